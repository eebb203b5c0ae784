#!/usr/bin/env python3
"""Clock and power beside a sustained kernel: is it held back by the board's power limit?

Each case (the fa3 cases of tools/ab_fa3.py, plus ``fa2_single16k``: the portable kernel on the
same L=16384 causal prefill) is captured in a CUDA graph and replayed back to back for
``--seconds``, while nvidia-smi samples the SM clock, the power draw and the active clock-event
reasons every 100 ms (reason 0x4 = SW power cap). Prints the rate per half second and the last
samples; ``--json PATH`` writes both.

    python3 tools/power_probe.py [--cases single16k,paged,fa2_single16k] [--seconds 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from ab_fa3 import HKV, HQ, cases as fa3_cases

SMI = ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active",
       "--format=csv,noheader", "-lms", "100"]


def _fa2_case(dev):
    from fi_attention.prefill import single_prefill_with_kv_cache  # noqa: PLC0415
    from fi_core import testing  # noqa: PLC0415

    L, d = 16384, 128
    q = testing.randn((L, HQ, d), torch.bfloat16, dev, seed=1)
    k = testing.randn((L, HKV, d), torch.bfloat16, dev, seed=2)
    v = testing.randn((L, HKV, d), torch.bfloat16, dev, seed=3)
    return 4.0 * L * L * HQ * d / 2, lambda: single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")


def _sustain(fn, flops: float, seconds: float) -> tuple[list, list]:
    """fn replayed back to back for `seconds`; TFLOP/s per half second and nvidia-smi's lines."""
    smi = subprocess.Popen(SMI, stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    rates, t_end = [], time.time() + seconds
    while time.time() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n, t0 = 0, time.time()
        start.record()
        while time.time() - t0 < 0.5:
            fn()
            n += 1
            if n % 8 == 0:  # bound the queue so the timed span is GPU time
                torch.cuda.synchronize()
        end.record()
        end.synchronize()
        rates.append(round(flops / (start.elapsed_time(end) * 1000 / n) / 1e6, 1))
    time.sleep(0.3)
    smi.terminate()
    return rates, smi.communicate()[0].strip().splitlines()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="single16k,paged,fa2_single16k")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import fi_attention.prefill.hopper as hop  # noqa: PLC0415

    dev = torch.device("cuda")
    names = args.cases.split(",")
    work = fa3_cases([n for n in names if n != "fa2_single16k"], dev)
    out = {}
    for name in names:
        if name == "fa2_single16k":
            flops, fn = _fa2_case(dev)
        else:
            flops, case, _o = work[name]
            g = torch.cuda.CUDAGraph()
            case(hop.run_ragged, hop.run_paged)  # loads the module outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                case(hop.run_ragged, hop.run_paged)
            fn = g.replay
        fn()
        torch.cuda.synchronize()
        rates, smi = _sustain(fn, flops, args.seconds)
        out[name] = {"tflop_s_per_half_second": rates, "smi": smi}
        print(name, rates)
        print("\n".join(smi[-6:]))
        time.sleep(2.0)  # let the board cool between cases
    if args.json:
        env = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
               "command": "python3 tools/power_probe.py " + " ".join(sys.argv[1:]),
               "gpu": torch.cuda.get_device_name()}
        with open(args.json, "w") as f:
            json.dump({"environment": env, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
