"""The engine for asyncio applications: ``async for chunk in aengine.stream(prompt)``.

Decoding blocks for the whole answer, so it never runs on the event loop: each answer runs in a worker
thread of its own, which hands its text chunks to the loop (``loop.call_soon_threadsafe``) as the
engine yields them.  The side-channel callbacks of :meth:`Engine.generate` (``on_prefill``,
``on_sources``, ``on_logprobs``) and a load's ``on_progress`` are called on the event loop too, in order
with the chunks, so they may touch the application's state freely.

Answers run one at a time, as with the synchronous engine: a second answer asked for while one runs
waits for it, in the order asked (``wait=False``: it raises :class:`EngineBusy` instead), and a thread
using the :class:`Engine` directly takes its turn the same way.  An answer stops at once, the model pass
under way cut (:meth:`Engine.cancel`), when the task reading it is cancelled or ends, or when its
stream is left: ``aclose``, ``async with``, a ``break`` out of its loop once the stream is dropped.  A
reader cancelled while it awaits a chunk returns once the worker has let go of the engine, and the next
answer, ``wait=False`` too, waits for an answer being stopped rather than being refused, so the engine
serves the next request at once.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from edge_spec.runtime.engine import Completion, Engine, EngineBusy, GenerationStats
from edge_spec.runtime.loaded import LoadOptions
from edge_spec.runtime.loops.config import LoopConfig
from edge_spec.runtime.options import GenerateOptions
from edge_spec.runtime.progress import LoadProgress
from edge_spec.runtime.text import Message

__all__ = ["AsyncEngine", "AsyncStream"]


class AsyncEngine:
    """An :class:`Engine` used from asyncio (see the module docstring).  Make one with :meth:`load` or
    :meth:`from_bundle`, or wrap an engine already loaded: ``AsyncEngine(engine)``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()  # the answers asked of this wrapper, one at a time, in order
        self._current: _Answer | None = None  # the answer holding the turn
        self._streams: weakref.WeakSet[AsyncStream] = weakref.WeakSet()

    @classmethod
    async def load(
        cls,
        path: str | Path | None = None,
        options: LoadOptions | None = None,
        *,
        mode: str | None = None,
        config: LoopConfig | None = None,
        on_progress: Callable[[LoadProgress], Any] | None = None,
    ) -> AsyncEngine:
        """:meth:`Engine.load` in a worker thread; ``on_progress(LoadProgress)`` is called on the event loop.
        Cancelling the awaiting task stops the load (at its next progress step) and frees what it loaded
        before the ``CancelledError`` reaches the caller."""
        return await _load(lambda **kw: Engine.load(path, options, mode=mode, config=config, **kw), on_progress)

    @classmethod
    async def from_bundle(
        cls, path: str | Path | None = None, *, on_progress: Callable[[LoadProgress], Any] | None = None, **settings
    ) -> AsyncEngine:
        """:meth:`Engine.from_bundle` (the same ``settings``) in a worker thread, as :meth:`load`."""
        return await _load(lambda **kw: Engine.from_bundle(path, **settings, **kw), on_progress)

    def stream(
        self, prompt: str | list[Message], options: GenerateOptions | None = None, *, wait: bool = True, **settings
    ) -> AsyncStream:
        """The answer to ``prompt`` as text chunks: ``async for chunk in aengine.stream(prompt)``.  The
        ``options`` and ``settings`` are :meth:`Engine.generate`'s; nothing starts before the first chunk
        is asked for.  ``wait=False``: raise :class:`EngineBusy` there when another answer holds the engine."""
        stream = AsyncStream(self, prompt, wait, GenerateOptions.from_kwargs(options, **settings))
        self._streams.add(stream)
        return stream

    async def complete(
        self, prompt: str | list[Message], options: GenerateOptions | None = None, *, wait: bool = True, **settings
    ) -> Completion:
        """The whole answer at once (:meth:`Engine.complete`), decoded off the event loop."""
        async with self.stream(prompt, options, wait=wait, **settings) as stream:
            text = "".join([chunk async for chunk in stream])
        return Completion(text, stream.token_ids, stream.stats)

    async def aclose(self) -> None:
        """Stop the answers in progress and close the engine (:meth:`Engine.close`: its memory goes back
        to the system); answers asked for later raise :class:`~edge_spec.runtime.engine.EngineClosed`."""
        for stream in list(self._streams):
            await stream.aclose()
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


async def _load(load: Callable[..., Engine], on_progress: Callable[[LoadProgress], Any] | None) -> AsyncEngine:
    """Run ``load(on_progress=..., cancel=...)`` in a worker thread; a cancelled caller cancels the load."""
    loop = asyncio.get_running_loop()
    cancel = threading.Event()

    def progress(update: LoadProgress) -> None:
        if on_progress is not None:
            _call_soon(loop, on_progress, update)

    future = loop.run_in_executor(None, lambda: load(on_progress=progress, cancel=cancel))
    try:
        engine = await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        try:
            late = await future  # the load stops at its next step and frees what it loaded
        except BaseException:  # its LoadCancelled, or another cancel of the caller: stop waiting
            late = None
        if late is not None:  # it had finished loading before it saw the cancel
            await asyncio.to_thread(late.close)
        raise
    return AsyncEngine(engine)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> bool:
    """Call ``callback(*args)`` on ``loop`` (from any thread); False once the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
        return True
    except RuntimeError:  # the loop is closed: nobody is listening any more
        return False


class _Answer:
    """What one answer's worker thread and its reader share (not the stream itself, so that a stream
    nobody holds any more can be collected, and its finalizer stop the answer)."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.finished = loop.create_future()  # set on the loop once the worker has let go of the engine
        self.lock = threading.RLock()
        self.cancelled = False
        self.generating = False  # the worker holds the engine and generates this answer

    def cancel(self) -> None:
        """Stop this answer (from any thread): before it starts, or at once (the pass under way is cut)."""
        with self.lock:
            self.cancelled = True
            if self.generating:  # the worker holds the engine, so this cannot reach another answer
                self.engine.cancel()

    def emit(self, kind: str, value: Any = None) -> None:
        if not _call_soon(self.loop, self.queue.put_nowait, (kind, value)):
            self.cancel()


