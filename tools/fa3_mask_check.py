"""GPU check, run from the repository root: the fa3 custom-mask cases of
packages/fi-attention/tests/prefill/test_prefill_gpu.py that need no fa2 module (that file's autouse
fixture builds every fa2 variant first), i.e. the cross-tile custom-mask modules (d = 64 / 128),
plus single prefill at 1000 x 1000 (several work tiles per CTA). Prints one line when all pass."""
import sys

import torch

sys.path.insert(0, "packages/fi-attention/tests/prefill")
import test_prefill_gpu as t  # noqa: E402
from fi_attention.prefill import single_prefill_with_kv_cache  # noqa: E402
from fi_attention.reference import attention_reference  # noqa: E402
from fi_core import testing  # noqa: E402

n = 0
for d in (64, 128):
    for lq, lkv in ((200, 700), (300, 129), (1000, 1000)):
        q, k, v = t._qkv(lq, lkv, 8, 2, d, d, torch.bfloat16, seed=d + lq)
        m = testing.rand((lq, lkv), seed=3) > 0.5
        m[17] = False
        m[18] = True
        out, lse = single_prefill_with_kv_cache(q, k, v, custom_mask=m.cuda(), backend="fa3", return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, custom_mask=m, return_lse=True)
        t._close(out, ref, torch.bfloat16, f"fa3 mask d={d} {lq}x{lkv}: ")
        testing.assert_close(lse, ref_lse, **t.LSE_TOL)
        assert lse[17].isneginf().all() and (out[17] == 0).all()
        n += 1
t.test_batch_custom_mask_and_window(128, "fa3")
t.test_paged_custom_mask("fa3", 128, torch.bfloat16, 16)
t.test_paged_custom_mask("fa3", 64, torch.bfloat16, 8)
print(f"mask checks passed: {n} single + batch d128 + paged d128/d64")
