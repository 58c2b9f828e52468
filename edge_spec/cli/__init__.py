"""``edge-spec`` command line: fetch, models, export, add-heads, info, generate, chat, serve, bench, train-head,
cache.

Each command lives in the module named after it (``fetch``, ``export`` with ``add-heads``, ``models``,
``info``, ``generate``, ``chat``, ``serve``, ``bench``, ``train_head``, ``cache``); the options several
commands share are declared once in ``options``.  User mistakes
surface as one ``error: ...`` line and exit code 1 (see :class:`edge_spec.errors.EdgeSpecError`);
tracebacks are for bugs only.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import typer

from edge_spec import extras
from edge_spec.cli import bench, cache, chat, export, fetch, generate, info, models, serve, train_head
from edge_spec.cli.output import console, out
from edge_spec.errors import EdgeSpecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Speculative decoding for local LLMs on ONNX Runtime.",
)
app.command()(fetch.fetch)
app.command()(export.export)
app.command("add-heads")(export.add_heads)
app.command()(info.info)
app.command("models")(models.models_list)
app.command()(generate.generate)
app.command()(chat.chat)
app.command()(serve.serve)
app.command()(bench.bench)
app.command("train-head")(train_head.train_head)
app.add_typer(cache.app, name="cache")


def main() -> None:
    """Console entry point: one-line errors for user mistakes, a mistyped flag or argument included (click
    would draw a usage box around it)."""
    click = _click_exceptions()
    try:
        code = app(standalone_mode=False, prog_name="edge-spec")
    except click.NoArgsIsHelpError as exc:  # bare `edge-spec` or `edge-spec generate`: the help
        out.print(exc.format_message(), markup=False)
        sys.exit(2)
    except click.UsageError as exc:
        where = f"; see {exc.ctx.command_path} --help" if exc.ctx else ""
        _error(exc.format_message().rstrip(".") + where)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        _error(exc.format_message())
        sys.exit(exc.exit_code)
    except EdgeSpecError as exc:
        _error(str(exc))
        sys.exit(1)
    except ModuleNotFoundError as exc:  # a module of an extra that is not installed, imported deep in a command
        missing = extras.explain(exc, _command_name() or "")
        if missing is None:
            raise
        _error(str(missing))
        sys.exit(1)
    except OSError as exc:  # a full disk, a read-only or forbidden path, no file handles left, ...
        from edge_spec.errors import os_error_line

        _error(os_error_line(exc))
        sys.exit(1)
    except (KeyboardInterrupt, click.Abort):
        console.print("[red]interrupted[/red]")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def _command_name() -> str | None:
    """The command on this process's command line (the first argument that names one)."""
    names = {command.name or command.callback.__name__.replace("_", "-") for command in app.registered_commands}
    return next((arg for arg in sys.argv[1:] if arg in names), None)


def _error(message: str) -> None:
    """One line on stderr; the message is printed as is (a path or a flag may hold brackets)."""
    from rich.text import Text

    console.print(Text.assemble(("error:", "red"), " ", message))


def _click_exceptions():
    """The exceptions of the click that typer runs on (recent typer has its own copy of click), with
    ``Abort`` beside them."""
    try:
        from typer._click import exceptions
        from typer.exceptions import Abort
    except ImportError:
        from click import exceptions
        from click.exceptions import Abort
    return SimpleNamespace(
        NoArgsIsHelpError=exceptions.NoArgsIsHelpError,
        UsageError=exceptions.UsageError,
        ClickException=exceptions.ClickException,
        Abort=Abort,
    )
