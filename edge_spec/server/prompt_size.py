"""Cheap lower bounds on a prompt's token count, so an oversized prompt is refused without tokenizing it
on the event loop.

``tokenizers``' ``encode`` holds the GIL for its whole run (seconds for a few MiB of text), so even in a
worker thread it would stall the event loop.  Two floors come first:

* characters: no token stands for more input characters than its longest vocabulary entry has, so a
  prompt of C characters is at least C / L tokens.  Free, but weak when the vocabulary has long entries
  (runs of spaces or dashes of 100+ characters).
* a private copy of the tokenizer, run with ``encode_batch`` (which releases the GIL): the exact count of
  a raw prompt (before the beginning-of-sequence token) and the count of the message contents of a chat
  (the template adds its own).  A copy, because the runtime's tokenizer switches its own special-token
  mode while encoding chat contents, which a call running beside it would collide with.

Only a prompt that passes both is counted exactly (by the engine, a prompt of at most about a context's
worth of tokens).  Both floors assume the normalizer does not fold several characters into one and the
chat template keeps every message's content, as the templates of the supported models do.
"""

from __future__ import annotations

from tokenizers import Tokenizer


def longest_token_chars(backend: Tokenizer) -> int:
    """Characters in the longest vocabulary entry, added tokens included (a byte-level entry has one
    character per byte, so never fewer than the text it decodes to)."""
    return max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1) or 1


def prompt_texts(prompt: str | list[dict]) -> list[str]:
    """The texts of a prompt that are tokenized as they are: a raw prompt, or each message's content."""
    if isinstance(prompt, str):
        return [prompt]
    return [m["content"] for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str)]


class PromptFloor:
    """Lower bounds on the token count of prompts for one tokenizer."""

    def __init__(self, backend: Tokenizer) -> None:
        self.token_chars = longest_token_chars(backend)
        self._copy = Tokenizer.from_str(backend.to_str())

    def by_characters(self, prompt: str | list[dict]) -> int:
        """Tokens the prompt has at least, from its length alone (constant time per message)."""
        chars = sum(len(text) for text in prompt_texts(prompt))
        return -(-chars // self.token_chars)

    def by_tokenizing(self, prompt: str | list[dict]) -> int:
        """Tokens the prompt has at least, from tokenizing its texts without holding the GIL (blocking:
        run it in a worker thread)."""
        texts = [text for text in prompt_texts(prompt) if text]
        if not texts:
            return 0
        return sum(len(encoding.ids) for encoding in self._copy.encode_batch(texts, add_special_tokens=False))
