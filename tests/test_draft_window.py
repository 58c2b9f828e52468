"""A drafter model reads only the tail of a long prompt (``propose.model.DRAFT_CONTEXT``): its prefill
sits between the first token and the second on the long prompts agents and editors send, and drafts lean on
recent tokens.  What it reads decides speed only: greedy answers stay the target's own."""

from __future__ import annotations

import pytest

from edge_spec.runtime.propose.model import ModelDrafter

WINDOW = 24


@pytest.fixture
def drafter(engine):
    """The spec engine's drafter model with a window of :data:`WINDOW` tokens, restored afterwards."""
    drafter = engine.bundle.active_drafter(engine.config)
    assert isinstance(drafter, ModelDrafter)
    saved = drafter.context
    drafter.context = WINDOW
    drafter.rewind(0)
    yield drafter
    drafter.context = saved
    drafter.rewind(0)


def fed_tokens(drafter: ModelDrafter, monkeypatch) -> list[int]:
    """Counts the tokens each pass of the drafter's body reads from now on."""
    fed: list[int] = []
    forward = drafter.body.forward

    def counted(ids, *args, **kwargs):
        fed.append(len(ids))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(drafter.body, "forward", counted)
    return fed


def long_question(words: int) -> str:
    return "Please repeat these words in order: " + " ".join(f"w{i % 7}" for i in range(words))


def test_a_long_prompt_is_read_from_its_tail_and_the_answer_stays_the_target_s(engine, ar_engine, drafter, monkeypatch):
    question = long_question(40)
    prompt_ids = engine.prompt_ids(question)
    assert len(prompt_ids) > 2 * WINDOW
    fed = fed_tokens(drafter, monkeypatch)
    answer = "".join(engine.generate(question, max_new_tokens=12))
    assert fed[0] == WINDOW  # the prefill: the prompt's last WINDOW tokens, not all of it
    assert drafter.offset == len(prompt_ids) - WINDOW
    committed = list(engine.last_token_ids)
    assert drafter.body.tokens == (prompt_ids + committed)[drafter.offset :][: drafter.body.length]
    assert answer == "".join(ar_engine.generate(question, max_new_tokens=12))
    assert committed == list(ar_engine.last_token_ids)
    assert engine.last_stats.spec is not None and engine.last_stats.spec.draft_steps > 0  # it did draft


def test_the_next_turn_of_a_conversation_reads_only_its_new_tokens(engine, drafter, monkeypatch):
    drafter.context = 2 * WINDOW  # a turn adds about as many tokens as the window holds: it must keep its start
    first = [{"role": "user", "content": long_question(40)}]
    reply = "".join(engine.generate(first, max_new_tokens=6))
    offset = drafter.offset
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]
    second_ids = engine.prompt_ids(second)
    fed = fed_tokens(drafter, monkeypatch)
    "".join(engine.generate(second, max_new_tokens=4))
    assert drafter.offset == offset  # the window kept its start: the cache stays valid
    assert fed[0] < len(second_ids) - offset  # only what the cache lacked
    # a prompt that has nothing in common with the cache starts a new window
    "".join(engine.generate(long_question(60), max_new_tokens=2))
    assert drafter.offset != offset


def test_a_short_prompt_is_read_whole_and_no_window_reads_everything(engine, drafter, monkeypatch):
    short = "Say hi."
    short_ids = engine.prompt_ids(short)
    assert len(short_ids) <= WINDOW
    fed = fed_tokens(drafter, monkeypatch)
    "".join(engine.generate(short, max_new_tokens=2))
    assert drafter.offset == 0 and fed[0] == len(short_ids)
    drafter.context = None  # negative control: without a window the whole long prompt is read
    drafter.rewind(0)
    question = long_question(40)
    fed.clear()
    "".join(engine.generate(question, max_new_tokens=2))
    assert fed[0] == len(engine.prompt_ids(question))


def test_rewinding_before_the_window_forgets_it(engine, drafter):
    "".join(engine.generate(long_question(40), max_new_tokens=2))
    assert drafter.offset > 0
    drafter.rewind(drafter.offset - 1)
    assert drafter.offset == 0 and drafter.body.length == 0
