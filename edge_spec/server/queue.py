"""One engine, one worker thread: generations run one at a time, in arrival order.

The :class:`~edge_spec.runtime.engine.Engine` is not thread-safe, so only the worker thread touches it
(besides ``Engine.cancel``, which is).  Requests wait in a bounded queue; a full queue refuses the next
one (HTTP 429 with ``Retry-After``).  A :class:`Job` carries one request's events from the worker
thread to the request's coroutine on the event loop: ``start``, ``text`` chunks, then ``done`` (with
the engine's statistics) or ``error``.  Cancelling a job (its client went away, or the server is shutting
down) drops it from the queue, or stops its generation at the next token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine, GenerationStats
from edge_spec.runtime.logprobs import TokenLogprob
from edge_spec.server.errors import ApiError, bad_request, shutting_down
from edge_spec.server.openai_format import edge_spec_stats
from edge_spec.server.schemas import Sampling

log = logging.getLogger("edge_spec.server")


@dataclass
class Event:
    kind: str  # "start", "text", "done" or "error"
    text: str = ""
    stats: GenerationStats | None = None
    error: ApiError | None = None
    # [[text, source], ...] when the job asked for them: a text event's; a done event's for the answer's last
    # tokens when their text is empty
    sources: list[list[str]] | None = None
    logprobs: list[TokenLogprob] | None = None  # the same tokens' log-probabilities, when the job asked for them


@dataclass(eq=False)
class Job:
    """One request's generation: run by the worker thread, read by the request's coroutine (``events``)."""

    prompt: str | list[dict]
    sampling: Sampling
    label: str  # for the log: "chat" / "completion" and the response id
    loop: asyncio.AbstractEventLoop
    tools: list[dict] | None = None  # for the chat template
    provenance: bool = False  # text events carry their tokens' sources (Engine.generate's on_sources)
    logprobs: int | None = None  # text events carry their tokens' log-probabilities with this many alternatives
    marked_tokens: frozenset[int] = frozenset()  # tokens whose text is marked (Engine.generate's marked_tokens)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None  # "disconnect" or "shutdown"
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_text: float | None = None  # when the first text of the answer left the engine

    @property
    def queue_seconds(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted

    @property
    def time_to_first_text(self) -> float | None:
        """Seconds from the request's arrival in the queue to its first text (queue, prefill, first tokens)."""
        return None if self.first_text is None else self.first_text - self.submitted

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineWorker:
    """Runs jobs on ``engine`` one at a time; at most ``max_queue`` jobs wait behind the running one."""

    def __init__(self, engine: Engine, max_queue: int) -> None:
        if max_queue < 0:
            raise EdgeSpecError("--max-queue must be 0 or more")
        self.engine = engine
        self.max_queue = max_queue
        self.counts: collections.Counter[str] = collections.Counter()  # completed, cancelled, failed, refused
        # called on the worker thread after each answer the engine finished (metrics): (job, stats)
        self.on_answered: Callable[[Job, GenerationStats], None] | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._closing = False
        self._durations: collections.deque[float] = collections.deque(maxlen=16)  # recent jobs' seconds
        self._thread = threading.Thread(target=self._run, name="edge-spec-engine", daemon=True)

    # -- the event loop's side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise 429 (queue full) / 503 (shutting down)."""
        with self._cond:
            if self._closing:
                raise shutting_down()
            if len(self._waiting) + (self._current is not None) > self.max_queue:
                self.counts["refused"] += 1
                raise ApiError(
                    429,
                    f"the server is busy: {len(self._waiting)} requests are waiting behind the one "
                    f"being answered (--max-queue {self.max_queue}); retry later",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": str(self._retry_after())},
                )
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Drop ``job`` from the queue or stop its generation at the next token (any thread)."""
        with self._cond:
            if job.cancelled.is_set():
                return
            job.cancel_reason = reason
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                job.emit(
                    Event(
                        "error",
                        error=shutting_down()
                        if reason == "shutdown"
                        else ApiError(499, "the client went away", code="cancelled"),
                    )
                )
            elif job is self._current:
                self.engine.cancel()

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new jobs and drop the waiting ones (503); the running one gets ``grace`` seconds to finish,
        then stops at its next token."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            waiting, current = list(self._waiting), self._current
            self._cond.notify()
        for job in waiting:
            self.cancel(job, "shutdown")
        if current is not None:
            log.info("shutting down: the answer in progress gets %.0f s to finish", grace)
            timer = threading.Timer(grace, self.cancel, (current, "shutdown"))
            timer.daemon = True
            timer.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down now (the running job is cancelled) and wait for the worker thread."""
        self.begin_shutdown(0.0)
        current = self._current
        if current is not None:
            self.cancel(current, "shutdown")
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: about one recent request's time."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, min(60, math.ceil(mean)))

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait(timeout=1.0)
                if not self._waiting:
                    return  # closing and nothing left
                job = self._current = self._waiting.popleft()
            try:
                self._serve(job)
            finally:
                with self._cond:
                    self._current = None

    def _serve(self, job: Job) -> None:
        engine = self.engine
        job.started = time.perf_counter()
        job.emit(Event("start"))

        def stop_if_cancelled(_fraction: float = 0.0) -> None:
            # a cancel that came before generate() started was cleared by it: repeat it
            if job.cancelled.is_set():
                engine.cancel()

        sources: list[list[list[str]]] = []  # the pieces of the chunk about to be yielded
        logged: list[TokenLogprob] = []  # the log-probabilities of its tokens

        def logprobs() -> list[TokenLogprob] | None:
            taken = list(logged)
            logged.clear()
            return taken if job.logprobs is not None else None

        try:
            if job.cancelled.is_set():  # cancelled between leaving the queue and here
                raise _Cancelled
            options = job.sampling.options(
                on_prefill=stop_if_cancelled,
                tools=job.tools,
                on_sources=sources.append if job.provenance else None,
                logprobs=job.logprobs,
                on_logprobs=logged.extend if job.logprobs is not None else None,
                marked_tokens=job.marked_tokens,
            )
            for text in engine.generate(job.prompt, options):
                if job.first_text is None:
                    job.first_text = time.perf_counter()
                job.emit(Event("text", text, sources=sources.pop() if sources else None, logprobs=logprobs()))
                stop_if_cancelled()
        except _Cancelled:
            self.counts["cancelled"] += 1
            job.emit(Event("error", error=shutting_down()))
            return
        except EdgeSpecError as exc:  # what the engine refuses is the request's mistake
            self.counts["failed"] += 1
            job.emit(Event("error", error=bad_request(str(exc))))
            return
        except Exception as exc:  # a bug: log it, keep serving
            log.exception("%s failed", job.label)
            self.counts["failed"] += 1
            job.emit(
                Event("error", error=ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
            )
            return
        stats = engine.last_stats
        seconds = time.perf_counter() - job.started
        self._durations.append(seconds)
        self.counts["cancelled" if stats.stop_reason == "cancelled" else "completed"] += 1
        if self.on_answered is not None:  # before the answer ends: a client that reads /metrics next sees it
            try:
                self.on_answered(job, stats)
            except Exception:  # a bug in the observer: log it, keep serving
                log.exception("recording %s failed", job.label)
        job.emit(
            Event(
                "done",
                stats=stats,
                sources=sources.pop() if sources else None,  # tokens with no text
                logprobs=logprobs(),
            )
        )
        log.info("%s", describe(job, stats, seconds))


class _Cancelled(Exception):
    pass


def describe(job: Job, stats: GenerationStats, seconds: float) -> str:
    """One log line per request, speculative statistics included."""
    x = edge_spec_stats(stats, job.queue_seconds)
    reason = stats.stop_reason + (
        f", {job.cancel_reason}" if stats.stop_reason == "cancelled" and job.cancel_reason else ""
    )
    line = (
        f"{job.label}: {x['prompt_tokens']} prompt + {x['new_tokens']} new tokens ({reason}) in {seconds:.2f} s; "
        f"queue {x['queue_seconds']:.2f} s, prefill {x['prefill_seconds']:.2f} s, "
        f"{x['tokens_per_second']:.1f} tok/s, {x['mode']}"
    )
    if x["target_calls"]:
        line += (
            f", drafted {x['drafted']}, accepted {x['accepted']} ({x['acceptance_rate']:.0%}), "
            f"τ {x['tau']:.2f} over {x['target_calls']} target passes"
        )
    return line