class AsyncStream:
    """One answer's text chunks, as the engine yields them (``async for``).  After the last one, ``stats``
    (:class:`GenerationStats`) and ``token_ids`` hold the answer's, and ``text`` the whole text.  Leaving
    early (``aclose``, ``async with``, a cancelled reader) stops the answer."""

    def __init__(self, owner: AsyncEngine, prompt: str | list[Message], wait: bool, options: GenerateOptions) -> None:
        self._owner = owner
        self._prompt = prompt
        self._wait = wait
        self._options = options
        self._answer: _Answer | None = None
        self._done = False
        self.text = ""
        self.token_ids: list[int] = []
        self.stats: GenerationStats | None = None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        if self._answer is None:
            await self._start()
        answer = self._answer
        try:
            kind, value = await answer.queue.get()
        except asyncio.CancelledError:
            await self._stop()
            raise
        if kind == "text":
            self.text += value
            return value
        await self._stop()  # returns once the worker has let go of the engine: the next answer starts at once
        if kind == "error":
            raise value
        self.stats, self.token_ids = value
        raise StopAsyncIteration

    async def _start(self) -> None:
        """Take the engine's turn (waiting for the answers before this one; with ``wait=False`` only for
        one being stopped), then start the worker."""
        owner = self._owner
        if not self._wait and owner._turn.locked() and not (owner._current is not None and owner._current.cancelled):
            raise EngineBusy("engine busy: another generation is in progress")
        await owner._turn.acquire()
        loop = asyncio.get_running_loop()
        answer = self._answer = owner._current = _Answer(owner.engine, loop)
        # the answer stops when its stream is dropped unfinished, or when the task reading it ends
        weakref.finalize(self, answer.cancel)
        reader = asyncio.current_task()

        def stop(_task: asyncio.Task) -> None:
            answer.cancel()

        if reader is not None:
            reader.add_done_callback(stop)

        def finished(_future: asyncio.Future) -> None:
            if reader is not None:
                reader.remove_done_callback(stop)
            if owner._current is answer:
                owner._current = None
            owner._turn.release()

        answer.finished.add_done_callback(finished)
        threading.Thread(
            target=_run, args=(answer, self._prompt, self._wait, self._options), name="edge-spec answer", daemon=True
        ).start()

    async def _stop(self) -> None:
        """Stop the answer and wait until its worker has let go of the engine (a second cancel of the
        waiting task stops the wait, not the stop)."""
        self._done = True
        answer = self._answer
        if answer is None:
            return
        answer.cancel()
        try:
            await asyncio.shield(answer.finished)
        except asyncio.CancelledError:
            pass

    async def aclose(self) -> None:
        """Stop the answer (when it has not ended) and wait for the engine to be free."""
        await self._stop()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _run(answer: _Answer, prompt: str | list[Message], wait: bool, options: GenerateOptions) -> None:
    """The worker thread: one answer, its chunks and its end handed to the event loop."""
    engine, loop = answer.engine, answer.loop
    on_loop = {}
    for name in ("on_sources", "on_logprobs"):  # called on the loop, before the chunk they describe
        callback = getattr(options, name)
        if callback is not None:
            on_loop[name] = lambda value, callback=callback: _call_soon(loop, callback, value)
    on_prefill = options.on_prefill

    def prefill(fraction: float) -> None:
        if answer.cancelled:  # a cancel that came before generate() started was cleared by it: repeat it
            engine.cancel()
        if on_prefill is not None:
            _call_soon(loop, on_prefill, fraction)

    try:
        with engine.held(wait):
            with answer.lock:
                if answer.cancelled:  # before it started: nothing was generated
                    answer.emit("done", (GenerationStats(stop_reason="cancelled", mode=engine.config.mode), []))
                    return
                answer.generating = True
            chunks = engine.generate(prompt, replace(options, on_prefill=prefill, **on_loop))
            try:
                for text in chunks:
                    answer.emit("text", text)
                    if answer.cancelled:
                        engine.cancel()  # cuts the pass under way; the answer's statistics are kept
            finally:
                chunks.close()
                with answer.lock:
                    answer.generating = False
            answer.emit("done", (engine.last_stats, list(engine.last_token_ids)))
    except BaseException as exc:  # the reader raises it
        answer.emit("error", exc)
    finally:
        _call_soon(loop, _finish, answer.finished)


def _finish(finished: asyncio.Future) -> None:
    if not finished.done():
        finished.set_result(None)
