"""The model's control tokens in raw prompts, and fill-in-the-middle prompts.

Editors send FIM prompts as raw text holding the model's markers (Qwen2.5-Coder:
``<|fim_prefix|>before<|fim_suffix|>after<|fim_middle|>``); each marker reaches the model as its one
token id because the bundle's tokenizer reads every control token of the vocabulary as one token
(:func:`edge_spec.runtime.text.register_control_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_spec.runtime.text import TextTokenizer

# (prefix, suffix, middle) marker names of the families this server knows, all prefix-suffix-middle order
FIM_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
)


@dataclass(frozen=True)
class FimTokens:
    prefix: str
    suffix: str
    middle: str

    def prompt(self, before: str, after: str) -> str:
        """The prompt for filling in between ``before`` and ``after`` (prefix-suffix-middle order)."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


def fim_tokens(tokenizer: TextTokenizer) -> FimTokens | None:
    """The model's FIM markers, or None when its vocabulary has no known set."""
    backend = tokenizer.tokenizer
    for names in FIM_NAMES:
        if all(backend.token_to_id(name) is not None for name in names):
            return FimTokens(*names)
    return None
