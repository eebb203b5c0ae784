"""Where the host time of BatchDecodeWithPagedKVCacheWrapper.run() goes, on the GPU machine.

Each piece of the launch path is timed alone (median / min / max of 7 batch means of 500 calls,
the pieces in turns so that a slow spell of the host lands on every piece), beside the full run()
of a plain and a CUDA-graph wrapper, and the launch floors of launch_probe.so called from Python
(ctypes) and from C (n calls in a C loop). The case is the bench's _host_times one: b1 x kv512,
GQA 32/8, head_dim 128, bf16, one launch.

    nvcc -O2 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a \\
        -o tools/launch_probe/launch_probe.so tools/launch_probe/launch_probe.cu
    python3 tools/launch_probe/run_pieces.py OUT.json
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time

import torch

from fi_core.bench import time_host_interleaved
from fi_core.launch import capturing, raw_stream
from fi_attention import BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper
from fi_attention.decode.launch import OFF_RUN, PACK_RUN, DecodeArgs

PAGE, D = 16, 128
ONE_ARG = ["noop", "launch_plain", "launch_pdl", "launch_ex_noattr", "launch_drv", "get_device", "last_error",
           "capture_status"]  # launch_probe.cu's loop() order


def _c_loop(call, reps: int = 9, n: int = 500) -> list:
    """[median, min] per call of ``call(n)`` (n calls made in C), the device synchronised between reps."""
    vals = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rc = call(n)
        vals.append((time.perf_counter() - t0) / n * 1e6)
        if rc:
            raise RuntimeError(f"launch probe returned {rc}")
    torch.cuda.synchronize()
    return [round(statistics.median(vals), 3), round(min(vals), 3)]


def main(out_path: str) -> None:
    dev = torch.device("cuda")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_probe.so"))
    fns = {}
    for name in ONE_ARG:
        f = getattr(lib, name)
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]
        fns[name] = f
    for name, argtypes in (("loop", [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
                           ("loop_sizes", [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
                           ("loop_ptr", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_int, argtypes
    s = raw_stream(0)

    pages = 512 // PAGE
    indptr = torch.tensor([0, pages], dtype=torch.int32)
    indices = torch.arange(pages, dtype=torch.int32)
    last = torch.tensor([PAGE], dtype=torch.int32)
    cache = torch.randn(pages, 2, PAGE, 8, D, device=dev).to(torch.bfloat16)
    q = torch.randn(1, 32, D, device=dev).to(torch.bfloat16)
    out = torch.empty_like(q)
    ws = lambda: torch.empty(32 << 20, dtype=torch.uint8, device=dev)  # noqa: E731
    wp = BatchDecodeWithPagedKVCacheWrapper(ws())
    wp.plan(indptr, indices, last, 32, 8, D, PAGE, q_data_type=torch.bfloat16, disable_split_kv=True)
    wg = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws(), indptr.cuda(), indices.cuda(), last.cuda())
    wg.plan(indptr, indices, last, 32, 8, D, PAGE, q_data_type=torch.bfloat16, disable_split_kv=True)
    for w in (wp, wg):
        w.run(q, cache, out=out)
        w.run(q, cache, out=out)  # the launch path from here on
    torch.cuda.synchronize()
    addr, launch = wp._fast[5], wp._fast[6]
    fnptr = ctypes.cast(launch, ctypes.c_void_p).value
    res: dict = {}
    for rep in range(2):
        c = {name: _c_loop(lambda n, i=i: lib.loop(i, n, s)) for i, name in enumerate(ONE_ARG)}
        for i, name in enumerate(["pdl_param8", "pdl_param384", "pdl_param1k", "pdl_param384_smem100k"]):
            c[name] = _c_loop(lambda n, i=i: lib.loop_sizes(i, n, s))
        c["decode_launcher"] = _c_loop(lambda n: lib.loop_ptr(fnptr, addr, n))
        res[f"c_loop_per_call_us_rep{rep}"] = c

    class Sig:  # run()'s signature, doing nothing: the call's own cost
        def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, enable_pdl=None, window_left=None):
            return out

    sig, scratch = Sig(), DecodeArgs()  # the wrapper's own block must keep its pointers
    shape, bf, cont = q.shape, torch.bfloat16, torch.contiguous_format
    ev = torch.cuda.Event()
    arr = torch.arange(256, dtype=torch.int32).numpy()

    def probe():  # fi_attention.bench_decode._host_speed's work
        int(arr[1:].sum()) + sum(range(64))
        ev.record()

    pieces = {
        "host_speed_probe": probe,
        "py_noop": lambda: None,
        "run_signature_call": lambda: sig.run(q, cache, out=out),
        "is_compiling": torch.compiler.is_compiling,
        "is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
        "capturing": capturing,
        "raw_stream": lambda: raw_stream(0),
        "q.shape": lambda: q.shape, "q.stride()": lambda: q.stride(), "q.is_contiguous()": lambda: q.is_contiguous(),
        "q.data_ptr()": lambda: q.data_ptr(), "q.get_device()": lambda: q.get_device(), "q.dtype": lambda: q.dtype,
        "cache_key": lambda: (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype),
        "pack_run": lambda: PACK_RUN(scratch, OFF_RUN, 1, 2, 3, 4, 5, 6, 0, 1.0, 1.0, 7),
        "empty_like": lambda: torch.empty_like(q),
        "empty_like_contiguous": lambda: torch.empty_like(q, memory_format=cont),
        "empty_shape_device": lambda: torch.empty(shape, dtype=bf, device=dev),
        "new_empty": lambda: q.new_empty(shape),
        "ctypes_noop": lambda: fns["noop"](addr, s),
        "ctypes_empty_pdl": lambda: fns["launch_pdl"](addr, s),
        "ctypes_decode_launcher": lambda: launch(addr),
        "run_plain_out": lambda: wp.run(q, cache, out=out),
        "run_graph_wrapper_out": lambda: wg.run(q, cache, out=out),
        "run_plain_alloc": lambda: wp.run(q, cache),
    }
    for rep in range(2):
        r = time_host_interleaved(pieces, iters=500, warmup=50, batches=7)
        res[f"python_us_rep{rep}"] = {k: [round(x, 3) for x in v] for k, v in r.items()}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for k, v in res.items():
        print(k)
        for name, t in v.items():
            print(f"  {name:28s} {t}")


if __name__ == "__main__":
    main(sys.argv[1])
