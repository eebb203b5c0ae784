"""CPU tests of state merging: merging attention over KV halves must equal attention over all."""

import pytest
import torch

from fi_core import testing
from fi_core.errors import InputError, InputTypeError
from fi_attention import merge_state, merge_state_in_place, merge_states
from fi_attention.reference import attention_reference


def _parts(n_parts, L=5, H=4, D=16, lkv=24, seed=0):
    q = testing.randn((L, H, D), seed=seed)
    k = testing.randn((lkv, H, D), seed=seed + 1)
    v = testing.randn((lkv, H, D), seed=seed + 2)
    full_o, full_s = attention_reference(q, k, v, return_lse=True, q_offset=lkv)
    cuts = torch.linspace(0, lkv, n_parts + 1).long().tolist()
    parts = [attention_reference(q, k[a:b], v[a:b], return_lse=True, q_offset=lkv)
             for a, b in zip(cuts[:-1], cuts[1:])]
    return full_o, full_s, parts


def test_merge_state_equals_full_attention():
    full_o, full_s, ((oa, sa), (ob, sb)) = _parts(2)
    o, s = merge_state(oa, sa, ob, sb)
    testing.assert_close(o, full_o, dtype=torch.float32, atol=1e-5, rtol=1e-4)
    testing.assert_close(s, full_s, dtype=torch.float32, atol=1e-5, rtol=1e-4)


def test_merge_states_equals_full_attention():
    full_o, full_s, parts = _parts(5)
    v = torch.stack([p[0] for p in parts], 1)
    s = torch.stack([p[1] for p in parts], 1)
    o, lse = merge_states(v, s)
    testing.assert_close(o, full_o, dtype=torch.float32, atol=1e-5, rtol=1e-4)
    testing.assert_close(lse, full_s, dtype=torch.float32, atol=1e-5, rtol=1e-4)


def test_merge_with_empty_states():
    v = torch.ones(2, 1, 4)
    s = torch.tensor([[1.0], [float("-inf")]])
    o, lse = merge_state(v, s, 3 * v, torch.full_like(s, float("-inf")))
    assert torch.equal(o[0], v[0]) and lse[0].item() == 1.0
    assert torch.all(o[1] == 0) and torch.isneginf(lse[1]).all()


def test_merge_state_in_place_mask():
    full_o, full_s, ((oa, sa), (ob, sb)) = _parts(2)
    v, s = oa.clone(), sa.clone()
    mask = torch.tensor([True, False, True, False, True])
    merge_state_in_place(v, s, ob, sb, mask=mask)
    testing.assert_close(v[mask], full_o[mask], dtype=torch.float32, atol=1e-5, rtol=1e-4)
    assert torch.equal(v[~mask], oa[~mask]) and torch.equal(s[~mask], sa[~mask])


def test_merge_validation():
    v, s = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(InputTypeError, match="float32"):
        merge_state(v, s.half(), v, s)
    with pytest.raises(InputError, match="shape"):
        merge_state(v, s[:, :2], v, s)
    with pytest.raises(InputError, match="mask"):
        merge_state_in_place(v, s, v, s, mask=torch.ones(3, dtype=torch.bool))


def test_merge_states_of_no_states():
    """N = 0 merges nothing: zeros and -inf, as the kernel writes them."""
    o, lse = merge_states(torch.ones(3, 0, 2, 8, dtype=torch.float16), torch.ones(3, 0, 2))
    assert o.shape == (3, 2, 8) and o.dtype == torch.float16 and torch.all(o == 0)
    assert lse.shape == (3, 2) and torch.isneginf(lse).all()


def test_cascade_arguments_are_checked():
    import numpy as np
    from fi_attention import MultiLevelCascadeAttentionWrapper
    from fi_attention.prefill import segment_packbits
    v = torch.randn(3, 2, 8)
    s = torch.randn(3, 2)
    with pytest.raises(InputTypeError, match="mask must be a torch.Tensor, got list"):
        merge_state_in_place(v, s, v.clone(), s.clone(), mask=[True, False, True])
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    assert MultiLevelCascadeAttentionWrapper(np.int64(2), ws)._num_levels == 2
    with pytest.raises(InputError, match="num_levels must be an int >= 1, got True"):
        MultiLevelCascadeAttentionWrapper(True, ws)
    m = MultiLevelCascadeAttentionWrapper(2, ws)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(InputTypeError, match="qo_indptr_arr must be a list of num_levels int32 tensors, got NoneType"):
        m.plan(None, [i32([0, 1])] * 2, [i32([0])] * 2, [i32([1])] * 2, 4, 2, 64, 4)
    with pytest.raises(InputError, match=r"qo_indptr_arr\[0\] must be 1-D with batch \+ 1 entries"):
        m.plan([i32([]), i32([0, 2])], [i32([0, 1])] * 2, [i32([0])] * 2, [i32([1])] * 2, 4, 2, 64, 4)
    with pytest.raises(InputTypeError, match="indptr must be int32 or int64, got float32"):
        segment_packbits(torch.ones(11, dtype=torch.bool), torch.tensor([0, 4.9, 11.0]))
