"""Per-loop configuration: each loop gets only the settings it honours; anything else is refused in one line."""

from __future__ import annotations

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, SsdConfig, TreeConfig, loop_config


@pytest.mark.parametrize(
    "mode, settings, flag",
    [
        ("ssd", dict(schedule="adaptive"), "--schedule"),  # ssd drafts a fixed γ
        ("ssd", dict(lookup=True), "--lookup"),  # ssd drafts with the model only
        ("ssd", dict(drafts=2), "--drafts"),
        ("spec", dict(drafts=2, lookup=True), "--lookup"),  # a tree of model drafts
        ("spec", dict(drafts=2, schedule="adaptive"), "--schedule"),  # trees have a fixed shape
        ("spec", dict(drafts=3, min_confidence=0.5), "--min-confidence"),
        ("spec", dict(verifier="rrs"), "--verifier"),  # a single chain has no multi-draft verifier
        ("ar", dict(gamma=2), "--gamma"),
    ],
)
def test_a_setting_the_loop_cannot_honour_is_refused_naming_the_flag(mode, settings, flag):
    with pytest.raises(EdgeSpecError, match=f"^{flag} does not apply to"):
        loop_config(mode, **settings)


def test_unset_settings_give_each_loop_its_own_defaults():
    assert loop_config("ssd", gamma=None, schedule=None, lookup=None, drafts=None) == SsdConfig()
    assert SsdConfig().gamma == 1  # the measured best for SSD on two cores, not the chain's γ = 4
    assert loop_config("spec") == ChainConfig()
    assert loop_config("spec", drafts=1) == ChainConfig()  # one draft is the chain
    assert loop_config("ar") == ArConfig()


def test_the_adaptive_ceiling_is_longer_than_the_fixed_default():
    # the adaptive schedule only drafts long where the curve and the acceptance pay for it (test_policy);
    # a fixed schedule drafts its γ every round, so its default stays short
    adaptive, fixed = loop_config("spec"), loop_config("spec", schedule="fixed")
    assert (adaptive.adaptive, adaptive.gamma) == (True, 32)
    assert (fixed.adaptive, fixed.gamma) == (False, 4)
    assert loop_config("spec", schedule="fixed", gamma=6).gamma == 6  # a given γ wins either way
    assert loop_config("spec", schedule="adaptive", gamma=3).gamma == 3


def test_user_settings_reach_the_loop():
    chain = loop_config("spec", gamma=2, schedule="fixed", lookup=False)
    assert (chain.gamma, chain.adaptive, chain.proposers) == (2, False, ("model", "guess"))
    assert loop_config("spec", lookup=True).proposers[0] == "suffix"
    assert loop_config("spec", lookup=True, suffix=False).proposers[0] == "lookup"
    assert loop_config("spec", drafts=3, gamma=1, verifier="rrs") == TreeConfig(gamma=1, drafts=3, verifier="rrs")
    assert loop_config("ssd", gamma=3).gamma == 3


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: loop_config("spec", gamma=0), "--gamma must be at least 1"),
        (lambda: loop_config("spec", schedule="eager"), "--schedule must be adaptive or fixed"),
        (lambda: loop_config("spec", drafts=2, verifier="beam"), "unknown multi-draft verifier 'beam'"),
        (lambda: loop_config("beam"), "unknown mode 'beam'"),
        (lambda: ChainConfig(proposers=("model", "oracle")), "unknown proposer 'oracle'"),
        (lambda: ChainConfig(min_confidence=1.5), "min_confidence must be in"),
        (lambda: SsdConfig(fan_out=0), "fan_out must be at least 1"),
    ],
)
def test_bad_values_fail_in_one_line(make, message):
    with pytest.raises(EdgeSpecError, match=message):
        make()


def test_tree_and_ssd_configurations_have_no_chain_only_fields():
    with pytest.raises(TypeError):
        TreeConfig(min_confidence=0.5)  # the tree loop does not stop on confidence
    with pytest.raises(TypeError):
        SsdConfig(adaptive=True)  # nor does SSD plan its rounds adaptively
