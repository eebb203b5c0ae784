#!/usr/bin/env python3
"""Interleaved A/B timing of mm_fp4's paths and builds of its FP4 weight-streaming kernel
(fi_gemm/fp4/gemv_fp4.cu) in one process on the GPU, builds timed in turns (CUDA graphs cycling
through input sets larger than L2, median over rounds), with torch's bf16 GEMM on bf16 copies of
the same weights as the floor a Hopper deployment without FP4 would run.

    python3 tools/ab_fp4.py [--rounds 9] [--cases m1,m4,m16] BUILD ...

BUILD is ``0`` (the sources' defaults), ``U1=N`` / ``U2=N`` (gemv_fp4.cu built with
FI_GEMV_FP4_U1 / _U2 = N: K steps in flight per warp at M <= 8 / M <= 16), ``F16=0|1`` (its
NVFP4 expansion: bf16 tables or fp16 bit placement), several joined by commas; ``dequant`` (the
dequantise + bf16 GEMM path by name) or ``bf16`` (torch.matmul on bf16 copies).
Cases: ``mN`` = NVFP4, M = N tokens, N = K = 4096; ``mxN`` the same in MXFP4; ``wN`` =
NVFP4, M = N, N = 14336, K = 4096 (an MLP up projection).

``--build-only`` compiles the builds' modules and exits. One line per case: each build's median,
its TB/s (the packed operands' bytes and the output, as the bench routine counts them) and its
speed-up over the first build (median of per-round ratios); ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import re
import sys

import torch

from ab_common import agree, build_only, capture_cycle, measure, parse_builds, switch_build

NOTE = ("CUDA graphs cycling through input sets of >= 3x L2, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")
ALL_CASES = "m1,m4,m16"
SWITCHES = ("U1", "U2", "F16")


def parse_build(build: str):
    return switch_build(build, SWITCHES, ("dequant", "bf16"))


def use_build(sw: dict) -> None:
    from fi_gemm.fp4 import api, spec  # noqa: PLC0415

    spec.GEMV_FP4_AB.clear()
    spec.GEMV_FP4_AB.update(sw)
    api.reset_dispatch()


def make_cases(names: list[str], dev):
    """name -> (bytes, input sets, run(kind, *set) -> output)."""
    from fi_core import testing  # noqa: PLC0415
    from fi_core.bench import rotating_inputs  # noqa: PLC0415
    from fi_gemm import fp4_quantize  # noqa: PLC0415
    from fi_gemm.fp4.reference import dequantize_fp4  # noqa: PLC0415

    out = {}
    for name in names:
        mt = re.fullmatch(r"(m|mx|w)(\d+)", name)
        if mt is None:
            raise SystemExit(f"unknown case {name!r}; e.g. {ALL_CASES},mx1,w16")
        kind, m = mt.group(1), int(mt.group(2))
        n, k = (14336 if kind == "w" else 4096), 4096
        mx = kind == "mx"
        block = 32 if mx else 16

        def make(i, m=m, n=n, k=k, mx=mx, block=block):
            x = testing.randn((m, k), torch.float32, dev, seed=2 * i)
            w = testing.randn((n, k), torch.float32, dev, seed=2 * i + 1)
            if mx:
                (a, sa), (b, sb), alpha = fp4_quantize(x, None, 32, True), fp4_quantize(w, None, 32, True), None
            else:
                gx, gw = (448 * 6 / x.abs().amax()).reshape(1), (448 * 6 / w.abs().amax()).reshape(1)
                (a, sa), (b, sb), alpha = fp4_quantize(x, gx), fp4_quantize(w, gw), (1 / (gx * gw)).float()
            xb = dequantize_fp4(a, sa, block, mx, "128x4")
            xb = (xb * alpha if alpha is not None else xb).to(torch.bfloat16)
            wb = dequantize_fp4(b, sb, block, mx, "128x4").to(torch.bfloat16)
            return a, b, sa, sb, alpha, xb, wb
        moved = (m + n) * k * (0.5 + 1 / block) + 2.0 * m * n
        out[name] = (moved, rotating_inputs(make, dev), block, mx)
    return out


def main() -> int:
    args, builds, names = parse_builds(__doc__, ALL_CASES, parse_build)
    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_gemm.fp4.spec import dequant_spec, gemv_fp4_spec  # noqa: PLC0415

        specs = [dequant_spec(Arch.parse("9.0a"))]
        for sw in builds.values():
            if isinstance(sw, dict):
                use_build(sw)
                specs.append(gemv_fp4_spec(torch.bfloat16, Arch.parse("9.0a")))
        use_build({})
        return build_only(specs)

    from fi_gemm import mm_fp4  # noqa: PLC0415

    dev = torch.device("cuda")
    work = make_cases(names, dev)
    graphs, calls, refs = {}, {}, {}
    for b, sw in builds.items():
        if isinstance(sw, dict):
            use_build(sw)
        for name, (_bytes, sets, block, mx) in work.items():
            if sw == "bf16":
                def fn(a, b_, sa, sb, alpha, xb, wb):
                    return xb @ wb.T
            else:
                be = "dequant_bf16" if sw == "dequant" else "auto"

                def fn(a, b_, sa, sb, alpha, xb, wb, be=be, block=block, mx=mx):
                    return mm_fp4(a, b_.T, sa, sb.T, alpha, block_size=block, use_nvfp4=not mx, backend=be)
            got = fn(*sets[0]).float()  # outside the capture: loads modules, creates cuBLAS's handle
            if sw != "bf16":  # every mm_fp4 build must agree with the first (same math, other order)
                agree(refs, name, b, got, tol=1e-2, relative=True)
            torch.cuda.synchronize()
            graphs[(name, b)], calls[(name, b)] = capture_cycle(fn, sets)
    use_build({})
    measure(args, graphs, calls, names, {n: work[n][0] / 1e6 for n in names}, "tb_s", "TB/s", 6,
            "ab_fp4.py", "mm_fp4", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
