"""The README's tables made from the matrix: the support table (:func:`readme_table`) and the
architectures table (:func:`architectures_table`), kept between their markers by
:func:`with_readme_table`. Dev tooling: nothing of the core imports it.
"""

from __future__ import annotations

from ..matrix import Matrix, Row

README_START = "<!-- matrix-table:start -->"
README_END = "<!-- matrix-table:end -->"


def readme_table(m: Matrix) -> str:
    """The support matrix as a Markdown table: runs of releases with identical cells collapsed."""

    def cell(row: Row | None) -> str:
        if row is None:
            return "-"
        shown = []
        for k in ("cpu-e2e", "gpu-e2e"):
            for stale in (False, True):  # a supported cell lists its stale runs apart
                ev = [e for e in row.evidence if e["kind"] == k and (e.get("stale") == "true") == stale]
                models = sorted({m.strip() for e in ev for m in e.get("models", "").split(",") if m.strip()})
                tps = sorted({int(tp) for e in ev for tp in e.get("tp", "1").split(",")})
                twins = sorted({e["identical_to"] for e in ev if "identical_to" in e})
                if models:
                    shown.append(f"{k}{' stale' if stale and row.status == 'supported' else ''}: {', '.join(models)}"
                                 + (f" at TP {', '.join(map(str, tps))}" if tps != [1] else "")
                                 + (f" (code identical to {', '.join(twins)})" if twins else ""))
        if row.status == "supported":
            return "**supported** (" + "; ".join(shown) + ")"
        if row.status == "stale":
            return "stale (" + "; ".join(shown) + ")"
        return row.status

    by_cell = {(r.speculators, r.vllm): r for r in m.rows}
    lines = ["| vLLM | adapter | " + " | ".join(f"speculators {s}" for s in m.speculators) + " |",
             "|---|---|" + "---|" * len(m.speculators)]
    runs: list[tuple[list[str], str, list[str]]] = []
    for rel in m.releases:
        rows = [by_cell.get((s, rel)) for s in m.speculators]
        adapter = next((r.adapter for r in rows if r is not None), "-")
        cells = [cell(r) for r in rows]
        # consecutive releases of one adapter whose cells read the same share a row (each release in it
        # has its own evidence of that kind: compat_matrix.yaml lists them)
        if runs and runs[-1][1] == adapter and runs[-1][2] == cells:
            runs[-1][0].append(rel)
        else:
            runs.append(([rel], adapter, cells))
    for rels, adapter, cells in runs:
        span = rels[0] if len(rels) == 1 else f"{rels[0]} - {rels[-1]} ({len(rels)} releases)"
        lines.append(f"| {span} | {adapter} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


ARCH_START = "<!-- architectures-table:start -->"
ARCH_END = "<!-- architectures-table:end -->"


def _spans(releases: list[str], known: list[str]) -> str:
    """Releases as runs of consecutive known releases: ``0.29.0 - 0.32.0 (5 releases), 0.33.0``."""
    idx = sorted(known.index(r) for r in releases if r in known)
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [known[r[0]] if len(r) == 1 else f"{known[r[0]]} - {known[r[-1]]} ({len(r)} releases)" for r in runs]
    return ", ".join(parts + sorted(r for r in releases if r not in known))


def architectures_table(m: Matrix) -> str:
    """The architectures as a Markdown table: per architecture, the releases it is proven on (CPU,
    GPU) and those where parity failed or the engine refused it (with the reason)."""
    lines = ["| architecture | proven on CPU | proven on GPU | passed on older capture code (stale) "
             "| accepted by convention (declared, not run) | not proven |",
             "|---|---|---|---|---|---|"]
    for arch in sorted({a["architecture"] for a in m.architectures}):
        mine = [a for a in m.architectures if a["architecture"] == arch]
        runs = [a for a in mine if a["outcome"] != "accepted"]

        def spans(platform: str, outcome: str, runs: list = runs) -> str:
            rels = [a["vllm"] for a in runs if a["platform"] == platform and a["outcome"] == outcome]
            return _spans(rels, m.releases) if rels else ""

        stale = "; ".join(f"{p}: {t}" for p in ("cpu", "gpu") if (t := spans(p, "stale")))
        accepted = "; ".join(_spans(a["vllm"], m.releases) for a in mine if a["outcome"] == "accepted")
        other = [f"{a['outcome']} on {a['platform']} {a['vllm']}" + (f": {a['reason']}" if a.get("reason") else "")
                 for a in runs if a["outcome"] not in ("proven", "stale")]
        lines.append(f"| {arch} | {spans('cpu', 'proven') or '-'} | {spans('gpu', 'proven') or '-'} | {stale or '-'} "
                     f"| {accepted or '-'} | {'; '.join(other) or '-'} |")
    return "\n".join(lines)


def with_readme_table(readme: str, m: Matrix) -> str:
    start, end = readme.index(README_START) + len(README_START), readme.index(README_END)
    readme = readme[:start] + "\n" + readme_table(m) + "\n" + readme[end:]
    if ARCH_START in readme:
        start, end = readme.index(ARCH_START) + len(ARCH_START), readme.index(ARCH_END)
        readme = readme[:start] + "\n" + architectures_table(m) + "\n" + readme[end:]
    return readme
