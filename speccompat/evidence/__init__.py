"""Dev tooling: the evidence behind ``compat_matrix.yaml``, and the files made from it.

- :mod:`.capture_path`: the files a run of a release runs and their hashes (``HOT_PATH``,
  ``release_capture_path``, ``code_record``);
- :mod:`.freshness`: whether a run on record ran today's capture path (``hot_path_state``, ``is_stale``);
- :mod:`.generate`: the matrix made from ``evidence/`` and its YAML text;
- :mod:`.tables`: the README's support and architectures tables;
- :mod:`.cli`: ``python -m speccompat.matrix [--write] [--watch]`` (or ``python -m speccompat.evidence``).

The core reads the generated file through :mod:`speccompat.matrix` and imports none of these.
"""
