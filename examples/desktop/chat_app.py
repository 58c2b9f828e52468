"""Run the desktop chat: ``python examples/desktop/chat_app.py [BUNDLE] [--mode spec|ar|ssd] [--threads N]``.

With no bundle it loads the default one of ``edge-spec models`` (the picker lists the others)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A desktop chat window for an edge-spec bundle.")
    parser.add_argument("bundle", nargs="?", type=Path, help="bundle folder (default: the default bundle)")
    parser.add_argument("--mode", default="spec", choices=["spec", "ar", "ssd"], help="decoding loop")
    parser.add_argument("--threads", type=int, help="ONNX Runtime threads (default: all cores but one; 0: all)")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest answer, in tokens")
    parser.add_argument("--system", help="system prompt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError:
        print("the desktop chat needs PySide6: pip install 'edge-spec[desktop]'", file=sys.stderr)
        return 1
    from edge_chat.window import ChatWindow

    app = QApplication(sys.argv[:1])
    window = ChatWindow(
        args.bundle,
        load_options={"mode": args.mode} | ({} if args.threads is None else {"threads": args.threads}),
        generate_settings={"max_new_tokens": args.max_tokens},
        system=args.system,
    )
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
