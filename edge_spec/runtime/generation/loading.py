"""Loading a bundle into an engine: open (and maybe re-hash) its files, load its models, measure this
machine's costs for the speculative modes, following the load's progress and stopping it on request.

A failed or cancelled load frees what it loaded: its models are closed and its hashing is stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from edge_spec.defaults import DEFAULT_MODE
from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import role_bytes
from edge_spec.runtime import heap
from edge_spec.runtime.loaded import BundleFiles, LoadedBundle, LoadOptions, drafter_name
from edge_spec.runtime.loops.config import LoopConfig, TreeConfig, loop_config
from edge_spec.runtime.loops.tree import check_tree
from edge_spec.runtime.progress import LoadTracker, ProgressCallback
from edge_spec.runtime.propose.drafters import DRAFTERS

Engine = TypeVar("Engine")  # what ``make`` builds over the loaded bundle: ``runtime.engine.Engine``


def load_engine(
    make: Callable[..., Engine],
    path: str | Path | None,
    options: LoadOptions,
    mode: str | None,
    config: LoopConfig | None,
    on_progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> Engine:
    """The engine ``make(bundle, config, exact=...)`` builds over the bundle at ``path`` loaded with
    ``options``, in the loop ``config`` names (None: ``mode``'s defaults)."""
    tracker = LoadTracker(on_progress, cancel, str(path) if path is not None else "the default bundle")
    if options.verify and tracker.active:
        tracker.report("verifying", 0.0)
        files = BundleFiles.open(path, True, counter=lambda total: tracker.counter("verifying", total))
        tracker.report("verifying", 1.0)
    else:
        files = BundleFiles.open(path, options.verify)
    if config is None:
        config = loop_config(mode or DEFAULT_MODE)
    elif mode is not None and mode != config.mode:
        raise EdgeSpecError(f"mode {mode!r} does not match the {type(config).__name__} given (mode {config.mode!r})")
    try:
        options.check()
        _check_draft_length(config, files.manifest["context_length"])
        return _load_models(make, files, options, config, tracker)
    except BaseException:  # a failed or cancelled load: its models were closed, its hashing is stopped
        if files.weight_check is not None:
            files.weight_check.stop()
        heap.release()
        raise


def _check_draft_length(config: LoopConfig, context: int) -> None:
    """Refuse, before the (slow) load, a fixed draft length whose target pass cannot fit the bundle's context
    (the cost measurement times passes of γ+1 tokens after at least one cached token)."""
    gamma = getattr(config, "gamma", 0)
    if gamma and gamma + 3 > context:
        raise EdgeSpecError(
            f"gamma {gamma} does not fit the bundle's context of {context} tokens (at most {max(context - 3, 0)})"
        )


def _load_models(
    make: Callable[..., Engine],
    files: BundleFiles,
    options: LoadOptions,
    config: LoopConfig,
    tracker: LoadTracker,
) -> Engine:
    """The models of an opened bundle, loaded (and this machine's costs measured for the speculative
    modes), the progress told to ``tracker``; a failed or cancelled load closes what it loaded."""
    speculative = config.mode != "ar"
    drafter_role = DRAFTERS[drafter_name(config)].manifest_key if speculative else None
    target_bytes, drafter_bytes = (role_bytes(files.manifest, role) for role in ("target", drafter_role))
    tracker.report("reading", 0.0)
    loaded = LoadedBundle.load(files, options, takes_turns=speculative)
    try:
        engine = make(loaded, config, exact=options.exact)
        tracker.report("reading", target_bytes / max(target_bytes + drafter_bytes, 1))
        if isinstance(config, TreeConfig):
            check_tree(loaded.target, config)  # the verifier's draft count and the sampler are checked per request
        if speculative:
            loaded.active_drafter(config)  # loaded now, so the first answer is not slowed down
        tracker.report("reading", 1.0)
        if tracker.active and not options.verify:
            tracker.wait_for(files.weight_check)
        if speculative or loaded.kernels_untimed is not None:
            tracker.report("measuring", 0.0)
            loaded.time_kernels()
            if speculative:
                engine.measure_costs()
            tracker.report("measuring", 1.0)
        return engine
    except BaseException:
        loaded.close()
        raise
