"""``benchmarks/cpu_mask.py``: a process told by CPUID that this CPU is another kind picks that kind's kernels.

What is tested is the native library's own choice from CPUID (no ``EDGE_SPEC_NATIVE_*`` switch set), the
benchmark tool that runs every engine on another kind's instruction sets, and that the preloaded handler
leaves every other fault to the program's own handler or the default action."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import native_kernels

_SPEC = importlib.util.spec_from_file_location(
    "cpu_mask", Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_mask.py"
)
cpu_mask = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cpu_mask)  # the script, without putting benchmarks/ on every later test's path

FLAGS = cpu_mask.cpu_flags()
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or "cpuid_fault" not in FLAGS
    or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="needs an x86-64 Linux with CPUID faulting and a C compiler",
)


def kernels(native_library, function: str, mask: str) -> str:
    return native_kernels(native_library, function, cpu_mask.masked_environment(mask))


def test_an_avx2_only_cpu_runs_the_avx2_kernels_without_amx(native_library):
    assert "avx2" in FLAGS
    assert kernels(native_library, "EdgeSpecGGUFMatMulPath", "avx2") == "avx2"
    assert kernels(native_library, "EdgeSpecAttentionPath", "avx2") == "avx2"
    assert kernels(native_library, "EdgeSpecGGUFPromptPath", "avx2") == ""


def test_intel_laptop_cores_take_avx_vnni_products_where_cpuid_reports_them(native_library):
    expected = "avxvnni" if "avx_vnni" in FLAGS else "avx2"
    assert kernels(native_library, "EdgeSpecGGUFMatMulPath", "avxvnni") == expected
    assert kernels(native_library, "EdgeSpecGGUFPromptPath", "avxvnni") == ""


def test_without_amx_the_avx512_kernels_read_prompts(native_library):
    unmasked = native_kernels(native_library, "EdgeSpecGGUFMatMulPath", {})
    assert kernels(native_library, "EdgeSpecGGUFMatMulPath", "noamx") == unmasked
    assert kernels(native_library, "EdgeSpecGGUFPromptPath", "noamx") == ""


def run_masked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=cpu_mask.masked_environment("avx2"), capture_output=True, text=True
    )


def test_numpy_sees_the_masked_cpu_and_a_program_keeps_its_own_fault_handler():
    done = run_masked(
        "import faulthandler; faulthandler.enable()\n"
        "from numpy._core._multiarray_umath import __cpu_features__ as f\n"
        "print(f['AVX512F'], f['AVX2'])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    crash = run_masked("import faulthandler; faulthandler.enable(); import ctypes; ctypes.string_at(8)")
    assert crash.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in crash.stderr  # faulthandler's report: the fault reached it


def test_a_real_fault_still_ends_the_process_with_sigsegv():
    done = run_masked("import ctypes; ctypes.string_at(8)")
    assert done.returncode == -signal.SIGSEGV


def test_an_unknown_mask_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, "-c", "pass"],
        env={**cpu_mask.masked_environment("avx2"), "CPUID_MASK": "avx9"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "cpuid_mask: CPUID_MASK=avx9: choose avx2, avxvnni or noamx"
