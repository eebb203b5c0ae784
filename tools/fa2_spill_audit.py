#!/usr/bin/env python3
"""ptxas spills of every fa2 prefill kernel variant, against each spec's declared spill budget.

The compile check (tools/compile_check.py) builds one representative module per op; the fa2 kernel
has many more variants (dtype, head dims, paging, custom mask, soft cap, ALiBi, RoPE, fp8 KV), and
register allocation near 255 registers moves with each of them. This compiles each variant's
device code with the module's own nvcc command (fi_core.jit.build.compile_command: the same
flags, includes and defines) and reports the spill bytes of the attention kernel beside the
spec's ``spill_budget``. It needs nvcc, not a GPU.

    python3 tools/fa2_spill_audit.py [--arch 8.0 --arch 9.0a] [--jobs N] [--head-dims 64,128,256,192x128]
                                     [--match SUBSTRING]

Head dims are d (q/k and v alike) or QKxVO; 192x128 is ragged only (no paged variants).

Exit status 1 when a variant spills beyond its budget (listed at the end).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fi_core.arch import Arch
from fi_core.jit.build import compile_command, parse_ptxas, spill_problems
from fi_core.jit.spec import find_nvcc
from fi_attention.prefill.spec import fa2_spec

KERNEL = "prefill_fa2_kernel"


def variants(arch: Arch, head_dims):
    """Every fa2_spec combination the launcher can ask for at these (qk, vo) head dims (bf16 q;
    fp16 allocates the same way), without duplicates."""
    seen = {}
    for (dqk, dvo), paged, flag, fp8, softcap in itertools.product(
            head_dims, (False, True), (None, "custom_mask", "alibi", "rope"), (False, True), (False, True)):
        if paged and dqk != dvo:
            continue
        kw = {flag: True} if flag else {}
        if fp8:
            kw["kv_dtype"] = torch.float8_e4m3fn
        s = fa2_spec(torch.bfloat16, dqk, dvo, paged, arch, softcap=softcap, **kw)
        seen.setdefault(s.name, s)
    return list(seen.values())


def ptxas_kernels(spec, nvcc: Path, tmp: str) -> dict[str, dict]:
    """The ptxas report of the spec's module, per kernel (parse_ptxas)."""
    obj = Path(tmp) / f"{spec.name}_{spec.arch.sm}.o"
    r = subprocess.run(compile_command(spec, spec.sources[0], obj, nvcc), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{spec.name} [{spec.arch}]: nvcc failed:\n{r.stderr[-2000:]}")
    return parse_ptxas(r.stdout + r.stderr)["kernels"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", default=None)
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--head-dims", default="64,128,256,192x128")
    ap.add_argument("--match", default="", help="only variants whose module name contains this")
    args = ap.parse_args()
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found")
        return 1
    archs = [Arch.parse(a) for a in (args.arch or ["8.0", "9.0a"])]
    head_dims = [tuple(int(v) for v in x.split("x")) if "x" in x else (int(x), int(x))
                 for x in args.head_dims.split(",")]
    specs = [s for a in archs for s in variants(a, head_dims) if args.match in s.name]
    print(f"{len(specs)} fa2 variants for {' '.join(a.sm for a in archs)}", flush=True)
    over = []
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(args.jobs) as ex:
        for s, kernels in zip(specs, ex.map(lambda s: ptxas_kernels(s, nvcc, tmp), specs)):
            k = next(v for fn, v in kernels.items() if KERNEL in fn)
            found, allowed = spill_problems(s, kernels)
            over += found
            mark = " OVER" if found else (" within budget" if allowed else "")
            print(f"  {s.name:<48} {s.arch.sm:<7} {k.get('registers', 0):3d} regs  spill "
                  f"{k.get('spill_stores', 0):3d} / {k.get('spill_loads', 0):3d} B  budget {s.spill_budget:3d}{mark}",
                  flush=True)
    if over:
        print("over budget:\n  " + "\n  ".join(over))
        return 1
    print("every variant within its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
