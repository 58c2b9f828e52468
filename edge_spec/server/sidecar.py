"""``edge-spec serve`` as the sidecar of a desktop application (Electron, Tauri, an editor extension).

An application that is not written in Python starts the server as a child process and needs three
things from it, as editors get them from llama-server: where it listens, without guessing a free port
(``--port 0``: the system picks one); that it is ready, without polling (one JSON line on stdout once it
accepts connections: :func:`ready_line`; everything else the server says goes to stderr); and that it
does not outlive the application (``--exit-with-parent``: :class:`ParentWatch`), even when the
application is killed and never gets to stop it.  ``--api-key auto`` makes a key for this launch only,
handed over in the ready line, so that other local users and web pages cannot use the model.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("edge_spec.server")

AUTO_KEY = "auto"  # --api-key auto: a key made for this launch
POLL_SECONDS = 0.1  # how often the parent process is looked for
HARD_EXIT_SECONDS = 1.5  # after the parent is gone, the longest an orderly stop may take before the process exits


def new_api_key() -> str:
    """A key for one launch: 256 random bits, URL-safe (it goes in an ``Authorization`` header)."""
    return secrets.token_urlsafe(32)


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches the server at (a wildcard address is not one to connect to)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(url: str, api_key: str | None, model: str) -> str:
    """The one line a parent process reads on the server's stdout once it accepts connections."""
    return json.dumps({"url": url, "api_key": api_key, "model": model})


def announce(line: str) -> None:
    """Write the ready line to stdout, whole and at once (a parent reads up to the newline)."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # no stdout, or the parent closed it: nothing to tell
        pass


def _exit_now() -> None:
    """What a parent's death does before the server runs (loading a bundle): nothing is worth finishing."""
    os._exit(0)


class ParentWatch:
    """Calls an action once when the process that started this one dies or closes this one's stdin.

    Three signs, whichever comes first: on Linux the kernel's parent-death signal (``PR_SET_PDEATHSIG``,
    SIGTERM: the server's usual shutdown); on every system a thread that polls the parent (POSIX: the
    parent id changes when the process is re-parented; Windows: the parent's process handle is
    signalled); and, when stdin is a pipe or a socket, a thread that reads it to its end (a parent that
    dies, however, closes its end).  A stdin that is a terminal or ``/dev/null`` is not read.
    """

    def __init__(self, poll_seconds: float = POLL_SECONDS) -> None:
        self.parent = os.getppid()
        self.poll_seconds = poll_seconds
        self._action: Callable[[], None] = _exit_now
        self._fired = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        if sys.platform.startswith("linux"):
            _parent_death_signal(signal.SIGTERM)
        threading.Thread(target=self._poll_parent, name="edge-spec parent watch", daemon=True).start()
        if _is_pipe(0):
            threading.Thread(target=self._read_stdin, name="edge-spec stdin watch", daemon=True).start()

    def on_gone(self, action: Callable[[], None]) -> None:
        """Do ``action`` (from a watcher thread) when the parent is gone: now, if it is already."""
        with self._lock:
            self._action = action
            fired = self._fired.is_set()
        if fired:
            action()

    @property
    def gone(self) -> bool:
        """Whether the parent was found gone."""
        return self._fired.is_set()

    def _fire(self, why: str) -> None:
        with self._lock:
            if self._fired.is_set():
                return
            self._fired.set()
            action = self._action
        log.info("%s: stopping", why)
        action()

    def _poll_parent(self) -> None:
        alive = _parent_alive_check(self.parent)
        while alive():
            time.sleep(self.poll_seconds)
        self._fire(f"the parent process ({self.parent}) is gone")

    def _read_stdin(self) -> None:
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        self._fire("stdin was closed")


def _is_pipe(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _parent_death_signal(signum: int) -> None:
    """Linux: have the kernel send ``signum`` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # the polling thread still watches
        pass


def _parent_alive_check(parent: int) -> Callable[[], bool]:
    """A check that the process ``parent`` still runs."""
    if sys.platform == "win32":
        return _windows_process_check(parent)
    if parent <= 1:  # started by init, or already re-parented: no parent to watch but stdin
        return lambda: True
    return lambda: os.getppid() == parent


def _windows_process_check(pid: int) -> Callable[[], bool]:
    """Windows keeps a dead parent's id in ``os.getppid()``: watch its process handle instead."""
    synchronize, wait_object_0 = 0x00100000, 0
    kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
    handle = kernel32.OpenProcess(synchronize, False, pid)
    if not handle:  # gone already (or not ours to open): nothing to wait for
        return lambda: False
    return lambda: kernel32.WaitForSingleObject(handle, 0) != wait_object_0


def exit_now() -> None:
    """End the process at once, its output flushed: after an orderly stop for a parent that is gone, the
    interpreter's own teardown (a second or more, most of it in the native libraries) waits for nothing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(0)


def stop_soon(stop: Callable[[], None]) -> None:
    """Stop the server in order (``stop``), and exit the process outright if that takes longer than
    ``HARD_EXIT_SECONDS``: a parent that is gone waits for nothing, and its application must not find a
    server left behind."""
    timer = threading.Timer(HARD_EXIT_SECONDS, exit_now)
    timer.daemon = True
    timer.start()
    stop()
