"""``python -m speccompat.matrix`` (also ``python -m speccompat.evidence``): check or ``--write``
``compat_matrix.yaml``, the README's tables and ``evidence/hot_path.json`` against ``evidence/``, and
the release watch (``--watch``, :mod:`speccompat.watch`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .freshness import HOT_PATH_FILE, hot_path_state
from .generate import generate, to_yaml
from .tables import with_readme_table

DESCRIPTION = "compat_matrix.yaml: which (speculators, vLLM) cells are supported, and how that was shown."


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m speccompat.matrix", description=DESCRIPTION)
    ap.add_argument("--evidence", default="evidence", help="evidence folder (default: ./evidence)")
    ap.add_argument("--out", default="compat_matrix.yaml")
    ap.add_argument("--readme", default="README.md", help="README whose support table is kept in sync")
    ap.add_argument("--write", action="store_true", help="write the files (default: check them)")
    watch = ap.add_argument_group("release watch", "--watch: releases on the package index newer than the "
                                  "evidence knows, checked statically (see speccompat.watch); with --write their "
                                  "results join evidence/static/releases.json and the files are regenerated. "
                                  "Exit 0 nothing new, 1 something new, 2 the index or sources unavailable")
    watch.add_argument("--watch", action="store_true", help="ask the package index for new vLLM/speculators releases")
    watch.add_argument("--sources", type=Path, help="folder of existing <V>/vllm trees (no download)")
    watch.add_argument("--wheels", type=Path, help="folder of downloaded vLLM wheels (<V>/*.whl or *.whl)")
    watch.add_argument("--speculators-sources", type=Path, help="folder of <S>/speculators trees (no download)")
    watch.add_argument("--index-versions", type=Path, metavar="JSON",
                       help="{distribution: [versions]} read instead of asking the index (offline runs)")
    args = ap.parse_args(argv)
    if args.watch:
        return _watch(args)
    return _check_or_write(args)


def _watch(args: Any) -> int:
    from pathlib import Path

    from .. import watch as w

    evidence = Path(args.evidence)
    try:
        index = w.index_versions
        if args.index_versions is not None:
            try:
                listing = json.loads(args.index_versions.read_text())
            except ValueError as exc:
                raise w.WatchError(f"{args.index_versions}: not JSON ({exc})") from None
            bad = ([] if isinstance(listing, dict) else [None]) or [
                d for d, v in listing.items() if not isinstance(v, list) or not all(isinstance(x, str) for x in v)]
            if bad:
                raise w.WatchError(f"{args.index_versions}: expected a JSON object {{distribution: [version strings]}}"
                                   + (f"; {', '.join(map(repr, bad))} is not a list of strings" if bad != [None] else ""))
            index = lambda dist: listing.get(dist, [])  # noqa: E731
        w.read_listed(evidence / "static" / "releases.json")  # before scripts/static_check.py reads it
        sc = w.load_static_check(evidence.resolve().parent)
        report = w.watch(evidence / "static" / "releases.json", sc, index=index, sources=args.sources,
                         wheels=args.wheels, speculators_sources=args.speculators_sources, write=args.write)
    except (w.WatchError, OSError, ValueError) as exc:
        print(f"release watch: {exc}", file=sys.stderr)
        return w.EXIT_TROUBLE
    if report.written:
        _check_or_write(args, quiet=True)
        report.written += [args.out, args.readme, str(evidence / Path(HOT_PATH_FILE).name)]
    print(report.summary(sc))
    return report.exit_code()


def _check_or_write(args: Any, quiet: bool = False) -> int:
    from pathlib import Path

    code = hot_path_state(Path(args.evidence).resolve().parent)  # once: the matrix and evidence/hot_path.json
    m = generate(Path(args.evidence), code)
    out, readme = Path(args.out), Path(args.readme)
    want = {out: to_yaml(m), readme: with_readme_table(readme.read_text(), m),
            Path(args.evidence) / Path(HOT_PATH_FILE).name: json.dumps(code, indent=1) + "\n"}
    if args.write:
        for path, text in want.items():
            path.write_text(text)
            if not quiet:
                print(f"wrote {path}")
        return 0
    stale = [str(p) for p, text in want.items() if not p.exists() or p.read_text() != text]
    if stale:
        print(f"{', '.join(stale)} differ(s) from what {args.evidence}/ shows; run with --write", file=sys.stderr)
        return 1
    print(f"{out} and {readme} agree with {args.evidence}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
