"""Request bodies → typed records, checked field by field (a wrong field is a 400 naming it).

Fields that change nothing in the answer (``user``, ``metadata``, ``store``, ``service_tier``, fields of
future API versions, ...) are accepted and ignored, since every client sends some.  A field that would
change the answer and is not supported (:data:`UNSUPPORTED`: ``logit_bias``, penalties, audio, ...) is
refused with a 400 naming it whenever its value asks for something, never ignored; so are ``n`` /
``best_of`` > 1 and prompts the engine cannot take (token arrays, several prompts, non-text message parts).  ``logprobs`` / ``top_logprobs`` ask for token log-probabilities (:func:`_chat_logprobs`,
:func:`_completion_logprobs`); a value out of range is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field, replace

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint, grammar_for
from edge_spec.runtime.logprobs import MAX_TOP_LOGPROBS
from edge_spec.runtime.options import GenerateOptions
from edge_spec.runtime.verify.sampling import SamplingParams
from edge_spec.server.errors import bad_request

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")


def _never(value) -> bool:
    return False


# field -> (whether its value asks for nothing, why it is refused otherwise); null always asks for nothing
UNSUPPORTED = {
    "logit_bias": (lambda v: v == {}, "this server does not bias token probabilities"),
    "presence_penalty": (lambda v: v == 0, "this server applies no repetition penalties"),
    "frequency_penalty": (lambda v: v == 0, "this server applies no repetition penalties"),
    "audio": (_never, "this model answers in text only"),
    "modalities": (lambda v: v == ["text"], "this model answers in text only"),
    "prediction": (_never, "predicted outputs are not supported"),
    "web_search_options": (_never, "this server does not search the web"),
    "reasoning_effort": (_never, "this model is not a reasoning model"),
    "verbosity": (_never, "this model has no verbosity setting"),
    "functions": (_never, "the deprecated functions API is not supported: send 'tools'"),
    "function_call": (_never, "the deprecated functions API is not supported: send 'tool_choice'"),
}
COMPLETION_UNSUPPORTED = ("logit_bias", "presence_penalty", "frequency_penalty")
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs (OpenAI's limit)


@dataclass(frozen=True)
class Sampling:
    """What ``Engine.generate`` takes besides the prompt; ``max_tokens`` None: until EOS or the context is full."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # not OpenAI's: "coupled" fixes a sampled answer by its seed (SamplingParams); None: see :meth:`resolved`
    sampler: str | None = None
    # OpenAI's shape (constrain.grammar), or the constraint the route compiled from it; None: free text
    response_format: dict | Constraint | None = None
    grammar: str | None = field(default=None, repr=False)  # response_format's grammar, read once when parsed

    def resolved(self, coupled_available: bool = True) -> "Sampling":
        """The sampler that runs: the one asked for by name, else "coupled" for a sampled answer with a
        seed (so the seed gives the same answer again, in every mode: what OpenAI's ``seed`` promises),
        else "rejection".  ``coupled_available``: False where the engine's loop has no coupled verifier."""
        if self.sampler is not None:
            return self
        seeded = self.seed is not None and self.temperature > 0 and coupled_available
        return replace(self, sampler="coupled" if seeded else "rejection")

    @property
    def sampler_name(self) -> str:
        """What draws the tokens: "greedy", "coupled" or "rejection" (for responses and logs)."""
        return "greedy" if self.temperature == 0 else self.sampler or "rejection"

    def options(self, **answer) -> GenerateOptions:
        """What ``Engine.generate`` gets for this request; ``answer``: the rest of its
        :class:`~edge_spec.runtime.options.GenerateOptions` (tools, side channels)."""
        return GenerateOptions(
            max_new_tokens=self.max_tokens or None,  # None: until the end token or a full context
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            sampler=self.sampler or "rejection",
            stop=self.stop,
            response_format=self.response_format,
            **answer,
        )


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked: what the server does with them depends on the model (``tool_use``)."""

    tools: list[dict]  # OpenAI function tools, as sent (they go to the chat template as they are)
    choice: str  # "none", "auto" or "required"; "required" too when a function is named
    function: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # {"role", "content", ...}, roles and tool calls as chat templates expect them
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    tools: ToolRequest | None = None  # None: no tools sent
    provenance: bool = False  # x_edge_spec.provenance: each chunk names its tokens' sources
    logprobs: int | None = None  # top_logprobs when logprobs is true (None: no log-probabilities)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str  # raw text, no chat template
    sampling: Sampling
    suffix: str | None = None  # fill-in-the-middle: text after the cursor
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    provenance: bool = False
    logprobs: int | None = None  # the alternatives per token to report (None: no log-probabilities)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, else a 400 in OpenAI's shape."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"could not parse the JSON body of the request: {exc}") from None
    except ValueError as exc:  # an integer literal past Python's conversion limit
        if "digits" not in str(exc):
            raise
        raise bad_request(
            "could not parse the JSON body of the request: an integer in it has more than "
            f"{sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def parse_chat(body: dict) -> ChatRequest:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is a required property", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    _refuse_unsupported(body, UNSUPPORTED)
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)],
        sampling=_sampling(body, max_tokens_keys=("max_completion_tokens", "max_tokens")),
        stream=_stream(body),
        include_usage=_include_usage(body),
        model=_typed(body, "model", str),
        tools=_tool_request(body),
        provenance=_provenance(body),
        logprobs=_chat_logprobs(body),
    )


def parse_completion(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is a required property", param="prompt")
    if not isinstance(prompt, str):
        raise bad_request(
            "'prompt' must be a string (token arrays and several prompts per request are not supported)", param="prompt"
        )
    suffix = _typed(body, "suffix", str)
    _only_one(body, "best_of")
    _refuse_unsupported(body, {key: UNSUPPORTED[key] for key in COMPLETION_UNSUPPORTED})
    return CompletionRequest(
        prompt=prompt,
        sampling=_sampling(body, max_tokens_keys=("max_tokens",), default_max=16),
        suffix=suffix,
        echo=bool(_typed(body, "echo", bool)),
        stream=_stream(body),
        include_usage=_include_usage(body),
        model=_typed(body, "model", str),
        provenance=_provenance(body),
        logprobs=_completion_logprobs(body),
    )


def _refuse_unsupported(body: dict, fields: dict) -> None:
    for key, (harmless, why) in fields.items():
        value = body.get(key)
        if value is not None and not harmless(value):
            raise bad_request(
                f"'{key}' is {why}" if why.startswith("not supported") else f"'{key}' is not supported: {why}",
                param=key,
            )


def _message(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", param=where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}", param=f"{where}.role"
        )
    content = message.get("content")
    calls = _tool_calls(message.get("tool_calls"), where) if role == "assistant" else []
    if content is None and role == "assistant":
        content = None if calls else ""  # a template writes no empty text before the calls
    elif isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts are supported", param=f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text parts", param=f"{where}.content")
    checked = {"role": "system" if role == "developer" else role, "content": content}
    if calls:
        checked["tool_calls"] = calls
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                f"{where}.tool_call_id must be the id of the call this message answers", param=f"{where}.tool_call_id"
            )
        checked["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):  # some templates name the function answered
            checked["name"] = message["name"]
    return checked


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates take them: ``arguments`` as the object its
    JSON text encodes (templates write it with ``tojson``), or as the text when that is not an object."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
    checked = []
    for i, call in enumerate(calls):
        here = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"{here}.function must be an object with the function's name and arguments", param=f"{here}.function"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError:
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else arguments
        elif not isinstance(arguments, dict):
            raise bad_request(f"{here}.function.arguments must be a JSON string", param=f"{here}.function.arguments")
        checked.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return checked


def _tool_request(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked as OpenAI checks them."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = _typed(body, "parallel_tool_calls", bool)
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be an array of function tools", param="tools")
    tools = [_tool(tool, i) for i, tool in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    function = None
    if isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        function = named.get("name") if isinstance(named, dict) else None
        if function not in names:
            raise bad_request(
                "'tool_choice' names a function that is not among 'tools' (give "
                '{"type": "function", "function": {"name": NAME}} with a tool\'s name)',
                param="tool_choice",
            )
        choice = "required"
    elif choice is not None and choice not in TOOL_CHOICES:
        raise bad_request(
            f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or names a function", param="tool_choice"
        )
    if not tools:
        if choice == "required":
            raise bad_request("'tool_choice' asks for a tool call, but no 'tools' are given", param="tool_choice")
        return None
    return ToolRequest(
        tools=tools, choice=choice or "auto", function=function, parallel=True if parallel is None else parallel
    )


def _tool(tool, index: int) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"{where}.type: only function tools are supported", param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(
            f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
            param=f"{where}.function.name",
        )
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise bad_request(
            f"{where}.function.parameters must be a JSON schema of type object", param=f"{where}.function.parameters"
        )
    return tool


def _response_format(body: dict) -> tuple[dict | None, str | None]:
    """``response_format`` checked for its shape here (a 400 naming it) and its grammar; (None, None) for
    free text.  Whether the grammar compiles is checked by the route, under a time limit (compiling can
    take as long as the schema makes it), which then compiles it for the engine."""
    value = body.get("response_format")
    try:
        grammar = grammar_for(value)
    except EdgeSpecError as exc:
        raise bad_request(str(exc), param="response_format") from None
    return (None, None) if grammar is None else (value, grammar)


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
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("sampler", sampler),
    ):
        if value is not None:
            try:
                SamplingParams(**{name: value})  # the engine's own range checks
            except EdgeSpecError as exc:
                raise bad_request(f"'{name}': {exc}", param=name) from None
    response_format, grammar = _response_format(body)
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k or 0,
        seed=seed,
        stop=stop,
        sampler=sampler,
        response_format=response_format,
        grammar=grammar,
    )


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
    try:
        return float(value)
    except OverflowError:  # an integer past any double: out of every field's range, as infinity is
        return math.inf if value > 0 else -math.inf


def _only_one(body: dict, key: str) -> None:
    value = _typed(body, key, int)
    if value is not None and value != 1:
        raise bad_request(
            f"'{key}' must be 1: this server generates one choice per request (send {value} requests instead)",
            param=key,
        )


def _stream(body: dict) -> bool:
    return bool(_typed(body, "stream", bool))


def _include_usage(body: dict) -> bool:
    options = _typed(body, "stream_options", dict) or {}
    return bool(_typed(options, "include_usage", bool))


def _provenance(body: dict) -> bool:
    """``x_edge_spec: {"provenance": true}`` (this server's own field, which no OpenAI client sends): name the
    source of every token of the answer (see ``openai_format``)."""
    options = _typed(body, "x_edge_spec", dict) or {}
    unknown = sorted(set(options) - {"provenance"})
    if unknown:
        raise bad_request(
            f"'x_edge_spec.{unknown[0]}' is not a field of this server: x_edge_spec takes 'provenance'",
            param=f"x_edge_spec.{unknown[0]}",
        )
    value = options.get("provenance")
    if value is not None and not isinstance(value, bool):
        raise bad_request("'x_edge_spec.provenance' must be a boolean", param="x_edge_spec.provenance")
    return bool(value)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs: true`` and ``top_logprobs`` (0 to 20): the number of alternatives per token to
    report, None when log-probabilities are not asked for."""
    wanted = _typed(body, "logprobs", bool)
    top = _typed(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
    if top and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict) -> int | None:
    """The legacy completions' ``logprobs`` (0 to 5): the alternatives per token, None when not asked for.
    The prompt's own log-probabilities are not computed, so ``echo`` with them is refused."""
    top = _typed(body, "logprobs", int)
    if top is None:
        return None
    if not 0 <= top <= MAX_COMPLETION_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {top}", param="logprobs")
    if _typed(body, "echo", bool):
        raise bad_request(
            "'logprobs' with 'echo' is not supported: the prompt's tokens get no log-probabilities "
            "here; send one without the other",
            param="echo",
        )
    return top
