"""CPU tests of the norms: validation errors, references against naive loops, the CPU backend
of every public function (incl. 3-D and strided rows), torch.compile(fullgraph=True) tracing."""

import math

import pytest
import torch

from fi_core import InputError, InputTypeError, testing
from fi_sampling import norm
from fi_sampling.norm.reference import (
    fused_add_rmsnorm_reference, layernorm_reference, rmsnorm_reference,
)


def _naive_rmsnorm(x, w, eps, offset=0.0):
    """Loop over rows in float64: an independent statement of the definition."""
    rows = x.reshape(-1, x.shape[-1]).double()
    out = torch.empty_like(rows)
    for i in range(rows.shape[0]):
        ms = sum(float(v) ** 2 for v in rows[i]) / rows.shape[1]
        scale = 1.0 / math.sqrt(ms + eps)
        for j in range(rows.shape[1]):
            out[i, j] = rows[i, j] * scale * (float(w[j]) + offset)
    return out.reshape(x.shape)


def _naive_layernorm(x, g, b, eps):
    rows = x.double()
    out = torch.empty_like(rows)
    for i in range(rows.shape[0]):
        vals = [float(v) for v in rows[i]]
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / len(vals)
        for j, v in enumerate(vals):
            out[i, j] = (v - mean) / math.sqrt(var + eps) * float(g[j]) + float(b[j])
    return out


# ---- references vs naive formulas ------------------------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_reference_matches_naive(offset):
    x = testing.randn((3, 2, 13), torch.float32, seed=1)
    w = testing.randn((13,), torch.float32, seed=2)
    got = rmsnorm_reference(x, w, 1e-5, offset)
    torch.testing.assert_close(got.double(), _naive_rmsnorm(x, w, 1e-5, offset), atol=1e-5, rtol=1e-5)


def test_fused_add_reference_rounds_sum_before_norm():
    x = testing.randn((4, 24), torch.bfloat16, seed=3)
    r = testing.randn((4, 24), torch.bfloat16, seed=4)
    w = testing.randn((24,), torch.bfloat16, seed=5)
    normed, new_r = fused_add_rmsnorm_reference(x, r, w, 1e-6)
    s = (x.float() + r.float()).to(torch.bfloat16)
    assert torch.equal(new_r, s)
    want = _naive_rmsnorm(s.float(), w.float(), 1e-6).to(torch.bfloat16)
    testing.assert_close(normed, want)


def test_layernorm_reference_matches_naive():
    x = testing.randn((5, 17), torch.float32, seed=6, scale=3.0) + 2.0
    g = testing.randn((17,), torch.float32, seed=7)
    b = testing.randn((17,), torch.float32, seed=8)
    got = layernorm_reference(x, g, b, 1e-6)
    torch.testing.assert_close(got.double(), _naive_layernorm(x, g, b, 1e-6), atol=1e-5, rtol=1e-5)


# ---- CPU backend of the public API -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rmsnorm_cpu_backend(dtype):
    x = testing.randn((7, 33), dtype, seed=9)
    w = testing.randn((33,), dtype, seed=10)
    out = testing.empty_poisoned((7, 33), dtype, "cpu")
    assert norm.rmsnorm(x, w, 1e-6, out=out) is out
    testing.assert_close(out, _naive_rmsnorm(x.float(), w.float(), 1e-6).to(dtype))
    testing.assert_close(norm.gemma_rmsnorm(x, w), _naive_rmsnorm(x.float(), w.float(), 1e-6, 1.0).to(dtype))


def test_rmsnorm_3d_strided_rows_cpu():
    # q sliced out of a fused qkv tensor: [tokens, heads, head_dim] with a row stride != heads*dim
    qkv = testing.randn((5, 3 * 4 * 16), torch.bfloat16, seed=11)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = testing.randn((16,), torch.bfloat16, seed=12)
    got = norm.rmsnorm(q, w)
    testing.assert_close(got, rmsnorm_reference(q.contiguous(), w))


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_cpu_in_place(gemma):
    x = testing.randn((6, 40), torch.bfloat16, seed=13)
    r = testing.randn((6, 40), torch.bfloat16, seed=14)
    w = testing.randn((40,), torch.bfloat16, seed=15)
    want_x, want_r = fused_add_rmsnorm_reference(x, r, w, 1e-6, 1.0 if gemma else 0.0)
    fn = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    assert fn(x, r, w) is None
    assert torch.equal(r, want_r)
    assert torch.equal(x, want_x)


