"""Device cost profile of a bundle: measured latencies the γ policy plans with, cached per device.

Why measured and not analytic: on a 2-core AVX2 CPU a target pass over 3+
new tokens is compute-bound (int8-activation matmuls), so a memory-bound model
(every pass costs one weight read) badly underestimates verification.  We time,
once per bundle + drafter head + provider + thread count + ONNX Runtime version
+ CPU, a target pass over 1..γ_max+1 new tokens and a drafter step (body and
head separately), at a short and a longer KV length, and cache the result as
JSON in the user cache directory (``$EDGE_SPEC_CACHE`` or
``~/.cache/edge-spec/costs``).  Each latency is the fastest of several
repeats: other load only ever slows a pass down, so the minimum is the
machine's cost.  The loop keeps refining these numbers with moving averages of
what it measures live, and a profile that live passes keep beating (it was
taken while the machine was busy) is corrected on disk (:func:`correct_from_live`); one that live
passes keep losing to (the machine became slower) is measured again at the next load
(:func:`outgrown_by_live`).

The analytic memory-bound side (bytes of weights each step reads) is computed
too, so that MBSU can be reported beside measured speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_spec.files import write_text_atomic
from edge_spec.paths import cache_root

PROFILE_VERSION = 8  # 8: the drafter's step over two rows too (the catch-up a round can leave it)
KV_LENGTHS = (48, 256)  # the profile reports the median over these cache lengths


@dataclass
class CostProfile:
    verify: dict[int, float]  # target pass latency (s) by number of new tokens
    draft_body: float  # drafter body, one token (s)
    draft_head: float  # drafter head on one hidden state (s)
    measured_seconds: float  # how long profiling took
    draft_catch_up: float = 0.0  # what a second row adds to a drafter body step (s; schedule.policy prices it)
    cached: bool = False
    corrections: int = 0  # times live passes replaced latencies measured under load

    @property
    def draft_step(self) -> float:
        return self.draft_body + self.draft_head


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
    return [ort.__version__, platform.machine(), platform.processor(), os.cpu_count(), _cpu_model()]


def remembered(key: str, check) -> bool:
    """A yes/no fact about this device, checked once (``check()``) and cached beside the profiles."""
    path = cache_dir() / f"fact-{key}.json"
    try:
        return bool(json.loads(path.read_text())["value"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = bool(check())
    _store(path, {"value": value})
    return value


def pair_key(manifest: dict, drafter: dict) -> str:
    """The drafter/target pair alone (what acceptance depends on, unlike latencies)."""
    return _digest([_target_hashes(manifest), drafter])


def _digest(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _target_hashes(manifest: dict) -> list[str]:
    """The exact target weights, as their files' sha256."""
    return sorted(f["sha256"] for f in manifest["target"]["files"])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def measure(target, drafter, max_tokens: int, repeats: int = 3) -> CostProfile:
    """Time target passes over 1..max_tokens new tokens and drafter body/head steps on throwaway
    tokens at each KV length in ``KV_LENGTHS`` (both caches are reset afterwards)."""
    started = time.perf_counter()
    verify: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
    body, head, two_rows = [], [], []
    for length in KV_LENGTHS:
        length = min(length, target.capacity - max_tokens - 1)
        target.reset()
        target.forward([0] * length, 1)
        drafter.profile_fill(length)
        for _ in range(repeats):
            # alternate the two models as the loop does: each pass is timed right after the other
            # model ran, which is what it costs in a round (back-to-back passes of one model are
            # faster, and planning with them makes long drafts look cheaper than they are)
            for n in verify:
                drafter.profile_step()
                # logits for every row, as a verify pass asks for them: the LM head over n rows costs
                # more than over one, and a profile without that makes drafted rounds look cheap
                verify[n].append(_timed(lambda: target.forward([0] * n, n)))
                target.rewind(length)
                body_seconds, head_seconds = drafter.profile_step()
                body.append(body_seconds)
                head.append(head_seconds)
            two_rows.append(drafter.profile_step(rows=2)[0])
    target.reset()
    drafter.profile_fill(0)
    one_row = _typical(body)
    return CostProfile({n: _typical(t) for n, t in verify.items()}, one_row, _typical(head),
                       time.perf_counter() - started, draft_catch_up=max(_typical(two_rows) - one_row, 0.0))


def _typical(seconds: list[float]) -> float:
    """The cost of a pass as the planner should see it: the fastest repeat per KV length (load only
    adds time), then the median over lengths (the cache grows during a request)."""
    per_length = np.array_split(np.asarray(seconds), len(KV_LENGTHS))
    return float(np.median([chunk.min() for chunk in per_length]))


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def load_or_measure(key: str, target, drafter, max_tokens: int) -> CostProfile:
    cached = load(key)
    if cached is not None:
        return cached
    profile = measure(target, drafter, max_tokens)
    save(key, profile)
    return profile


