"""CPU tests for RoPE: validation, the reference against a naive complex-number formula, the CPU
backend of every public function, and torch.compile(fullgraph=True) tracing."""

import math

import pytest
import torch

from fi_core import InputError, InputTypeError, testing
from fi_sampling import rope
from fi_sampling.rope.reference import (
    cos_sin_from_positions, positions_from_indptr, rope_frequencies, rope_reference,
)


def _qk(nnz=5, hq=4, hk=2, d=64, dtype=torch.float32, seed=0):
    return (testing.randn((nnz, hq, d), dtype, seed=seed),
            testing.randn((nnz, hk, d), dtype, seed=seed + 1))


def _llama31_freq(f, scale, low, high, old):
    # The Llama 3.1 rule as written in the model code: by wavelength, piecewise.
    wavelen = 2 * math.pi / f
    if wavelen < old / high:
        return f
    if wavelen > old / low:
        return f / scale
    s = (old / wavelen - low) / (high - low)
    return (1 - s) * f / scale + s * f


def _naive(x, pos, rotary_dim, interleave, theta=1e4, scale=1.0, llama=None):
    """float64, one pair at a time, rotation as multiplication by exp(i * angle)."""
    out = x.double().clone()
    half = rotary_dim // 2
    for i in range(half):
        f = theta ** (-2 * i / rotary_dim)
        f = _llama31_freq(f, scale, *llama) if llama else f / scale
        rot = torch.polar(torch.ones(len(pos), dtype=torch.float64), pos.double() * f)[:, None]
        a, b = (2 * i, 2 * i + 1) if interleave else (i, i + half)
        z = torch.complex(out[..., a], out[..., b]) * rot
        out[..., a], out[..., b] = z.real, z.imag
    return out


# ---- reference vs naive ---------------------------------------------------------------------------

