"""``models``: the bundles in the models directory, one line each (an app's bundle picker lists the same)."""

from __future__ import annotations

from pathlib import Path

from edge_spec.cli.output import out
from edge_spec.errors import EdgeSpecError


def models_list() -> None:
    """List the bundles in the models directory: name, target / drafter, weights, size on disk, drafter heads
    and EAGLE-3 heads; * marks the default bundle, the one chat, generate, serve, info and bench use when
    given none."""
    from edge_spec.paths import bundles_dir, default_bundle

    root, default, found = bundles_dir(), default_bundle(), list_bundles()
    make = "`edge-spec fetch && edge-spec export`"
    if not found:
        out.print(f"no bundles in {root}: run {make} to make the default one", markup=False)
        return
    out.print(f"bundles in {root} (* the default: used when a command is given no bundle)", markup=False)
    for path in found:
        out.print(("* " if path == default else "  ") + bundle_summary(path), markup=False)
    if default not in found:
        out.print(f"the default bundle, {default.name}, is not made yet: run {make}", markup=False)


def list_bundles() -> list[Path]:
    """The bundles ``edge-spec models`` lists, by name: the folders of the models directory's ``bundles/``
    that hold a manifest (an app's bundle picker shows the same ones)."""
    from edge_spec.manifest import MANIFEST
    from edge_spec.paths import bundles_dir

    root = bundles_dir()
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file()) if root.is_dir() else []


def bundle_summary(path: Path) -> str:
    """One line on a bundle for ``edge-spec models`` (a bundle that cannot be read says why)."""
    from edge_spec.manifest import eagle_heads, read_manifest

    try:
        manifest = read_manifest(path)
    except (EdgeSpecError, OSError) as exc:
        return f"{path.name}  cannot be read: {exc}"
    target, draft = manifest["target"], manifest["draft"]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    size_text = f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.1f} MiB"
    heads = ", ".join(
        f"{name} (default)" if name == draft.get("default_head") else name for name in draft.get("heads", {})
    )
    line = (
        f"{path.name}  {target['name']} / {draft['name']}, {target['quantization']['weights']}, {size_text}; "
        f"drafter heads: {heads}"
    )
    if manifest.get("eagle"):
        line += f"; EAGLE-3 heads: {', '.join(eagle_heads(manifest))}"
    return line
