"""model/heap.py: a round's row-sized arrays reuse freed pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc thresholds: Linux only")

# In a fresh process: what keep_heap() says, then the minor page faults of 200 rounds that each make
# and free the arrays of one sampled row (float32 logits -> float64 probabilities) on a 150k vocabulary.
ROUNDS = """
import json, resource, sys
import numpy as np
from edge_spec.runtime.model.heap import keep_heap
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs
kept = keep_heap()
logits = np.random.default_rng(0).standard_normal(151936).astype(np.float32)
params = SamplingParams(temperature=0.7)
logits_to_probs(logits, params)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    logits_to_probs(logits, params)
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _rounds(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("EDGE_SPEC_KEEP_HEAP", "MALLOC_MMAP_THRESHOLD_",
                                                              "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_kept_heap_rounds_reuse_pages_and_glibc_defaults_fault_them_in():
    kept, default = _rounds(), _rounds(EDGE_SPEC_KEEP_HEAP="0")
    assert kept["kept"] is True and default["kept"] is False
    # a float64 row is 297 pages: with the defaults every round faults in at least one row's worth
    assert default["faults"] > 200 * 290
    assert kept["faults"] < 200


def test_the_owners_malloc_settings_are_left_alone():
    assert _rounds(MALLOC_TRIM_THRESHOLD_="1048576")["kept"] is False
