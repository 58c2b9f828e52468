"""An export the system kills (the out-of-memory killer's SIGKILL) is said in one line by the command: what
was being built, the memory it had reached, what the system had available and what to do; nothing is
left half-written.  Ctrl-C still stops the command and the process doing the work in one line.

The command is run as users run it (``python -m edge_spec.cli export``), and the process doing the
export's work is killed from outside once the export is at a known stage: a SIGKILL is what the kernel
sends, so the command cannot tell this kill from its own."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF files")

from edge_spec.export.bundle import (
    activity,  # noqa: E402
    watchdog,
)
from tests.test_export_memory import _small_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALIBRATING = "calibration: generating text with the exported target"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the child")


class Command:
    """``edge-spec export`` in a process of its own (a process group of its own, as a shell's job), its
    stderr read line by line as it comes."""

    def __init__(self, tmp_path: Path) -> None:
        target, draft = _small_pair(tmp_path)
        prompts = tmp_path / "prompts.txt"  # enough prompts that the calibration stage lasts seconds
        prompts.write_text("".join(f"def f{i}(x):\n" for i in range(200)))
        self.out = tmp_path / "bundle"
        args = ["--target", target, "--draft", draft, "--output", str(self.out), "--context-length", "64"]
        args += ["--draft-vocab", "trim", "--calibration", str(prompts), "--eagle", "none", "--no-measure"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "edge_spec.cli", "export", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, COLUMNS="400", NO_COLOR="1"),
            start_new_session=True,
            # as a terminal starts it: a suite run in the background inherits an ignored SIGINT, and
            # Python installs no Ctrl-C handler in a process that starts with SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, fragment: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, "the export ended before saying " + repr(fragment) + ":\n" + "\n".join(self.seen)
            self.seen.append(line)
            if fragment in line:
                return

    def worker(self) -> int:
        """The process doing the export's work: the command's child, or the command where it has none."""
        pid = self.process.pid
        children = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += (task / "children").read_text().split()
        return int(children[0]) if children else pid

    def finish(self) -> tuple[int, str]:
        code = self.process.wait(timeout=120)
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return code, "\n".join(self.seen)


def _last_line(err: str, start: str) -> str:
    """The command's closing line: the last, the only one that begins with ``start`` (transformers' own
    warnings come before it, as they do in any export), after no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and [line for line in lines if line.startswith(start)] == lines[-1:], err
    return lines[-1]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


@linux_only
@pytest.mark.slow
def test_an_export_killed_by_the_system_is_one_line_naming_its_stage_and_memory(tmp_path):
    command = Command(tmp_path)
    command.wait_for(CALIBRATING)
    os.kill(command.worker(), signal.SIGKILL)
    code, err = command.finish()
    line = _last_line(err, "error:")
    assert code == 1, err
    pattern = (
        r"error: the export was killed while building the drafter heads \(the calibration text\) after reaching "
        r"\d+\.\d GB of memory, with \d+\.\d GB available when it started \((most likely )?the system's "
        r"out-of-memory killer( ended it)?\): close other programs \(browsers, other models, IDEs\) or export a "
        r"smaller pair \(--target, --draft\); nothing was written to (?P<out>.+)"
    )
    match = re.fullmatch(pattern, line)
    assert match and Path(match.group("out")) == command.out.resolve(), line
    peak = float(re.search(r"reaching (\d+\.\d) GB", line).group(1))
    assert 0.1 <= peak < 20, line  # the child's resident memory: an export imports torch and transformers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "prompts.txt", "t.gguf"]


@linux_only
@pytest.mark.slow
def test_ctrl_c_stops_the_export_and_its_worker_in_one_line(tmp_path):
    command = Command(tmp_path)
    command.wait_for(CALIBRATING)
    worker = command.worker()
    os.killpg(command.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole job
    code, err = command.finish()
    assert code == 130 and _last_line(err, "interrupted") == "interrupted", err
    assert _gone(worker)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "prompts.txt", "t.gguf"]


def test_the_export_says_what_it_is_building_layer_by_layer(tmp_path, tiny_pair):
    """What the watchdog would name: each step, each layer of each graph, the drafter heads' parts."""
    from tests.test_reliability import _export

    said = []
    activity.listen(lambda kind, text: said.append((kind, text)))
    try:
        _export(tmp_path / "bundle", tiny_pair, quant="int4", draft_vocab="trim")
    finally:
        activity.listen(None)
    doing = [text for kind, text in said if kind == "doing"]
    layers = len(tiny_pair[1].model.layers)
    expected = ["loading the target", "building the target graph", "building the target graph (the embedding table)"]
    expected += [f"building the target graph (layer {i + 1} of {layers})" for i in range(layers)]
    expected += ["building the target graph (the LM head)", "checking the target", "loading the drafter"]
    expected += ["building the drafter body", "building the drafter body (the embedding table)"]
    expected += [f"building the drafter body (layer {i + 1} of {layers})" for i in range(layers)]
    expected += ["building the drafter heads", "building the drafter heads (the calibration text)"]
    assert doing == expected


def test_the_kill_line_is_certain_only_when_the_killer_counted_a_kill():
    watch = watchdog.Watch("nothing was written to /b", doing="loading the target", peak=int(3.14e9))
    watch.available, watch.oom_kills = int(2.9e9), {"/proc/vmstat": 4}
    certain = watchdog.killed_line(watch, {"/proc/vmstat": 5})
    assert certain == (
        "the export was killed while loading the target after reaching 3.1 GB of memory, with 2.9 GB available "
        "when it started (the system's out-of-memory killer ended it): close other programs (browsers, other "
        "models, IDEs) or export a smaller pair (--target, --draft); nothing was written to /b"
    )
    likely = watchdog.killed_line(watch, {"/proc/vmstat": 4})
    assert likely == certain.replace(
        "the system's out-of-memory killer ended it", "most likely the system's out-of-memory killer"
    )
