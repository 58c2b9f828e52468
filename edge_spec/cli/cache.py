"""``cache``: what edge-spec keeps of a user's answers on disk (the suffix cache), and forgetting it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edge_spec.cli.options import CACHE_DIR_HELP, default_suffix_cache_dir
from edge_spec.cli.output import out

app = typer.Typer(no_args_is_help=True, help="The suffix cache kept on disk (--persist-cache, --cache-dir).")


@app.command("clear")
def clear(
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", envvar="EDGE_SPEC_SUFFIX_CACHE_DIR", help=f"{CACHE_DIR_HELP} Default: the user's."
    ),
) -> None:
    """Remove every bundle's suffix cache file: the answers speculative decoding drafts from."""
    from edge_spec.runtime.suffix_store import clear_caches

    directory = cache_dir or default_suffix_cache_dir()
    removed = clear_caches(directory) if directory.is_dir() else []
    if not removed:
        out.print(f"no suffix cache in {directory}", markup=False)
    for path in removed:
        out.print(f"removed {path}", markup=False)
