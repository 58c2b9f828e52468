"""Resolve a model source (registry name, GGUF file, Hugging Face directory or hub id) into weights + tokenizer.

The config and tokenizer come from transformers for every kind of source, and so do the weights'
names and values, read one tensor at a time when the graph builder needs them, so that the whole
float32 model never exists: a GGUF file's as transformers' GGUF loader reads them (``gguf/tensors.py``),
a Hugging Face directory's from its safetensors files (``checkpoint.py``).  A hub id, or a directory
whose files are not the model's parameters by name, is loaded whole by ``from_pretrained``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph.weights import DecoderWeights, weights_from_state_dict

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    name: str
    source: str
    weights: DecoderWeights
    tokenizer: object  # transformers.PreTrainedTokenizerFast
    eos_token_ids: list[int]
    #: for a GGUF source, what keeps its blocks (gguf.carry: a CarryReport, or the GGUFBlocks that are
    #: weights.carried, which check the file's blocks when first asked)
    gguf_carry: object | None = None


def locate_source(source: str) -> tuple[str, str, str | None]:
    """Return (kind, location, gguf_file) with kind in {"gguf", "hf_dir", "hub"}."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise EdgeSpecError(f"{source}: not a GGUF file (expected *.gguf) or a Hugging Face model directory")
        return "gguf", str(path.parent), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return "gguf", str(path), ggufs[0].name
            raise EdgeSpecError(f"{source}: directory has no config.json (not a Hugging Face model directory)")
        return "hf_dir", str(path), None
    from edge_spec import fetch

    registry = fetch.load_registry()
    if source in registry["models"]:
        entry = registry["models"][source]
        if "gguf" not in entry and entry.get("hub_id"):  # no offline copy: the hub, given a network
            return "hub", entry["hub_id"], None
        gguf_path = fetch.fetch_gguf(source)
        return "gguf", str(gguf_path.parent), gguf_path.name
    if HUB_ID.match(source) and not source.startswith((".", "/", "~")):
        return "hub", source, None
    known = ", ".join(registry["models"])
    raise EdgeSpecError(f"model source not found: {source!r} (not a file, a directory, a hub id or one of: {known})")


def check_source_exists(source: str) -> None:
    """Fail fast (before minutes of loading the other model) on a local path that does not exist."""
    looks_local = source.lower().endswith(".gguf") or source.startswith((".", "/", "~")) or "\\" in source
    if looks_local and not Path(source).expanduser().exists():
        raise EdgeSpecError(f"model source not found: {source}")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        check_gguf(path)


def _eos_ids(tokenizer, hf_config, generation_config) -> list[int]:
    """All ids that end a turn: generation config's eos list, the tokenizer's eos, and chat end markers."""
    ids: list[int] = []
    for candidate in (
        getattr(generation_config, "eos_token_id", None),
        tokenizer.eos_token_id,
        getattr(hf_config, "eos_token_id", None),
    ):
        if candidate is None:
            continue
        ids.extend(candidate if isinstance(candidate, (list, tuple)) else [candidate])
    # a marker counts where it is a control token: Qwen's vocabulary holds "</s>" as an ordinary word
    added = tokenizer.get_added_vocab()
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>"):
        if marker in added:
            ids.append(added[marker])
    return sorted(set(int(i) for i in ids))


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a file that is not a complete GGUF file (random bytes, empty, a header only,
    cut short): the GGUF reader parses its header and tensor table, mapping the file without reading it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise EdgeSpecError(f"cannot read {path}: {exc.strerror or exc}") from None
    if size == 0:
        raise EdgeSpecError(f"{path}: not a valid GGUF file (it is empty)")
    if magic != b"GGUF":
        raise EdgeSpecError(f"{path}: not a valid GGUF file (no GGUF magic at the start)")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        if not reader.tensors:
            raise ValueError("it holds no tensors")
        end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
        if end > size:
            raise ValueError(f"tensor data runs to byte {end} of a {size}-byte file")
    except ImportError:
        return
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors on bad input
        why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(
            f"{path}: not a valid GGUF file, truncated or damaged ({why}); fetch or download it again"
        ) from None


