#!/usr/bin/env python3
"""Interleaved A/B timing of fa3 prefill kernel builds in one process on the GPU.

Separate bench processes drift by several per cent on the lent H200 (clocks, power), more than the
changes being compared. Here every build of the kernel is loaded into one process and the builds
are timed in turns (round-robin, CUDA graphs of a few launches, median over rounds), so drift hits
them alike.

    python3 tools/ab_fa3.py [--rounds 7] [--cases single8k,single16k,ragged,paged] BUILD ...

Cases (GQA 32/8, bf16, causal unless named full): single2k / single4k / single8k / single16k, full4k,
single4k_d256 (head_dim 256), single4k_d64 / single16k_d64 (head_dim 64), ragged (16 x 2048),
paged (the same batch, page 16, pages in random order), paged_seq (page 16, pages in order),
paged128 (page 128, random order), paged128_seq (page 128 in order), paged128_ragged_layout (page
128, pages in order, K and V in two tensors: ragged's addresses), paged_e4m3 (paged over an fp8
e4m3 cache, scales 1), paged_d256 (paged at head_dim 256; the KV tile is 80 keys there), mask4k /
mask4k_d64 / mask4k_d256 (single L=4096 under a random packed custom mask of density 1/2, not
causal: the custom_mask_prefill routine's case), mask4k_cap (mask4k at head_dim 128 with
logits_soft_cap 50: the mask + soft-cap module), paged_cap (paged with logits_soft_cap 50: the
paged causal soft-cap module).

BUILD is an integer (the current source with FI_FA3_VARIANT=N, 0 = the default), ``mc`` / ``nomc``
(the default with / without K/V multicast, whatever FI_FA3_MULTICAST says; under its default,
auto, build 0 takes multicast on the cases of at least MULTICAST_MIN_FLOPS) or a path to
another prefill_sm90.cu (e.g. an older commit's, unpacked with ``git show``). ``--build-only``
compiles the modules the named cases need (for a kernel cache that travels to the GPU machine)
and exits. Prints one line per case with the median time of each build and its speed-up over the
first build (median of the per-round ratios); ``--json PATH`` writes the same numbers in the form
tools/bench_summary.py renders (``--label`` says what the builds are).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
from pathlib import Path

import torch

from ab_common import arg_parser, build_only, capture_checked, measure

HQ, HKV, D = 32, 8, 128
SOFTCAP = 50.0  # logits_soft_cap of the *_cap cases
NOTE = ("fixed inputs, CUDA graphs of 5 launches, builds timed in turns; paired_speedup = median over "
        "rounds of t(first build) / t(build)")


def spec_factory(build: str):
    """A replacement for hopper.prefill_sm90_spec that returns the given build's module spec."""
    from fi_attention.prefill.hopper import spec as hs  # noqa: PLC0415

    raw = hs.prefill_sm90_spec.__wrapped__

    def build_spec(variant, *args, **kw):
        old, hs.VARIANT = hs.VARIANT, variant
        try:
            return raw(*args, **kw)
        finally:
            hs.VARIANT = old

    if build in ("mc", "nomc"):  # the default kernel with / without K/V multicast (FI_FA3_MULTICAST)
        return lambda *args, **kw: build_spec(None, *args, **{**kw, "multicast": build == "mc"})
    if build.isdigit():
        return lambda *args, **kw: build_spec(int(build) or None, *args, **kw)
    path = Path(build).resolve()
    tag = "ab" + hashlib.sha1(path.read_bytes()).hexdigest()[:8]  # same on every machine
    return lambda *args, **kw: _other(build_spec(None, *args, **kw), tag, path)


def _other(spec, tag, path):
    """``spec`` with another source file, under its own module name."""
    return dataclasses.replace(spec, name=f"{spec.name}_{tag}", sources=(path,))


