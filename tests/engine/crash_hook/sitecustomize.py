"""A crash at a chosen point of a driver run, for the kill-and-resume tests.

Python imports this module (as ``sitecustomize``) at the start of every process whose PYTHONPATH
holds this folder. It acts only when ``SPECCOMPAT_TEST_CRASH_AFTER`` is set and the process's command
line holds ``SPECCOMPAT_TEST_CRASH_ARGV`` (its words, in a row): then, once the data-set
writer of that process has committed at least ``SPECCOMPAT_TEST_CRASH_AFTER`` samples (files renamed
into place, manifest entries fsynced), the process sends SIGKILL to itself, or to its whole process
group (engine included) with ``SPECCOMPAT_TEST_CRASH_GROUP=1``.

A test that polls the output folder and kills from outside can miss the moment on a busy machine (the
streaming driver may finish a shard between two polls); this crash happens mid-run every time."""

import os
import sys


def _install() -> None:
    after = os.environ.get("SPECCOMPAT_TEST_CRASH_AFTER")
    if not after:
        return
    words = " ".join(os.environ.get("SPECCOMPAT_TEST_CRASH_ARGV", "").split())
    # a spawned engine process's command line is multiprocessing's bootstrap: it never holds the words
    if f" {words} " not in f" {' '.join(sys.argv)} ":
        return
    import signal
    import threading

    from speccompat.dataset.writer import DatasetWriter

    limit, group = int(after), os.environ.get("SPECCOMPAT_TEST_CRASH_GROUP") == "1"
    committed, lock = [0], threading.Lock()
    original = DatasetWriter._commit

    def _commit(self, batch):  # type: ignore[no-untyped-def]
        original(self, batch)
        with lock:
            committed[0] += len(batch.done)
            if committed[0] >= limit:
                sys.stderr.write(f"crash hook: SIGKILL after {committed[0]} committed sample(s)\n")
                sys.stderr.flush()
                if group:
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    DatasetWriter._commit = _commit


_install()
