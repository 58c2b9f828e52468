"""The suffix cache and the ``suffix`` proposer: the index's matches, majority continuations, what is
kept across requests (memory bound, LRU, the file, a corpus), and exactness through the chain loop."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import ChainConfig, loop_config
from edge_spec.runtime.propose.base import DraftRule
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.copy_rules import CopyRuleRecord
from edge_spec.runtime.propose.suffix import continuation
from edge_spec.runtime.propose.suffix_cache import SuffixCache, index_corpus
from edge_spec.runtime.propose.suffix_index import LEVELS, SuffixIndex
from edge_spec.runtime.schedule.acceptance import AcceptanceCalibration, RequestAcceptance, SequenceCalibration
from edge_spec.runtime.schedule.policy import CostModel
from edge_spec.runtime.schedule.sources import LookupChoice
from edge_spec.runtime.suffix_store import bundle_cache_file, clear_caches, open_suffix_cache
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import chi_square_same_distribution, cli, run


def index_of(*documents: list[int]) -> SuffixIndex:
    index = SuffixIndex(64)
    for document in documents:
        index.extend(document)
        index.end_document()
    return index


def ctx(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, np.int32)


@pytest.mark.parametrize("bits", [6, 20, 31])
def test_a_query_tail_hashes_as_the_index_hashed_its_ngrams(bits):
    """Inserts hash every n-gram vectorised (``_hashes``), a query its tail in plain integers
    (``tail_buckets``): the two must give the same bucket, or nothing cached is ever found."""
    from edge_spec.runtime.propose.suffix_index import _buckets, _hashes, tail_buckets

    rng = np.random.default_rng(3)
    for length in (1, 3, 17, 40):
        context = rng.integers(0, 152_000, length).astype(np.int32)
        found = tail_buckets(context, bits)
        for level, n in enumerate(LEVELS):
            if n > length:
                assert found[level] == -1
                continue
            assert found[level] == int(_buckets(_hashes(context[-n:], n), bits)[0]), (length, n)
    # and a different tail lands elsewhere at the longest levels (the hash sees every token)
    a = rng.integers(0, 152_000, 16).astype(np.int32)
    b = a.copy()
    b[0] += 1
    assert tail_buckets(a, 31)[-1] != tail_buckets(b, 31)[-1]


def test_a_round_s_few_tokens_are_linked_as_one_long_append_links_them():
    """A request's index grows by a round's few tokens at a time (the plain-integer path), a cache by
    whole answers (the vectorised one): both must leave the same chains, or a query finds other
    occurrences depending on how the text arrived."""
    from edge_spec.runtime.propose.suffix_index import SMALL_APPEND

    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 40, 700).astype(np.int32)  # a small vocabulary: many repeats and collisions
    tokens[rng.integers(0, 700, 12)] = -1  # document ends inside the text
    whole, rounds = SuffixIndex(1024), SuffixIndex(1024)
    whole.extend(tokens)
    at = 0
    while at < len(tokens):
        step = int(rng.integers(1, SMALL_APPEND + 1))
        rounds.extend(tokens[at : at + step])
        at += step
    assert rounds.size == whole.size
    for level in range(len(LEVELS)):
        assert np.array_equal(rounds._heads[level], whole._heads[level]), level
        assert np.array_equal(rounds._chains[level], whole._chains[level]), level
    for end in (5, 64, 300, 699):
        query = tokens[max(0, end - 20) : end]
        assert rounds.occurrences(query, exclude_from=end) == whole.occurrences(query, exclude_from=end)


def test_the_longest_level_wins_and_matches_are_measured_exactly():
    # "5 1 2" occurs once; "1 2" twice more, followed by 7 and 8
    index = index_of([9, 1, 2, 7, 3, 1, 2, 8, 4, 4, 4, 4, 5, 1, 2, 6])
    level, follows, lengths = index.occurrences(ctx([0, 0, 3, 5, 1, 2]))
    assert level == 2 and len(follows) == 3
    by_token = {int(index.tokens[f]): m for f, m in zip(follows, lengths)}
    assert by_token == {6: 3, 7: 2, 8: 2}  # "5 1 2" really matched 3 tokens back, the others 2
    level, follows, lengths = index.occurrences(ctx([4, 4, 4, 5, 1, 2]))  # 5 tokens: level 4 has it
    assert level == 4 and [int(index.tokens[f]) for f in follows] == [6] and lengths == [6]


def test_no_match_across_documents_or_past_their_end():
    index = index_of([1, 2, 3], [4, 5, 1, 2])
    level, follows, _ = index.occurrences(ctx([1, 2]))
    assert [int(index.tokens[f]) for f in follows] == [3]  # the second "1 2" ends its document
    assert index.occurrences(ctx([3, 4]))[0] == 0  # "3 | 4" spans a separator


def test_hash_collisions_never_match():
    index = SuffixIndex(64)
    rng = np.random.default_rng(0)
    index.extend(rng.integers(0, 50, 5000))  # 64-bucket tables at first, grown: many collisions on the way
    for _ in range(200):
        query = rng.integers(0, 50, 8).astype(np.int32)
        level, follows, lengths = index.occurrences(query)
        for follow, length in zip(follows, lengths):
            assert length >= level
            assert np.array_equal(index.tokens[follow - length : follow], query[-length:])


def test_majority_continuation_and_its_share():
    # after "1 2": 3 4 twice, 3 5 once -> 3 (share 1), then 4 (share 2/3)
    index = index_of([1, 2, 3, 4, 0], [1, 2, 3, 4, 9], [1, 2, 3, 5, 7])
    tokens, shares, matched, _, _ = continuation(ctx([8, 1, 2]), [index], 4)
    assert tokens[:2] == [3, 4]
    assert shares[0] == 1.0 and shares[1] == pytest.approx(2 / 3)
    assert matched == 2


def test_a_long_match_in_the_cache_outranks_a_short_one_in_the_request():
    request = index_of()
    request.extend([1, 2, 50, 60, 9, 1, 2])  # the request itself: "1 2" followed by 50
    cache = index_of([7, 8, 9, 1, 2, 70, 71])  # an earlier answer: "9 1 2" followed by 70
    tokens, _, matched, positions, cached = continuation(ctx([5, 7, 8, 9, 1, 2]), [request, cache], 2)
    assert tokens == [70, 71] and matched == 5 and positions  # the cache's match is 5 tokens long
    assert cached  # only an earlier answer has it: judged by the cache's own record (schedule.acceptance)
    tokens, _, _, positions, cached = continuation(ctx([6, 1, 2]), [request, cache], 1)
    assert tokens == [50] and positions == [] and not cached  # a 2-token match in the cache is chance
    request.extend([3, 4, 5, 6, 60, 8, 3, 4, 5, 6])
    cache.extend([3, 4, 5, 6, 70])
    tokens, shares, _, positions, cached = continuation(ctx([3, 4, 5, 6]), [request, cache], 1)
    # both match 4 tokens: they vote together (a tie), the request's own occurrence first
    assert tokens == [60] and shares == [0.5] and positions == [] and not cached
    cache.extend([9, 3, 4, 5, 6, 60])
    tokens, shares, _, positions, cached = continuation(ctx([3, 4, 5, 6]), [request, cache], 1)
    assert tokens == [60] and shares == [2 / 3] and positions and not cached  # the request has it too


def test_drafts_only_the_cache_has_are_judged_apart_from_the_requests_own():
    """Another request's answer is a weaker witness than this request's own text: a cache whose drafts
    keep failing (a warm cache of unrelated answers) must not pull down the estimate of copies from
    the prompt, nor the other way round, and a calibration file from before the split keeps its bins."""
    costs = CostModel(draft=0.018, verify={1: 0.048, 2: 0.056, 3: 0.082, 4: 0.100})
    model_rate = (1 + 0.8) / costs.round_cost(1)  # the drafter's γ = 1 round at acceptance 0.8
    calibration = AcceptanceCalibration()
    choice = LookupChoice(calibration.sequence, RequestAcceptance(calibration), own_first=True)
    for _ in range(40):
        choice.record_first(8, 1.0, right=False, cached=True)
        choice.record_first(8, 1.0, right=True, cached=False)
    sequence = calibration.sequence
    assert sequence.first_draft(8, 1.0, cached=True) < 0.2 < 0.9 < sequence.first_draft(8, 1.0)
    assert choice.lookup_gamma(4, 8, costs, 4, model_rate, adaptive=True, cached=True) == 0
    assert choice.lookup_gamma(4, 8, costs, 4, model_rate, adaptive=True) >= 1
    old = calibration.to_dict()
    old["sequence_first"] = old["sequence_first"][: len(old["sequence_first"]) // 2]  # the layout before
    again = AcceptanceCalibration.from_dict(old).sequence
    assert again.first_draft(8, 1.0) == pytest.approx(sequence.first_draft(8, 1.0))
    assert again.first_draft(8, 1.0, cached=True) == SequenceCalibration().first_draft(8, 1.0, cached=True)


def lines(heads: range, middle: int) -> list[int]:
    """Lines ``7 k 1 2 middle 8``: a new ``k`` every line, so no match reaches past ``1 2``."""
    return [t for k in heads for t in (7, k, 1, 2, middle, 8)]


@pytest.mark.parametrize("answer_middle", [5, 3])
def test_a_request_follows_the_copy_rule_its_own_text_rewards(answer_middle):
    """Six prompt lines go on ``1 2 3``; the answer's lines go on ``1 2 5``.  Most occurrences of ``1 2``
    say 3 (the longest-match rule's draft), the latest says 5 (prompt lookup's).  Once the answer has
    shown which rule copies it, the suffix proposer drafts by that one; the negative control, an answer
    that goes on as the prompt did, keeps the longest match's drafts."""
    from edge_spec.runtime.propose.suffix import SuffixDrafts

    prompt = lines(range(100, 106), 3)
    answer = [9] + lines(range(200, 206), answer_middle)
    drafts = SuffixDrafts(ProposerContext(vocab_size=300))
    drafts.begin(prompt, {})
    rule = DraftRule(SamplingParams(), np.random.default_rng(0), gamma=2)
    offered = {}
    for end in range(len(prompt) + 1, len(prompt) + len(answer)):
        committed = prompt + answer[: end - len(prompt)]
        if committed[-2:] == [1, 2]:
            offered[end] = drafts.propose(committed, 8, rule).tokens
    last = offered[max(offered)]
    assert last == [answer_middle, 8]
    assert [tokens[0] for tokens in offered.values()][0] == 3  # the first line: the longest-match rule's draft
    if answer_middle == 5:
        assert drafts.rules.prefers_latest()
    else:
        assert not drafts.rules.prefers_latest() and drafts.rules.longest == drafts.rules.latest == 0


