#!/usr/bin/env python3
"""AOT check: build a family's wheel with FI_AOT=1, install it into an empty directory, and load
every representative kernel of the family from a process that has no nvcc and FI_NO_JIT=1. Every
module must come from the wheel's _prebuilt/ directory.

    python tools/aot_check.py [--package fi-sampling] [--arch 9.0a]

Needs hatchling and nvcc here (the wheel build compiles); the loading process gets neither.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOADER = """
import importlib, sys
from fi_core.arch import Arch
from fi_core.jit import loader
from fi_core.registry import OPS
mod = importlib.import_module({module!r})
assert mod.__file__.startswith({site!r}), mod.__file__
n = 0
for op in OPS.values():
    if op.family != {dist!r} or op.specs is None:
        continue
    for spec in op.specs(Arch.parse({arch!r})):
        m = loader.load(spec)
        assert m.origin == "prebuilt", (spec.name, m.origin)
        n += 1
print(f"{{n}} module loads, all from the wheel's _prebuilt/")
assert n > 0
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", default="fi-sampling")
    ap.add_argument("--arch", default="9.0a")
    args = ap.parse_args()
    module = args.package.replace("-", "_")
    pkg_dir = ROOT / "packages" / args.package
    src_paths = ":".join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Child environments are explicit: the build sees nvcc on PATH, the loader sees nothing.
        env_build = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": src_paths, "FI_AOT": "1",
                     "FI_CUDA_ARCH_LIST": args.arch, "FI_CACHE_DIR": str(tmp / "cache"), "HOME": str(tmp)}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                        str(pkg_dir), "-w", str(tmp / "wheel")], check=True, env=env_build)
        prebuilt = pkg_dir / "src" / module / "_prebuilt"
        if prebuilt.exists():  # the hook writes into the source tree; keep the checkout clean
            shutil.rmtree(prebuilt)
        wheels = list((tmp / "wheel").glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp / "site"), *map(str, wheels)], check=True)
        env_load = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp / 'site'}:{ROOT / 'packages/fi-core/src'}",
                    "FI_NO_JIT": "1", "FI_NVCC": "/nonexistent", "FI_CACHE_DIR": str(tmp / "empty-cache"),
                    "HOME": str(tmp)}
        code = LOADER.format(module=module, site=str(tmp / "site"), dist=args.package, arch=args.arch)
        out = subprocess.run([sys.executable, "-c", code], env=env_load, capture_output=True, text=True)
        sys.stdout.write(out.stdout)
        if out.returncode != 0:
            sys.stdout.write(out.stderr)
            print(f"AOT check FAILED for {args.package}")
            return 1
    print(f"AOT check passed for {args.package} ({args.arch})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
