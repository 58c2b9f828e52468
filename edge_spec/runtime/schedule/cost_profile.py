"""Device cost profile of a bundle: measured latencies the γ policy plans with, cached per device.

Why measured and not analytic: on a 2-core AVX2 CPU a target pass over 3+
new tokens is compute-bound (int8-activation matmuls), so a memory-bound model
(every pass costs one weight read) badly underestimates verification.  We time,
once per bundle + drafter head + provider + thread count + ONNX Runtime version
+ CPU, target passes over a few row counts and drafter steps (body and head
separately), and cache the result as JSON in the user cache directory
(``$EDGE_SPEC_CACHE`` or ``~/.cache/edge-spec/costs``).

The first answer waits for it, so it is quick (:func:`measure`, about forty passes' worth): once
the models' pages are on huge pages (until then a pass runs at half speed), one warm-up pass, then
two passes per row count in :func:`quick_rows` (every count up to six, where kernels that tile rows in
pairs make neighbours differ most and where most rounds land, then a few up to the ceiling or
``QUICK_ROWS_MAX``), up the counts and back down, each right after a drafter step as in a round.  Row counts between are interpolated (the curve is near
linear between them) and listed in ``estimated``; live passes replace them
(:func:`refine_from_live`), so the saved profile fills in with use, with no measuring that competes
with an answer for the cores.

A profile taken while the machine was busy is not kept as its truth.  Other processes' share of the
CPU while it was measured (``busy``), or a profile much slower than the one measured before it for the
same key, mark it ``suspect``.  One measured while others were busy is measured again at the first load
that finds the machine quiet (other processes' share over half a second, :func:`others_now`); until then,
and for one that is only slower than before, live passes that beat it (any suspect profile, by 15% a trusted one, at
every size measured live) replace it: the sizes measured live take their live latencies, the sizes
between them lie on straight lines between those, and past them the line goes on with their slope (the
old curve's at the new level where they are too few), as estimates the next passes replace in turn.  One that live passes
keep losing to (the machine became slower) is measured again at the next load
(:func:`outgrown_by_live`).

Every profile says when it was measured (``measured_at``), by which command (``measured_by``: ``edge-spec
export`` measures the bundle it made) and why the one before it was dropped (``replaced``), for
``edge-spec info --costs`` to tell; ``--remeasure`` there measures again on request (:func:`remeasuring`).

The analytic memory-bound side (bytes of weights each step reads) is computed
too, so that MBSU can be reported beside measured speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_spec.files import write_text_atomic
from edge_spec.native.build import kernel_identity
from edge_spec.paths import cache_root
from edge_spec.runtime.latency_curve import latency_at
from edge_spec.runtime.model import huge_pages
from edge_spec.runtime.model.kernel_choice import cpu_fields

PROFILE_VERSION = 10  # 10: quick profiles time each row count twice (up the counts, then down), the rest estimated
QUICK_LENGTH = 32  # cache length the quick profile times its passes at (its warm-up pass fills it)
DENSE_ROWS = 6  # every row count up to this one is timed
SPARSE_ROWS = (8, 12, 16, 24, 32, 48, 64, 96, 128)  # past it, these (and the ceiling)
# The first answer waits for the quick profile, and a pass costs ~14 ms a row on a 2-core CPU: past this many
# rows the curve goes on along its last timed segment (near linear there) until live passes measure it.
QUICK_ROWS_MAX = 17
BUSY = 0.25  # other processes took this share of the CPU while a profile was measured: suspect
QUIET = 0.15  # other processes' share of the CPU below which a load measures a busy profile again
QUIET_SPAN = 0.5  # seconds over which a load reads that share (only where a busy profile is cached)
SLOWER = 1.3  # a profile this much slower than the one measured before it for the same key: suspect
MIN_CALLS = 8  # live passes of a size before they judge or refine the profile


@dataclass
class CostProfile:
    verify: dict[int, float]  # target pass latency (s) by number of new tokens
    draft_body: float  # drafter body, one token (s)
    draft_head: float  # drafter head on one hidden state (s)
    measured_seconds: float  # how long profiling took
    draft_catch_up: float = 0.0  # what a second row adds to a drafter body step (s; schedule.policy prices it)
    cached: bool = False
    corrections: int = 0  # times live passes replaced latencies measured under load
    quick: bool = False  # measured by :func:`measure`: a few row counts timed up and down, the rest estimated
    estimated: list[int] = field(default_factory=list)  # row counts interpolated, not timed nor measured live yet
    busy: float = 0.0  # share of the CPU other processes used while it was measured (0 where unknown)
    suspect: bool = False  # evidence that it was measured under load: live passes that beat it replace it
    measured_at: float = 0.0  # when (seconds since the epoch; 0: before profiles said)
    measured_by: str = ""  # the command that measured it ("edge-spec export", "edge-spec chat", ...)
    replaced: str = ""  # why the profile before it was dropped ("": there was none)
    dropped: str = ""  # on a profile kept as previous-KEY.json: why it was dropped (forget)

    @property
    def measured_busy(self) -> bool:
        """Measured while other processes were busy, and not replaced by live passes since: the next quiet
        load measures it again."""
        return self.suspect and self.busy >= BUSY

    @property
    def draft_step(self) -> float:
        return self.draft_body + self.draft_head


_listeners: list[Callable[[str], None]] = []


@contextlib.contextmanager
def on_measure(callback: Callable[[str], None]) -> Iterator[None]:
    """Within the block, ``callback(what)`` is called when this machine starts being measured (a first
    load: its speed, or a device fact), ``what`` saying so in a few words (a spinner shows it), and
    ``callback("")`` when that is done."""
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


@contextlib.contextmanager
def measuring(what: str) -> Iterator[None]:
    """Within the block this machine is being measured, ``what`` saying so: every :func:`on_measure` callback
    hears it."""
    for callback in _listeners:
        callback(what)
    try:
        yield
    finally:
        for callback in _listeners:
            callback("")


def cache_dir() -> Path:
    return cache_root() / "costs"


def cache_key(manifest: dict, drafter: dict, provider: str, threads: int | str, max_tokens: int) -> str:
    """Everything the latencies depend on: the exact weights, the drafter (its manifest record), the
    device and runtime."""
    parts = [PROFILE_VERSION, _target_hashes(manifest), drafter, provider, threads, max_tokens, *_runtime()]
    return _digest(parts)


def target_key(manifest: dict, provider: str, threads: int | str) -> str:
    """Everything the target's kernels depend on (which ones run, so how they round): its graph and
    weights, the device and runtime."""
    return _digest(["target", _target_hashes(manifest), provider, threads, *_runtime()])


def _runtime() -> list:
    return [
        ort.__version__,
        platform.machine(),
        platform.processor(),
        os.cpu_count(),
        cpu_fields().get("model name", ""),
        *kernel_identity(),
    ]


def _read_json(path: Path) -> object | None:
    """A cached JSON file's contents; None where there is none or it does not parse (measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def recalled(key: str) -> bool | None:
    """A yes/no fact about this device as cached by :func:`remembered`; None when not checked yet."""
    fact = _read_json(cache_dir() / f"fact-{key}.json")
    return bool(fact["value"]) if isinstance(fact, dict) and "value" in fact else None


