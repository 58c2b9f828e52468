"""One name per concept on the command line: a flag means the same thing in every command, and a concept
is spelt the same way everywhere.

Every option's help begins with what the option is (its *lead*: the text before the first ``.``, ``;``,
``:`` or ``(``); what follows may say how one command uses it (its default there, whether it repeats).
``CONCEPTS`` maps each concept's canonical name to a pattern that recognises the concept at the start of
a help text, in the words its help uses and in the ways it was once phrased."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from collections import defaultdict

import pytest
import typer.main

from edge_spec.cli import app
from edge_spec.runtime.loops.config import ADAPTIVE_GAMMA_MAX, FIXED_GAMMA, SsdConfig, TreeConfig

# canonical name -> pattern over the start of a help text
CONCEPTS: dict[str, str] = {
    "BUNDLE": r"(the )?bundle directory",
    "--output": r"output directory|directory for",
    "--provider": r"execution provider\b",
    "--draft-provider": r"drafter execution provider",
    "--provider-option": r"provider option|key=value for the --provider",
    "--threads": r"intra-op threads",
    "--draft-threads": r"drafter intra-op threads",
    "--mode": r"decoding mode\b|spec \(speculative",
    "--gamma": r"draft tokens per target pass|with --costs: the longest draft",
    "--schedule": r"draft length schedule|spec: adaptive",
    "--drafts": r"(spec: |multi-draft modes: )?drafts per step",
    "--verifier": r"multi-draft (sampling )?verifier",
    "--lookup": r"prompt lookup drafting|spec: also draft by prompt lookup",
    "--drafter": r"drafter kind|spec: what drafts",
    "--suffix-cache": r"draft from the suffix cache",
    "--persist-cache": r"keep the suffix cache",
    "--cache-dir": r"directory of the suffix cache",
    "--corpus": r"a directory \(your repository\)",
    "--draft-head": r"(spec: )?drafter heads?\b",
    "--eagle-head": r"eagle lm heads?\b|--drafter eagle: the eagle head's lm head",
    "--eagle": r"eagle-3 head to attach|also attach an eagle-3 head",
    "--draft-vocab": r"drafter lm heads\b|heads to add",
    "--vocab-size": r"(eagle )?(draft )?vocabulary size",
    "--draft": r"drafter( source)?:|drafter source",
    "--target": r"target( source)?:",
    "--exact": r"batch-invariant",
    "--verify": r"(also )?check every (bundle )?file's sha256",
    "--temperature": r"(sampling )?temperatures?\b|0 = greedy",
    "--top-k": r"keep the k most likely",
    "--top-p": r"nucleus sampling",
    "--seed": r"(random )?seed\b",
    "--sampler": r"how sampled (tokens|answers) are drawn",
    "--max-tokens": r"(maximum|most) (new )?tokens|new tokens per",
    "--prompts": r"prompt (file|set)",
    "--calibration": r"calibration prompt file|vocabtrim/specvocab: calibration",
    "--keep": r"vocabtrim rows kept|vocabtrim: vocabulary rows kept",
    "--rank": r"specvocab:? scorer rank",
    "--candidates": r"specvocab:? candidates",
    "--scorer": r"specvocab scorer fit",
    "--train-steps": r"specvocab:? distillation steps",
    "--union-keep": r"static vocabtrim rows|trim\+specvocab: static vocabtrim rows",
    "--scorer-vocab": r"specvocab:? (scorer rows|rows the scorer ranks)",
}


def _lead(help_text: str) -> str:
    """What an option is: its help up to the first ``.``, ``;``, ``:`` or ``(``."""
    return re.match(r"[^.;:(]*", help_text).group().strip()


def _kind(param) -> str:
    """The type of one value of an option (a repeatable option takes several such values)."""
    if hasattr(param, "type"):  # click's own Option
        return param.type.name
    annotation = param.type_descriptor.annotation  # typer's copy of click
    args = typing.get_args(annotation)
    annotation = args[0] if args and param.multiple else annotation
    return getattr(annotation, "__name__", str(annotation))


def _concepts_of(help_text: str) -> list[str]:
    return [name for name, pattern in CONCEPTS.items() if re.match(pattern, help_text, re.IGNORECASE)]


def _parameters() -> list[tuple[str, object]]:
    """(command, parameter) for every visible parameter of every command."""
    group = typer.main.get_command(app)
    return [
        (name, param)
        for name, command in sorted(group.commands.items())
        for param in command.params
        if not getattr(param, "hidden", False) and param.name != "help"
    ]


def _options() -> list[tuple[str, str, object]]:
    """(command, flag, option) for every visible option."""
    return [(command, param.opts[0], param) for command, param in _parameters() if param.param_type_name == "option"]


def test_every_option_says_what_it_is():
    missing = [f"{command} {flag}" for command, flag, param in _options() if not _lead(param.help or "")]
    assert not missing, f"options without a help text saying what they are: {missing}"


def test_a_concept_has_one_name():
    """An option whose help names a concept is spelt as that concept's canonical flag."""
    clashes = []
    for command, flag, param in _options():
        for concept in _concepts_of(param.help or ""):
            if flag != concept:
                clashes.append(f"{command} {flag} is {concept} ({_lead(param.help)!r})")
    for command, param in _parameters():
        if param.param_type_name == "argument" and "BUNDLE" in _concepts_of(param.help or ""):
            name = param.metavar or param.name.upper()
            if "BUNDLE" not in re.findall(r"\w+", name):
                clashes.append(f"{command} argument {name} is BUNDLE")
    assert not clashes, "a concept with two names:\n" + "\n".join(clashes)


def test_a_flag_named_after_a_concept_means_it():
    """An option spelt as a concept's canonical flag is that concept."""
    wrong = [
        f"{command} {flag}: {_lead(param.help or '')!r}"
        for command, flag, param in _options()
        if flag in CONCEPTS and not re.match(CONCEPTS[flag], param.help or "", re.IGNORECASE)
    ]
    assert not wrong, "flags used for another meaning:\n" + "\n".join(wrong)


def test_a_flag_means_the_same_in_every_command():
    """A flag several commands take has one lead and one value type, and is a named concept."""
    uses = defaultdict(list)
    for command, flag, param in _options():
        uses[flag].append((command, _lead(param.help or ""), _kind(param)))
    differing = []
    for flag, seen in sorted(uses.items()):
        if len(seen) < 2:
            continue
        if flag not in CONCEPTS:
            differing.append(f"{flag} ({', '.join(c for c, _, _ in seen)}) is no concept of CONCEPTS")
        if len({(lead, kind) for _, lead, kind in seen}) > 1:
            differing.append(f"{flag}: " + "; ".join(f"{c}: {lead!r} [{kind}]" for c, lead, kind in seen))
    assert not differing, "flags with several meanings:\n" + "\n".join(differing)


def _help(*command: str) -> str:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def test_the_gamma_help_states_the_configured_defaults():
    text = " ".join(_help("generate").split())
    assert f"adaptive {ADAPTIVE_GAMMA_MAX}" in text and f"fixed {FIXED_GAMMA}" in text
    assert f"multi-draft {TreeConfig.gamma}" in text and f"ssd {SsdConfig.gamma}" in text


def test_every_command_has_a_help():
    for command in typer.main.get_command(app).commands:
        assert "Usage:" in _help(command)


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"]])
def test_the_package_runs_as_a_module(args):
    result = subprocess.run(
        [sys.executable, "-m", "edge_spec.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "300", "NO_COLOR": "1", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    if args[0] == "bench":
        assert "--modes" in result.stdout
