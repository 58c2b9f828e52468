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
    "--prompt-reader": r"the int8 prompt reader",
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


# command -> option -> the defaults the code that runs uses, each read from where it is defined (all must agree)
def _configured_defaults() -> dict[str, dict[str, list]]:
    import inspect

    from edge_spec.defaults import (
        DEFAULT_HOST,
        DEFAULT_MAX_BODY,
        DEFAULT_MAX_QUEUE,
        DEFAULT_MODE,
        DEFAULT_PORT,
        DEFAULT_PROVIDER,
        DEFAULT_SHUTDOWN_GRACE,
        DEFAULT_THREADS,
        parse_size,
    )
    from edge_spec.runtime.loaded import LoadOptions
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.server import serve
    from edge_spec.server.guard import GuardPolicy, make_policy
    from edge_spec.train import trainer
    from edge_spec.train.settings import CHECKPOINT_SECONDS, CollectOptions, TrainOptions

    def default(function, name: str):
        return inspect.signature(function).parameters[name].default

    collect, train = CollectOptions(), TrainOptions()
    load = LoadOptions()
    placement = {  # where the models run: every command that loads a bundle
        "provider": [DEFAULT_PROVIDER, load.provider, default(Decoder, "provider")],
        "threads": [DEFAULT_THREADS, load.threads, default(Decoder, "threads")],
    }
    engine = {**placement, "mode": [DEFAULT_MODE]}  # also the loop the engine runs when none is named
    return {
        "generate": engine,
        "chat": engine,
        "bench": placement,
        "info": placement,
        "train-head": {
            "max_items": [collect.max_items],
            "max_tokens": [collect.answer_tokens],
            "held_out_every": [collect.held_out_every],
            "seed": [collect.seed, train.seed],  # one --seed for both
            "vocab_size": [train.draft_vocab],
            "intermediate": [train.intermediate],
            "epochs": [train.epochs],
            "steps": [train.steps],
            "ttt": [train.ttt],
            "lr": [train.lr],
            "hard_labels": [not train.soft],
            "init": [train.init],
            "checkpoint_minutes": [CHECKPOINT_SECONDS / 60, default(trainer.train, "checkpoint_seconds") / 60],
        },
        "serve": {
            "host": [DEFAULT_HOST, default(serve.build_app, "bind_host"), GuardPolicy().bind_host],
            "port": [DEFAULT_PORT],
            "max_queue": [
                DEFAULT_MAX_QUEUE,
                default(serve.build_app, "max_queue"),
                default(serve.server_config, "max_queue"),
            ],
            "shutdown_grace": [DEFAULT_SHUTDOWN_GRACE, default(serve.server_config, "shutdown_grace")],
            # given as a size (4M): what it parses to
            "max_body": [DEFAULT_MAX_BODY, GuardPolicy().max_body, make_policy().max_body, parse_size],
            **engine,
        },
    }


def _option_defaults(command: str) -> dict[str, object]:
    """The default of each option of ``command``, as its help states it."""
    found = typer.main.get_command(app).commands[command]
    return {param.name: param.default for param in found.params if param.param_type_name == "option"}


@pytest.mark.parametrize("command", ["train-head", "serve", "generate", "chat", "bench", "info"])
def test_option_defaults_are_the_configured_ones(command):
    """Each default a command's help states is the one its configuration defines and its code runs with."""
    configured = _configured_defaults()[command]
    stated = _option_defaults(command)
    wrong = {}
    for name, sources in configured.items():
        parse = sources[-1] if callable(sources[-1]) else None
        values = sources[:-1] if parse else sources
        value = parse(stated[name]) if parse else stated[name]
        if any(value != v or type(value) is not type(v) for v in values):
            wrong[name] = (stated[name], values)
    assert wrong == {}, "option defaults that differ from their configuration (stated, configured)"


@pytest.mark.parametrize("command", ["train-head", "serve"])
def test_every_valued_default_comes_from_a_configuration(command):
    """A command's options with a value as default are in the table above (engine options are
    :class:`~edge_spec.cli.options.EngineFlags`', checked with the engine's configuration)."""
    import dataclasses

    from edge_spec.cli.options import EngineFlags

    shared = {field.name for field in dataclasses.fields(EngineFlags)}
    valued = {
        name
        for name, value in _option_defaults(command).items()
        if name not in shared and not isinstance(value, bool) and value not in (None, [], ())
    }
    assert valued - set(_configured_defaults()[command]) == set()


def test_the_configured_defaults_are_read_without_torch_or_uvicorn():
    """The help's defaults come from light modules: building the command line loads neither the trainer's
    torch nor the server's uvicorn."""
    code = "import sys, edge_spec.cli; print(sorted({'torch', 'uvicorn', 'starlette'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_bench_work_imports_on_its_own():
    """``edge_spec.bench.command`` (the bench command's work) imports before the command line does: the mode
    words the command's help lists do not come from a module that imports the command line."""
    result = subprocess.run([sys.executable, "-c", "import edge_spec.bench.command"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


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
