"""``edge-spec export``: target + drafter sources -> one bundle directory (see ``edge_spec.manifest``).

The steps run one model at a time so that peak memory is one float32 model plus
its quantized copy, not both models at once.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec import __version__
from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph_builder import BuildOptions, build_decoder, build_head, save_model
from edge_spec.export.sources import LoadedModel, check_same_tokenizer, check_source_exists, load_model
from edge_spec.manifest import FORMAT, file_record, write_manifest


@dataclass
class ExportOptions:
    quant: str = "int4"
    block_size: int = 32
    accuracy_level: int = 4
    context_length: int = 4096
    draft_vocab: str = "full"  # "full" | "trim"
    keep: tuple[int, ...] = (16384,)  # VocabTrim: head rows kept (one head per value; the first is the default)
    calibration: Path | None = None  # VocabTrim: prompt file (one JSON list or one prompt per line)
    calibration_tokens: int = 96  # VocabTrim: new tokens generated per calibration prompt

    @property
    def keep_list(self) -> list[int]:
        return [self.keep] if isinstance(self.keep, int) else list(self.keep)


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)


def _model_record(model: LoadedModel, bundle_dir: Path, role: str, quant_info: dict, stem: str = "model") -> dict:
    files = [file_record(bundle_dir, f"{role}/{stem}.onnx"), file_record(bundle_dir, f"{role}/{stem}.onnx.data")]
    return {
        "name": model.name,
        "source": model.source,
        "config": model.weights.config.to_dict(),
        "parameters": model.weights.num_parameters(),
        "quantization": quant_info,
        "onnx": f"{role}/{stem}.onnx",
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
    }


def _export_head(bundle_dir: Path, name: str, lm_head: np.ndarray, vocab_ids: np.ndarray | None,
                 build: BuildOptions) -> dict:
    """Write draft/head_<name>.onnx (+ its vocabulary map) and return its manifest entry."""
    weight = lm_head if vocab_ids is None else lm_head[vocab_ids]
    save_model(build_head(weight, build), bundle_dir / "draft" / f"head_{name}.onnx")
    files = [file_record(bundle_dir, f"draft/head_{name}.onnx"), file_record(bundle_dir, f"draft/head_{name}.onnx.data")]
    entry = {"onnx": f"draft/head_{name}.onnx", "size": int(weight.shape[0]), "parameters": int(weight.size)}
    if vocab_ids is not None:
        np.save(bundle_dir / "draft" / f"vocab_{name}.npy", vocab_ids)
        files.append(file_record(bundle_dir, f"draft/vocab_{name}.npy"))
        entry["vocab_ids"] = f"draft/vocab_{name}.npy"
    entry["files"] = files
    return entry


def save_tokenizer(tokenizer, eos_ids: list[int], bundle_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json: all the runtime needs, without transformers."""
    tokenizer.backend_tokenizer.save(str(bundle_dir / "tokenizer.json"))
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: keep the default one
        template = template.get("default") or next(iter(template.values()))
    config = {
        "chat_template": template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "eos_token_ids": eos_ids,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
    }
    (bundle_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_decoder(model: LoadedModel, bundle_dir: Path, role: str, options: BuildOptions, stem: str = "model") -> None:
    out = bundle_dir / role
    out.mkdir(parents=True, exist_ok=True)
    save_model(build_decoder(model.weights, options), out / f"{stem}.onnx")


def export_bundle(
    target_source: str,
    draft_source: str,
    out_dir: Path,
    options: ExportOptions,
    progress=None,
    *,
    loader=load_model,
) -> dict:
    """Export target and drafter into ``out_dir`` and return the manifest.

    ``loader`` maps a source string to a :class:`LoadedModel` (tests pass
    in-memory models).  ``progress`` is called with one line per step.
    """
    out_dir = Path(out_dir)
    if options.quant not in ("int4", "int8", "fp32"):
        raise EdgeSpecError(f"--quant must be int4, int8 or fp32, not {options.quant!r}")
    if options.draft_vocab not in ("full", "trim"):
        raise EdgeSpecError(f"--draft-vocab must be 'full' or 'trim', not {options.draft_vocab!r}")
    if loader is load_model:
        for source in (target_source, draft_source):
            check_source_exists(source)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.perf_counter()
    quant_info = {
        "weights": options.quant,
        "block_size": options.block_size,
        "accuracy_level": options.accuracy_level,
        "symmetric": True,
        "embedding": "GatherBlockQuantized" if options.quant != "fp32" else "Gather",
    }
    build = BuildOptions(options.quant, options.block_size, options.accuracy_level, options.context_length)

    _say(progress, f"loading target {target_source}")
    target = loader(target_source)
    _say(progress, f"building target graph ({options.quant})")
    export_decoder(target, staging, "target", build)
    save_tokenizer(target.tokenizer, target.eos_token_ids, staging)
    target_record = _model_record(target, staging, "target", quant_info)
    target_tokenizer, target_vocab = target.tokenizer, target.weights.config.vocab_size
    eos_ids = target.eos_token_ids
    special_ids = list(getattr(target_tokenizer, "all_special_ids", []))
    del target
    gc.collect()

    _say(progress, f"loading drafter {draft_source}")
    draft = loader(draft_source)
    check_same_tokenizer(target_tokenizer, draft.tokenizer)
    if draft.weights.config.vocab_size != target_vocab:
        raise EdgeSpecError(
            f"drafter vocabulary size {draft.weights.config.vocab_size} differs from the target's {target_vocab}"
        )
    _say(progress, f"building drafter body ({options.quant})")
    draft_dir = staging / "draft"
    body = BuildOptions(options.quant, options.block_size, options.accuracy_level, options.context_length,
                        build_head=False)
    export_decoder(draft, staging, "draft", body, stem="body")
    draft_record = _model_record(draft, staging, "draft", quant_info, "body")
    lm_head = draft.weights.lm_head
    draft_record["parameters"] -= int(lm_head.size)  # body only; each head records its own
    heads = {"full": _export_head(staging, "full", lm_head, None, build)}
    if options.draft_vocab == "trim":
        from edge_spec.export.vocabtrim import count_target_tokens, load_prompts, select_vocabulary

        prompts = load_prompts(options.calibration)
        _say(progress, f"VocabTrim: generating calibration text with the exported target ({len(prompts)} prompts)")
        counts = count_target_tokens(staging, prompts, options.calibration_tokens, options.context_length,
                                     progress)
        np.save(draft_dir / "token_counts.npy", counts)
        always = list(eos_ids) + list(special_ids)
        for keep in options.keep_list:
            vocab_ids = select_vocabulary(counts, keep, always)
            name = f"trim-{keep}"
            coverage = float(counts[vocab_ids].sum() / max(counts.sum(), 1))
            _say(progress, f"VocabTrim head {name}: covers {coverage:.1%} of calibration tokens")
            heads[name] = _export_head(staging, name, lm_head, vocab_ids, build)
            heads[name]["calibration_coverage"] = coverage
    draft_record["heads"] = heads
    draft_record["default_head"] = f"trim-{options.keep_list[0]}" if options.draft_vocab == "trim" else "full"
    draft_record["files"] += [f for h in heads.values() for f in h.pop("files")]
    draft_record["bytes"] = sum(f["bytes"] for f in draft_record["files"])
    del draft
    gc.collect()

    manifest = {
        "format": FORMAT,
        "edge_spec_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "context_length": options.context_length,
        "target": target_record,
        "draft": draft_record,
        "export_seconds": round(time.perf_counter() - started, 1),
    }
    write_manifest(staging, manifest)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return manifest
