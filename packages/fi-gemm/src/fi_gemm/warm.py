"""Build every fi-gemm kernel module the GPU tests and benchmark routines use, in one parallel
ninja run: ``python3 -m fi_gemm.warm [--arch 9.0a]`` (default: the current GPU, else 9.0a).

On the H200 the CUTLASS units take 1-3 minutes each (one core and ~3.4 GB of RAM per unit), so
warming with FI_MAX_JOBS=16 before the tests keeps compile time off the test clock.
"""

from __future__ import annotations

import argparse
import time

import torch

from fi_core import Arch, KernelSpec

from .dense.spec import gemm_sm80_spec, gemm_sm90_spec, gemv_spec
from .fp4.spec import dequant_spec, gemv_fp4_spec, quant_spec
from .fp8.spec import blockwise_sm89_spec, blockwise_sm90_spec

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2


def gpu_test_specs(arch: Arch) -> list[KernelSpec]:
    """Modules used by tests/ and bench routines on `arch`."""
    specs = [quant_spec(arch), dequant_spec(arch), gemv_fp4_spec(bf16, arch), gemv_fp4_spec(f16, arch),
             gemv_spec(bf16, bf16, bf16, arch), gemv_spec(bf16, bf16, f16, arch),
             gemv_spec(f16, f16, f16, arch), gemv_spec(bf16, bf16, f32, arch)]
    if arch.cc >= 89:
        specs += [gemv_spec(e4m3, e4m3, bf16, arch), gemv_spec(e4m3, e5m2, f16, arch)]
    # The CUTLASS 2.x unit of Ampere / Ada; on sm_90 its tests ask for it by name.
    specs += [gemm_sm80_spec(bf16, bf16, bf16, arch), gemm_sm80_spec(bf16, bf16, f16, arch),
              gemm_sm80_spec(f16, f16, f16, arch)]
    if arch.cc >= 89:
        specs += [gemm_sm80_spec(e4m3, e4m3, bf16, arch), gemm_sm80_spec(e4m3, e5m2, f16, arch),
                  blockwise_sm89_spec(e4m3, e4m3, bf16, arch), blockwise_sm89_spec(e5m2, e4m3, f16, arch)]
    if arch.cc == 90:
        for cfg in ("mid", "large"):
            specs += [gemm_sm90_spec(bf16, bf16, bf16, cfg, arch),
                      gemm_sm90_spec(e4m3, e4m3, bf16, cfg, arch)]
        specs += [gemm_sm90_spec(bf16, bf16, bf16, "pingpong", arch),
                  gemm_sm90_spec(bf16, bf16, f16, "large", arch),
                  gemm_sm90_spec(f16, f16, f16, "mid", arch),
                  gemm_sm90_spec(e4m3, e5m2, f16, "large", arch),
                  blockwise_sm90_spec(e4m3, e4m3, bf16, "default", arch),
                  blockwise_sm90_spec(e4m3, e4m3, bf16, "swizzled", arch)]
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None, help="target, e.g. 9.0a (default: current GPU or 9.0a)")
    args = ap.parse_args()
    if args.arch:
        arch = Arch.parse(args.arch)
    elif torch.cuda.is_available():
        from fi_core import arch_of

        arch = arch_of(torch.device("cuda"))
    else:
        arch = Arch.parse("9.0a")
    from fi_core.jit import build_many

    t = time.time()
    specs = gpu_test_specs(arch)
    build_many(specs)
    print(f"fi_gemm: {len(specs)} modules for {arch} ready in {time.time() - t:.0f} s")


if __name__ == "__main__":
    main()