def test_copy_rules_are_credited_only_once_the_answer_decides_between_them():
    rules = CopyRuleRecord()
    rules.offer(3, longest=[4, 5, 6], latest=[4, 5, 9])
    rules.settle([0, 1, 2, 4, 5])  # both still match every token known so far: undecided
    assert rules.pending and rules.longest == rules.latest == 0
    rules.settle([0, 1, 2, 4, 5, 9])
    assert not rules.pending and rules.latest == 3 and rules.longest == 2 and rules.prefers_latest()
    rules.offer(6, longest=[1], latest=[1])  # identical drafts tell nothing
    assert not rules.pending


def test_the_request_never_matches_its_own_end():
    request = SuffixIndex()
    request.extend([4, 4])
    assert continuation(ctx([4, 4]), [request], 3)[0] == []
    request.extend([4])
    assert continuation(ctx([4, 4, 4]), [request], 3)[0] == [4]


def test_memory_is_bounded_and_the_least_recently_used_answers_go_first():
    cache = SuffixCache(capacity=2000)
    answers = [[1000 * (i + 1) + j for j in range(450)] for i in range(5)]
    for answer in answers[:4]:
        cache.remember([1, 2, 3], answer)  # 3 + 450 + a separator each
    cache.used([cache.documents[0].start + 3 + 5])  # the oldest answer was drafted from: it stays
    cache.remember([1, 2, 3], answers[4])  # past 2000 tokens: back to 1500 or less
    assert cache.tokens <= 2000 * 0.75
    kept = {int(cache.index.tokens[d.start + 3]) for d in cache.documents}
    assert answers[0][0] in kept and answers[4][0] in kept and answers[1][0] not in kept
    level, follows, _ = cache.index.occurrences(ctx(answers[0][:4]))
    assert level == 4 and int(cache.index.tokens[follows[0]]) == answers[0][4]


