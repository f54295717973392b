#!/usr/bin/env python3
"""Write docs/patches.md from the code: every patch and every adapter's recorded vLLM changes.

    python scripts/gen_docs.py          # write
    python scripts/gen_docs.py --check  # exit 1 if the file is stale (a test runs this)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "patches.md"


def render() -> str:
    from speccompat.patches import GROUPS
    from speccompat.registry import adapter_modules, by_name, fingerprint

    out = [
        "# Patches and adapters",
        "",
        "Generated from the code by `python scripts/gen_docs.py`; `speccompat doctor` shows which apply "
        "to the installed versions.",
        "",
        "## Patches (names in speculators' modules, and speculators' methods)",
        "",
        "Each patch replaces one attribute of speculators; vLLM's modules are never modified. Patches of "
        "one module are applied together or not at all, when that module is imported.",
        "",
    ]
    for module, group in GROUPS.items():
        out += [f"### `{module}`", ""]
        for p in group:
            out += [
                f"#### `{p.id}` -> `{p.target}`" + (" (optional)" if p.optional else "") + (" (added)" if p.adds else ""),
                "",
                f"- **Why**: {p.why}",
                f"- **How**: {p.how}",
                f"- **vLLM change**: {p.vllm_change}",
                f"- **Remove when**: {p.remove_when}",
                f"- **Upstream**: {p.upstream}",
                "",
            ]
    from speccompat.api import REMOVED_NAMES

    out += ["## Names removed upstream", "",
            "Served from `speccompat.stand_ins` to the module that imports them, only while the library "
            "lacks them (a scoped `__import__`; the library itself is not modified):", ""]
    for module, redirects in REMOVED_NAMES.items():
        for (mod, name), home in redirects.items():
            doc = (getattr(__import__(home, fromlist=[name]), name).__doc__ or "").strip().splitlines()[0]
            out.append(f"- `{mod}.{name}` for `{module}` -> `{home}`: {doc}")
    out += ["", "## Adapters (one per vLLM release range, oldest first)", ""]
    mods = adapter_modules()
    for i, (since, name) in enumerate(mods):
        a = by_name(name)
        until = f"< {mods[i + 1][0]}" if i + 1 < len(mods) else "and later (nightlies: by fingerprint)"
        doc = (a.__module__ and sys.modules[a.__module__].__doc__ or "").strip().splitlines()[0]
        out += [f"### `{name}`: vLLM >= {since}, {until}", "", doc, ""]
        for c in vars(a).get("changes", ()):
            out += [
                f"- **vLLM {c.vllm}**: {c.what}",
                f"  - breaks: {c.breaks}",
                f"  - handled: {c.how}",
                f"  - remove when: {c.remove_when}",
                f"  - upstream: {c.upstream}",
            ]
        fp = fingerprint(a)  # its requires + the next adapter's new symbols, required absent
        out += ["", f"Fingerprint ({len(fp)} symbols): " + ", ".join(f"`{s.describe()}`" for s in fp.values()), ""]
    return "\n".join(out)


def missing_upstream() -> list[str]:
    """Every patch and adapter change whose ``upstream`` is not a PR/issue URL or ``"none: <why>"``."""
    from speccompat.adapter import upstream_problem
    from speccompat.patches import GROUPS
    from speccompat.registry import all_adapters

    out = [f"patch {p.id}: {upstream_problem(p.upstream)}" for group in GROUPS.values() for p in group
           if upstream_problem(p.upstream)]
    for a in all_adapters():
        out += [f"{a.name()} change (vLLM {c.vllm}) {c.what[:60]!r}...: {upstream_problem(c.upstream)}"
                for c in vars(a).get("changes", ()) if upstream_problem(c.upstream)]
    return out


def main() -> int:
    bad = missing_upstream()
    if bad:
        print("records without an upstream link:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
