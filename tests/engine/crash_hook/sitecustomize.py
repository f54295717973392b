"""A crash at a chosen point of a driver run, for the kill-and-resume tests.

Python imports this module (as ``sitecustomize``) at the start of every process whose PYTHONPATH
holds this folder. It acts only when ``SPECCOMPAT_TEST_CRASH_AFTER`` (N) is set and the process's
command line holds ``SPECCOMPAT_TEST_CRASH_ARGV`` (its words, in a row): when the data-set writer of
that process is handed sample N+1, it waits until the first N are committed (files renamed into
place, manifest entries fsynced), then the process sends SIGKILL to itself, or to its whole process
group (engine included) with ``SPECCOMPAT_TEST_CRASH_GROUP=1``: exactly N samples are in the data
set, the engine had more in flight.

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
    import time

    from speccompat.dataset.writer import DatasetWriter

    limit, group = int(after), os.environ.get("SPECCOMPAT_TEST_CRASH_GROUP") == "1"
    submitted, lock = [0], threading.Lock()
    original = DatasetWriter.submit

    def submit(self, jobs):  # type: ignore[no-untyped-def]
        with lock:
            before = submitted[0]
            submitted[0] += len(jobs)
        if before >= limit:  # the first `limit` samples are queued: wait until they are committed
            while self.stats.files < limit and self.error is None:
                time.sleep(0.01)
            sys.stderr.write(f"crash hook: SIGKILL after {self.stats.files} committed sample(s)\n")
            sys.stderr.flush()
            if group:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, jobs)

    DatasetWriter.submit = submit


_install()
