#!/usr/bin/env python3
"""Interleaved A/B timing of builds of the cos/sin-cache RoPE kernel (fi-sampling's rope.cu) in one
process on the GPU.

Separate bench processes drift by several per cent on the lent H200, more than the changes being
compared, so every build is loaded into one process and the builds are timed in turns (CUDA graphs
that cycle through input sets larger than L2, median over rounds).

    python3 tools/ab_rope.py [--rounds 9] [--cases cache8k,cache256] BUILD ...

BUILD is ``0`` (the source's default), ``V=N`` (the module built with FI_ROPE_CACHE_VARIANT=N; rope.cu
lists the variants) or ``copy``: torch's in-place ``mul_(1)`` over the same q and k, the same bytes
read and written in place without a cache row: a floor for the in-place traffic on this GPU.

Cases (32 q / 8 kv heads, head_dim 128, bf16, NeoX, positions uniform in [0, 8192), in place):
cache8k (8192 tokens: the apply_rope_with_cos_sin_cache_inplace bench routine's shape), cache256
(256 tokens: a decode step's batch).

``--build-only`` compiles the modules of the named builds (a kernel cache that can travel to the
GPU machine) and exits. Prints one line per case with each build's median time, its TB/s (q and k
read and written once, plus positions and cache rows) and its speed-up over the first build (median
of the per-round ratios); ``--json PATH`` writes the same numbers in the form
tools/bench_summary.py renders.
"""

from __future__ import annotations

import sys

import torch

from ab_common import arg_parser, build_only, measure

NOTE = ("CUDA graphs cycling through input sets of >= 3x L2, builds timed in turns; "
        "paired_speedup = median over rounds of t(first build) / t(build)")
HQ, HK, D, MAX_POS = 32, 8, 128, 8192
ALL_CASES = "cache8k,cache256"


def parse_build(build: str) -> int | None | str:
    """The cache variant of one build: None for the source's default, "copy" for the floor."""
    if build in ("0", "copy"):
        return None if build == "0" else "copy"
    key, _, val = build.partition("=")
    if key.upper() != "V" or not val.isdigit():
        raise SystemExit(f"build {build!r}: expected 0, copy or V=N")
    return int(val)


def use_build(variant: int | None) -> None:
    """Make the next fi-sampling RoPE call load the module of `variant`."""
    from fi_sampling.rope import spec as rope_spec  # noqa: PLC0415

    rope_spec.CACHE_VARIANT = variant
    rope_spec.rope_spec.cache_clear()


def make_cases(names: list[str], dev):
    """name -> (bytes moved, input sets)."""
    from fi_core import testing  # noqa: PLC0415
    from fi_core.bench import rotating_inputs  # noqa: PLC0415

    out = {}
    for name in names:
        if not name.startswith("cache") or not name[5:].rstrip("k").isdigit():
            raise SystemExit(f"unknown case {name!r}; cases: {ALL_CASES}")
        nnz = int(name[5:].rstrip("k")) * (1024 if name.endswith("k") else 1)

        def make(i, nnz=nnz):
            q = testing.randn((nnz, HQ * D), torch.bfloat16, dev, seed=3 * i)
            k = testing.randn((nnz, HK * D), torch.bfloat16, dev, seed=3 * i + 1)
            pos = torch.randint(0, MAX_POS, (nnz,), generator=testing.generator(3 * i + 2)).to(dev)
            return pos, q, k
        moved = 2.0 * nnz * (HQ + HK) * D * 2 + nnz * 8 + nnz * D * 4
        out[name] = (moved, rotating_inputs(make, dev))
    return out


def main() -> int:
    args = arg_parser(__doc__, rounds=9, cases=ALL_CASES, warmup_s=2.0).parse_args()
    builds = {b: parse_build(b) for b in args.builds}
    names = args.cases.split(",")

    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415
        from fi_sampling.rope import spec as rope_spec  # noqa: PLC0415

        specs = []
        for v in builds.values():
            if v != "copy":
                use_build(v)
                specs.append(rope_spec.rope_spec(torch.bfloat16, Arch.parse("9.0a")))
        return build_only(specs)

    from fi_sampling.rope import apply_rope_with_cos_sin_cache_inplace  # noqa: PLC0415
    from fi_sampling.rope.reference import cos_sin_from_positions, rope_frequencies  # noqa: PLC0415

    dev = torch.device("cuda")
    freqs = rope_frequencies(D, 1.0, 1e4, device=dev)
    cos, sin = cos_sin_from_positions(torch.arange(MAX_POS, device=dev), freqs)
    cache = torch.cat((cos, sin), dim=1).contiguous()
    work = make_cases(names, dev)
    # the calls are in place: keep a copy of each case's first set to check every build on
    pristine = {name: [t.clone() for t in sets[0]] for name, (_bytes, sets) in work.items()}
    graphs, calls, refs = {}, {}, {}
    for b, v in builds.items():
        if v != "copy":
            use_build(v)
        for name, (_bytes, sets) in work.items():
            if v == "copy":
                def fn(pos, q, k):
                    q.mul_(1)
                    k.mul_(1)
            else:
                def fn(pos, q, k):
                    apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cache, True)
                # every kernel build must give the first kernel build's result on fresh inputs
                pos, q, k = (t.clone() for t in pristine[name])
                fn(pos, q, k)
                got = torch.cat((q.float().flatten(), k.float().flatten()))
                torch.cuda.synchronize()
                if name in refs:
                    err = (got - refs[name]).abs().max().item()
                    if err != 0:
                        raise SystemExit(f"build {b} differs from the first kernel build on {name}: {err:.3e}")
                else:
                    refs[name] = got
            fn(*sets[0])  # loads the module outside the capture
            torch.cuda.synchronize()
            k = -(-max(20, len(sets)) // len(sets)) * len(sets)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(k):
                    fn(*sets[i % len(sets)])
            graphs[(name, b)], calls[(name, b)] = g, k
    measure(args, graphs, calls, names, {n: work[n][0] / 1e6 for n in names}, "tb_s", "TB/s", 8,
            "ab_rope.py", "rope cos/sin cache", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
