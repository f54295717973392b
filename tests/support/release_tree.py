"""A copy of the repository as far as the release list reaches, plus an installed-like site."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOX_STUB = '''
"""Records what noxfile.py declares (the sessions and their parameters), as nox -l would list them."""
SESSIONS = []
class options:
    sessions = []
    reuse_existing_virtualenvs = False
class Session:
    pass
def parametrize(names, values, ids=None):
    def mark(fn):
        fn.__nox_params__ = ids or [", ".join(map(str, v if isinstance(v, (list, tuple)) else [v])) for v in values]
        return fn
    return mark
def session(fn=None, **kw):
    def register(f):
        name = kw.get("name") or f.__name__
        params = getattr(f, "__nox_params__", None)
        SESSIONS.extend([f"{name}({p})" for p in params] if params else [name])
        return f
    return register(fn) if fn is not None else register
'''


def release_tree(tmp: Path) -> Path:
    """A copy of the repository as far as the release list reaches, plus an installed-like site."""
    repo = tmp / "repo"
    (repo / "speccompat").mkdir(parents=True)
    for f in (REPO / "speccompat").iterdir():
        if f.name not in ("__pycache__", "compat_matrix.yaml"):
            (repo / "speccompat" / f.name).symlink_to(f)
    (repo / "speccompat" / "compat_matrix.yaml").symlink_to("../compat_matrix.yaml")
    (repo / "adapters").mkdir()
    for f in (REPO / "adapters").glob("*.py"):
        (repo / "adapters" / f.name).symlink_to(f)
    (repo / "evidence" / "static").mkdir(parents=True)
    shutil.copy(REPO / "evidence" / "static" / "releases.json", repo / "evidence" / "static")
    shutil.copy(REPO / "evidence" / "hot_path.json", repo / "evidence")
    for sub in ("cpu", "gpu"):
        (repo / "evidence" / sub).symlink_to(REPO / "evidence" / sub)
    (repo / "scripts").mkdir()
    for name in ("compat_matrix.yaml", "README.md", "noxfile.py", "scripts/static_check.py"):
        shutil.copy(REPO / name, repo / name)
    site = tmp / "site"  # what `pip install` of this tree would give: speccompat + speccompat.adapters
    site.mkdir()
    import packaging
    import wrapt

    for mod in (packaging, wrapt):
        (site / Path(mod.__file__).parent.name).symlink_to(Path(mod.__file__).parent)
    (site / "speccompat").mkdir()
    for f in (repo / "speccompat").iterdir():
        (site / "speccompat" / f.name).symlink_to(f.resolve() if f.name != "compat_matrix.yaml" else repo / f.name)
    (site / "speccompat" / "adapters").symlink_to(repo / "adapters")
    dist = site / "speccompat-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speccompat\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nspeccompat = speccompat.plugin:register\n")
    (tmp / "nox").mkdir()
    (tmp / "nox" / "nox.py").write_text(NOX_STUB)
    return repo
