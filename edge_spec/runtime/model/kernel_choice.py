"""Which prefetches the native ``MatMulGGUF``'s passes ask for: measured per machine by the export, recorded in
the manifest, set by the runtime where the bundle runs on the machine that measured it.

A one-row pass (every target-only token, every drafter step over the op) streams the weights at the memory's
pace, and whether software prefetches help it depends on the core's own prefetchers, not on its vendor: they
cost a Zen 4 EPYC's one-row passes 1.03-1.15x, saved a Zen 5 EPYC's 1.05-1.14x and an Intel Xeon's 1.28x
(``benchmarks/native_ab.py``).  The same holds for asking for a record eight on, into the second level ("far"):
it made an Intel Xeon's passes of every size 1.15-1.20x faster, a Zen 5 EPYC's verify passes of four rows and
more 1.06-1.15x and its one- and two-row passes 1.01-1.05x slower.  So the export times both ways of each on
the target it has just built, their passes interleaved in one process (a shared machine's drift falls on both):
one-row passes asking ahead and not, then passes of :data:`FAR_ROWS` rows asking far and not, and keeps the
faster where it is faster by more than :data:`MARGIN`, the vendor's rule otherwise.  A bundle copied to another
machine (exported with ``--no-measure`` on a bigger one, shipped inside an application) times the same passes on
its first load there, on the target it has just loaded, and the runtime remembers that machine's record beside its
cost profiles (``runtime.loaded``).  ``EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH`` and ``EDGE_SPEC_NATIVE_FAR_PREFETCH``
(``1`` or ``0``) decide over everything.  Prefetches change no bits: the choices move speed only, never an answer.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.native_attention import (
    gguf_matmul_asks_ahead,
    gguf_matmul_far_words,
    gguf_matmul_path,
)

ONE_ROW_SWITCH = "EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH"
FAR_SWITCH = "EDGE_SPEC_NATIVE_FAR_PREFETCH"
#: the pass sizes timed asking far ahead and not: a drafter's or target-only step, and verify passes of short
#: to long drafts (the op's kernels take rows in groups of up to eight)
FAR_ROWS = (1, 2, 4, 8)
#: ``far_from_rows`` of a record where no pass asks far ahead
NO_PASS = 0
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


def cpu_description() -> str:
    """The CPU: :func:`cpu_fields` in one line (``platform.processor()`` where there are none)."""
    fields = cpu_fields()
    cpu = " ".join(fields.get(k, "") for k in CPU_FIELDS).strip()
    return cpu or platform.processor() or platform.machine()


def this_machine(library: Path) -> str:
    """What a measurement holds for: the CPU (:func:`cpu_description`) and the op's kernels on it, which a
    masked CPU or ``EDGE_SPEC_NATIVE_AVX512=0`` change without changing the CPU."""
    return f"{cpu_description()} / {gguf_matmul_path(library)}"


def choice_in_force(library: Path) -> str:
    """Whether this process's one-row passes ask ahead now: "ahead" or "none"."""
    return AHEAD if gguf_matmul_asks_ahead(library) else NONE


def switch_choice() -> str | None:
    """What ``EDGE_SPEC_NATIVE_ONE_ROW_PREFETCH`` asks for ("ahead", "none"), or None where it is not set."""
    value = os.environ.get(ONE_ROW_SWITCH, "")
    return {"1": AHEAD, "0": NONE}.get(value[:1])


def _call_setter(library: Path, function: str, value: int) -> None:
    """``library``'s ``void function(int)`` called with ``value`` (-1: back to the vendor's rule)."""
    setter = getattr(ctypes.CDLL(str(library)), function, None)
    if setter is None:
        return  # a library from before the choice: its vendor rule stays
    setter.argtypes = [ctypes.c_int]
    setter(value)


def set_one_row_prefetch(library: Path, choice: str | None) -> None:
    """Make this process's one-row passes ask ahead ("ahead") or not ("none"), or follow the vendor's rule
    again (None), in every session of ``library`` from now on; the environment's switch decides over it."""
    _call_setter(library, "EdgeSpecGGUFSetOneRowPrefetch", -1 if choice is None else int(choice == AHEAD))


