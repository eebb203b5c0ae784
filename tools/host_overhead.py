#!/usr/bin/env python3
"""Host time of BatchDecodeWithPagedKVCacheWrapper.run() and .plan() on a machine without a GPU.

The wrapper runs its CUDA host path under fi_attention.decode.hostsim (meta device buffers, a
native no-op launcher, stand-in events and streams): every microsecond reported is Python, numpy
and torch-dispatch work, without the CUDA calls themselves (kernel launch, cudaMemcpyAsync, event
record), which come on top on a GPU. The cases follow bench_decode.py (_host_times, _plan_time and
the decode table), plus ragged batches and the call forms a serving loop uses. A ragged case either
plans the same batch on every call or, like a decode loop, the batch one step later (every request
one token longer) on each call, cycling through 64 steps.

    python3 tools/host_overhead.py                      # the working tree
    python3 tools/host_overhead.py --baseline main      # ... side by side with another revision
    python3 tools/host_overhead.py --baseline main --rounds 4   # ... in alternating processes

With ``--rounds N`` both trees run in child processes, one after the other and in alternating order,
N times each; a tree's cell is its minimum over the rounds, and the last column the median over
rounds of the per-round ratio baseline / this tree (> 1: this tree is faster). The host's speed
drifts over seconds, so a single pair of runs can differ by more than the change measured. Run
``--baseline HEAD`` (the tree against itself) for the noise floor: on the 2-core CI-type machine
of session 36 its ratios spread 0.97-1.06 over 6 rounds.

Times are per call: the minimum and the median over repeats of many calls (the minimum is the
cost without interference from other processes; the median shows the noise).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE, D = 16, 128


def _load_hostsim(path: str | None):
    """fi_attention.decode.hostsim, from ``path`` when the measured tree predates it (its relative
    imports then bind to the measured tree's modules)."""
    if path is None:
        from fi_attention.decode import hostsim  # noqa: PLC0415
        return hostsim
    name = "fi_attention.decode.hostsim"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _per_call_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    for _ in range(max(1, calls // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times), statistics.median(times)


def _tables(batch, kv_len, seed=0):
    """bench_decode.uniform_tables: uniform requests whose pages interleave (a copy: --baseline
    trees predate that function)."""
    import torch  # noqa: PLC0415
    pages = -(-kv_len // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    last = torch.full((batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32)
    return indptr, indices, last


def _ragged_tables(batch, max_len, seed=0):
    """Random lengths in [1, max_len] (the last one max_len), pages interleaved."""
    return _ragged_steps(batch, max_len, 1, seed)[0]


def _ragged_steps(batch, max_len, steps, seed=0):
    """The page tables of ``steps`` consecutive decode steps of _ragged_tables' batch."""
    import torch  # noqa: PLC0415
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g)
    lens[-1] = max_len
    tables = []
    for step in range(steps):
        pages = (lens + step + PAGE - 1) // PAGE
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
        last = (lens + step - (pages - 1) * PAGE).to(torch.int32)
        indices = torch.randperm(int(indptr[-1]), generator=g).to(torch.int32)
        tables.append((indptr, indices, last))
    return tables


def measure(hostsim_path: str | None, scale: float) -> dict:
    import torch  # noqa: PLC0415
    hs = _load_hostsim(hostsim_path)
    results: dict = {}
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    with hs.HostSim(device_memory="meta", launcher="noop") as sim:
        results["launcher"] = sim.launcher
        raw = sim.module.fn("fi_batch_decode").raw
        args = (0,) if getattr(hs, "_ONE_ARG", False) else (0, hs.FAKE_STREAM)  # the tree's launcher ABI
        results["bare launcher call"] = _per_call_us(lambda: raw(*args), int(20000 * scale), 7)

        def run_case(name, batch, kv_len, kv_dtype=bf16, tuple_cache=False, graph=False, with_out=True,
                     scales=None, layers=1):
            indptr, indices, last = _tables(batch, kv_len)
            n_pages = int(indptr[-1])
            caches = [torch.zeros(n_pages, 2, PAGE, 8, D, dtype=kv_dtype) for _ in range(layers)]
            if tuple_cache:
                caches = [(c[:, 0], c[:, 1]) for c in caches]
            q = torch.zeros(batch, 32, D, dtype=bf16)
            out = torch.empty_like(q)
            bufs = (torch.zeros(batch + 1, dtype=torch.int32), torch.zeros(n_pages, dtype=torch.int32),
                    torch.zeros(batch, dtype=torch.int32)) if graph else None
            w = sim.wrapper(graph_buffers=bufs)
            w.plan(indptr, indices, last, 32, 8, D, PAGE, q_data_type=bf16, kv_data_type=kv_dtype)
            kw = dict(scales or {})
            if with_out:
                kw["out"] = out
            if layers == 1:
                cache = caches[0]
                results[name] = _per_call_us(lambda: w.run(q, cache, **kw), int(20000 * scale), 7)
            else:  # one wrapper, a cache per layer in turn (a serving step)
                turn = itertools.cycle(caches)
                results[name] = _per_call_us(lambda: w.run(q, next(turn), **kw), int(20000 * scale), 7)

        run_case("run b1 kv512 out= (bench _host_times)", 1, 512)
        run_case("run b1 kv512, out allocated", 1, 512, with_out=False)
        run_case("run b64 kv4096 out=", 64, 4096)
        run_case("run b1 kv512 (k, v) tuple cache", 1, 512, tuple_cache=True)
        run_case("run b1 kv512 fp8 k_scale/v_scale", 1, 512, kv_dtype=e4m3, scales=dict(k_scale=0.8, v_scale=1.25))
        run_case("run b1 kv512 CUDA-graph wrapper", 1, 512, graph=True)
        run_case("run b1 kv512 out=, 32 layer caches in turn", 1, 512, layers=32)

        def plan_case(name, tables, graph=False, kv_dtype=bf16, hkv=8):
            indptr, indices, last = tables
            batch = last.numel()
            bufs = (torch.zeros(batch + 1, dtype=torch.int32), torch.zeros(indices.numel(), dtype=torch.int32),
                    torch.zeros(batch, dtype=torch.int32)) if graph else None
            w = sim.wrapper(workspace_bytes=128 << 20, graph_buffers=bufs)
            f = lambda: w.plan(indptr, indices, last, 32, hkv, D, PAGE, q_data_type=bf16, kv_data_type=kv_dtype)
            results[name] = _per_call_us(f, int(2000 * scale), 7)

        for batch, kv_len in ((1, 512), (1, 32768), (16, 8192), (64, 4096), (128, 8192), (256, 2048)):
            plan_case(f"plan b{batch} kv{kv_len}", _tables(batch, kv_len))
        plan_case("plan b64 kv4096 MHA 32/32", _tables(64, 4096), hkv=32)
        plan_case("plan b128 kv8192 fp8", _tables(128, 8192), kv_dtype=e4m3)
        plan_case("plan b16 kv8192 CUDA-graph", _tables(16, 8192), graph=True)
        for batch in (16, 128):
            plan_case(f"plan ragged b{batch} kv<=8192", _ragged_tables(batch, 8192))

        def steps_case(name, steps):
            w = sim.wrapper(workspace_bytes=128 << 20)
            tables = itertools.cycle(steps)
            f = lambda: w.plan(*next(tables), 32, 8, D, PAGE, q_data_type=bf16, kv_data_type=bf16)
            results[name] = _per_call_us(f, int(2000 * scale), 7)

        for batch in (16, 128):
            steps_case(f"plan ragged b{batch} kv<=8192, next step", _ragged_steps(batch, 8192, 64))
    return results


def _baseline_tree(rev: str, into: str) -> str:
    """The packages of ``rev`` extracted under ``into``; returns the PYTHONPATH of their sources."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "packages"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.pathsep.join(str(p) for p in sorted(Path(into, "packages").glob("*/src")))


def _child(pythonpath: str, hostsim: str, scale: float) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, __file__, "--scale", str(scale), "--_child", hostsim],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _rounds(args) -> int:
    """--baseline with --rounds: both trees in child processes, alternating (see the docstring)."""
    this_path = os.pathsep.join(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    hostsim = str(ROOT / "packages/fi-attention/src/fi_attention/decode/hostsim.py")
    runs: dict[str, list] = {args.baseline: [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="fi-host-baseline-") as d:
        base_path = _baseline_tree(args.baseline, d)
        for r in range(args.rounds):
            order = [(args.baseline, base_path, hostsim), ("this tree", this_path, "")]
            for label, path, sim in order if r % 2 == 0 else order[::-1]:
                runs[label].append(_child(path, sim, args.scale))
    names = [k for k in runs["this tree"][0] if k != "launcher"]
    base_runs, this_runs = runs[args.baseline], runs["this tree"]
    print(f"host time per call, us (minimum over {args.rounds} alternating rounds); "
          f"launcher: {this_runs[0]['launcher']}")
    print(f"{'case':44}{args.baseline:>14}{'this tree':>14}{'base / this':>14}")
    table = {}
    for n in names:
        pairs = [(b[n][0], t[n][0]) for b, t in zip(base_runs, this_runs) if b.get(n) and t.get(n)]
        if not pairs:
            print(f"{n:44}{'-':>14}{min(t[n][0] for t in this_runs):>14.2f}{'-':>14}")
            continue
        base_min, this_min = min(p[0] for p in pairs), min(p[1] for p in pairs)
        ratio = statistics.median(b / t for b, t in pairs)
        table[n] = {"baseline_min_us": base_min, "this_min_us": this_min, "median_ratio": ratio}
        print(f"{n:44}{base_min:>14.2f}{this_min:>14.2f}{ratio:>14.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": args.baseline, "rounds": args.rounds,
                                               "cases": table, "runs": runs}, indent=1))
    return 0


def _cell(t) -> str:
    return "-" if t is None else f"{t[0]:.2f} / {t[1]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="REV", help="also measure this git revision (e.g. main)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the call counts (default 1)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --baseline: alternate both trees in child processes N times")
    ap.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    ap.add_argument("--_child", metavar="HOSTSIM", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child is not None:  # a baseline run: print the numbers for the parent
        print(json.dumps(measure(args._child or None, args.scale)))
        return 0
    if args.baseline and args.rounds > 0:
        return _rounds(args)
    sys.path[:0] = [str(p) for p in sorted(ROOT.glob("packages/*/src"))]  # measure this tree
    columns = {"this tree": measure(None, args.scale)}
    if args.baseline:
        hostsim = str(ROOT / "packages/fi-attention/src/fi_attention/decode/hostsim.py")
        with tempfile.TemporaryDirectory(prefix="fi-host-baseline-") as d:
            base = _child(_baseline_tree(args.baseline, d), hostsim, args.scale)
        columns = {args.baseline: base, **columns}
    names = [k for k in columns["this tree"] if k != "launcher"]
    print(f"host time per call, us (min / median); launcher: {columns['this tree']['launcher']}")
    head = "".join(f"{c:>22}" for c in columns)
    print(f"{'case':44}{head}")
    for n in names:
        cells = "".join(f"{_cell(col.get(n)):>22}" for col in columns.values())
        print(f"{n:44}{cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(columns, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
