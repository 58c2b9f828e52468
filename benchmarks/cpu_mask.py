"""Run a command as if this CPU were another kind: without AVX-512 and AMX (``avx2``, or ``avxvnni`` keeping
AVX-VNNI), or without AMX alone (``noamx``), as CPUID tells every engine in it.

Why: the speed of every engine on a CPU depends on the kernels it picks from CPUID, and the kinds of machine
users have (AVX2-only laptops and servers, Intel's laptop cores with AVX-VNNI, AVX-512 without AMX) are not
always at hand.  Our runtime has switches for its own kernels (``EDGE_SPEC_NATIVE_AVX512=0``); ONNX Runtime's
MLAS (under onnxruntime-genai), oneDNN (under OpenVINO GenAI) and numpy have none.  This runs the command with
``benchmarks/cpu_mask/cpuid_mask.c`` preloaded (Linux's CPUID faulting: ``cpuid_fault`` in /proc/cpuinfo), so
that all of them, and every process the command starts, choose the kernels of that kind; llama.cpp, built by
``session_peers.py`` for this machine's instruction sets, gets a build of its own for the masked set
(``models/llamacpp/build-MASK``).

It is this machine's cores, caches and memory running the other kind's instructions, not the other kind's
machine: ratios between engines say whether our kernels hold up on that instruction set; the absolute speeds
and the memory-bound ratios belong to the real machine.

    python benchmarks/cpu_mask.py avx2 -- python benchmarks/spec_peers.py --bundle BUNDLE --peers genai,llamacpp ...
    python benchmarks/cpu_mask.py avx2 --check      # what numpy and our kernels see
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "cpu_mask" / "cpuid_mask.c"
MASKS = ("avx2", "avxvnni", "noamx")
_AVX512 = {
    "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2",
    "avx512_vnni", "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "avx512_vp2intersect",
}  # fmt: skip
_AMX = {"amx_tile", "amx_int8", "amx_bf16", "amx_fp16"}
HIDDEN_FLAGS = {  # /proc/cpuinfo's names of what each mask hides (cpuid_mask.c clears their CPUID bits)
    "avx2": _AVX512 | _AMX | {"avx_vnni"},
    "avxvnni": _AVX512 | _AMX,
    "noamx": _AMX,
}


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags (what the CPU has, whatever a mask makes CPUID say); empty where there are none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def library() -> Path:
    """The preload library, built once per source version with the system's C compiler."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edge-spec" / "cpu_mask"
    built = cache / f"cpuid_mask-{digest}.so"
    if not built.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = built.with_suffix(".partial")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"], check=True)
        partial.rename(built)
    return built


def masked_environment(mask: str) -> dict[str, str]:
    preload = " ".join(filter(None, [str(library()), os.environ.get("LD_PRELOAD", "")]))
    return {**os.environ, "CPUID_MASK": mask, "LD_PRELOAD": preload}


CHECK = """
from numpy._core._multiarray_umath import __cpu_features__ as numpy_features
from edge_spec.native import build
from edge_spec.runtime.model.native_attention import gguf_matmul_path
library = build.required_library_path()
print("numpy: AVX512F", numpy_features["AVX512F"], "AVX512_SPR", numpy_features["AVX512_SPR"],
      "AVX2", numpy_features["AVX2"])
print("edge-spec MatMulGGUF kernels:", gguf_matmul_path(library) if library else "(no native library)")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mask", choices=MASKS)
    parser.add_argument("--check", action="store_true", help="print what numpy and our kernels see, and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args()
    if "cpuid_fault" not in cpu_flags():
        raise SystemExit("this machine has no CPUID faulting (cpuid_fault in /proc/cpuinfo): it cannot be masked")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.check or command == ["--check"]:
        root = Path(__file__).resolve().parents[1]
        command = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r})\n{CHECK}"]
    if not command:
        raise SystemExit("give a command after --, or --check")
    raise SystemExit(subprocess.run(command, env=masked_environment(args.mask)).returncode)


if __name__ == "__main__":
    main()
