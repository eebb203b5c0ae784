#!/usr/bin/env python3
"""Build every fa3 (Hopper prefill) module in parallel: dtypes x head dims x causal x paged x soft cap,
48 modules for sm_90a, and the 16 head_dim-128 ones again with K/V multicast (FI_FA3_MULTICAST=1).
The GPU tests of the fa3 kernel and of the prefill API on backend fa3 use a dozen to two dozen of
them; building the 48 up front on the GPU machine's 16 cores (FI_MAX_JOBS) took 153 s there, where
the tests would otherwise build each one serially on first use.

    python3 tools/prebuild_fa3.py [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args()
    from fi_attention.prefill.hopper.spec import HEAD_DIMS, MULTICAST_HEAD_DIM, prefill_sm90_spec  # noqa: PLC0415
    from fi_core import Arch  # noqa: PLC0415
    from fi_core.jit import build_many  # noqa: PLC0415

    arch = Arch.parse("9.0a")
    specs = [prefill_sm90_spec(dt, d, causal, arch, paged=paged, softcap=cap, multicast=mc)
             for dt, d, causal, paged, cap, mc in itertools.product(
                 (torch.bfloat16, torch.float16), HEAD_DIMS, (True, False), (False, True), (False, True),
                 (False, True)) if not mc or d == MULTICAST_HEAD_DIM]
    t0 = time.time()
    build_many(specs, jobs=args.jobs)
    print(f"built {len(specs)} fa3 modules in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
