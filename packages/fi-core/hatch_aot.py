"""Hatchling build hook shared by every fi package: with FI_AOT=1, compile the package's declared
kernel variants for FI_CUDA_ARCH_LIST into the wheel (src/<module>/_prebuilt/).

Used from each package's pyproject.toml:

    [tool.hatch.build.targets.wheel.hooks.custom]
    path = "../fi-core/hatch_aot.py"

An AOT build needs fi-core, torch and nvcc in the build environment:
    FI_AOT=1 FI_CUDA_ARCH_LIST="8.0 9.0a" pip wheel --no-build-isolation --no-deps packages/fi-sampling
Without FI_AOT the hook does nothing and imports nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class FiAotHook(BuildHookInterface):
    PLUGIN_NAME = "fi-aot"

    def initialize(self, version, build_data):
        here = Path(__file__).resolve().parent
        core_src = here / "src"
        if core_src.is_dir() and str(core_src) not in sys.path:
            sys.path.insert(0, str(core_src))
        try:
            from fi_core import knobs
        except ImportError as exc:  # fi-core is not importable: only a problem for AOT builds
            knobs = None
            missing = exc
        if knobs is None or not knobs.aot():
            if knobs is None and self._aot_requested():
                raise RuntimeError(f"FI_AOT=1 needs fi-core importable in the build env: {missing}")
            return
        from fi_core.aot import build_prebuilt

        root = Path(self.root)
        src = root / "src"
        modules = [p.name for p in src.iterdir() if (p / "__init__.py").is_file()]
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
        for mod in modules:
            dest = src / mod / "_prebuilt"
            built = build_prebuilt(mod, dest)
            for d in built:
                for f in d.iterdir():
                    rel = f.relative_to(src)
                    build_data["force_include"][str(f)] = str(rel)
            self.app.display_info(f"fi-aot: {len(built)} prebuilt module(s) for {mod}")

    @staticmethod
    def _aot_requested() -> bool:
        import os

        return os.environ.get("FI_AOT", "0").lower() in ("1", "true", "yes", "on")
