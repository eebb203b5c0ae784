"""What the interleaved A/B tools (ab_fa3.py, ab_fa2.py, ab_gemv.py, ab_decode.py, ab_memops.py)
share: checking and capturing each (case, build), timing the captured CUDA graphs in turns, the
per-case report, and the JSON form tools/bench_summary.py renders.

Separate bench processes drift by several per cent on the lent H200, more than the changes being
compared; builds replayed in alternating order within one process see the same drift.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def arg_parser(doc: str, rounds: int, cases: str, warmup_s: float,
               calls: int | None = None) -> argparse.ArgumentParser:
    """The options every A/B tool takes: the builds, --rounds, --cases, --warmup-s, --build-only,
    --json and --label, with the tool's defaults; --calls (launches per graph replay) when the
    tool gives a default for it."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--cases", default=cases)
    ap.add_argument("--warmup-s", type=float, default=warmup_s, help="seconds of untimed replays first")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--label", default="builds compared", help="what the JSON file compares")
    if calls is not None:
        ap.add_argument("--calls", type=int, default=calls, help="launches per graph replay")
    return ap


def parse_builds(doc: str, cases: str, parse_build, rounds: int = 9, warmup_s: float = 2.0):
    """The command line of a tool whose builds are switch sets: (args, {build: parse_build(build)},
    case names)."""
    args = arg_parser(doc, rounds=rounds, cases=cases, warmup_s=warmup_s).parse_args()
    return args, {b: parse_build(b) for b in args.builds}, args.cases.split(",")


def build_only(specs) -> int:
    """--build-only: compile the modules the builds need (distinct specs, in one parallel build)
    into the kernel cache, say which, and return the exit status."""
    from fi_core.jit import build_many  # noqa: PLC0415

    specs = list({s.name: s for s in specs}.values())
    build_many(specs)
    print(f"built {len(specs)} modules: {' '.join(s.name for s in specs)}")
    return 0


def capture_checked(run, name: str, build: str, refs: dict, calls: int, tol: float = 2e-2):
    """A CUDA graph of ``calls`` runs of one (case, build). ``run()`` launches the case and returns
    its output; the first call (outside the capture: it loads the module) must match the first
    build's output of the case within ``tol`` (same math on the same inputs), or the tool stops."""
    agree(refs, name, build, run().float(), tol)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            run()
    return g


def agree(refs: dict, name: str, build: str, got, tol: float | None = None, relative: bool = False) -> None:
    """Every build's output ``got`` of case ``name`` must match the first checked build's: bit for
    bit (``tol`` None), or with its largest difference under ``tol`` (relative: divided by the
    first output's largest magnitude); NaN never matches and the tool stops otherwise. ``refs``
    keeps the first build's output per case."""
    if name not in refs:
        refs[name] = (build, got.clone())
        return
    first, ref = refs[name]
    err = (got - ref).abs().max().item()
    if relative:
        err /= max(ref.abs().max().item(), 1e-6)
    if not (err == 0 if tol is None else err < tol):
        raise SystemExit(f"build {build} differs from build {first} on {name}: {err:.3e}")


def capture_cycle(fn, sets: list, min_calls: int = 20):
    """A CUDA graph of ``fn(*set)`` cycling through the input sets (at least ``min_calls`` calls, a
    whole number of cycles). Returns (graph, calls)."""
    k = -(-max(min_calls, len(sets)) // len(sets)) * len(sets)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(k):
            fn(*sets[i % len(sets)])
    return g, k


def parse_switches(build: str) -> dict[str, int]:
    """A build's compile switches: ``0`` (none) or NAME=INT[,NAME=INT...], names upper-cased."""
    if build == "0":
        return {}
    out = {}
    for item in build.split(","):
        key, _, val = item.partition("=")
        if not key.isidentifier() or not val.lstrip("-").isdigit():
            raise SystemExit(f"build {build!r}: expected NAME=INT[,NAME=INT...], found {item!r}")
        out[key.upper()] = int(val)
    return out


def switch_build(build: str, switches, special: tuple = ()):
    """A tool's build: one of its ``special`` names (returned as is) or a switch set checked
    against the ``switches`` the tool knows ({} for the defaults)."""
    if build in special:
        return build
    sw = parse_switches(build)
    unknown = set(sw) - set(switches)
    if unknown:
        raise SystemExit(f"build {build!r}: unknown switch {sorted(unknown)}; known: {sorted(switches)}")
    return sw


def time_in_turns(graphs: dict, calls: dict, names: list, builds: list, rounds: int,
                  warmup_s: float) -> dict:
    """Per-call microseconds of every graph (key (case, build); ``calls[key]`` launches per
    replay) over ``rounds`` rounds, builds in alternating order, after ``warmup_s`` seconds of
    untimed replays (clocks ramp up under load). Returns {key: [us, ...]}."""
    times = {key: [] for key in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t_end = time.time() + warmup_s
    while time.time() < t_end:
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
    for r in range(rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for name in names:
            for b in order:
                g = graphs[(name, b)]
                g.replay()  # warm
                start.record()
                g.replay()
                end.record()
                end.synchronize()
                times[(name, b)].append(start.elapsed_time(end) * 1000 / calls[(name, b)])
    return times


def report(times: dict, names: list, builds: list, rate: dict, rate_key: str, rate_unit: str,
           width: int) -> dict:
    """Prints a line per case (each build's median, its rate and its speed-up over the first
    build: the median over rounds of the per-round ratios, steadier than a ratio of medians) and
    returns the cases in JSON form. ``rate[name]`` is work per microsecond of time (bytes / 1e6
    for TB/s, flops / 1e6 for TFLOP/s), stored under ``rate_key``."""
    result = {}
    for name in names:
        med = {b: statistics.median(times[(name, b)]) for b in builds}
        t0 = times[(name, builds[0])]
        paired = {b: statistics.median(a / c for a, c in zip(t0, times[(name, b)])) for b in builds}
        cells = "  ".join(f"[{b}] {med[b]:9.2f} us {rate[name] / med[b]:7.2f} {rate_unit} x{paired[b]:.3f}"
                          for b in builds)
        print(f"{name:{width}s} {cells}")
        result[name] = {b: {"median_us": med[b], "all_us": times[(name, b)], "paired_speedup": paired[b],
                            rate_key: rate[name] / med[b]} for b in builds}
    return result


def write_json(path: str, tool: str, what: str, label: str, note: str, builds: list, cases: dict) -> None:
    """The result file: routine "<what> A/B (tools/<tool>): <label>", the command line, the GPU."""
    env = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "command": f"python3 tools/{tool} " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(), "note": note}
    Path(path).write_text(json.dumps({"routine": f"{what} A/B (tools/{tool}): {label}", "environment": env,
                                      "builds": builds, "cases": cases}, indent=1))


def measure(args, graphs: dict, calls: dict, names: list, rate: dict, rate_key: str, rate_unit: str,
            width: int, tool: str, what: str, note: str) -> dict:
    """A tool's whole timing step: the graphs timed in turns (args.rounds, args.warmup_s), the report
    printed, and with args.json the result file written. Returns the cases in JSON form."""
    times = time_in_turns(graphs, calls, names, args.builds, args.rounds, args.warmup_s)
    result = report(times, names, args.builds, rate, rate_key, rate_unit, width)
    if args.json:
        write_json(args.json, tool, what, args.label, note, args.builds, result)
    return result
