"""The chat on a terminal: commands answered locally, one message per Enter (a paste of many lines
included), history kept between runs, answers rendered as Markdown while they stream, and Ctrl-C that
stops an answer at any moment after Enter, the reading of the prompt included."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import time

import pyte
import pytest
from prompt_toolkit.history import FileHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from edge_spec.chat.commands import Command, Message, Unknown, line_continues, parse
from edge_spec.chat.interrupt import CancelOnInterrupt
from edge_spec.chat.loop import run_chat
from edge_spec.chat.render import MarkdownStream, footer, stream_answer
from edge_spec.chat.terminal import PlainInput, TerminalInput, history_file

# ---------------------------------------------------------------------------
# commands and the line-continuation rule
# ---------------------------------------------------------------------------


def test_commands_are_recognised_on_a_line_of_their_own():
    assert parse("/help") == Command("help")
    assert parse("  /reset  ") == Command("reset")
    assert parse("/exit") == parse("/quit") == Command("exit")
    assert parse("/help me") == Command("help")  # the first word names the command
    assert parse("") is None and parse("   \n ") is None


def test_an_unknown_command_is_one_line_and_no_message():
    unknown = parse("/usr/bin/env is slow")
    assert unknown == Unknown("/usr/bin/env")
    assert unknown.line == "unknown command /usr/bin/env: /help lists them"


def test_a_double_slash_sends_the_text_with_one_slash_removed():
    assert parse("//help") == Message("/help")
    assert parse("// a comment") == Message("/ a comment")


def test_text_of_several_lines_is_a_message_even_when_it_starts_with_a_slash():
    pasted = "// add two numbers\nint add(int a, int b);"
    assert parse(pasted) == Message(pasted)
    assert parse("/etc/hosts\nwhat is this file?") == Message("/etc/hosts\nwhat is this file?")
    assert parse("hello") == Message("hello")


def test_a_trailing_backslash_continues_the_message():
    assert line_continues("first line \\")
    assert not line_continues("first line")
    assert not line_continues("path\\ ")  # only a backslash that ends the line


def test_piped_lines_are_messages_and_a_trailing_backslash_joins_them():
    reader = PlainInput(io.StringIO("one\ntwo \\\nthree\n\\\nlast\n"), prompt="")
    assert [reader.read() for _ in range(4)] == ["one", "two \nthree", "\nlast", None]


# ---------------------------------------------------------------------------
# the line editor
# ---------------------------------------------------------------------------


def typed(text: str, history: str | os.PathLike, reads: int) -> list[str | None]:
    """What ``reads`` reads of the chat's line editor return when ``text`` is typed."""
    with create_pipe_input() as keys:
        keys.send_text(text)
        reader = TerminalInput(history, input=keys, output=DummyOutput())
        return [reader.read() for _ in range(reads)]


def test_a_bracketed_paste_of_several_lines_is_one_message(tmp_path):
    paste = "\x1b[200~line1\nline2\r\nline3\x1b[201~"
    assert typed(paste + "\r" + "next\r", tmp_path / "h", 2) == ["line1\nline2\nline3", "next"]


def test_alt_enter_and_a_trailing_backslash_insert_a_new_line(tmp_path):
    assert typed("one\x1b\rtwo\r", tmp_path / "h", 1) == ["one\ntwo"]
    assert typed("one\\\rtwo\\\rthree\r", tmp_path / "h", 1) == ["one\ntwo\nthree"]


def test_ctrl_c_clears_the_line_and_ctrl_d_leaves(tmp_path):
    assert typed("discarded\x03kept\r", tmp_path / "h", 1) == ["kept"]
    assert typed("\x04", tmp_path / "h", 1) == [None]


def test_history_is_kept_between_runs(tmp_path):
    path = tmp_path / "state" / "chat_history"
    typed("\x1b[200~def f():\n    pass\x1b[201~\r/help\r", path, 2)
    assert list(FileHistory(path).load_history_strings()) == ["/help", "def f():\n    pass"]  # newest first
    assert os.stat(path).st_mode & 0o077 == 0  # what was typed is the user's alone
    # a later run: two steps up the history recall the pasted message
    assert typed("\x1b[A\x1b[A\r", path, 1) == ["def f():\n    pass"]


def test_an_unwritable_history_is_one_warning_and_the_chat_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert typed("hello\r", blocker / "chat_history", 1) == ["hello"]
    err = capsys.readouterr().err
    assert "history" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_history_lives_in_the_user_state_directory(monkeypatch, tmp_path):
    import platformdirs

    monkeypatch.delenv("EDGE_SPEC_HOME", raising=False)
    assert history_file() == platformdirs.user_state_path("edge-spec", appauthor=False) / "chat_history"
    monkeypatch.setenv("EDGE_SPEC_HOME", str(tmp_path))
    assert history_file() == tmp_path / "chat_history"


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------