def remembered(key: str, check) -> bool:
    """A yes/no fact about this device, checked once (``check()``) and cached beside the profiles."""
    path = cache_dir() / f"fact-{key}.json"
    value = recalled(key)
    if value is not None:
        return value
    with measuring("checking this machine's arithmetic (first run)"):
        value = bool(check())
    _store(path, {"value": value})
    return value


def kernels_key(manifest: dict, machine: str) -> str:
    """What a timing of the native op's kernels on this device holds for: the target's weights, the
    ``machine`` (``kernel_choice.this_machine``: the CPU and the kernels the op runs on it), the runtime and
    the op's build."""
    return _digest(["kernels", _target_hashes(manifest), machine, *_runtime()])


def recalled_record(key: str) -> dict | None:
    """A measurement of this device stored by :func:`remember_record`; None when there is none (or it is
    damaged: it is measured again)."""
    record = _read_json(cache_dir() / f"kernels-{key}.json")
    return record if isinstance(record, dict) else None


def remember_record(key: str, record: dict) -> None:
    """Keep ``record`` (the native op's kernel choice timed on this device) beside the profiles."""
    _store(cache_dir() / f"kernels-{key}.json", record)


def pair_key(manifest: dict, drafter: dict) -> str:
    """The drafter/target pair alone (what acceptance depends on, unlike latencies)."""
    return _digest([_target_hashes(manifest), drafter])


