#!/usr/bin/env python3
"""Run fi_gemm.autotune over a list of dense GEMM shapes and report every unit's time per shape
(what the autotuner measured to pick one), beside torch.

    python3 tools/autotune_table.py [--json PATH]

The records go to a private tuning file in a temporary folder (FI_CACHE_DIR's records are not
touched). Each unit is timed by the autotuner itself (fi_gemm.tuning: the call's operands, CUDA
events); torch.matmul / torch._scaled_mm by fi_core.bench.time_fn's eager event loop on the same
operands, for reference only (the bench routines time both sides in CUDA graphs). Session 14's
result file came from this tool's first version, whose torch column was one 20-call event loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from fi_core import testing
from fi_core.bench import time_fn
from fi_gemm import autotune, bmm_fp8, mm_bf16, tuning
from fi_gemm.dense import api

SHAPES = [(128, 14336, 4096), (1024, 4096, 4096), (4096, 4096, 4096), (2048, 14336, 4096),
          (8192, 8192, 8192)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    path = Path(tempfile.mkdtemp()) / "tuning.json"
    tuning._path = lambda name: path  # a private record file
    tuning.forget()
    api.reset_dispatch()
    rows = []
    for m, n, k in SHAPES:
        a = testing.randn((m, k), bf16, dev, seed=1)
        w = testing.randn((n, k), bf16, dev, seed=2, scale=k ** -0.5)
        with autotune():
            mm_bf16(a, w.T)
        torch_us = time_fn(torch.matmul, [(a, w.T)], use_graph=False).median_us
        a8, w8 = a.to(e4m3), w.to(e4m3)
        sa = torch.tensor([1.0], device=dev)
        with autotune():
            bmm_fp8(a8[None], w8.T[None], sa, sa, bf16)
        torch8_us = time_fn(lambda x, y, s: torch._scaled_mm(x, y, s, s, out_dtype=bf16),
                            [(a8, w8.T, sa)], use_graph=False).median_us
        entries = json.loads(path.read_text())["entries"]
        for op, base, key_dtype in (("mm_bf16", torch_us, "bfloat16"), ("bmm_fp8", torch8_us, "float8_e4m3fn")):
            entry = entries[f"{op}|{key_dtype}|{key_dtype}|bfloat16|{m}|{n}|{k}|1"]
            flop = 2.0 * m * n * k
            row = {"op": op, "m": m, "n": n, "k": k, "chosen": entry["config"], "units_us": entry["us"],
                   "torch_us": base}
            rows.append(row)
            units = "  ".join(f"{u} {t:8.2f} ({flop / t / 1e6:6.1f})" for u, t in sorted(entry["us"].items()))
            print(f"{op:8} {m:>5} x {n:>5} x {k:>5}  {units}  torch {base:8.2f} ({flop / base / 1e6:6.1f})"
                  f"  -> {entry['config']}   [us (TFLOP/s)]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
