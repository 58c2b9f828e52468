"""The desktop chat example (examples/desktop, PySide6): a window that runs the engine in process on a
worker thread.  On the tiny bundle: the picker lists what ``edge-spec models`` lists, an answer streams
into the view with each token on its source's colour, Stop ends it promptly, and the UI thread's event
loop keeps its 10 ms timer on time while the answer decodes.  Runs on Qt's offscreen platform (no display
needed); skipped where PySide6 or pytest-qt is not installed (both are in the test extra)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="the desktop example needs PySide6: pip install -e '.[test]'")
pytest.importorskip("pytestqt", reason="the desktop example's tests need pytest-qt: pip install -e '.[test]'")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QLabel  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "desktop"
sys.path.insert(0, str(EXAMPLE))

from edge_chat.latency import LatencyProbe  # noqa: E402
from edge_chat.sources import LEGEND, source_colours  # noqa: E402
from edge_chat.window import ChatWindow  # noqa: E402

from edge_spec.paths import default_bundle  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import loop_config  # noqa: E402

PROMPT = "hi"  # the tiny target answers it at length: 236 tokens, up to the bundle's context
ANSWER_WAIT_MS = 120_000


@pytest.fixture
def models_dir(tmp_path, monkeypatch, fp32_bundle):
    """A models directory whose bundles/ holds the tiny bundle under the default bundle's name and under
    another name."""
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(tmp_path))
    default = default_bundle()
    shutil.copytree(fp32_bundle, default)
    shutil.copytree(fp32_bundle, default.parent / "another-fp32")
    return tmp_path


@pytest.fixture
def make_window(qtbot):
    """ChatWindow(...), shown, and closed at the end of the test (which ends its engine thread)."""
    windows = []

    def make(*args, **kwargs) -> ChatWindow:
        window = ChatWindow(*args, **kwargs)
        qtbot.addWidget(window)
        windows.append(window)
        window.show()
        return window

    yield make
    for window in windows:
        window.close()


@pytest.fixture
def window(qtbot, models_dir, make_window):
    """The window on the default bundle, loaded: spec mode with a fixed draft length (the tiny drafter's
    drafts are then proposed whatever this machine's costs), one thread (the other core stays the UI's)."""
    load_options = {"threads": 1, "config": loop_config("spec", gamma=4, schedule="fixed")}
    window = make_window(load_options=load_options, generate_settings={"max_new_tokens": 400})
    qtbot.waitUntil(lambda: window.ready, timeout=ANSWER_WAIT_MS)
    return window


def ask(qtbot, window: ChatWindow, text: str = PROMPT):
    with qtbot.waitSignal(window.answer_done, timeout=ANSWER_WAIT_MS) as done:
        assert window.send(text)
    return done.args[0]


def greedy_answer(bundle: Path, prompt: str, max_new_tokens: int) -> str:
    with Engine.from_bundle(bundle, threads=1) as engine:
        return engine.complete([{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens).text


NEWLINES = "\n\r\u2028\u2029"  # the view keeps each as a paragraph break


def as_shown(text: str) -> str:
    """``text`` as the view's toPlainText() gives it back (line breaks as "\\n", no-break spaces as spaces)."""
    return "".join("\n" if c in NEWLINES else " " if c == "\xa0" else c for c in text)


def shown_colours(window: ChatWindow) -> list[tuple[str, str | None]]:
    """Every character of the view but its paragraph breaks, with its background colour (None: none)."""
    shown = []
    block = window.view.document().begin()
    while block.isValid():
        fragments = block.begin()
        while not fragments.atEnd():
            fragment = fragments.fragment()
            brush = fragment.charFormat().background()
            colour = None if brush.style() == Qt.BrushStyle.NoBrush else brush.color().name()
            shown.extend((c, colour) for c in fragment.text())
            fragments += 1
        block = block.next()
    return shown


def test_the_picker_offers_the_bundles_edge_spec_models_lists(qtbot, models_dir, make_window):
    window = make_window(load_options={"threads": 1})
    items = [(window.bundles.itemText(i), window.bundles.itemData(i)) for i in range(window.bundles.count())]
    default = default_bundle()
    assert items == [
        (f"{default.name} (default)", str(default)),
        ("another-fp32", str(default.parent / "another-fp32")),
    ]
    assert window.progress.isVisible()  # the default one is loading
    qtbot.waitUntil(lambda: window.ready, timeout=ANSWER_WAIT_MS)
    assert not window.progress.isVisible() and window.worker.engine.bundle.bundle_dir == default


def test_the_progress_bar_follows_the_load_stages(qtbot, models_dir, make_window):
    window = make_window(load_options={"threads": 1})
    reports: list[tuple[str, float]] = []
    window.worker.load_progress.connect(lambda stage, fraction: reports.append((stage, fraction)))
    qtbot.waitUntil(lambda: window.ready, timeout=ANSWER_WAIT_MS)
    stages = [stage for stage, _ in reports]
    assert {"reading", "measuring"} <= set(stages) and stages.index("reading") < stages.index("measuring")
    assert ("reading", 1.0) in reports and window.progress.isHidden()
    window._on_load_progress("reading", 0.42)  # what a report shows: the stage's fraction, and its name
    assert not window.progress.isHidden() and (window.progress.value(), window.progress.maximum()) == (420, 1000)
    assert "reading 42%" in window.statusBar().currentMessage()