def screen_lines(raw: str, width: int, height: int) -> list[pyte.screens.Char]:
    """What a terminal shows after ``raw`` was written to it: the lines scrolled off the top, then the
    screen (each line a list of characters with their attributes)."""
    screen = pyte.HistoryScreen(width, height, history=10_000)
    screen.set_mode(pyte.modes.LNM)  # the terminal driver turns \n into \r\n
    pyte.Stream(screen).feed(raw)
    rows = [[line[x] for x in range(width)] for line in screen.history.top]
    rows += [[screen.buffer[y][x] for x in range(width)] for y in range(height)]
    return rows


def text_of(row) -> str:
    return "".join(char.data for char in row).rstrip()


def test_a_streamed_answer_is_markdown_with_highlighted_code_shown_once():
    answer = (
        "Here it is:\n\n```python\n"
        + "".join(f"value_{i} = {i}  # line {i}\n" for i in range(40))
        + "```\n\nA **bold** end.\n"
    )
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=60, height=12, color_system="truecolor")
    stream = MarkdownStream(console, min_interval=0)  # every chunk re-rendered: the hardest case
    with stream:
        for start in range(0, len(answer), 7):
            stream.add(answer[start : start + 7])
    rows = screen_lines(buffer.getvalue(), 60, 12)
    lines = [text_of(row) for row in rows]
    for i in range(40):  # each line once, in order, whatever the re-renders drew meanwhile
        assert sum(f"value_{i} = {i}  # line {i}" in line for line in lines) == 1, lines
    positions = [next(n for n, line in enumerate(lines) if f"# line {i}" in line) for i in range(40)]
    assert positions == sorted(positions)
    assert not any("```" in line or "**" in line for line in lines)  # rendered, not raw Markdown
    code = rows[positions[3]]
    assert len({char.fg for char in code if char.data.strip()}) > 1  # highlighted: several colours
    assert "A bold end." in lines


def test_an_answer_to_a_pipe_is_raw_text():
    buffer = io.StringIO()
    console = Console(file=buffer, width=60)  # not a terminal
    with MarkdownStream(console) as stream:
        stream.add("# Title\n\n```python\nx = 1\n")
        stream.add("```\n")
    assert buffer.getvalue() == "# Title\n\n```python\nx = 1\n```\n\n"


class FakeStats:
    new_tokens, tokens_per_second, prefill_seconds, spec, coupled_seed, stop_reason = 0, 0.0, 0.0, None, None, ""


class SlowEngine:
    """Like the engine: a generation clears any earlier cancel when it starts, then checks for one
    between the passes that read the prompt and after each token.  ``ctrl_c``: when the user presses
    Ctrl-C, "start" (after Enter, before the generation clears earlier cancels) or "prompt" (while
    the prompt is read)."""

    def __init__(self, ctrl_c: str | None = None, tokens: int = 200, passes: int = 5):
        import threading

        self._cancel = threading.Event()
        self.ctrl_c, self.tokens, self.passes = ctrl_c, tokens, passes
        self.last_stats = FakeStats()
        self.generated = 0

    def cancel(self):
        self._cancel.set()

    def generate(self, prompt, on_prefill=None, **kwargs):
        if self.ctrl_c == "start":
            os.kill(os.getpid(), signal.SIGINT)
        self._cancel.clear()
        self.last_stats = stats = FakeStats()
        stats.stop_reason = "length"
        for done in range(self.passes):
            if self.ctrl_c == "prompt" and done == 2:
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            if self._cancel.is_set():
                stats.stop_reason = "cancelled"
                return
            on_prefill(done / self.passes)
        for _ in range(self.tokens):
            self.generated += 1
            stats.new_tokens += 1
            yield "tok "
            if self._cancel.is_set():
                stats.stop_reason = "cancelled"
                return


@pytest.mark.parametrize("moment", ["start", "prompt"])
def test_ctrl_c_after_enter_stops_the_answer(moment):
    engine = SlowEngine(ctrl_c=moment)
    err = io.StringIO()
    with CancelOnInterrupt(engine) as interrupt:
        stream_answer(engine, "hi", out=Console(file=io.StringIO()), console=Console(file=err), interrupt=interrupt)
    assert engine.last_stats.stop_reason == "cancelled"
    assert engine.generated <= (1 if moment == "start" else 0)
    assert "cancelled]" in err.getvalue()


