"""docs/patches.md is generated from the patches and adapters and kept current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_patch_docs_are_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_patch_and_change_names_its_upstream(monkeypatch):
    import importlib.util

    from speccompat.adapter import upstream_problem
    from speccompat.patches import GROUPS
    from speccompat.registry import all_adapters

    records = [p.upstream for g in GROUPS.values() for p in g]
    records += [c.upstream for a in all_adapters() for c in vars(a).get("changes", ())]
    assert len(records) >= 18 + 20 and all(upstream_problem(u) is None for u in records)
    assert upstream_problem("") and upstream_problem("none") and upstream_problem("see PR 12")
    # The docs check refuses a record without one, naming it.
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    gen_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_docs)
    first = next(iter(GROUPS.values()))
    monkeypatch.setitem(GROUPS, next(iter(GROUPS)), [first[0]._replace(upstream=""), *first[1:]])
    assert gen_docs.missing_upstream() == [f"patch {first[0].id}: upstream '' is neither a GitHub PR/issue URL "
                                           "nor 'none: <why>'"]
