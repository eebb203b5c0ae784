"""Ahead-of-time kernels for wheels (FI_AOT=1).

`build_prebuilt(family_module, dest)` imports the family, collects the representative kernel
variants its ops declare (OpInfo.specs) for every arch of FI_CUDA_ARCH_LIST, builds them in one
parallel ninja run, and copies each module to ``dest/<name>-<source_key16>/`` (module.so +
meta.json). The loader looks there before the JIT cache; the source key ignores the compiler
version, so a wheel built with any nvcc serves users without one.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Optional
from collections.abc import Sequence

from .arch import Arch, archs_for_build
from .jit import build_many
from .registry import OPS


def specs_of_family(family_module: str, archs: Sequence[Arch]) -> list:
    importlib.import_module(family_module)
    prefix = family_module.split(".")[0]
    specs = []
    for op in OPS.values():
        if op.specs is None:
            continue
        for arch in archs:
            for s in op.specs(arch):
                if s.package.split(".")[0] == prefix and s not in specs:
                    specs.append(s)
    return specs


def build_prebuilt(family_module: str, dest: Path, archs: Optional[Sequence[str]] = None,
                   jobs: Optional[int] = None) -> list[Path]:
    targets = archs_for_build(archs)
    specs = specs_of_family(family_module, targets)
    dirs = build_many(specs, jobs=jobs)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for s, d in zip(specs, dirs):
        target = dest / s.prebuilt_dirname
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
        for f in ("module.so", "meta.json"):
            shutil.copy2(d / f, target / f)
        out.append(target)
    return out
