"""Device cost profile: measured once per bundle/head/device, cached, and used to seed the γ policy."""

from __future__ import annotations

import pytest

from edge_spec.benchmarking.ort_profile import profile_rows
from edge_spec.manifest import read_manifest
from edge_spec.runtime.schedule import cost_profile
from edge_spec.runtime.engine import Engine
from tests.helpers import chain


def test_profile_is_measured_once_then_read_from_the_cache(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    first = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert first.cost_profile is not None and not first.cost_profile.cached
    assert set(first.cost_profile.verify) == {1, 2, 3, 4}
    assert first.cost_profile.draft_body > 0 and first.cost_profile.draft_head > 0
    assert len([p for p in (tmp_path / "costs").glob("*.json") if not p.name.startswith("fact-")]) == 1
    second = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert second.cost_profile.cached and second.cost_profile.verify == first.cost_profile.verify
    # the profile seeds the live cost model the policy reads
    assert second.target.recent_seconds()[3] == first.cost_profile.verify[3]
    assert second.drafter.step_estimate == first.cost_profile.draft_step
    # and the drafter's second row, the price of a catch-up, from the first round on
    assert first.cost_profile.draft_catch_up >= 0
    assert second.cost_profile.draft_catch_up == first.cost_profile.draft_catch_up
    assert second.drafter.catch_up_seconds == pytest.approx(max(first.cost_profile.draft_catch_up, 0.0))


def test_profile_key_depends_on_head_threads_and_gamma(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    heads = engine.manifest["draft"]["heads"]
    keys = {cost_profile.cache_key(engine.manifest, heads[head], "cpu", threads, gamma)
            for head in ("full", "trim-64") for threads in (1, 2) for gamma in (3, 5)}
    assert len(keys) == 8


def test_memory_bound_bytes_ratio_reported(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    extra = engine.complete("def is_prime", max_new_tokens=12).stats.spec
    assert 0 < extra.bytes_ratio < 1.5
    assert extra.mbsu_bytes == extra.tau / (extra.bytes_ratio * extra.mean_gamma + 1)


def test_profiled_latencies_follow_the_measured_ones():
    """A machine slowed down by other load: the 2-row pass is measured 1.5x its profile, so the profiled
    3-row pass, not measured since, is scaled alike (else a longer draft would look cheap)."""
    from edge_spec.runtime.model.decoder import DecoderStats

    stats = DecoderStats()
    for n, seconds in {1: 0.050, 2: 0.056, 3: 0.082}.items():
        stats.seed(n, seconds)
    assert stats.recent_seconds() == {1: 0.050, 2: 0.056, 3: 0.082}
    for _ in range(30):
        stats.add(2, 0.084)
    recent = stats.recent_seconds()
    assert recent[2] == pytest.approx(0.084)
    assert recent[3] == pytest.approx(0.082 * 1.5) and recent[1] == pytest.approx(0.050 * 1.5)


def profile(**verify_ms) -> cost_profile.CostProfile:
    return cost_profile.CostProfile({int(n[1:]): ms / 1e3 for n, ms in verify_ms.items()}, 0.020, 0.001, 1.0)


def test_a_pass_costs_its_fastest_repeat_per_cache_length():
    # two KV lengths x three repeats: one repeat slowed by load at each length
    assert cost_profile._typical([0.050, 0.090, 0.051, 0.060, 0.061, 0.120]) == pytest.approx(0.055)


def test_a_profile_taken_under_load_is_corrected_by_live_passes():
    busy = profile(n1=128, n2=140, n3=170)
    live = {1: 0.050, 2: 0.057}
    assert not cost_profile.correct_from_live(busy, live, {1: 3, 2: 3})  # too few live passes to judge
    assert cost_profile.correct_from_live(busy, live, {1: 20, 2: 20})
    assert busy.verify[1] == pytest.approx(0.050) and busy.verify[2] == pytest.approx(0.057)
    assert busy.verify[3] == pytest.approx(0.170 * (0.050 / 0.128 + 0.057 / 0.140) / 2)  # the median ratio
    assert busy.corrections == 1


def test_a_right_profile_is_left_alone():
    right = profile(n1=50, n2=57, n3=82)
    assert not cost_profile.correct_from_live(right, {1: 0.049, 2: 0.060}, {1: 20, 2: 20})
    assert not cost_profile.correct_from_live(right, {1: 0.030, 2: 0.056}, {1: 20, 2: 20})  # one size only
    assert right.verify == {1: 0.050, 2: 0.057, 3: 0.082}


def test_a_corrected_profile_is_what_the_next_load_reads(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    key = engine._profile_key
    slow = {n: 10 * t for n, t in engine.cost_profile.verify.items()}  # as if profiled on a busy machine
    cost_profile.save(key, cost_profile.CostProfile(slow, 0.01, 0.001, 1.0))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert engine.cost_profile.verify == pytest.approx(slow)
    engine.complete("one two three one two three one two three", max_new_tokens=40, temperature=0)
    reloaded = cost_profile.load(key)
    assert reloaded.corrections == 1 and reloaded.verify[2] < slow[2] / 2


def test_a_machine_that_became_slower_than_its_profile_is_profiled_again():
    fast = profile(n1=26, n2=32, n3=39)
    slowed = {1: 0.132, 2: 0.127}  # five times dearer at one row, four at two (memory throttled)
    assert not cost_profile.outgrown_by_live(fast, slowed, {1: 3, 2: 3})  # too few live passes to judge
    assert cost_profile.outgrown_by_live(fast, slowed, {1: 20, 2: 20})
    assert not cost_profile.outgrown_by_live(fast, {1: 0.031, 2: 0.037}, {1: 20, 2: 20})  # live averages' usual margin
    assert not cost_profile.outgrown_by_live(fast, {1: 0.132, 2: 0.037}, {1: 20, 2: 20})  # one size only
    assert fast.verify == {1: 0.026, 2: 0.032, 3: 0.039}  # judged, not changed


def test_an_outgrown_profile_is_measured_again_at_the_next_load(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    key = engine._profile_key
    fast = {n: t / 10 for n, t in engine.cost_profile.verify.items()}  # as if profiled on a faster day
    cost_profile.save(key, cost_profile.CostProfile(fast, 0.0001, 0.00001, 1.0))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert engine.cost_profile.cached and engine.cost_profile.verify == pytest.approx(fast)
    engine.complete("one two three one two three one two three", max_new_tokens=40, temperature=0)
    assert cost_profile.load(key) is None  # forgotten
    again = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert not again.cost_profile.cached and again.cost_profile.verify[1] > 2 * fast[1]


def test_verify_passes_are_timed_with_every_rows_logits():
    """A verify pass over n rows asks for n rows of logits (greedy match or rejection sampling at each),
    and the LM head over n rows costs more than over one: the profile must time the pass the verifier
    runs, not a prefill-like pass that keeps only the last row's logits."""

    class Target:
        capacity = 512

        def __init__(self) -> None:
            self.passes: list[tuple[int, int]] = []

        def reset(self) -> None:
            pass

        def rewind(self, length: int) -> None:
            pass

        def forward(self, tokens, num_logits):
            self.passes.append((len(tokens), num_logits))

    class Drafter:
        def profile_fill(self, length: int) -> None:
            pass

        def profile_step(self, rows: int = 1) -> tuple[float, float]:
            return 0.01, 0.001

    target = Target()
    cost_profile.measure(target, Drafter(), max_tokens=4, repeats=1)
    timed = [(rows, logits) for rows, logits in target.passes if rows <= 4]
    assert sorted(set(timed)) == [(1, 1), (2, 2), (3, 3), (4, 4)]


def test_the_drafter_s_second_row_is_profiled():
    """A round whose drafts were all accepted leaves the drafter two tokens to read: the profile times
    that step too, and its catch-up price is what the second row adds (never negative)."""

    class Target:
        capacity = 512

        def reset(self) -> None:
            pass

        def rewind(self, length: int) -> None:
            pass

        def forward(self, tokens, num_logits):
            pass

    class Drafter:
        def profile_fill(self, length: int) -> None:
            pass

        def profile_step(self, rows: int = 1) -> tuple[float, float]:
            return 0.010 + 0.002 * (rows - 1), 0.001

    profile = cost_profile.measure(Target(), Drafter(), max_tokens=2, repeats=2)
    assert profile.draft_body == pytest.approx(0.010)
    assert profile.draft_catch_up == pytest.approx(0.002)


def test_verify_rows_profile_splits_every_row_count_by_bit_width(int4_bundle):
    """The row-cost profiler (``edge_spec.benchmarking.ort_profile``, behind ``verify_rows_profile.py``) must
    attribute every interleaved pass to its row count (it refuses a profile whose passes it cannot match),
    and list matmuls by role and bits."""
    onnx_path = int4_bundle / read_manifest(int4_bundle)["target"]["onnx"]
    profile = profile_rows(onnx_path, threads=1, steps=3, rows=3)
    assert sorted(profile.walls) == sorted(profile.groups) == [1, 2, 3]
    assert all(len(walls) == 3 and min(walls) > 0 for walls in profile.walls.values())
    for groups in profile.groups.values():
        assert any(group.endswith("/4bit") for group in groups), groups
        assert "MatMulNBits" not in groups  # every matmul is attributed to its role and bits
