"""Every patch is either backed by a control test - the same check run with the patch left out
(``SPECCOMPAT_DISABLE``) showing the defect returns - or exempt, with the reason no control runs.

A new patch must be added to one of the two tables; a control must exist and must disable the patch.
"""

from __future__ import annotations

import ast
from pathlib import Path

from speccompat.patches import GROUPS

REPO = Path(__file__).resolve().parent.parent
SILENT = "tests/engine/test_silent_bugs.py"

#: patch id -> (test file, control test): the test runs with the patch disabled and asserts the defect.
CONTROLS = {
    "generator.generate": (SILENT, "test_control_without_the_fix_sequences_beyond_32_are_lost"),
    "worker._setup_hidden_states_capture": (SILENT, "test_control_without_the_fix_llama_4_scaling_is_dropped"),
    # The three worker patches are one capture: its control leaves all of them out ("worker.").
    "worker._reset_capture": (SILENT, "test_control_without_the_fix_llama_4_scaling_is_dropped"),
    "worker._get_captured_states": (SILENT, "test_control_without_the_fix_llama_4_scaling_is_dropped"),
    "worker._speccompat_info": ("tests/test_api.py", "test_disabling_the_worker_info_patch_skips_the_worker_check"),
}

_CRASH = ("without it speculators raises on the vLLM releases of the adapter changes it routes (a crash, not "
          "silent data); the static evidence records the changed signature per release")
#: patch id -> why no control test runs without it.
EXEMPT = {
    "pydantic.reload_schema": "without it `import speculators` raises PydanticUndefinedAnnotation with pydantic "
                              ">= 2.13: no test can run at all",
    "generator.VllmConfig": "routes vllm_config(): a control needs MLA on the CPU platform with the rotary op on, "
                            "which the parity tests of DeepseekV3/Kimi measure against the reference",
    "generator.CacheConfig": "vLLM's CPU attention rejects speculators' block_size=16 from 0.30 (a crash); "
                             "tests/test_adapters.py checks prefix caching is turned off",
    "generator.SchedulerConfig": _CRASH,
    "generator.get_kv_cache_config_from_groups": _CRASH,
    "generator.Scheduler": _CRASH,
    "generator.Request": _CRASH,
    "generator.MultiprocExecutor": _CRASH,
    "generator.mem_get_info": "without it speculators 0.4 sizes the KV cache at 0 blocks on CPU: the engine "
                              "cannot start (a crash)",
    "generator.torch": "without it speculators 0.3.0 raises 'Found no NVIDIA driver' on CPU (a crash)",
    "generator.AutoTokenizer": "without it loading a tokenizer with remote code raises (a crash)",
    "generator.__init__": "input validation: the unit tests give the bad layer ids it refuses",
    "generator.__del__": "an error at interpreter exit, after every result was returned",
}


def _patch_ids() -> list[str]:
    return [p.id for group in GROUPS.values() for p in group]


def _disabled_in(path: Path, name: str) -> set[str]:
    """The SPECCOMPAT_DISABLE entries the test function ``name`` in ``path`` runs with (from dict
    literals in its body, or module-level constants it names)."""
    tree = ast.parse(path.read_text())

    def entries(node: ast.AST) -> set[str]:
        out = set()
        for d in ast.walk(node):
            if isinstance(d, ast.Dict):
                for k, v in zip(d.keys, d.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == "SPECCOMPAT_DISABLE" and isinstance(v, ast.Constant):
                        out |= {e.strip() for e in v.value.split(",") if e.strip()}
        return out

    consts = {t.id: entries(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert fn is not None, f"{path.name} has no test {name}"
    found = entries(fn)
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id in consts:
            found |= consts[n.id]
    return found


def test_every_patch_has_a_control_or_an_exemption():
    ids = _patch_ids()
    assert len(ids) == len(set(ids)) == 18
    assert not set(CONTROLS) & set(EXEMPT)
    assert sorted(set(CONTROLS) | set(EXEMPT)) == sorted(ids)
    assert all(len(reason) > 30 for reason in EXEMPT.values())


def test_each_control_runs_without_its_patch():
    for pid, (file, name) in CONTROLS.items():
        disabled = _disabled_in(REPO / file, name)
        assert any(e == pid or (e.endswith(".") and pid.startswith(e)) for e in disabled), (pid, file, name, disabled)
        assert name.startswith(("test_control_without_the_fix_", "test_disabling_")), name


def test_the_disable_reader_sees_a_missing_disable(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("OFF = {'SPECCOMPAT_DISABLE': 'worker.'}\n"
                 "def test_a():\n    run(env=OFF)\n"
                 "def test_b():\n    run(env={'SPECCOMPAT_DISABLE': 'generator.generate, generator.Request'})\n"
                 "def test_c():\n    run()\n")
    assert _disabled_in(f, "test_a") == {"worker."}
    assert _disabled_in(f, "test_b") == {"generator.generate", "generator.Request"}
    assert _disabled_in(f, "test_c") == set()
