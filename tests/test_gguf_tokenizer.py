"""The bundle's tokenizer for a GGUF source splits text as the file's own tokenizer (llama.cpp) does.

Fast tier: a tiny SentencePiece-BPE vocabulary on which merging by score (what the file means) and
Unigram (what transformers builds for Gemma) disagree.  Slow tier: Gemma 3 270M and SmolLM2-135M from
their fetched GGUF files.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.export.gguf import tokenizer as gt

S = gt.SPACE
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# piece: score.  On "abc" merging by score takes "ab" (-1) first and ends at [ab, c]; Unigram maximizes the
# summed score and takes [a, bc] (-10 + -2 beats -1 + -30).
PIECES = {
    S: -5.0,
    "a": -10.0,
    "b": -11.0,
    "c": -30.0,
    "d": -12.0,
    "ab": -1.0,
    "bc": -2.0,
    "cd": -3.0,
    "aa": -4.0,
    S + "a": -6.0,
    S + "ab": -0.5,
    "abcd": -7.0,
}
USER_DEFINED = ["\n", "  "]  # cut from raw text before anything else (Gemma writes its spaces raw)


def tiny_vocab(add_space_prefix: bool = False) -> gt.GGUFVocab:
    tokens = SPECIAL + BYTES + list(PIECES) + USER_DEFINED
    scores = [-1000.0] * 4 + [0.0] * 256 + list(PIECES.values()) + [-1000.0] * len(USER_DEFINED)
    types = [gt.CONTROL] * 4 + [gt.BYTE] * 256 + [gt.NORMAL] * len(PIECES) + [gt.USER_DEFINED] * len(USER_DEFINED)
    return gt.GGUFVocab(
        model="llama",
        pre="default",
        tokens=tokens,
        scores=scores,
        types=types,
        merges=None,
        add_space_prefix=add_space_prefix,
        unk_id=3,
    )


def pieces(vocab: gt.GGUFVocab, ids: list[int]) -> list[str]:
    return [vocab.tokens[i] for i in ids]


def unigram_conversion(vocab: gt.GGUFVocab):
    """What transformers builds from a Gemma GGUF's vocabulary (a Unigram model): the negative control."""
    from transformers.integrations.ggml import GGUFGemmaConverter

    return GGUFGemmaConverter(
        {
            "tokens": list(vocab.tokens),
            "scores": list(vocab.scores),
            "token_type": list(vocab.types),
            "unk_token_id": vocab.unk_id,
            "add_prefix_space": vocab.add_space_prefix,
        }
    ).converted()


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "d", " ", "  ", "\n", "é", "x", "🍕"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(count)]


# -- the reference against hand-worked cases --------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abc", ["ab", "c"]),  # the highest-scoring merge wins, not the best total
        ("aaa", ["aa", "a"]),  # equal scores: the leftmost pair merges
        ("abcd", ["abcd"]),  # merged pieces merge again: ab, cd, then abcd
        ("é", ["<0xC3>", "<0xA9>"]),  # not in the vocabulary: its UTF-8 bytes
        ("a b", ["a", S, "b"]),  # spaces become ▁; "a▁" and "▁b" are not tokens
        (" ab", [S + "ab"]),  # ▁ab (-0.5) beats ab (-1), so ▁a never forms
        ("a\nb", ["a", "\n", "b"]),  # user-defined tokens are cut out first
        ("a  b", ["a", "  ", "b"]),  # so are Gemma's raw runs of spaces
    ],
)
def test_reference_spm_by_hand(text, expected):
    vocab = tiny_vocab()
    assert pieces(vocab, gt.ReferenceTokenizer(vocab).encode(text)) == expected


def test_reference_prefixes_a_space_at_the_start_and_after_special_text():
    vocab = tiny_vocab(add_space_prefix=True)
    ids = gt.ReferenceTokenizer(vocab).encode("ab\nab")
    assert pieces(vocab, ids) == [S + "ab", "\n", S + "ab"]