def test_the_file_is_private_survives_a_restart_and_damage_starts_afresh(tmp_path):
    path = tmp_path / "suffix-x.npz"
    cache = SuffixCache(path=path)
    cache.remember([1, 2], [5, 6, 7, 8, 9])
    cache.save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = SuffixCache(path=path)
    assert continuation(ctx([6, 7]), [again.index], 2)[0] == [8, 9]
    path.write_bytes(b"not a cache")
    assert SuffixCache(path=path).tokens == 0
    again.clear()
    assert not path.exists() and again.tokens == 0


def _npz(path, **arrays) -> bytes:
    """An ``.npz`` file holding ``arrays``: a sound zip whose contents are not a cache."""
    np.savez(path, **arrays)
    return path.read_bytes()


def _meta(documents, version=1, clock=3) -> np.ndarray:
    return np.array(json.dumps({"version": version, "clock": clock, "documents": documents}))


def _damaged_files(tmp_path) -> dict[str, bytes]:
    """Damaged suffix cache files: what a crash, a full disk or another program can leave."""
    good = tmp_path / "good.npz"
    cache = SuffixCache(path=good)
    cache.remember([1, 2], [5, 6, 7, 8, 9])
    cache.save()
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    tokens = np.array([1, 2, 5, 6, -1], np.int32)
    one = [[0, 5, 1, "answer", ""]]
    compressed = tmp_path / "compressed.npz"  # random tokens: the members compress to no less than their size
    np.savez_compressed(compressed, tokens=rng.integers(0, 2**31 - 1, 2000, dtype=np.int32), meta=_meta(one))
    bad_stream = bytearray(compressed.read_bytes())
    bad_stream[80:88] = b"\xff" * 8  # the start of the first member's deflate stream: zlib.error
    return {
        "truncated": data[: len(data) // 2],
        "random bytes": rng.integers(0, 256, 4000, dtype=np.uint8).tobytes(),
        "empty": b"",
        "deflate stream damaged": bytes(bad_stream),
        "no tokens": _npz(tmp_path / "a.npz", meta=_meta(one)),
        "object array (pickle)": _npz(tmp_path / "p.npz", tokens=np.array([{"a": 1}], dtype=object), meta=_meta([])),
        "tokens of text": _npz(tmp_path / "b.npz", tokens=np.array(["a", "b"]), meta=_meta(one)),
        "tokens 2-D": _npz(tmp_path / "c.npz", tokens=tokens.reshape(1, 5), meta=_meta(one)),
        "tokens of floats": _npz(tmp_path / "d.npz", tokens=tokens.astype(np.float32) + 0.5, meta=_meta(one)),
        "meta not JSON": _npz(tmp_path / "e.npz", tokens=tokens, meta=np.array("{not json")),
        "meta a list": _npz(tmp_path / "f.npz", tokens=tokens, meta=np.array("[1, 2]")),
        "meta an array": _npz(tmp_path / "g.npz", tokens=tokens, meta=np.array([1, 2])),
        "documents overlap": _npz(
            tmp_path / "h.npz", tokens=tokens, meta=_meta([[0, 5, 1, "answer", ""], [2, 5, 1, "answer", ""]])
        ),
        "documents leave a gap": _npz(tmp_path / "i.npz", tokens=tokens, meta=_meta([[2, 5, 1, "answer", ""]])),
        "document of strings": _npz(tmp_path / "j.npz", tokens=tokens, meta=_meta([["0", "5", 1, "answer", ""]])),
        "document too short": _npz(tmp_path / "k.npz", tokens=tokens, meta=_meta([[0, 5]])),
        "unknown kind": _npz(tmp_path / "l.npz", tokens=tokens, meta=_meta([[0, 5, 1, "secret", ""]])),
        "ids past the vocabulary": _npz(
            tmp_path / "m.npz", tokens=np.array([1, 2, 10**6, -1], np.int32), meta=_meta([[0, 4, 1, "answer", ""]])
        ),
        "negative ids": _npz(
            tmp_path / "n.npz", tokens=np.array([1, -7, 3, -1], np.int32), meta=_meta([[0, 4, 1, "answer", ""]])
        ),
        "clock not a number": _npz(tmp_path / "o.npz", tokens=tokens, meta=_meta(one, clock="x")),
    }


def test_a_damaged_file_is_set_aside_with_one_warning_and_the_cache_starts_empty(tmp_path, caplog):
    """A cache is disposable: whatever a damaged file holds, the cache starts empty, the file is kept
    aside (renamed, for a look) and said in one line, and the next save writes a sound file."""
    cases = _damaged_files(tmp_path)
    for name, content in cases.items():
        directory = tmp_path / name.replace(" ", "-")
        directory.mkdir()
        path = directory / "suffix-x.npz"
        path.write_bytes(content)
        caplog.clear()
        cache = SuffixCache(path=path, vocab_size=1000)
        assert cache.tokens == 0 and cache.documents == [], name
        aside = list(directory.glob("suffix-x.npz.damaged-*"))
        assert len(aside) == 1 and aside[0].read_bytes() == content and not path.exists(), name
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "\n" not in warnings[0].getMessage(), name
        assert str(path) in warnings[0].getMessage() and aside[0].name in warnings[0].getMessage(), name
        cache.remember([1, 2], [5, 6, 7, 8, 9])
        cache.save()
        again = SuffixCache(path=path, vocab_size=1000)
        assert again.tokens == cache.tokens and continuation(ctx([6, 7]), [again.index], 2)[0] == [8, 9], name
        # damaged again: the newer copy replaces the older one (set-aside copies do not pile up)
        path.write_bytes(content)
        assert SuffixCache(path=path, vocab_size=1000).tokens == 0
        assert len(list(directory.glob("suffix-x.npz.damaged-*"))) == 1, name
        damaged = list(directory.glob("suffix-x.npz.damaged-*"))
        assert clear_caches(directory) == damaged and not list(directory.iterdir()), name  # cache clear: it too


def test_a_sound_file_of_another_version_or_a_missing_one_starts_empty_quietly(tmp_path, caplog):
    path = tmp_path / "suffix-x.npz"
    assert SuffixCache(path=path).tokens == 0
    np.savez(path, tokens=np.array([1, 2, 5, 6, -1], np.int32), meta=_meta([[0, 5, 1, "answer", ""]], version=99))
    assert SuffixCache(path=path).tokens == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert not list(tmp_path.glob("*.damaged-*"))


@pytest.mark.slow
def test_generate_with_a_damaged_cache_answers_and_warns_once(fp32_bundle, tmp_path):
    directory = tmp_path / "cache"
    first = cli("generate", str(fp32_bundle), "one two three", "--cache-dir", str(directory), "--max-tokens", "8")
    assert first.returncode == 0, first.stderr
    (path,) = directory.glob("suffix-*.npz")
    sound = path.read_bytes()
    for content in (sound[: len(sound) // 2], os.urandom(3000)):
        path.write_bytes(content)
        result = cli("generate", str(fp32_bundle), "hi", "--cache-dir", str(directory), "--max-tokens", "4")
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        lines = [line for line in result.stderr.splitlines() if "damaged" in line]
        assert len(lines) == 1 and "set aside" in lines[0], result.stderr
        assert path.exists()  # the answer was kept in a new, sound file
        assert len(list(directory.glob("suffix-*.npz.damaged-*"))) == 1


def test_a_corpus_is_read_once_and_changed_files_again(tmp_path):
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("ignored")
    (root / "a.py").write_text("alpha beta gamma")
    (root / "b.md").write_text("delta epsilon")
    (root / "image.png").write_bytes(b"\x89PNG")
    words = {}

    def encode(text: str) -> list[int]:
        return [words.setdefault(w, len(words) + 10) for w in text.split()]

    cache = SuffixCache()
    assert index_corpus(cache, root, encode) == 2
    assert index_corpus(cache, root, encode) == 0  # nothing changed: nothing read
    (root / "a.py").write_text("alpha beta zeta and more")
    (root / "b.md").unlink()
    assert index_corpus(cache, root, encode) == 1
    tokens = {int(t) for t in cache.index.tokens[: cache.tokens]}
    assert words["zeta"] in tokens and words["gamma"] not in tokens and words["delta"] not in tokens


CORPUS_RUN = """
import json, sys
from pathlib import Path
from edge_spec.runtime.propose.suffix_cache import SuffixCache, index_corpus
from tests.peak_memory import peak_rss_bytes

found = {}
for root in sys.argv[1:]:
    cache = SuffixCache()
    read = index_corpus(cache, Path(root), lambda text: [len(w) for w in text.split()])
    found[Path(root).name] = {"read": read, "tokens": cache.tokens}
print(json.dumps({"found": found, "peak": peak_rss_bytes() // 1024}))
"""
CORPUS_TRAPS = {  # a file the corpus must skip: why, said in its one line
    "fifo": "not a regular file",
    "link to /dev/zero": "not a regular file",
    "link to /dev/urandom": "not a regular file",
    "too large": "larger than 512 KiB",
    "link loop": "unreadable",
}


def test_a_corpus_reads_regular_files_only_within_bounds_and_says_what_it_skipped(tmp_path):
    """Each trap beside a good file, in a child process killed past 20 s (a blocked read or an endless
    one must fail the test, not hang it or swell the test process)."""
    import subprocess
    import sys

    from edge_spec.runtime.propose.suffix_cache import CORPUS_MAX_FILE

    roots = []
    for number, case in enumerate(CORPUS_TRAPS):
        root = tmp_path / f"repo{number}"
        root.mkdir()
        (root / "b.py").write_text("alpha beta gamma")
        if case == "fifo":
            os.mkfifo(root / "a.py")  # opening it to read waits for a writer that never comes
        elif case.startswith("link to"):
            (root / "z.py").symlink_to(case.removeprefix("link to "))  # size 0, endless
        elif case == "too large":
            (root / "big.py").write_text("x = 1\n" * (CORPUS_MAX_FILE // 6 + 1))
        else:
            (root / "c.py").symlink_to("c.py")  # ELOOP
        roots.append(root)
    try:
        result = subprocess.run(
            [sys.executable, "-c", CORPUS_RUN, *map(str, roots)],
            capture_output=True,
            text=True,
            timeout=20,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    except subprocess.TimeoutExpired:
        pytest.fail("reading the corpora took more than 20 s")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == len(roots), lines
    for root, (case, reason), line in zip(roots, CORPUS_TRAPS.items(), lines):
        assert report["found"][root.name] == {"read": 1, "tokens": 4}, case  # b.py: three words, a separator
        assert line == f"corpus {root}: skipped 1 file (1 {reason})", case
    assert report["peak"] < 400 * 1024, f"{report['peak']} KiB at most"


def test_a_corpus_stops_at_its_byte_budget(tmp_path, caplog):
    from edge_spec.runtime.propose.suffix_cache import corpus_budget

    root = tmp_path / "repo"
    root.mkdir()
    cache = SuffixCache(capacity=100_000)
    budget = corpus_budget(cache.capacity)
    text = "word " * 20_000  # 100 kB a file
    count = budget // len(text) + 5
    for i in range(count):
        (root / f"f{i:03}.txt").write_text(text)
    read = index_corpus(cache, root, lambda text: [len(w) for w in text.split()])
    assert read == budget // len(text)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"skipped {count - read} files ({count - read} past the corpus budget of" in line


def test_open_refuses_bad_settings_in_one_line(tmp_path):
    manifest = {"target": {"name": "m", "files": [{"sha256": "ab"}]}, "tokenizer": {}}
    with pytest.raises(EdgeSpecError, match="not a directory"):
        open_suffix_cache(manifest, str.split, corpus=tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(EdgeSpecError, match="not a directory"):
        open_suffix_cache(manifest, str.split, cache_dir=tmp_path / "file")
    with pytest.raises(EdgeSpecError, match="at least 1024"):
        open_suffix_cache(manifest, str.split, capacity=10)
    other = {"target": {"name": "m", "files": [{"sha256": "cd"}]}, "tokenizer": {}}
    assert bundle_cache_file(tmp_path, manifest) != bundle_cache_file(tmp_path, other)
    bundle_cache_file(tmp_path, manifest).write_bytes(b"")
    assert clear_caches(tmp_path) == [bundle_cache_file(tmp_path, manifest)]


def test_the_default_chain_drafts_from_the_suffix_cache():
    assert loop_config("spec").proposers == ("suffix", "model", "guess")
    assert loop_config("spec", suffix=False).proposers == ("lookup", "model", "guess")
    assert loop_config("spec", lookup=False).proposers == ("model", "guess")
    with pytest.raises(EdgeSpecError, match="--suffix-cache does not apply to --mode ar"):
        loop_config("ar", suffix=True)


# ---------------------------------------------------------------------------
# through the loop, on the tiny models
# ---------------------------------------------------------------------------

PROMPTS = ["a b c d a b c d a b", "def f(x): return x def f(x): return", "one two three one two three one"]


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-160")


def run_with_cache(engine, ids, params, n, config, cache, seed=0):
    from edge_spec.runtime.loops.stats import SpecStats
    from tests.helpers import loop_tokens

    stats = SpecStats()
    context = ProposerContext(
        engine.bundle.target.vocab_size, {"model": engine.bundle.active_drafter(config)}, suffix_cache=cache
    )
    rng = np.random.default_rng(seed)
    return list(loop_tokens(config, engine.bundle.target, context, ids, params, rng, n, stats)), stats


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_a_warm_cache_equals_autoregressive(engine, adaptive):
    """The second time an answer is asked for, the cache holds the first: most of it is drafted from
    there, and the answer is still the target's, token for token."""
    config = ChainConfig(gamma=4, adaptive=adaptive, proposers=("suffix", "model", "guess"))
    cache = SuffixCache()
    drafted = 0
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        cold, _ = run_with_cache(engine, ids, SamplingParams(), 40, config, cache)
        cache.remember(ids, cold)
        warm, stats = run_with_cache(engine, ids, SamplingParams(), 40, config, cache)
        assert cold == reference and warm == reference, prompt
        drafted += stats.tally("suffix").accepted
    assert drafted > 40, "the warm cache drafted little: case not exercised"


def test_the_engine_remembers_its_answers_and_keeps_them_when_asked(int4_bundle, tmp_path):
    with Engine.from_bundle(int4_bundle, threads=1, draft_head="trim-160", cache_dir=tmp_path) as first:
        answer = "".join(first.generate("one two three", max_new_tokens=12))
        assert first.bundle.suffix_cache.tokens >= len(first.last_token_ids)
    files = list(tmp_path.glob("suffix-*.npz"))
    assert len(files) == 1
    with Engine.from_bundle(int4_bundle, threads=1, draft_head="trim-160", cache_dir=tmp_path) as second:
        assert second.bundle.suffix_cache.tokens == first.bundle.suffix_cache.tokens
        assert "".join(second.generate("one two three", max_new_tokens=12)) == answer
    with Engine.from_bundle(int4_bundle, threads=1, draft_head="trim-160") as private:
        assert private.bundle.suffix_cache.tokens == 0 and private.bundle.suffix_cache.path is None


def test_a_busy_engine_writes_its_cache_at_most_every_interval_and_on_close(int4_bundle, tmp_path):
    import weakref

    from edge_spec.runtime.propose import suffix_cache

    def on_disk(path) -> int:
        return SuffixCache(2000, path).tokens

    with Engine.from_bundle(int4_bundle, threads=1, draft_head="trim-160", cache_dir=tmp_path) as engine:
        path = engine.bundle.suffix_cache.path
        engine.complete("one two three", max_new_tokens=12)
        first = engine.bundle.suffix_cache.tokens
        assert on_disk(path) == first > 0  # the process's first answer is written at once
        engine.complete("four five six", max_new_tokens=12)
        assert engine.bundle.suffix_cache.tokens > first and on_disk(path) == first  # the next waits for the interval
    assert on_disk(path) == engine.bundle.suffix_cache.tokens  # close wrote it
    # a process that never closes its engine writes the rest when it exits
    cache = SuffixCache(2000, tmp_path / "exit.npz")
    cache.remember([1, 2, 3], [4, 5, 6, 7])
    cache.save()
    cache.remember([1, 2, 3], [8, 9, 10, 11])
    cache.save(throttled=True)
    assert on_disk(tmp_path / "exit.npz") < cache.tokens
    suffix_cache._save_at_exit(weakref.ref(cache))
    assert on_disk(tmp_path / "exit.npz") == cache.tokens


@pytest.mark.slow
def test_sampled_with_suffix_drafts_matches_target_distribution(engine):
    """A cache holding several continuations of the prompt: sampled answers drafted from it follow the
    target's distribution (suffix drafts are verified against a point mass, as lookup's are); a
    negative control drawn from the wrong temperature must fail the same test."""
    params = SamplingParams(temperature=1.0)
    ids = engine.bundle.tokenizer.encode(PROMPTS[0])
    cache = SuffixCache()
    for seed in range(6):
        cache.remember(ids, run(engine, ids, params, 8, None, seed=100 + seed)[0])
    config = ChainConfig(gamma=2, adaptive=False, proposers=("suffix", "model"))
    n = 1500
    ar = [tuple(run(engine, ids, params, 3, None, seed=s)[0]) for s in range(n)]
    spec, drafted = [], 0
    for s in range(n):
        tokens, stats = run_with_cache(engine, ids, params, 3, config, cache, seed=10**6 + s)
        spec.append(tuple(tokens))
        drafted += stats.tally("suffix").rounds
    assert drafted > n // 2
    assert chi_square_same_distribution(ar, spec) > 1e-3
    colder = [tuple(run(engine, ids, SamplingParams(temperature=0.6), 3, None, seed=s)[0]) for s in range(n)]
    assert chi_square_same_distribution(ar, colder) < 1e-3


def test_levels_are_increasing():
    assert list(LEVELS) == sorted(LEVELS) and LEVELS[0] >= 2
