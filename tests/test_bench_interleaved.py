"""The interleaved timing loop behind the A/B studies: who runs when, on which cache, and what is kept."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.bench.interleaved import fastest_prefill, interleaved_passes, random_ids


class RecordingDecoder:
    """Stands in for a Decoder: records every call into a log it shares with the other side."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log, self.length = name, log, 0

    def reset(self) -> None:
        self.length = 0

    def prefill(self, ids: list[int]) -> None:
        self.log.append((self.name, "prefill", len(ids)))
        self.length = len(ids)

    def rewind(self, length: int) -> None:
        self.length = length

    def forward(self, ids: list[int], num_logits: int) -> None:
        self.log.append((self.name, "forward", self.length, tuple(ids), num_logits))
        self.length += len(ids)


def test_each_pass_starts_from_the_context_and_the_sides_take_turns_in_alternating_order():
    log: list[tuple] = []
    decoders = {"a": RecordingDecoder("a", log), "b": RecordingDecoder("b", log)}
    medians = interleaved_passes(decoders, list(range(7)), [1, 3], repeats=3, rng=np.random.default_rng(0), warm_up=1)

    assert [entry for entry in log if entry[1] == "prefill"] == [("a", "prefill", 7), ("b", "prefill", 7)]
    passes = [entry for entry in log if entry[1] == "forward"]
    assert len(passes) == (1 + 3) * 2 * 2  # (warm-up + repeats) x row counts x sides
    assert all(entry[2] == 7 for entry in passes)  # rewound to the context before every pass
    firsts = [passes[i][0] for i in range(0, len(passes), 2)]
    assert firsts == ["a", "a", "b", "b", "a", "a", "b", "b"]  # reversed every other repeat
    for i in range(0, len(passes), 2):  # both sides get the same new tokens, every row asking for logits
        assert passes[i][3] == passes[i + 1][3] and passes[i][4] == len(passes[i][3])
    assert set(medians) == {"a", "b"} and all(set(m) == {1, 3} and min(m.values()) >= 0 for m in medians.values())


def test_prompt_read_passes_ask_for_one_row_of_logits():
    log: list[tuple] = []
    interleaved_passes({"a": RecordingDecoder("a", log)}, [5, 6], [4], 2, np.random.default_rng(0), logit_rows=1)
    assert {entry[4] for entry in log if entry[1] == "forward"} == {1}


def test_fastest_prefill_reads_one_prompt_on_every_side_each_repeat():
    log: list[tuple] = []
    decoders = {"a": RecordingDecoder("a", log), "b": RecordingDecoder("b", log)}
    best = fastest_prefill(decoders, 9, 2, np.random.default_rng(0))
    assert log == [("a", "prefill", 9), ("b", "prefill", 9)] * 2
    assert set(best) == {"a", "b"} and all(0 <= s < float("inf") for s in best.values())


@pytest.mark.parametrize("count", [0, 1, 50])
def test_random_ids_are_plain_ints_from_the_vocabularys_middle(count):
    ids = random_ids(np.random.default_rng(1), count)
    assert len(ids) == count and all(type(t) is int and 100 <= t < 20000 for t in ids)