def test_without_a_turn_of_its_own_an_answer_still_stops_on_ctrl_c():
    engine = SlowEngine(ctrl_c="prompt")
    stream_answer(engine, "hi", out=Console(file=io.StringIO()), console=Console(file=io.StringIO()))
    assert engine.last_stats.stop_reason == "cancelled"


def test_outside_an_answer_ctrl_c_is_the_usual_keyboard_interrupt():
    # Python's own handler, as in a terminal; a process started in the background of a non-interactive
    # shell inherits SIGINT ignored and never gets it
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        engine = SlowEngine()
        with CancelOnInterrupt(engine):
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, started_with)


# ---------------------------------------------------------------------------
# the conversation
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(int4_bundle):
    from edge_spec.runtime.engine import Engine

    return Engine.from_bundle(int4_bundle, threads=1, mode="ar")


def converse(engine, lines: list[str]) -> tuple[list[list[dict]], str]:
    """The prompts the model was asked to answer, and what the chat said meanwhile."""
    asked = []

    def answer(messages, interrupt):
        asked.append([dict(m) for m in messages])
        return "ok"

    said = io.StringIO()
    script = iter(lines)
    run_chat(engine, lambda: next(script, None), answer, console=Console(file=said, width=200), max_tokens=8)
    return asked, said.getvalue()


def test_commands_never_reach_the_model(engine):
    asked, said = converse(engine, ["/help", "/nope", "hello", "/reset", "//help", "/quit", "never read"])
    assert [[m["content"] for m in prompt] for prompt in asked] == [["hello"], ["/help"]]  # /reset emptied it
    assert "unknown command /nope: /help lists them" in said
    for command in ("/help", "/reset", "/exit", "/quit", "//"):
        assert command in said  # the help lists them
    assert "history cleared" in said


def test_a_message_of_several_lines_is_one_turn(engine):
    asked, _ = converse(engine, ["line1\nline2\nline3", "next"])
    assert [prompt[-1]["content"] for prompt in asked] == ["line1\nline2\nline3", "next"]
    assert [m["role"] for m in asked[1]] == ["user", "assistant", "user"]


# ---------------------------------------------------------------------------
# the command on a pseudo-terminal
# ---------------------------------------------------------------------------

FOOTER = re.compile(r"\[\d+ tokens, (?:[\d.]+|-) tok/s, prefill [\d.]+ s[^\]]*, (\w+)\]")

# the chat with a slower model: each chunk of the answer 50 ms apart, the first one after FIRST_DELAY
# seconds (a long prompt being read), so that a person, or a test, can press Ctrl-C in the middle
SLOW_CHAT = """
import os, sys, time
from edge_spec.runtime.engine import Engine
real = Engine.generate
def slow(self, prompt, **kwargs):
    time.sleep(float(os.environ.get("FIRST_DELAY", "0")))
    for chunk in real(self, prompt, **kwargs):
        time.sleep(0.05)
        yield chunk
Engine.generate = slow
from edge_spec.cli import main
sys.argv = ["edge-spec", *sys.argv[1:]]
main()
"""


def spawn_chat(tmp_path, bundle, *args, slow=False, env=None):
    import pexpect

    environment = dict(
        os.environ, EDGE_SPEC_HOME=str(tmp_path), TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", **(env or {})
    )  # pexpect answers no cursor position requests
    environment.pop("NO_COLOR", None)
    command = ["-c", SLOW_CHAT] if slow else ["-m", "edge_spec.cli"]
    child = pexpect.spawn(
        sys.executable,
        [*command, "chat", str(bundle), "--threads", "1", *args],
        env=environment,
        dimensions=(30, 100),
        encoding="utf-8",
        timeout=120,
    )
    child.expect_exact(">>> ")
    return child


def leave(child) -> str:
    import pexpect

    child.send("/exit\r")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    return child.before


@pytest.mark.slow
def test_a_pasted_message_of_three_lines_is_one_turn_and_is_kept(tmp_path, int4_bundle):
    child = spawn_chat(tmp_path, int4_bundle, "--max-tokens", "8")
    child.send("\x1b[200~line1\nline2\nline3\x1b[201~")
    child.send("\r")
    child.expect(FOOTER)
    footers = 1
    child.expect_exact(">>> ")
    child.send("/help\r")
    child.expect_exact("/reset")
    child.expect_exact(">>> ")
    footers += len(FOOTER.findall(child.before))
    rest = leave(child)
    assert footers + len(FOOTER.findall(rest)) == 1  # one answer: the paste; /help never reached the model
    assert "Traceback" not in rest
    history = list(FileHistory(tmp_path / "chat_history").load_history_strings())
    assert history == ["/exit", "/help", "line1\nline2\nline3"]


