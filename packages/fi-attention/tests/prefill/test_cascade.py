"""MultiLevelCascadeAttentionWrapper: a shared-prefix level plus per-request suffix levels must
equal plain paged prefill over each request's full page list (prefix pages + own pages)."""

import pytest
import torch

from fi_core import testing
from fi_core.errors import InputError
from fi_attention.cascade import MultiLevelCascadeAttentionWrapper
from fi_attention.prefill import BatchPrefillWithPagedKVCacheWrapper

i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
DEVICES = ["cpu", pytest.param("cuda", marks=testing.gpu_only())]


@pytest.mark.parametrize("device", DEVICES)
def test_two_level_cascade_equals_flat_paged_prefill(device):
    ps, hq, hkv, d = 4, 4, 2, 64
    qo = [3, 1, 6]
    prefix_pages, own = [0, 1, 2], [[3, 4], [5], [6, 7, 8]]
    last_own = [2, 4, 1]
    cache = testing.randn((9, 2, ps, hkv, d), torch.bfloat16, device, seed=1)
    q = testing.randn((sum(qo), hq, d), torch.bfloat16, device, seed=2)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    qo_ind = i32([0, 3, 4, 10])
    w = MultiLevelCascadeAttentionWrapper(2, ws)
    w.plan([i32([0, sum(qo)]), qo_ind],
           [i32([0, 3]), i32([0, 2, 3, 6])],
           [i32(prefix_pages), i32(sum(own, []))],
           [i32([ps]), i32(last_own)], hq, hkv, d, ps, q_data_type=torch.bfloat16)
    out, lse = w.run(q, cache, return_lse=True)
    flat = BatchPrefillWithPagedKVCacheWrapper(ws)
    pages = [prefix_pages + o for o in own]
    flat.plan(qo_ind, i32([0, 5, 9, 15]), i32(sum(pages, [])), i32(last_own), hq, hkv, d, ps,
              q_data_type=torch.bfloat16)
    want, want_lse = flat.run(q, cache, return_lse=True)
    # Levels write bf16 partial outputs before the merge: one extra bf16 rounding.
    testing.assert_close(out, want, atol=1.6e-2, rtol=1.6e-2)
    testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_cascade_validation():
    w = MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(InputError, match="num_levels = 2"):
        w.plan([i32([0, 3])], [i32([0, 1])], [i32([0])], [i32([1])], 4, 2, 64, 16)
    with pytest.raises(InputError, match="same for every level"):
        w.plan([i32([0, 3]), i32([0, 4])], [i32([0, 1])] * 2, [i32([0])] * 2, [i32([1])] * 2, 4, 2, 64, 16)
    with pytest.raises(InputError, match="num_levels"):
        MultiLevelCascadeAttentionWrapper(0, torch.empty(8, dtype=torch.uint8))
