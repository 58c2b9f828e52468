"""Drive the chat window by itself and report what a user would feel: how long the bundle takes to load,
how late the UI thread's event loop runs while an answer decodes (a 10 ms timer's lateness, p50 / p99 /
max), and, with ``--stop-after``, how long Stop takes to end the answer (``--rounds``: over several
answers); ``--screenshot`` saves the window while the answer streams.  Run it on a display, or under Xvfb:

    xvfb-run -a -s "-screen 0 1280x900x24" python examples/desktop/demo.py BUNDLE --screenshot shot.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from edge_chat.latency import LatencyProbe
from edge_chat.window import ChatWindow
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

PROMPT = "Write a Python function that checks whether a number is prime, with a docstring and a short example."


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--mode", default="spec")
    parser.add_argument("--threads", type=int, help="ONNX Runtime threads (default: all cores but one; 0: all)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--screenshot", type=Path, help="save the window here once the answer has --shot-chars")
    parser.add_argument("--shot-chars", type=int, default=400)
    parser.add_argument("--stop-after", type=float, help="press Stop this many seconds after the first token")
    parser.add_argument("--rounds", type=int, default=1, help="answers to ask for, one after the other")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    app = QApplication(sys.argv[:1])
    started = time.perf_counter()
    window = ChatWindow(
        args.bundle,
        load_options={"mode": args.mode} | ({} if args.threads is None else {"threads": args.threads}),
        generate_settings={"max_new_tokens": args.max_tokens},
    )
    window.show()
    probe = LatencyProbe(10)  # over all the answers, from the first Send to the last answer's end
    marks: dict[str, float] = {}
    stops: list[float] = []
    rounds = [0]

    def send() -> None:
        marks.pop("first", None)
        marks["sent"] = time.perf_counter()
        window.new_chat()
        window.send(args.prompt)

    def on_ready_poll() -> None:
        if not window.ready:
            return
        ready_poll.stop()
        print(f"load {time.perf_counter() - started:.2f} s")
        probe.start()
        send()

    def on_pieces(length: int) -> None:
        now = time.perf_counter()
        if "first" not in marks:
            marks["first"] = now
            print(f"first token {now - marks['sent']:.2f} s after Send")
            if args.stop_after is not None:
                QTimer.singleShot(round(args.stop_after * 1000), window.stop)
        if args.screenshot and "shot" not in marks and length >= args.shot_chars:
            marks["shot"] = now
            window.grab().save(str(args.screenshot))

    def on_done(stats) -> None:
        if args.screenshot and "shot" not in marks:
            marks["shot"] = time.perf_counter()
            window.grab().save(str(args.screenshot))
        line = f"answer: {stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tok/s, {stats.stop_reason}"
        if window.last_stop_seconds is not None and stats.stop_reason == "cancelled":
            stops.append(window.last_stop_seconds * 1000)
            line += f"; Stop to the answer's end {stops[-1]:.0f} ms"
        print(line)
        rounds[0] += 1
        if rounds[0] < args.rounds:
            QTimer.singleShot(0, send)
            return
        probe.stop()
        print(
            f"UI event loop lateness over {len(probe.lateness_ms)} ticks of 10 ms: p50 {probe.percentile(50):.1f} ms, "
            f"p99 {probe.percentile(99):.1f} ms, max {max(probe.lateness_ms):.1f} ms"
        )
        if stops:
            print(
                f"Stop to the answer's end over {len(stops)} answers: " + ", ".join(f"{ms:.0f}" for ms in stops) + " ms"
            )
        QTimer.singleShot(300, window.close)
        QTimer.singleShot(400, app.quit)

    ready_poll = QTimer()
    ready_poll.timeout.connect(on_ready_poll)
    ready_poll.start(20)
    window.answer_grew.connect(on_pieces)  # on the UI thread (the worker's signals are sent from its own)
    window.answer_done.connect(on_done)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
