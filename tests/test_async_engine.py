"""``AsyncEngine``: answers streamed to an event loop from a worker thread, cancelled by cancelling the
reading task (the engine free for the next answer at once), one at a time as the synchronous engine
runs them, and a load that reports its progress on the loop and stops when its task is cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from edge_spec.runtime.aio import AsyncEngine
from edge_spec.runtime.engine import Engine, EngineBusy
from edge_spec.runtime.progress import LoadProgress

PROMPT = "def is_prime(n):"
LONG = 200  # tokens at most: the tiny model's greedy answer to PROMPT runs for a hundred or more


@pytest.fixture(scope="module")
def reference(engine):
    """The synchronous engine's greedy answers."""
    return {n: engine.complete(PROMPT, max_new_tokens=n, temperature=0.0) for n in (12, LONG)}


@pytest.fixture()
def slowed(engine, monkeypatch):
    """Every text chunk of the engine's answers 10 ms apart, so that an answer of LONG tokens takes seconds."""
    generate = Engine.generate

    def slow(self, *args, **kwargs):
        for chunk in generate(self, *args, **kwargs):
            time.sleep(0.01)
            yield chunk

    monkeypatch.setattr(Engine, "generate", slow)
    return engine


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


def test_a_stream_gives_the_synchronous_answer_without_blocking_the_loop(engine, reference, monkeypatch):
    decoding = set()
    generate = Engine.generate

    def watched(self, *args, **kwargs):
        for chunk in generate(self, *args, **kwargs):
            decoding.add(threading.get_ident())
            time.sleep(0.005)  # an answer that takes long enough for a blocked loop to show
            yield chunk

    monkeypatch.setattr(Engine, "generate", watched)

    async def main():
        aengine = AsyncEngine(engine)
        ticks, threads = 0, set()
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        ticking = asyncio.create_task(ticker())
        stream = aengine.stream(
            PROMPT, max_new_tokens=LONG, on_sources=lambda pieces: threads.add(threading.get_ident())
        )
        chunks = [chunk async for chunk in stream]
        stop.set()
        await ticking
        return chunks, stream, ticks, threads

    chunks, stream, ticks, threads = run(main())
    want = reference[LONG]
    assert "".join(chunks) == stream.text == want.text
    assert stream.token_ids == want.token_ids and stream.stats.new_tokens == want.stats.new_tokens >= 100
    assert len(decoding) == 1 and threading.get_ident() not in decoding  # decoded in a worker thread
    assert ticks >= 10  # meanwhile the loop ran other tasks
    assert threads == {threading.get_ident()}  # callbacks run on the event loop's thread


def test_cancelling_the_reader_stops_decoding_and_frees_the_engine(slowed, reference):
    async def main():
        aengine = AsyncEngine(slowed)
        first = asyncio.Event()
        got = []

        async def read():
            async for chunk in aengine.stream(PROMPT, max_new_tokens=LONG):
                got.append(chunk)
                first.set()

        task = asyncio.create_task(read())
        await first.wait()
        started = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stopped_in = time.perf_counter() - started
        stats = slowed.last_stats
        # the engine is free: an answer that refuses to wait is served, and is the usual answer
        after = await aengine.complete(PROMPT, max_new_tokens=12, wait=False)
        return stopped_in, stats, got, after

    stopped_in, stats, got, after = run(main())
    assert stats.stop_reason == "cancelled" and stats.new_tokens < LONG // 2, stats
    assert stopped_in < 1.0
    assert after.text == reference[12].text


def test_a_reader_cancelled_elsewhere_still_stops_its_answer(slowed, reference):
    """The task is cancelled while it awaits something else than the next chunk (say, a UI update): the
    answer stops when the task ends, and the next answer, even one that will not wait, is served."""

    async def main():
        aengine = AsyncEngine(slowed)
        first = asyncio.Event()
        never = asyncio.Event()

        async def read():
            async for _chunk in aengine.stream(PROMPT, max_new_tokens=LONG):
                first.set()
                await never.wait()

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await aengine.complete(PROMPT, max_new_tokens=12, wait=False)
        return after

    after = run(main())
    assert after.text == reference[12].text