def test_another_bundle_picked_during_a_load_is_the_one_loaded(qtbot, models_dir, make_window):
    window = make_window(load_options={"threads": 1})
    window.bundles.setCurrentIndex(1)
    window.bundles.activated.emit(1)  # as a click on the second entry does, while the first one loads
    qtbot.waitUntil(lambda: window.ready, timeout=ANSWER_WAIT_MS)
    qtbot.wait(200)  # a late report of the first load would show here
    assert window.worker.engine.bundle.bundle_dir == default_bundle().parent / "another-fp32"
    assert window.ready and window.send_button.isEnabled()


def test_no_bundle_says_how_to_make_one(tmp_path, monkeypatch, make_window):
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(tmp_path))
    window = make_window()
    assert window.bundles.count() == 0 and not window.send_button.isEnabled()
    assert "edge-spec export" in window.statusBar().currentMessage()


def test_an_answer_streams_into_the_view_coloured_by_source(qtbot, window, fp32_bundle):
    taken: list[int] = []  # how many pieces each delivery to the UI thread carried
    take = window.worker.take_pieces

    def counted():
        pieces = take()
        taken.append(len(pieces))
        return pieces

    window.worker.take_pieces = counted
    stats = ask(qtbot, window)
    answer = window.answer_text()
    assert stats.stop_reason == "length" and answer == greedy_answer(fp32_bundle, PROMPT, 400)
    assert sum(1 for n in taken if n) > 1, "the answer arrived in one piece, not streamed"
    assert as_shown(answer) in window.view.toPlainText()

    colours = source_colours()
    pieces = window.turns[-1][1]
    assert {"target", "model"} <= {source for _, source in pieces}  # accepted drafts and the target's tokens
    wanted = [(c, colours[source]) for text, source in pieces for c in text if c not in NEWLINES]
    assert [(c, colour) for c, colour in shown_colours(window) if colour is not None] == wanted

    window.colour_box.setChecked(False)  # plain text: no background anywhere, the same text
    assert all(colour is None for _, colour in shown_colours(window))
    assert as_shown(answer) in window.view.toPlainText()

    for key, label, meaning in LEGEND:  # the legend shows the chat page's colours
        swatch = window.findChild(QLabel, f"legend-{key}")
        assert swatch.text() == label and meaning in swatch.toolTip()
        assert f"background: {colours[key]}" in swatch.styleSheet()


def test_stop_ends_the_answer_promptly(qtbot, window):
    full = ask(qtbot, window)
    assert full.stop_reason == "length"
    window.new_chat()

    shown_at_stop = []

    def stop_at_first_piece(length: int):
        window.answer_grew.disconnect(stop_at_first_piece)
        shown_at_stop.append(length)
        window.stop_button.click()

    window.answer_grew.connect(stop_at_first_piece)
    stats = ask(qtbot, window)
    assert stats.stop_reason == "cancelled"
    assert 0 < stats.new_tokens < full.new_tokens / 2
    assert window.last_stop_seconds < 0.5
    assert len(window.answer_text()) == shown_at_stop[0]  # nothing shown after Stop
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()
    # the stopped answer stays in the conversation, and the next message follows it
    assert window.messages[-1] == {"role": "assistant", "content": window.answer_text()}


def test_stop_pressed_before_the_engine_starts_is_kept(qtbot, window):
    """Stop right after Send, before the worker thread has begun the answer (the engine clears earlier
    cancels when a generation starts): the answer still ends at once."""
    with qtbot.waitSignal(window.answer_done, timeout=ANSWER_WAIT_MS) as done:
        window.send(PROMPT)
        window.stop()
    assert done.args[0].stop_reason == "cancelled" and done.args[0].new_tokens <= 2


def test_the_ui_thread_stays_responsive_while_decoding(qtbot, window):
    probe = LatencyProbe(10)
    probe.start()
    started = time.perf_counter()
    while time.perf_counter() - started < 3:
        ask(qtbot, window)
        window.new_chat()
    probe.stop()
    p99 = probe.percentile(99)
    print(f"UI event loop lateness over {len(probe.lateness_ms)} ticks of 10 ms: p99 {p99:.1f} ms")
    assert len(probe.lateness_ms) > 100 and p99 < 50


def test_the_probe_sees_a_blocked_event_loop(qtbot):
    """The latency probe is a real measurement: a UI thread blocked for 150 ms shows as a late tick."""
    probe = LatencyProbe(10)
    probe.start()
    qtbot.wait(50)
    time.sleep(0.15)
    qtbot.wait(50)
    probe.stop()
    assert max(probe.lateness_ms) >= 130 and probe.percentile(50) < 20


def test_processing_events_keeps_its_references(qapp):
    """pytest-qt processes Qt's events around every test once a QApplication exists, and the window's
    thread hands its signals over through them: a binding whose processEvents drops a reference to None
    on each call (PySide6 6.12.0, excluded in pyproject.toml) would crash the interpreter later on."""
    before = sys.getrefcount(None)
    for _ in range(1000):
        qapp.processEvents()
    assert sys.getrefcount(None) - before > -100
