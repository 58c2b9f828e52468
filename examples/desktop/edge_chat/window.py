"""The chat window: a bundle picker, the conversation with each answer token coloured by its source, a
legend, a composer with Send and Stop, and a progress bar while a bundle loads or a long prompt is read.

Nothing here decodes: the :class:`~edge_chat.worker.EngineWorker` does, on its own thread, so the window
keeps repainting and answering clicks while an answer streams in.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, QThread, Signal, Slot
from PySide6.QtGui import (
    QCloseEvent,
    QColor,
    QFont,
    QFontDatabase,
    QKeySequence,
    QShortcut,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from edge_chat.bundles import bundle_choices
from edge_chat.sources import LEGEND, LEGEND_NOTE, colour_of, source_colours
from edge_chat.worker import EngineWorker, Piece
from edge_spec.chat.render import footer
from edge_spec.paths import bundles_dir

TEXT_ON_SWATCH = QColor("#1b1f24")  # the swatches are light: dark text stays readable in a dark theme too


class ChatWindow(QMainWindow):
    request_load = Signal(str)  # to the worker thread
    request_generate = Signal(object, object)
    answer_grew = Signal(int)  # on the UI thread, once new text of the answer is shown: the answer's length
    answer_done = Signal(object)  # on the UI thread, once an answer is shown whole: its GenerationStats

    def __init__(
        self,
        bundle: Path | None = None,
        *,
        load_options: dict | None = None,
        generate_settings: dict | None = None,
        system: str | None = None,
    ) -> None:
        super().__init__()
        self.setWindowTitle("edge-spec chat")
        self.generate_settings = {"max_new_tokens": 512, **(generate_settings or {})}
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.turns: list[tuple[str, list[Piece]]] = []  # what the view shows: (role, pieces)
        self.busy = False  # an answer is asked for and has not ended
        self.ready = False  # a bundle is loaded
        self.answer_length = 0  # characters of the answer streaming now
        self.stop_pressed_at: float | None = None
        self.last_stop_seconds: float | None = None  # from Stop to the answer's end, for the last stopped one

        self._build()
        self.worker = EngineWorker(load_options)
        self.thread_ = QThread(self)
        self.thread_.setObjectName("engine")
        self.worker.moveToThread(self.thread_)
        self.request_load.connect(self.worker.load)
        self.request_generate.connect(self.worker.generate)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.load_failed.connect(self._on_load_failed)
        self.worker.load_progress.connect(self._on_load_progress)
        self.worker.progress.connect(self._on_progress)
        self.worker.pieces_ready.connect(self._on_pieces)
        self.worker.finished.connect(self._on_finished)
        self.worker.failed.connect(self._on_failed)
        self.thread_.start()
        QApplication.instance().aboutToQuit.connect(self.close)  # the engine thread ends before the application
        self._fill_bundles(bundle)

    # layout
    def _build(self) -> None:
        root = QWidget()
        layout = QVBoxLayout(root)

        picker = QHBoxLayout()
        picker.addWidget(QLabel("Bundle:"))
        self.bundles = QComboBox()
        self.bundles.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.bundles.activated.connect(self._on_bundle_chosen)
        picker.addWidget(self.bundles, 1)
        self.open_button = QPushButton("Open…")
        self.open_button.setToolTip("Load a bundle folder from elsewhere")
        self.open_button.clicked.connect(self._open_bundle)
        picker.addWidget(self.open_button)
        layout.addLayout(picker)

        self.progress = QProgressBar()
        self.progress.setTextVisible(False)
        self.progress.setMaximumHeight(8)
        self.progress.hide()
        layout.addWidget(self.progress)

        legend = QHBoxLayout()
        legend.addWidget(QLabel("<b>tokens from:</b>"))
        colours = source_colours()
        for key, label, meaning in LEGEND:
            swatch = QLabel(label)
            swatch.setObjectName(f"legend-{key}")
            swatch.setToolTip(f"{meaning}. {LEGEND_NOTE}")
            swatch.setStyleSheet(
                f"background: {colours[key]}; color: {TEXT_ON_SWATCH.name()}; border-radius: 3px; padding: 1px 5px;"
            )
            legend.addWidget(swatch)
        legend.addStretch(1)
        self.colour_box = QCheckBox("Colour tokens by source")
        self.colour_box.setChecked(True)
        self.colour_box.toggled.connect(self._render_all)
        legend.addWidget(self.colour_box)
        layout.addLayout(legend)

        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        self.view.document().setDefaultFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))  # code
        self.view.setPlaceholderText("The conversation appears here.")
        layout.addWidget(self.view, 1)

        composer = QHBoxLayout()
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Ctrl+Enter sends)")
        self.input.setFixedHeight(64)
        composer.addWidget(self.input, 1)
        buttons = QVBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_chat)
        for button in (self.send_button, self.stop_button, self.new_button):
            buttons.addWidget(button)
        composer.addLayout(buttons)
        layout.addLayout(composer)
        QShortcut(QKeySequence("Ctrl+Return"), self, activated=self.send)
        QShortcut(QKeySequence("Escape"), self, activated=self.stop)

        self.setCentralWidget(root)
        self.resize(900, 640)
        self._update_buttons()

    def _update_buttons(self) -> None:
        self.send_button.setEnabled(self.ready and not self.busy)
        self.stop_button.setEnabled(self.busy)
        self.new_button.setEnabled(not self.busy)
        self.bundles.setEnabled(not self.busy)
        self.open_button.setEnabled(not self.busy)

    # bundles
    def _fill_bundles(self, bundle: Path | None) -> None:
        for choice in bundle_choices():
            self.bundles.addItem(choice.label, str(choice.path))
            self.bundles.setItemData(self.bundles.count() - 1, choice.summary, Qt.ItemDataRole.ToolTipRole)
        if bundle is not None:
            self._select_bundle(Path(bundle))
        elif self.bundles.count():
            self._on_bundle_chosen(0)
        else:
            self.statusBar().showMessage(
                f"no bundles in {bundles_dir()}: run `edge-spec fetch && edge-spec export`, or Open… a bundle folder"
            )

    def _select_bundle(self, path: Path) -> None:
        index = self.bundles.findData(str(path))
        if index < 0:
            self.bundles.addItem(f"{path.name} ({path.parent})", str(path))
            index = self.bundles.count() - 1
        self.bundles.setCurrentIndex(index)
        self._on_bundle_chosen(index)

    @Slot(int)
    def _on_bundle_chosen(self, index: int) -> None:
        path = self.bundles.itemData(index)
        if path is None or self.busy:
            return
        self.ready = False
        self._update_buttons()
        self._show_progress(-1.0)
        self.statusBar().showMessage(f"loading {Path(path).name}…")
        self.worker.cancel_load()  # a load still running gives way to this one
        self.request_load.emit(path)

    def _open_bundle(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Open a bundle folder", str(bundles_dir()))
        if folder:
            self._select_bundle(Path(folder))

    @Slot(str)
    def _on_loaded(self, path: str) -> None:
        if self.worker.engine is None or path != self.bundles.currentData():  # closed, or another one follows
            return
        self.ready = True
        self.progress.hide()
        self.statusBar().showMessage(f"{Path(path).name} loaded ({self.worker.engine.config.mode} mode)")
        self._update_buttons()
        self.input.setFocus()

    @Slot(str)
    def _on_load_failed(self, why: str) -> None:
        if not why:  # cancelled: the load asked for since follows
            return
        self.progress.hide()
        self.statusBar().showMessage(f"cannot load the bundle: {why}")
        self._update_buttons()

    @Slot(str, float)
    def _on_load_progress(self, stage: str, fraction: float) -> None:
        """The load's stages in turn (verifying the files, reading the models, measuring this machine),
        each filling the bar."""
        name = Path(self.bundles.currentData() or "").name
        self.statusBar().showMessage(f"loading {name}: {stage} {fraction:.0%}")
        self._show_progress(fraction)

    @Slot(float)
    def _on_progress(self, fraction: float) -> None:
        self._show_progress(fraction)

    def _show_progress(self, fraction: float) -> None:
        """A bar filled to ``fraction``, or a busy bar while the fraction is unknown (-1)."""
        if fraction < 0:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(round(1000 * min(fraction, 1.0)))
        self.progress.show()

    # the conversation
    def send(self, text: str | None = None) -> bool:
        """Ask for an answer to ``text`` (default: the composer's text); False when it cannot be sent now."""
        text = (text if isinstance(text, str) else self.input.toPlainText()).strip()
        if not text or self.busy or not self.ready:
            return False
        self.input.clear()
        self.messages.append({"role": "user", "content": text})
        self.turns.append(("user", [[text, ""]]))
        self._render_turn("user", [[text, ""]])
        self.turns.append(("assistant", []))
        self._render_header("assistant")
        self.busy = True
        self.answer_length = 0
        self.stop_pressed_at = None
        self._update_buttons()
        self._show_progress(-1.0)
        self.statusBar().showMessage("reading the prompt…")
        self.worker.arm()
        self.request_generate.emit(list(self.messages), dict(self.generate_settings))
        return True

    def stop(self) -> None:
        if self.busy:
            self.stop_pressed_at = time.perf_counter()
            self.worker.stop()
            self.statusBar().showMessage("stopping…")

    def new_chat(self) -> None:
        if self.busy:
            return
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.turns = []
        self.view.clear()

    def answer_text(self) -> str:
        """The last answer's text so far."""
        return "".join(text for text, _ in self.turns[-1][1]) if self.turns and self.turns[-1][0] == "assistant" else ""

    @Slot()
    def _on_pieces(self) -> None:
        pieces = self.worker.take_pieces()
        if not pieces or not self.turns or self.stop_pressed_at is not None:
            return  # after Stop the answer shows no more: the engine ends within the round it is in
        if self.progress.isVisible():
            self.progress.hide()
            self.statusBar().showMessage("answering…")
        self.turns[-1][1].extend(pieces)
        self._append_pieces(pieces)
        self.answer_length += sum(len(text) for text, _ in pieces)
        self.answer_grew.emit(self.answer_length)

    @Slot(object)
    def _on_finished(self, stats) -> None:
        self._on_pieces()  # anything streamed after the last notification was taken
        if self.stop_pressed_at is not None:
            self.last_stop_seconds = time.perf_counter() - self.stop_pressed_at
        answer = self.answer_text()
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
        self.statusBar().showMessage(footer(stats))
        self._end_answer()
        self.answer_done.emit(stats)

    @Slot(str)
    def _on_failed(self, why: str) -> None:
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()  # not answered: the next message does not follow it
        self.statusBar().showMessage(f"error: {why}")
        self._end_answer()
        self.answer_done.emit(None)

    def _end_answer(self) -> None:
        self.busy = False
        self.progress.hide()
        self._update_buttons()

    # rendering
    def _cursor(self) -> QTextCursor:
        cursor = self.view.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _render_header(self, role: str) -> None:
        cursor = self._cursor()
        if not self.view.document().isEmpty():
            cursor.insertBlock()
            cursor.insertBlock()
        header = QTextCharFormat()
        header.setFontWeight(QFont.Weight.Bold)
        cursor.insertText("You" if role == "user" else "Assistant", header)
        cursor.insertBlock()
        cursor.setCharFormat(QTextCharFormat())

    def _render_turn(self, role: str, pieces: list[Piece]) -> None:
        self._render_header(role)
        self._append_pieces(pieces)

    def _append_pieces(self, pieces: list[Piece]) -> None:
        """Add text at the end of the view, each piece on its source's colour; the view follows the end
        when it was showing it."""
        bar = self.view.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 4
        cursor = self._cursor()
        cursor.beginEditBlock()
        colour = self.colour_box.isChecked()
        for text, source in pieces:
            style = QTextCharFormat()
            background = colour_of(source) if colour and source else None
            if background is not None:
                style.setBackground(QColor(background))
                style.setForeground(TEXT_ON_SWATCH)
            cursor.insertText(text, style)
        cursor.endEditBlock()
        if following:
            bar.setValue(bar.maximum())

    @Slot()
    def _render_all(self) -> None:
        self.view.clear()
        for role, pieces in self.turns:
            self._render_turn(role, pieces)

    def closeEvent(self, event: QCloseEvent) -> None:
        """Stop the answer, end the engine thread (after the load or answer it runs), release the engine."""
        self.worker.blockSignals(True)  # nothing more for a closed window
        self.worker.cancel_load()
        self.worker.stop()
        self.thread_.quit()
        self.thread_.wait()
        self.worker.close()
        super().closeEvent(event)
