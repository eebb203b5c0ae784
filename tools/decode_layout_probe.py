#!/usr/bin/env python3
"""What the paged cache layout costs batch decode: the same batch timed with the page table and
cache layouts a serving engine may have, next to torch SDPA on contiguous K/V, in one process.

TARGETS.md's decode rows are NHD caches of 16-token pages whose pages interleave across requests
(the bench routine's tables). Here the same batch also runs with its pages in request order, with
HND caches (one head's page rows contiguous), and with larger pages, so the gap to SDPA can be
split into what the layout costs and what the kernel costs.

    python3 tools/decode_layout_probe.py                      # b16 x 8192, b128 x 8192, b256 x 2048
    python3 tools/decode_layout_probe.py --shapes 16x8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted(ROOT.glob("packages/*/src"))]

HQ, HKV, D = 32, 8, 128


def _case(batch, kv_len, layout, page, shuffled):
    import torch  # noqa: PLC0415
    from fi_core.bench import rotating_inputs, time_fn  # noqa: PLC0415
    from fi_attention import CUDAGraphBatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415
    from fi_attention.bench_decode import uniform_tables  # noqa: PLC0415
    from fi_attention.reference import attention_reference, gather_paged_kv  # noqa: PLC0415
    from fi_core import testing  # noqa: PLC0415

    dev = torch.device("cuda")
    indptr, indices, last, n_pages = uniform_tables(batch, kv_len, page, interleaved=shuffled)
    shape = (n_pages, 2, page, HKV, D) if layout == "NHD" else (n_pages, 2, HKV, page, D)

    def make(i):
        g = torch.Generator(device=dev).manual_seed(100 + i)
        return (torch.randn(batch, HQ, D, device=dev, generator=g).to(torch.bfloat16),
                torch.randn(shape, device=dev, generator=g).to(torch.bfloat16))

    sets = rotating_inputs(make, dev)
    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device=dev), indptr.to(dev), indices.to(dev), last.to(dev),
        kv_layout=layout)
    w.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=torch.bfloat16)
    out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=dev)
    q0, c0 = sets[0]
    w.run(q0, c0, out=out)
    for b in (0, batch - 1):  # the timed path computes the right thing
        k, v = gather_paged_kv(c0, indptr, indices, last, b, layout)
        testing.assert_close(out[b:b + 1], attention_reference(q0[b:b + 1], k, v), dtype=torch.bfloat16)
    t = time_fn(lambda q, c: w.run(q, c, out=out), sets)
    del sets
    torch.cuda.empty_cache()
    return t.median_us, w._plan.num_items


def _sdpa(batch, kv_len):
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from fi_core.bench import rotating_inputs, time_fn  # noqa: PLC0415
    dev = torch.device("cuda")

    def make(i):
        g = torch.Generator(device=dev).manual_seed(200 + i)
        return tuple(torch.randn(s, device=dev, generator=g).to(torch.bfloat16)
                     for s in ((batch, HQ, 1, D), (batch, HKV, kv_len, D), (batch, HKV, kv_len, D)))

    sets = rotating_inputs(make, dev)
    t = time_fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), sets)
    del sets
    torch.cuda.empty_cache()
    return t.median_us


VARIANTS = [("NHD", 16, True), ("NHD", 16, False), ("HND", 16, True), ("NHD", 128, True), ("HND", 128, True),
            ("HND", 1024, True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x8192,128x8192,256x2048", help="BATCHxKV,... (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        batch, kv_len = (int(x) for x in shape.split("x"))
        kv_bytes = batch * kv_len * HKV * D * 2 * 2
        sdpa = _sdpa(batch, kv_len)
        print(f"b{batch} kv{kv_len}: torch SDPA (contiguous K/V) {sdpa:.2f} us, {kv_bytes / sdpa / 1e6:.2f} TB/s")
        rows.append(dict(batch=batch, kv_len=kv_len, case="sdpa", us=round(sdpa, 2)))
        for layout, page, shuffled in VARIANTS:
            us, items = _case(batch, kv_len, layout, page, shuffled)
            name = f"{layout} page {page}, pages {'interleaved' if shuffled else 'in order'}"
            print(f"  {name:38s} {us:8.2f} us  {kv_bytes / us / 1e6:.2f} TB/s  x{sdpa / us:.3f} SDPA  ({items} items)")
            rows.append(dict(batch=batch, kv_len=kv_len, case=name, us=round(us, 2), items=items))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
