#!/usr/bin/env python3
"""Paged prefill 16 x 2048 (page 16, GQA 32/8, head_dim 128, causal, bf16 q) over a bf16 cache and
an fp8 e4m3 one, in turns in one process: fa3 bf16, fa3 e4m3, fa2 e4m3, and fa3 e4m3 A/B builds
(FI_FA3_VARIANT bits; 4096 = no conversion and 8192 = no widening give wrong results and are for
timing only). SCALES=1 adds fa3 / fa2 e4m3 with k_scale 0.8, v_scale 1.25 passed to run() ("fold":
the kernels' epilogues apply v_scale) against run() then out.mul_(1.25) ("mul": the pass over the
output that run() made before session 48). ORDER=1 adds, after those, fa3 e4m3 with k_scale 0.8
alone ("k") and without scales once more ("last"): whether the unscaled row's extra time (sessions
48-50) follows the logit scale or the row's place right after the bf16 row. Prints us and TFLOP/s
per round; writes $OUT/fp8_time.json (default /tmp).

    ROUNDS=3 VARIANTS=4096,8192 SCALES=1 python3 tools/fa3_fp8_time.py
"""
import json
import os

import torch

from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper
from fi_attention.prefill.hopper import spec as hopper_spec
from fi_core.bench import time_fn

HQ, HKV, D, B, L, PS = 32, 8, 128, 16, 2048, 16
BUILDS = [("fa3", torch.bfloat16, None, ""), ("fa3", torch.float8_e4m3fn, None, ""),
          ("fa2", torch.float8_e4m3fn, None, "")]
SCALED = [(b, torch.float8_e4m3fn, None, m) for b in ("fa3", "fa2") for m in ("fold", "mul")]


def main():
    pages_per = L // PS
    indices = torch.randperm(B * pages_per, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    qo = torch.arange(0, (B + 1) * L, L, dtype=torch.int32)
    kvp = torch.arange(0, (B + 1) * pages_per, pages_per, dtype=torch.int32)
    last = torch.full((B,), PS, dtype=torch.int32)
    q = torch.randn(B * L, HQ, D, device="cuda", dtype=torch.bfloat16)
    caches = {torch.bfloat16: torch.randn(B * pages_per, 2, PS, HKV, D, device="cuda", dtype=torch.bfloat16)}
    caches[torch.float8_e4m3fn] = caches[torch.bfloat16].to(torch.float8_e4m3fn)
    flops = 4.0 * L * L * HQ * D * B / 2
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    variants = [int(v) for v in os.environ.get("VARIANTS", "4096,8192").split(",") if v]
    builds = BUILDS + [("fa3", torch.float8_e4m3fn, v, "") for v in variants]
    if os.environ.get("SCALES") == "1":
        builds += SCALED
    if os.environ.get("ORDER") == "1":
        builds += [("fa3", torch.float8_e4m3fn, None, m) for m in ("k", "last")]
    rows = []
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        for backend, kv, variant, mode in builds:
            hopper_spec.VARIANT = variant
            hopper_spec.prefill_sm90_spec.cache_clear()
            w = BatchPrefillWithPagedKVCacheWrapper(workspace, backend=backend)
            w.plan(qo, kvp, indices, last, HQ, HKV, D, PS, causal=True, q_data_type=torch.bfloat16, kv_data_type=kv)
            cache = caches[kv]
            if mode == "fold":
                fn = lambda w=w, cache=cache: w.run(q, cache, k_scale=0.8, v_scale=1.25)  # noqa: E731
            elif mode == "k":
                fn = lambda w=w, cache=cache: w.run(q, cache, k_scale=0.8)  # noqa: E731
            elif mode == "mul":
                fn = lambda w=w, cache=cache: w.run(q, cache, k_scale=0.8).mul_(1.25)  # noqa: E731
            else:
                fn = lambda w=w, cache=cache: w.run(q, cache)  # noqa: E731
            us = time_fn(fn, [()], reps=10, use_graph=False, min_calls_per_replay=4).median_us
            rows.append(dict(round=rnd, backend=backend, kv=str(kv), variant=variant, scales=mode, us=us,
                             tflops=flops / us / 1e6))
            print(f"round {rnd} {backend} {str(kv):22s} variant {variant} {mode or '-':4s}: {us:9.2f} us "
                  f"{flops / us / 1e6:7.1f} TFLOP/s", flush=True)
    hopper_spec.VARIANT = None
    hopper_spec.prefill_sm90_spec.cache_clear()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "fp8_time.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