@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32, 6])
def test_reference_matches_naive(interleave, rotary_dim):
    q, k = _qk()
    pos = torch.tensor([0, 1, 17, 100, 211])
    rq, rk = rope_reference(q, k, pos_ids=pos, rotary_dim=rotary_dim, interleave=interleave)
    # fp32 angles at positions <= 211 differ from float64 ones by < 211 * 2^-24 rad
    testing.assert_close(rq, _naive(q, pos, rotary_dim, interleave).float(), atol=1e-4, rtol=1e-4)
    testing.assert_close(rk, _naive(k, pos, rotary_dim, interleave).float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(rq[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("interleave", [False, True])
def test_reference_llama31_matches_naive(interleave):
    q, k = _qk(d=128)
    pos = torch.tensor([0, 3, 50, 120, 255])
    llama = (1.0, 4.0, 8192.0)
    rq, _ = rope_reference(q, k, pos_ids=pos, interleave=interleave, rope_scale=8.0,
                           rope_theta=5e5, llama31=llama)
    want = _naive(q, pos, 128, interleave, theta=5e5, scale=8.0, llama=llama).float()
    testing.assert_close(rq, want, atol=1e-4, rtol=1e-4)
    # the three regimes all occur at these settings: kept, scaled and blended frequencies
    f = rope_frequencies(128, 8.0, 5e5, llama).double()
    base = 5e5 ** (-2 * torch.arange(64, dtype=torch.float64) / 128)
    ratio = base / f
    assert (ratio - 1).abs().min() < 1e-6 and (ratio - 8).abs().min() < 1e-5
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_rope_scale_divides_frequency():
    f1 = rope_frequencies(128, 1.0, 1e4).double()
    f4 = rope_frequencies(128, 4.0, 1e4).double()
    assert torch.allclose(f1 / 4, f4, rtol=1e-7, atol=0)
    assert f1[0] == 1.0 and abs(f1[1].item() - 1e4 ** (-2 / 128)) < 1e-7


def test_positions_from_indptr_skips_empty_requests():
    indptr = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    offsets = torch.tensor([10, 99, 0, 7], dtype=torch.int32)
    got = positions_from_indptr(indptr, offsets, 6)
    assert got.tolist() == [10, 11, 0, 1, 2, 7]


def test_cache_and_computed_angles_agree():
    q, k = _qk(d=128)
    pos = torch.tensor([0, 9, 4095, 1000, 77])
    freqs = rope_frequencies(96)
    cos, sin = cos_sin_from_positions(torch.arange(4096), freqs)
    cache = torch.cat((cos, sin), 1)
    for interleave in (False, True):
        a = rope_reference(q, k, pos_ids=pos, rotary_dim=96, interleave=interleave)
        b = rope_reference(q, k, pos_ids=pos, cos_sin_cache=cache, interleave=interleave)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- CPU backend of the public API ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_functions_on_cpu(dtype):
    q, k = _qk(nnz=6, dtype=dtype)
    indptr, offsets = torch.tensor([0, 4, 6]), torch.tensor([3, 100])
    pos = positions_from_indptr(indptr, offsets, 6)
    ref = rope_reference(q, k, pos_ids=pos, rotary_dim=32, interleave=True)
    for out in (rope.apply_rope(q, k, indptr, offsets, 32, True),
                rope.apply_rope_pos_ids(q, k, pos, 32, True)):
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    q2, k2 = q.clone(), k.clone()
    assert rope.apply_rope_inplace(q2, k2, indptr, offsets, rotary_dim=32, interleave=True) is None
    assert torch.equal(q2, ref[0]) and torch.equal(k2, ref[1])
    q2, k2 = q.clone(), k.clone()
    assert rope.apply_rope_pos_ids_inplace(q2, k2, pos, 32, True) is None
    assert torch.equal(q2, ref[0]) and torch.equal(k2, ref[1])

    lref = rope_reference(q, k, pos_ids=pos, rope_scale=8, rope_theta=5e5, llama31=(1.0, 4.0, 8192.0))
    for out in (rope.apply_llama31_rope(q, k, indptr, offsets),
                rope.apply_llama31_rope_pos_ids(q, k, pos)):
        assert torch.equal(out[0], lref[0]) and torch.equal(out[1], lref[1])
    q2, k2 = q.clone(), k.clone()
    assert rope.apply_llama31_rope_inplace(q2, k2, indptr, offsets) is None
    assert torch.equal(q2, lref[0])
    q2, k2 = q.clone(), k.clone()
    assert rope.apply_llama31_rope_pos_ids_inplace(q2, k2, pos) is None
    assert torch.equal(k2, lref[1])


def test_cos_sin_cache_api_on_cpu():
    q, k = _qk(nnz=4, hq=3, hk=1, d=64, dtype=torch.bfloat16)
    cache = testing.randn((50, 32), torch.float32, seed=5)
    pos = torch.tensor([0, 49, 7, 7], dtype=torch.int32)
    for neox in (True, False):
        ref = rope_reference(q, k, pos_ids=pos, cos_sin_cache=cache, interleave=not neox)
        qo, ko = rope.apply_rope_with_cos_sin_cache(pos, q.reshape(4, -1), k.reshape(4, -1), 64, cache, neox)
        assert qo.shape == (4, 192) and torch.equal(qo.view(4, 3, 64), ref[0])
        assert torch.equal(ko.view(4, 1, 64), ref[1])
        q2, k2 = q.reshape(4, -1).clone(), k.reshape(4, -1).clone()
        assert rope.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, 64, cache, neox) is None
        assert torch.equal(q2.view(4, 3, 64), ref[0]) and torch.equal(k2.view(4, 1, 64), ref[1])


def test_out_of_place_leaves_inputs_and_inplace_leaves_tail():
    q, k = _qk()
    q0, k0 = q.clone(), k.clone()
    pos = torch.arange(5)
    rope.apply_rope_pos_ids(q, k, pos, rotary_dim=16)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    rope.apply_rope_pos_ids_inplace(q, k, pos + 1, rotary_dim=16)
    assert torch.equal(q[..., 16:], q0[..., 16:]) and not torch.equal(q[..., :16], q0[..., :16])


def test_empty_batch_is_a_no_op():
    q, k = _qk(nnz=0)
    qo, ko = rope.apply_rope_pos_ids(q, k, torch.zeros(0, dtype=torch.int64))
    assert qo.shape == q.shape and ko.shape == k.shape


def test_torch_compile_fullgraph_cpu():
    q, k = _qk(nnz=7, dtype=torch.bfloat16)
    pos = torch.arange(7) * 3

    def f(q, k, pos):
        qo, ko = rope.apply_rope_pos_ids(q, k, pos, rotary_dim=32)
        rope.apply_rope_pos_ids_inplace(qo, ko, pos, rotary_dim=32, interleave=True)
        return qo * 2, ko

    want = f(q.clone(), k.clone(), pos)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q.clone(), k.clone(), pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- validation ------------------------------------------------------------------------------

def test_rejects_bad_dtypes():
    q, k = _qk()
    pos = torch.arange(5)
    with pytest.raises(InputTypeError, match="q must be float16 or bfloat16 or float32, got int32"):
        rope.apply_rope_pos_ids(q.int(), k, pos)
    with pytest.raises(InputTypeError, match="k must have q's dtype"):
        rope.apply_rope_pos_ids(q, k.half(), pos)
    with pytest.raises(InputTypeError, match="pos_ids must be int32 or int64, got float32"):
        rope.apply_rope_pos_ids(q, k, pos.float())
    with pytest.raises(InputTypeError, match="cos_sin_cache must be float32, got float16"):
        rope.apply_rope_with_cos_sin_cache(pos, q.reshape(5, -1), k.reshape(5, -1), 64,
                                           torch.zeros(8, 64, dtype=torch.float16))


def test_rejects_bad_shapes():
    q, k = _qk()
    pos = torch.arange(5)
    with pytest.raises(InputError, match="q must be 3-D"):
        rope.apply_rope_pos_ids(q[0], k, pos)
    with pytest.raises(InputError, match="same number of tokens"):
        rope.apply_rope_pos_ids(q, k[:4], pos)
    with pytest.raises(InputError, match="same head_dim"):
        rope.apply_rope_pos_ids(q, k[..., :32], pos)
    with pytest.raises(InputError, match=r"pos_ids must have shape \[5\]"):
        rope.apply_rope_pos_ids(q, k, pos[:4])
    with pytest.raises(InputError, match="contiguous in its last dimension"):
        rope.apply_rope_pos_ids(q.transpose(1, 2).contiguous().transpose(1, 2), k, pos)
    with pytest.raises(InputError, match="batch_size >= 1"):
        rope.apply_rope(q, k, torch.tensor([0]), torch.tensor([], dtype=torch.int64))
    with pytest.raises(InputError, match=r"offsets must have shape \[2\]"):
        rope.apply_rope(q, k, torch.tensor([0, 2, 5]), torch.tensor([0]))


@pytest.mark.parametrize("rotary_dim", [0, 7, 66, -2])
def test_rejects_bad_rotary_dim(rotary_dim):
    q, k = _qk()
    with pytest.raises(InputError, match=f"rotary_dim must be even and in \\[2, head_dim=64\\], got {rotary_dim}"):
        rope.apply_rope_pos_ids(q, k, torch.arange(5), rotary_dim=rotary_dim)


def test_rejects_bad_scalars():
    q, k = _qk()
    pos = torch.arange(5)
    with pytest.raises(InputError, match="rope_scale must be > 0"):
        rope.apply_rope_pos_ids(q, k, pos, rope_scale=0)
    with pytest.raises(InputError, match="rope_theta must be > 0"):
        rope.apply_rope_pos_ids(q, k, pos, rope_theta=-1.0)
    with pytest.raises(InputError, match="low_freq_factor < high_freq_factor"):
        rope.apply_llama31_rope_pos_ids(q, k, pos, low_freq_factor=4, high_freq_factor=4)


def test_rejects_bad_cache_layout():
    q, k = _qk()
    pos = torch.arange(5)
    qf, kf = q.reshape(5, -1), k.reshape(5, -1)
    with pytest.raises(InputError, match="num_heads \\* head_size=48"):
        rope.apply_rope_with_cos_sin_cache(pos, qf, kf, 48, torch.zeros(8, 48))
    with pytest.raises(InputError, match="rotary_dim even and <= head_size=64"):
        rope.apply_rope_with_cos_sin_cache(pos, qf, kf, 64, torch.zeros(8, 128))
    with pytest.raises(InputError, match="cos_sin_cache must be contiguous"):
        rope.apply_rope_with_cos_sin_cache(pos, qf, kf, 64, torch.zeros(64, 8).t())


def test_check_inputs_catches_bad_indices():
    from fi_core import knobs

    q, k = _qk()
    with knobs.override(FI_CHECK_INPUTS="1"):
        with pytest.raises(InputError, match="end at nnz=5"):
            rope.apply_rope(q, k, torch.tensor([0, 2, 4]), torch.tensor([0, 0]))
        with pytest.raises(InputError, match=r"positions must be in \[0, 8\)"):
            rope.apply_rope_with_cos_sin_cache(torch.tensor([0, 1, 2, 3, 8]), q.reshape(5, -1),
                                               k.reshape(5, -1), 64, torch.zeros(8, 64))


def test_cos_sin_cache_accepts_3d_heads():
    q, k = _qk(nnz=4, hq=3, hk=1, d=64)
    cache = testing.randn((8, 64), torch.float32, seed=6)
    pos = torch.tensor([1, 2, 3, 7])
    qo, ko = rope.apply_rope_with_cos_sin_cache(pos, q, k, 64, cache)
    ref = rope_reference(q, k, pos_ids=pos, cos_sin_cache=cache)
    assert qo.shape == q.shape and torch.equal(qo, ref[0]) and torch.equal(ko, ref[1])
    with pytest.raises(InputError, match="or \\[nnz, num_heads, head_size\\]"):
        rope.apply_rope_with_cos_sin_cache(pos, q, k, 32, cache[:, :32])


def test_cache_position_out_of_range_gives_nan_rows():
    q, k = _qk(nnz=3, hq=2, hk=1, d=64)
    cache = testing.randn((10, 32), torch.float32, seed=8)
    qo, _ = rope.apply_rope_with_cos_sin_cache(torch.tensor([10, 2, -1]), q.reshape(3, -1),
                                               k.reshape(3, -1), 64, cache)
    qo = qo.view(3, 2, 64)
    assert qo[:, :, :32].isnan().all(dim=(1, 2)).tolist() == [True, False, True]
    assert torch.equal(qo[:, :, 32:], q[:, :, 32:])  # the tail is copied regardless