def _digest(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _target_hashes(manifest: dict) -> list[str]:
    """The exact target weights, as their files' sha256."""
    return sorted(f["sha256"] for f in manifest["target"]["files"])


def quick_rows(max_tokens: int) -> list[int]:
    """The row counts :func:`measure` times: every count up to ``DENSE_ROWS``, then ``SPARSE_ROWS`` short
    of the last by two or more, and the last: the ceiling ``max_tokens``, or ``QUICK_ROWS_MAX`` below it."""
    last = min(max_tokens, QUICK_ROWS_MAX)
    dense = range(1, min(DENSE_ROWS, last) + 1)
    return sorted({*dense, *(n for n in SPARSE_ROWS if n <= last - 2), last})


def measure(target, drafter, max_tokens: int) -> CostProfile:
    """The quick profile: after the pages of the models just loaded are on huge pages, a warm-up pass of
    ``QUICK_LENGTH`` throw-away tokens (the cache the passes are timed at), then two passes over each row
    count in :func:`quick_rows` (the counts up, then down; each count's mean), each between two drafter
    steps as in a round; the row counts between are interpolated (:func:`interpolate`) and listed as
    ``estimated``.  Both caches are reset afterwards."""
    started = time.perf_counter()
    huge_pages.wait_all()  # meanwhile the pages are being copied, on one of the cores the passes need
    length = min(QUICK_LENGTH, target.capacity - max_tokens - 1)
    clock = _CpuClock()
    target.reset()
    # logits for every row, as a verify pass asks for them: the LM head over n rows costs more than over one
    target.forward([0] * length, max_tokens)
    drafter.profile_fill(length)
    body, head = [], []

    def drafter_step() -> None:
        body_seconds, head_seconds = drafter.profile_step()
        body.append(body_seconds)
        head.append(head_seconds)

    drafter_step()  # its warm-up
    rows = quick_rows(max_tokens)
    sweeps: dict[int, list[float]] = {n: [] for n in rows}
    # up the row counts, then down: a machine that speeds up or slows down while it is measured (a
    # neighbour's load, the clock leaving its boost) moves every count's mean alike, where one sweep up
    # would make each count dearer the more rows it has -- a slope the schedule never tests, since it
    # stops drafting the rounds whose passes would show it
    for n in rows + rows[::-1]:
        # alternate the two models as the loop does: each pass is timed right after the other model ran,
        # which is what it costs in a round (back-to-back passes of one model are faster)
        drafter_step()
        sweeps[n].append(_timed(lambda n=n: target.forward([0] * n, n, lean=True)))  # one row: a lean round's
        target.rewind(length)
    timed = {n: sum(times) / len(times) for n, times in sweeps.items()}
    drafter_step()
    two_rows = min(drafter.profile_step(rows=2)[0] for _ in range(2))
    target.reset()
    drafter.profile_fill(0)
    one_row = min(body[1:])
    verify = interpolate(timed, max_tokens)
    return CostProfile(
        verify,
        one_row,
        min(head[1:]),
        time.perf_counter() - started,
        draft_catch_up=max(two_rows - one_row, 0.0),
        quick=True,
        estimated=[n for n in verify if n not in timed],
        busy=clock.others(),
    )


def interpolate(timed: dict[int, float], max_tokens: int) -> dict[int, float]:
    """Latencies for 1..``max_tokens`` rows from those ``timed``: first each timed one lowered to the
    cheapest timed at as many rows or more (a pass over more rows never costs less: a dearer one was
    slowed by something else), then read as the cost model reads any curve (``latency_curve.latency_at``:
    straight lines between, the last segment continued past the largest timed count), so the curve is
    non-decreasing and exact at every timed point that needed no lowering."""
    floor = {}
    cheapest = float("inf")
    for n in sorted(timed, reverse=True):
        cheapest = min(cheapest, timed[n])
        floor[n] = cheapest
    return {n: latency_at(floor, n) for n in range(1, max_tokens + 1)}


CPU_CLOCK_SPAN = 1.0  # seconds: over less, the kernel's 10 ms ticks say nothing about a share


class _CpuClock:
    """The share of the machine's CPU that other processes used since it was made (Linux: ``/proc/stat``
    against this process's own CPU time; 0 where either cannot be read, or after less than
    ``CPU_CLOCK_SPAN``)."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, int] | None:
        try:
            lines = Path("/proc/stat").read_text().splitlines()
            fields = [int(x) for x in lines[0].split()[1:9]]
            cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        mine = os.times()
        # steal: time the hypervisor gave other machines, which slows this one alike
        return (
            (user + nice + system + irq + softirq + steal) / tick,
            mine.user + mine.system,
            time.monotonic(),
            max(cpus, 1),
        )

    def others(self, span: float = CPU_CLOCK_SPAN) -> float:
        """The share since the clock was made; 0 after less than ``span`` seconds."""
        end = self._read()
        if self.start is None or end is None or end[2] - self.start[2] < span:
            return 0.0
        busy, mine, wall = (e - s for e, s in zip(end[:3], self.start[:3]))
        return float(min(max((busy - mine) / (wall * end[3]), 0.0), 1.0))


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def others_now(span: float = QUIET_SPAN) -> float:
    """Other processes' share of the CPU over the next ``span`` seconds (0 where it cannot be read)."""
    clock = _CpuClock()
    time.sleep(span)
    return clock.others(span=span * 0.9)


_remeasure = False


@contextlib.contextmanager
def remeasuring() -> Iterator[None]:
    """Within the block, a load measures its profile again even where one is cached (``edge-spec info
    --costs --remeasure``)."""
    global _remeasure
    _remeasure = True
    try:
        yield
    finally:
        _remeasure = False


def _command() -> str:
    """The command this process runs, as a profile names what measured it: ``edge-spec SUBCOMMAND``, else
    the program's name."""
    argv = sys.argv or [""]
    program = Path(argv[0]).name
    if program in ("edge-spec", "edge-spec.exe", "__main__.py"):
        words = [word for word in argv[1:] if not word.startswith("-")]
        return "edge-spec" + (f" {words[0]}" if words else "")
    return program or "python"


def load_or_measure(
    key: str, target, drafter, max_tokens: int, settle: Callable[[], None] | None = None
) -> CostProfile:
    """The cached profile, else one measured now (:func:`measure`, after ``settle()``: waiting for the
    process's own background work) and cached: suspect when other processes were busy meanwhile, or when
    it is much slower than the one measured before it for this key (kept by :func:`forget`).  A cached
    profile measured while other processes were busy is measured again once the machine is quiet
    (:func:`others_now` below ``QUIET``), and any is within :func:`remeasuring`."""
    cached = load(key)
    previous = _read(cache_dir() / f"previous-{key}.json") if cached is None or cached.measured_busy else None
    if cached is None:
        why = previous.dropped if previous is not None else ""
    elif _remeasure:
        why = "as asked (--remeasure)"
    elif cached.measured_busy and others_now() < QUIET:
        why = f"the one before it was measured while other processes used {cached.busy:.0%} of the CPU"
    else:
        return _watch(cached)
    with measuring(
        "measuring this machine's speed (first run, a few seconds)"
        if cached is None
        else "measuring this machine's speed again (a few seconds)"
    ):
        if settle is not None:
            settle()
        profile = measure(target, drafter, max_tokens)
    profile.measured_at, profile.measured_by, profile.replaced = time.time(), _command(), why
    # slower than the last trusted profile: another sign of load (a busy one is no measure of the machine)
    before = previous if cached is None or cached.measured_busy else cached
    slower = before is not None and _median_ratio(profile.verify, before.verify) > SLOWER
    profile.suspect = profile.busy >= BUSY or slower
    if profile.measured_busy and cached is not None and cached.measured_busy:
        if _median_ratio(profile.verify, cached.verify) > 1:  # busy again, and slower: the old one stays
            return _watch(cached)
    save(key, profile)
    return _watch(profile)


def _median_ratio(now: dict[int, float], before: dict[int, float]) -> float:
    ratios = [now[n] / before[n] for n in now if before.get(n, 0) > 0]
    return float(np.median(ratios)) if ratios else 1.0


def load(key: str) -> CostProfile | None:
    """The cached profile, or None (none yet, or damaged: it is measured again)."""
    profile = _read(cache_dir() / f"{key}.json")
    if profile is not None:
        profile.cached = True
    return profile


def _read(path: Path) -> CostProfile | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["verify"] = {int(n): t for n, t in data["verify"].items()}
        return CostProfile(**data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(key: str, profile: CostProfile) -> None:
    """Write atomically; a read-only cache directory means profiling at every load."""
    _store(cache_dir() / f"{key}.json", {**asdict(profile), "cached": False})


def _store(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically; a cache that cannot be written is skipped."""
    try:
        write_text_atomic(path, json.dumps(data, indent=1))
    except OSError:
        pass


UNDER_LOAD = 0.85  # live passes this much cheaper than a trusted profile, at every size measured live: replace it


def refine_from_live(
    profile: CostProfile,
    live: dict[int, float],
    calls: dict[int, int],
    steps: dict[int, float] | None = None,
    step_calls: dict[int, int] | None = None,
    min_calls: int = MIN_CALLS,
) -> bool:
    """Bring the profile to what live passes cost (``live``: latency by rows; ``calls``: live passes by rows,
    only those since the profile was loaded; ``steps``/``step_calls`` the same for the drafter's body).
    Sizes count once measured live ``min_calls`` times or more.  Returns whether the profile changed (the
    caller saves it).

    * Taken under load (:func:`correct_from_live`): replaced.
    * Else the estimated sizes measured live take their live latencies, brought to the profile's level
      (live moving averages run above a profile of single passes: the median ratio over the timed sizes
      measured live), and the estimates left are drawn again through them."""
    if correct_from_live(profile, live, calls, steps, step_calls, min_calls):
        return True
    measured = _measured(profile, live, calls, min_calls)
    fresh = {n: t for n, t in measured.items() if n in profile.estimated}
    if not fresh:
        return False
    timed = [measured[n] / profile.verify[n] for n in measured if n not in profile.estimated]
    level = float(np.median(timed)) if timed else 1.0
    anchors = {n: t for n, t in profile.verify.items() if n not in profile.estimated}
    anchors.update({n: t / level for n, t in fresh.items()})
    profile.verify = reshape(profile.verify, anchors)
    profile.estimated = [n for n in profile.verify if n not in anchors]
    return True


def correct_from_live(
    profile: CostProfile,
    live: dict[int, float],
    calls: dict[int, int],
    steps: dict[int, float] | None = None,
    step_calls: dict[int, int] | None = None,
    min_calls: int = MIN_CALLS,
) -> bool:
    """Replace a profile taken while the machine was busy with what live passes cost.

    Taken under load: every size measured live ``min_calls`` times or more is cheaper live than profiled,
    by ``UNDER_LOAD`` at least for a trusted profile (a profile slower than live at one size and right at
    another is noise, not load), by anything for a suspect one.  The sizes measured live take their live
    latencies as they are; the others are drawn through them (:func:`reshape`: a busy machine's values
    between live sizes are noise, so lines between those) and become estimates, for live passes to replace in turn; the drafter takes its live step where measured, else
    the median ratio.  Returns whether the profile changed (the caller saves it)."""
    measured = _measured(profile, live, calls, min_calls)
    if not measured:
        return False
    ratios = [t / profile.verify[n] for n, t in measured.items()]
    if max(ratios) >= (1.0 if profile.suspect else UNDER_LOAD):
        return False
    profile.verify = reshape(profile.verify, measured)
    profile.estimated = [n for n in profile.verify if n not in measured]
    steps, step_calls = steps or {}, step_calls or {}
    if steps.get(1, 0) > 0 and step_calls.get(1, 0) >= min_calls:
        scale = steps[1] / profile.draft_body if profile.draft_body > 0 else 1.0
        if steps.get(2, 0) > 0 and step_calls.get(2, 0) >= min_calls:
            profile.draft_catch_up = max(steps[2] - steps[1], 0.0)
        profile.draft_body = steps[1]
    else:  # the load that slowed the target slowed the drafter alike
        scale = float(np.median(ratios))
        profile.draft_body *= scale
        profile.draft_catch_up *= scale
    profile.draft_head *= scale
    profile.corrections += 1
    profile.suspect = False
    return True


def reshape(old: dict[int, float], anchors: dict[int, float]) -> dict[int, float]:
    """``old`` redrawn through ``anchors`` (new latencies at some sizes): a size between two anchors lies
    on the straight line between them (the curve is near linear between row counts a few apart, and the
    old values there may be a busy machine's noise); past the last anchor, or before the first, the line
    goes on with the anchors' slope where they span two rows or more, else the old curve's at the nearest
    anchor's level (fitted over all sizes, so that one noisy size or a flat stretch does not set it)."""
    known = sorted(n for n in anchors if old.get(n, 0) > 0)
    if not known:
        return dict(old)
    sizes = sorted(old)
    fitted = _slope({n: anchors[n] for n in known}) if known[-1] - known[0] >= 2 else None
    slope = _slope(old)
    out = {}
    for n in sizes:
        lo = max((k for k in known if k <= n), default=None)
        hi = min((k for k in known if k >= n), default=None)
        if n in anchors:
            out[n] = anchors[n]
        elif lo is not None and hi is not None:
            out[n] = anchors[lo] + (n - lo) / (hi - lo) * (anchors[hi] - anchors[lo])
        elif lo is not None:
            out[n] = anchors[lo] + (n - lo) * (fitted if fitted is not None else slope * anchors[lo] / old[lo])
        else:  # never below half the first anchor: a pass over fewer rows still reads every weight
            step = fitted if fitted is not None else slope * anchors[hi] / old[hi]
            out[n] = max(anchors[hi] - (hi - n) * step, anchors[hi] / 2)
    return out


def _slope(curve: dict[int, float]) -> float:
    """The least-squares slope of latency over rows (never negative; 0 for one point)."""
    if len(curve) < 2:
        return 0.0
    sizes = sorted(curve)
    return max(float(np.polyfit(sizes, [curve[n] for n in sizes], 1)[0]), 0.0)


OUTGROWN = 1.5  # live passes this much dearer than the profile, at every measured size: measure again


def outgrown_by_live(
    profile: CostProfile, live: dict[int, float], calls: dict[int, int], min_calls: int = MIN_CALLS
) -> bool:
    """Whether the machine has become slower than its profile says, at every size measured live
    (``min_calls`` passes or more), by more than ``OUTGROWN``: throttled memory, another power mode.  Live moving averages run 10-20% above a profile of single passes on a quiet
    machine, hence the margin.  Scaling such a profile would keep its old shape, and a slowdown does not
    keep it (a memory-bound machine prices extra rows cheaper), so the caller forgets the profile and the
    next load measures it again; until then the loop plans with live latencies (``DecoderStats``).
    Not while other processes have used ``BUSY`` of the CPU or more since the profile was loaded
    (:func:`_watch`): live passes slowed by them say nothing about this machine, and a profile measured
    now would be one measured under load."""
    ratios = [t / profile.verify[n] for n, t in _measured(profile, live, calls, min_calls).items()]
    if not ratios or min(ratios) <= OUTGROWN:
        return False
    clock = getattr(profile, "loaded_clock", None)
    return clock is None or clock.others() < BUSY


def _watch(profile: CostProfile) -> CostProfile:
    """Start counting other processes' CPU time from the profile's load (not saved with it)."""
    profile.loaded_clock = _CpuClock()
    return profile


def _measured(profile: CostProfile, live: dict[int, float], calls: dict[int, int], min_calls: int) -> dict[int, float]:
    """Live latency per profiled pass size measured live ``min_calls`` times or more."""
    return {
        n: live[n]
        for n in profile.verify
        if live.get(n, 0) > 0 and calls.get(n, 0) >= min_calls and profile.verify[n] > 0
    }


OUTGROWN_WHY = "live passes ran slower than the one before it at every size measured (the machine became slower)"


def forget(key: str, why: str = OUTGROWN_WHY) -> None:
    """Drop a cached profile: the next load measures it again, says ``why`` the old one went, and compares
    the new one with it (kept as ``previous-KEY.json``).  One that cannot be moved stays."""
    path = cache_dir() / f"{key}.json"
    profile = _read(path)
    try:
        path.replace(cache_dir() / f"previous-{key}.json")
    except OSError:
        return
    if profile is not None:
        _store(cache_dir() / f"previous-{key}.json", {**asdict(profile), "cached": False, "dropped": why})
