"""Device cost profile: measured once per bundle/head/device, cached, and used to seed the γ policy."""

from __future__ import annotations

import pytest

from edge_spec.runtime.schedule import cost_profile
from edge_spec.runtime.engine import Engine
from tests.helpers import chain


def test_profile_is_measured_once_then_read_from_the_cache(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    first = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert first.cost_profile is not None and not first.cost_profile.cached
    assert set(first.cost_profile.verify) == {1, 2, 3, 4}
    assert first.cost_profile.draft_body > 0 and first.cost_profile.draft_head > 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    second = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    assert second.cost_profile.cached and second.cost_profile.verify == first.cost_profile.verify
    # the profile seeds the live cost model the policy reads
    assert second.target.recent_seconds()[3] == first.cost_profile.verify[3]
    assert second.drafter.step_estimate == first.cost_profile.draft_step


def test_profile_key_depends_on_head_threads_and_gamma(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1)
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
