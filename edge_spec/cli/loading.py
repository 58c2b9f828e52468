"""From the engine options to a loaded engine: the bundle, the loop, the placement, each checked before
the (slow) load, with a spinner saying where the load's time goes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from edge_spec.cli.options import EngineFlags
from edge_spec.cli.output import console
from edge_spec.errors import EdgeSpecError

if TYPE_CHECKING:
    from edge_spec.runtime.loaded import LoadOptions


def find_bundle(bundle: Path | None) -> Path:
    """The bundle given, or the default one (a one-line error saying how to make it when it is not there),
    after finishing or undoing an install a killed run left there and removing the staging directories
    of killed runs beside it (``export.bundle.install.prepare``: never a live writer's)."""
    from edge_spec.export.bundle.install import prepare
    from edge_spec.paths import default_bundle
    from edge_spec.paths import find_bundle as find

    with contextlib.suppress(OSError):  # a bundle on a read-only disk is still read
        prepare(bundle if bundle is not None else default_bundle(), lambda line: console.print(f"[dim]-[/dim] {line}"))
    return find(bundle)


def loop_config(mode: str, **settings):
    """The loop ``mode`` runs, with the settings given on the command line (None: not given); a flag
    the loop cannot honour is refused in one line (``loops.config.loop_config``)."""
    from edge_spec.runtime.loops.config import loop_config as config

    return config(mode, **settings)


def engine_config(flags: EngineFlags):
    """The loop the engine options ask for."""
    return loop_config(flags.mode, **flags.loop_settings())


def check_threads(threads: int, draft_threads: int | None = None) -> None:
    """Thread counts from 0 (all cores) to 4 x this machine's cores: more only oversubscribes (a huge
    count hangs ORT creating threads, one past int32 overflows it)."""
    most = 4 * (os.cpu_count() or 1)
    for value, flag in ((threads, "--threads"), (draft_threads, "--draft-threads")):
        if value is not None and not 0 <= value <= most:
            raise EdgeSpecError(f"{flag} must be 0 (all cores) to {most} (4 x the {most // 4} cores here), not {value}")


def check_sampler(sampler: str, temperatures: list[float], configs: list) -> None:
    """A misspelt --sampler, or one a loop of the run cannot honour, is refused before any model is loaded."""
    from edge_spec.runtime.loops.config import check_sampling
    from edge_spec.runtime.verify.sampling import SAMPLERS, SamplingParams

    if sampler not in SAMPLERS:
        raise EdgeSpecError(f"--sampler must be one of {', '.join(SAMPLERS)}, not {sampler!r}")
    for temperature in temperatures:
        params = SamplingParams(temperature=temperature, sampler=sampler, seed=0)
        for config in configs:
            check_sampling(config, params)


def provider_options(pairs: list[str]) -> dict[str, str]:
    """``--provider-option KEY=VALUE`` flags as ORT's provider-options dict."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise EdgeSpecError(f"--provider-option takes KEY=VALUE, not {pair!r}")
        options[key.strip()] = value.strip()
    return options


@contextlib.contextmanager
def loading_status() -> Iterator[None]:
    """A spinner while a bundle loads, saying what the time goes to: a first load on a machine also
    measures the machine (``cost_profile.on_measure``)."""
    if not console.is_terminal:
        yield
        return
    from edge_spec.runtime.schedule import cost_profile

    with (
        console.status("[dim]loading the bundle[/dim]") as status,
        cost_profile.on_measure(lambda what: status.update(f"[dim]{what or 'loading the bundle'}[/dim]")),
    ):
        yield


def load_options(provider_option: list[str] | None = None, **settings) -> LoadOptions:
    """The load options given on the command line (``LoadOptions``' fields, the provider options as
    ``--provider-option KEY=VALUE`` flags), checked before the (slow) load: thread counts, then the pairs."""
    from edge_spec.runtime.loaded import LoadOptions

    options = LoadOptions(**settings)
    check_threads(options.threads, options.draft_threads)
    return dataclasses.replace(options, provider_options=provider_options(provider_option or []))


def open_engine(bundle: Path, config, options: LoadOptions):
    """The engine for ``bundle`` running ``config``, loaded with ``options`` (``load_options``): its draft
    lengths are checked before the models load, and ``exact`` is refused at once where this device cannot honour it."""
    from edge_spec.runtime.engine import Engine

    with loading_status():
        engine = Engine.load(bundle, options, config=config)
        if options.exact:  # refused now, not at every request of a chat or a server (Engine.exact_for)
            engine.exact_for(engine.config.mode, options.exact)
    return engine


def load_engine(bundle: Path, flags: EngineFlags, config):
    """The engine the engine options ask for, running ``config`` (``engine_config(flags)``)."""
    return open_engine(bundle, config, load_options(**flags.load_settings()))
