"""Model drafters: the proposers that are models of their own, loaded from a bundle.  One registry.

A sequence proposer is a module plus a line in ``propose.PROPOSERS``; a model drafter is a
:class:`DrafterSpec` plus a line in :data:`DRAFTERS`.  The spec says everything the rest of the runtime
asks of a drafter: how it loads from a loaded bundle (:meth:`DrafterSpec.loader`), its LM heads and
which one is the default, the manifest entry that holds its files (what loading it reads), what its
costs and acceptance are keyed by (:meth:`DrafterSpec.profile_entry`) and what one of its steps reads
against the target (:meth:`DrafterSpec.parameters`, :meth:`DrafterSpec.step_bytes`).  The loop
configuration's ``--drafter``, the loaded bundle, the engine, the cost profile, the bench and the CLI
read drafters from here and test no drafter's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import eagle_heads
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.session import small_session
from edge_spec.runtime.propose.eagle import EagleDrafter
from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead
from edge_spec.runtime.propose.model import ChainDrafter, ModelDrafter
from edge_spec.runtime.verify.sampling import check_vocab_ids


class DrafterBundle(Protocol):
    """What a drafter's loader reads of a loaded bundle (``loaded.LoadedBundle``)."""

    bundle_dir: Path
    manifest: dict
    target: Decoder  # its capacity and vocabulary; the EAGLE head also reads its embedding

    def draft_placement(self) -> dict:
        """Where the drafter's sessions run: ``provider``, ``threads``, ``provider_options``."""


class DrafterLoader(Protocol):
    """One drafter of one loaded bundle: the parts all its LM heads share load once."""

    def get(self, head: str | None) -> ChainDrafter:
        """The drafter drafting with LM head ``head`` (a name :meth:`DrafterSpec.heads` lists; None for a
        drafter without heads), loaded on first use."""


def load_array(path: Path) -> np.ndarray:
    """A bundle's ``.npy`` table; a damaged one is a one-line error naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise EdgeSpecError(
            f"cannot read {path} ({why}): the bundle is damaged; run edge-spec info {path.parent.parent} --verify"
        ) from None


def token_ids(bundle: DrafterBundle, head: dict, key: str) -> np.ndarray | None:
    """A head's id table (vocabulary map, always-kept ids, scorer universe), checked against the target."""
    if not head.get(key):
        return None
    return check_vocab_ids(load_array(bundle.bundle_dir / head[key]), bundle.target.vocab_size)


def load_head(bundle: DrafterBundle, head: dict, name: str) -> DraftHead | SpecVocabHead:
    """An LM head (the drafter model's or the EAGLE head's) from its manifest entry."""
    where, root = bundle.draft_placement(), bundle.bundle_dir
    if head.get("kind") == "specvocab":
        always, universe = token_ids(bundle, head, "always_ids"), token_ids(bundle, head, "universe")
        try:
            return SpecVocabHead(
                root / head["onnx"],
                root / head["rows"],
                root / head["scales"],
                head["candidates"],
                always_ids=always,
                universe=universe,
                rows_by_universe=head.get("rows_by") == "universe",
                **where,
            )
        except (ValueError, OSError, EOFError, KeyError) as exc:  # its int8 rows or scales
            raise EdgeSpecError(
                f"cannot read drafter head {name!r} ({str(exc)[:120] or type(exc).__name__}): "
                f"the bundle is damaged; run edge-spec info {root} --verify"
            ) from None
    return DraftHead(root / head["onnx"], vocab_ids=token_ids(bundle, head, "vocab_ids"), **where)


def head_bytes(bundle_dir: Path, entry: dict, hidden_size: int) -> int:
    """Bytes one step of an LM head reads: its graph's weights (a SpecVocab head's scorer) plus, for
    SpecVocab, the int8 candidate rows it gathers."""
    size = (bundle_dir / (entry["onnx"] + ".data")).stat().st_size
    if entry.get("kind") == "specvocab":
        size += entry["size"] * hidden_size
    return size