def set_far_rows(library: Path, rows: int | None) -> None:
    """Make this process's passes of ``rows`` rows and more ask far ahead (:data:`NO_PASS`: none), or follow
    the vendor's rule again (None), in every session of ``library`` from now on; the environment's switch
    decides over it."""
    _call_setter(library, "EdgeSpecGGUFSetFarRows", -1 if rows is None else rows)


def far_rows_in_force(library: Path) -> int:
    """The fewest rows of a pass that asks far ahead in this process now (:data:`NO_PASS`: none)."""
    words = gguf_matmul_far_words(library)
    if words == "far":
        return 1
    if words.startswith("far from "):
        return int(words.split()[2])
    return NO_PASS


def switch_far_rows() -> int | None:
    """What ``EDGE_SPEC_NATIVE_FAR_PREFETCH`` asks for (1: every pass, :data:`NO_PASS`), or None where unset."""
    value = os.environ.get(FAR_SWITCH, "")
    return {"1": 1, "0": NO_PASS}.get(value[:1])


def _interleaved_passes(
    decoder, sides: dict[str, Callable[[], None]], rows: int, context: int, repeats: int, rng
) -> dict[str, float]:
    """Median milliseconds of ``decoder``'s passes of ``rows`` new tokens after ``context`` tokens (already in
    its cache), each side set by its function before its pass, the sides' order reversed every other repeat,
    so that a machine speeding up or slowing down falls on all of them."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    vocab = decoder.vocab_size
    warm_up = 2
    for repeat in range(warm_up + repeats):
        tokens = [int(t) for t in rng.integers(0, vocab, rows)]
        for side in list(sides) if repeat % 2 == 0 else list(sides)[::-1]:
            sides[side]()
            decoder.rewind(context)
            started = time.perf_counter()
            decoder.forward(tokens, rows)
            if repeat >= warm_up:
                times[side].append(time.perf_counter() - started)
    return {side: round(1000 * statistics.median(t), 3) for side, t in times.items()}


def _timing(decoder, context: int, measure: Callable[[int, object], dict]) -> dict:
    """``measure(context, rng)`` over ``decoder`` with a random ``context``-token prompt in its cache (at most
    what its capacity leaves for a pass of eight rows); leaves the cache empty."""
    huge_pages.wait_all()  # a pass on pages still being copied runs at half speed
    rng = np.random.default_rng(0)
    context = max(1, min(context, decoder.capacity - max(FAR_ROWS) - 1))
    try:
        decoder.prefill([int(t) for t in rng.integers(0, decoder.vocab_size, context)])
        return measure(context, rng)
    finally:
        decoder.reset()


def time_one_row_passes(decoder, library: Path, *, context: int = 64, repeats: int = 24) -> dict[str, float]:
    """Median milliseconds of ``decoder``'s one-row passes after a ``context``-token prompt, asking ahead and
    not in turn.  Leaves the decoder's cache empty and this process on the vendor's rule."""
    sides = {side: partial(set_one_row_prefetch, library, side) for side in CHOICES}
    try:
        return _timing(decoder, context, lambda at, rng: _interleaved_passes(decoder, sides, 1, at, repeats, rng))
    finally:
        set_one_row_prefetch(library, None)


def time_far_passes(
    decoder, library: Path, *, rows: tuple[int, ...] = FAR_ROWS, context: int = 64, repeats: int = 12
) -> dict[str, dict[str, float]]:
    """Median milliseconds of ``decoder``'s passes of each of ``rows`` rows after a ``context``-token prompt,
    asking far ahead ("far") and not ("near") in turn, by row count (as a string: the record is JSON).  Leaves
    the decoder's cache empty and this process's far prefetch on the vendor's rule."""
    sides = {"far": partial(set_far_rows, library, 1), "near": partial(set_far_rows, library, NO_PASS)}

    def measure(at: int, rng) -> dict[str, dict[str, float]]:
        return {str(n): _interleaved_passes(decoder, sides, n, at, repeats, rng) for n in rows}

    try:
        return _timing(decoder, context, measure)
    finally:
        set_far_rows(library, None)


