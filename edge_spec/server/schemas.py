"""Request bodies → typed records, checked field by field (a wrong field is a 400 naming it).

Fields this server does not know or does not use (``model``, ``user``, ``presence_penalty``, ...) are
ignored rather than refused, since every client sends some.  ``n`` / ``best_of`` > 1 and prompts the
engine cannot take (token arrays, several prompts, non-text message parts) are refused clearly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.verify.sampling import SamplingParams
from edge_spec.server.errors import bad_request

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Sampling:
    """What ``Engine.generate`` takes besides the prompt; ``max_tokens`` None: until EOS or the context is full."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    sampler: str = "rejection"  # not OpenAI's: "coupled" fixes a sampled answer by its seed (SamplingParams)

    def engine_kwargs(self, capacity: int) -> dict:
        return dict(max_new_tokens=self.max_tokens or capacity, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, sampler=self.sampler, stop=list(self.stop))


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # {"role", "content": str}, roles as the chat template expects them
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str  # raw text, no chat template
    sampling: Sampling
    suffix: str | None = None  # fill-in-the-middle: text after the cursor
    echo: bool = False
    stream: bool = False
    include_usage: bool = False


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, else a 400 in OpenAI's shape."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"could not parse the JSON body of the request: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def parse_chat(body: dict) -> ChatRequest:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is a required property", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    return ChatRequest(messages=[_message(m, i) for i, m in enumerate(messages)],
                       sampling=_sampling(body, max_tokens_keys=("max_completion_tokens", "max_tokens")),
                       stream=_stream(body), include_usage=_include_usage(body))


def parse_completion(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is a required property", param="prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (token arrays and several prompts per request are not "
                          "supported)", param="prompt")
    suffix = _typed(body, "suffix", str)
    _only_one(body, "best_of")
    return CompletionRequest(prompt=prompt, sampling=_sampling(body, max_tokens_keys=("max_tokens",), default_max=16),
                             suffix=suffix, echo=bool(_typed(body, "echo", bool)), stream=_stream(body),
                             include_usage=_include_usage(body))


def _message(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}",
                          param=f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported", param=f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text parts", param=f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _sampling(body: dict, max_tokens_keys: tuple[str, ...], default_max: int | None = None) -> Sampling:
    _only_one(body, "n")
    max_tokens = default_max
    for key in max_tokens_keys:  # the first one given wins (max_completion_tokens replaces max_tokens)
        value = _typed(body, key, int)
        if value is not None:
            if value < 1:
                raise bad_request(f"'{key}' must be at least 1", param=key)
            max_tokens = value
            break
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    top_k = _typed(body, "top_k", int)  # not OpenAI's, but vLLM and llama.cpp take it
    seed = _typed(body, "seed", int)
    sampler = _typed(body, "sampler", str)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or an array of strings", param="stop")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                        ("sampler", sampler)):
        if value is not None:
            try:
                SamplingParams(**{name: value})  # the engine's own range checks
            except EdgeSpecError as exc:
                raise bad_request(f"'{name}': {exc}", param=name) from None
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k or 0, seed=seed,
                    stop=stop, sampler=sampler or "rejection")


def _typed(body: dict, key: str, kind: type):
    """``body[key]`` when present and not null, checked to be a ``kind`` (bool is no int here)."""
    value = body.get(key)
    if value is None:
        return None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad_request(f"'{key}' must be {_KIND_NAMES[kind]}", param=key)
    return value


_KIND_NAMES = {int: "an integer", str: "a string", bool: "a boolean", dict: "an object"}


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{key}' must be a number", param=key)
    return float(value)


def _only_one(body: dict, key: str) -> None:
    value = _typed(body, key, int)
    if value is not None and value != 1:
        raise bad_request(f"'{key}' must be 1: this server generates one choice per request (send {value} "
                          "requests instead)", param=key)


def _stream(body: dict) -> bool:
    return bool(_typed(body, "stream", bool))


def _include_usage(body: dict) -> bool:
    options = _typed(body, "stream_options", dict) or {}
    return bool(_typed(options, "include_usage", bool))