class DrafterSpec:
    """A model drafter, as the registry knows it.  Subclasses give the class attributes and
    :meth:`loader`; the defaults read a manifest entry laid out as the drafter model's (``heads``,
    ``default_head``, ``parameters``, ``config``)."""

    name: str = ""  # the proposer's name: ``--drafter NAME``, each draft's source, its tokens' provenance
    manifest_key: str = ""  # its manifest entry (a role of ``manifest.ROLES``): its files, what a load reads
    label: str = ""  # the bench's modes of it: LABEL (its default head), LABEL+HEAD, LABEL@γN, ...
    title: str = ""  # how messages name it: "bundle has no {title} head ..."
    summary: str = ""  # what it is, in a sentence's words (``bench --modes`` help)
    head_option: str | None = None  # the ``LoadOptions`` field that picks its LM head (None: the default)
    remedy: str = ""  # what to do when a bundle lacks it (None of it is required but the drafter model)

    def present(self, manifest: dict) -> bool:
        """Whether the bundle has this drafter."""
        return bool(manifest.get(self.manifest_key))

    def heads(self, manifest: dict) -> dict[str, dict]:
        """Its LM heads by name (empty: the bundle lacks it)."""
        return manifest[self.manifest_key]["heads"] if self.present(manifest) else {}

    def default_head(self, manifest: dict) -> str | None:
        return manifest[self.manifest_key]["default_head"] if self.present(manifest) else None

    def loader(self, bundle: DrafterBundle) -> DrafterLoader:
        raise NotImplementedError

    def profile_entry(self, manifest: dict, head: str | None) -> dict:
        """What its costs (the cost profile's key) and its acceptance (the schedule's calibration) depend on."""
        entry = manifest[self.manifest_key]
        return {"head": entry["heads"][head], "body": entry["config"]}

    def parameters(self, manifest: dict, head: str | None) -> int:
        """Parameters one step reads (c in MBSU, over the target's)."""
        entry = manifest[self.manifest_key]
        return entry["parameters"] + entry["heads"][head]["parameters"]

    def step_bytes(self, bundle_dir: Path, manifest: dict, head: str | None) -> int:
        """Bytes one step reads (c in a memory-bound model, over the target's)."""
        entry = manifest[self.manifest_key]
        body = (bundle_dir / (entry["onnx"] + ".data")).stat().st_size
        return body + head_bytes(bundle_dir, entry["heads"][head], entry["config"]["hidden_size"])


class _ModelLoader:
    """The drafter model's body, loaded once; one :class:`ModelDrafter` per LM head, sharing it."""

    def __init__(self, spec: DrafterSpec, bundle: DrafterBundle) -> None:
        self.spec, self.bundle = spec, bundle
        self.body: Decoder | None = None
        self.by_head: dict[str, ModelDrafter] = {}

    def get(self, head: str | None) -> ChainDrafter:
        bundle, entry = self.bundle, self.bundle.manifest[self.spec.manifest_key]
        if self.body is None:
            self.body = Decoder(
                bundle.bundle_dir / entry["onnx"],
                capacity=bundle.target.capacity,
                takes_turns=True,
                prompt_graph=bundle.draft_prompt_graph(entry),
                **bundle.draft_placement(),
            )
        if head not in self.by_head:
            drafter = ModelDrafter(self.body, load_head(bundle, entry["heads"][head], head), bundle.target.vocab_size)
            drafter.name = self.spec.name  # its drafts' source
            self.by_head[head] = drafter
        return self.by_head[head]


class ModelSpec(DrafterSpec):
    """The drafter model: a small decoder of the target's family plus one LM head (``propose.model``)."""

    name = "model"
    manifest_key = "draft"
    label = "spec"
    title = "drafter"
    summary = "the bundle's drafter model"
    head_option = "draft_head"
    remedy = "export the bundle again"

    def loader(self, bundle: DrafterBundle) -> DrafterLoader:
        return _ModelLoader(self, bundle)


