"""Device cost profile: measured once per bundle/head/device, cached, and used to seed the γ policy."""

from __future__ import annotations

from edge_spec.runtime import cost_profile
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.speculative import SpecConfig


def test_profile_is_measured_once_then_read_from_the_cache(int4_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    first = Engine.from_bundle(int4_bundle, threads=1, mode="spec", spec=SpecConfig(gamma=3, adaptive=True))
    assert first.cost_profile is not None and not first.cost_profile.cached
    assert set(first.cost_profile.verify) == {1, 2, 3, 4}
    assert first.cost_profile.draft_body > 0 and first.cost_profile.draft_head > 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    second = Engine.from_bundle(int4_bundle, threads=1, mode="spec", spec=SpecConfig(gamma=3, adaptive=True))
    assert second.cost_profile.cached and second.cost_profile.verify == first.cost_profile.verify
    # the profile seeds the live cost model the policy reads
    assert second.target.recent_seconds()[3] == first.cost_profile.verify[3]
    assert second.draft.step_estimate == first.cost_profile.draft_step


def test_profile_key_depends_on_head_threads_and_gamma(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1)
    keys = {cost_profile.cache_key(engine.manifest, head, "cpu", threads, gamma)
            for head in ("full", "trim-64") for threads in (1, 2) for gamma in (3, 5)}
    assert len(keys) == 8


def test_memory_bound_bytes_ratio_reported(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    extra = engine.complete("def is_prime", max_new_tokens=12).stats.extra
    assert 0 < extra["bytes_ratio"] < 1.5
    assert extra["mbsu_bytes"] == extra["tau"] / (extra["bytes_ratio"] * extra["mean_gamma"] + 1)
