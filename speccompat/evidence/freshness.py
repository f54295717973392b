"""Evidence freshness: whether an end-to-end run ran the capture path its release has now.

:func:`hot_path_state` is the capture path now (its hash, the day it last changed, each release's
part, and what ``evidence/hot_path.json`` keeps for runs git cannot judge); :func:`is_stale` judges
one run against it. Dev tooling: nothing of the core imports it.
"""

from __future__ import annotations

import json
from typing import Any

from packaging.version import Version

from .capture_path import (
    HASH_SCHEME,
    hot_path_files,
    hot_path_sha256,
    release_capture_paths,
    release_sha256_at,
)


def run_release_sha256(run: dict[str, Any], code: dict[str, Any]) -> str | None:
    """The capture path of its release that an end-to-end run ran: the ``release_sha256`` its
    evidence recorded, else, for a run of an unmodified checkout (``commit``, ``hot_path_modified``
    false), the one derived at that commit (``code["runs"]``, from :func:`hot_path_state`), else, for a
    run that recorded the whole capture path's hash only, its release's capture path in that state
    (``code["states"]``); else None. Hashes of scheme 1 come back as :data:`HASH_SCHEME` reads them
    (:func:`translate`)."""
    rec = run.get("code") or {}
    if rec.get("release_sha256"):
        return translate(code, rec["release_sha256"])
    if rec.get("commit") and rec.get("hot_path_modified") is False:
        return ((code.get("runs") or {}).get(rec["commit"]) or {}).get(str(run.get("vllm")))
    # a run that recorded only the whole capture path's hash, of a state on record
    return translate(code, ((code.get("states") or {}).get(rec.get("hot_path_sha256") or "") or {}).get(
        str(run.get("vllm"))))


def translate(code: dict[str, Any], release_sha: str | None) -> str | None:
    """A release capture path hash recorded under hash scheme 1 as scheme :data:`HASH_SCHEME` reads the
    same code (``code["translated"]``, :func:`hot_path_state`); any other hash unchanged."""
    return (code.get("translated") or {}).get(release_sha, release_sha) if release_sha else release_sha


HOT_PATH_FILE = "evidence/hot_path.json"


def hot_path_state(root: Any) -> dict[str, Any]:
    """The capture path now: ``sha256`` (:func:`hot_path_sha256`) and ``last_change``, the day its
    files last changed - from git where ``root`` is a checkout (today when they differ from HEAD),
    else from ``evidence/hot_path.json`` when its hash is the current one, else today.

    Per release, for the releases with end-to-end evidence under ``evidence/cpu`` and ``gpu``:
    ``releases`` {vLLM release: its capture path now} (:func:`release_capture_path`), and ``runs``
    {commit: {vLLM release: its capture path at that commit}} for the runs on record that name an
    unmodified commit and no ``release_sha256`` - derived from git where it has the commit
    (:func:`release_sha256_at`), else kept from ``evidence/hot_path.json``; ``states`` {an earlier
    whole capture path's hash: ``releases`` as they were in it}, one entry added each time the file
    is written after the capture path changed, so that a run which recorded only that hash is still
    judged on its own release's part; ``hash_scheme`` (:data:`HASH_SCHEME`) and ``translated`` {a
    release's hash under scheme 1: the same code's under this scheme}, made once when the file of an
    older scheme is read, so that runs recorded before the switch keep their verdict. The file
    (written by ``--write``) keeps the check working without git."""
    import datetime
    import subprocess
    from pathlib import Path

    root = Path(root)
    sha = hot_path_sha256(root)
    files = hot_path_files(root)
    stored = root / HOT_PATH_FILE
    kept = json.loads(stored.read_text()) if stored.is_file() else {}
    day = None
    try:
        git = {"cwd": root, "capture_output": True, "text": True, "timeout": 60}
        if subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], **git).returncode == 0:
            if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *files], **git).returncode != 0:
                day = datetime.date.today().isoformat()
            else:
                day = subprocess.run(["git", "log", "-1", "--format=%cs", "--", *files], **git).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        day = None
    if day is None:
        day = kept["last_change"] if kept.get("sha256") == sha else datetime.date.today().isoformat()
    on_record = []
    for sub in ("cpu", "gpu"):
        folder = root / "evidence" / sub
        on_record += [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    on_record = [run for run in on_record if run.get("vllm")]
    now = release_capture_paths(root, {str(run["vllm"]) for run in on_record})
    wanted: dict[str, set[str]] = {}
    for run in on_record:
        rec = run.get("code") or {}
        if rec.get("commit") and rec.get("hot_path_modified") is False and not rec.get("release_sha256"):
            wanted.setdefault(rec["commit"], set()).add(str(run["vllm"]))
    runs: dict[str, dict[str, str]] = {}
    for commit, versions in sorted(wanted.items()):
        derived = release_sha256_at(root, commit, versions)
        for version, release_sha in derived.items():
            release_sha = release_sha or ((kept.get("runs") or {}).get(commit) or {}).get(version)
            if release_sha:
                runs.setdefault(commit, {})[version] = release_sha
    states = dict(kept.get("states") or {})
    if kept.get("sha256") and kept["sha256"] != sha and kept.get("releases"):
        states[kept["sha256"]] = kept["releases"]
    translated = dict(kept.get("translated") or {})
    if kept and kept.get("hash_scheme", 1) < HASH_SCHEME:
        # The switch to scheme 2, once: the same tree hashed both ways gives each release's hash
        # under the old scheme (as runs recorded it) and under the new one.
        old = release_capture_paths(root, now, unversioned=None)
        translated.update({old[v]["sha256"]: now[v]["sha256"] for v in now if old[v]["sha256"] != now[v]["sha256"]})
    return {"sha256": sha, "last_change": day, "files": files, "hash_scheme": HASH_SCHEME,
            "releases": {v: now[v]["sha256"] for v in sorted(now, key=Version)}, "runs": runs, "states": states,
            "translated": translated}


def is_stale(run: dict[str, Any], code: dict[str, Any]) -> bool:
    """An end-to-end run predates the capture path of its release (``code``: :func:`hot_path_state`).

    Where the run's release capture path is known (:func:`run_release_sha256`: recorded, or derived
    at its commit), the run is stale when it differs from that release's now: the core files, the
    adapter modules the release runs and its fingerprint, so a change to another release's adapter
    leaves it current. Otherwise by the whole capture path: stale when it recorded another
    :func:`hot_path_sha256`, or recorded none and is dated on or before the day the capture path
    last changed (a day cannot order a run and a change made on the same day, so such a run counts
    as older)."""
    mine = run_release_sha256(run, code)
    now = (code.get("releases") or {}).get(str(run.get("vllm")))
    if mine and now:
        return mine != now
    recorded = (run.get("code") or {}).get("hot_path_sha256")
    if recorded:
        return recorded != code["sha256"]
    return str(run["date"]) <= code["last_change"]
