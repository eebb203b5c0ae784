#!/usr/bin/env python3
"""Interleaved A/B timing of builds of fi-sampling's memory-bound kernels (the cos/sin-cache RoPE
kernel in rope.cu, the RMSNorm register kernels in norm.cu) in one process on the GPU.

Separate bench processes drift by several per cent on the lent H200, more than the changes being
compared, so every build is loaded into one process and the builds are timed in turns (CUDA graphs
that cycle through input sets larger than L2, median over rounds).

    python3 tools/ab_memops.py [--rounds 9] [--cases rope8k,rope256,fadd8k] BUILD ...

BUILD is ``0`` (the sources' defaults), ``copy`` (a torch floor with the case's traffic: in-place
``mul_(1)`` over q and k for RoPE, ``x.mul(1)`` for rmsnorm, ``_foreach_mul_`` over x and the
residual for fused_add_rmsnorm) or ``ROPE=N`` (rope.cu built with FI_ROPE_CACHE_VARIANT=N, which
lists the variants). Session 42 also timed a norm.cu switch for evict-first row stores this way
(x0.998-1.001 on rms8k / fadd8k on an H100, results/h100/memops_ab_session42_norm_evict.json; not
kept): a new norm.cu switch joins SWITCHES as a spec-module attribute.

Cases (bf16): ropeN / ropeNk (in-place apply_rope_with_cos_sin_cache_inplace on N or N x 1024
tokens, 32 q / 8 kv heads, head_dim 128, NeoX, positions uniform in [0, 8192); rope8k is the bench
routine's shape, rope256 a decode step's batch), rmsN / rmsNk (rmsnorm of N rows of 8192),
faddN / faddNk (fused_add_rmsnorm in place, N rows of 8192; fadd8k is the bench routine's shape).

``--build-only`` compiles the modules of the named builds (a kernel cache that can travel to the
GPU machine) and exits. Prints one line per case with each build's median time, its TB/s (bytes
each op must move) and its speed-up over the first build (median of the per-round ratios); ``--json
PATH`` writes the same numbers in the form tools/bench_summary.py renders.
"""

from __future__ import annotations

import re
import sys

import torch

from ab_common import agree, build_only, capture_cycle, measure, parse_builds, switch_build

NOTE = ("CUDA graphs cycling through input sets of >= 3x L2, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")
HQ, HK, D, MAX_POS = 32, 8, 128, 8192
HIDDEN = 8192
ALL_CASES = "rope8k,rope256,rms8k,fadd8k"
SWITCHES = {"ROPE": "CACHE_VARIANT"}


def parse_build(build: str) -> dict[str, int] | None:
    """A build's switches ({} for the defaults), or None for the torch floor."""
    return None if build == "copy" else switch_build(build, SWITCHES)


def use_build(switches: dict[str, int]) -> None:
    """Make the next RoPE call load the module built with `switches`."""
    from fi_sampling.rope import spec as rope_spec  # noqa: PLC0415

    rope_spec.CACHE_VARIANT = switches.get("ROPE")
    rope_spec.rope_spec.cache_clear()


def make_cases(names: list[str], dev):
    """name -> (bytes moved, input sets, kernel fn(*set) returning what to compare, floor fn)."""
    from fi_core import testing  # noqa: PLC0415
    from fi_core.bench import rotating_inputs  # noqa: PLC0415
    from fi_sampling.norm import fused_add_rmsnorm, rmsnorm  # noqa: PLC0415
    from fi_sampling.rope import apply_rope_with_cos_sin_cache_inplace  # noqa: PLC0415
    from fi_sampling.rope.reference import cos_sin_from_positions, rope_frequencies  # noqa: PLC0415

    bf16 = torch.bfloat16
    freqs = rope_frequencies(D, 1.0, 1e4, device=dev)
    cos, sin = cos_sin_from_positions(torch.arange(MAX_POS, device=dev), freqs)
    cache = torch.cat((cos, sin), dim=1).contiguous()
    w = testing.randn((HIDDEN,), bf16, dev, seed=99)
    out = {}
    for name in names:
        m = re.fullmatch(r"(rope|rms|fadd)(\d+)(k?)", name)
        if m is None:
            raise SystemExit(f"unknown case {name!r}; e.g. {ALL_CASES}")
        kind, n = m.group(1), int(m.group(2)) * (1024 if m.group(3) else 1)
        if kind == "rope":
            def make(i, n=n):
                q = testing.randn((n, HQ * D), bf16, dev, seed=3 * i)
                k = testing.randn((n, HK * D), bf16, dev, seed=3 * i + 1)
                pos = torch.randint(0, MAX_POS, (n,), generator=testing.generator(3 * i + 2)).to(dev)
                return pos, q, k

            def run(pos, q, k):
                apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, True)
                return q, k

            def floor(pos, q, k):
                q.mul_(1)
                k.mul_(1)
            moved = 2.0 * n * (HQ + HK) * D * 2 + n * 8 + n * D * 4
        elif kind == "rms":
            def make(i, n=n):
                return (testing.randn((n, HIDDEN), bf16, dev, seed=i),)

            def run(x):
                return (rmsnorm(x, w),)

            def floor(x):
                x.mul(1)
            moved = 2.0 * n * HIDDEN * 2 + HIDDEN * 2
        else:
            def make(i, n=n):
                return (testing.randn((n, HIDDEN), bf16, dev, seed=2 * i),
                        testing.randn((n, HIDDEN), bf16, dev, seed=2 * i + 1))

            def run(x, r):
                fused_add_rmsnorm(x, r, w)
                return x, r

            def floor(x, r):
                torch._foreach_mul_([x, r], 1)
            moved = 4.0 * n * HIDDEN * 2 + HIDDEN * 2
        out[name] = (moved, rotating_inputs(make, dev), run, floor)
    return out


def main() -> int:
    args, builds, names = parse_builds(__doc__, ALL_CASES, parse_build)

    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_sampling.norm import spec as norm_spec  # noqa: PLC0415
        from fi_sampling.rope import spec as rope_spec  # noqa: PLC0415

        specs = [norm_spec.norm_spec(torch.bfloat16, Arch.parse("9.0a"))]
        for sw in builds.values():
            if sw is not None:
                use_build(sw)
                specs.append(rope_spec.rope_spec(torch.bfloat16, Arch.parse("9.0a")))
        return build_only(specs)

    dev = torch.device("cuda")
    work = make_cases(names, dev)
    # the calls work in place: keep a copy of each case's first set to check every build on
    pristine = {name: [t.clone() for t in sets[0]] for name, (_b, sets, _r, _f) in work.items()}
    graphs, calls, refs = {}, {}, {}
    for b, sw in builds.items():
        if sw is not None:
            use_build(sw)
        for name, (_bytes, sets, run, floor) in work.items():
            fn = floor if sw is None else run
            if sw is not None:  # every kernel build must give the first kernel build's result
                got = torch.cat([t.float().flatten() for t in run(*(t.clone() for t in pristine[name]))])
                agree(refs, name, b, got)
            fn(*sets[0])  # loads the module outside the capture
            torch.cuda.synchronize()
            graphs[(name, b)], calls[(name, b)] = capture_cycle(fn, sets)
    measure(args, graphs, calls, names, {n: work[n][0] / 1e6 for n in names}, "tb_s", "TB/s", 8,
            "ab_memops.py", "fi-sampling memory-bound ops", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
