"""Device cost profile: measured once per bundle/head/device, cached, and used to seed the γ policy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_spec.bench.ort_profile import profile_rows
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model import row_invariance
from edge_spec.runtime.schedule import cost_profile
from edge_spec.runtime.schedule.policy import CostModel
from tests.helpers import chain


def test_profile_is_measured_once_then_read_from_the_cache(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    first = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert first.bundle.cost_profile is not None and not first.bundle.cost_profile.cached
    assert set(first.bundle.cost_profile.verify) == {1, 2, 3, 4}
    assert first.bundle.cost_profile.draft_body > 0 and first.bundle.cost_profile.draft_head > 0
    assert len([p for p in (tmp_path / "costs").glob("*.json") if not p.name.startswith("fact-")]) == 1
    second = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert second.bundle.cost_profile.cached and second.bundle.cost_profile.verify == first.bundle.cost_profile.verify
    # the profile seeds the live cost model the policy reads
    assert second.bundle.target.recent_seconds()[3] == first.bundle.cost_profile.verify[3]
    assert second.bundle.drafter.step_estimate == first.bundle.cost_profile.draft_step
    # and the drafter's second row, the price of a catch-up, from the first round on
    assert first.bundle.cost_profile.draft_catch_up >= 0
    assert second.bundle.cost_profile.draft_catch_up == first.bundle.cost_profile.draft_catch_up
    assert second.bundle.drafter.catch_up_seconds == pytest.approx(max(first.bundle.cost_profile.draft_catch_up, 0.0))


def test_profile_key_depends_on_head_threads_and_gamma(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    heads = engine.bundle.manifest["draft"]["heads"]
    keys = {
        cost_profile.cache_key(engine.bundle.manifest, heads[head], "cpu", threads, gamma)
        for head in ("full", "trim-64")
        for threads in (1, 2)
        for gamma in (3, 5)
    }
    assert len(keys) == 8


def test_profile_and_fact_keys_follow_the_native_kernels(int4_bundle, monkeypatch):
    """Another native kernel (new code, or a switch that picks another of its paths) is measured anew."""
    from edge_spec.native import build

    manifest = read_manifest(int4_bundle)
    before = cost_profile.target_key(manifest, "cpu", 2), cost_profile.cache_key(manifest, {}, "cpu", 2, 32)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_AVX512", "0")
    switched = cost_profile.target_key(manifest, "cpu", 2), cost_profile.cache_key(manifest, {}, "cpu", 2, 32)
    monkeypatch.delenv("EDGE_SPEC_NATIVE_AVX512")
    monkeypatch.setattr(build, "sources_digest", lambda: "another kernel")
    edited = cost_profile.target_key(manifest, "cpu", 2), cost_profile.cache_key(manifest, {}, "cpu", 2, 32)
    monkeypatch.undo()
    assert (cost_profile.target_key(manifest, "cpu", 2), cost_profile.cache_key(manifest, {}, "cpu", 2, 32)) == before
    for other in (switched, edited):
        assert other[0] != before[0] and other[1] != before[1]


def test_memory_bound_bytes_ratio_reported(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    extra = engine.complete("def is_prime", max_new_tokens=12).stats.spec
    assert 0 < extra.bytes_ratio < 1.5
    assert extra.mbsu_bytes == extra.tau / (extra.bytes_ratio * extra.mean_gamma + 1)


def test_profiled_latencies_follow_the_measured_ones():
    """A machine slowed down by other load: the 2-row pass is measured 1.5x its profile, so the profiled
    3-row pass, not measured since, is priced above its profile (else a longer draft would look cheap):
    the 2-row pass's live latency plus the profile's step to three rows, which is less than scaling it
    alike; the 1-row pass, below every measured size, is scaled alike."""
    from edge_spec.runtime.model.decoder import DecoderStats

    stats = DecoderStats()
    for n, seconds in {1: 0.050, 2: 0.056, 3: 0.082}.items():
        stats.seed(n, seconds)
    assert stats.recent_seconds() == {1: 0.050, 2: 0.056, 3: 0.082}
    for _ in range(30):
        stats.add(2, 0.084)
    recent = stats.recent_seconds()
    assert recent[2] == pytest.approx(0.084)
    assert recent[3] == pytest.approx(0.084 + (0.082 - 0.056)) and 0.082 < recent[3] < 0.082 * 1.5
    assert recent[1] == pytest.approx(0.050 * 1.5)


def test_a_size_below_every_measured_one_is_never_priced_above_them():
    """After a long prompt every multi-row pass pays each row's attention, so the measured sizes move far
    from a profile taken over a short cache; the one-row pass, scaled alike, would be priced above the
    two-row pass it is cheaper than, and a round that carries a guess in the second row would look free."""
    from edge_spec.runtime.model.decoder import DecoderStats

    stats = DecoderStats()
    for n, seconds in {1: 0.0331, 2: 0.0331, 3: 0.0364, 4: 0.0383}.items():
        stats.seed(n, seconds)
    for _ in range(10):
        stats.add(2, 0.0400)
        stats.add(3, 0.0467)
        stats.add(4, 0.0498)
    recent = stats.recent_seconds()
    assert recent[1] == pytest.approx(0.0400)  # scaled alike (median ratio 1.28) it would be 0.0425
    for _ in range(10):
        stats.add(1, 0.0294)
    assert stats.recent_seconds()[1] == pytest.approx(0.0294)  # measured: its own price


def test_sizes_not_run_live_are_not_priced_out_of_reach():
    """Live passes over two and three rows cost 6 and 5 ms more than the profile says, those over four rows
    and more what it says (a cost per pass the profile's passes did not pay).  Scaled by the measured sizes'
    ratio, the four-row pass would be priced at 46.5 ms where it costs 39.5: the plan then stops at two
    drafts even when nine drafts in ten are accepted, never runs a four-row pass, and never learns its
    price.  Carried on from the largest size measured below it, it is priced within reach, the plan drafts
    more, and its passes then set the price."""
    from edge_spec.runtime.model.decoder import DecoderStats
    from edge_spec.runtime.schedule.policy import CostModel, plan_round

    profiled = {1: 0.0246, 2: 0.0267, 3: 0.0316, 4: 0.0376, 5: 0.0448, 6: 0.0489, 7: 0.0543, 8: 0.0598}
    stats = DecoderStats()
    for n, seconds in profiled.items():
        stats.seed(n, seconds)
    for _ in range(10):
        stats.add(2, 0.0330)
        stats.add(3, 0.0365)
    recent = stats.recent_seconds()
    assert recent[4] == pytest.approx(0.0365 + (0.0376 - 0.0316))  # the profile's step from 3 to 4 rows
    assert recent[3] < recent[4] < profiled[4] * 0.0330 / 0.0267
    assert plan_round(0.9, 0.9, CostModel(0.008, recent, overhead=0.001), 8).gamma >= 3
    for _ in range(10):
        stats.add(4, 0.0395)
    assert stats.recent_seconds()[4] == pytest.approx(0.0395)


def profile(**verify_ms) -> cost_profile.CostProfile:
    return cost_profile.CostProfile({int(n[1:]): ms / 1e3 for n, ms in verify_ms.items()}, 0.020, 0.001, 1.0)


def test_a_profile_taken_under_load_is_corrected_by_live_passes():
    busy = profile(n1=128, n2=140, n3=170)
    live = {1: 0.050, 2: 0.057}
    assert not cost_profile.correct_from_live(busy, live, {1: 3, 2: 3})  # too few live passes to judge
    assert cost_profile.correct_from_live(busy, live, {1: 20, 2: 20})
    assert busy.verify[1] == pytest.approx(0.050) and busy.verify[2] == pytest.approx(0.057)
    # past the live sizes (too close together for a slope of their own): the old slope (fitted: 21 ms a
    # row) at the level of the nearest live size
    assert busy.verify[3] == pytest.approx(0.057 + 0.021 * 0.057 / 0.140)
    assert busy.estimated == [3]  # for live passes to replace in turn
    assert busy.corrections == 1


def test_a_busy_profile_is_redrawn_through_the_live_sizes():
    """Between sizes measured live, a busy machine's values are noise: straight lines between the live
    latencies replace them; past the live sizes the line goes on with their slope (rising where the busy
    curve was flat, left by passes lowered to a cheaper one over more rows)."""
    busy = {
        1: 0.120,
        2: 0.137,
        3: 0.207,
        4: 0.207,
        5: 0.253,
        6: 0.253,
        7: 0.276,
        8: 0.366,
        9: 0.366,
        10: 0.366,
        11: 0.366,
        12: 0.366,
        13: 0.401,
    }
    live = {2: 0.082, 5: 0.131}
    redrawn = cost_profile.reshape(busy, live)
    assert redrawn[2] == 0.082 and redrawn[5] == 0.131
    assert redrawn[3] == pytest.approx(0.082 + 0.049 / 3) and redrawn[4] == pytest.approx(0.082 + 2 * 0.049 / 3)
    for n in range(6, 14):
        assert redrawn[n] == pytest.approx(0.131 + (n - 5) * 0.049 / 3)
    assert redrawn[1] == pytest.approx(0.082 - 0.049 / 3)
    # one live size: the busy curve's slope (fitted over all its sizes), at the live size's level
    alone = cost_profile.reshape(busy, {2: 0.082})
    slope = np.polyfit(list(busy), list(busy.values()), 1)[0] * 0.082 / 0.137
    assert alone[13] == pytest.approx(0.082 + 11 * slope) and alone[1] == pytest.approx(0.082 - slope)


def test_a_right_profile_is_left_alone():
    right = profile(n1=50, n2=57, n3=82)
    assert not cost_profile.correct_from_live(right, {1: 0.049, 2: 0.060}, {1: 20, 2: 20})
    assert not cost_profile.correct_from_live(right, {1: 0.030, 2: 0.056}, {1: 20, 2: 20})  # one size only
    assert right.verify == {1: 0.050, 2: 0.057, 3: 0.082}


def test_a_corrected_profile_is_what_the_next_load_reads(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    key = engine.bundle._profile_key
    slow = {n: 10 * t for n, t in engine.bundle.cost_profile.verify.items()}  # as if profiled on a busy machine
    cost_profile.save(key, cost_profile.CostProfile(slow, 0.01, 0.001, 1.0))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert engine.bundle.cost_profile.verify == pytest.approx(slow)
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
    monkeypatch.setattr(cost_profile._CpuClock, "others", lambda self, span=1.0: 0.0)  # no other process busy
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    key = engine.bundle._profile_key
    fast = {n: t / 10 for n, t in engine.bundle.cost_profile.verify.items()}  # as if profiled on a faster day
    cost_profile.save(key, cost_profile.CostProfile(fast, 0.0001, 0.00001, 1.0))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert engine.bundle.cost_profile.cached and engine.bundle.cost_profile.verify == pytest.approx(fast)
    engine.complete("one two three one two three one two three", max_new_tokens=40, temperature=0)
    assert cost_profile.load(key) is None  # forgotten
    again = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    assert not again.bundle.cost_profile.cached and again.bundle.cost_profile.verify[1] > 2 * fast[1]


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

        def forward(self, tokens, num_logits, lean=False):
            self.passes.append((len(tokens), num_logits))

    class Drafter:
        def profile_fill(self, length: int) -> None:
            pass

        def profile_step(self, rows: int = 1) -> tuple[float, float]:
            return 0.01, 0.001

    target = Target()
    cost_profile.measure(target, Drafter(), max_tokens=4)
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

        def forward(self, tokens, num_logits, lean=False):
            pass

    class Drafter:
        def profile_fill(self, length: int) -> None:
            pass

        def profile_step(self, rows: int = 1) -> tuple[float, float]:
            return 0.010 + 0.002 * (rows - 1), 0.001

    profile = cost_profile.measure(Target(), Drafter(), max_tokens=2)
    assert profile.draft_body == pytest.approx(0.010)
    assert profile.draft_catch_up == pytest.approx(0.002)


def test_verify_rows_profile_splits_every_row_count_by_bit_width(int4_bundle):
    """The row-cost profiler (``edge_spec.bench.ort_profile``, behind ``verify_rows_profile.py``) must
    attribute every interleaved pass to its row count (it refuses a profile whose passes it cannot match),
    and list matmuls by role and bits."""
    onnx_path = int4_bundle / read_manifest(int4_bundle)["target"]["onnx"]
    profile = profile_rows(onnx_path, threads=1, steps=3, rows=3)
    assert sorted(profile.walls) == sorted(profile.groups) == [1, 2, 3]
    assert all(len(walls) == 3 and min(walls) > 0 for walls in profile.walls.values())
    for groups in profile.groups.values():
        assert any(group.endswith("/4bit") for group in groups), groups
        assert "MatMulNBits" not in groups  # every matmul is attributed to its role and bits
    long_cache = profile_rows(onnx_path, threads=1, steps=2, rows=[1, 4], prompt_tokens=200)
    assert sorted(long_cache.walls) == [1, 4]  # only the row counts asked for, after a 200-token prompt
    assert all(len(walls) == 2 for walls in long_cache.walls.values())


# --- the quick profile ---------------------------------------------------------------------------------

INTEL = {
    1: 68.0,
    2: 77.7,
    3: 95.5,
    4: 108.3,
    5: 131.2,
    6: 135.6,
    7: 150.0,
    8: 168.6,
    9: 182.0,
    10: 194.0,
    11: 206.0,
    12: 218.7,
    13: 233.0,
    14: 248.0,
    15: 262.0,
    16: 277.3,
    17: 292.0,
}  # ms by rows


class CurveTarget:
    """A target whose pass over n rows costs ``curve[n]`` ms times ``load`` (as ``cost_profile._timed``
    reports it, patched by :func:`timed_by`), counting its passes."""

    capacity = 512

    def __init__(self, curve: dict[int, float], load: float = 1.0) -> None:
        self.curve, self.load = curve, load
        self.passes: list[int] = []
        self.last = 0.0

    def reset(self) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass

    def forward(self, tokens, num_logits, lean=False):
        self.passes.append(len(tokens))
        self.last = self.curve.get(len(tokens), 0.0) * self.load / 1e3


class StepDrafter:
    def __init__(self) -> None:
        self.steps = 0

    def profile_fill(self, length: int) -> None:
        pass

    def profile_step(self, rows: int = 1) -> tuple[float, float]:
        self.steps += 1
        return 0.014 + 0.003 * (rows - 1), 0.001


def timed_by(monkeypatch, target: CurveTarget) -> None:
    def timed(fn):
        fn()
        return target.last

    monkeypatch.setattr(cost_profile, "_timed", timed)


def test_the_quick_profile_times_a_few_row_counts_up_and_down(monkeypatch):
    target, drafter = CurveTarget(INTEL), StepDrafter()
    timed_by(monkeypatch, target)
    profile = cost_profile.measure(target, drafter, max_tokens=17)
    timed = [1, 2, 3, 4, 5, 6, 8, 12, 17]
    assert cost_profile.quick_rows(17) == timed
    # one warm-up, then two passes per row count: up the counts and back down
    assert target.passes == [cost_profile.QUICK_LENGTH] + timed + timed[::-1]
    assert drafter.steps <= 2 * len(timed) + 4
    assert profile.quick and sorted(profile.verify) == list(range(1, 18))
    assert profile.estimated == [7, 9, 10, 11, 13, 14, 15, 16]
    for n in timed:  # exact where timed
        assert profile.verify[n] == pytest.approx(INTEL[n] / 1e3)
    costs = [profile.verify[n] for n in range(1, 18)]
    assert costs == sorted(costs)  # non-decreasing
    assert profile.verify[10] == pytest.approx((INTEL[8] + (INTEL[12] - INTEL[8]) / 2) / 1e3)
    assert profile.draft_body == pytest.approx(0.014) and profile.draft_catch_up == pytest.approx(0.003)


class DriftingTarget(CurveTarget):
    """A machine that slows down steadily while it is measured: each pass runs ``drift`` slower than the one
    before it (a neighbour's load arriving, the clock coming off its boost)."""

    def __init__(self, curve: dict[int, float], drift: float) -> None:
        super().__init__(curve)
        self.drift = drift

    def forward(self, tokens, num_logits, lean=False):
        super().forward(tokens, num_logits)
        self.load *= 1.0 + self.drift


def test_a_machine_slowing_down_while_it_is_measured_leaves_the_curve_its_shape(monkeypatch):
    """Timed once each in ascending order, the row counts of a machine that slows down by 2% a pass come
    out ever dearer the more rows they have: four rows 1.34x one row where they cost 1.11x, and the schedule
    then never drafts the rounds whose passes would show it (a size not run live keeps its profiled price).
    Timed in an ascending and a descending sweep, each count's mean carries the same drift."""
    target, drafter = DriftingTarget(INTEL, drift=0.02), StepDrafter()
    timed_by(monkeypatch, target)
    profile = cost_profile.measure(target, drafter, max_tokens=17)
    for n in cost_profile.quick_rows(17):
        assert profile.verify[n] / profile.verify[1] == pytest.approx(INTEL[n] / INTEL[1], rel=0.02)
    steady = CurveTarget(INTEL)
    timed_by(monkeypatch, steady)
    assert cost_profile.measure(steady, StepDrafter(), max_tokens=17).verify == pytest.approx(
        {
            n: ms / 1e3
            for n, ms in cost_profile.interpolate({n: INTEL[n] for n in cost_profile.quick_rows(17)}, 17).items()
        }
    )


def test_a_high_ceiling_is_timed_to_the_quick_limit_and_estimated_past_it(monkeypatch):
    target, drafter = CurveTarget(INTEL), StepDrafter()
    timed_by(monkeypatch, target)
    profile = cost_profile.measure(target, drafter, max_tokens=33)
    assert max(target.passes[1:]) == cost_profile.QUICK_ROWS_MAX == 17  # the first answer waits no longer
    assert sorted(profile.verify) == list(range(1, 34))
    assert set(range(18, 34)) <= set(profile.estimated)
    slope = (INTEL[17] - INTEL[12]) / 5 / 1e3
    assert profile.verify[33] == pytest.approx(INTEL[17] / 1e3 + 16 * slope)  # not as cheap as 17 rows
    costs = [profile.verify[n] for n in range(1, 34)]
    assert costs == sorted(costs) and costs[-1] > costs[16]


def test_interpolation_is_monotone_and_a_pass_slowed_by_other_load_is_lowered():
    timed = {1: 0.068, 2: 0.078, 3: 0.200, 4: 0.108, 8: 0.170}  # the 3-row pass met other load
    curve = cost_profile.interpolate(timed, 10)
    assert curve[1] == 0.068 and curve[2] == 0.078 and curve[4] == 0.108 and curve[8] == 0.170
    assert curve[3] == 0.108  # no dearer than a pass over more rows
    assert [curve[n] for n in range(1, 11)] == sorted(curve.values())
    assert curve[6] == pytest.approx(0.108 + 2 / 4 * (0.170 - 0.108))
    # past the last timed count the last segment goes on: each row costs what the 4..8 rows did
    assert curve[10] == pytest.approx(0.170 + 2 * (0.170 - 0.108) / 4)


def quick(**verify_ms) -> cost_profile.CostProfile:
    """A quick profile timed at the sizes given, the rest of 1..max interpolated."""
    timed = {int(n[1:]): ms / 1e3 for n, ms in verify_ms.items()}
    verify = cost_profile.interpolate(timed, max(timed))
    return cost_profile.CostProfile(
        verify, 0.014, 0.001, 1.0, quick=True, estimated=[n for n in verify if n not in timed]
    )


def test_live_passes_replace_interpolated_values():
    profile = quick(**{f"n{n}": INTEL[n] for n in cost_profile.quick_rows(17)})
    assert profile.estimated == [7, 9, 10, 11, 13, 14, 15, 16]
    level = 1.1  # live moving averages run above a profile of single passes
    live = {n: level * INTEL[n] / 1e3 for n in (2, 3, 4, 9)}
    assert not cost_profile.refine_from_live(profile, live, {n: 3 for n in live})  # too few to judge
    assert cost_profile.refine_from_live(profile, live, {n: 20 for n in live})
    assert profile.verify[9] == pytest.approx(INTEL[9] / 1e3)  # live, at the profile's level
    assert 9 not in profile.estimated and profile.estimated == [7, 10, 11, 13, 14, 15, 16]
    assert profile.verify[2] == INTEL[2] / 1e3 and profile.verify[8] == INTEL[8] / 1e3  # timed sizes stay
    # the estimates left are drawn again through the new point, and stay monotone
    assert INTEL[9] / 1e3 <= profile.verify[10] <= profile.verify[11] <= INTEL[12] / 1e3
    assert profile.corrections == 0
    assert not cost_profile.refine_from_live(profile, live, {n: 20 for n in live})  # nothing new


def test_the_planner_reads_live_latencies_at_every_row_count():
    """Sizes the profile only estimated are seeded like the timed ones, and a live measurement of any
    size replaces its seed; sizes not measured live follow the measured ones: on the line between two of
    them, or past the largest one."""
    from edge_spec.runtime.model.decoder import DecoderStats

    profile = quick(n1=68, n2=78, n3=96, n6=136)
    stats = DecoderStats()
    for n, seconds in profile.verify.items():
        stats.seed(n, seconds)
    for _ in range(10):
        stats.add(5, 0.140)  # an estimated size
        stats.add(3, 0.096)
    recent = stats.recent_seconds()
    assert recent[5] == pytest.approx(0.140) and recent[3] == pytest.approx(0.096)
    assert recent[4] == pytest.approx((0.096 + 0.140) / 2)  # between two sizes measured live: on their line
    # past the largest measured size: scaled by the upper median ratio, or carried on from it where that is less
    scaled = profile.verify[6] * 0.140 / profile.verify[5]
    assert recent[6] == pytest.approx(min(scaled, 0.140 + profile.verify[6] - profile.verify[5]))


QUIET = {n: ms / 1e3 for n, ms in INTEL.items()}


def test_a_busy_machine_s_profile_converges_to_the_quiet_numbers():
    """Measured while other processes took the cores (each size slowed by its own amount), then refined by
    the live passes of successive requests on the quiet machine: every size measured live takes the quiet
    latency, and the estimates between follow them until those are measured too."""
    rng = np.random.default_rng(0)
    busy = {n: t * rng.uniform(1.6, 3.0) for n, t in QUIET.items() if n in cost_profile.quick_rows(17)}
    profile = cost_profile.CostProfile(
        cost_profile.interpolate(busy, 17),
        0.030,
        0.002,
        1.0,
        quick=True,
        estimated=[n for n in range(1, 18) if n not in busy],
    )
    requests = [(2, 3, 4), (1, 5, 6), (7, 8, 9), (10, 11, 12, 13), (14, 15, 16, 17)]
    steps = {1: 0.014, 2: 0.017}
    for number, sizes in enumerate(requests):
        live = {n: QUIET[n] for n in sizes}
        assert cost_profile.refine_from_live(profile, live, {n: 20 for n in sizes}, steps, {1: 50, 2: 20})
        if number == 0:  # replaced, not scaled: the live sizes as they are, the drafter's live step
            assert profile.corrections == 1 and not profile.suspect
            assert profile.draft_body == 0.014 and profile.draft_catch_up == pytest.approx(0.003)
            assert [profile.verify[n] for n in (2, 3, 4)] == [QUIET[2], QUIET[3], QUIET[4]]
            assert profile.estimated == [1, *range(5, 18)]
        costs = [profile.verify[n] for n in range(1, 18)]
        assert costs == sorted(costs)
    assert profile.verify == pytest.approx(QUIET) and profile.estimated == []
    assert profile.corrections == 1  # once replaced, refined like any profile
    assert not cost_profile.refine_from_live(profile, {n: 1.1 * t for n, t in QUIET.items()}, {n: 20 for n in QUIET})


def test_a_profile_that_matches_live_passes_is_kept_as_it_is():
    right = quick(n1=68, n2=78, n3=96, n4=108)
    kept = dict(right.verify)
    for margin in (1.0, 1.05, 1.2, 1.4):  # live moving averages run at or above the profile
        live = {n: margin * t for n, t in kept.items()}
        assert not cost_profile.refine_from_live(right, live, {n: 20 for n in live})
        assert not cost_profile.outgrown_by_live(right, live, {n: 20 for n in live})
    assert not cost_profile.refine_from_live(right, {n: 0.9 * t for n, t in kept.items()}, {n: 20 for n in kept})
    assert right.verify == kept and right.corrections == 0


def test_a_suspect_profile_gives_way_to_any_faster_live_passes():
    """Evidence of load when it was measured (other processes busy, or slower than the profile measured
    before it): live passes that beat it at every size replace it, even by less than a trusted one needs."""
    trusted, suspect = quick(n1=68, n2=78, n3=96), quick(n1=68, n2=78, n3=96)
    suspect.suspect = True
    live = {1: 0.062, 2: 0.072, 3: 0.090}  # 7-9% faster
    assert not cost_profile.refine_from_live(trusted, live, {n: 20 for n in live})
    assert cost_profile.refine_from_live(suspect, live, {n: 20 for n in live})
    assert suspect.verify == live and not suspect.suspect and suspect.corrections == 1
    confirmed = quick(n1=68, n2=78, n3=96)
    confirmed.suspect = True
    assert not cost_profile.refine_from_live(confirmed, {1: 0.070, 2: 0.080, 3: 0.100}, {1: 20, 2: 20, 3: 20})
    assert confirmed.suspect  # not faster anywhere: nothing to replace it with


def test_a_profile_measured_while_others_were_busy_is_suspect(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    target = CurveTarget(INTEL)
    timed_by(monkeypatch, target)
    monkeypatch.setattr(cost_profile._CpuClock, "others", lambda self: 0.0)
    assert not cost_profile.load_or_measure("quiet", target, StepDrafter(), 17).suspect
    monkeypatch.setattr(cost_profile._CpuClock, "others", lambda self: 0.6)
    busy = cost_profile.load_or_measure("busy", target, StepDrafter(), 17)
    assert busy.suspect and busy.busy == 0.6
    assert cost_profile.load("busy").suspect  # saved as such, for the next load's live passes


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc/stat")
def test_other_processes_share_of_the_cpu_is_measured():
    """Another process spinning on a core while the profile would be measured: its share shows (a
    quarter of the CPU or more is what marks a profile suspect); over too short a time nothing is said."""
    assert cost_profile._CpuClock().others() == 0.0  # ticks are 10 ms: too short to tell
    clock = cost_profile._CpuClock()
    spin = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert clock.others() >= min(0.9 / (os.cpu_count() or 1), cost_profile.BUSY)


def test_a_profile_much_slower_than_the_one_before_it_is_suspect(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_profile._CpuClock, "others", lambda self: 0.0)
    target = CurveTarget(INTEL)
    timed_by(monkeypatch, target)
    cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    cost_profile.forget("key")
    target.load = 1.1  # about as fast: not suspect
    assert not cost_profile.load_or_measure("key", target, StepDrafter(), 17).suspect
    cost_profile.forget("key")
    target.load = 2.0
    assert cost_profile.load_or_measure("key", target, StepDrafter(), 17).suspect


def test_the_machine_is_measured_in_a_few_passes_with_a_word_for_the_spinner(int4_bundle, tmp_path, monkeypatch):
    """A first load on the tiny bundle at the default γ ceiling: the quick profile's passes only, announced
    while they run; a second load measures nothing."""
    from edge_spec.runtime.model.decoder import Decoder

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    Engine.from_bundle(int4_bundle, threads=1, mode="ar").bundle.exact_rows()  # the device checks, cached first
    passes = []
    forward = Decoder.forward

    def counted(self, token_ids, *args, **kwargs):
        passes.append((self.model_path.parent.name, len(token_ids)))
        return forward(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(Decoder, "forward", counted)
    said = []
    with cost_profile.on_measure(said.append):
        engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(16, adaptive=True))
    assert said == ["measuring this machine's speed (first run, a few seconds)", ""]
    profile = engine.bundle.cost_profile
    assert profile.quick and not profile.cached and sorted(profile.verify) == list(range(1, 18))
    assert profile.estimated == [7, 9, 10, 11, 13, 14, 15, 16]
    target = engine.bundle.manifest["target"]["onnx"].split("/")[0]
    assert len([p for p in passes if p[0] == target]) == 1 + 2 * len(cost_profile.quick_rows(17))
    passes.clear()
    with cost_profile.on_measure(said.append):
        again = Engine.from_bundle(int4_bundle, threads=1, config=chain(16, adaptive=True))
    assert again.bundle.cost_profile.cached and len(said) == 2
    assert not [p for p in passes if p[0] == target]
    # every size, estimated or timed, seeds the cost model the planner reads
    assert again.bundle.target.recent_seconds()[10] == profile.verify[10]


PROMPTS = ["def is_prime(n):", "one two three one two three one two", "The quick brown fox"]


def test_a_profile_measured_under_load_is_replaced_and_greedy_output_never_changes(int4_bundle, tmp_path, monkeypatch):
    """Profile passes 10 ms slower each (as when other processes hold the cores; the tiny model's passes
    take a fraction of that): the answers are target-only decoding's all the same (the schedule changes
    speed, not tokens), and the live passes of the first request replace the profile with what they
    cost, saved for the next load."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    timed = cost_profile._timed
    monkeypatch.setattr(cost_profile, "_timed", lambda fn: timed(fn) + 0.010)
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True))
    monkeypatch.setattr(cost_profile, "_timed", timed)
    slow = dict(engine.bundle.cost_profile.verify)
    reference = engine.complete(PROMPTS[0], max_new_tokens=40, mode="ar", exact=True).token_ids
    assert engine.complete(PROMPTS[0], max_new_tokens=40, temperature=0).token_ids == reference
    saved = cost_profile.load(engine.bundle._profile_key)
    assert saved.corrections == 1
    live = [n for n in saved.verify if n not in saved.estimated]
    assert live and all(saved.verify[n] < slow[n] / 2 for n in live)
    again = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True))
    assert again.bundle.cost_profile.cached and again.bundle.cost_profile.verify == pytest.approx(saved.verify)
    for prompt in PROMPTS[1:]:
        reference = engine.complete(prompt, max_new_tokens=40, mode="ar", exact=True).token_ids
        assert engine.complete(prompt, max_new_tokens=40, temperature=0).token_ids == reference
        assert again.complete(prompt, max_new_tokens=40, temperature=0).token_ids == reference


def test_once_a_busy_profile_is_replaced_the_planner_plans_with_the_new_one(int4_bundle, tmp_path, monkeypatch):
    """The sizes not measured live are priced from the replaced profile in the same process too, not from
    the busy seeds scaled by how far the live ones moved (which keeps the busy machine's shape)."""
    from edge_spec.runtime.model.decoder import DecoderStats

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True))
    busy = {1: 0.200, 2: 0.300, 3: 0.500, 4: 0.500, 5: 0.900}
    engine.bundle.cost_profile = cost_profile.CostProfile(dict(busy), 0.020, 0.001, 1.0, quick=True, suspect=True)
    engine.bundle.target.stats = stats = DecoderStats()
    engine.bundle._profile_calls = ({}, {})
    for n, seconds in busy.items():
        stats.seed(n, seconds)
    for _ in range(10):
        stats.add(2, 0.050)
        stats.add(4, 0.070)
    engine.bundle.correct_costs(engine.config)
    assert engine.bundle.cost_profile.corrections == 1
    expected = {1: 0.040, 2: 0.050, 3: 0.060, 4: 0.070, 5: 0.080}
    assert engine.bundle.cost_profile.verify == pytest.approx(expected)
    assert engine.bundle.target.recent_seconds() == pytest.approx(expected)


def test_the_device_checks_follow_the_first_answer_and_leave_the_cost_model_alone(int4_bundle, tmp_path, monkeypatch):
    """A first load runs no device check, so the planner's first rounds price every size from the profile;
    the checks run after the first answer, and their passes are not counted as live ones."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True))
    assert engine.bundle.exact_available(check=False) is None  # not checked yet
    planner = engine.bundle.target.recent_seconds()
    assert {n: planner[n] for n in engine.bundle.cost_profile.verify} == engine.bundle.cost_profile.verify
    answered, before_checks = [], []  # tokens of the answer when each check starts; the passes counted then
    check_device, one_row = engine.bundle.check_device, row_invariance.one_row_passes_match
    monkeypatch.setattr(
        engine.bundle,
        "check_device",
        lambda: before_checks.append(dict(engine.bundle.target.stats.calls)) or check_device(),
    )
    monkeypatch.setattr(
        "edge_spec.runtime.loaded.one_row_passes_match",
        lambda decoder: answered.append(len(engine.last_token_ids)) or one_row(decoder),
    )
    engine.complete(PROMPTS[0], max_new_tokens=12)
    assert answered and answered[0] > 0 and engine.bundle.exact_available(check=False) is not None  # after the answer
    assert engine.bundle.target.stats.calls == before_checks[0]


@pytest.mark.parametrize("measure", [True, False])
def test_export_measures_the_machine_so_the_first_load_does_not(monkeypatch, capsys, tmp_path, tiny_pair, measure):
    """``export`` ends by timing the bundle with the default settings, running the exactness checks and
    answering a few prompts: the first load after it reads all three from the cache (the acceptance
    rates the schedule learned included).  ``--no-measure`` leaves them to the first load."""
    import functools

    from edge_spec.export.bundle import build as bundle
    from tests.test_reliability import _cli, _models

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    loader = _models(tiny_pair).__getitem__
    monkeypatch.setattr(bundle, "export_bundle", functools.partial(bundle.export_bundle, loader=loader))
    out = tmp_path / "bundle"
    args = ["export", "--target", "tiny-target", "--draft", "tiny-draft", "--output", str(out), "--quant", "fp32"]
    args += ["--context-length", "256", "--eagle", "none"] + ([] if measure else ["--no-measure"])
    code, _, err = _cli(monkeypatch, capsys, *args)
    assert code in (0, None), err
    assert ("measured this machine for the bundle" in err) == measure, err
    with Engine.from_bundle(out) as engine:
        profile = engine.bundle.cost_profile
        # the export left a profile: read as it is, or (sub-millisecond passes of a tiny model are noisy) measured
        # again because the export's own answers kept losing to it, a verdict only a cached profile can get
        assert (profile.cached or profile.replaced == cost_profile.OUTGROWN_WHY) == measure, profile.replaced
        # the exactness verdicts: read from the cache without checking, or not there yet
        assert (engine.bundle.exact_available(check=False) is not None) == measure
        assert ("greedy" in engine.bundle.schedule_memory(engine.config).calibrations) == measure


def test_the_cost_model_prices_sizes_past_a_profile_as_the_profile_would():
    """A ceiling raised after the profile was taken: the cost model reads the sizes the profile lacks
    on the same line the profile would have drawn to them."""
    timed = {n: INTEL[n] / 1e3 for n in cost_profile.quick_rows(17)}
    longer = cost_profile.interpolate(timed, 33)
    shorter = CostModel(draft=0.014, verify=cost_profile.interpolate(timed, 17))
    assert [shorter.verify_cost(n) for n in range(1, 34)] == pytest.approx([longer[n] for n in range(1, 34)])


# -- where a profile came from, and a busy one measured again ---------------------------------------------


def busy_while_measured(monkeypatch, share: float) -> None:
    """Other processes' share of the CPU while a profile is measured."""
    monkeypatch.setattr(cost_profile._CpuClock, "others", lambda self, span=cost_profile.CPU_CLOCK_SPAN: share)


def test_a_profile_measured_under_load_is_measured_again_at_the_next_quiet_load(tmp_path, monkeypatch):
    """A busy machine's profile (a one-row pass priced at twice its cost) is marked and kept only while the
    machine stays busy; the first load that finds it quiet measures again and keeps the new one."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    target = CurveTarget(INTEL, load=2.0)
    timed_by(monkeypatch, target)
    busy_while_measured(monkeypatch, 0.6)
    busy = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert busy.suspect and busy.busy == 0.6 and busy.verify[1] == pytest.approx(2 * INTEL[1] / 1e3)
    passes = len(target.passes)
    monkeypatch.setattr(cost_profile, "others_now", lambda: 0.5)  # still busy at the next load: kept
    kept = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert kept.cached and kept.suspect and kept.verify == busy.verify and len(target.passes) == passes
    monkeypatch.setattr(cost_profile, "others_now", lambda: 0.02)  # quiet: measured again
    busy_while_measured(monkeypatch, 0.02)
    target.load = 1.0
    quiet = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert not quiet.cached and not quiet.suspect and quiet.verify[1] == pytest.approx(INTEL[1] / 1e3)
    assert quiet.replaced == "the one before it was measured while other processes used 60% of the CPU"
    assert cost_profile.load("key").verify == quiet.verify  # what the next load reads
    assert cost_profile.load_or_measure("key", target, StepDrafter(), 17).cached


def test_a_profile_says_when_and_by_which_command_it_was_measured(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    timed_by(monkeypatch, target := CurveTarget(INTEL))
    busy_while_measured(monkeypatch, 0.0)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/edge-spec", "export", "--target", "x"])
    before = time.time()
    profile = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert before <= profile.measured_at <= time.time()
    assert profile.measured_by == "edge-spec export" and profile.replaced == ""
    saved = cost_profile.load("key")
    assert (saved.measured_at, saved.measured_by) == (profile.measured_at, "edge-spec export")
    monkeypatch.setattr(sys, "argv", ["/usr/lib/python3/site-packages/edge_spec/cli/__main__.py", "info", "--costs"])
    assert cost_profile._command() == "edge-spec info"
    monkeypatch.setattr(sys, "argv", ["my_app.py"])
    assert cost_profile._command() == "my_app.py"


def test_a_profile_dropped_or_measured_again_on_request_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    timed_by(monkeypatch, target := CurveTarget(INTEL))
    busy_while_measured(monkeypatch, 0.0)
    cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    with cost_profile.remeasuring():
        asked = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert not asked.cached and asked.replaced == "as asked (--remeasure)"
    assert cost_profile.load_or_measure("key", target, StepDrafter(), 17).cached  # asked once, not forever
    cost_profile.forget("key")  # live passes kept losing to it
    again = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    assert not again.cached and again.replaced.startswith("live passes ran slower than the one before it")


def test_info_costs_says_where_its_profile_came_from_and_measures_again_when_asked(
    int4_bundle, tmp_path, monkeypatch, capsys
):
    from tests.test_reliability import _cli

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    busy_while_measured(monkeypatch, 0.0)

    def costs(*flags: str) -> str:
        code, out, err = _cli(monkeypatch, capsys, "info", str(int4_bundle), "--costs", "--threads", "1", *flags)
        assert code in (0, None), err
        return next(line for line in out.splitlines() if line.startswith("costs "))

    first = costs()
    assert re.search(r"measured now in [\d.]+ s: the first for these settings", first), first
    assert f"kept in {tmp_path / 'costs'}" in first
    cached = costs()
    assert re.search(r"cached: measured \d{4}-\d\d-\d\d \d\d:\d\d by edge-spec info", cached), cached
    asked = costs("--remeasure")
    assert re.search(r"measured now in [\d.]+ s: as asked \(--remeasure\)", asked), asked
    busy_while_measured(monkeypatch, 0.5)
    marked = costs("--remeasure")
    assert "while other processes used 50% of the CPU: measured again at the next quiet load" in marked, marked


def test_live_passes_slowed_by_other_processes_leave_the_profile_alone(tmp_path, monkeypatch):
    """Live passes 4-5x dearer than the profile while other processes hold the CPU: the machine is busy,
    not slower, and a profile measured now would be a busy one; once they are quiet, the same live
    passes mean a slower machine."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    timed_by(monkeypatch, target := CurveTarget(INTEL))
    busy_while_measured(monkeypatch, 0.0)
    profile = cost_profile.load_or_measure("key", target, StepDrafter(), 17)
    slowed = {n: 4.5 * profile.verify[n] for n in (1, 2)}
    busy_while_measured(monkeypatch, 0.6)  # others' share since the profile was loaded
    assert not cost_profile.outgrown_by_live(profile, slowed, {1: 20, 2: 20})
    busy_while_measured(monkeypatch, 0.05)
    assert cost_profile.outgrown_by_live(profile, slowed, {1: 20, 2: 20})


def test_an_answer_in_another_mode_leaves_the_engine_s_profile_alone(int4_bundle, tmp_path, monkeypatch):
    """The profile is measured for the engine's loop and drafter: an answer asked in another mode (SSD,
    whose verify passes share the cores with drafting ahead) teaches it nothing, while one in the
    engine's own mode corrects a profile taken under load as usual."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    timed = cost_profile._timed
    monkeypatch.setattr(cost_profile, "_timed", lambda fn: timed(fn) + 0.010)
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(4, adaptive=True))
    monkeypatch.setattr(cost_profile, "_timed", timed)
    key = engine.bundle._profile_key
    engine.complete(PROMPTS[0], max_new_tokens=40, temperature=0, mode="ssd")
    assert cost_profile.load(key).corrections == 0
    engine.complete(PROMPTS[0], max_new_tokens=40, temperature=0)
    assert cost_profile.load(key).corrections == 1


def test_the_step_profiler_names_each_matmul_by_its_role():
    """``profile_step.py`` sums kernel time per role; a native SwiGLU node (``layers.N/glu``) carries the
    gate and up rows, so it counts as ``gate_up`` as the separate gate-and-up node does."""
    from edge_spec.bench.ort_profile import role_of

    assert role_of("layers.3.gate_up/out/MatMulNBits") == "gate_up"
    assert role_of("layers.27/glu/MatMulGGUF") == "gate_up"
    assert role_of("layers.0.down/out/MatMulGGUF") == "down"
    assert role_of("lm_head/out/MatMulNBits") == "lm_head"


def test_the_step_profiler_counts_the_bytes_of_native_matmuls_too(tmp_path):
    """A native-layout target reads its weights through ``MatMulGGUF``: the step profiler's bytes per
    projection (and its GB/s) must count those records as it counts ``MatMulNBits``' packed weights, or a
    native bundle's table is empty and its total divides by zero."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edge_spec.bench.ort_profile import matmul_weight_bytes
    from edge_spec.runtime.model.native_attention import QUANTIZED_MATMULS

    records = numpy_helper.from_array(np.zeros(2368 * 6, np.uint8), "layers.0.o.records")
    packed = numpy_helper.from_array(np.zeros((16, 48, 16), np.uint8), "lm_head.qweight")
    scales = numpy_helper.from_array(np.zeros(16 * 48, np.float32), "lm_head.scales")
    gguf = {"domain": "ai.edge_spec", "K": 1536, "N": 16, "type": 12}
    nbits = {"domain": "com.microsoft", "K": 1536, "N": 16, "bits": 4, "block_size": 32}
    nodes = [
        helper.make_node("MatMulGGUF", ["x", records.name], ["h"], name="layers.0.o/out/MatMulGGUF", **gguf),
        helper.make_node(
            "MatMulNBits", ["h", packed.name, scales.name], ["y"], name="lm_head/out/MatMulNBits", **nbits
        ),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1536])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 16])], [records, packed, scales],
    )  # fmt: skip
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    assert matmul_weight_bytes(path) == {
        "layers.0.o/out/MatMulGGUF": 2368 * 6,
        "lm_head/out/MatMulNBits": 16 * 48 * 16 + 16 * 48 * 4,
    }
    assert {"MatMulGGUF", "MatMulNBits"} <= set(QUANTIZED_MATMULS) and "Relu" not in QUANTIZED_MATMULS
