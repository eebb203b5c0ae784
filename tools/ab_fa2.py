#!/usr/bin/env python3
"""Interleaved A/B timing of builds of the portable (fa2) prefill kernel in one process on the GPU,
as tools/ab_fa3.py does for the Hopper kernel: every build is loaded into one process and the builds
are timed in turns (CUDA graphs of a few calls, median over rounds), so clock and power drift hit
them alike.

    python3 tools/ab_fa2.py [--rounds 7] [--cases single16k,single4k] BUILD ...

Cases (GQA 32/8, bf16, head_dim 128, single prefill through ``backend="fa2"``, causal unless named
full): single4k / single8k / single16k, full4k; ragged (16 x 2048 causal,
BatchPrefillWithRaggedKVCacheWrapper); paged (the same batch from a paged cache, page 16, pages in
random order: BatchPrefillWithPagedKVCacheWrapper); paged_softcap (the same with logits_soft_cap 30),
paged_fp8 (an e4m3 cache, k_scale = v_scale = 0.5), paged_fp8_softcap (both); ragged_alibi / ragged_rope /
paged_alibi / paged_rope (pos_encoding_mode ALIBI / ROPE_LLAMA); mask4k_d64 / mask4k / mask4k_d256 (single
prefill L=4096 with a packed custom mask, random with density 1/2, at head_dim 64 / 128 / 256; the
kernel visits every KV tile, so TFLOP/s count the full L^2 product).

BUILD is ``0`` (the current prefill_fa2.cu) or a path to another prefill_fa2.cu (e.g. an older
commit's, unpacked with ``git show``), built under its own module name; ``BUILD@N`` builds it with
kv tiles of N; ``BUILD+wide`` gives custom-mask variants the regular tile (spec.TILE_CONFIG)
instead of the narrow one (host plan and kernel alike). ``--build-only`` compiles
the modules for sm_90a and exits. Every build's output must match the first build's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sys
from pathlib import Path

import torch

from ab_common import arg_parser, build_only, capture_checked, measure

HQ, HKV, D = 32, 8, 128
NOTE = ("fixed inputs, CUDA graphs of 5 calls, builds timed in turns; paired_speedup = median over "
        "rounds of t(first build) / t(build)")


def spec_factory(build: str):
    """A replacement for prefill.spec.fa2_spec that returns the given build's module spec.
    ``BUILD@N`` compiles the build with kv tiles of N (FI_KV_TILE) instead of spec.py's choice."""
    from fi_attention.prefill import spec as ps  # noqa: PLC0415

    wide = build.endswith("+wide")
    build, _, kv_tile = build.removesuffix("+wide").partition("@")
    if build == "0" and not kv_tile:
        # fa2_spec is cached; a +wide build must not see (or leave) the narrow tiles' entries
        return ps.fa2_spec.__wrapped__ if wide else ps.fa2_spec
    path = Path(build).resolve() if build != "0" else Path(ps.__file__).with_name("prefill_fa2.cu")
    tag = "ab" + hashlib.sha1(path.read_bytes()).hexdigest()[:8]  # same on every machine

    def make(*args, **kw):
        s = (ps.fa2_spec.__wrapped__ if wide else ps.fa2_spec)(*args, **kw)
        defines = dict(s.defines, FI_KV_TILE=int(kv_tile)) if kv_tile else s.defines
        return dataclasses.replace(s, name=f"{s.name}_{tag}{'n' + kv_tile if kv_tile else ''}",
                                   sources=(path,), defines=defines)
    return make


