#!/usr/bin/env python3
"""Build, here on the CPU machine, every sm_90a module the prefill GPU suites load, and pack them
for the GPU machine, where the suites then start at once instead of compiling ~100 modules there.

The set: the module lists of tests/prefill_hopper and tests/prefill/test_prefill_gpu.py (both
backends: FI_TEST_PREFILL_BACKEND=fa3 adds its paged cases), the fa3 module the cascade test takes
under "auto", merge_states for every dtype of tests/cascade, and the fa3 modules of
tools/sanitize_fa3.py's runs. On 2 cores the ~100 modules take about 25 minutes from cold.

    python3 tools/prebuild_prefill_tests.py [--jobs N] [--pack .fi-cache/modules.tar.xz]

--pack writes the built modules as modules/<name>/... into an xz tarball (about 4 MB, where the
modules themselves take ~130 MB: too much for a device call's 64 MiB carry). tools/gpu-check
unpacks .fi-cache/modules.tar.xz into its cache when it finds one.
"""

from __future__ import annotations

import argparse
import importlib.util
import tarfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "packages" / "fi-attention" / "tests"


def _test_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def specs_for(arch):
    from fi_attention.cascade.merge import merge_spec  # noqa: PLC0415
    from fi_attention.prefill.hopper.spec import prefill_sm90_spec  # noqa: PLC0415

    bf = torch.bfloat16
    specs = list(_test_module(TESTS / "prefill_hopper" / "test_prefill_hopper.py")._test_specs(arch))
    api = _test_module(TESTS / "prefill" / "test_prefill_gpu.py")
    specs += [s for backend in ("fa2", "fa3") for s in api._test_specs(arch, backend)]
    specs.append(prefill_sm90_spec(bf, 64, False, arch, paged=True))  # test_cascade.py on "auto"
    specs += [merge_spec(dt, arch) for dt in (torch.float16, bf, torch.float32)]
    # tools/sanitize_fa3.py: ragged / paged, d = 64 / 128 / 256, causal, soft cap (its fp8 K/V
    # modules are in the prefill_hopper list)
    specs += [prefill_sm90_spec(bf, d, True, arch, paged=p) for d in (64, 128, 256) for p in (False, True)]
    specs += [prefill_sm90_spec(bf, 128, True, arch, softcap=True)]
    unique = {}
    for s in specs:
        unique.setdefault(s.dirname, s)
    return list(unique.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default FI_MAX_JOBS or all cores)")
    ap.add_argument("--pack", type=Path, default=None, help="also write the modules into this .tar.xz")
    args = ap.parse_args()
    from fi_core import Arch  # noqa: PLC0415
    from fi_core.jit import build_many  # noqa: PLC0415

    specs = specs_for(Arch.parse("9.0a"))
    t0 = time.time()
    dirs = build_many(specs, jobs=args.jobs)
    print(f"{len(specs)} prefill test modules ready in {time.time() - t0:.0f} s")
    if args.pack:
        args.pack.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.pack, "w:xz") as tar:
            for d in dirs:
                tar.add(d, arcname=f"modules/{Path(d).name}")
        print(f"wrote {args.pack} ({args.pack.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
