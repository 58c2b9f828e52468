"""What ``edge-spec export`` and ``add-heads`` build, and their defaults: the settings measured best on the
default pair (a SpecVocab drafter head of rank 192 scoring the 65,536 most frequent calibration tokens
with 128 exact candidates per step, plus a 32,768-row VocabTrim head).  The CLI's options take their
defaults and help from here, so a default is written once.

Kept free of the exporter's heavy imports (torch, transformers): the CLI reads it to build its help.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_spec.defaults import DEFAULT_CONTEXT_LENGTH
from edge_spec.errors import EdgeSpecError

DRAFT_VOCAB_MODES = ("full", "trim", "specvocab", "trim+specvocab")
GGUF_BLOCK_MODES = ("target", "both", "none")
#: what each ``--gguf-layout`` asks of the graph builder (``BuildOptions`` fields; docs/methods/gguf.md):
#: ``lean`` is ``fast`` with the LM head at 4 bits and its best rows per position scored again at 8 bits
LEAN_RESCORED_ROWS = 64
GGUF_LAYOUTS: dict[str, dict] = {
    "fast": {},
    "lean": {"head_rescore": LEAN_RESCORED_ROWS},
    "exact": {"carry_exact": True},
    "small": {"carry_narrow": True},
    "native": {"carry_native": True, "head_rescore": LEAN_RESCORED_ROWS},
    "compact": {"carry_native": True, "head_rescore": LEAN_RESCORED_ROWS, "carry_compact": True},
}


#: ``--gguf-layout auto``: compact where edge-spec's native op runs on the exporting machine, else lean: a bundle
#: converted at each load there is slower.  ``native`` is the faithful layout one flag away.
AUTO_LAYOUT = "auto"
AUTO_NATIVE_LAYOUT = "compact"


def layout_settings(layout: str | None) -> dict:
    """The ``BuildOptions`` fields of ``layout`` (a manifest without one: ``exact``, as such bundles were built)."""
    return GGUF_LAYOUTS[layout or "exact"]


def layout_name(
    carry_exact: bool, carry_narrow: bool, head_rescore: int, carry_native: bool = False, carry_compact: bool = False
) -> str:
    """The ``--gguf-layout`` that asked for these ``BuildOptions`` fields (the manifest records it)."""
    fields = {
        "carry_exact": carry_exact,
        "carry_narrow": carry_narrow,
        "head_rescore": head_rescore,
        "carry_native": carry_native,
        "carry_compact": carry_compact,
    }
    asked = {name: value for name, value in fields.items() if value}
    return next(name for name, settings in GGUF_LAYOUTS.items() if settings == asked)


@dataclass
class ExportOptions:
    quant: str = "int4"
    block_size: int = 32
    # the drafter's re-quantized blocks: its rounding moves acceptance, not the output, and at 128 its narrow
    # matrices make a draft step cheaper than at 32 by more than the acceptance lost (README, *A cheaper drafter step*)
    draft_block_size: int = 128
    accuracy_level: int = 4
    context_length: int = DEFAULT_CONTEXT_LENGTH
    draft_vocab: str = (
        "specvocab,trim"  # comma list of: full, trim, specvocab, trim+specvocab (first non-full: default)
    )
    keep: tuple[int, ...] = (32768,)  # VocabTrim: head rows kept (one head per value; the first is the default)
    calibration: Path | None = None  # VocabTrim/SpecVocab: prompt file (one JSON list or one prompt per line)
    calibration_tokens: int = 96  # new tokens the target generates per calibration prompt
    rank: tuple[int, ...] = (192,)  # SpecVocab: scorer rank(s) R
    candidates: tuple[int, ...] = (128,)  # SpecVocab: exact-logit candidates per step
    scorer: str = "data"  # SpecVocab scorer fit: "data" (hidden-state weighted SVD) or "svd"
    train_steps: int = 0  # SpecVocab: distillation steps after the closed-form fit
    union_keep: int = 1024  # trim+specvocab: static VocabTrim rows always among the candidates
    scorer_vocab: tuple[int, ...] = (65536,)  # SpecVocab: rows the scorer ranks (top-K calibration tokens; 0 = all)
    gguf_blocks: str = "target"  # which GGUF sources keep their blocks in MatMulNBits: target, both or none
    # carried blocks (GGUF_LAYOUTS, or AUTO_LAYOUT): native (lean, with Q4_K and Q6_K as GGUF's own bytes under
    # the native op, loaded in lean's form where that op cannot run), compact (native with the layers' Q6_K
    # rounded to Q4_K), lean (fast, the LM head at 4 bits with its best rows re-scored at 8), fast, exact or
    # small.  compact reads 5% fewer bytes a token than native at top-1 agreement 0.962 (native 0.987;
    # docs/methods/gguf.md); auto is compact where the native op runs on this machine
    gguf_layout: str = AUTO_LAYOUT
    prompt_reader: bool = False  # a second target graph reading prompts through int8 matmuls (graph.prompt_reader)

    def fitted_to(self, vocab_size: int, hidden_size: int) -> "ExportOptions":
        """These options for a drafter head of ``vocab_size`` rows of ``hidden_size``: a VocabTrim size or a
        scorer universe at least the vocabulary means the whole vocabulary, a scorer rank at least the
        hidden size means that size (the defaults are sized for the default pair; a small model's export
        should not fail on them)."""
        import dataclasses

        keep = tuple(dict.fromkeys(min(k, vocab_size) for k in self.keep_list))
        scorer_vocab = tuple(dict.fromkeys(0 if k >= vocab_size else k for k in self.scorer_vocab))
        rank = tuple(dict.fromkeys(min(r, hidden_size) for r in self.rank))
        return dataclasses.replace(self, keep=keep, scorer_vocab=scorer_vocab, rank=rank)

    @property
    def keep_list(self) -> list[int]:
        return [self.keep] if isinstance(self.keep, int) else list(self.keep)

    @property
    def vocab_modes(self) -> list[str]:
        return [m.strip() for m in self.draft_vocab.split(",") if m.strip()]

    def check(self) -> None:
        if self.quant not in ("int4", "int8", "fp32"):
            raise EdgeSpecError(f"--quant must be int4, int8 or fp32, not {self.quant!r}")
        for flag, size in (("--block-size", self.block_size), ("--draft-block-size", self.draft_block_size)):
            if self.quant != "fp32" and (size < 16 or size & (size - 1)):
                raise EdgeSpecError(f"{flag} must be a power of two, 16 or more (MatMulNBits), not {size}")
        if self.context_length < 16:
            raise EdgeSpecError(f"--context-length must be at least 16 tokens, not {self.context_length}")
        for mode in self.vocab_modes or ["?"]:
            if mode not in DRAFT_VOCAB_MODES:
                raise EdgeSpecError(
                    f"--draft-vocab must be a comma list of {', '.join(DRAFT_VOCAB_MODES)}, not {self.draft_vocab!r}"
                )
        if self.gguf_blocks not in GGUF_BLOCK_MODES:
            raise EdgeSpecError(f"--gguf-blocks must be one of {', '.join(GGUF_BLOCK_MODES)}, not {self.gguf_blocks!r}")
        if self.gguf_layout not in (AUTO_LAYOUT, *GGUF_LAYOUTS):
            raise EdgeSpecError(
                f"--gguf-layout must be one of {', '.join((AUTO_LAYOUT, *GGUF_LAYOUTS))}, not {self.gguf_layout!r}"
            )
        if self.scorer not in ("data", "svd"):
            raise EdgeSpecError(f"--scorer must be 'data' or 'svd', not {self.scorer!r}")
        if min(self.candidates) < 1:
            raise EdgeSpecError("--candidates must be positive")
