"""The engine loop of ``speccompat serve``: concurrent requests batched into one engine.

The HTTP threads put each checked request (its token ids) on a queue and wait for its future. The
loop runs in the thread that started the engine (the main thread): it takes the first waiting
request, then feeds ``speccompat.generator.stream`` from the queue as long as requests are waiting,
so that the requests of concurrent clients share the engine's steps (vLLM's scheduler batches them
under the in-flight token budget). When the queue is empty the stream finishes what it admitted and
the loop waits for the next request. Each sequence's states (views of the workers' staging memory,
``copy=False``) go to ``publish`` as soon as the step that completed it ran: the publisher checks and
stores them in another thread.

Failures, as ``speccompat extract`` treats them: a sequence the stream rejects (non-finite states, a
step whose token ids could not be verified, a KV cache too small for it) stops the stream; the
sequences it had admitted and not handed out are then run one at a time, so that only the bad request
fails (:class:`RequestFailed`, a 5xx; a KV cache too small for one request alone is the request's
fault, :class:`RequestRejected`, a 4xx). Any other exception is the engine's: every request in flight
or waiting fails (:class:`EngineFailed`, 503), the loop stops and the server exits (status 1).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

__all__ = ["EngineFailed", "EngineLoop", "Job", "RequestFailed", "RequestRejected", "ServerBusy"]

logger = logging.getLogger("speccompat.serve")

#: A progress line at most this often while requests arrive.
PROGRESS_EVERY_S = 30.0


class RequestRejected(Exception):
    """The request cannot be served as sent (HTTP 4xx): ``status`` and a one-line message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestFailed(Exception):
    """The engine or the store failed this request alone (HTTP 500); the server goes on."""

    status = 500


class EngineFailed(Exception):
    """The engine failed: nothing more is served (HTTP 503); the server exits."""

    status = 503


class ServerBusy(Exception):
    """Too much is waiting (HTTP 503 with Retry-After): the client should retry later."""

    status = 503


class Job:
    """One request: its token ids and the future its HTTP handler waits on."""

    __slots__ = ("future", "ids", "queued_at")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.future: Future = Future()
        self.queued_at = time.monotonic()

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class EngineLoop:
    """Owns the engine (speculators' generator under speccompat) and serves the queue.

    ``publish(job, states)``: called in the loop's thread with a sequence's states (one ``[n, hidden]``
    tensor per layer); it must resolve ``job.future`` eventually (it may block to bound memory).
    ``stream``: ``speccompat.generator.stream`` (replaceable for tests without an engine)."""

    def __init__(self, gen: Any, publish: Callable[[Job, list[Any]], None], *, max_in_flight_tokens: int,
                 max_queued: int = 4096, stream: Callable[..., Iterator] | None = None) -> None:
        if stream is None:
            from speccompat.generator import stream
        self.gen, self.publish, self.stream = gen, publish, stream
        self.max_in_flight_tokens, self.max_queued = max_in_flight_tokens, max_queued
        self.queue: queue.Queue[Job] = queue.Queue()
        self.failed: str | None = None
        self.requests = self.tokens = self.streams = 0
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._started = time.monotonic()

    # ---- the HTTP side (any thread)

    def submit(self, ids: list[int]) -> Future:
        """Queue one checked request; its future resolves to what ``publish`` sets."""
        if self.failed is not None:
            raise EngineFailed(f"the engine failed and serves nothing more: {self.failed}")
        if self.queue.qsize() >= self.max_queued:
            raise ServerBusy(f"{self.max_queued} requests are waiting for the engine; retry later")
        job = Job(ids)
        self.queue.put(job)
        if self.failed is not None:  # failed meanwhile: the loop may not see this job any more
            job.fail(EngineFailed(f"the engine failed: {self.failed}"))
        return job.future

    # ---- the loop (the engine's thread)

    def run(self, stop: Callable[[], bool], poll_s: float = 0.1) -> None:
        """Serve until ``stop()`` is true while nothing is waiting; raises after an engine failure
        (every waiting request failed first)."""
        while True:
            try:
                job = self.queue.get(timeout=poll_s)
            except queue.Empty:
                if stop():
                    return
                continue
            try:
                self._serve_from(job)
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"
                self._fail_waiting(EngineFailed(f"the engine failed: {self.failed}"))
                raise

    def _fail_waiting(self, exc: BaseException) -> None:
        while True:
            try:
                self.queue.get_nowait().fail(exc)
            except queue.Empty:
                return

    def _serve_from(self, first: Job) -> None:
        from speccompat.errors import HiddenStatesError

        jobs: list[Job] = []

        def inputs() -> Iterator[list[int]]:
            job: Job | None = first
            while job is not None:
                jobs.append(job)
                yield job.ids
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    return

        handed: set[int] = set()
        unverified = 0
        self.streams += 1
        try:
            for index, states, stats in self.stream(self.gen, inputs(), max_in_flight_sequences=None,
                                                    max_in_flight_tokens=self.max_in_flight_tokens, copy=False):
                if stats.get("unverified_steps", 0) > unverified:
                    raise HiddenStatesError(f"{stats['unverified_steps'] - unverified} engine step(s) could not be "
                                            "verified against the prompts (unverified_steps)")
                handed.add(index)
                self._deliver(jobs[index], states)
        except HiddenStatesError as exc:
            suspects = [j for i, j in enumerate(jobs) if i not in handed]
            logger.warning("%s; running the %d request(s) in flight one at a time", exc, len(suspects))
            for job in suspects:
                self._serve_alone(job)
        except BaseException as exc:
            for i, job in enumerate(jobs):
                if i not in handed:
                    job.fail(EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}"))
            raise

    def _serve_alone(self, job: Job) -> None:
        from speccompat.errors import HiddenStatesError, KVCacheTooSmall

        try:
            (result,) = self.gen.generate([list(job.ids)], copy=False)
        except KVCacheTooSmall as exc:
            job.fail(RequestRejected(f"the prompt's {len(job.ids)} tokens do not fit the engine's KV cache ({exc})"))
            return
        except HiddenStatesError as exc:
            job.fail(RequestFailed(f"the engine's hidden states for this prompt failed their checks: {exc}"))
            return
        if (getattr(self.gen, "_speccompat_stats", None) or {}).get("unverified_steps", 0):
            job.fail(RequestFailed("an engine step could not be verified against the prompt (unverified_steps)"))
            return
        self._deliver(job, result["hidden_states"])

    def _deliver(self, job: Job, states: list[Any]) -> None:
        with self._lock:
            self.requests += 1
            self.tokens += len(job.ids)
        self.publish(job, states)
        now = time.monotonic()
        if now - self._last_log >= PROGRESS_EVERY_S:
            self._last_log = now
            logger.info("served %d requests (%d tokens, %.0f tokens/s since the start) in %d engine streams",
                        self.requests, self.tokens, self.tokens / max(now - self._started, 1e-9), self.streams)
