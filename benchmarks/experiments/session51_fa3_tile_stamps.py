#!/usr/bin/env python3
"""Session 51: per-work-tile clock64 stamps of the fa3 kernel, run and analysis.

Build the diagnostic source first: apply session51_fa3_tile_stamps_diagnostic.diff to a copy of
prefill_sm90.cu (say /tmp/v_ts.cu). It adds a device array of stamps (clock64 per CTA, tile and
event) and an export, fi_prefill_sm90_stamps, that clears or copies it. Then, from the repository
root on an sm_90 GPU with FI_FA3_MULTICAST=0:

    python3 benchmarks/experiments/session51_fa3_tile_stamps.py run /tmp/v_ts.cu OUTDIR [cases]
    python3 benchmarks/experiments/session51_fa3_tile_stamps.py analyse OUTDIR

Slots per (CTA, tile): consumer warpgroup w (thread 0 of it) 4w + 0 descriptor read, 4w + 1 first
K (and previous V) ready, 4w + 2 first KV tile done (incl. the previous tile's epilogue), 4w + 3 KV
loop done; producer 8 tile start, 9 published, 10 first K issued, 11 KV tiles of the tile;
12 + 2w / 13 + 2w the previous tile's epilogue start / end; 16 + w cycles spent in the KV loop's
full-barrier waits. The analysis fits cycles per tile = a * KV tiles + b.
"""
import ctypes
import glob
import os
import sys

import numpy as np

SHAPE = (160, 128, 18)


def run(src, out, names):
    import torch  # noqa: PLC0415

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    import ab_fa3  # noqa: PLC0415
    import fi_attention.prefill.hopper as hop  # noqa: PLC0415
    from fi_core import arch_of, load  # noqa: PLC0415

    hop.prefill_sm90_spec = ab_fa3.spec_factory(src)
    dev = torch.device("cuda")
    work = ab_fa3.cases(names, dev)
    for name in names:
        _flops, fn, _o = work[name]
        for _ in range(30):
            fn(hop.run_ragged, hop.run_paged)
        torch.cuda.synchronize()
        spec = hop.prefill_sm90_spec(torch.bfloat16, 128, True, arch_of(dev), paged=name.startswith("paged"),
                                     multicast=False)
        f = load(spec)._lib.fi_prefill_sm90_stamps
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        for rep in range(4):
            assert f(None, 0, 1) == 0
            torch.cuda.synchronize()
            fn(hop.run_ragged, hop.run_paged)
            torch.cuda.synchronize()
            buf = np.empty(SHAPE, dtype=np.int64)
            assert f(buf.ctypes.data, buf.nbytes, 0) == 0
            np.save(f"{out}/st_{name}_{rep}.npy", buf)


def analyse(out, rep="1"):
    keys = ["D", "wdesc", "wk", "first", "pre_ep", "ep", "post_ep", "loop", "lwait"]
    for path in sorted(glob.glob(f"{out}/st_*_{rep}.npy")):
        name = os.path.basename(path)[3:-6]
        a = np.load(path)
        rows = {k: [] for k in ["k", *keys]}
        for c in range(a.shape[0]):
            if a[c, 0, 0] == -1:
                continue
            nt = int((a[c, :, 3] != -1).sum())
            for w in (0, 1):
                b = 4 * w
                for i in range(1, nt):
                    if a[c, i, 11] <= 0 or a[c, i, 12 + 2 * w] == -1:
                        continue
                    rows["k"].append(a[c, i, 11])
                    rows["D"].append(a[c, i, b + 3] - a[c, i - 1, b + 3])
                    rows["wdesc"].append(a[c, i, b] - a[c, i - 1, b + 3])
                    rows["wk"].append(a[c, i, b + 1] - a[c, i, b])
                    rows["first"].append(a[c, i, b + 2] - a[c, i, b + 1])
                    rows["pre_ep"].append(a[c, i, 12 + 2 * w] - a[c, i, b + 1])
                    rows["ep"].append(a[c, i, 13 + 2 * w] - a[c, i, 12 + 2 * w])
                    rows["post_ep"].append(a[c, i, b + 2] - a[c, i, 13 + 2 * w])
                    rows["loop"].append(a[c, i, b + 3] - a[c, i, b + 2])
                    rows["lwait"].append(a[c, i, 16 + w])
        r = {k: np.array(v, dtype=np.float64) for k, v in rows.items()}
        k = r["k"]
        fit = np.linalg.lstsq(np.vstack([k, np.ones_like(k)]).T, r["D"], rcond=None)[0]
        print(f"{name}: cycles per tile = {fit[0]:.0f} * KV tiles + {fit[1]:.0f}; means over {len(k)} "
              + ", ".join(f"{key} {r[key].mean():.0f}" for key in keys))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], (sys.argv[4] if len(sys.argv) > 4 else "ragged,paged,single4k").split(","))
    else:
        analyse(sys.argv[2])
