"""Whether the native ``MatMulGGUF``'s one-row passes ask for their records ahead: measured per machine by the
export, recorded in the manifest, set by the runtime where the bundle runs on the machine that measured it.

A one-row pass (every target-only token, every drafter step over the op) streams the weights at the memory's
pace, and whether software prefetches help it depends on the core's own prefetchers, not on its vendor: they
cost a Zen 4 EPYC's one-row passes 1.03-1.15x, saved a Zen 5 EPYC's 1.05-1.14x and an Intel Xeon's 1.28x
(``benchmarks/native_ab.py``).  So the export times both on the target it has just built, their passes
interleaved in one process (a shared machine's drift falls on both), and keeps the faster where it is faster
by more than :data:`MARGIN`, the vendor's rule (ahead on Intel's cores) otherwise.  A bundle copied to another
machine (exported with ``--no-measure`` on a bigger one, shipped inside an application) times the same passes on
its first load there, on the target it has just loaded, and the runtime remembers that machine's record beside its
cost profiles (``runtime.loaded``).  ``EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH=1`` or ``0`` decides over everything.
Prefetches change no bits: the choice moves speed only, never an answer.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.native_attention import gguf_matmul_asks_ahead, gguf_matmul_path

ONE_ROW_SWITCH = "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH"
#: how much faster (as a fraction of the slower median) a side must be to displace the vendor's rule
MARGIN = 0.02
#: a one-row pass shorter than this reads weights the caches hold (a test's tiny model), where asking for the
#: next record ahead of the prefetcher is moot and the timing only the machine's noise: the vendor's rule stays
MIN_PASS_MS = 2.0
AHEAD, NONE = "ahead", "none"
CHOICES = (AHEAD, NONE)


CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name")


def cpu_fields() -> dict[str, str]:
    """The first processor's ``CPU_FIELDS`` as Linux's ``/proc/cpuinfo`` gives them (empty elsewhere)."""
    fields: dict[str, str] = {}
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return fields
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in CPU_FIELDS and key not in fields:
            fields[key] = value.strip()
        if not line.strip() and fields:
            break  # the first processor's block is enough
    return fields


def this_machine(library: Path) -> str:
    """What a measurement holds for: the CPU (:func:`cpu_fields`; ``platform.processor()`` where there are
    none) and the op's kernels on it, which a masked CPU or ``EDGE_SPEC_NATIVE_AVX512=0`` change without
    changing the CPU."""
    fields = cpu_fields()
    cpu = " ".join(fields.get(k, "") for k in CPU_FIELDS).strip()
    return f"{cpu or platform.processor() or platform.machine()} / {gguf_matmul_path(library)}"


def choice_in_force(library: Path) -> str:
    """Whether this process's one-row passes ask ahead now: "ahead" or "none"."""
    return AHEAD if gguf_matmul_asks_ahead(library) else NONE


def switch_choice() -> str | None:
    """What ``EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH`` asks for ("ahead", "none"), or None where it is not set."""
    value = os.environ.get(ONE_ROW_SWITCH, "")
    return {"1": AHEAD, "0": NONE}.get(value[:1])


def set_one_row_prefetch(library: Path, choice: str | None) -> None:
    """Make this process's one-row passes ask ahead ("ahead") or not ("none"), or follow the vendor's rule
    again (None), in every session of ``library`` from now on; the environment's switch decides over it."""
    setter = getattr(ctypes.CDLL(str(library)), "EdgeSpecGGUFSetOneRowPrefetch", None)
    if setter is None:
        return  # a library from before the choice: its vendor rule stays
    setter.argtypes = [ctypes.c_int]
    setter(-1 if choice is None else int(choice == AHEAD))


def time_one_row_passes(decoder, library: Path, *, context: int = 64, repeats: int = 24) -> dict[str, float]:
    """Median milliseconds of ``decoder``'s one-row passes after a ``context``-token prompt, asking ahead and
    not in turn (the order reversed every other repeat, so that a machine speeding up or slowing down falls
    on both).  Leaves the decoder's cache empty and this process on the vendor's rule."""
    huge_pages.wait_all()  # a pass on pages still being copied runs at half speed
    rng = np.random.default_rng(0)
    context = max(1, min(context, decoder.capacity - 2))
    vocab = decoder.vocab_size
    times: dict[str, list[float]] = {AHEAD: [], NONE: []}
    try:
        decoder.prefill([int(t) for t in rng.integers(0, vocab, context)])
        warm_up = 2
        for repeat in range(warm_up + repeats):
            token = [int(rng.integers(0, vocab))]
            for side in (AHEAD, NONE) if repeat % 2 == 0 else (NONE, AHEAD):
                set_one_row_prefetch(library, side)
                decoder.rewind(context)
                started = time.perf_counter()
                decoder.forward(token, 1)
                if repeat >= warm_up:
                    times[side].append(time.perf_counter() - started)
    finally:
        decoder.reset()
        set_one_row_prefetch(library, None)
    return {side: round(1000 * statistics.median(t), 3) for side, t in times.items()}


