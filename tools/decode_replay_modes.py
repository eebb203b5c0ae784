#!/usr/bin/env python3
"""Per-replay times of batch decode CUDA graphs, to see whether the replays of a bench row fall in
modes (the b1 x 32768 row's replays read 36.9 or 40.6 us per call in some bench runs) and whether
the input set decides the mode.

The bench routine's tables and inputs (tools' rotating sets, CUDA-graph wrapper); three graphs of
20 calls: AB (the sets alternate, as the bench's), A (set 0 only), B (set 1 only), replayed in
turns for ``--seconds`` while nvidia-smi samples clocks and power every 100 ms; then, the bench's
way, fi_core.bench.time_fn on the same wrapper and the AB graph replayed alone (30 in a row), 5 times.

    python3 tools/decode_replay_modes.py [--batch 1 --kv 32768] [--seconds 6] [--json PATH]

Prints median / min / max / p10 / p90 per graph and the share of replays under ``--split`` us, and
the sequence of fast (f) / slow (s) replays.

``--phases`` asks instead what puts the bench's b1 row into its slow mode after the large rows:
time_fn (the bench's timer) three times on inputs made at the start ("fresh"); then the b128 x 8192
row's work (its inputs made, a CUDA-graph wrapper replayed for ``--heavy-seconds``, freed,
torch.cuda.empty_cache() as the bench does between rows) and time_fn at once on the same b1 inputs
("after_heavy": the memory placement of the b1 inputs is unchanged, the GPU's clocks and power
state are not); after ``--rest`` seconds idle ("after_rest"); and on b1 inputs made anew after the
heavy phase ("new_inputs": the placement a bench row gets after the large rows). nvidia-smi samples
the SM clock and power every 100 ms throughout, with the phase start times beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted(ROOT.glob("packages/*/src"))]

HQ, HKV = 32, 8
K = 20  # calls per graph, as fi_core.bench.time_fn's minimum


def decode_setup(torch, batch: int, kv: int, seed: int):
    """The bench routine's row for (batch, kv): a planned CUDA-graph wrapper, its output buffer, and
    make(i) -> (q, paged cache) of input set i (seeds seed + i)."""
    from fi_attention.bench_decode import PAGE, D, uniform_tables  # noqa: PLC0415
    from fi_attention.decode import CUDAGraphBatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415

    dev = "cuda"
    indptr, indices, last, n_pages = uniform_tables(batch, kv)

    def make(i):
        g = torch.Generator(device=dev).manual_seed(seed + i)
        cache = torch.randn(n_pages, 2, PAGE, HKV, D, device=dev, generator=g).to(torch.bfloat16)
        return torch.randn(batch, HQ, D, device=dev, generator=g).to(torch.bfloat16), cache

    w = CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                    indptr.to(dev), indices.to(dev), last.to(dev))
    w.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return w, torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=dev), make


def start_smi():
    """nvidia-smi sampling timestamp, SM and memory clocks, power and clock-event reasons every 100 ms."""
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,"
                             "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "100"],
                            stdout=subprocess.PIPE, text=True)


def write_json(path, torch, **fields) -> None:
    env = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "command": "python3 tools/decode_replay_modes.py " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name()}
    with open(path, "w") as f:
        json.dump(dict(environment=env, **fields), f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv", type=int, default=32768)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--split", type=float, default=38.5, help="us per call between the fast and slow modes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--phases", action="store_true", help="fresh / after_heavy / after_rest / new_inputs")
    ap.add_argument("--heavy-seconds", type=float, default=4.0)
    ap.add_argument("--rest", type=float, default=3.0)
    args = ap.parse_args()
    import torch  # noqa: PLC0415
    from fi_core.bench import rotating_inputs, time_fn  # noqa: PLC0415

    w, out, make = decode_setup(torch, args.batch, args.kv, 100)
    sets = rotating_inputs(make, "cuda")
    print("sets", len(sets), [s[1].data_ptr() for s in sets], file=sys.stderr)
    for s in sets:
        w.run(*s, out=out)
    torch.cuda.synchronize()
    if args.phases:
        return phases(args, torch, w, out, sets, make)
    graphs = {}
    stream = torch.cuda.Stream()
    for name, order in (("AB", [i % len(sets) for i in range(K)]), ("A", [0] * K), ("B", [1 % len(sets)] * K)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for i in order:
                w.run(*sets[i], out=out)
        g.replay()
        graphs[name] = g
    torch.cuda.synchronize()
    smi = start_smi()
    time.sleep(0.3)
    res = {k: [] for k in graphs}
    seq = []
    t0 = time.time()
    while time.time() - t0 < args.seconds:
        for name, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            us = a.elapsed_time(b) * 1e3 / K
            res[name].append(us)
            seq.append((round(time.time() - t0, 4), name, round(us, 2)))
    # The bench's way: one graph replayed back to back (fi_core.bench.time_fn: a fresh graph of 20
    # calls, 30 timed replays), and the AB graph above replayed alone 30 times in a row.
    solo = {"time_fn": [], "ab_alone": []}
    for _ in range(5):
        t = time_fn(lambda q, c: w.run(q, c, out=out), sets)
        solo["time_fn"].append([round(t.median_us, 2), round(t.min_us, 2), round(t.max_us, 2)])
        alone = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs["AB"].replay()
            b.record()
            b.synchronize()
            alone.append(round(a.elapsed_time(b) * 1e3 / K, 2))
        solo["ab_alone"].append(alone)
    print("time_fn (median, min, max) x5:", solo["time_fn"])
    print("AB graph alone, 30 replays in a row, medians x5:", [statistics.median(v) for v in solo["ab_alone"]])
    smi.terminate()
    samples = smi.stdout.read().strip().splitlines()
    summary = {}
    for name, v in res.items():
        v2 = sorted(v)
        n = len(v2)
        summary[name] = dict(n=n, median=statistics.median(v2), min=v2[0], max=v2[-1], p10=v2[n // 10],
                             p90=v2[9 * n // 10], frac_below_split=sum(x < args.split for x in v2) / n)
        print(name, json.dumps({k: round(x, 3) for k, x in summary[name].items()}))
    modes = "".join("f" if us < args.split else "s" for _, _, us in seq)
    print(f"mode sequence (f < {args.split} us < s), first 300:", modes[:300])
    if args.json:
        write_json(args.json, torch, summary=summary, solo=solo, seq=seq, smi=samples)
    return 0


def phases(args, torch, w, out, sets, make) -> int:
    from fi_core.bench import rotating_inputs, time_fn  # noqa: PLC0415

    smi = start_smi()
    time.sleep(0.5)
    marks, res = [], {}

    def mark(name):  # local wall-clock time to the millisecond, as nvidia-smi's timestamps
        t = time.time()
        marks.append((name, time.strftime("%H:%M:%S", time.localtime(t)) + f"{t % 1:.3f}"[1:]))

    def timed(name, inputs):
        mark(name)
        res[name] = []
        for _ in range(3):
            t = time_fn(lambda q, c: w.run(q, c, out=out), inputs)
            res[name].append([round(t.median_us, 2), round(t.min_us, 2), round(t.max_us, 2)])
        print(name, "time_fn (median, min, max) x3:", res[name], flush=True)

    timed("fresh", sets)
    # the b128 x 8192 row's work, as the bench runs it before b1
    mark("heavy")
    wb, ob, make_big = decode_setup(torch, 128, 8192, 300)
    big = rotating_inputs(make_big, "cuda")
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=stream):
        for i in range(4):
            wb.run(*big[i % len(big)], out=ob)
    t0 = time.time()
    while time.time() - t0 < args.heavy_seconds:
        g.replay()
        torch.cuda.synchronize()
    del g, big, wb, ob
    torch.cuda.empty_cache()
    timed("after_heavy", sets)
    time.sleep(args.rest)
    timed("after_rest", sets)
    timed("new_inputs", rotating_inputs(make, "cuda"))
    smi.terminate()
    samples = smi.stdout.read().strip().splitlines()
    if args.json:
        write_json(args.json, torch, phases=res, marks=marks, smi=samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
