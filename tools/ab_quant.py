#!/usr/bin/env python3
"""Interleaved A/B timing of builds of fp4_quantize's kernel (fi_gemm/fp4/quant.cu) in one process
on the GPU, builds timed in turns (CUDA graphs cycling through input sets larger than L2, median
over rounds), with a bf16 copy of the same input (read k x 2 bytes, write as many) as the floor.

    python3 tools/ab_quant.py [--rounds 9] [--cases q4096,q16384] BUILD ...

BUILD is ``0`` (the sources' defaults), ``NAME=V`` (quant.cu built with FI_FP4_QUANT_NAME = V;
several joined by commas) or ``copy``. quant.cu has no such switch now: session 44's ``EPT=N``
(scale entries per thread) and ``BITS=1`` (the e2m1 code from the float's bits) come with
benchmarks/experiments/session44_fp4_quant_bits_and_ept.diff applied; a switch the source does
not read is refused (torch's copy of the input: the bandwidth reference).
Cases: ``qN`` = NVFP4 of N rows x 4096 bf16, ``qxN`` = MXFP4 of the same.

One line per case: each build's median, its TB/s (input read, codes and scales written; the copy
counted by its own bytes would be higher: its TB/s column uses the same byte count, so it reads
as "how fast this much traffic could go") and its speed-up over the first build; ``--json PATH``
writes the numbers. ``--build-only`` compiles the builds' modules and exits.
"""

from __future__ import annotations

import re
import sys

import torch

from ab_common import agree, build_only, capture_cycle, measure, parse_builds, parse_switches

NOTE = ("CUDA graphs cycling through input sets of >= 3x L2, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")
ALL_CASES = "q4096,q16384,qx4096"


def use_build(sw: dict) -> None:
    from fi_gemm.fp4 import api, spec  # noqa: PLC0415

    src = (spec._HERE / "quant.cu").read_text()
    for k in sw:
        if f"FI_FP4_QUANT_{k}" not in src:
            raise SystemExit(f"quant.cu does not read FI_FP4_QUANT_{k}: apply the experiment patch that adds it")
    spec.QUANT_AB.clear()
    spec.QUANT_AB.update(sw)
    api.reset_dispatch()


def main() -> int:
    args, builds, names = parse_builds(__doc__, ALL_CASES, lambda b: b if b == "copy" else parse_switches(b))
    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_gemm.fp4.spec import quant_spec  # noqa: PLC0415

        specs = []
        for sw in builds.values():
            if isinstance(sw, dict):
                use_build(sw)
                specs.append(quant_spec(Arch.parse("9.0a")))
        use_build({})
        return build_only(specs)

    from fi_core import testing  # noqa: PLC0415
    from fi_core.bench import rotating_inputs  # noqa: PLC0415
    from fi_gemm import fp4_quantize  # noqa: PLC0415

    dev = torch.device("cuda")
    work = {}
    for name in names:
        mt = re.fullmatch(r"(q|qx)(\d+)", name)
        if mt is None:
            raise SystemExit(f"unknown case {name!r}; e.g. {ALL_CASES}")
        mx, rows, k = mt.group(1) == "qx", int(mt.group(2)), 4096

        def make(i, rows=rows, k=k):
            x = testing.randn((rows, k), torch.bfloat16, dev, seed=i)
            return x, (448 * 6 / x.float().abs().amax()).reshape(1)
        block = 32 if mx else 16
        work[name] = (rows * k * (2 + 0.5 + 1 / block), rotating_inputs(make, dev), block, mx)
    graphs, calls, refs = {}, {}, {}
    for b, sw in builds.items():
        if isinstance(sw, dict):
            use_build(sw)
        for name, (_bytes, sets, block, mx) in work.items():
            if sw == "copy":
                def fn(x, gs):
                    return x.clone()
            else:
                def fn(x, gs, block=block, mx=mx):
                    return fp4_quantize(x, gs, block, mx)
                q, sf = fn(*sets[0])
                agree(refs, name, b, torch.cat([q.flatten(), sf.flatten()]))  # every build: the same bytes
            fn(*sets[0])
            torch.cuda.synchronize()
            graphs[(name, b)], calls[(name, b)] = capture_cycle(fn, sets)
    use_build({})
    measure(args, graphs, calls, names, {n: work[n][0] / 1e6 for n in names}, "tb_s", "TB/s", 6,
            "ab_quant.py", "fp4_quantize", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
