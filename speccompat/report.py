"""The structured report returned by ``speccompat.status()`` and printed by ``speccompat doctor``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .patches import GROUPS

__all__ = ["Status", "build_status"]


@dataclass
class Status:
    state: str  # inactive | unsupported | armed | active | error
    vllm: dict[str, Any]
    speculators: dict[str, Any]
    adapter: str | None
    selection: str
    probe: str
    mismatches: list[str]
    matrix_row: dict[str, Any] | None
    patches: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "vllm": self.vllm,
            "speculators": self.speculators,
            "adapter": self.adapter,
            "selection": self.selection,
            "probe": self.probe,
            "mismatches": self.mismatches,
            "matrix_row": self.matrix_row,
            "patches": self.patches,
            "changes": self.changes,
            "warnings": self.warnings,
            "errors": self.errors,
            "workers": self.workers,
        }

    def __str__(self) -> str:
        lines = [
            f"speccompat: {self.state}",
            f"  vLLM        {_pkg(self.vllm)}",
            f"  speculators {_pkg(self.speculators)}",
            f"  adapter     {self.adapter or '-'}" + (f" ({self.selection})" if self.selection else ""),
            f"  probe       {self.probe}",
        ]
        lines += [f"    mismatch: {m}" for m in self.mismatches]
        if self.matrix_row:
            r = self.matrix_row
            # a run of older capture code says so, as compat_matrix.yaml and the README table do
            ev = ", ".join(f"{e['kind']} {e['date']}" + (" stale" if str(e.get("stale")).lower() == "true" else "")
                           for e in r.get("evidence", []))
            lines.append(f"  matrix row  {r['speculators']} x vLLM {r['vllm']}: {r['status']} [{ev}]")
        else:
            lines.append("  matrix row  none")
        for p in self.patches:
            reason = f" - {p['reason']}" if p.get("reason") else ""
            lines.append(f"  [{p['state']:>7}] {p['id']}{reason}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def _pkg(d: dict[str, Any]) -> str:
    if not d.get("raw"):
        return "not installed"
    dist = f" ({d['dist']})" if d.get("dist") and d["dist"] != "speculators" else ""
    src = f" [{d['source']}]" if d.get("source") not in (None, "metadata") else ""
    return f"{d['raw']}{dist}{src}"


def _pkg_dict(inst: Any) -> dict[str, Any]:
    if inst is None:
        return {"raw": None}
    return {
        "raw": inst.raw,
        "dist": inst.dist,
        "source": inst.source,
        "dev": inst.is_dev,
    }


def build_status(state: Any) -> Status:
    patches = []
    for module, group in GROUPS.items():
        for p in group:
            o = state.outcomes.get(p.id)
            if o is not None:
                patches.append(o.as_dict())
            elif state.armed and module.endswith(".custom_worker") and state.workers:
                pids = ", ".join(str(w["pid"]) for w in state.workers)
                patches.append({"id": p.id, "target": p.target, "state": "applied",
                                 "reason": f"in the worker processes (pid {pids}), checked by RPC"})
            elif state.armed:
                patches.append({"id": p.id, "target": p.target, "state": "pending",
                                "reason": f"{module} not imported yet"})
    listed = {p["id"] for p in patches}
    patches += [o.as_dict() for pid, o in state.outcomes.items() if pid not in listed]
    if not state.armed:
        st = "unsupported" if state.warnings else "inactive"
    elif state.errors or state.probe == "failed" or any(p["state"] == "failed" for p in patches):
        st = "error"
    elif state.adapter is not None:
        st = "active"
    else:
        st = "armed"
    adapter_cls = type(state.adapter) if state.adapter is not None else state.adapter_cls
    return Status(
        state=st,
        vllm=_pkg_dict(state.vllm),
        speculators=_pkg_dict(state.speculators),
        adapter=state.adapter_name,
        selection=state.selection or ("by version; probe pending" if state.adapter_cls else ""),
        probe=state.probe,
        mismatches=list(state.mismatches),
        matrix_row=state.row.as_dict() if state.row is not None else None,
        patches=patches,
        changes=[c.as_dict() for c in adapter_cls.history()] if adapter_cls is not None else [],
        warnings=list(state.warnings),
        errors=list(state.errors),
        workers=list(state.workers),
    )