def gguf_parsed_once():
    """Within it, a GGUF file's header is parsed and converted once per load (:mod:`edge_spec.export.gguf.header`)."""
    from edge_spec.export.gguf.header import parsed_once

    return parsed_once()


def load_model(source: str) -> LoadedModel:
    """Load ``source`` as float32 weights and a fast tokenizer (see module docstring)."""
    with gguf_parsed_once():
        return _load_model(source)


def _load_model(source: str) -> LoadedModel:
    kind, location, gguf_file = locate_source(source)
    if kind == "gguf":
        check_gguf(Path(location) / gguf_file)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        hf_config = AutoConfig.from_pretrained(location, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        streamed = None
        if gguf_file:
            from edge_spec.export.gguf.tensors import GGUFTensors

            state = GGUFTensors(Path(location) / gguf_file, hf_config)
            streamed = state, state.model_class
        elif kind == "hf_dir":
            from edge_spec.export.sources.checkpoint import streamable

            streamed = streamable(Path(location), hf_config)
        if streamed is not None:
            state, model_class = streamed
        else:  # a hub id, or a checkpoint whose files are not the model's parameters by name
            model = AutoModelForCausalLM.from_pretrained(
                location, dtype=torch.float32, low_cpu_mem_usage=True, **kwargs
            )
            state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
            model_class = type(model).__name__
            del model
    except EdgeSpecError:
        raise
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (no network? use a local GGUF file or directory)" if kind == "hub" else ""
        raise EdgeSpecError(f"cannot load {source!r}: {first[:200]}{hint}") from exc
    except (ValueError, IndexError, KeyError) as exc:
        if kind != "gguf":
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(f"cannot load {source!r}: not a valid GGUF file for transformers ({first[:200]})") from exc
    try:
        generation_config = GenerationConfig.from_pretrained(location, **kwargs)
    except Exception:  # GGUF files and many directories carry none
        generation_config = None
    if not getattr(tokenizer, "is_fast", False):
        raise EdgeSpecError(f"{source!r}: only models with a fast (tokenizer.json) tokenizer are supported")
    if gguf_file:  # transformers' conversion of a GGUF vocabulary is not always the file's tokenizer
        from edge_spec.export.gguf.tokenizer import fix_gguf_tokenizer

        fix_gguf_tokenizer(Path(location) / gguf_file, tokenizer, source)
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [model_class]
    weights = weights_from_state_dict(hf_config, state)
    carry = None
    if gguf_file:
        from edge_spec.export.gguf.carry import GGUFBlocks

        weights.carried = carry = GGUFBlocks(Path(location) / gguf_file, weights, state.records)
    name = Path(gguf_file).stem if gguf_file else Path(location).name
    return LoadedModel(name, source, weights, tokenizer, _eos_ids(tokenizer, hf_config, generation_config), carry)


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Refuse a drafter whose tokenizer differs: its token ids would mean other strings to the target, and
    exact verification compares ids.  The refusal names the first ids that differ."""
    t_vocab = {i: s for s, i in target_tok.get_vocab().items()}
    d_vocab = {i: s for s, i in draft_tok.get_vocab().items()}
    differing = [i for i in range(max(max(t_vocab), max(d_vocab)) + 1) if t_vocab.get(i) != d_vocab.get(i)]
    if differing:
        shown = ", ".join(f"{i} (target {t_vocab.get(i)!r} vs drafter {d_vocab.get(i)!r})" for i in differing[:3])
        more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
        raise EdgeSpecError(
            f"drafter tokenizer differs from the target's at token id {shown}{more}: exact verification needs "
            "one vocabulary; pick a drafter of the target's family, or drafting that needs no second tokenizer "
            "(prompt lookup: generate --lookup; a feature-level head: edge-spec train-head)"
        )
