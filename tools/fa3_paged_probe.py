#!/usr/bin/env python3
"""The fa3 paged-KV GPU tests of test_prefill_hopper.py called directly, one line per case (PASS /
FAIL with the error), with no pytest prebuild fixture (which builds every module of the file, ~40,
where these cases load 14): every page size and layout of test_paged, the other head dims (64, 256),
the fp8 paged cases, and the paged cases of the persistent-CTA and multicast tests. Run from the
repository root on an sm_90 GPU:

    python3 tools/fa3_paged_probe.py

Exit status 1 when a case fails.
"""
import itertools
import sys

from fa3_fp8_probe import load_module, params_of, run


def cases():
    h = load_module("tph", "packages/fi-attention/tests/prefill_hopper/test_prefill_hopper.py")
    out = [(f"paged {ps} {lay} causal={c}", lambda ps=ps, lay=lay, c=c: h.test_paged(ps, lay, c))
           for (ps, lay), c in itertools.product(params_of(h.test_paged), (True, False))]
    out += [(f"paged d, page, layout {a}", lambda a=a: h.test_paged_other_head_dims(*a))
            for a in params_of(h.test_paged_other_head_dims)]
    out += [(f"fp8 paged {ps} {lay} {kv} causal={c}",
             lambda ps=ps, lay=lay, kv=kv, c=c: h.test_fp8_kv_paged(ps, lay, kv, c))
            for (ps, lay, kv), c in itertools.product(params_of(h.test_fp8_kv_paged), (True, False))]
    out += [(f"persistent {c}", lambda c=c: h.test_persistent_many_tiles_per_cta(c))
            for c in params_of(h.test_persistent_many_tiles_per_cta) if "page_size" in c]
    out += [(f"multicast {c}", lambda c=c: h.test_multicast_matches_single_cta(c))
            for c in params_of(h.test_multicast_matches_single_cta) if "page_size" in c]
    return out


def main():
    return run(cases())


if __name__ == "__main__":
    sys.exit(main())
