"""Where the repository, its models and the default bundle are.

One module for these so that the bundle ``edge-spec export`` writes by default and the bundle the
benchmarks read by default are one computation: a new default target in ``models/registry.json``
or a ``$EDGE_SPEC_MODELS`` moves both together.

``DEFAULT_BUNDLE`` is computed on first use, not at import: it reads the registry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from edge_spec.errors import EdgeSpecError

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_MODELS = REPO_ROOT / "models"


def cache_root() -> Path:
    """edge-spec's user cache: measured cost profiles, weight-check stamps (``$EDGE_SPEC_CACHE`` wins)."""
    root = os.environ.get("EDGE_SPEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-spec"


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


def load_registry(path: Path | None = None) -> dict:
    """Read the model registry.

    Defaults to ``models_dir()/registry.json`` and falls back to the one in
    the source tree, so pointing ``$EDGE_SPEC_MODELS`` at an empty disk still
    knows which models exist.
    """
    if path is None:
        path = models_dir() / "registry.json"
        if not path.is_file():
            path = REPO_MODELS / "registry.json"
    try:
        registry = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeSpecError(f"model registry not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise EdgeSpecError(f"cannot read model registry {path}: {exc}") from None
    if not isinstance(registry, dict) or not isinstance(registry.get("models"), dict):
        raise EdgeSpecError(f"model registry {path} has no 'models' table")
    return registry


def default_pair() -> tuple[str, str]:
    """The registry's default (target, drafter) names."""
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
