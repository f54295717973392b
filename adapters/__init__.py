"""speccompat.adapters: one module per range of vLLM releases.

A module ``vllm_X_Y_Z`` defines ``Adapter``, serving vLLM ``X.Y.Z`` up to (not including) the next
module's release. It subclasses the previous module's ``Adapter`` and overrides only what vLLM
changed, recording each change (``Change``: what, what breaks, how it is handled, when the code can
go) and the fingerprint of symbols it relies on. Modules are discovered by name; adding a release
means adding one module here and one row in ``compat_matrix.yaml``.

This folder is the ``adapters/`` directory of the repository, installed as ``speccompat.adapters``
(it never claims the top-level import name ``adapters``).
"""