class _EagleLoader:
    """The EAGLE head's layer, feature projection and draft vocabulary, loaded once; its LM heads swap in."""

    def __init__(self, spec: DrafterSpec, bundle: DrafterBundle) -> None:
        self.spec, self.bundle = spec, bundle
        self.drafter: EagleDrafter | None = None
        self.lm_heads: dict[str, DraftHead | SpecVocabHead | None] = {}

    def get(self, head: str | None) -> ChainDrafter:
        if self.drafter is None:
            self.drafter = self._load()
        self.drafter.lm_head = self._lm_head(head)
        return self.drafter

    def _load(self) -> EagleDrafter:
        from edge_spec.runtime.model.embedding import TargetEmbedding

        bundle, spec = self.bundle, self.spec
        entry = bundle.manifest.get(spec.manifest_key)
        if not entry:
            raise EdgeSpecError(f"this bundle has no {spec.title} head: {spec.remedy}")
        if "features" not in bundle.target.output_names:
            raise EdgeSpecError(
                f"this bundle's target graph has no features output for its {spec.title} head; "
                "attach the head again with this edge-spec version"
            )
        where, root = bundle.draft_placement(), bundle.bundle_dir
        layer = Decoder(root / entry["onnx"], capacity=bundle.target.capacity, takes_turns=True, **where)
        fc = small_session(root / entry["fc_onnx"], what="EAGLE feature projection", **where)
        d2t = load_array(root / entry["d2t"])
        ids = check_vocab_ids(np.arange(len(d2t)) + d2t, bundle.target.vocab_size)
        embedding = TargetEmbedding.from_onnx(root / bundle.manifest["target"]["onnx"])
        return EagleDrafter(layer, fc, embedding.rows, ids, bundle.target.vocab_size, name=spec.name)

    def _lm_head(self, name: str | None) -> DraftHead | SpecVocabHead | None:
        """An LM head, loaded on first use (None: the single graph has it inside)."""
        if name not in self.lm_heads:
            head = self.spec.heads(self.bundle.manifest)[name]
            self.lm_heads[name] = None if head.get("kind") == "builtin" else load_head(self.bundle, head, name)
        return self.lm_heads[name]


class EagleSpec(DrafterSpec):
    """The EAGLE-3 head on the target's features (``propose.eagle``; ``edge-spec train-head`` or SpecForge)."""

    name = "eagle"
    manifest_key = "eagle"
    label = "eagle"
    title = "EAGLE"
    summary = "the bundle's EAGLE head on the target's features (edge-spec train-head)"
    head_option = "eagle_head"
    remedy = "train one with `edge-spec train-head BUNDLE`"

    def heads(self, manifest: dict) -> dict[str, dict]:
        return eagle_heads(manifest)  # a bundle before the split: one builtin head

    def default_head(self, manifest: dict) -> str | None:
        return manifest[self.manifest_key].get("default_head", "full") if self.present(manifest) else None

    def loader(self, bundle: DrafterBundle) -> DrafterLoader:
        return _EagleLoader(self, bundle)

    def profile_entry(self, manifest: dict, head: str | None) -> dict:
        entry = manifest[self.manifest_key]
        if "heads" not in entry:  # one graph: its record is all there is (cache keys as before the split)
            return entry
        layer = {k: v for k, v in entry.items() if k not in ("heads", "default_head", "files", "bytes")}
        return {self.manifest_key: layer, "head": entry["heads"][head]}

    def parameters(self, manifest: dict, head: str | None) -> int:
        return manifest[self.manifest_key]["parameters"]

    def step_bytes(self, bundle_dir: Path, manifest: dict, head: str | None) -> int:
        """Its layer (and fc) plus the LM head ``head``; a single-graph head's whole record."""
        entry = manifest[self.manifest_key]
        if "heads" not in entry:
            return entry["bytes"]
        layer = sum((bundle_dir / (entry[key] + ".data")).stat().st_size for key in ("onnx", "fc_onnx"))
        return layer + head_bytes(bundle_dir, entry["heads"][head], entry["config"]["hidden_size"])


# the model drafters by proposer name; a chain drafts with one of them (``--drafter``), the first by default
DRAFTERS: dict[str, DrafterSpec] = {
    "model": ModelSpec(),  # the drafter model (propose.model)
    "eagle": EagleSpec(),  # the EAGLE-3 head on the target's features (propose.eagle)
}
DEFAULT_DRAFTER = next(iter(DRAFTERS))
