"""Where edge-spec's shipped data, its models, bundles and caches are.

Shipped with the package (``edge_spec/data/``, :data:`PACKAGE_DATA`): the model registry, the calibration,
bench and training prompts, the shipped calibration text and EAGLE-3 head.  Made or downloaded here
(:func:`models_dir`): GGUF files (``gguf/``), their part wheels (``downloads/``), bundles (``bundles/``),
head training work (``eagle-work/``).  That directory is, first match wins:

* ``$EDGE_SPEC_MODELS``;
* ``$EDGE_SPEC_HOME``, which also holds the cache (``cache/``) and the bench results, so that nothing is
  written anywhere else, the current directory included;
* ``models/`` of a source checkout, when edge-spec runs from one;
* the platform's user data directory (``platformdirs.user_data_dir("edge-spec")``: ``~/.local/share/edge-spec``
  on Linux).

A ``registry.json`` in that directory is read instead of the shipped one (a private list of models).

One module for these so that the bundle ``edge-spec export`` writes by default and the bundle the other
commands and the benchmarks read by default are one computation: a new default target in the registry or
another models directory moves both together.  ``DEFAULT_BUNDLE`` is computed on first use, not at
import: it reads the registry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import platformdirs

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import MANIFEST

APP = "edge-spec"
PACKAGE_DATA = Path(__file__).resolve().parent / "data"
REPO_ROOT = Path(__file__).resolve().parents[1]  # a source checkout, or site-packages in an installed package


def in_checkout() -> bool:
    """Whether edge-spec runs from its source checkout (an editable install included)."""
    try:
        return 'name = "edge-spec"' in (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False


def home() -> Path | None:
    """``$EDGE_SPEC_HOME``: models, bundles and caches all under one directory (None: not set)."""
    root = os.environ.get("EDGE_SPEC_HOME")
    return Path(root).expanduser() if root else None


def cache_root() -> Path:
    """edge-spec's user cache: measured cost profiles, weight-check stamps (``$EDGE_SPEC_CACHE`` wins, then
    ``$EDGE_SPEC_HOME/cache``, then the platform's user cache directory)."""
    root = os.environ.get("EDGE_SPEC_CACHE")
    if root:
        return Path(root).expanduser()
    if home() is not None:
        return home() / "cache"
    return Path(platformdirs.user_cache_dir(APP, appauthor=False))


def models_dir() -> Path:
    """Where models and bundles live (see the module's docstring for the order)."""
    env = os.environ.get("EDGE_SPEC_MODELS")
    if env:
        return Path(env).expanduser()
    if home() is not None:
        return home()
    if in_checkout():
        return REPO_ROOT / "models"
    return Path(platformdirs.user_data_dir(APP, appauthor=False))


def bench_results_dir() -> Path:
    """Where ``edge-spec bench`` writes when not given ``--output``: ``bench-results`` in the current
    directory, or under ``$EDGE_SPEC_HOME`` when that is set."""
    return (home() or Path()) / "bench-results"


def load_registry(path: Path | None = None) -> dict:
    """Read the model registry: ``path``, else ``models_dir()/registry.json`` when there is one, else the
    shipped registry."""
    if path is None:
        path = models_dir() / "registry.json"
        if not path.is_file():
            path = PACKAGE_DATA / "registry.json"
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
    return bundles_dir() / f"{name}-{quant}"


def bundles_dir() -> Path:
    return models_dir() / "bundles"


def default_bundle() -> Path:
    """What ``edge-spec export`` writes with no arguments (int4 is its ``--quant`` default), and what the
    commands and ``Engine.from_bundle()`` read when given no bundle."""
    return bundle_dir(default_pair()[0], "int4")


def find_bundle(path: str | Path | None = None) -> Path:
    """``path``, or the default bundle when None; a default bundle not made yet is a one-line error that
    says how to make it (a given path is checked where it is read)."""
    if path is not None:
        return Path(path)
    bundle = default_bundle()
    if not (bundle / MANIFEST).is_file():
        raise EdgeSpecError(f"no bundle at {bundle}: run `edge-spec fetch && edge-spec export` first")
    return bundle


def __getattr__(name: str) -> Path:
    if name == "DEFAULT_BUNDLE":
        return default_bundle()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
