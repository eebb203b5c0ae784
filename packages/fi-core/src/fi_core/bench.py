"""The one benchmark harness: CUDA events over graph replays, L2-rotated inputs, median/min/max,
TB/s or TFLOP/s against the measured ceiling, the baseline in the same run, JSON results.

A compute-bound row names its ceiling (``BenchRow(..., ceiling="gemm16")``); the harness then
times that ceiling once in the same process, after the routine's rows, and reports the row's
TFLOP/s as a percentage of it (``pct_of_ceiling``, the table's ``%ceil``): shared/TARGETS.md asks
for compute-bound kernels "as % of the cuBLAS number measured in the same run".

A family registers routines in its ``bench.py``::

    @routine("rmsnorm", family="fi-sampling", help="rmsnorm vs torch F.rms_norm")
    def rmsnorm_routine(args: RoutineArgs):
        sets = rotating_inputs(lambda i: (x_i, w), device)      # > 2x L2 of distinct data
        check_against_reference(...)                            # correctness before timing
        ours = time_fn(lambda x, w: rmsnorm(x, w), sets)
        base = time_fn(lambda x, w: F.rms_norm(x, (n,), w), sets)
        yield BenchRow("rmsnorm", "8192x8192 bf16", ours, bytes=..., baseline=("F.rms_norm", base))

`flashinfer bench --routine rmsnorm` runs it, prints a table and writes
``benchmarks/results/<gpu>/<routine>.json``.

A/B runs in one process: :func:`apply_tuning` sets integer compile-time tuning values from routine
options; :func:`config_choices`, :func:`with_config` and :func:`checked` run a routine's rows once
per named configuration (``--option fp8_large=A+B``), each checked against the reference first.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from collections.abc import Callable, Iterable, Sequence

import torch

from .errors import InputError

# Measured on the H200 (shared/TARGETS.md); percentages of bandwidth are against the datasheet.
HBM_PEAK_TBPS = {"H200": 4.8, "H100": 3.35}
COPY_CEILING_TBPS = {"H200": 4.25}


@dataclass
class Timing:
    median_us: float
    min_us: float
    max_us: float
    samples: int
    method: str  # "graph" | "events"

    def to_dict(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class BenchRow:
    routine: str
    config: str
    ours: Timing
    bytes: Optional[float] = None
    flops: Optional[float] = None
    baseline: Optional[tuple[str, Timing]] = None
    target_us: Optional[float] = None
    backend: str = ""
    extra: dict = field(default_factory=dict)
    ceiling: Optional[str] = None  # a key of CEILINGS: the measured compute ceiling of this row

    def metrics(self, gpu: str = "", ceilings: Optional[dict] = None) -> dict:
        """The row as JSON. ``ceilings`` maps a CEILINGS key to ``(label, TFLOP/s)`` measured in
        this run; a row that names one of them gets ``ceiling`` and ``pct_of_ceiling``."""
        t = self.ours.median_us * 1e-6
        d: dict[str, Any] = {"routine": self.routine, "config": self.config,
                             "backend": self.backend, "ours": self.ours.to_dict()}
        if self.bytes:
            tbps = self.bytes / t / 1e12
            d["tb_s"] = round(tbps, 3)
            peak = _lookup(HBM_PEAK_TBPS, gpu)
            if peak:
                d["pct_of_hbm_peak"] = round(100 * tbps / peak, 1)
        if self.flops:
            tflops = self.flops / t / 1e12
            d["tflop_s"] = round(tflops, 1)
            if self.ceiling and ceilings and self.ceiling in ceilings:
                label, top = ceilings[self.ceiling]
                d["ceiling"] = {"name": label, "tflop_s": round(top, 1)}
                d["pct_of_ceiling"] = round(100 * tflops / top, 1)
        if self.baseline is not None:
            name, bt = self.baseline
            d["baseline"] = {"name": name, **bt.to_dict()}
            d["speedup_vs_baseline"] = round(bt.median_us / self.ours.median_us, 3)
            if self.flops:
                d["baseline"]["tflop_s"] = round(self.flops / (bt.median_us * 1e-6) / 1e12, 1)
        if self.target_us is not None:
            d["target_us"] = self.target_us
            d["meets_target"] = self.ours.median_us <= self.target_us
        d.update(self.extra)
        return d


def _lookup(table: dict, gpu: str):
    for k, v in table.items():
        if k in gpu:
            return v
    return None


@dataclass
class RoutineArgs:
    quick: bool = False
    device: str = "cuda"
    options: dict = field(default_factory=dict)


@dataclass
class Routine:
    name: str
    family: str
    fn: Callable[[RoutineArgs], Iterable[BenchRow]]
    help: str = ""


ROUTINES: dict[str, Routine] = {}


def routine(name: str, family: str, help: str = ""):
    def deco(fn):
        ROUTINES[name] = Routine(name, family, fn, help)
        return fn
    return deco


def apply_tuning(args: RoutineArgs, module, names: dict[str, str], *caches) -> str:
    """A/B runs of compile-time tuning values: for each routine option in ``names`` (option ->
    integer attribute of an op's ``spec`` module, e.g. ``{"fused_nv": "FUSED_NV"}``) that was given,
    set the attribute and clear ``caches`` (the spec functions' ``functools.cache``) so the next call
    builds that module. Returns the label suffix for the rows' config, "" when no option was given.

    >>> apply_tuning(RoutineArgs(options={"fused_nv": "2"}), spec, {"fused_nv": "FUSED_NV"},
    ...              spec.norm_spec)  # doctest: +SKIP
    ' [fused_nv=2]'
    """
    given = [o for o in names if o in args.options]
    for o in given:
        setattr(module, names[o], int(args.options[o]))
    if given:
        for c in caches:
            c.cache_clear()
    return " [" + " ".join(f"{o}={args.options[o]}" for o in given) + "]" if given else ""


def config_choices(args: RoutineArgs, option: str, table: dict) -> list[str]:
    """Unit names an A/B run asked for with ``--option OPTION=NAME[+NAME...]``, each a key of
    `table`; [] when the option was not given. (apply_tuning sets integer tuning values; these
    options name whole configurations, e.g. fi-gemm's CUTLASS tile units.)"""
    if option not in args.options:
        return []
    names = [v for v in args.options[option].split("+") if v]
    unknown = [v for v in names if v not in table]
    if unknown or not names:
        raise InputError(f"{option} must name one or more ('+'-joined) of {sorted(table)}, "
                         f"got {args.options[option]!r}")
    return names


def checked(ab_label: str, check, *args) -> bool:
    """Run check(*args), a reference check. In an A/B run (`ab_label`: the candidate's row label)
    a candidate that fails it (a wrong result, or a unit the kernel library rejects) is reported on stdout and
    not timed, so the other candidates' rows survive; otherwise a failure propagates as usual."""
    if not ab_label:
        check(*args)
        return True
    try:
        check(*args)
    except Exception as exc:  # reported here; the candidate gets no row
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"{ab_label}: not timed, {type(exc).__name__}: {first}", flush=True)
        return False
    return True


def with_config(module, attr: str, option: str, names: list[str]):
    """For each name: set module.attr to it and yield the rows' label suffix; the attribute is
    restored afterwards. With no names, one pass with the default and no suffix."""
    if not names:
        yield ""
        return
    saved = getattr(module, attr)
    try:
        for name in names:
            setattr(module, attr, name)
            yield f" [{option}={name}]"
    finally:
        setattr(module, attr, saved)


def l2_bytes(device=None) -> int:
    try:
        from .arch import device_info  # noqa: PLC0415

        idx = torch.device(device).index if device is not None else None
        return device_info(idx or 0).l2_bytes
    except Exception:
        return 64 << 20


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def rotating_inputs(make: Callable[[int], Any], device=None, min_sets: int = 2,
                    max_sets: int = 64) -> list:
    """Distinct input sets whose total size is >= 3x L2, so timing sees HBM, not cache."""
    first = make(0)
    per = max(tensor_bytes(first), 1)
    n = max(min_sets, min(max_sets, -(-3 * l2_bytes(device) // per)))
    return [first] + [make(i) for i in range(1, n)]


def time_fn(fn: Callable, inputs: Sequence[Any], *, use_graph: bool = True, reps: int = 30,
            warmup: int = 3, min_calls_per_replay: int = 20, settle_s: float = 0.0) -> Timing:
    """Time fn(*inputs[i]) per call. Calls cycle through `inputs`; a CUDA graph of K calls is
    captured and replayed `reps` times, each replay timed with events; K >= min_calls_per_replay.
    Falls back to an event-timed eager loop when fn cannot be captured.

    ``settle_s``: seconds of idle GPU before the first call, so the measurement does not start
    inside the power-capped state that heavy work timed just before it leaves behind (H200: the
    SM clock stays at 1590-1620 MHz for a fraction of a second after the board's 700 W cap, and a
    latency-bound decode step runs 12 % slower there; benchmarks/notes.md, session 34)."""
    sets = [s if isinstance(s, (tuple, list)) else (s,) for s in inputs]
    k = max(min_calls_per_replay, len(sets))
    k = -(-k // len(sets)) * len(sets)
    if settle_s > 0:
        torch.cuda.synchronize()
        time.sleep(settle_s)
    for _ in range(warmup):
        for s in sets:
            fn(*s)
    torch.cuda.synchronize()
    if use_graph:
        try:
            return _time_graph(fn, sets, k, reps)
        except Exception:
            torch.cuda.synchronize()
    return _time_eager(fn, sets, k, reps)


def _time_graph(fn, sets, k, reps) -> Timing:
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*sets[0])  # a warm-up on the capture stream (allocator pools, lazy init)
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=stream):
        for i in range(k):
            fn(*sets[i % len(sets)])
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / k)
    return Timing(statistics.median(times), min(times), max(times), reps, "graph")


def _time_eager(fn, sets, k, reps) -> Timing:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(k):
            fn(*sets[i % len(sets)])
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / k)
    return Timing(statistics.median(times), min(times), max(times), reps, "events")


def time_host(fn: Callable[[], Any], iters: int = 2000, warmup: int = 200) -> float:
    """Host time per call in microseconds (median of 5 batches), for launch-overhead numbers."""
    return time_host_stats(fn, iters, warmup)[0]


def time_host_stats(fn: Callable[[], Any], iters: int = 2000, warmup: int = 200,
                    batches: int = 5) -> tuple[float, float, float]:
    """Host time per call in microseconds: (median, minimum, maximum) of the mean call time of ``batches``
    batches of ``iters`` calls, the device synchronised between batches.

    The lent H200's host changes speed by up to 1.8x within seconds, evenly for Python, numpy
    and CUDA driver calls (benchmarks/results/h200/probe_plan_dist_session12.txt): the median is
    what this run saw, the minimum what the code costs when the host runs at full speed.
    """
    return time_host_interleaved({0: fn}, iters, warmup, batches)[0]


def time_host_interleaved(fns: dict, iters: int = 200, warmup: int = 20,
                          batches: int = 7) -> dict:
    """:func:`time_host_stats` of several functions whose batches take turns (batch i of every
    function, then batch i + 1), so that a slow spell of the host lands on one batch of each
    instead of on every batch of one. Returns {name: (median, minimum, maximum)}."""
    import time  # noqa: PLC0415

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    means: dict = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            means[name].append((time.perf_counter() - t0) / iters * 1e6)
            torch.cuda.synchronize()
    return {name: (statistics.median(m), min(m), max(m)) for name, m in means.items()}


def environment() -> dict:
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": _command_line(),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "host": platform.node(),
    }
    try:
        from .arch import device_info  # noqa: PLC0415

        info = device_info(0)
        env.update(gpu=info.name, arch=str(info.arch), sm_count=info.sm_count,
                   cuda_driver_api=info.driver_version, l2_bytes=info.l2_bytes)
    except Exception as exc:
        env["gpu"] = f"none ({exc})"
    try:
        import pynvml  # noqa: PLC0415  (nvidia-ml-py, when present)

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        env["driver"] = drv.decode() if isinstance(drv, bytes) else drv
    except Exception:
        env["driver"] = "unknown"
    from .version import __version__  # noqa: PLC0415

    env["fi_core"] = __version__
    return env


def _command_line() -> str:
    prog = os.path.basename(sys.argv[0])
    if prog == "__main__.py":
        prog = "python3 -m " + os.path.basename(os.path.dirname(sys.argv[0]))
    return " ".join([prog] + sys.argv[1:])


def gpu_slug(name: str) -> str:
    m = re.search(r"(H200|H100|A100|L40S|B200|GB200|RTX ?\w+)", name)
    return (m.group(1) if m else re.sub(r"\W+", "-", name)).lower().replace(" ", "")


# The product size of the compute ceiling: large enough that cuBLAS runs at its sustained rate
# (1.1 TFLOP, ~1.6 ms on an H100 / H200), small enough (4 x 128 MiB of operands) for any GPU.
GEMM16_CEILING_N = 8192
# Warm-up passes and timed replays of the ceiling: ~0.3 s of products first, then ~0.5 s timed,
# so it reads the board at its power cap. Ten replays straight after lighter work read a cool
# board instead: 675-781 TFLOP/s on one H100 in a row of runs, against 680-693 with 60 replays
# (benchmarks/results/h100/gemm16_ceiling_probe_session56.txt).
GEMM16_CEILING_WARMUP, GEMM16_CEILING_REPS = 100, 40


def gemm16_ceiling(device: str = "cuda") -> tuple[str, float]:
    """The dense 16-bit tensor-core ceiling as this GPU sustains it now: cuBLAS (``torch.matmul``)
    on bf16 8192 x 8192 x 8192 products, random L2-rotated operands (a product of zeros runs
    faster than one of real data), graph replays timed like every row after a warm-up long enough
    to reach the power cap. Returns (label, TFLOP/s)."""
    from .testing import randn  # noqa: PLC0415

    n = GEMM16_CEILING_N
    sets = rotating_inputs(lambda i: (randn((n, n), torch.bfloat16, device, seed=2 * i),
                                      randn((n, n), torch.bfloat16, device, seed=2 * i + 1)), device)
    t = time_fn(lambda a, b: a @ b, sets, reps=GEMM16_CEILING_REPS, warmup=GEMM16_CEILING_WARMUP,
                min_calls_per_replay=8)
    return f"cuBLAS bf16 {n}^3", 2.0 * n ** 3 / (t.median_us * 1e-6) / 1e12


CEILINGS: dict[str, Callable[[str], tuple[str, float]]] = {"gemm16": gemm16_ceiling}


def measure_ceilings(rows: Sequence[BenchRow], args: RoutineArgs) -> dict:
    """Time each ceiling the rows name, once (``--option ceiling=off`` skips them)."""
    if args.options.get("ceiling", "on") == "off":
        return {}
    wanted = dict.fromkeys(r.ceiling for r in rows if r.ceiling and r.flops)
    unknown = [c for c in wanted if c not in CEILINGS]
    if unknown:
        raise KeyError(f"unknown ceiling {unknown[0]!r} in a bench row; known: {sorted(CEILINGS)}")
    return {c: CEILINGS[c](args.device) for c in wanted}


def run_routine(name: str, args: RoutineArgs) -> tuple[dict, list[dict]]:
    if name not in ROUTINES:
        raise KeyError(f"unknown routine {name!r}; known: {sorted(ROUTINES)}")
    env = environment()
    rows = list(ROUTINES[name].fn(args))
    ceilings = measure_ceilings(rows, args)
    return env, [r.metrics(env.get("gpu", ""), ceilings) for r in rows]


def write_results(name: str, env: dict, rows: list[dict], outdir: Path) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    path = outdir / f"{name}.json"
    path.write_text(json.dumps({"routine": name, "environment": env, "results": rows}, indent=1))
    return path


def format_table(rows: list[dict]) -> str:
    head = ["config", "ours us", "TB/s", "%HBM", "TFLOP/s", "%ceil", "baseline", "base us", "speedup",
            "target"]
    lines = [head]
    for r in rows:
        b = r.get("baseline") or {}
        lines.append([
            r["config"], f"{r['ours']['median_us']:.2f}", _fmt(r.get("tb_s")),
            _fmt(r.get("pct_of_hbm_peak")), _fmt(r.get("tflop_s")), _fmt(r.get("pct_of_ceiling")),
            b.get("name", ""),
            _fmt(b.get("median_us")), _fmt(r.get("speedup_vs_baseline")),
            "" if "target_us" not in r else f"{r['target_us']} {'ok' if r['meets_target'] else 'MISS'}",
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines)
    ceilings = {r["ceiling"]["name"]: r["ceiling"]["tflop_s"] for r in rows if "ceiling" in r}
    return text + "".join(f"\n%ceil: of {k} at {v:.1f} TFLOP/s, same run" for k, v in ceilings.items())


def _fmt(v) -> str:
    return "" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def plot(name: str, rows: list[dict], path: Path) -> Path:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [r["config"] for r in rows]
    ours = [r["ours"]["median_us"] for r in rows]
    base = [(r.get("baseline") or {}).get("median_us") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="fi")
    if any(b is not None for b in base):
        ax.bar([x + 0.2 for x in xs], [b or 0 for b in base], width=0.4, label="baseline")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time (us, median)")
    ax.set_title(name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
