#!/usr/bin/env python3
"""The fa3 fp8-K/V GPU tests (and fa2's fp8 widening and v_scale cases) called directly, one line
per case (PASS / FAIL with the error), with no pytest prebuild fixtures: those build every module of
their files, minutes on a fresh machine, where this builds only what the cases load. Run from the
repository root on an sm_90 GPU:

    python3 tools/fa3_fp8_probe.py          # every case
    python3 tools/fa3_fp8_probe.py quick    # exactness, persistent many-tile and page-16 cases
    python3 tools/fa3_fp8_probe.py quick --variant N   # an A/B build (FI_FA3_VARIANT bits)

Exit status 1 when a case fails.
"""
import importlib.util
import itertools
import sys
import time
import traceback

import torch

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def params_of(fn):
    """The argument tuples of a test's (single) parametrize mark."""
    return [mk.args[1] for mk in fn.pytestmark if mk.name == "parametrize"][0]


def cases():
    h = load_module("tph", "packages/fi-attention/tests/prefill_hopper/test_prefill_hopper.py")
    g = load_module("tpg", "packages/fi-attention/tests/prefill/test_prefill_gpu.py")
    out = [(f"exact {a}", lambda a=a: h.test_fp8_kv_widening_is_exact(*a))
           for a in params_of(h.test_fp8_kv_widening_is_exact)]
    out += [(f"ragged {kv} causal={c}", lambda kv=kv, c=c: h.test_fp8_kv_ragged(kv, c))
            for kv, c in itertools.product((E4, E5), (True, False))]
    paged = [(16, "NHD", E4), (8, "HND", E4), (128, "NHD", E5), (256, "HND", E4), (16, "NHD_pad", E5)]
    out += [(f"paged {ps} {lay} {kv} causal={c}",
             lambda ps=ps, lay=lay, kv=kv, c=c: h.test_fp8_kv_paged(ps, lay, kv, c))
            for (ps, lay, kv), c in itertools.product(paged, (True, False))]
    out += [(f"features {c}", lambda c=c: h.test_fp8_kv_features(c)) for c in params_of(h.test_fp8_kv_features)]
    out += [(f"persistent {c}", lambda c=c: h.test_persistent_many_tiles_per_cta(c))
            for c in params_of(h.test_persistent_many_tiles_per_cta) if "kv_dtype" in c]
    for (dt, kv), be in itertools.product(((torch.bfloat16, E4), (torch.float16, E5)), ("fa3", "auto")):
        out.append((f"wrapper single {dt} {kv} {be}",
                    lambda dt=dt, kv=kv, be=be: g.test_single_prefill_fp8_kv_with_scales(dt, kv, be)))
    out.append(("wrapper paged fa3", lambda: g.test_paged_fp8_kv("fa3")))
    out += [(f"fa2 exact {a}", lambda a=a: g.test_fa2_fp8_widening_is_exact(*a))
            for a in params_of(g.test_fa2_fp8_widening_is_exact)]
    for dt, kv in ((torch.bfloat16, E4), (torch.float16, E5)):
        out.append((f"fa2 wrapper single {dt} {kv}", lambda dt=dt, kv=kv: g.test_single_prefill_fp8_kv_with_scales(
            dt, kv, "fa2")))
    out.append(("fa2 wrapper paged", lambda: g.test_paged_fp8_kv("fa2")))
    out.append(("fa2 paged split + merge, d 256 e4m3, v_scale",
                lambda: g.test_paged_custom_mask("fa2", 256, E4, 7)))
    return out


def main():
    args = sys.argv[1:]
    if "--variant" in args:
        from fi_attention.prefill.hopper import spec  # noqa: PLC0415
        i = args.index("--variant")
        spec.VARIANT = int(args[i + 1])
        del args[i:i + 2]
    todo = cases()
    if args == ["quick"]:
        todo = [c for c in todo if c[0].startswith(("exact", "persistent", "paged 16 NHD", "fa2"))]
    return run(todo)


def run(todo) -> int:
    """Call each (name, fn) case, print PASS / FAIL per case and a count; 1 when any failed."""
    fails = 0
    for name, fn in todo:
        t = time.time()
        try:
            fn()
            print(f"PASS {name} [{time.time() - t:.1f}s]", flush=True)
        except Exception as e:  # noqa: BLE001 - report every case, then fail at the end
            fails += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            traceback.print_exc(limit=3)
    print(f"{len(todo) - fails} passed, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