def load(key: str) -> CostProfile | None:
    """The cached profile, or None (none yet, or damaged: it is measured again)."""
    path = cache_dir() / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        data["verify"] = {int(n): t for n, t in data["verify"].items()}
        return CostProfile(**{**data, "cached": True})
    except (ValueError, KeyError, TypeError):
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


UNDER_LOAD = 0.85  # live passes this much cheaper than the profile, at every measured size: re-time


def correct_from_live(profile: CostProfile, live: dict[int, float], calls: dict[int, int],
                      min_calls: int = 8) -> bool:
    """Replace a profile taken while the machine was busy with what live passes cost.

    Only when every size measured live (``min_calls`` passes or more) is consistently cheaper than
    the profile: a profile slower than live at one size and right at another is noise, not load.
    Sizes not measured live, and the drafter, are scaled by the median ratio.  Returns
    whether the profile changed (the caller saves it)."""
    ratios = _live_ratios(profile, live, calls, min_calls)
    if not ratios or max(ratios.values()) >= UNDER_LOAD:
        return False
    scale = float(np.median(list(ratios.values())))
    profile.verify = {n: ratios[n] * t if n in ratios else scale * t for n, t in profile.verify.items()}
    profile.draft_body *= scale  # the load that slowed the target slowed the drafter alike
    profile.corrections += 1
    return True


OUTGROWN = 1.5  # live passes this much dearer than the profile, at every measured size: measure again


def outgrown_by_live(profile: CostProfile, live: dict[int, float], calls: dict[int, int], min_calls: int = 8) -> bool:
    """Whether the machine has become slower than its profile says, at every size measured live
    (``min_calls`` passes or more), by more than ``OUTGROWN``: throttled memory, another power mode,
    other tenants.  Live moving averages run 10-20% above a profile of fastest repeats on a quiet
    machine, hence the margin.  Scaling such a profile would keep its old shape, and a slowdown does not
    keep it (a memory-bound machine prices extra rows cheaper), so the caller forgets the profile and the
    next load measures it again; until then the loop plans with live latencies (``DecoderStats``)."""
    ratios = _live_ratios(profile, live, calls, min_calls)
    return bool(ratios) and min(ratios.values()) > OUTGROWN


def _live_ratios(profile: CostProfile, live: dict[int, float], calls: dict[int, int], min_calls: int
                 ) -> dict[int, float]:
    """Live latency / profiled latency per pass size measured live ``min_calls`` times or more."""
    return {n: live[n] / profile.verify[n] for n in profile.verify
            if n in live and calls.get(n, 0) >= min_calls and profile.verify[n] > 0}


def forget(key: str) -> None:
    """Drop a cached profile (the next load measures it again); one that cannot be removed stays."""
    try:
        (cache_dir() / f"{key}.json").unlink()
    except OSError:
        pass


def weight_bytes(bundle_dir: Path, manifest: dict, head: str) -> tuple[int, int]:
    """(target bytes, drafter body + head bytes) read per step in a memory-bound model."""
    target = sum(f["bytes"] for f in manifest["target"]["files"] if f["path"].endswith(".data"))
    draft = manifest["draft"]
    body = (bundle_dir / (draft["onnx"] + ".data")).stat().st_size
    return target, body + head_bytes(bundle_dir, draft["heads"][head], draft["config"]["hidden_size"])


def head_bytes(bundle_dir: Path, entry: dict, hidden_size: int) -> int:
    """Bytes one step of an LM head reads: its graph's weights (a SpecVocab head's scorer) plus, for
    SpecVocab, the int8 candidate rows it gathers."""
    size = (bundle_dir / (entry["onnx"] + ".data")).stat().st_size
    if entry.get("kind") == "specvocab":
        size += entry["size"] * hidden_size
    return size


def eagle_bytes(bundle_dir: Path, manifest: dict, head: str | None) -> int:
    """Bytes one EAGLE draft step reads: its layer (and fc) plus the LM head ``head``; a single-graph head's
    whole record."""
    entry = manifest["eagle"]
    if "heads" not in entry:
        return entry["bytes"]
    layer = sum((bundle_dir / (entry[key] + ".data")).stat().st_size for key in ("onnx", "fc_onnx"))
    return layer + head_bytes(bundle_dir, entry["heads"][head], entry["config"]["hidden_size"])
