"""Build KernelSpecs with nvcc driven by ninja.

Each spec gets its own ``build.ninja`` (kept in the module directory, so a build can be replayed by
hand); many specs build in one ninja run through a top-level file that ``subninja``s them, so
``flashinfer precompile`` and test warm-up use every core. Each spec builds in a private temporary
directory and is renamed into the cache under its key's lock once complete.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Sequence

from .. import knobs
from ..errors import CompileError, KernelUnavailableError
from . import cache
from .spec import COMMON_SOURCE, KernelSpec, base_nvcc_flags, find_nvcc, nvcc_version

ProgressFn = Callable[[int, int, str], None]

_PTXAS_FN = re.compile(r"ptxas info\s*: (?:Compiling entry function|Function properties for) '?([^' ]+)'?")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def ninja_path() -> str:
    try:
        import ninja  # noqa: PLC0415

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.is_file():
            return str(cand)
    except Exception:
        pass
    found = shutil.which("ninja")
    if not found:
        raise KernelUnavailableError("ninja is not installed: pip install ninja")
    return found


def require_nvcc() -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelUnavailableError(
            "this kernel is not prebuilt for your GPU and not in the kernel cache, and nvcc was not "
            "found to compile it. Install the CUDA toolkit (nvcc >= 12.4; set CUDA_HOME or FI_NVCC), "
            "or install a prebuilt wheel built with FI_AOT=1 for your architecture.")
    if knobs.no_jit():
        raise KernelUnavailableError("FI_NO_JIT=1 forbids compiling kernels at run time")
    return nvcc


def compile_command(spec: KernelSpec, src: Path, obj: Path, nvcc: Path) -> list[str]:
    # FI_TARGET_CC (e.g. 90) tells the host code of a module which GPU it is built for, where
    # __CUDA_ARCH__ exists only in device code: a launcher that uses an sm_90 feature (clusters)
    # decides at compile time. It is a function of spec.arch, which the cache key covers.
    cmd = [str(nvcc), *base_nvcc_flags(), spec.arch.gencode, f"-DFI_TARGET_CC={spec.arch.cc}"]
    for d in spec.search_dirs():
        cmd += ["-I", str(d)]
    cmd += [f"-D{k}={v}" if v != "" else f"-D{k}" for k, v in spec.defines]
    cmd += list(spec.flags)
    cmd += ["-c", str(src), "-o", str(obj)]
    return cmd


def link_command(objs: Sequence[Path], out: Path, nvcc: Path, spec: KernelSpec) -> list[str]:
    return [str(nvcc), "-shared", spec.arch.gencode, *map(str, objs), "-o", str(out)]


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def write_spec_ninja(spec: KernelSpec, build_dir: Path, nvcc: Path) -> tuple[Path, list[str]]:
    """Write build_dir/build.ninja for one spec; returns its path and the compile commands."""
    lines = ["ninja_required_version = 1.3", ""]
    sources = [*spec.sources, COMMON_SOURCE]
    objs: list[Path] = []
    cmds: list[str] = []
    rule = f"nvcc_{build_dir.name.replace('.', '_').replace('-', '_')}"
    lines += [
        f"rule {rule}",
        # The log of each compile (ptxas report) is kept beside the object and echoed, so a
        # failure shows it and a success leaves it for meta.json.
        "  command = $cmd > $out.log 2>&1; rc=$$?; cat $out.log; exit $$rc",
        "  description = nvcc $desc",
        "",
        f"rule link_{rule}",
        "  command = $cmd",
        "  description = link $desc",
        "",
    ]
    for i, src in enumerate(sources):
        obj = build_dir / f"{i}_{src.stem}.o"
        objs.append(obj)
        cmd = compile_command(spec, src, obj, nvcc)
        cmds.append(shlex.join(cmd))
        lines += [
            f"build {_ninja_escape(str(obj))}: {rule} {_ninja_escape(str(src))}",
            f"  cmd = {shlex.join(cmd).replace('$', '$$')}",
            f"  desc = {spec.name}[{spec.arch}] {src.name}",
        ]
    so = build_dir / cache.MODULE
    link = link_command(objs, so, nvcc, spec)
    cmds.append(shlex.join(link))
    lines += [
        f"build {_ninja_escape(str(so))}: link_{rule} {' '.join(_ninja_escape(str(o)) for o in objs)}",
        f"  cmd = {shlex.join(link).replace('$', '$$')}",
        f"  desc = {spec.name}[{spec.arch}]",
        "",
    ]
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines))
    return path, cmds


def parse_ptxas(log: str) -> dict:
    """Per-kernel register/stack/spill/smem numbers and warnings from `ptxas -v` output."""
    kernels: dict[str, dict] = {}
    current: Optional[str] = None
    warnings = []
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {})
        if "warning" in line.lower() and "ptxas" in line.lower():
            warnings.append(line.strip())
        if current is None:
            continue
        if (m := _PTXAS_USED.search(line)):
            kernels[current]["registers"] = int(m.group(1))
            if (s := _PTXAS_SMEM.search(line)):
                kernels[current]["smem"] = int(s.group(1))
        if (m := _PTXAS_SPILL.search(line)):
            kernels[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                    spill_loads=int(m.group(3)))
    return {"kernels": kernels, "warnings": warnings}


def spill_problems(spec, kernels: dict[str, dict]) -> tuple[list[str], str]:
    """Spills in a module's ptxas report (``kernels``: parse_ptxas()["kernels"], as meta.json
    stores it) beyond the spec's ``spill_budget`` (0 unless the spec declares a measured
    exception), and a note of the spills the budget let through. Used by tools/compile_check.py
    and tools/fa2_spill_audit.py."""
    budget = getattr(spec, "spill_budget", 0)
    problems, allowed = [], []
    for fn, k in kernels.items():
        st, ld = k.get("spill_stores", 0), k.get("spill_loads", 0)
        if max(st, ld) > budget:
            problems.append(f"{spec.name}[{spec.arch}] {fn}: {st} B spill stores, {ld} B spill loads"
                            f"{f' (budget {budget} B)' if budget else ''}")
        elif st or ld:
            allowed.append(f"{max(st, ld)} B spills within its budget of {budget} B")
    return problems, "; ".join(allowed)


def _max_jobs() -> int:
    return knobs.max_jobs() or os.cpu_count() or 1


def build_many(specs: Sequence[KernelSpec], *, jobs: Optional[int] = None,
               progress: Optional[ProgressFn] = None, force: bool = False,
               built: Optional[set] = None) -> list[Path]:
    """Make sure every spec is in the cache; build the missing ones in one ninja run.

    Returns the module directories in the order of ``specs``. Concurrent callers (one process per
    GPU rank) serialise on per-key locks and re-check after acquiring, so each module is built once.
    `built`, if given, receives the dirnames this call compiled (not those another process did).
    """
    unique: dict[str, KernelSpec] = {}
    for s in specs:
        unique.setdefault(s.dirname, s)
    # Locks are taken in sorted order so two processes building overlapping sets cannot deadlock.
    names = sorted(unique)
    stack = []
    try:
        todo: list[KernelSpec] = []
        for name in names:
            if not force:
                ok, _ = cache.verify(cache.module_dir(name))
                if ok:
                    continue
            lk = cache.lock(name)
            lk.__enter__()
            stack.append(lk)
            ok, _ = cache.verify(cache.module_dir(name))
            if force or not ok:
                todo.append(unique[name])
        if todo:
            _build_locked(todo, jobs=jobs, progress=progress)
            if built is not None:
                built.update(s.dirname for s in todo)
    finally:
        for lk in reversed(stack):
            lk.__exit__(None, None, None)
    return [cache.module_dir(s.dirname) for s in specs]


def _build_locked(specs: list[KernelSpec], *, jobs: Optional[int], progress: Optional[ProgressFn]):
    nvcc = require_nvcc()
    ninja = ninja_path()
    dirs: dict[str, Path] = {}
    cmds: dict[str, list[str]] = {}
    top_lines = ["ninja_required_version = 1.3", ""]
    for s in specs:
        d = cache.new_build_dir(s.dirname)
        dirs[s.dirname] = d
        path, cmds[s.dirname] = write_spec_ninja(s, d, nvcc)
        top_lines.append(f"subninja {_ninja_escape(str(path))}")
    top = Path(tempfile.mkdtemp(prefix="ninja.", dir=cache.root() / "tmp"))
    (top / "build.ninja").write_text("\n".join(top_lines) + "\n")
    t0 = time.time()
    try:
        proc = subprocess.Popen(
            [ninja, "-f", str(top / "build.ninja"), "-j", str(jobs or _max_jobs()), "-k", "0"],
            cwd=top, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "NINJA_STATUS": "[%f/%t] "})
        out_lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            out_lines.append(line)
            if knobs.verbose_build():
                sys.stderr.write(line)
            m = re.match(r"\[(\d+)/(\d+)\] (.*)", line)
            if m and progress is not None:
                progress(int(m.group(1)), int(m.group(2)), m.group(3).strip())
        rc = proc.wait()
        output = "".join(out_lines)
        if rc != 0:
            failed = [s for s in specs if not (dirs[s.dirname] / cache.MODULE).is_file()]
            first = failed[0] if failed else specs[0]
            raise CompileError(
                f"nvcc failed building {', '.join(f'{s.name}[{s.arch}]' for s in failed) or 'modules'}",
                command="\n".join(cmds[first.dirname]), log=output)
        elapsed = time.time() - t0
        for s in specs:
            d = dirs[s.dirname]
            log = "\n".join(p.read_text(errors="replace") for p in sorted(d.glob("*.o.log")))
            so = d / cache.MODULE
            os.chmod(so, 0o700)
            meta = {
                "spec": s.describe(), "key": s.key(), "source_key": s.source_key(),
                "nvcc": nvcc_version(), "commands": cmds[s.dirname], "ptxas": parse_ptxas(log),
                "checksum": cache.sha256_file(so), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "batch_seconds": round(elapsed, 2),
            }
            for junk in list(d.glob("*.o")) + list(d.glob("*.o.log")):
                junk.unlink()
            (d / cache.META).write_text(json.dumps(meta, indent=1))
            cache.install(d, s.dirname)
    finally:
        shutil.rmtree(top, ignore_errors=True)
        for d in dirs.values():
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