def test_leaving_a_stream_early_stops_its_answer(slowed):
    async def main():
        aengine = AsyncEngine(slowed)
        async with aengine.stream(PROMPT, max_new_tokens=LONG) as stream:
            async for _chunk in stream:
                break
        return slowed.last_stats

    stats = run(main())
    assert stats.stop_reason == "cancelled" and stats.new_tokens < LONG


def test_two_answers_run_one_after_the_other(slowed, reference):
    async def main():
        aengine = AsyncEngine(slowed)
        timeline = []

        async def read(name, n):
            async for _chunk in aengine.stream(PROMPT, max_new_tokens=n):
                timeline.append(name)
            return name

        results = await asyncio.gather(read("a", 12), read("b", 12))
        return timeline, results

    timeline, results = run(main())
    assert results == ["a", "b"]
    first_b = timeline.index("b")
    assert set(timeline[:first_b]) == {"a"} and set(timeline[first_b:]) == {"b"}, timeline


def test_an_answer_that_will_not_wait_is_refused_while_another_runs(slowed, reference):
    async def main():
        aengine = AsyncEngine(slowed)
        stream = aengine.stream(PROMPT, max_new_tokens=LONG)
        await stream.__anext__()
        with pytest.raises(EngineBusy):
            await aengine.complete(PROMPT, max_new_tokens=12, wait=False)
        await stream.aclose()
        return await aengine.complete(PROMPT, max_new_tokens=12, wait=False)

    assert run(main()).text == reference[12].text


def test_a_thread_holding_the_engine_makes_async_answers_wait_or_refuse(engine, reference):
    """A synchronous caller in another thread takes its turn as with the synchronous API."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with engine.held():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)

    async def main():
        aengine = AsyncEngine(engine)
        with pytest.raises(EngineBusy):
            await aengine.complete(PROMPT, max_new_tokens=12, wait=False)
        waiting = asyncio.create_task(aengine.complete(PROMPT, max_new_tokens=12))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release.set()
        return await waiting

    try:
        assert run(main()).text == reference[12].text
    finally:
        release.set()
        holder.join(30)


def test_a_queued_answer_cancelled_never_runs(slowed, reference, monkeypatch):
    prompts = []
    generate = Engine.generate

    def counted(self, prompt, *args, **kwargs):
        prompts.append(prompt)
        return generate(self, prompt, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", counted)

    async def main():
        aengine = AsyncEngine(slowed)
        running = asyncio.create_task(aengine.complete(PROMPT, max_new_tokens=12))
        await asyncio.sleep(0)
        queued = asyncio.create_task(aengine.complete("never", max_new_tokens=12))
        await asyncio.sleep(0.05)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        return await running

    assert run(main()).text == reference[12].text
    assert prompts == [PROMPT]


def test_an_async_load_reports_progress_on_the_loop_and_closes(int4_bundle, reference):
    async def main():
        events, threads = [], set()

        def on_progress(progress: LoadProgress):
            events.append(progress.stage)
            threads.add(threading.get_ident())

        async with await AsyncEngine.from_bundle(
            int4_bundle, threads=1, mode="spec", on_progress=on_progress
        ) as aengine:
            answer = await aengine.complete(PROMPT, max_new_tokens=12)
        return events, threads, answer, aengine

    events, threads, answer, aengine = run(main())
    assert events[0] == "reading" and events[-1] == "measuring"
    assert threads == {threading.get_ident()}
    assert answer.text == reference[12].text
    assert aengine.engine.bundle.target is None  # closed


def test_cancelling_an_async_load_frees_it(int4_bundle, monkeypatch):
    """The task awaiting the load is cancelled while the target is read: the CancelledError reaches the
    caller once the load has stopped and its models are freed."""
    import gc
    import weakref

    from edge_spec.runtime.loaded import LoadedBundle

    real = LoadedBundle.load.__func__
    made = []

    def slow_load(cls, *args, **kwargs):
        time.sleep(0.3)
        loaded = real(cls, *args, **kwargs)
        made.append(weakref.ref(loaded.target))
        return loaded

    monkeypatch.setattr(LoadedBundle, "load", classmethod(slow_load))

    async def main():
        task = asyncio.create_task(AsyncEngine.from_bundle(int4_bundle, threads=1, mode="spec"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    gc.collect()
    assert len(made) == 1 and made[0]() is None
