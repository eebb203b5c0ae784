#!/usr/bin/env python3
"""Interleaved A/B timing of builds of the weight-streaming GEMM (fi-gemm's gemv.cu) in one process.

Separate bench processes drift by several per cent on the lent H200, more than the changes being
compared, so every build is loaded into one process and the builds are timed in turns (CUDA graphs
that cycle through input sets larger than L2, median over rounds).

    python3 tools/ab_gemv.py [--rounds 9] [--cases mm1,mm16,fp8_16,seg512] BUILD ...

BUILD is ``0`` (the source's defaults), ``torch`` (the torch baseline of each case: torch.matmul,
torch._scaled_mm, torch.bmm) or comma-separated switches of gemv.cu without their FI_GEMV_ prefix,
e.g. ``ROLL=0`` or ``ROLL=1,U8=4`` (each is passed as -DFI_GEMV_<NAME>=<value>).

Cases (N = K = 4096 unless named): mm1 / mm4 / mm16 (mm_bf16 at M = 1 / 4 / 16), fp8_1 / fp8_16
(bmm_fp8 e4m3 -> bf16), gw16 (gemm_fp8_nt_groupwise, 1x128 / 128x128 scales, MN-major), seg16 /
seg512 (SegmentGEMMWrapper, LoRA shrink: 8 segments of 16 / 512 rows, 4096 -> 16).

``--build-only`` compiles the modules of the named builds (a kernel cache that can travel to the GPU
machine) and exits. Prints one line per case with each build's median time and its speed-up over
the first build (median of the per-round ratios); ``--json PATH`` writes the same numbers in the
form tools/bench_summary.py renders.
"""

from __future__ import annotations

import sys

import torch

from ab_common import agree, build_only, capture_cycle, measure, parse_builds, parse_switches

NOTE = ("CUDA graphs cycling through input sets of >= 3x L2, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")
N = K = 4096
ALL_CASES = "mm1,mm4,mm16,fp8_1,fp8_16,gw16,seg16,seg512"


def parse_build(build: str) -> dict[str, int] | None:
    """Switches of one build; None for the torch baseline."""
    return None if build == "torch" else parse_switches(build)


def use_build(switches: dict[str, int]) -> None:
    """Make the next fi-gemm call load the module built with `switches`."""
    from fi_gemm.dense import api as dense_api, spec as dense_spec  # noqa: PLC0415
    from fi_gemm.fp8 import groupwise  # noqa: PLC0415
    from fi_gemm.segment import api as seg_api  # noqa: PLC0415

    dense_spec.GEMV_AB = dict(switches)
    dense_spec.gemv_spec.cache_clear()
    for mod in (dense_api, groupwise, seg_api):
        mod.reset_dispatch()


