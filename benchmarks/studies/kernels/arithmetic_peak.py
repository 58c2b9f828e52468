"""This CPU's arithmetic peaks: the ceiling a prompt read's kernels are measured against.

Reading a long prompt is bound by arithmetic, not by memory: the target's int8 matmul products
(``vpdpbusd``) and float32 attention (``vfmadd231ps``).  How close a kernel runs to what the cores can
retire says whether a faster kernel is left to write, or only other arithmetic (bfloat16 products,
``vdpbf16ps``, at twice float32's rate where the CPU has them, at a cost in fidelity).  Where the CPU has
AMX, its int8 tile product (``tdpbssd``, what ``MatMulGGUF``'s prompt passes run on) is measured too.  Builds
``arithmetic_peak.c`` with gcc and prints, per instruction the CPU has, billions of instructions and of
arithmetic operations (a multiply-add counts two) per second, on one thread and on ``--threads``:

    python benchmarks/studies/kernels/arithmetic_peak.py [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("arithmetic_peak.c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("gcc") is None:
        sys.exit("needs gcc")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "arithmetic_peak"
        subprocess.run(["gcc", "-O2", "-pthread", str(SOURCE), "-o", str(binary)], check=True)
        rows = {}
        for threads in sorted({1, args.threads}):
            out = subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, instructions, ops = line.split("\t")
                rows.setdefault(name, {})[threads] = (float(instructions), float(ops))
    counts = sorted({t for r in rows.values() for t in r})
    print("instruction".ljust(18) + "".join(f"{t} thread(s): G instr/s, GOPS".rjust(34) for t in counts))
    for name, by_threads in rows.items():
        cells = "".join(f"{by_threads[t][0]:>21.2f}, {by_threads[t][1]:>10.0f}" for t in counts)
        print(name.ljust(18) + cells)


if __name__ == "__main__":
    main()
