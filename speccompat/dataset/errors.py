"""Errors of the data-set machinery, each with the exit status a driver should return."""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REJECTED", "DatasetError", "NoSpace",
           "Rejected", "WriterFailed"]

#: every sample has its file
EXIT_OK = 0
#: some samples failed, the engine failed, or the disk filled up: finished files are kept, re-run to resume
EXIT_FAILED = 1
#: refused before any engine started (input, layer ids, output directory, provenance, disk space)
EXIT_REJECTED = 2
#: interrupted (Ctrl-C); finished files are kept
EXIT_INTERRUPTED = 130


class DatasetError(Exception):
    """Base class; ``exit_status`` is what a driver returns for it."""

    exit_status = EXIT_FAILED


class Rejected(DatasetError):
    """The run cannot start; the message says why and what to do. Nothing was started or written."""

    exit_status = EXIT_REJECTED


class WriterFailed(DatasetError):
    """The background writer stopped (an I/O error); files finished before it are kept."""


class NoSpace(WriterFailed):
    """The output file system is full (ENOSPC, or the quota is exhausted)."""
