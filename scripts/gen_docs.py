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


#: The environment variables speccompat reads (see ``speccompat.api`` and ``speccompat.generator``).
SETTINGS = """## Settings

| variable | effect |
|---|---|
| `SPECCOMPAT_STRICT=1` | like `apply(strict=True)`: no adapter or no matrix row is an error, and so is a capture step whose token ids cannot be verified |
| `SPECCOMPAT_VLLM_VERSION=0.24.0` | the release a vLLM build really is, when its version string is odd (the live probe still decides; the adapter it confirms is the one every process uses) |
| `SPECCOMPAT_LOG_LEVEL=WARNING` | level of the `speccompat` logger |
| `SPECCOMPAT_IN_FLIGHT=1` | steps the generator's engine loop keeps submitted: 1 collects each step before scheduling the next; the default (2 on GPUs from vLLM 0.11.1; 1 on CPUs, where the driver would compete with the forward for the cores) schedules and sends the next step while one runs |
| `SPECCOMPAT_GENERATE=call` | how `generate()` with copies runs: `stream` on top of `speccompat.generator.stream` (each sequence copied out as soon as its last step ran; the default on GPUs), `call` one engine call copied out after the loop (the default on CPUs) |
| `SPECCOMPAT_DISABLE=generator.generate,worker.` | leave patches out (ids, or prefixes ending in `.`), e.g. to reproduce a bug; an item that names no patch is an error (`PatchError`, naming it). Workers are still checked unless `worker._speccompat_info` itself is left out |

speccompat logs through the standard `logging` module under the `speccompat` logger (a `NullHandler`,
propagating): where the application configured logging, its handlers receive speccompat's records.
Only while the root logger has no handler at all does speccompat print its INFO lines to stderr itself.

`apply()` belongs before `import speculators`; after it, it patches the modules already imported,
provided that import succeeded. Where vLLM is missing or unsupported, `apply()` still applies
speculators' import fixes and warns, naming what is missing; `apply(strict=True)` raises instead.
`revert()` restores every replaced object in the driver process and stops new worker processes from
applying; workers already running keep their patches until their executor shuts down.
"""


def render() -> str:
    from speccompat.patches import GROUPS
    from speccompat.registry import adapter_modules, by_name, fingerprint

    out = [
        "# Patches and adapters",
        "",
        "Generated from the code by `python scripts/gen_docs.py`; `speccompat doctor` shows which apply "
        "to the installed versions.",
        "",
        SETTINGS,
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
