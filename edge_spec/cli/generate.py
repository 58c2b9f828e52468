"""``generate``: one prompt answered, streamed to stdout."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import typer

from edge_spec.cli import output
from edge_spec.cli.groups import takes_groups
from edge_spec.cli.loading import check_sampler, engine_config, find_bundle, load_engine
from edge_spec.cli.options import EngineFlags, SamplingFlags, max_tokens_option
from edge_spec.cli.output import console
from edge_spec.errors import EdgeSpecError


def _is_bundle(argument: str) -> bool:
    """Whether ``argument`` names a directory holding a bundle's manifest (a prompt too long to be a file name,
    or one holding a NUL, is not one)."""
    from edge_spec.manifest import MANIFEST

    try:
        return (Path(argument) / MANIFEST).is_file()
    except (OSError, ValueError):
        return False


def _bundle_and_prompt(arguments: list[str]) -> tuple[Path, str]:
    """``generate``'s positional arguments, ``[BUNDLE] PROMPT``: two are a bundle and a prompt (the bundle is
    checked where it is read), one is the prompt for the default bundle, unless it names a bundle."""
    if len(arguments) > 2:
        raise EdgeSpecError(
            f"generate takes at most a bundle and a prompt, not {len(arguments)} arguments (quote a "
            "prompt of several words)"
        )
    if len(arguments) == 2:
        return find_bundle(Path(arguments[0])), arguments[1]
    (prompt,) = arguments
    if prompt != "-" and _is_bundle(prompt):
        raise EdgeSpecError(
            f'{prompt} is a bundle: give the prompt after the bundle (edge-spec generate {prompt} "PROMPT")'
        )
    return find_bundle(None), prompt


def _read_prompt(prompt: str) -> str:
    """The prompt argument, or standard input for ``-``: refuses empty and non-UTF-8 prompts."""
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EdgeSpecError(f"the prompt read from standard input is not UTF-8 text (byte {exc.start})") from None
        where = "read from standard input "
    else:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes the terminal's encoding could not decode (kept as surrogates)
            raise EdgeSpecError(
                "the prompt is not UTF-8 text (check the terminal's encoding, or pipe it in with -)"
            ) from None
        where = ""
    if not prompt.strip():
        raise EdgeSpecError(f"the prompt {where}is empty")
    return prompt


@takes_groups
def generate(
    arguments: list[str] = typer.Argument(
        ...,
        metavar="[BUNDLE] PROMPT",
        show_default=False,
        help="The bundle directory (default: the default bundle, see edge-spec "
        "models) and the prompt; - reads the prompt from standard input (e.g. a "
        "file piped in).",
    ),
    max_tokens: int = max_tokens_option(256),
    sampling: SamplingFlags = ...,
    stop: list[str] = typer.Option([], help="Stop string (repeatable)."),
    raw: bool = typer.Option(False, help="Send the prompt as is, without the chat template."),
    engine: EngineFlags = ...,
) -> None:
    """Answer one prompt and exit (Ctrl-C stops it: exit status 130).

    Each answer ends with a line of statistics: tokens, tok/s (the tokens after the first, per second of
    decoding), the prefill time and τ = tokens emitted per target pass (1 for the target alone; each
    accepted draft adds to it).
    """
    bundle, prompt = _bundle_and_prompt(arguments)
    prompt = _read_prompt(prompt)
    if any(not s for s in stop):
        raise EdgeSpecError("--stop must not be empty")
    config = engine_config(engine)
    check_sampler(sampling.sampler, [sampling.temperature], [config])
    loaded = load_engine(bundle, engine, config)
    request = prompt if raw else [{"role": "user", "content": prompt}]
    output.stream(loaded, request, max_new_tokens=max_tokens, stop=stop, **dataclasses.asdict(sampling))
    if loaded.last_stats.stop_reason == "cancelled":
        console.print("[red]cancelled[/red]")
        raise typer.Exit(130)