def test_reference_bpe_matches_a_byte_level_tokenizer():
    """The gpt2-type reference (regex split, byte-level, lowest merge rank first) on a trained byte-level
    BPE whose pre-tokenizer is GPT-2's regex."""
    import json

    from tests import tiny_models

    backend = tiny_models.make_tokenizer().backend_tokenizer
    model = json.loads(backend.to_str())["model"]
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    vocab = gt.GGUFVocab(
        model="gpt2",
        pre="gpt2",
        tokens=[by_id[i] for i in range(len(by_id))],
        scores=None,
        types=None,
        merges=[m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
        add_space_prefix=False,
    )
    reference = gt.ReferenceTokenizer(vocab)
    for text in gt.CHECK_SENTENCES + ("What is 12 * 7? Let's think step by step.",):
        assert reference.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_reference_declines_what_it_does_not_cover():
    reference, why = gt.reference_tokenizer(
        gt.GGUFVocab(
            model="gpt2", pre="deepseek-llm", tokens=["a"], scores=None, types=None, merges=[], add_space_prefix=False
        )
    )
    assert reference is None and "deepseek-llm" in why
    reference, why = gt.reference_tokenizer(
        gt.GGUFVocab(model="bert", pre=None, tokens=["a"], scores=None, types=None, merges=None, add_space_prefix=False)
    )
    assert reference is None and "bert" in why


# -- the shipped tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_shipped_tokenizer_equals_the_reference(add_space_prefix):
    vocab = tiny_vocab(add_space_prefix)
    backend = gt.spm_bpe_tokenizer(vocab)
    reference = gt.ReferenceTokenizer(vocab)
    texts = list(gt.CHECK_SENTENCES) + random_texts(300)
    assert [backend.encode(t, add_special_tokens=False).ids for t in texts] == [reference.encode(t) for t in texts]
    gt.check_matches_reference(backend, reference, "tiny")  # no refusal


def test_shipped_tokenizer_decodes_back_to_the_text():
    vocab = tiny_vocab()
    backend = gt.spm_bpe_tokenizer(vocab)
    for text in ["abc d", "a\n\nb  c", "é🍕 x", "  ab  "]:
        assert backend.decode(backend.encode(text, add_special_tokens=False).ids) == text


def test_merges_rank_by_the_merged_tokens_score():
    vocab = tiny_vocab()
    merges = gt.spm_merges(vocab.tokens, vocab.scores)
    assert merges.index((S, "ab")) < merges.index(("a", "b")) < merges.index(("b", "c")) < merges.index(("a", "a"))
    assert ("ab", "cd") in merges and ("x", "y") not in merges


def test_control_tokens_stay_special_with_their_ids():
    vocab = tiny_vocab()
    backend = gt.spm_bpe_tokenizer(vocab)
    assert backend.encode("<bos>ab", add_special_tokens=False).ids == [2, vocab.tokens.index("ab")]
    assert {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special} == dict(
        enumerate(SPECIAL)
    )


# -- the check ----------------------------------------------------------------------------------------------


def test_check_refuses_the_unigram_conversion_naming_the_first_differing_sentence():
    vocab = tiny_vocab()
    unigram = unigram_conversion(vocab)
    assert pieces(vocab, unigram.encode("abc", add_special_tokens=False).ids) == ["a", "bc"]
    with pytest.raises(EdgeSpecError, match=r"^tiny: .*splits 'xx abc' unlike the GGUF's own") as refused:
        gt.check_matches_reference(
            unigram, gt.ReferenceTokenizer(vocab), "tiny", sentences=("ab d", "xx abc", "bcd abc")
        )
    assert "\n" not in str(refused.value)


def _write_gguf(path: Path, vocab: gt.GGUFVocab) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_bos_token_id(2)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fix_replaces_the_unigram_conversion_from_a_gguf_file(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package (the export extra) writes the GGUF file")
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_vocab()
    path = _write_gguf(tmp_path / "tiny.gguf", vocab)
    assert gt.read_gguf_vocab(path) == vocab
    converted = unigram_conversion(vocab)  # what AutoTokenizer.from_pretrained(gguf_file=...) holds today
    converted.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=converted, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    with pytest.raises(EdgeSpecError, match="splits"):
        gt.check_matches_reference(
            tokenizer.backend_tokenizer, gt.ReferenceTokenizer(vocab), "tiny", sentences=("abc",)
        )
    gt.fix_gguf_tokenizer(path, tokenizer, "tiny")
    assert pieces(vocab, tokenizer("abc", add_special_tokens=False).input_ids) == ["ab", "c"]
    assert tokenizer("abc").input_ids[0] == 2  # the BOS the converted tokenizer added is still added
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)


def test_fix_leaves_an_uncovered_vocabulary_unchecked_and_says_so(tmp_path, caplog):
    pytest.importorskip("gguf", reason="the gguf package (the export extra) writes the GGUF file")
    import dataclasses

    vocab = dataclasses.replace(tiny_vocab(), model="gpt2", pre="deepseek-llm", merges=["a b"])
    path = tmp_path / "other.gguf"
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_merges(vocab.merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    backend = unigram_conversion(tiny_vocab())

    class Holder:
        backend_tokenizer = backend

    with caplog.at_level(logging.WARNING, logger=gt.__name__):
        gt.fix_gguf_tokenizer(path, Holder(), "other")
    assert "not checked" in caplog.text and "deepseek-llm" in caplog.text
    assert Holder.backend_tokenizer is backend


# -- real models (slow) -------------------------------------------------------------------------------------


def _fetched(name: str) -> Path:
    from edge_spec import paths

    entry = paths.load_registry()["models"][name]
    path = paths.models_dir() / "gguf" / entry["gguf"]["file"]
    if not path.is_file():
        pytest.skip(f"{path} is absent (edge-spec fetch {name})")
    return path


def _load_and_fix(path: Path):
    from transformers import AutoTokenizer

    from edge_spec.export.sources.resolve import gguf_parsed_once

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        converted = tokenizer.backend_tokenizer
        gt.fix_gguf_tokenizer(path, tokenizer, path.name)
        vocab = gt.read_gguf_vocab(path)
    return tokenizer, converted, vocab


@pytest.mark.slow
def test_gemma3_ships_the_gguf_tokenization():
    pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF files")
    tokenizer, converted, vocab = _load_and_fix(_fetched("gemma-3-270m"))
    reference = gt.ReferenceTokenizer(vocab)
    backend = tokenizer.backend_tokenizer
    for text in gt.CHECK_SENTENCES:
        assert backend.encode(text, add_special_tokens=False).ids == reference.encode(text), text
    ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    assert ids == [818, 5279, 529, 7001, 563]  # The ▁capital ▁of ▁France ▁is
    assert tokenizer("The capital of France is").input_ids[0] == tokenizer.bos_token_id == 2
    assert backend.token_to_id("<start_of_turn>") == vocab.tokens.index("<start_of_turn>")
    with pytest.raises(EdgeSpecError, match="splits 'The capital of France is'"):  # transformers' Unigram
        gt.check_matches_reference(converted, reference, "gemma")


@pytest.mark.slow
def test_smollm2_ships_the_gguf_tokenization():
    pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF files")
    tokenizer, _, vocab = _load_and_fix(_fetched("smollm2-135m-instruct"))
    assert (vocab.model, vocab.pre) == ("gpt2", "smollm")
    reference = gt.ReferenceTokenizer(vocab)
    for text in gt.CHECK_SENTENCES:
        assert tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids == reference.encode(text), text
