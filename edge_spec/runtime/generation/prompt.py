"""The prompt's token ids: raw text, or chat messages through the chat template with the tools and the
answer's format told to the model, and the latest part of a conversation that fits the context."""

from __future__ import annotations

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import schema_instruction, with_instruction
from edge_spec.runtime.text import Message, TextTokenizer


def prompt_ids(
    tokenizer: TextTokenizer,
    capacity: int,
    prompt: str | list[Message],
    check_length: bool = True,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
) -> list[int]:
    """Token ids of a raw prompt or of chat messages through the chat template, which gets ``tools``
    (OpenAI's function schemas) when given and a JSON schema ``response_format`` as a system
    instruction (``constrain.instruction``: the model is told the format it is held to);
    ``check_length``: refuse a prompt that leaves no room in a context of ``capacity`` for an answer."""
    if isinstance(prompt, str):
        if tools:
            raise EdgeSpecError("tools need chat messages, not a raw prompt")
        ids = tokenizer.encode(prompt)
    else:
        ids = _encode_chat_told(tokenizer, list(prompt), schema_instruction(response_format), tools)
    if not ids:
        raise EdgeSpecError("empty prompt")
    if check_length and len(ids) >= capacity:
        raise EdgeSpecError(f"prompt is {len(ids)} tokens, longer than the context length {capacity}")
    return ids


def _encode_chat_told(
    tokenizer: TextTokenizer, messages: list[Message], instruction: str | None, tools: list[dict] | None
) -> list[int]:
    """``messages`` through the chat template with ``instruction`` as system text, or in the first user
    message where the template refuses the system message it would be (Gemma 2's, older Mistral's)."""
    told = with_instruction(messages, instruction)
    try:
        return tokenizer.encode_chat(told, tools=tools)
    except EdgeSpecError:
        if instruction is None or (messages and messages[0].get("role") == "system"):
            raise  # nothing added, or the conversation's own system message is what the template refuses
        return tokenizer.encode_chat(with_instruction(messages, instruction, into_user=True), tools=tools)


def fit_messages(
    tokenizer: TextTokenizer, capacity: int, messages: list[Message], reserve: int
) -> tuple[list[Message], int]:
    """The latest part of a conversation whose prompt leaves ``reserve`` tokens of a context of
    ``capacity`` for the answer, and how many messages were dropped to get it.

    A chat outgrows any context: rather than refusing the next turn, drop the oldest messages.
    A leading system message is kept, the last message is always kept, and what remains after the
    system message starts with a user message (some chat templates require that).  Raises
    :class:`EdgeSpecError` when the system and last messages alone leave less than ``reserve``.
    """
    messages = list(messages)
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(system) :]
    dropped = 0
    while (needed := len(prompt_ids(tokenizer, capacity, system + rest, check_length=False))) + reserve > capacity:
        if len(rest) <= 1:
            raise EdgeSpecError(
                f"the prompt needs {needed} tokens even with only the last message; with {reserve} "
                f"kept for the answer the context holds {capacity}: shorten it"
            )
        rest.pop(0)
        dropped += 1
        while len(rest) > 1 and rest[0].get("role") != "user":
            rest.pop(0)
            dropped += 1
    return system + rest, dropped
