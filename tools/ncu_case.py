#!/usr/bin/env python3
"""Run one benchmark case a few times so Nsight Compute can profile its kernels on the GPU:

    ncu --clock-control none -k regex:decode_mma --launch-skip 3 --launch-count 1 \
        python3 tools/ncu_case.py decode_b128

Cases: decode_b128 (GQA 32/8 b128 kv8192), decode_b1 (b1 kv32768), decode_fp8 (fp8 b128 kv8192;
for the decode cases, DECODE_AB=NAME=N,... in the environment builds -DFI_NAME=N),
prefill_paged (fa3 16 x 2048 causal, page 16), prefill_ragged (the same batch with ragged K/V; for the
fa3 cases FA3_VARIANT=N in the environment builds FI_FA3_VARIANT=N),
prefill_paged128_ragged_layout (the paged kernel on page 128 in order, K and V in two tensors),
prefill_full (fa3 single prefill L=4096 without a mask: the mainloop alone), prefill_causal (fa3
single prefill L=8192 causal; for both, FA3_VARIANT=N in the environment builds FI_FA3_VARIANT=N),
prefill_fa2_causal (the portable fa2 kernel on the same L=8192 causal prefill), prefill_fa2_paged /
prefill_fa2_ragged (the fa2 kernel on the prefill_paged / prefill_ragged batches), segment_lora (segment
GEMM, 8 segments x 512 rows, 4096 -> 16), gemv_m16 (mm_bf16 M=16, N=K=4096), sdpa_b128 (torch SDPA on
decode b128's contiguous K/V), stream_read (torch sum over 4.3 GB, a plain read). Each call is checked
nowhere: the bench routines and GPU tests check these shapes; this script only launches them.
"""

from __future__ import annotations

import os
import sys

import torch


def _decode(batch, kv_len, kv_dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16):
    from fi_attention.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415
    from fi_attention.decode import spec  # noqa: PLC0415

    # DECODE_AB=NAME=N,... in the environment builds the tensor-core kernel with -DFI_NAME=N
    ab = os.environ.get("DECODE_AB", "")
    spec.MMA_AB = {"FI_" + k: int(v) for k, v in (item.split("=") for item in ab.split(",") if item)}
    pages = -(-kv_len // page)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * page, dtype=torch.int32)
    cache = torch.randn(batch * pages, 2, page, hkv, d, device="cuda").to(kv_dtype)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    return lambda: w.run(q, cache)


def _fa3_variant():
    """FA3_VARIANT=N (N > 0) in the environment: the fa3 cases build FI_FA3_VARIANT=N."""
    import os  # noqa: PLC0415

    from fi_attention.prefill.hopper import spec  # noqa: PLC0415

    if int(os.environ.get("FA3_VARIANT") or 0):
        spec.VARIANT = int(os.environ["FA3_VARIANT"])


def _prefill_paged(batch=16, length=2048, hq=32, hkv=8, d=128, page=16, ragged_layout=False, backend="fa3"):
    """ragged_layout: pages in order, K and V as two tensors (the ragged case's addresses)."""
    from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper  # noqa: PLC0415

    _fa3_variant()
    pages = length // page
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * length
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    last = torch.full((batch,), page, dtype=torch.int32)
    if ragged_layout:
        indices = torch.arange(batch * pages, dtype=torch.int32)
        cache = (torch.randn(batch * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16),
                 torch.randn(batch * pages, page, hkv, d, device="cuda", dtype=torch.bfloat16))
    else:
        indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        cache = torch.randn(batch * pages, 2, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch * length, hq, d, device="cuda", dtype=torch.bfloat16)
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                            backend=backend)
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=torch.bfloat16)
    return lambda: w.run(q, cache)


def _prefill_ragged(batch=16, length=2048, hq=32, hkv=8, d=128, backend="fa3"):
    from fi_attention.prefill import BatchPrefillWithRaggedKVCacheWrapper  # noqa: PLC0415

    _fa3_variant()
    indptr = torch.arange(batch + 1, dtype=torch.int32) * length
    q = torch.randn(batch * length, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * length, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                             backend=backend)
    w.plan(indptr, indptr, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
    return lambda: w.run(q, k, v)


def _prefill_single(length, causal, hq=32, hkv=8, d=128, backend="fa3"):
    """Single prefill (fa3, or the portable fa2 kernel); FA3_VARIANT=N in the environment builds the
    fa3 kernel with FI_FA3_VARIANT=N."""
    from fi_attention.prefill import single_prefill_with_kv_cache  # noqa: PLC0415

    _fa3_variant()
    q = torch.randn(length, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend)


def _segment_lora(segs=8, rows=512, d_in=4096, d_out=16):
    from fi_gemm import SegmentGEMMWrapper  # noqa: PLC0415

    x = torch.randn(segs * rows, d_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(segs, d_out, d_in, device="cuda", dtype=torch.bfloat16)
    indptr = torch.arange(0, (segs + 1) * rows, rows, device="cuda")
    seg = SegmentGEMMWrapper(torch.empty(1 << 20, dtype=torch.int8, device="cuda"))
    return lambda: seg.run(x, w, segs, True, seg_indptr=indptr)


def _gemv_m16(m=16, n=4096, k=4096):
    from fi_gemm import mm_bf16  # noqa: PLC0415

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: mm_bf16(a, w.T)


def _sdpa_b128(batch=128, kv_len=8192, hq=32, hkv=8, d=128):
    """The decode bench's baseline: torch SDPA on contiguous K/V (batch decode's bytes, no pages).
    On the H200's torch it runs cuDNN's kernel (name matches regex:sdpa)."""
    import torch.nn.functional as F  # noqa: PLC0415

    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, kv_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, hkv, kv_len, d, device="cuda", dtype=torch.bfloat16)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _stream_read(gbytes=4.3):
    """A plain read of decode b128's byte count (torch's sum reduction), for comparison. torch splits
    it into 32-bit-indexed pieces: one profiled launch reads ~1.15 GB."""
    x = torch.randn(int(gbytes * 2**30 / 2), device="cuda", dtype=torch.bfloat16)
    return lambda: x.sum(dtype=torch.float32)


CASES = {
    "decode_b128": lambda: _decode(128, 8192),
    "decode_b1": lambda: _decode(1, 32768),
    "decode_fp8": lambda: _decode(128, 8192, torch.float8_e4m3fn),
    "prefill_paged": _prefill_paged,
    "prefill_ragged": _prefill_ragged,
    "prefill_paged128_ragged_layout": lambda: _prefill_paged(page=128, ragged_layout=True),
    "prefill_full": lambda: _prefill_single(4096, causal=False),
    "prefill_causal": lambda: _prefill_single(8192, causal=True),
    "prefill_fa2_causal": lambda: _prefill_single(8192, causal=True, backend="fa2"),
    "prefill_fa2_paged": lambda: _prefill_paged(backend="fa2"),
    "prefill_fa2_ragged": lambda: _prefill_ragged(backend="fa2"),
    "segment_lora": _segment_lora,
    "gemv_m16": _gemv_m16,
    "sdpa_b128": _sdpa_b128,
    "stream_read": _stream_read,
}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        print(f"usage: ncu_case.py {{{'|'.join(CASES)}}}", file=sys.stderr)
        return 2
    fn = CASES[sys.argv[1]]()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