def time_kernels(decoder, library: Path) -> dict:
    """Time ``decoder``'s passes both ways of each choice (:data:`KERNEL_CHOICES`, in turn, each set before
    the next is timed) and return this machine's record: the machine, each choice (against the vendor's
    rule) and what made it, and the timings; a choice the environment's switch makes is recorded untimed.
    Leaves the choices set in this process."""
    for choice in KERNEL_CHOICES:
        choice.set(library, None)
    record: dict = {"machine": this_machine(library)}
    for choice in KERNEL_CHOICES:
        asked = choice.switch()
        if asked is not None:
            record.update({choice.key: asked, choice.by: choice.switch_name})
        else:
            vendor = choice.in_force(library)
            ms = choice.time(decoder, library)
            made, by = choice.decide(ms, vendor)
            record.update({choice.key: made, choice.timings: ms, choice.by: by})
        choice.set(library, record[choice.key])
    return record


def measure_kernels(target: Path, library: Path, *, threads: int, capacity: int) -> dict:
    """Time passes of the ``target`` graph (:func:`time_kernels`) and return the manifest's record.  Leaves
    the choices set in this process, so that what the export builds next (the drafter's body:
    ``rounds_drafter_native``) is built for them."""
    from edge_spec.runtime.model.decoder import Decoder

    decoder = Decoder(target, threads=threads, capacity=capacity, takes_turns=True)
    try:
        return time_kernels(decoder, library)
    finally:
        del decoder


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


def decide_far(ms: dict[str, dict[str, float]], vendor_rows: int) -> tuple[int, str]:
    """(the fewest rows of a pass that asks far ahead, :data:`NO_PASS` for none; what made it) from each pass
    size's median passes ``ms`` (:func:`time_far_passes`): the sizes from which on every size timed is faster
    asking far, a size within :data:`MARGIN` either way counting as the vendor's rule (``vendor_rows``) has it;
    ``vendor_rows`` itself where no size differs by more, or passes are shorter than :data:`MIN_PASS_MS`."""
    if max(max(sides.values()) for sides in ms.values()) < MIN_PASS_MS:
        return vendor_rows, f"the vendor's rule (passes under {MIN_PASS_MS:g} ms read from the caches)"

    def asks_far(rows: int) -> bool | None:
        far, near = ms[str(rows)]["far"], ms[str(rows)]["near"]
        return True if far < (1 - MARGIN) * near else False if near < (1 - MARGIN) * far else None

    verdicts = {rows: asks_far(rows) for rows in sorted(int(n) for n in ms)}
    if all(v is None for v in verdicts.values()):
        return vendor_rows, f"the vendor's rule (measured within {MARGIN:.0%})"
    chosen = NO_PASS
    for rows in sorted(verdicts, reverse=True):
        vendor_asks = vendor_rows != NO_PASS and rows >= vendor_rows
        if not (vendor_asks if verdicts[rows] is None else verdicts[rows]):
            break
        chosen = rows
    return chosen, "measured"


def _valid_rows(rows) -> bool:
    return isinstance(rows, int) and not isinstance(rows, bool) and rows >= NO_PASS


@dataclass(frozen=True)
class KernelChoice:
    """One of the op's per-machine choices: its record's fields, its switch, and how it is timed, decided
    and set."""

    key: str  # the record's field for the choice
    timings: str  # ... for its timings
    by: str  # ... for what made it
    switch_name: str
    switch: Callable[[], object]  # what the environment asks for, None where unset
    in_force: Callable[[Path], object]
    time: Callable[[object, Path], dict]
    decide: Callable[[dict, object], tuple[object, str]]
    set: Callable[[Path, object], None]
    valid: Callable[[object], bool]  # whether a record's value for the choice is one (a damaged record's is not)


