"""Running an export's work in a child process that the command watches, so that a kill by the system is
said in one line.

Why: the kernel's out-of-memory killer ends a process with SIGKILL, which the process cannot catch: an
export killed so leaves the shell's ``Killed`` and nothing else.  The process that started it can see
it, though.  So the command (the parent) starts ``python -m edge_spec.export.bundle.watchdog``, hands it the
work (a function's import path and its argument, pickled over stdin) and, while the child runs:

* shows what the child says (the work's ``say`` payloads, over a pipe) through the command's own
  display, so progress lines appear as they would in one process;
* keeps what the child is doing and what it would leave on disk (:mod:`edge_spec.export.bundle.activity`);
* reads the child's peak resident memory (``VmHWM`` in ``/proc/PID/status``) and the memory the
  system has available, a few times a second.

A child ended by SIGKILL is then one line: what it was doing, the memory it had reached, what the
system had available, whether the out-of-memory killer's counters moved meanwhile (``/proc/vmstat``,
the cgroup's ``memory.events`` or ``memory.oom_control``: then it certainly was the killer, else most
likely), what to do, and what was kept; the child's staging directory is removed first (a later export
would remove it too: :func:`edge_spec.export.bundle.install.prepare`).

The child runs in a session of its own, so a terminal's Ctrl-C reaches the command only: the command
passes it on as SIGINT, the child's work stops as on a Ctrl-C in one process (its staging directory
removed) and the command says ``interrupted`` once.  A child that does not stop within
:data:`STOP_SECONDS` is killed.  Should the command itself die, the child gets SIGTERM (Linux), which
it takes as a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from edge_spec.errors import EdgeSpecError

POLL_SECONDS = 0.1  # how often the command reads the child's memory while it says nothing
STOP_SECONDS = 30.0  # how long a child stopped by Ctrl-C may take to remove what it wrote
GB = 1e9
#: exceptions the work raises that the command says as it would in one process (one line); any other
#: is a bug: the child prints its traceback
PASSED_ON = (EdgeSpecError, OSError, ImportError, MemoryError)


def available_memory() -> int | None:
    from edge_spec.export.bundle.stages import available_memory

    return available_memory()


# -- the command's side ------------------------------------------------------------------------------


@dataclass
class Watch:
    """What the command knows of its child: what it does, what it would leave, how much it holds."""

    kept: str
    doing: str = "starting"
    ready: bool = False  # the child runs its own code (before, a Ctrl-C there would print a traceback)
    peak: int = 0  # bytes: the child's highest resident memory seen
    available: int | None = None  # bytes the system had available when the child started
    oom_kills: dict[str, int] = field(default_factory=dict)  # the killer's counters then

    def sample(self, pid: int) -> None:
        peak = peak_memory_of(pid)
        if peak is not None:
            self.peak = max(self.peak, peak)


def run(
    function: str,
    argument: object,
    show: Callable[[object], None],
    *,
    kept: str,
    cleanup: Callable[[], None] = lambda: None,
) -> object:
    """Run ``function(argument, say)`` (``function``: "module:name") in a watched child and return what it
    returns.  ``say(payload)`` in the child is ``show(payload)`` here; ``kept``: what is on disk should the
    child stop before it says otherwise (:func:`edge_spec.export.bundle.activity.kept`); ``cleanup``: removes
    what a killed or interrupted child left.  The work's one-line errors are raised here as they were
    there; a child killed or ended by a signal raises :class:`EdgeSpecError` with the line above."""
    watch = Watch(kept, available=available_memory(), oom_kills=oom_kill_counts())
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "edge_spec.export.bundle.watchdog", str(write_end)],
            stdin=subprocess.PIPE,
            pass_fds=(write_end,),
            start_new_session=True,  # a terminal's Ctrl-C reaches the command, which passes it on
        )
    finally:
        os.close(write_end)
    messages = Connection(read_end, writable=False)
    try:
        with contextlib.suppress(BrokenPipeError):  # a child that died at once: said below
            child.stdin.write(pickle.dumps((function, argument)))
            child.stdin.close()
        try:
            outcome = _follow(child, messages, watch, show)
        except KeyboardInterrupt:
            _stop(child, messages, watch, show)
            cleanup()
            raise
    finally:
        messages.close()
        if child.poll() is None:  # an error here, not the child's: it must not outlive the command
            child.kill()
            child.wait()
    kind, value = outcome
    if kind == "done":
        return value
    if kind == "raised":
        raise value
    if kind == "interrupted":
        cleanup()
        raise KeyboardInterrupt
    cleanup()
    code = child.returncode
    if code == -signal.SIGKILL:
        raise EdgeSpecError(killed_line(watch, oom_kill_counts()))
    if code < 0:
        raise EdgeSpecError(
            f"the export stopped on signal {signal.Signals(-code).name} while {watch.doing}, after reaching "
            f"{_gb(watch.peak)} of memory; {watch.kept}"
        )
    raise SystemExit(code or 1)  # a bug: the child printed its traceback


def _follow(child: subprocess.Popen, messages: Connection, watch: Watch, show) -> tuple[str, object]:
    """Relay the child's messages until it ends; (outcome, value): ("done", result), ("raised",
    exception), ("interrupted", None) or ("ended", None) when it ended without a word (a signal)."""
    outcome: tuple[str, object] = ("ended", None)
    while True:
        try:
            ready = messages.poll(POLL_SECONDS)
            message = messages.recv() if ready else None
        except (EOFError, OSError):  # the child closed its end: it has ended
            break
        watch.sample(child.pid)
        if message is None:
            if child.poll() is not None and not messages.poll(0):
                break
            continue
        kind, value = message
        if kind == "say":
            show(value)
        elif kind == "doing":
            watch.doing = value
        elif kind == "kept":
            watch.kept = value
        elif kind == "ready":
            watch.ready = True
        else:
            outcome = (kind, value)
    child.wait()
    return outcome


def _stop(child: subprocess.Popen, messages: Connection, watch: Watch, show) -> None:
    """Ctrl-C: the child stops as a Ctrl-C stops the work in one process (what it wrote removed), within
    :data:`STOP_SECONDS`, else it is killed; a second Ctrl-C kills it at once."""
    try:
        if child.poll() is None and watch.ready:
            child.send_signal(signal.SIGINT)
        elif child.poll() is None:  # still starting: it has written nothing
            child.kill()
        deadline = time.monotonic() + STOP_SECONDS
        while child.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(EOFError, OSError):
                if messages.poll(POLL_SECONDS):
                    messages.recv()  # what it says while stopping is not shown: the command says "interrupted"
    except KeyboardInterrupt:
        pass
    if child.poll() is None:
        child.kill()
    child.wait()


def killed_line(watch: Watch, oom_kills_after: dict[str, int]) -> str:
    """The one line for a child ended by SIGKILL (see the module docstring)."""
    certain = any(oom_kills_after.get(name, 0) > count for name, count in watch.oom_kills.items())
    cause = "the system's out-of-memory killer ended it" if certain else "most likely the system's out-of-memory killer"
    available = f", with {_gb(watch.available)} available when it started" if watch.available is not None else ""
    reached = f" after reaching {_gb(watch.peak)} of memory{available}" if watch.peak else available
    return (
        f"the export was killed while {watch.doing}{reached} ({cause}): close other programs (browsers, other "
        f"models, IDEs) or export a smaller pair (--target, --draft); {watch.kept}"
    )


def _gb(size: float) -> str:
    return f"{size / GB:.1f} GB"


def peak_memory_of(pid: int) -> int | None:
    """Process ``pid``'s highest resident memory so far (Linux: ``VmHWM``), else its resident memory now
    (psutil, where installed), else None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return None  # a process that has ended (a zombie) has no memory left to read
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # psutil missing, or the process gone
        return None


