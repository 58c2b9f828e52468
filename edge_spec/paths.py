"""Where the repository, its models and the default bundle are.

One module for these so that the bundle ``edge-spec export`` writes by default and the bundle the
benchmarks read by default are one computation: a new default target in ``models/registry.json``
or a ``$EDGE_SPEC_MODELS`` moves both together.

``DEFAULT_BUNDLE`` is computed on first use, not at import: it reads the registry, and
:mod:`edge_spec.fetch` (which reads the registry) imports this module for :func:`models_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_MODELS = REPO_ROOT / "models"


def models_dir() -> Path:
    """Where models live.

    ``$EDGE_SPEC_MODELS`` wins so CI and users can put gigabytes elsewhere;
    otherwise a source checkout keeps everything in its own ``models/``;
    an installed package (no registry next to it) falls back to a user cache.
    """
    env = os.environ.get("EDGE_SPEC_MODELS")
    if env:
        return Path(env).expanduser()
    if (REPO_MODELS / "registry.json").is_file():
        return REPO_MODELS
    return Path.home() / ".cache" / "edge-spec" / "models"


def default_pair() -> tuple[str, str]:
    """The registry's default (target, drafter) names."""
    from edge_spec.fetch import load_registry

    pair = load_registry()["default_pair"]
    return pair["target"], pair["draft"]


def bundle_dir(target: str, quant: str) -> Path:
    """Where ``edge-spec export`` puts ``target`` quantized as ``quant`` when not given ``--out``:
    named after the source (a registry name, or a path's last part without ``.gguf``)."""
    name = Path(target.rstrip("/")).name
    name = name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
    return models_dir() / "bundles" / f"{name}-{quant}"


def __getattr__(name: str) -> Path:
    if name == "DEFAULT_BUNDLE":  # what `edge-spec export` writes with no arguments (int4 is its --quant default)
        return bundle_dir(default_pair()[0], "int4")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