def timed_record(ms: dict[str, float], library: Path) -> dict:
    """The record of a timing ``ms`` (:func:`time_one_row_passes`) on this machine, the vendor's rule in force:
    the machine, the choice :func:`decide` makes and what made it, and the timings."""
    choice, by = decide(ms, choice_in_force(library))
    return {"machine": this_machine(library), "one_row_prefetch": choice, "one_row_ms": ms, "by": by}


def measure_one_row_prefetch(
    target: Path, library: Path, *, threads: int, capacity: int, context: int = 64, repeats: int = 24
) -> dict:
    """Time one-row passes of the ``target`` graph (:func:`time_one_row_passes`) and return the manifest's
    record (:func:`timed_record`).  Leaves the choice set in this process, so that what the export builds next
    (the drafter's body: ``rounds_drafter_native``) is built for it."""
    from edge_spec.runtime.model.decoder import Decoder

    asked = switch_choice()
    if asked is not None:
        return {"machine": this_machine(library), "one_row_prefetch": asked, "by": ONE_ROW_SWITCH}
    decoder = Decoder(target, threads=threads, capacity=capacity, takes_turns=True)
    try:
        ms = time_one_row_passes(decoder, library, context=context, repeats=repeats)
    finally:
        del decoder
    record = timed_record(ms, library)
    set_one_row_prefetch(library, record["one_row_prefetch"])
    return record


def decide(ms: dict[str, float], vendor: str) -> tuple[str, str]:
    """(the choice, what made it) from each side's median pass ``ms``: the faster side where it is faster by
    more than :data:`MARGIN`, else ``vendor`` (the vendor's rule), since a closer call is the machine's noise;
    ``vendor`` too for passes shorter than :data:`MIN_PASS_MS`."""
    if max(ms.values()) < MIN_PASS_MS:
        return vendor, f"the vendor's rule (passes under {MIN_PASS_MS:g} ms read from the caches)"
    faster = min(ms, key=ms.__getitem__)
    if ms[faster] < (1 - MARGIN) * max(ms.values()):
        return faster, "measured"
    return vendor, f"the vendor's rule (measured within {MARGIN:.0%})"


def measured_here(record: dict | None, library: Path) -> bool:
    """Whether ``record`` (a manifest's ``native_kernels``, or one remembered at a load) is a choice measured on
    this machine: this CPU, on the kernels the op runs here (a damaged one is none)."""
    return (
        record is not None
        and record.get("machine") == this_machine(library)
        and record.get("one_row_prefetch") in CHOICES
    )


def apply_kernel_choice(record: dict | None, library: Path) -> str:
    """Set ``record``'s choice where this is the machine that measured it, the vendor's rule elsewhere;
    returns the choice in force ("ahead" or "none")."""
    set_one_row_prefetch(library, record["one_row_prefetch"] if measured_here(record, library) else None)
    return choice_in_force(library)


def record_words(record: dict, where: str) -> str:
    """The ``native_kernels`` record in words, its CPU said as ``where``: what the export says, and
    ``edge-spec info`` (:func:`describe`)."""
    timed = record.get("one_row_ms")
    times = f" ({timed[AHEAD]:.1f} ms asking ahead, {timed[NONE]:.1f} ms not)" if timed else ""
    asks = "ask" if record.get("one_row_prefetch") == AHEAD else "do not ask"
    return f"native op: one-row passes {asks} for their records ahead {where}{times}: {record.get('by', '?')}"


def describe(record: dict, library: Path | None, remembered: dict | None = None) -> str:
    """The manifest's ``native_kernels`` record in words, and what this machine runs (``library``: the native
    op's here, None where it does not run; ``remembered``: the record a load timed on this machine), for
    ``edge-spec info``."""
    words = record_words(record, f"on {record.get('machine', '?')}")
    if library is None:
        return words + "; the op does not run here"
    asked = switch_choice()
    if asked is not None:
        return words + f"; {ONE_ROW_SWITCH} decides here ({asked})"
    if measured_here(record, library):
        return words
    if measured_here(remembered, library):
        here = record_words(remembered, "here").removeprefix("native op: ")
        return f"{words}; this machine differs and timed its own at a load: {here}"
    return words + (
        "; this machine differs and times its own at the next load (until then its vendor's rule: "
        f"{choice_in_force(library)})"
    )
