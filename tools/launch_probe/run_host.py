"""run() host time of the decode wrapper of the tree on PYTHONPATH, as one JSON line: the bench's
_host_times cases (b1 x kv512, split and one launch), a CUDA-graph wrapper, a plain wrapper cycling
through 32 layer caches and a run() that allocates out, timed in turns in one process (median /
min / max of 9 batch means of 512 calls) beside the bench's host-speed probe. Outputs are checked
against the reference first.

A/B of two revisions on the GPU machine: extract the other tree (git archive REV packages | tar -x
-C DIR) and run this script alternately with each tree's packages/*/src on PYTHONPATH.
"""

from __future__ import annotations

import itertools
import json

import torch

import fi_attention
from fi_core.bench import time_host_interleaved
from fi_attention import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper
from fi_attention.reference import batch_decode_reference

PAGE, D = 16, 128


def main() -> None:
    dev = torch.device("cuda")
    pages = 512 // PAGE
    indptr = torch.tensor([0, pages], dtype=torch.int32)
    indices = torch.arange(pages, dtype=torch.int32)
    last = torch.tensor([PAGE], dtype=torch.int32)
    caches = [torch.randn(pages, 2, PAGE, 8, D, device=dev).to(torch.bfloat16) for _ in range(32)]
    cache = caches[0]
    q = torch.randn(1, 32, D, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)

    def wrapper(graph=False, **kw):
        ws = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
        w = (CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr.cuda(), indices.cuda(), last.cuda())
             if graph else BatchDecodeWithPagedKVCacheWrapper(ws))
        w.plan(indptr, indices, last, 32, 8, D, PAGE, q_data_type=torch.bfloat16, **kw)
        return w

    w_split, w_one, w_graph = wrapper(), wrapper(disable_split_kv=True), wrapper(graph=True)
    err = 0.0
    for w in (w_split, w_one, w_graph):
        for c in caches[:3]:
            w.run(q, c, out=out)
            w.run(q, c, out=out)  # the second call of a cache takes the launch path
            ref = batch_decode_reference(q, c, indptr, indices, last)
            err = max(err, (out.float() - ref.float()).abs().max().item())
    if err > 3e-2:
        raise SystemExit(f"decode output differs from the reference by {err}")
    turn = itertools.cycle(caches)
    ev = torch.cuda.Event()
    arr = torch.arange(256, dtype=torch.int32).numpy()

    def probe():  # fi_attention.bench_decode._host_speed's work
        int(arr[1:].sum()) + sum(range(64))
        ev.record()

    fns = {"probe": probe,
           "run_split": lambda: w_split.run(q, cache, out=out),
           "run_one_launch": lambda: w_one.run(q, cache, out=out),
           "run_graph_wrapper": lambda: w_graph.run(q, cache, out=out),
           "run_layers32": lambda: w_one.run(q, next(turn), out=out),
           "run_alloc_out": lambda: w_one.run(q, cache)}
    r = time_host_interleaved(fns, iters=512, warmup=64, batches=9)
    times = {k: [round(x, 3) for x in v] for k, v in r.items()}
    print(json.dumps({"tree": fi_attention.__file__, "max_err": err, **times}))


if __name__ == "__main__":
    main()
