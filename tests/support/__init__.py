"""What the test modules share: fake models, results and releases, data sets written as the driver
writes them, children that run speculators' own trainers. Test modules import from here, never
from one another or from ``conftest`` (tests/test_test_imports.py checks it)."""
