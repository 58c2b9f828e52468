"""Session workloads: sequences of requests whose later requests repeat earlier material.

A prompt-by-prompt benchmark cannot show what drafting from earlier requests gains; a session can: an
agent loop whose tool results and calls come back in every later turn, a file rewritten change after
change, tests for similar functions in one conversation or as an editor's command sent once per
function, a chat answer revised.  A session file holds one JSON object per line::

    {"id": str, "category": str, "history": bool, "system": str | null, "tools": [...] | null,
     "max_tokens": int, "turns": [{"messages": [{"role": ..., "content": ...}, ...]}, ...]}

Each request is built by :func:`turn_messages` from the script and *the answering engine's own* earlier
answers, so every engine (and every decoding mode) replays a session as a client talking to it would.
``max_tokens`` is the most new tokens of each of the session's answers; ``tools`` (OpenAI function
schemas) go with every request.

Standard library only: the peer benchmark scripts import this module inside their own virtual
environments, where edge-spec's dependencies are not installed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from edge_spec.errors import EdgeSpecError

DEFAULT_SESSIONS = Path(__file__).resolve().parents[1] / "data" / "bench" / "sessions.jsonl"
PLACEHOLDER = "{previous_answer}"  # in a message's content: the engine's answer to the turn before
ROLES = ("system", "user", "assistant", "tool")
# an opening fence line (```python, ```) and the code after it, up to a closing fence line if there is one
_FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL)


def load_sessions(path: str | Path | None = None) -> list[dict]:
    """The sessions of a file (default: the shipped set), each checked and completed: ``system`` and
    ``tools`` are None where left out.  A malformed file raises :class:`EdgeSpecError` naming the line
    and what is wrong with it."""
    path = Path(path) if path is not None else DEFAULT_SESSIONS
    if not path.is_file():
        raise EdgeSpecError(f"session file not found: {path}")
    sessions: list[dict] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise EdgeSpecError(f"{where}: invalid JSON ({exc})") from None
        session = check_session(item, where)
        if session["id"] in seen:
            raise EdgeSpecError(f"{where}: session id {session['id']!r} is used twice")
        seen.add(session["id"])
        sessions.append(session)
    if not sessions:
        raise EdgeSpecError(f"session file {path} has no sessions")
    return sessions


def check_session(item: object, where: str = "session") -> dict:
    """``item`` as a session (a new dict), or :class:`EdgeSpecError` saying ``where`` it is malformed."""
    if not isinstance(item, dict):
        raise EdgeSpecError(f"{where}: expected a session object, not {type(item).__name__}")
    for key, kind in (("id", "a non-empty string"), ("category", "a non-empty string")):
        if not (isinstance(item.get(key), str) and item[key].strip()):
            raise EdgeSpecError(f"{where}: {key!r} must be {kind}")
    where = f"{where} (session {item['id']!r})"
    if not isinstance(item.get("history"), bool):
        raise EdgeSpecError(f"{where}: 'history' must be true or false")
    if item.get("system") is not None and not isinstance(item["system"], str):
        raise EdgeSpecError(f"{where}: 'system' must be a string or null")
    tools = item.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise EdgeSpecError(f"{where}: 'tools' must be null or a list of {{'type': 'function', 'function': ...}}")
    max_tokens = item.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise EdgeSpecError(f"{where}: 'max_tokens' must be a whole number of at least 1")
    turns = item.get("turns")
    if not isinstance(turns, list) or not turns:
        raise EdgeSpecError(f"{where}: 'turns' must be a non-empty list")
    for t, turn in enumerate(turns, 1):
        messages = turn.get("messages") if isinstance(turn, dict) else None
        if not isinstance(messages, list) or not messages:
            raise EdgeSpecError(f"{where}: turn {t} must be an object with a non-empty 'messages' list")
        for m, message in enumerate(messages, 1):
            if not (isinstance(message, dict) and message.get("role") in ROLES):
                raise EdgeSpecError(f"{where}: turn {t} message {m} needs a 'role' of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise EdgeSpecError(f"{where}: turn {t} message {m} needs a string 'content'")
            if t == 1 and PLACEHOLDER in message["content"]:
                raise EdgeSpecError(f"{where}: turn 1 uses {PLACEHOLDER}, but no answer comes before it")
    return {**item, "system": item.get("system"), "tools": tools}


def select_sessions(sessions: list[dict], categories: list[str] | None, per_category: int | None) -> list[dict]:
    """The sessions of ``categories`` (all when None or empty), at most ``per_category`` of each, in file order."""
    if categories:
        unknown = set(categories) - {s["category"] for s in sessions}
        if unknown:
            raise EdgeSpecError(f"unknown session categories: {', '.join(sorted(unknown))}")
        sessions = [s for s in sessions if s["category"] in categories]
    taken: Counter[str] = Counter()
    chosen = []
    for session in sessions:
        if per_category is None or taken[session["category"]] < per_category:
            chosen.append(session)
            taken[session["category"]] += 1
    return chosen


def turn_messages(session: dict, turn_index: int, previous_answers: list[str]) -> list[dict]:
    """The messages of the request for turn ``turn_index`` (from 0), given the engine's answers to the
    turns before it (``previous_answers[k]``: its answer to turn k).

    The session's system prompt comes first.  With ``history`` the conversation carries every earlier
    turn's messages, each followed by the engine's answer as an assistant message; without it a request
    is the system prompt and this turn's messages alone (an editor that sends the current file, not a
    chat).  :data:`PLACEHOLDER` in a message becomes the answer to the turn before (its code, where the
    answer has a fenced block: :func:`answer_code`)."""
    if not 0 <= turn_index < len(session["turns"]):
        raise IndexError(f"session {session['id']!r} has no turn {turn_index}")
    if len(previous_answers) < turn_index:
        raise ValueError(f"turn {turn_index} needs the answers to the {turn_index} turns before it")
    messages = [{"role": "system", "content": session["system"]}] if session.get("system") is not None else []
    first = 0 if session["history"] else turn_index
    for k in range(first, turn_index + 1):
        previous = previous_answers[k - 1] if k > 0 else None
        messages += [_filled(message, previous) for message in session["turns"][k]["messages"]]
        if k < turn_index:
            messages.append({"role": "assistant", "content": previous_answers[k]})
    return messages


def answer_code(answer: str) -> str:
    """What replaces :data:`PLACEHOLDER`: the code of ``answer``'s longest fenced block (up to the end of
    the answer when its closing fence was cut off by the token limit), or the whole answer, stripped,
    where it has none -- an editor applies the code, not the words around it."""
    blocks = [match.group(1) for match in _FENCE.finditer(answer)]
    if not blocks:
        return answer.strip()
    return max(blocks, key=len).strip("\n")


def _filled(message: dict, previous: str | None) -> dict:
    """A copy of ``message`` with :data:`PLACEHOLDER` replaced by the code of ``previous``."""
    if previous is None or PLACEHOLDER not in message["content"]:
        return dict(message)
    return {**message, "content": message["content"].replace(PLACEHOLDER, answer_code(previous))}
