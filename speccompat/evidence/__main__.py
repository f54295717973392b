"""``python -m speccompat.evidence``: the same command as ``python -m speccompat.matrix``."""

import sys

from .cli import main

sys.exit(main())
