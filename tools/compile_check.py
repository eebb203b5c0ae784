#!/usr/bin/env python3
"""Compile check: build every registered op's representative kernel variants with nvcc for the
given archs (default sm_80 and sm_90a) and fail on ptxas spills or on warning C7510 (wgmma
serialised across a function boundary, which makes Hopper kernels much slower). A spec may declare
a ``spill_budget`` (bytes) where a measurement showed the spilling build faster than the
spill-free one; spills up to it are reported, not failed.

ptxas does not always warn: where paths with different wgmma groups in flight merge, it serialises
every wgmma of the kernel silently (a fa3 prefill variant ran 30 % slower that way, session 15).
So the SASS of every sm_90a module is read too (cuobjdump, from the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels in requirements-dev.txt): a CUTLASS/CuTe module must contain wgmma
(HGMMA / QGMMA), and a kernel with as many wgmma waits (WARPGROUP.DEPBAR) as wgmma instructions
is reported as serialised.

    python tools/compile_check.py [--arch 8.0 --arch 9.0a] [--jobs N] [--sass auto|require|off] [OP ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fi_core.arch import Arch
from fi_core.cli import collect_specs
from fi_core.jit import build_many
from fi_core.jit.build import spill_problems
from fi_core.jit.cache import MODULE


_GMMA = re.compile(r"\b[HQIB]GMMA\.")
_WAIT = "WARPGROUP.DEPBAR"


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH or from the nvidia-cuda-cuobjdump wheel (nvidia/cu*/bin)."""
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia  # noqa: PLC0415 (a namespace package of the NVIDIA wheels)
    except ImportError:
        return None
    for base in nvidia.__path__:
        for cand in sorted(Path(base).glob("cu*/bin/cuobjdump")):
            return str(cand)
    return None


def sass_wgmma(cuobjdump: str, lib: Path) -> dict[str, tuple[int, int]]:
    """Per kernel of a module's SASS: (wgmma instructions, wgmma waits)."""
    env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, check=True,
                         env=env).stdout
    return parse_sass_wgmma(out)


def parse_sass_wgmma(sass: str) -> dict[str, tuple[int, int]]:
    """(wgmma instructions, wgmma waits) per ``Function :`` section of cuobjdump -sass output."""
    counts: dict[str, list[int]] = {}
    cur = None
    for line in sass.splitlines():
        if "Function :" in line:
            cur = counts.setdefault(line.split("Function :", 1)[1].strip(), [0, 0])
        elif cur is not None:
            if _GMMA.search(line):
                cur[0] += 1
            elif _WAIT in line:
                cur[1] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


def sass_problems(spec, counts: dict[str, tuple[int, int]]) -> tuple[list[str], int]:
    """Problems in an sm_90a module's SASS (``counts`` from sass_wgmma), and its wgmma count."""
    problems = []
    for fn, (gmma, waits) in counts.items():
        if gmma >= 4 and waits >= gmma:
            problems.append(f"{spec.name}[{spec.arch}] {fn[:80]}: wgmma serialised in SASS "
                            f"({gmma} wgmma, {waits} waits)")
    total = sum(g for g, _ in counts.values())
    if spec.cutlass and total == 0:
        problems.append(f"{spec.name}[{spec.arch}]: a CUTLASS/CuTe module for sm_90a without wgmma in its SASS")
    return problems, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--sass", choices=("auto", "require", "off"), default="auto",
                    help="SASS check of sm_90a modules: auto skips it without cuobjdump, require fails")
    ap.add_argument("ops", nargs="*")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump() if args.sass != "off" else None
    if args.sass == "require" and cuobjdump is None:
        print("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
        return 1
    if args.sass == "auto" and cuobjdump is None:
        print("SASS check skipped: cuobjdump not found")
    archs = [Arch.parse(a) for a in (args.arch or ["8.0", "9.0a"])]
    specs = collect_specs(archs, args.ops)
    # A Hopper-only variant is declared only for sm_90a by its op (specs(arch) returns [] elsewhere).
    print(f"compile check: {len(specs)} module(s) for {' '.join(map(str, archs))}", flush=True)
    t0 = time.time()
    dirs = build_many(specs, jobs=args.jobs)
    problems = []
    for s, d in zip(specs, dirs):
        meta = json.loads((d / "meta.json").read_text())
        rep = meta["ptxas"]
        found, allowed = spill_problems(s, rep["kernels"])
        problems += found
        for w in rep["warnings"]:
            if "C7510" in w or "serialized" in w:
                problems.append(f"{s.name}[{s.arch}]: {w}")
        regs = max((k.get("registers", 0) for k in rep["kernels"].values()), default=0)
        extra = ""
        if cuobjdump is not None and str(s.arch) == "sm_90a":
            found, gmma = sass_problems(s, sass_wgmma(cuobjdump, d / MODULE))
            problems += found
            extra = f", {gmma} wgmma in SASS" if gmma else ""
        extra += f", {allowed}" if allowed else ""
        print(f"  ok  {s.name:<40} {str(s.arch):<8} max {regs} regs, {len(rep['kernels'])} kernel(s){extra}")
    print(f"built/checked in {time.time() - t0:.0f} s")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"{len(specs)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
