"""Import hooks: callbacks around a module's execution, and scoped import redirects."""

from __future__ import annotations


def test_before_and_after_run_around_the_module_body(tmp_path, py):
    (tmp_path / "sc_watched.py").write_text("ORDER.append('body')\nVALUE = 1\n")
    out = py(
        """
        import builtins
        from speccompat import importhooks
        builtins.ORDER = []
        importhooks.watch("sc_watched", before=lambda m: ORDER.append("before"),
                          after=lambda m: ORDER.append(("after", m.VALUE)))
        import sc_watched
        print(ORDER)
        # no trace left on the loaded module
        print(type(sc_watched.__loader__).__name__, type(sc_watched.__spec__.loader).__name__)
        importhooks.unwatch_all()
        import sys
        print(any(type(f).__name__ == "_Finder" for f in sys.meta_path))
        """,
        path=[tmp_path],
    ).stdout.splitlines()
    assert out[0] == "['before', 'body', ('after', 1)]"
    assert out[1] == "SourceFileLoader SourceFileLoader"
    assert out[2] == "False"


def test_redirect_serves_moved_names_without_touching_the_old_module(tmp_path, py):
    pkg = tmp_path / "sc_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "old.py").write_text("def kept():\n    return 'kept'\n")
    (pkg / "new.py").write_text("def moved():\n    return 'moved'\n")
    (tmp_path / "sc_user.py").write_text("from sc_lib.old import kept, moved\nfrom sc_lib.gone import thing\n")
    out = py(
        """
        from speccompat import importhooks
        redirects = {("sc_lib.old", "moved"): "sc_lib.new", ("sc_lib.gone", "thing"): "sc_lib.new"}
        import sc_lib.new
        sc_lib.new.thing = "thing from new"
        importhooks.watch("sc_user", before=lambda m: setattr(m, "__builtins__", importhooks.redirecting_builtins(redirects)))
        import sc_user, sc_lib.old
        print(sc_user.kept(), sc_user.moved(), sc_user.thing)
        print(hasattr(sc_lib.old, "moved"))
        """,
        path=[tmp_path],
    ).stdout.splitlines()
    assert out == ["kept moved thing from new", "False"]


def test_redirect_does_not_hide_real_import_errors(tmp_path, py):
    (tmp_path / "sc_user2.py").write_text("from sc_nowhere import x\n")
    proc = py(
        """
        from speccompat import importhooks
        importhooks.watch("sc_user2", before=lambda m: setattr(m, "__builtins__",
                          importhooks.redirecting_builtins({("sc_other", "y"): "json"})))
        import sc_user2
        """,
        path=[tmp_path],
        check=False,
    )
    assert proc.returncode != 0 and "No module named 'sc_nowhere'" in proc.stderr
