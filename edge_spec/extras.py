"""The optional parts of edge-spec (``pip install 'edge-spec[EXTRA]'``): which extra brings a module, and
the one line that says so when a command needs one that is not installed.

The base install runs bundles; ``export`` (torch, transformers, gguf) makes them, ``bench`` draws the bench
plot, ``test`` runs the test suite.  Commands that need an extra call :func:`require` before any work, so
the hint comes first (not after a download); :func:`explain` turns a ``ModuleNotFoundError`` raised
anywhere in a command into the same line (``edge_spec.cli.main``).
"""

from __future__ import annotations

import importlib.util

from edge_spec.errors import EdgeSpecError

#: top-level modules of each extra (pyproject.toml's optional-dependencies, and what they bring along)
MODULES = {
    "export": ("torch", "transformers", "gguf", "accelerate", "onnx_ir", "safetensors", "huggingface_hub"),
    "bench": ("matplotlib",),
    "test": ("pytest", "scipy", "openai", "httpx", "langchain_openai"),
}
#: the modules edge-spec itself imports from each extra: present means the extra is usable
REQUIRED = {"export": ("torch", "transformers", "gguf"), "bench": ("matplotlib",), "test": ("pytest",)}


class MissingExtra(EdgeSpecError):
    """A command needs an extra that is not installed."""


def extra_of(module: str | None) -> str | None:
    """The extra that brings ``module`` (a dotted name is looked up by its top level); None: no extra."""
    top = (module or "").split(".")[0]
    return next((extra for extra, modules in MODULES.items() if top in modules), None)


def install_line(extra: str) -> str:
    return f"pip install 'edge-spec[{extra}]'"


def needs_line(command: str, extra: str) -> str:
    return f"{' '.join(filter(None, ('edge-spec', command)))} needs the {extra} extra: {install_line(extra)}"


def installed(extra: str) -> bool:
    """Whether the modules edge-spec imports from ``extra`` can be imported (found, not imported: cheap)."""
    for module in REQUIRED[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except (ImportError, ValueError):  # a finder that refuses it, a module entry set to None
            return False
    return True


def require(command: str, extra: str) -> None:
    """Refuse ``edge-spec COMMAND`` in one line when ``extra`` is not installed."""
    if not installed(extra):
        raise MissingExtra(needs_line(command, extra))


def explain(exc: ModuleNotFoundError, command: str) -> MissingExtra | None:
    """The one-line error for a module of an extra missing under ``edge-spec COMMAND``; None when the module
    belongs to no extra (a bug or a broken install: its traceback is the useful report)."""
    extra = extra_of(exc.name)
    return MissingExtra(needs_line(command, extra)) if extra else None