@pytest.mark.slow
def test_ctrl_c_stops_a_long_answer_and_the_next_prompt_appears(tmp_path, int4_bundle):
    child = spawn_chat(tmp_path, int4_bundle, "--max-tokens", "200", "--plain", slow=True)
    child.send("tell me a long story\r")
    time.sleep(1.0)  # about 20 chunks in
    child.send("\x03")
    child.expect(FOOTER, timeout=10)
    assert child.match.group(1) == "cancelled"
    assert int(re.search(r"\[(\d+) tokens", child.match.group(0)).group(1)) < 100
    child.expect_exact(">>> ")
    assert "Traceback" not in leave(child)


@pytest.mark.slow
def test_ctrl_c_while_the_prompt_is_read_stops_the_answer(tmp_path, int4_bundle):
    child = spawn_chat(tmp_path, int4_bundle, "--max-tokens", "40", slow=True, env={"FIRST_DELAY": "2"})
    child.send("hello\r")
    time.sleep(1.0)  # in the middle of reading the prompt
    child.send("\x03")
    child.expect(FOOTER, timeout=10)
    assert child.match.group(1) == "cancelled"
    assert int(re.search(r"\[(\d+) tokens", child.match.group(0)).group(1)) <= 1
    child.expect_exact(">>> ")
    child.send("again\r")  # the chat goes on: the next answer runs to its end
    child.expect(FOOTER, timeout=30)
    assert child.match.group(1) != "cancelled"
    child.expect_exact(">>> ")
    leave(child)


@pytest.mark.slow
def test_ctrl_c_leaves_the_partial_answer_on_the_screen_once(tmp_path, int4_bundle):
    """The terminal echoes ^C where the cursor is: at the end of a live line drawn to the full width that
    starts a new line, below which the live area is redrawn, and the partial answer showed twice."""
    child = spawn_chat(tmp_path, int4_bundle, "--max-tokens", "200", slow=True)
    raw = io.StringIO()
    child.logfile_read = raw
    child.send("tell me a long story\r")
    time.sleep(1.0)  # about 20 chunks in, rendered as Markdown in the live area
    child.send("\x03")
    child.expect(FOOTER, timeout=10)
    assert child.match.group(1) == "cancelled"
    child.expect_exact(">>> ")
    leave(child)
    lines = [text_of(row) for row in screen_lines(raw.getvalue(), 100, 30)]
    asked = next(n for n, line in enumerate(lines) if "tell me a long story" in line)
    footer = next(n for n, line in enumerate(lines) if FOOTER.search(line))
    answer = [line for line in lines[asked + 1 : footer + 1] if line.strip()]
    assert answer and not any("^C" in line for line in answer), answer
    # every line of the partial answer once: none is followed by an earlier drawing of itself, or a longer one
    assert not any(later.startswith(line) for line, later in zip(answer, answer[1:])), answer


@pytest.mark.parametrize("tokens", [0, 1])
def test_an_answer_too_short_for_a_speed_shows_none(tokens):
    """The decode speed counts the tokens after the first (which the prompt's pass gives): under two
    tokens there is none to show, not 0.0 tok/s."""
    stats = FakeStats()
    stats.new_tokens, stats.prefill_seconds, stats.stop_reason = tokens, 0.2, "stop"
    assert footer(stats) == f"[{tokens} tokens, - tok/s, prefill 0.20 s, stop]"
    stats.new_tokens, stats.tokens_per_second = 2, 12.5
    assert footer(stats) == "[2 tokens, 12.5 tok/s, prefill 0.20 s, stop]"


@pytest.mark.parametrize("markdown", [True, False])
def test_control_characters_in_an_answer_never_reach_the_terminal(markdown):
    """Model text is text: an escape sequence in an answer (a window title, colours, a clipboard write)
    is shown as the characters it holds, never run by the terminal; the answer itself is kept as it came."""
    hostile = "hi \x1b]0;owned\x07 there \x1b[31mred\x1b]52;c;ZXZpbA==\x07\r\n\x9b2J end\n"
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=60, color_system="truecolor")
    with MarkdownStream(console, markdown=markdown, min_interval=0) as stream:
        stream.add(hostile)
    assert stream.text == hostile
    shown = buffer.getvalue()
    assert "\x1b]" not in shown and "\x07" not in shown and "\x9b" not in shown and "\x1b[31m" not in shown
    text = "\n".join(text_of(row) for row in screen_lines(shown, 60, 12))
    assert "hi ␛]0;owned␇ there ␛[31mred" in text and "end" in text
