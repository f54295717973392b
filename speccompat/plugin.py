"""vLLM general plugin: re-apply speccompat in every vLLM process (workers included).

vLLM calls :func:`register` in each process it starts (engine core, spawned or forked workers)
before it resolves ``worker_extension_cls``. It may be called many times; it only acts when the
driver armed speccompat (``SPECCOMPAT_APPLY`` in the environment), so installing speccompat
changes nothing for programs that do not call ``speccompat.apply()``.
"""

from __future__ import annotations

import json
import logging
import os

__all__ = ["register"]


def register() -> None:
    settings = os.environ.get("SPECCOMPAT_APPLY")
    if not settings:
        return
    try:
        strict = bool(json.loads(settings).get("strict", False))
    except ValueError:
        strict = False
    from .api import apply

    try:
        apply(strict=strict)
    except Exception:
        logging.getLogger("speccompat").exception("speccompat could not be applied in this vLLM process")
        if strict:
            raise