#: the choices in the order they are timed: one-row passes are timed asking far as they will run
KERNEL_CHOICES = (
    KernelChoice(
        key="one_row_prefetch",
        timings="one_row_ms",
        by="by",
        switch_name=ONE_ROW_SWITCH,
        switch=switch_choice,
        in_force=choice_in_force,
        time=time_one_row_passes,
        decide=decide,
        set=set_one_row_prefetch,
        valid=CHOICES.__contains__,
    ),
    KernelChoice(
        key="far_from_rows",
        timings="far_ms",
        by="far_by",
        switch_name=FAR_SWITCH,
        switch=switch_far_rows,
        in_force=far_rows_in_force,
        time=time_far_passes,
        decide=decide_far,
        set=set_far_rows,
        valid=_valid_rows,
    ),
)


def switched() -> list[str]:
    """The switches in this process's environment that decide a choice over any measurement."""
    return [choice.switch_name for choice in KERNEL_CHOICES if choice.switch() is not None]


def measured_here(record: dict | None, library: Path) -> bool:
    """Whether ``record`` (a manifest's ``native_kernels``, or one remembered at a load) holds choices measured
    on this machine: this CPU, on the kernels the op runs here (a damaged one, or one without the far choice,
    is none)."""
    return (
        isinstance(record, dict)
        and record.get("machine") == this_machine(library)
        and all(choice.valid(record.get(choice.key)) for choice in KERNEL_CHOICES)
    )


def apply_kernel_choice(record: dict | None, library: Path) -> str:
    """Set ``record``'s choices where this is the machine that measured them, the vendor's rules elsewhere;
    returns the one-row choice in force ("ahead" or "none")."""
    here = measured_here(record, library)
    for choice in KERNEL_CHOICES:
        choice.set(library, record[choice.key] if here else None)
    return choice_in_force(library)


def far_words(rows: int) -> str:
    """Which passes ask far ahead, in words."""
    if rows == NO_PASS:
        return "no pass asks far ahead"
    return "every pass asks far ahead" if rows == 1 else f"passes of {rows} rows and more ask far ahead"


def record_words(record: dict, where: str) -> str:
    """The ``native_kernels`` record in words, its CPU said as ``where``: what the export says, and
    ``edge-spec info`` (:func:`describe`)."""
    timed = record.get("one_row_ms")
    times = f" ({timed[AHEAD]:.1f} ms asking ahead, {timed[NONE]:.1f} ms not)" if timed else ""
    asks = "ask" if record.get("one_row_prefetch") == AHEAD else "do not ask"
    words = f"native op: one-row passes {asks} for their records ahead {where}{times}: {record.get('by', '?')}"
    if not _valid_rows(record.get("far_from_rows")):
        return words
    far = record.get("far_ms") or {}
    times = ", ".join(f"{n} {'row' if n == '1' else 'rows'} {t['far']:.1f}/{t['near']:.1f} ms" for n, t in far.items())
    return (
        f"{words}; {far_words(record['far_from_rows'])}"
        + (f" (far/near: {times})" if times else "")
        + (f": {record.get('far_by', '?')}")
    )


def describe(record: dict, library: Path | None, remembered: dict | None = None) -> str:
    """The manifest's ``native_kernels`` record in words, and what this machine runs (``library``: the native
    op's here, None where it does not run; ``remembered``: the record a load timed on this machine), for
    ``edge-spec info``."""
    words = record_words(record, f"on {record.get('machine', '?')}")
    if library is None:
        return words + "; the op does not run here"
    switches = switched()
    if switches:
        decides = "decides" if len(switches) == 1 else "decide"
        return words + f"; {' and '.join(switches)} {decides} here ({in_force(library)})"
    if measured_here(record, library):
        return words
    why = "this machine differs" if record.get("machine") != this_machine(library) else "the record is incomplete"
    if measured_here(remembered, library):
        here = record_words(remembered, "here").removeprefix("native op: ")
        return f"{words}; {why} and a load timed this machine's own: {here}"
    return words + (
        f"; {why} and the next load times this machine's own (until then the vendor's rules: {in_force(library)})"
    )


def in_force(library: Path) -> str:
    """What this process's passes ask for now, in words."""
    asks = "ask" if choice_in_force(library) == AHEAD else "do not ask"
    return f"one-row passes {asks} ahead, {far_words(far_rows_in_force(library))}"