def make_cases(names: list[str], dev):
    """name -> (bytes moved, input sets, fi fn(*set), torch fn(*set))."""
    from fi_core import testing  # noqa: PLC0415
    from fi_core.bench import rotating_inputs  # noqa: PLC0415
    from fi_gemm import SegmentGEMMWrapper, bmm_fp8, gemm_fp8_nt_groupwise, mm_bf16  # noqa: PLC0415
    from fi_gemm.fp8.bench import _torch_baseline, _torch_scales  # noqa: PLC0415
    from fi_gemm.fp8.quant import quantize_fp8_block, quantize_fp8_per_token_group  # noqa: PLC0415

    bf16, f32, e4m3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    out = {}
    for name in names:
        if name in ("mm1", "mm4", "mm16"):
            m = int(name[2:])

            def make(i, m=m):
                return (testing.randn((m, K), bf16, dev, seed=2 * i),
                        testing.randn((N, K), bf16, dev, seed=2 * i + 1, scale=K ** -0.5))
            out[name] = (2.0 * (m * K + N * K + m * N), rotating_inputs(make, dev),
                         lambda a, w: mm_bf16(a, w.T), lambda a, w: torch.matmul(a, w.T))
        elif name in ("fp8_1", "fp8_16"):
            m = int(name[4:])
            sa = torch.tensor([0.5], device=dev)
            sb = torch.tensor([0.02], device=dev)

            def make(i, m=m):
                return (testing.randn((m, K), f32, dev, seed=2 * i).to(e4m3),
                        testing.randn((N, K), f32, dev, seed=2 * i + 1).to(e4m3))
            out[name] = (1.0 * (m * K + N * K) + 2.0 * m * N, rotating_inputs(make, dev),
                         lambda a, w, sa=sa, sb=sb: bmm_fp8(a[None], w.T[None], sa, sb, bf16),
                         lambda a, w, sa=sa, sb=sb: torch._scaled_mm(a, w.T, sa, sb, out_dtype=bf16))
        elif name == "gw16":
            m = 16

            def make(i, m=m):
                a, sa = quantize_fp8_per_token_group(testing.randn((m, K), f32, dev, seed=2 * i),
                                                     scale_major_mode="MN")
                b, sb = quantize_fp8_block(testing.randn((N, K), f32, dev, seed=2 * i + 1),
                                           scale_major_mode="MN")
                return (a, b, sa, sb, *_torch_scales(sa, sb))
            sets = rotating_inputs(make, dev)
            a0, b0, _, _, ta0, tb0 = sets[0]
            base_fn, _ = _torch_baseline(a0, b0, ta0, tb0)
            out[name] = (1.0 * (m * K + N * K) + 2.0 * m * N, sets,
                         lambda a, b, sa, sb, ta, tb: gemm_fp8_nt_groupwise(a, b, sa, sb, scale_major_mode="MN"),
                         lambda a, b, sa, sb, ta, tb, fn=base_fn: fn(a, b, ta, tb))
        elif name in ("seg16", "seg512"):
            segs, rows, d_out = 8, int(name[3:]), 16
            indptr = torch.arange(0, (segs + 1) * rows, rows, device=dev)
            widx = torch.arange(segs, device=dev)
            wrap = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device=dev))

            def make(i, segs=segs, rows=rows, d_out=d_out):
                return (testing.randn((segs * rows, K), bf16, dev, seed=2 * i),
                        testing.randn((segs, d_out, K), bf16, dev, seed=2 * i + 1, scale=K ** -0.5))
            out[name] = (2.0 * (segs * rows * K + segs * d_out * K + segs * rows * d_out),
                         rotating_inputs(make, dev),
                         lambda x, w, segs=segs, indptr=indptr, widx=widx, wrap=wrap: wrap.run(
                             x, w, segs, True, seg_indptr=indptr, weight_indices=widx),
                         lambda x, w, segs=segs, rows=rows: torch.bmm(x.view(segs, rows, K), w.transpose(1, 2)))
        else:
            raise SystemExit(f"unknown case {name!r}; cases: {ALL_CASES}")
    return out


def main() -> int:
    args, builds, names = parse_builds(__doc__, ALL_CASES, parse_build)

    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_gemm.dense import spec as dense_spec  # noqa: PLC0415

        arch = Arch.parse("9.0a")
        bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
        specs = []
        for sw in builds.values():
            if sw is None:
                continue
            use_build(sw)
            specs += [dense_spec.gemv_spec(bf16, bf16, bf16, arch), dense_spec.gemv_spec(e4m3, e4m3, bf16, arch)]
        return build_only(specs)

    dev = torch.device("cuda")
    work = make_cases(names, dev)
    graphs, calls, refs = {}, {}, {}
    for b, sw in builds.items():
        if sw is not None:
            use_build(sw)
        for name, (_bytes, sets, ours, base) in work.items():
            fn = base if sw is None else ours
            got = fn(*sets[0]).float().reshape(-1)  # loads the module outside the capture; torch
            # returns some cases batched ([1, m, n], [segments, rows, n]), so compare flat
            agree(refs, name, b, got, 2e-2, relative=True)  # every build agrees with the first
            graphs[(name, b)], calls[(name, b)] = capture_cycle(fn, sets)
    measure(args, graphs, calls, names, {n: work[n][0] / 1e6 for n in names}, "tb_s", "TB/s", 7,
            "ab_gemv.py", "gemv", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
