"""The bundles the picker offers: the ones ``edge-spec models`` lists (the models directory's ``bundles/``:
``$EDGE_SPEC_MODELS``, ``$EDGE_SPEC_HOME``, or the platform's user data directory; see
:mod:`edge_spec.paths`), with the default bundle first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_spec.cli.models import bundle_summary, list_bundles
from edge_spec.paths import default_bundle


@dataclass(frozen=True)
class BundleChoice:
    path: Path
    summary: str  # the line `edge-spec models` prints for it
    default: bool  # the bundle commands use when given none

    @property
    def label(self) -> str:
        return f"{self.path.name} (default)" if self.default else self.path.name


def bundle_choices() -> list[BundleChoice]:
    """Every bundle ``edge-spec models`` lists, the default one first, then by name."""
    default = default_bundle()
    choices = [BundleChoice(path, bundle_summary(path), path == default) for path in list_bundles()]
    return sorted(choices, key=lambda choice: not choice.default)  # stable: the rest stay by name