class _UseBuild:
    """Points the fa2 launcher's spec lookup at a build inside the block. Schedules (plans and
    their device copies) are shared by the builds: they depend on the CTA rows and the resident
    CTAs per SM, which the builds compared here keep."""

    def __init__(self, build: str):
        from fi_attention.prefill import api  # noqa: PLC0415

        self.make = spec_factory(build)
        self.wide = build.endswith("+wide")
        # single prefill caches its schedules by shape, not by tile: a +wide build keeps its own
        self.schedules = functools.lru_cache(maxsize=256)(api._single_schedule.__wrapped__) if self.wide else None

    def __enter__(self):
        from fi_attention.prefill import api, launch, spec  # noqa: PLC0415

        self.saved = launch.fa2_spec, spec.tile_config, api._single_schedule
        launch.fa2_spec = self.make
        if self.wide:  # spec.fa2_spec and spec.cta_rows (launch's too) look tile_config up here
            tc = self.saved[1]
            spec.tile_config = lambda dqk, dvo, custom_mask=False, short=False: tc(dqk, dvo, False, short)
            api._single_schedule = self.schedules

    def __exit__(self, *exc):
        from fi_attention.prefill import api, launch, spec  # noqa: PLC0415

        launch.fa2_spec, spec.tile_config, api._single_schedule = self.saved


_BUILDS: dict[str, _UseBuild] = {}


def use_build(build: str) -> _UseBuild:
    """The build's context (one per build, so a +wide build's schedules persist across calls)."""
    if build not in _BUILDS:
        _BUILDS[build] = _UseBuild(build)
    return _BUILDS[build]


SINGLES = {"single4k": 4096, "single8k": 8192, "single16k": 16384, "full4k": 4096}
MASKED = {"mask4k_d64": 64, "mask4k": 128, "mask4k_d256": 256}  # name -> head_dim; L = 4096
# batch cases: name -> (logits soft cap, KV dtype, pos_encoding_mode)
RAGGED = {"ragged": (None, torch.bfloat16, "NONE"), "ragged_alibi": (None, torch.bfloat16, "ALIBI"),
          "ragged_rope": (None, torch.bfloat16, "ROPE_LLAMA")}
PAGED = {"paged": (None, torch.bfloat16, "NONE"), "paged_softcap": (30.0, torch.bfloat16, "NONE"),
         "paged_fp8": (None, torch.float8_e4m3fn, "NONE"), "paged_fp8_softcap": (30.0, torch.float8_e4m3fn, "NONE"),
         "paged_alibi": (None, torch.bfloat16, "ALIBI"), "paged_rope": (None, torch.bfloat16, "ROPE_LLAMA")}