def specs_for(build: str, arch, names) -> list:
    """The modules the named cases load for one build."""
    make = spec_factory(build)
    bf16 = torch.bfloat16
    need = {"full": any(n.startswith("full") for n in names),
            "causal": any(n.startswith("single") and _head_dim(n) == D or n == "ragged" for n in names),
            "paged": any(n.startswith("paged") and not n.endswith(("_cap", "_e4m3", "_d256")) for n in names),
            "paged_cap": "paged_cap" in names, "paged_e4m3": "paged_e4m3" in names,
            "paged_d256": "paged_d256" in names}
    other_dims = sorted({_head_dim(n) for n in names if not n.startswith(("mask", "paged"))} - {D})
    mask_dims = sorted({_head_dim(n) for n in names if n.startswith("mask") and not n.endswith("_cap")})
    mask_cap = any(n.startswith("mask") and n.endswith("_cap") for n in names)
    from fi_core import knobs  # noqa: PLC0415

    # every case is GQA 32/8: head_dim D runs the multicast module when it is on, and under
    # FI_FA3_MULTICAST=auto for the long cases (both modules are built then)
    mode = knobs.fa3_multicast()
    mcs = [True] if build == "mc" or (build != "nomc" and mode) else \
        [False] if build == "nomc" or mode is False else [False, True]
    return ([make(bf16, D, True, arch, multicast=mc) for mc in mcs] * need["causal"]
            + [make(bf16, D, False, arch, multicast=mc) for mc in mcs] * need["full"]
            + [make(bf16, D, True, arch, paged=True, multicast=mc) for mc in mcs] * need["paged"]
            + [make(bf16, D, True, arch, paged=True, softcap=True)] * need["paged_cap"]
            + [make(bf16, D, True, arch, paged=True, kv_dtype=torch.float8_e4m3fn)] * need["paged_e4m3"]
            + [make(bf16, 256, True, arch, paged=True)] * need["paged_d256"]
            + [make(bf16, d, True, arch) for d in other_dims]
            + [make(bf16, d, False, arch, custom_mask=True) for d in mask_dims]
            + [make(bf16, D, False, arch, custom_mask=True, softcap=True)] * mask_cap)


def _head_dim(name: str) -> int:
    """single4k_d256 -> 256, single4k_d64 -> 64; every other case runs head_dim D."""
    m = re.search(r"_d(\d+)$", name)
    return int(m.group(1)) if m else D


