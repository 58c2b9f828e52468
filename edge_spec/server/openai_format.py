"""OpenAI response bodies and stream chunks (``chat.completion``, ``chat.completion.chunk``,
``text_completion``), tool calls in them, the ``usage`` record and the ``x_edge_spec`` statistics.

A request with ``x_edge_spec: {"provenance": true}`` also gets where its tokens came from: every content
chunk's ``x_edge_spec.provenance`` is ``[[text, source], ...]``, one entry per token whose text the chunk
delivers, the texts joining to the chunk's content; source "target" for the target's own tokens (the first,
corrections, bonuses), else the proposer whose draft the target accepted ("model": the drafter model,
"suffix", "lookup", "forced": a grammar's forced token, "guess", "eagle").  Tokens whose text is empty go with the
next chunk, or with the last one (beside the statistics) at the end of the answer.  A non-streamed answer
carries the whole list.  Answers whose text a tool-call parser rewrites carry none.

Log-probabilities (``logprobs`` in the request) go in each choice's ``logprobs`` in OpenAI's shapes: chat's
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal":
null}`` and the legacy completions' ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`` (each dict holds the top alternatives and the token itself), a streamed chunk's for the
tokens whose text begins in it.  A token's ``token`` is its text, or where its bytes are not whole UTF-8
(part of a character) those bytes written ``\\xNN``; ``bytes`` are always its bytes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from edge_spec import __version__
from edge_spec.runtime.engine import GenerationStats
from edge_spec.runtime.logprobs import TokenLogprob
from edge_spec.server.tokens import TokenPieces
from edge_spec.server.tool_calls import ToolCall

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def sse(data: dict) -> bytes:
    """One server-sent event line carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def finish_reason(stats: GenerationStats, called: bool = False) -> str:
    """OpenAI's reason: "tool_calls" when the answer ended with calls (not cut by the length limit)."""
    reason = FINISH_REASONS.get(stats.stop_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def fingerprint(mode: str, sampler: str) -> str:
    """``system_fingerprint``: the set-up an answer depends on beside the request (with ``seed``, the same
    fingerprint and request give the same answer): the server's version, the decoding mode, the sampler."""
    return f"edge-spec-{__version__}-{mode}-{sampler}"


def call_body(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
    }


def edge_spec_stats(stats: GenerationStats, queue_seconds: float) -> dict:
    """What the engine did for one request: timings, and in the speculative modes drafted / accepted
    tokens, acceptance rate and τ (tokens per target pass); those are None in ar mode."""
    spec = stats.spec
    speculative = spec is not None and spec.target_calls > 0
    return {
        "mode": stats.mode,
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "stop_reason": stats.stop_reason,
        "queue_seconds": round(queue_seconds, 4),
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "decode_seconds": round(stats.decode_seconds, 4),
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "drafted": round(spec.mean_gamma * spec.target_calls) if speculative else None,
        "accepted": sum(spec.accepted_lengths) if speculative else None,
        "acceptance_rate": round(spec.acceptance_rate, 4) if speculative else None,
        "tau": round(spec.tau, 4) if speculative else None,
        "target_calls": spec.target_calls if speculative else None,
        "draft_steps": spec.draft_steps if speculative else None,
        "coupled_seed": stats.coupled_seed,  # with "sampler": "coupled", the seed that gives this answer again
    }


def token_text(pieces: TokenPieces, token_id: int) -> tuple[str, list[int]]:
    """A token's ``token`` and ``bytes`` in a log-probability entry (module docstring)."""
    piece = pieces.piece(token_id)
    if isinstance(piece, str):
        return piece, list(piece.encode())
    return bytes(piece).decode("utf-8", errors="backslashreplace"), list(piece)


@dataclass
class ResponseFormat:
    """Builds one response's bodies: ``kind`` "chat" (chat.completion) or "completion" (text_completion)."""

    kind: str
    model: str
    include_usage: bool = False  # streams: every chunk has "usage": null, then one usage chunk
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str | None = None  # system_fingerprint
    sampler: str | None = None  # "greedy", "coupled" or "rejection": reported in x_edge_spec
    pieces: TokenPieces | None = None  # the tokens' texts, when log-probabilities are reported

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def _head(self, object_name: str) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's ``logprobs`` for the tokens of ``entries`` (None: not asked for), in this kind's shape."""
        if entries is None or self.pieces is None:
            return None
        if self.kind == "chat":

            def entry(token_id: int, logprob: float) -> dict:
                text, raw = token_text(self.pieces, token_id)
                return {"token": text, "logprob": logprob, "bytes": raw}

            return {
                "content": [
                    {**entry(e.token_id, e.logprob), "top_logprobs": [entry(*t) for t in e.top]} for e in entries
                ],
                "refusal": None,
            }
        tokens = [token_text(self.pieces, e.token_id)[0] for e in entries]
        top = []
        for token, e in zip(tokens, entries):
            alternatives = {}
            for token_id, logprob in e.top:
                alternatives.setdefault(token_text(self.pieces, token_id)[0], logprob)
            alternatives.setdefault(token, e.logprob)  # the token itself, as OpenAI adds it
            top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top,
            "text_offset": [e.text_offset for e in entries],
        }

    def _stats(self, stats: GenerationStats, queue_seconds: float) -> dict:
        return {**edge_spec_stats(stats, queue_seconds), "sampler": self.sampler}

    def full(
        self,
        text: str | None,
        stats: GenerationStats,
        queue_seconds: float,
        tool_calls: Sequence[ToolCall] = (),
        sources: list[list[str]] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        """The non-streamed response (``usage`` always present); ``text`` None: the answer is calls only;
        ``sources``: the answer's provenance, ``logprobs`` its tokens' log-probabilities (module docstring)."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = [call_body(call) for call in tool_calls]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason(stats, bool(tool_calls)),
            }
            body = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self.logprobs(logprobs),
                "finish_reason": finish_reason(stats),
            }
            body = self._head("text_completion")
        extra = self._stats(stats, queue_seconds)
        if sources is not None:
            extra["provenance"] = sources
        return {**body, "choices": [choice], "usage": usage(stats), "x_edge_spec": extra}

    def chunk(
        self,
        text: str,
        *,
        first: bool = False,
        stats: GenerationStats | None = None,
        queue_seconds: float = 0.0,
        called: bool = False,
        delta: dict | None = None,
        sources: list[list[str]] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        """A stream chunk carrying ``text`` (or a chat ``delta`` as given); the last one (``stats`` given) has
        the finish reason (``called``: the answer made tool calls) and ``x_edge_spec``; ``sources``: the
        provenance of ``text``, in ``x_edge_spec``; ``logprobs``: its tokens' log-probabilities (module
        docstring).  A chat stream's first chunk carries the assistant role."""
        reason = finish_reason(stats, called) if stats is not None else None
        if self.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        if stats is not None:
            body["x_edge_spec"] = self._stats(stats, queue_seconds)
        if sources is not None:
            body.setdefault("x_edge_spec", {})["provenance"] = sources
        return body

    def call_chunks(self, call: ToolCall, index: int) -> list[dict]:
        """A tool call streamed as OpenAI streams one: its index, id, type, name and empty arguments first,
        then the arguments."""
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        arguments = {"index": index, "function": {"arguments": call.arguments}}
        return [self.chunk("", delta={"tool_calls": [head]}), self.chunk("", delta={"tool_calls": [arguments]})]

    def usage_chunk(self, stats: GenerationStats) -> dict:
        """``stream_options.include_usage``: the stream's last chunk, with no choices."""
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        return {**body, "choices": [], "usage": usage(stats)}


def model_list(names: Sequence[str], created: int) -> dict:
    return {"object": "list", "data": [model_card(name, created) for name in names]}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "edge-spec"}
