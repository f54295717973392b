"""Patches of ``speculators.utils.pydantic_utils``."""

from __future__ import annotations

from typing import Any

from ..patching import Patch
from ._common import NEVER_REMOVE, PYDANTIC_MODULE

__all__ = ["PYDANTIC"]

PYDANTIC = (
    Patch(
        id="pydantic.reload_schema",
        upstream="none: a pydantic >= 2.13 / transformers 5 interaction, no upstream report found",
        target=f"{PYDANTIC_MODULE}:ReloadableBaseModel.reload_schema",
        why="with pydantic >= 2.13 (and transformers 5) `import speculators` fails: "
        "PydanticUndefinedAnnotation: name 'torch' is not defined, raised by "
        "reload_and_populate_configs() -> ReloadableBaseModel.reload_schema()",
        how="model_rebuild(force=True) is given _types_namespace={'torch': torch}",
        vllm_change="none (pydantic/transformers); vLLM >= 0.30 pulls in the versions that trigger it",
        remove_when=NEVER_REMOVE,
        build=lambda ctx, original: classmethod(_reload_schema),
    ),
)


def _reload_schema(cls: Any) -> None:
    import torch

    cls.model_rebuild(force=True, _types_namespace={"torch": torch})