def test_layernorm_cpu_backend():
    x = testing.randn((3, 20), torch.bfloat16, seed=16)
    g, b = testing.randn((20,), seed=17), testing.randn((20,), seed=18)
    testing.assert_close(norm.layernorm(x, g, b), _naive_layernorm(x.float(), g, b, 1e-6).to(torch.bfloat16))


def test_torch_compile_fullgraph_cpu():
    x = testing.randn((4, 32), torch.bfloat16, seed=19)
    r = testing.randn((4, 32), torch.bfloat16, seed=20)
    w = testing.randn((32,), torch.bfloat16, seed=21)
    g, b = testing.randn((32,), seed=22), testing.randn((32,), seed=23)

    def f(x, r, w):
        y = norm.rmsnorm(x, w) + norm.gemma_rmsnorm(x, w)
        norm.fused_add_rmsnorm(x, r, w)
        return y, x, r, norm.layernorm(y, g, b)

    want = f(x.clone(), r.clone(), w)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x.clone(), r.clone(), w)
    for a, e in zip(got, want):
        assert torch.equal(a, e)


# ---- validation ------------------------------------------------------------------------------

def _xw(dtype=torch.bfloat16):
    return testing.randn((4, 16), dtype), testing.randn((16,), dtype, seed=1)


def test_rejects_weight_dtype_mismatch():
    x, w = _xw()
    with pytest.raises(InputTypeError, match="weight must be bfloat16, got float32"):
        norm.rmsnorm(x, w.float())


def test_rejects_bad_input():
    x, w = _xw()
    with pytest.raises(InputTypeError, match="input must be float16 or bfloat16 or float32, got int32"):
        norm.rmsnorm(x.to(torch.int32), w)
    with pytest.raises(InputError, match="input must be 2-D or 3-D"):
        norm.rmsnorm(x[0], w)
    with pytest.raises(InputError, match="contiguous in its last dimension"):
        norm.rmsnorm(testing.randn((16, 4), torch.bfloat16).t(), w)
    with pytest.raises(InputTypeError, match="input must be a torch.Tensor"):
        norm.rmsnorm([[1.0]], w)


def test_rejects_bad_weight_shape_and_layout():
    x, w = _xw()
    with pytest.raises(InputError, match=r"weight must have shape \[16\]"):
        norm.rmsnorm(x, w[:8])
    with pytest.raises(InputError, match="weight must be contiguous"):
        norm.rmsnorm(x, testing.randn((32,), torch.bfloat16)[::2])


def test_rejects_bad_out():
    x, w = _xw()
    with pytest.raises(InputError, match=r"out must have shape \[4, 16\]"):
        norm.rmsnorm(x, w, out=torch.empty(4, 8, dtype=torch.bfloat16))
    with pytest.raises(InputTypeError, match="out must have the dtype of input"):
        norm.rmsnorm(x, w, out=torch.empty(4, 16, dtype=torch.float16))


def test_rejects_bad_scalars():
    x, w = _xw()
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="eps must be finite and >= 0"):
            norm.rmsnorm(x, w, eps=eps)
    with pytest.raises(InputTypeError, match="eps must be a float"):
        norm.rmsnorm(x, w, eps="1e-6")
    with pytest.raises(InputTypeError, match="enable_pdl must be None or a bool"):
        norm.rmsnorm(x, w, enable_pdl=1)


def test_rejects_device_mismatch():
    x, w = _xw()
    with pytest.raises(InputError, match="one device"):
        norm.rmsnorm(x, w.to("meta"))


def test_fused_rejects_residual_mismatch():
    x, w = _xw()
    with pytest.raises(InputError, match=r"residual must have shape \[4, 16\]"):
        norm.fused_add_rmsnorm(x, x[:2].clone(), w)
    with pytest.raises(InputTypeError, match="residual must have the dtype of input"):
        norm.fused_add_rmsnorm(x, x.half(), w)


def test_layernorm_rejects_non_float32_params():
    x = testing.randn((2, 8), torch.bfloat16)
    with pytest.raises(InputTypeError, match="gemma must be float32, got bfloat16"):
        norm.layernorm(x, torch.ones(8, dtype=torch.bfloat16), torch.zeros(8))
    with pytest.raises(InputError, match=r"beta must have shape \[8\]"):
        norm.layernorm(x, torch.ones(8), torch.zeros(9))
    with pytest.raises(InputError, match="input must be 2-D"):
        norm.layernorm(x[None], torch.ones(8), torch.zeros(8))
