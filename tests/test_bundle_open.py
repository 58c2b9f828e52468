"""Opening a bundle reads its manifest once, whatever asks for the load (the command line's checks, the
progress of a verifying load), and a draft length that cannot fit the bundle's context is refused from
that manifest before any model loads."""

from __future__ import annotations

import threading

import pytest

from edge_spec import manifest as manifest_module
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime import loaded
from edge_spec.runtime.loops.config import loop_config


@pytest.fixture
def manifest_reads(monkeypatch):
    reads = []
    original = manifest_module.read_manifest

    def counted(directory):
        reads.append(directory)
        return original(directory)

    monkeypatch.setattr(manifest_module, "read_manifest", counted)
    monkeypatch.setattr(loaded, "read_manifest", counted)
    return reads


@pytest.mark.parametrize("verify", [False, True])
def test_the_command_line_load_reads_the_manifest_once(int4_bundle, manifest_reads, verify):
    from edge_spec.cli.loading import load_options, open_engine

    events = []
    options = load_options(threads=1, verify=verify)
    if verify:  # a verifying load that reports its progress sizes the hashing from the manifest
        from edge_spec.runtime.engine import Engine

        engine = Engine.from_bundle(int4_bundle, options, on_progress=events.append, cancel=threading.Event())
    else:
        engine = open_engine(int4_bundle, loop_config("spec", gamma=2), options)
    engine.close()
    assert len(manifest_reads) == 1, manifest_reads
    assert not verify or [e.fraction for e in events if e.stage == "verifying"][-1] == 1.0


def test_a_draft_length_past_the_context_is_refused_before_any_model_loads(int4_bundle, monkeypatch):
    from edge_spec.cli.loading import load_options, open_engine
    from edge_spec.manifest import read_manifest

    context = read_manifest(int4_bundle)["context_length"]

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the draft length was checked")

    monkeypatch.setattr(loaded.LoadedBundle, "load", classmethod(never))
    with pytest.raises(EdgeSpecError, match=rf"^gamma {context} does not fit the bundle's context of {context} tokens"):
        open_engine(int4_bundle, loop_config("spec", gamma=context), load_options(threads=1))
