"""Grammar compiles in a child process, ended when one passes its time limit.

No limit of llguidance bounds how long a compile takes (:mod:`compile`), and a thread cannot be stopped,
so a server compiles each request's grammar first in a child process of its own: a compile that passes
its time limit (:data:`COMPILE_SECONDS` by default) is ended with the process, the next check starts
another, and the request is refused in that bounded time.  A grammar that compiles there in time
compiles as fast where the answer is decoded, which compiles it again.  One child serves one vocabulary
(:func:`checker_for`), one grammar at a time: a check that cannot start within its own time limit,
because another holds the child, is refused as busy (:class:`CheckerBusy`) rather than queued without
end.  Outcomes are remembered for :data:`REMEMBERED` recent grammars, so a client that sends the same
schema with every request pays for it once.

The child is ``python -m edge_spec.runtime.constrain.child`` (a fresh interpreter: nothing of the
server's threads or ONNX Runtime is inherited), reads the tokenizer once, then answers each grammar with
the reason it is refused, or null: length-prefixed JSON messages over its stdin and stdout.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import IO

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain.compile import GrammarRefused
from edge_spec.runtime.constrain.grammar import first_line
from edge_spec.runtime.constrain.vocabulary import GrammarVocabulary

COMPILE_SECONDS = 5.0  # for one grammar: the schemas of real requests compile in milliseconds
START_SECONDS = 120.0  # for the child to start and read the tokenizer (not counted in a compile's time)
REMEMBERED = 256


class CheckerBusy(EdgeSpecError):
    """Another grammar holds the child past this check's time limit; the request may be sent again."""


class GrammarChecker:
    """Checks grammars for one vocabulary in a child process (see the module docstring); thread-safe."""

    def __init__(self, vocabulary: GrammarVocabulary) -> None:
        self._setup = {"source": vocabulary.source, "width": vocabulary.width, "end_ids": sorted(vocabulary.end_ids)}
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._outcomes: OrderedDict[str, str | None] = OrderedDict()  # grammar digest -> reason refused

    def check(self, grammar: str, seconds: float = COMPILE_SECONDS) -> None:
        """Returns when ``grammar`` compiles within ``seconds``; else :class:`GrammarRefused` with the reason
        (its time among them), or :class:`CheckerBusy`.  Blocking: call it from a worker thread."""
        key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
        if not self._lock.acquire(timeout=seconds):
            raise CheckerBusy(f"the grammar checker is busy with another grammar for more than {seconds:g} s")
        try:
            if key in self._outcomes:
                self._outcomes.move_to_end(key)
                reason = self._outcomes[key]
            else:
                reason = self._compile(grammar, seconds)
                self._outcomes[key] = reason
                if len(self._outcomes) > REMEMBERED:
                    self._outcomes.popitem(last=False)
        finally:
            self._lock.release()
        if reason is not None:
            raise GrammarRefused(reason)

    def start(self) -> None:
        """Start the child now, not at the first check (blocking: it reads the tokenizer)."""
        with self._lock:
            if self._child is None:
                self._child = _Child(self._setup)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _compile(self, grammar: str, seconds: float) -> str | None:
        if self._child is None:
            self._child = _Child(self._setup)
        started = time.monotonic()
        try:
            return self._child.ask({"grammar": grammar}, seconds)["reason"]
        except TimeoutError:
            self._stop()  # the only way to end a compile
            took = time.monotonic() - started
            return f"compiling it takes longer than {seconds:g} s (the limit; stopped after {took:.1f} s)"
        except EdgeSpecError:  # the child died (out of memory, killed): the grammar's doing
            self._stop()
            return "the grammar engine's process ended while compiling it"

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child = None


class _Child:
    """One child process and a thread that reads its answers (so that waiting for one has a time limit)."""

    def __init__(self, setup: dict) -> None:
        root = str(Path(__file__).resolve().parents[3])  # where edge_spec is, whatever the working directory
        path = os.environ.get("PYTHONPATH")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "edge_spec.runtime.constrain.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")},
        )
        self.answers: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, name="grammar-checker-reader", daemon=True).start()
        try:
            if not self.ask(setup, START_SECONDS).get("ready"):
                raise EdgeSpecError("the grammar checker could not read the tokenizer")
        except (TimeoutError, EdgeSpecError) as exc:
            self.kill()
            raise EdgeSpecError(f"the grammar checker could not start: {first_line(exc)}") from None

    def ask(self, message: dict, seconds: float) -> dict:
        """The child's answer to ``message``; TimeoutError past ``seconds``, EdgeSpecError if it died."""
        try:
            send(self.process.stdin, message)
        except OSError:
            raise EdgeSpecError("the grammar checker's process has ended") from None
        try:
            answer = self.answers.get(timeout=seconds)
        except queue.Empty:
            raise TimeoutError(f"no answer within {seconds:g} s") from None
        if answer is None:
            raise EdgeSpecError("the grammar checker's process has ended")
        return answer

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()

    def _read(self) -> None:
        try:
            while (answer := receive(self.process.stdout)) is not None:
                self.answers.put(answer)
        except (OSError, ValueError):  # the pipe closed under the reader
            pass
        self.answers.put(None)


_CHECKERS: weakref.WeakKeyDictionary[GrammarVocabulary, GrammarChecker] = weakref.WeakKeyDictionary()
_CHECKERS_LOCK = threading.Lock()


def checker_for(vocabulary: GrammarVocabulary) -> GrammarChecker:
    """The checker of ``vocabulary`` (one child process per vocabulary, started on the first check and
    ended with the vocabulary)."""
    with _CHECKERS_LOCK:
        checker = _CHECKERS.get(vocabulary)
        if checker is None:
            checker = _CHECKERS[vocabulary] = GrammarChecker(vocabulary)
            weakref.finalize(vocabulary, checker.close)
        return checker


def send(stream: IO[bytes], message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(b"%d\n" % len(data) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> dict | None:
    header = stream.readline()
    if not header:
        return None
    return json.loads(stream.read(int(header)))