def cases(names, dev):
    """name -> (flops, fn(run_ragged, run_paged)) with inputs allocated once."""
    from fi_core import testing  # noqa: PLC0415

    out = {}
    i32 = dict(dtype=torch.int32, device=dev)
    bf16 = torch.bfloat16
    for name in names:
        # single4k_d256 / single4k_d64 / single16k_d64: head_dim 256 / 64
        singles = {"single2k": 2048, "single4k": 4096, "single8k": 8192, "single16k": 16384, "full4k": 4096,
                   "single4k_d256": 4096, "single4k_d64": 4096, "single16k_d64": 16384}
        if name in singles:
            L = singles[name]
            d = _head_dim(name)
            causal = not name.startswith("full")
            q = testing.randn((L, HQ, d), bf16, dev, seed=1)
            k = testing.randn((L, HKV, d), bf16, dev, seed=2)
            v = testing.randn((L, HKV, d), bf16, dev, seed=3)
            o = torch.empty_like(q)

            def fn(rr, rp, q=q, k=k, v=v, o=o, L=L, causal=causal, d=d):
                rr(q, k, v, None, None, o, None, causal=causal, sm_scale=d ** -0.5, max_qo_len=L, batch_size=1)
            flops = 4.0 * L * L * HQ * d / (2 if causal else 1)
        elif name in ("ragged", "paged", "paged_seq", "paged128", "paged128_seq", "paged128_ragged_layout",
                      "paged_cap", "paged_e4m3", "paged_d256"):
            # paged: page 16, pages in random order; paged_seq: page 16 in order; paged128: page
            # 128 in random order (one box per tile half, as ragged), paged128_seq in order;
            # paged128_ragged_layout: page 128 in order with K and V in two tensors: the bytes and
            # addresses of the ragged case
            batch, L, page = 16, 2048, 128 if name.startswith("paged128") else 16
            d = _head_dim(name)
            q = testing.randn((batch * L, HQ, d), bf16, dev, seed=4)
            o = torch.empty_like(q)
            qo = torch.arange(batch + 1, **i32) * L
            if name == "ragged":
                k = testing.randn((batch * L, HKV, D), bf16, dev, seed=5)
                v = testing.randn((batch * L, HKV, D), bf16, dev, seed=6)

                def fn(rr, rp, q=q, k=k, v=v, o=o, qo=qo, L=L, batch=batch):
                    rr(q, k, v, qo, qo, o, None, causal=True, sm_scale=D ** -0.5, max_qo_len=L, batch_size=batch)
            else:
                pages = batch * L // page
                if name == "paged128_ragged_layout":
                    kc = testing.randn((pages, page, HKV, D), bf16, dev, seed=5)
                    vc = testing.randn((pages, page, HKV, D), bf16, dev, seed=6)
                else:
                    cache = testing.randn((pages, 2, page, HKV, d), bf16, dev, seed=7)
                    if name == "paged_e4m3":
                        cache = cache.to(torch.float8_e4m3fn)
                    kc, vc = cache[:, 0], cache[:, 1]
                idx = (torch.arange(pages) if name in ("paged_seq", "paged128_seq", "paged128_ragged_layout")
                       else torch.randperm(pages, generator=testing.generator(0))).to(**i32)
                kvp = torch.arange(batch + 1, **i32) * (L // page)
                last = torch.full((batch,), page, **i32)

                cap = SOFTCAP if name.endswith("_cap") else None

                def fn(rr, rp, q=q, kc=kc, vc=vc, o=o, qo=qo, kvp=kvp, idx=idx, last=last, L=L, batch=batch, page=page,
                       cap=cap, d=d):
                    rp(q, kc, vc, qo, kvp, idx, last, o, None, k_strides=tuple(kc.stride()[:3]),
                       v_strides=tuple(vc.stride()[:3]), page_size=page, causal=True, sm_scale=d ** -0.5,
                       logits_soft_cap=cap, max_qo_len=L, batch_size=batch, num_kv_heads=HKV)
            flops = batch * 4.0 * L * L * HQ * d / 2
        elif name in ("mask4k", "mask4k_d64", "mask4k_d256", "mask4k_cap"):
            L, d = 4096, _head_dim(name)
            cap = SOFTCAP if name.endswith("_cap") else None
            q = testing.randn((L, HQ, d), bf16, dev, seed=1)
            k = testing.randn((L, HKV, d), bf16, dev, seed=2)
            v = testing.randn((L, HKV, d), bf16, dev, seed=3)
            o = torch.empty_like(q)
            from fi_attention.prefill import packbits  # noqa: PLC0415

            keep = testing.rand((L, L), seed=5) < 0.5
            packed = packbits(keep.flatten().to(dev), bitorder="little")

            def fn(rr, rp, q=q, k=k, v=v, o=o, L=L, d=d, packed=packed, cap=cap):
                rr(q, k, v, None, None, o, None, causal=False, sm_scale=d ** -0.5, logits_soft_cap=cap,
                   max_qo_len=L, batch_size=1, packed_mask=packed)
            flops = 4.0 * L * L * HQ * d
        else:
            raise SystemExit(f"unknown case {name}")
        out[name] = (flops, fn, o)
    return out


def main() -> int:
    args = arg_parser(__doc__, rounds=7, cases="single8k,single16k,full4k,ragged,paged", warmup_s=3.0,
                      calls=5).parse_args()
    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415

        return build_only(s for b in args.builds for s in specs_for(b, Arch.parse("9.0a"), args.cases.split(",")))

    import fi_attention.prefill.hopper as hop  # noqa: PLC0415

    dev = torch.device("cuda")
    names = args.cases.split(",")
    work = cases(names, dev)
    graphs = {}  # (case, build) -> graph
    refs = {}
    for b in args.builds:
        hop.prefill_sm90_spec = spec_factory(b)
        for name, (_flops, fn, o) in work.items():
            def run(fn=fn, o=o):
                fn(hop.run_ragged, hop.run_paged)
                return o
            graphs[(name, b)] = capture_checked(run, name, b, refs, args.calls)
    measure(args, graphs, {key: args.calls for key in graphs}, names, {n: work[n][0] / 1e6 for n in names},
            "tflop_s", "TF/s", 10, "ab_fa3.py", "fa3", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
