#!/usr/bin/env python3
"""Compile check: build every registered op's representative kernel variants with nvcc for the
given archs (default sm_80 and sm_90a) and fail on ptxas spills or on warning C7510 (wgmma
serialised across a function boundary, which makes Hopper kernels much slower).

    python tools/compile_check.py [--arch 8.0 --arch 9.0a] [--jobs N] [OP ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from fi_core.arch import Arch
from fi_core.cli import collect_specs
from fi_core.jit import build_many


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", default=None)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("ops", nargs="*")
    args = ap.parse_args()
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
        for fn, k in rep["kernels"].items():
            if k.get("spill_stores", 0) or k.get("spill_loads", 0):
                problems.append(f"{s.name}[{s.arch}] {fn}: {k['spill_stores']} B spill stores, "
                                f"{k['spill_loads']} B spill loads")
        for w in rep["warnings"]:
            if "C7510" in w or "serialized" in w:
                problems.append(f"{s.name}[{s.arch}]: {w}")
        regs = max((k.get("registers", 0) for k in rep["kernels"].values()), default=0)
        print(f"  ok  {s.name:<40} {str(s.arch):<8} max {regs} regs, {len(rep['kernels'])} kernel(s)")
    print(f"built/checked in {time.time() - t0:.0f} s")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"{len(specs)} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
