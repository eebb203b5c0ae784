"""The `flashinfer` command line (fi-core provides it; the meta-package adds `demo`).

    flashinfer show-config [--check]
    flashinfer support [--arch 9.0a] [--op NAME] [--json]
    flashinfer cache ls|clear|verify
    flashinfer precompile [--arch ...] [--jobs N] [OP ...]
    flashinfer bench --routine NAME [--quick] [--out DIR] [--plot] | --list
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Sequence

from . import knobs


def _p(*a) -> None:
    print(*a, flush=True)


# ----- show-config -----------------------------------------------------------------------------

def cmd_show_config(args) -> int:
    import importlib.metadata as md  # noqa: PLC0415
    import platform  # noqa: PLC0415

    from .arch import device_count, device_info  # noqa: PLC0415
    from .families import FAMILIES, installed  # noqa: PLC0415
    from .jit import cache  # noqa: PLC0415
    from .jit.spec import cutlass_version, find_nvcc, nvcc_version  # noqa: PLC0415
    from .version import __version__  # noqa: PLC0415

    def ver(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "source checkout" if dist.startswith("fi") else "not installed"

    _p("== fi ==")
    _p(f"fi-core            {__version__}")
    for fam in FAMILIES:
        _p(f"{fam.dist:<18} {ver(fam.dist) if installed(fam) else 'not installed'}")
    _p("== environment ==")
    import torch  # noqa: PLC0415

    _p(f"python             {platform.python_version()}")
    _p(f"torch              {torch.__version__} (CUDA {torch.version.cuda})")
    _p(f"cuda-bindings      {ver('cuda-bindings')}")
    _p(f"nvidia-cutlass     {cutlass_version()}")
    nv = find_nvcc()
    _p(f"nvcc               {nvcc_version()} ({nv})" if nv
       else "nvcc               not found (only prebuilt/cached kernels can load)")
    _p("== GPU ==")
    n = device_count()
    if n == 0:
        from .arch import _init_driver  # noqa: PLC0415
        from .errors import NoGPUError  # noqa: PLC0415

        try:
            _init_driver()
        except NoGPUError as exc:
            _p(f"none: {exc}")
    for i in range(n):
        d = device_info(i)
        _p(f"[{i}] {d.name}: {d.arch}, {d.sm_count} SMs, {d.smem_per_block_optin // 1024} KiB smem/block, "
           f"{d.l2_bytes >> 20} MiB L2, {d.total_memory / 2**30:.0f} GiB, driver {d.driver_version}")
    _p("== kernel cache ==")
    try:
        root = cache.root()
        mods = cache.entries()
        _p(f"{root}: {len(mods)} module(s)")
    except Exception as exc:
        _p(f"unusable: {exc}")
    pre = _prebuilt_summary()
    _p(f"prebuilt modules   {pre or 'none'}")
    _p("== knobs ==")
    for name, value, _doc in knobs.describe():
        _p(f"{name:<26} {value}")
    if args.check:
        return _self_check()
    return 0


def _prebuilt_summary() -> str:
    import importlib.util  # noqa: PLC0415

    from .families import FAMILIES  # noqa: PLC0415

    parts = []
    for mod in ["fi_core", *(f.module for f in FAMILIES)]:
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            continue
        for loc in spec.submodule_search_locations:
            d = Path(loc) / "_prebuilt"
            if d.is_dir():
                n = sum(1 for x in d.iterdir() if x.is_dir())
                if n:
                    parts.append(f"{mod}: {n}")
    return ", ".join(parts)


def _self_check() -> int:
    from .arch import Arch, has_gpu  # noqa: PLC0415
    from .jit import build_many  # noqa: PLC0415
    from .selftest import run_check, selftest_spec  # noqa: PLC0415

    _p("== self-test ==")
    if has_gpu():
        _p(run_check())
        return 0
    t0 = time.time()
    build_many([selftest_spec(Arch.parse("9.0a"))])
    _p(f"no GPU: the self-test kernel compiled and cached for sm_90a in {time.time() - t0:.1f} s; "
       f"running it needs a CUDA GPU")
    return 0


# ----- support ---------------------------------------------------------------------------------

def cmd_support(args) -> int:
    from .arch import Arch, has_gpu, device_info  # noqa: PLC0415
    from .registry import support_matrix  # noqa: PLC0415

    arch = Arch.parse(args.arch) if args.arch else (device_info(0).arch if has_gpu() else None)
    rows = support_matrix(arch)
    if args.op:
        rows = [r for r in rows if r["op"] in args.op]
    if args.json:
        _p(json.dumps(rows, indent=1))
        return 0
    if not rows:
        _p("no ops registered (no fi family package installed?)")
        return 0
    cols = ["op", "family", "stability", "backend", "archs", "dtypes"] + (["on_arch"] if arch else [])
    header = {c: c for c in cols}
    if arch:
        header["on_arch"] = f"on {arch}"
    table = [header] + rows
    widths = {c: max(len(str(r.get(c, ""))) for r in table) for c in cols}
    _p(f"support matrix{' for ' + str(arch) if arch else ' (pass --arch to evaluate one)'}:")
    for r in table:
        _p("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    if any(r["backend"] == "reference" and r["archs"] != "cpu" for r in rows):
        _p("A 'reference' row that runs on GPUs is the pure-torch fallback: backend='auto' takes it on a GPU only "
           "when no kernel above it supports the call, and warns once (ReferenceFallbackWarning).")
    return 0


# ----- cache -----------------------------------------------------------------------------------

def cmd_cache(args) -> int:
    from .jit import cache  # noqa: PLC0415

    if args.action == "ls":
        rows = cache.entries()
        _p(f"{cache.root()}: {len(rows)} module(s)")
        for d, meta in rows:
            size = (d / cache.MODULE).stat().st_size if (d / cache.MODULE).exists() else 0
            arch = (meta or {}).get("spec", {}).get("arch", "?")
            built = (meta or {}).get("built_at", "?")
            _p(f"  {d.name:<48} {arch:<8} {size / 1024:8.0f} KiB  {built}")
        return 0
    if args.action == "clear":
        n = cache.clear()
        _p(f"removed {n} module(s) from {cache.root()}")
        return 0
    if args.action == "verify":
        bad = 0
        rows = cache.entries()
        for d, _ in rows:
            ok, why = cache.verify(d)
            if not ok:
                bad += 1
                _p(f"  BAD {d.name}: {why}")
        _p(f"{len(rows) - bad}/{len(rows)} module(s) verified in {cache.root()}")
        return 1 if bad else 0
    raise AssertionError(args.action)


# ----- precompile ------------------------------------------------------------------------------

def collect_specs(archs, ops: Sequence[str] = (), families: Sequence[str] = ()):
    from .registry import all_ops  # noqa: PLC0415
    from .selftest import selftest_spec  # noqa: PLC0415

    known = {o.name: o for o in all_ops()}
    unknown = [o for o in ops if o not in known]
    if unknown:
        raise SystemExit(f"unknown op(s) {unknown}; registered: {sorted(known)}")
    chosen = [known[o] for o in ops] if ops else list(known.values())
    if families:
        chosen = [o for o in chosen if o.family in families]
    specs = []
    for arch in archs:
        if not ops:
            specs.append(selftest_spec(arch))
        for op in chosen:
            if op.specs is None:
                continue
            for s in op.specs(arch):
                if s not in specs:
                    specs.append(s)
    return specs


def cmd_precompile(args) -> int:
    from .arch import archs_for_build  # noqa: PLC0415
    from .jit import build_many  # noqa: PLC0415

    archs = archs_for_build(args.arch)
    specs = collect_specs(archs, args.ops, args.family or ())
    _p(f"precompiling {len(specs)} module(s) for {' '.join(map(str, archs))} "
       f"with {args.jobs or knobs.max_jobs() or 'all'} job(s)")
    t0 = time.time()
    width = min(40, shutil.get_terminal_size((80, 20)).columns - 40)

    def progress(done: int, total: int, what: str) -> None:
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what[:30]:<30}")
        sys.stderr.flush()

    build_many(specs, jobs=args.jobs, progress=progress if sys.stderr.isatty() else None)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    _p(f"done in {time.time() - t0:.1f} s")
    return 0


# ----- bench -----------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    from . import bench  # noqa: PLC0415
    from .families import import_bench_routines  # noqa: PLC0415

    from . import bench_routines  # noqa: F401,PLC0415  (fi-core's own: launch overhead)

    import_bench_routines()
    if args.list or not args.routine:
        for r in sorted(bench.ROUTINES.values(), key=lambda r: (r.family, r.name)):
            _p(f"{r.name:<40} {r.family:<14} {r.help}")
        return 0
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        _p("flashinfer bench needs a CUDA GPU")
        return 2
    status = 0
    for name in args.routine:
        opts = dict(kv.split("=", 1) for kv in args.option)
        env, rows = bench.run_routine(name, bench.RoutineArgs(quick=args.quick, options=opts))
        _p(f"== {name} ({env.get('gpu')}, {env['date']}) ==")
        _p(bench.format_table(rows))
        out = Path(args.out) if args.out else Path("benchmarks/results") / bench.gpu_slug(env.get("gpu", "gpu"))
        path = bench.write_results(name, env, rows, out)
        _p(f"wrote {path}")
        if args.plot:
            _p(f"plot {bench.plot(name, rows, path.with_suffix('.png'))}")
    return status


# ----- main ------------------------------------------------------------------------------------

def build_parser(prog: str, extra: Sequence[Callable] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="fi kernel library (FlashInfer-compatible)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("show-config", help="versions, GPU, arch, cache, nvcc, prebuilt modules")
    s.add_argument("--check", action="store_true", help="also run the self-test kernel end to end")
    s.set_defaults(fn=cmd_show_config)

    s = sub.add_parser("support", help="op x backend x arch x dtype matrix from the registry")
    s.add_argument("--arch", help="evaluate for this arch (default: the current GPU)")
    s.add_argument("--op", action="append", help="only this op (repeatable)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_support)

    s = sub.add_parser("cache", help="inspect or clear the JIT kernel cache")
    s.add_argument("action", choices=["ls", "clear", "verify"])
    s.set_defaults(fn=cmd_cache)

    s = sub.add_parser("precompile", help="build kernels ahead of time into the cache")
    s.add_argument("--arch", action="append", help="target arch, e.g. 9.0a (repeatable; default "
                   "FI_CUDA_ARCH_LIST or the current GPU)")
    s.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes")
    s.add_argument("--family", action="append", help="only ops of this family, e.g. fi-sampling")
    s.add_argument("ops", nargs="*", help="ops to build (default: all registered)")
    s.set_defaults(fn=cmd_precompile)

    s = sub.add_parser("bench", help="run benchmark routines (GPU)")
    s.add_argument("--routine", action="append", help="routine name (repeatable)")
    s.add_argument("--list", action="store_true", help="list routines")
    s.add_argument("--quick", action="store_true", help="fewer configs")
    s.add_argument("--out", help="result directory (default benchmarks/results/<gpu>)")
    s.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    s.add_argument("--option", action="append", default=[], help="routine option key=value")
    s.set_defaults(fn=cmd_bench)

    for add in extra:
        add(sub)
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "fi-core",
         extra: Sequence[Callable] = ()) -> int:
    import logging  # noqa: PLC0415

    logging.basicConfig(level=getattr(logging, str(knobs.log_level()).upper(), logging.WARNING),
                        format="%(name)s: %(message)s")
    if knobs.log_dispatch():
        logging.getLogger("fi.dispatch").setLevel(logging.INFO)
    args = build_parser(prog, extra).parse_args(argv)
    from .errors import FIError  # noqa: PLC0415

    try:
        return int(args.fn(args) or 0)
    except FIError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
