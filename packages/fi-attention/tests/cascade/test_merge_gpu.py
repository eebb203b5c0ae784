"""GPU tests of merge_state(s) against the reference."""

import pytest
import torch

from fi_core import testing
from fi_attention import merge_state, merge_state_in_place, merge_states
from fi_attention.reference import merge_state_reference, merge_states_reference

pytestmark = testing.gpu_only()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("L,H,D", [(1, 1, 64), (7, 32, 128), (129, 8, 256)])
def test_merge_state(dtype, L, H, D):
    va, vb = testing.randn((L, H, D), dtype, "cuda", seed=1), testing.randn((L, H, D), dtype, "cuda", seed=2)
    sa, sb = testing.randn((L, H), torch.float32, "cuda", seed=3, scale=4), testing.randn((L, H), torch.float32, "cuda", seed=4, scale=4)
    sa[0, 0] = float("-inf")
    v, s = merge_state(va, sa, vb, sb)
    rv, rs = merge_state_reference(va, sa, vb, sb)
    testing.assert_close(v, rv, dtype=dtype)
    testing.assert_close(s, rs, dtype=torch.float32, atol=1e-5, rtol=1e-5)
    mask = torch.arange(L, device="cuda") % 2 == 0
    v2, s2 = va.clone(), sa.clone()
    merge_state_in_place(v2, s2, vb, sb, mask=mask)
    testing.assert_close(v2[mask], rv[mask], dtype=dtype)
    assert torch.equal(v2[~mask], va[~mask]) and torch.equal(s2[~mask], sa[~mask])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L,N,H,D", [(3, 1, 4, 128), (17, 5, 32, 128), (2, 40, 8, 64), (3, 0, 4, 64)])
def test_merge_states(dtype, L, N, H, D):
    v = testing.randn((L, N, H, D), dtype, "cuda", seed=1)
    s = testing.randn((L, N, H), torch.float32, "cuda", seed=2, scale=4)
    o, lse = merge_states(v, s)
    ro, rl = merge_states_reference(v, s)
    testing.assert_close(o, ro, dtype=dtype)
    testing.assert_close(lse, rl, dtype=torch.float32, atol=1e-5, rtol=1e-5)
