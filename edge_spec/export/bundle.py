"""``edge-spec export``: target + drafter sources -> one bundle directory (see ``edge_spec.manifest``).

The steps run one model at a time so that peak memory is one float32 model plus
its quantized copy, not both models at once.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_spec import __version__
from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph_builder import BuildOptions, build_decoder, save_model
from edge_spec.export.sources import LoadedModel, check_same_tokenizer, load_model
from edge_spec.manifest import FORMAT, file_record, write_manifest


@dataclass
class ExportOptions:
    quant: str = "int4"
    block_size: int = 32
    accuracy_level: int = 4
    context_length: int = 4096
    draft_vocab: str = "full"  # "full" | "trim"
    keep: int = 16384  # VocabTrim: head rows kept
    calibration: Path | None = None  # VocabTrim: prompt file (one JSON list or one prompt per line)
    calibration_tokens: int = 96  # VocabTrim: new tokens generated per calibration prompt
    extra: dict = field(default_factory=dict)


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)


def _model_record(model: LoadedModel, bundle_dir: Path, role: str, quant_info: dict) -> dict:
    files = [file_record(bundle_dir, f"{role}/model.onnx"), file_record(bundle_dir, f"{role}/model.onnx.data")]
    return {
        "name": model.name,
        "source": model.source,
        "config": model.weights.config.to_dict(),
        "parameters": model.weights.num_parameters(),
        "quantization": quant_info,
        "onnx": f"{role}/model.onnx",
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
    }


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


def export_decoder(model: LoadedModel, bundle_dir: Path, role: str, options: BuildOptions) -> None:
    out = bundle_dir / role
    out.mkdir(parents=True, exist_ok=True)
    save_model(build_decoder(model.weights, options), out / "model.onnx")


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
    del target
    gc.collect()

    _say(progress, f"loading drafter {draft_source}")
    draft = loader(draft_source)
    check_same_tokenizer(target_tokenizer, draft.tokenizer)
    if draft.weights.config.vocab_size != target_vocab:
        raise EdgeSpecError(
            f"drafter vocabulary size {draft.weights.config.vocab_size} differs from the target's {target_vocab}"
        )
    head: dict = {"kind": "full", "size": target_vocab}
    if options.draft_vocab == "trim":
        from edge_spec.export.vocabtrim import build_trimmed_head

        _say(progress, f"VocabTrim: calibrating with the exported target (keep {options.keep})")
        vocab_ids, calib = build_trimmed_head(staging, options, progress)
        (staging / "draft").mkdir(exist_ok=True)
        np.save(staging / "draft" / "vocab_ids.npy", vocab_ids)
        build = BuildOptions(options.quant, options.block_size, options.accuracy_level, options.context_length,
                             head_rows=vocab_ids)
        head = {"kind": "trim", "size": int(len(vocab_ids)), "vocab_ids": "draft/vocab_ids.npy", "calibration": calib}
    _say(progress, f"building drafter graph ({options.quant}, head {head['kind']} {head['size']})")
    export_decoder(draft, staging, "draft", build)
    draft_record = _model_record(draft, staging, "draft", quant_info)
    draft_record["head"] = head
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
