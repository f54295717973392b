"""The old path of :mod:`speccompat.dataset.parallel` (several engines for one extraction), kept so
that ``import speccompat.parallel`` and ``from speccompat.parallel import ...`` still work: the
name is the very same module object, so a patch of one is a patch of the other."""

from __future__ import annotations

import sys

from speccompat.dataset import parallel as _parallel

sys.modules[__name__] = _parallel
