"""The Python API as an application embeds it: a load that reports its progress and can be cancelled
(freeing what it loaded), ``close()`` giving the memory back over load/close cycles, and switching
bundles in one process."""

from __future__ import annotations

import gc
import shutil
import sys
import threading
import time
import weakref

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model import decoder as decoder_module
from edge_spec.runtime.progress import STAGES, LoadCancelled
from tests import tiny_models
from tests.helpers import export_tiny

PROMPT = "def is_prime(n):"


@pytest.fixture()
def fresh_bundle(int4_bundle, tmp_path):
    """A copy of the bundle at a path never loaded: its files are all hashed again (the weight check)."""
    return shutil.copytree(int4_bundle, tmp_path / "copy")


@pytest.fixture()
def decoders(monkeypatch):
    """Weak references to every Decoder (a model's session and KV cache) made meanwhile."""
    made: list[weakref.ref] = []
    real = decoder_module.Decoder.__init__

    def tracked(self, *args, **kwargs):
        made.append(weakref.ref(self))
        real(self, *args, **kwargs)

    monkeypatch.setattr(decoder_module.Decoder, "__init__", tracked)
    return made


def alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def hashing_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "edge-spec weight check"]


def check_stages(events, expected: list[str]) -> None:
    """``events`` go through the ``expected`` stages in order, each from 0.0 to 1.0, never backwards."""
    stages = [stage for i, (stage, _) in enumerate(events) if i == 0 or events[i - 1][0] != stage]
    assert stages == expected, events
    for stage in expected:
        fractions = [fraction for s, fraction in events if s == stage]
        assert fractions[0] == 0.0 and fractions[-1] == 1.0, (stage, fractions)
        assert fractions == sorted(fractions), (stage, fractions)


def test_a_load_reports_its_stages_in_order(fresh_bundle):
    events = []
    engine = Engine.from_bundle(
        fresh_bundle, threads=1, mode="spec", on_progress=lambda p: events.append((p.stage, p.fraction))
    )
    try:
        check_stages(events, ["reading", "verifying", "measuring"])
        assert set(STAGES) == {stage for stage, _ in events}
        reading = [f for s, f in events if s == "reading"]
        assert any(0.0 < f < 1.0 for f in reading), reading  # the target read, the drafter not yet
        assert engine.complete(PROMPT, max_new_tokens=4).token_ids
    finally:
        engine.close()


def test_a_verified_load_hashes_first_and_an_ar_load_measures_nothing(fresh_bundle):
    events = []
    engine = Engine.from_bundle(
        fresh_bundle, threads=1, mode="ar", verify=True, on_progress=lambda p: events.append((p.stage, p.fraction))
    )
    engine.close()
    check_stages(events, ["verifying", "reading"])
    verifying = [f for s, f in events if s == "verifying"]
    assert len(set(verifying)) > 3, verifying  # one step per file hashed


@pytest.mark.parametrize("stage", STAGES)
def test_a_load_cancelled_by_its_callback_frees_what_it_loaded(fresh_bundle, decoders, stage):
    seen = []
    midway = stage != "measuring"  # give up after a file hashed / the target read, or as the measuring starts

    def on_progress(progress):
        seen.append(progress.stage)
        return not (progress.stage == stage and (progress.fraction > 0 or not midway))  # False: give up

    with pytest.raises(LoadCancelled, match="cancelled") as caught:
        Engine.from_bundle(fresh_bundle, threads=1, mode="spec", verify=stage == "verifying", on_progress=on_progress)
    assert seen[-1] == stage
    if stage != "verifying":
        assert decoders, "the models were being read"
    assert not any(t.is_alive() for t in hashing_threads())
    # even with the traceback kept (pytest keeps it), nothing of the load stays alive
    assert caught.value.__traceback__ is not None
    assert alive(decoders) == 0
    engine = Engine.from_bundle(fresh_bundle, threads=1, mode="spec")  # and the bundle loads as before
    try:
        assert engine.complete(PROMPT, max_new_tokens=4).token_ids
    finally:
        engine.close()


def test_a_load_cancelled_from_another_thread_stops_at_its_next_step(int4_bundle, decoders, monkeypatch):
    """The user presses Cancel while the target is being read: the load stops once it is read, before
    the drafter is."""
    from edge_spec.runtime.loaded import LoadedBundle

    real = LoadedBundle.load.__func__
    reading = threading.Event()

    def slow_load(cls, *args, **kwargs):
        reading.set()
        time.sleep(0.3)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(LoadedBundle, "load", classmethod(slow_load))
    cancel = threading.Event()
    outcome = {}

    def load():
        try:
            outcome["engine"] = Engine.from_bundle(int4_bundle, threads=1, mode="spec", cancel=cancel)
        except LoadCancelled as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=load)
    worker.start()
    assert reading.wait(30)
    cancel.set()
    worker.join(30)
    assert "error" in outcome, outcome
    assert len(decoders) == 1  # the target only: the drafter was never read
    assert alive(decoders) == 0


def test_closing_frees_the_models(int4_bundle, decoders):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    engine.complete(PROMPT, max_new_tokens=8)
    assert alive(decoders) == 2  # target and drafter
    engine.close()
    assert alive(decoders) == 0


def test_switching_bundles_in_one_process(int4_bundle, fp32_bundle):
    """An application opens one bundle, then another: each answers as it does alone, whichever came
    first, and two can be open at once."""

    def answer(engine):
        return engine.complete(PROMPT, max_new_tokens=24, temperature=0.0).token_ids

    first = Engine.from_bundle(fp32_bundle, threads=1, mode="spec")
    fp32_alone = answer(first)
    first.close()
    second = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    int4_after = answer(second)
    third = Engine.from_bundle(fp32_bundle, threads=1, mode="spec")
    try:
        assert answer(third) == fp32_alone  # after another bundle, and beside it
        assert answer(second) == int4_after
        assert int4_after != fp32_alone  # they are different models (int4 rounds the weights)
    finally:
        second.close()
        third.close()


# ---------------------------------------------------------------------------
# the memory over load/close cycles
# ---------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def larger_bundle(tmp_path_factory):
    """A pair large enough (about 10 MB of fp32 weights each) that a model left behind shows in RSS."""
    tokenizer = tiny_models.make_tokenizer()
    target = tiny_models.make_qwen2(seed=0, hidden=256, layers=3)
    draft = tiny_models.perturbed_copy(target, seed=1, noise=0.15)
    return export_tiny(tmp_path_factory.mktemp("larger"), (tokenizer, target, draft), quant="fp32", context_length=1024)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc")
def test_load_close_cycles_give_the_memory_back(larger_bundle):
    """Five load / answer / close cycles: the resident size after each close stays where the first close
    left it (a model kept per cycle would add its weights each time), and a close gives back the models'
    memory (glibc keeps freed heap pages until asked: ``heap.release``)."""
    weights_mb = sum(f.stat().st_size for f in larger_bundle.rglob("*.data")) / 2**20
    after_close, dropped = [], []
    for _ in range(5):
        engine = Engine.from_bundle(larger_bundle, threads=1, mode="spec")
        engine.complete(PROMPT, max_new_tokens=16)
        loaded = rss_mb()
        engine.close()
        del engine
        after_close.append(rss_mb())
        dropped.append(loaded - after_close[-1])
    print(f"weights {weights_mb:.1f} MB; RSS after each close {[round(x, 1) for x in after_close]} MB")
    assert max(after_close) - after_close[0] < 0.5 * weights_mb, after_close
    assert min(dropped) > 0.5 * weights_mb, dropped
