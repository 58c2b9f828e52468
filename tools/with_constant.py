"""Run ``edge-spec`` or a benchmark script with one of the schedule's constants set otherwise, for A/B
runs of the schedule's tuning without editing the package.

    python tools/with_constant.py REQUEST_CAUTION=0 -- edge-spec bench BUNDLE --prompts ...
    python tools/with_constant.py CAUTION_FADE=24 -- benchmarks/studies/round_signals.py --analyze FILE ...

A name must be a module-level number in ``runtime/schedule`` (``acceptance``, ``policy``); the modules
read them at call time, so the override reaches every request the command makes.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from edge_spec.runtime.schedule import acceptance, policy

MODULES = (acceptance, policy)


def override(assignment: str) -> None:
    """Set ``NAME=NUMBER`` in every schedule module that has ``NAME`` as a public number, keeping its type
    (an int stays an int); anything else exits with one line, before the command runs."""
    name, _, value = assignment.partition("=")
    owners = [m for m in MODULES if isinstance(getattr(m, name, None), (int, float)) and not name.startswith("_")]
    if not owners or not value:
        raise SystemExit(
            f"with_constant: {assignment!r} is not NAME=NUMBER for a number in {', '.join(m.__name__ for m in MODULES)}"
        )
    for module in owners:
        setattr(module, name, type(getattr(module, name))(value))


def main() -> None:
    """``ASSIGNMENT... -- COMMAND...``: apply the assignments, then run the command in this process (the
    ``edge-spec`` CLI, or a script by its path), so that the changed numbers are the ones it reads."""
    args = sys.argv[1:]
    if "--" not in args or args.index("--") == len(args) - 1:
        raise SystemExit(__doc__)
    split = args.index("--")
    for assignment in args[:split]:
        override(assignment)
    command = args[split + 1 :]
    sys.argv = command
    if command[0] == "edge-spec":
        from edge_spec.cli import main as cli

        cli()
    else:
        sys.path.insert(0, str(Path(command[0]).resolve().parent))  # the script's sibling imports
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main()