def oom_kill_counts() -> dict[str, int]:
    """The out-of-memory killer's counters this system shows: its kills system-wide (``/proc/vmstat``)
    and in this process's memory cgroup (v2 ``memory.events``, v1 ``memory.oom_control``)."""
    counts = {}
    files = [Path("/proc/vmstat")]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            path = path.lstrip("/")
            if hierarchy == "0" and not controllers:
                files += [Path("/sys/fs/cgroup", path, "memory.events"), Path("/sys/fs/cgroup/memory.events")]
            elif "memory" in controllers.split(","):
                files += [Path("/sys/fs/cgroup/memory", path, "memory.oom_control")]
                files += [Path("/sys/fs/cgroup/memory/memory.oom_control")]
    except (OSError, ValueError):
        pass
    for path in dict.fromkeys(files):
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    counts[str(path)] = int(value)
        except (OSError, ValueError):
            continue
    return counts


# -- the child's side --------------------------------------------------------------------------------


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """Linux: SIGTERM (a Ctrl-C here) when the command that started this process dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _passable(error: BaseException) -> BaseException:
    """``error`` as it can cross to the command (pickled); an EdgeSpecError of its message where it
    cannot."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return EdgeSpecError(str(error))


def child_main(fd: int) -> int:
    """The child: read the work, run it, say how it ended (see the module docstring)."""
    from edge_spec.export.bundle import activity

    messages = Connection(fd, readable=False)
    signal.signal(signal.SIGTERM, _interrupt)
    _die_with_parent()

    def send(kind: str, value: object) -> None:
        messages.send((kind, value))

    try:
        try:
            send("ready", None)
            function, argument = pickle.load(sys.stdin.buffer)
            module, name = function.split(":")
            work = getattr(importlib.import_module(module), name)
            activity.listen(send)
            result = work(argument, lambda payload: send("say", payload))
        except KeyboardInterrupt:
            send("interrupted", None)
            return 130
        except PASSED_ON as error:
            send("raised", _passable(error))
            return 1
        send("done", result)
        return 0
    except (BrokenPipeError, ConnectionResetError):  # the command is gone: nobody to tell
        return 1


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
