"""A model drafter is one ``DrafterSpec`` plus one line in ``propose.drafters.DRAFTERS``: here a test drafter
(the tiny drafter model again, under its own name) registers itself in that one line and drafts through the
engine, the schedule and the bench with no other file touched."""

from __future__ import annotations

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.propose import build_proposers
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.drafters import DRAFTERS, ModelSpec
from edge_spec.runtime.schedule.planner import DraftPlanner
from tests.helpers import PROMPTS, chain, greedy_matches_target_only


class TwinSpec(ModelSpec):
    """The bundle's drafter model, loaded a second time as a drafter of its own: its own name, mode label,
    sessions and KV cache, and its own cost-profile and calibration keys."""

    name = "twin"
    label = "twin"
    head_option = None  # no load option picks its head: the bundle's default
    summary = "the drafter model again (a test drafter)"

    def profile_entry(self, manifest: dict, head: str | None) -> dict:
        return {self.name: super().profile_entry(manifest, head)}


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setitem(DRAFTERS, "twin", TwinSpec())  # the one registry line


@pytest.fixture
def engine(twin, int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, config=loop_config("spec", drafter="twin"), exact=True)


def test_it_drafts_through_the_engine_and_greedy_answers_stay_the_target_s(engine, int4_bundle):
    reference = Engine.from_bundle(int4_bundle, threads=1, mode="ar", exact=True)
    for prompt in PROMPTS[:2]:
        messages = [{"role": "user", "content": prompt}]
        got = engine.complete(messages, max_new_tokens=20, temperature=0.0)
        want = reference.complete(messages, max_new_tokens=20, temperature=0.0)
        assert got.token_ids == want.token_ids, prompt
    assert list(engine.bundle.drafters) == ["twin"]  # loaded alone, not the drafter model beside it
    twin = engine.bundle.drafters["twin"]
    assert twin is engine.bundle.active_drafter(engine.config) and twin.name == "twin"
    assert twin.decoder is not engine.bundle.drafter.decoder  # a drafter of its own: its own KV cache
    assert greedy_matches_target_only(engine, chain(3, drafter="twin")) > 0, "the twin never drafted"


def test_the_schedule_plans_its_rounds(engine):
    """The adaptive planner takes it as its model drafter, prices its rounds from its measured costs and
    drafts with it; an adaptive chain's rounds are its."""
    context = ProposerContext(engine.bundle.target.vocab_size, {"twin": engine.bundle.active_drafter(engine.config)})
    proposers = build_proposers(("twin", "guess"), context)
    planner = DraftPlanner(proposers, engine.bundle.target, gamma=4, adaptive=True)
    assert planner.model is proposers[0] and planner.model.name == "twin"
    assert planner._costs() is not None  # the engine measured its step: the policy can plan with it
    config = chain(4, adaptive=True, drafter="twin")
    assert config.proposers[0] == "twin"
    assert greedy_matches_target_only(engine, config) > 0, "the schedule never gave the twin a round"


def test_its_costs_and_calibration_are_keyed_by_its_spec(engine):
    model, twin = loop_config("spec"), loop_config("spec", drafter="twin")
    assert engine.bundle.schedule_memory(twin) is not engine.bundle.schedule_memory(model)
    assert engine.bundle.param_ratio(engine.config) == engine.bundle.param_ratio(
        model
    )  # the same files: the same ratios
    assert engine.bundle.bytes_ratio(engine.config) == engine.bundle.bytes_ratio(model)


def test_the_bench_lists_and_runs_it(engine):
    from edge_spec.cli.bench import mode_groups  # the command's module first: it imports the bench's

    assert ("twin",) in [words for words, _ in mode_groups()]  # a --modes word of its own
    from edge_spec.bench.command import benched_drafters, mode_kinds
    from edge_spec.bench.runs import load_bench_prompts, modes_for, run_bench

    drafters = benched_drafters(mode_kinds("ar,twin"), [])
    assert drafters == {"twin": None}
    default = engine.bundle.head_of("twin")
    modes = modes_for(engine, ["full"], chain(2, adaptive=True), [2], drafters=drafters, spec=False)
    assert [m.name for m in modes if m.name.startswith("twin")] == [f"twin+{default}@γ2", f"twin+{default}"]
    modes = modes_for(engine, ["full"], chain(2, adaptive=True), [2], drafters={"twin": ["full"]}, spec=False)
    twins = [m for m in modes if m.name.startswith("twin")]
    assert [m.name for m in twins] == ["twin@γ2", "twin"]  # its full head: its label alone
    assert all(m.config.proposers[0] == "twin" and m.drafter_head == "full" for m in twins)
    result = run_bench(engine, load_bench_prompts(None, ["code"], 1), modes, temperatures=[0.0], max_new_tokens=12)
    runs = [r for r in result["records"] if r["mode"].startswith("twin")]
    assert len(runs) == 2 and all(r["identical_to_ar"] for r in runs)


def test_a_drafter_that_is_not_registered_is_refused_in_one_line(twin):
    with pytest.raises(EdgeSpecError, match="--drafter must be one of model, eagle, twin, not 'triplet'"):
        loop_config("spec", drafter="triplet")


def test_each_registry_entry_is_named_as_its_drafter_drafts(twin):
    """The registry's key is the name ``--drafter`` takes and the source every draft of it carries."""
    assert all(spec.name == name for name, spec in DRAFTERS.items())