def cases(names, dev):
    """name -> (flops, make(build) -> fn returning the output) with inputs allocated once."""
    from fi_core import testing  # noqa: PLC0415
    from fi_attention.prefill import (  # noqa: PLC0415
        BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache)

    out = {}
    bf16 = torch.bfloat16
    for name in names:
        if name in SINGLES:
            L, causal = SINGLES[name], not name.startswith("full")
            q = testing.randn((L, HQ, D), bf16, dev, seed=1)
            k = testing.randn((L, HKV, D), bf16, dev, seed=2)
            v = testing.randn((L, HKV, D), bf16, dev, seed=3)

            def make(build, q=q, k=k, v=v, causal=causal):
                def fn():
                    with use_build(build):
                        return single_prefill_with_kv_cache(q, k, v, causal=causal, backend="fa2")
                return fn
            flops = 4.0 * L * L * HQ * D / (2 if causal else 1)
        elif name in MASKED:
            from fi_attention.prefill import packbits  # noqa: PLC0415

            L, d = 4096, MASKED[name]
            q = testing.randn((L, HQ, d), bf16, dev, seed=1)
            k = testing.randn((L, HKV, d), bf16, dev, seed=2)
            v = testing.randn((L, HKV, d), bf16, dev, seed=3)
            dense = torch.rand((L, L), generator=testing.generator(9)) < 0.5
            packed = packbits(dense.flatten().to(dev), bitorder="little")

            def make(build, q=q, k=k, v=v, packed=packed):
                def fn():
                    with use_build(build):
                        return single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed, backend="fa2")
                return fn
            flops = 4.0 * L * L * HQ * d
        elif name in RAGGED:
            batch, L = 16, 2048
            q = testing.randn((batch * L, HQ, D), bf16, dev, seed=4)
            k = testing.randn((batch * L, HKV, D), bf16, dev, seed=5)
            v = testing.randn((batch * L, HKV, D), bf16, dev, seed=6)
            o = torch.empty_like(q)
            indptr = torch.arange(batch + 1, dtype=torch.int32) * L
            pos = RAGGED[name][2]

            def make(build, q=q, k=k, v=v, o=o, indptr=indptr, pos=pos):
                # a CUDA-graph wrapper: the builds are timed as captured graphs
                w = BatchPrefillWithRaggedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=dev), backend="fa2", use_cuda_graph=True,
                    qo_indptr_buf=torch.zeros_like(indptr, device=dev),
                    kv_indptr_buf=torch.zeros_like(indptr, device=dev))
                with use_build(build):
                    w.plan(indptr, indptr, HQ, HKV, D, causal=True, q_data_type=bf16, pos_encoding_mode=pos)

                def fn():
                    with use_build(build):
                        return w.run(q, k, v, out=o)
                return fn
            flops = batch * 4.0 * L * L * HQ * D / 2
        elif name in PAGED:
            # the bench routine's paged batch: 16 x 2048 causal, page 16, pages in random order
            batch, L, page = 16, 2048, 16
            pages_per = L // page
            soft_cap, kv_dtype, pos = PAGED[name]
            q = testing.randn((batch * L, HQ, D), bf16, dev, seed=7)
            cache = testing.randn((batch * pages_per, 2, page, HKV, D), bf16, dev, seed=8).to(kv_dtype)
            scale = 0.5 if kv_dtype != bf16 else None
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * L
            kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
            kv_indices = torch.randperm(batch * pages_per, generator=testing.generator(0)).to(torch.int32)
            last = torch.full((batch,), page, dtype=torch.int32)
            o = torch.empty_like(q)

            def make(build, q=q, cache=cache, o=o, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                     kv_indices=kv_indices, last=last, page=page, soft_cap=soft_cap, kv_dtype=kv_dtype,
                     scale=scale, pos=pos):
                w = BatchPrefillWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=dev), backend="fa2", use_cuda_graph=True,
                    qo_indptr_buf=torch.zeros_like(qo_indptr, device=dev),
                    paged_kv_indptr_buf=torch.zeros_like(kv_indptr, device=dev),
                    paged_kv_indices_buf=torch.zeros_like(kv_indices, device=dev),
                    paged_kv_last_page_len_buf=torch.zeros_like(last, device=dev))
                with use_build(build):
                    w.plan(qo_indptr, kv_indptr, kv_indices, last, HQ, HKV, D, page, causal=True,
                           q_data_type=bf16, kv_data_type=kv_dtype, logits_soft_cap=soft_cap,
                           pos_encoding_mode=pos)

                def fn():
                    with use_build(build):
                        return w.run(q, cache, out=o, k_scale=scale, v_scale=scale)
                return fn
            flops = batch * 4.0 * L * L * HQ * D / 2
        else:
            raise SystemExit(f"unknown case {name}; cases: {', '.join([*SINGLES, *MASKED, *RAGGED, *PAGED])}")
        out[name] = (flops, make)
    return out


def main() -> int:
    args = arg_parser(__doc__, rounds=7, cases="single16k,single4k,ragged", warmup_s=3.0, calls=5).parse_args()
    if args.build_only:
        from fi_core import Arch  # noqa: PLC0415

        return build_only(spec_factory(b)(torch.bfloat16, D, D, False, Arch.parse("9.0a")) for b in args.builds)

    dev = torch.device("cuda")
    names = args.cases.split(",")
    work = cases(names, dev)
    graphs, refs, keep = {}, {}, []
    for b in args.builds:
        for name, (_flops, make) in work.items():
            fn = make(b)
            graphs[(name, b)] = capture_checked(fn, name, b, refs, args.calls)
            keep.append(fn)
    measure(args, graphs, {key: args.calls for key in graphs}, names, {n: work[n][0] / 1e6 for n in names},
            "tflop_s", "TF/s", 10, "ab_fa2.py", "fa2", NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
