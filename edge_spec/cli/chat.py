"""``chat``: a conversation on the terminal."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path
from typing import Optional

import typer

from edge_spec.cli import output
from edge_spec.cli.groups import takes_groups
from edge_spec.cli.loading import check_sampler, engine_config, find_bundle, load_engine
from edge_spec.cli.options import BundleArg, EngineFlags, SamplingFlags, max_tokens_option
from edge_spec.cli.output import console


@takes_groups
def chat(
    bundle: Optional[Path] = BundleArg,
    max_tokens: int = max_tokens_option(512),
    sampling: SamplingFlags = ...,
    system: Optional[str] = typer.Option(None, help="System prompt."),
    engine: EngineFlags = ...,
    plain: bool = typer.Option(
        False,
        "--plain",
        help="Print answers as raw text, not rendered as Markdown "
        "(they are raw anyway when the output is not a terminal).",
    ),
) -> None:
    """Interactive chat: /help lists the commands, Ctrl-C stops the current answer, Ctrl-D leaves.

    Each answer ends with a line of statistics: tokens, tok/s (the tokens after the first, per second of
    decoding), the prefill time and τ = tokens emitted per target pass (1 for the target alone; each
    accepted draft adds to it).
    """
    bundle = find_bundle(bundle)
    config = engine_config(engine)
    check_sampler(sampling.sampler, [sampling.temperature], [config])
    loaded = load_engine(bundle, engine, config)
    from edge_spec.chat.loop import run_chat
    from edge_spec.chat.terminal import open_input

    def answer(messages, interrupt):  # output.stream looked up at each turn (tests replace it)
        return output.stream(
            loaded,
            messages,
            markdown=not plain,
            interrupt=interrupt,
            max_new_tokens=max_tokens,
            **dataclasses.asdict(sampling),
        )

    run_chat(loaded, open_input().read, answer, console=console, system=system, max_tokens=max_tokens)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    console.print(f"[dim]peak RSS {peak_mib:.0f} MiB[/dim]")
