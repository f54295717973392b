"""Worker processes: vLLM's general-plugin entry point re-applies speccompat under spawn and fork."""

from __future__ import annotations

import json

import pytest
from support.fakes import release_facts, write_fake_speculators, write_fake_vllm


@pytest.fixture
def fake_world(tmp_path):
    write_fake_vllm(tmp_path, release_facts("0.32.0"), version="0.32.0")
    write_fake_speculators(tmp_path, "0.4.0.1")
    return [tmp_path]


CHILD = """
import json, multiprocessing as mp, os, sys

def child(queue):
    # What vLLM's load_general_plugins() does in every process it starts.
    from importlib.metadata import entry_points
    for ep in entry_points(group="vllm.general_plugins"):
        ep.load()()
    from speculators.data_generation.custom_worker import HiddenStatesWorkerExtension as E
    import speccompat
    queue.put(json.dumps([os.getpid(), hasattr(E, "_speccompat_info"),
                          E._setup_hidden_states_capture.__name__, speccompat.status().state]))

if __name__ == "__main__":
    import speccompat
    if sys.argv[1] == "apply":
        speccompat.apply()
    import speculators.data_generation.custom_worker  # the driver has it loaded too
    ctx = mp.get_context(sys.argv[2])
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start(); p.join(60)
    print(q.get(timeout=5))
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("driver_applied", [True, False])
def test_workers_follow_the_driver(tmp_path, py, fake_world, method, driver_applied):
    """Patched in the worker when the driver applied (the plugin re-applies under spawn; fork
    inherits), untouched when it did not."""
    script = tmp_path / "driver.py"
    script.write_text(CHILD)
    arg = "apply" if driver_applied else "no"
    out = py(f"import runpy, sys; sys.argv = ['driver', '{arg}', '{method}']; runpy.run_path('{script}', run_name='__main__')",
             path=fake_world).stdout.splitlines()[-1]
    pid, has_info, setup_name, state = json.loads(out)
    if driver_applied:
        assert has_info and setup_name == "setup_hidden_states_capture" and state == "active"
    else:
        assert not has_info and setup_name == "_setup_hidden_states_capture" and state == "inactive"


def test_plugin_is_safe_to_load_many_times(py, fake_world):
    out = py(
        """
        import json, speccompat
        from speccompat import plugin, patching
        speccompat.apply()
        import speculators.data_generation.custom_worker
        n = len(patching.applied_ids())
        for _ in range(5):
            plugin.register()
        print(json.dumps([n, len(patching.applied_ids())]))
        """,
        path=fake_world,
    ).stdout.splitlines()[-1]
    n, m = json.loads(out)
    assert n == m > 0
