"""Device cost profile of a bundle: measured latencies the γ policy plans with, cached per device.

Why measured and not analytic: on a 2-core AVX2 CPU a target pass over 3+
new tokens is compute-bound (int8-activation matmuls), so a memory-bound model
(every pass costs one weight read) badly underestimates verification.  We time,
once per bundle + drafter head + provider + thread count + ONNX Runtime version
+ CPU, a target pass over 1..γ_max+1 new tokens and a drafter step (body and
head separately), at a short and a longer KV length, and cache the result as
JSON in the user cache directory (``$EDGE_SPEC_CACHE`` or
``~/.cache/edge-spec/costs``).  The loop keeps refining these numbers with
moving averages of what it measures live.

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

PROFILE_VERSION = 4
KV_LENGTHS = (48, 256)  # the profile reports the median over these cache lengths


@dataclass
class CostProfile:
    verify: dict[int, float]  # target pass latency (s) by number of new tokens
    draft_body: float  # drafter body, one token (s)
    draft_head: float  # drafter head on one hidden state (s)
    measured_seconds: float  # how long profiling took
    cached: bool = False

    @property
    def draft_step(self) -> float:
        return self.draft_body + self.draft_head


def cache_dir() -> Path:
    root = os.environ.get("EDGE_SPEC_CACHE")
    if root:
        return Path(root) / "costs"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-spec" / "costs"


def cache_key(manifest: dict, drafter: dict, provider: str, threads: int | str, max_tokens: int) -> str:
    """Everything the latencies depend on: the exact weights, the drafter (its manifest record), the
    device and runtime."""
    target_files = sorted(f["sha256"] for f in manifest["target"]["files"])
    parts = [PROFILE_VERSION, target_files, drafter, provider,
             threads, max_tokens, ort.__version__, platform.machine(), platform.processor(), os.cpu_count(),
             _cpu_model()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def measure(target, drafter, max_tokens: int, repeats: int = 2) -> CostProfile:
    """Time target passes over 1..max_tokens new tokens and drafter body/head steps on throwaway
    tokens at each KV length in ``KV_LENGTHS`` (both caches are reset afterwards)."""
    started = time.perf_counter()
    verify: dict[int, list[float]] = {n: [] for n in range(1, max_tokens + 1)}
    body, head = [], []
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
                verify[n].append(_timed(lambda: target.forward([0] * n, 1)))
                target.rewind(length)
                body_seconds, head_seconds = drafter.profile_step()
                body.append(body_seconds)
                head.append(head_seconds)
    target.reset()
    drafter.profile_fill(0)
    return CostProfile({n: float(np.median(t)) for n, t in verify.items()}, float(np.median(body)),
                       float(np.median(head)), time.perf_counter() - started)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def load_or_measure(key: str, target, drafter, max_tokens: int) -> CostProfile:
    path = cache_dir() / f"{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            data["verify"] = {int(n): t for n, t in data["verify"].items()}
            return CostProfile(**{**data, "cached": True})
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    profile = measure(target, drafter, max_tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(profile), indent=1))
    except OSError:
        pass  # read-only home: profile every load
    return profile


def weight_bytes(bundle_dir: Path, manifest: dict, head: str) -> tuple[int, int]:
    """(target bytes, drafter body + head bytes) read per step in a memory-bound model."""
    target = sum(f["bytes"] for f in manifest["target"]["files"] if f["path"].endswith(".data"))
    draft = manifest["draft"]
    body = (bundle_dir / (draft["onnx"] + ".data")).stat().st_size
    entry = draft["heads"][head]
    head_bytes = (bundle_dir / (entry["onnx"] + ".data")).stat().st_size
    if entry.get("kind") == "specvocab":  # scorer + the int8 candidate rows it gathers
        head_bytes += entry["size"] * draft["config"]["hidden_size"]
    return target, body + head_bytes
