"""CPU tests of the gated activations: validation errors, the reference against scalar
formulas, the CPU backend (any leading shape, strided rows), torch.compile(fullgraph=True)."""

import math

import pytest
import torch

from fi_core import InputError, InputTypeError, testing
from fi_sampling import activation
from fi_sampling.activation.reference import act_and_mul_reference

FNS = {"silu": activation.silu_and_mul, "gelu": activation.gelu_and_mul,
       "gelu_tanh": activation.gelu_tanh_and_mul}

_SCALAR = {
    "silu": lambda v: v / (1.0 + math.exp(-v)),
    "gelu": lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))),
    "gelu_tanh": lambda v: 0.5 * v * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3))),
}


def _naive(x, act):
    rows = x.reshape(-1, x.shape[-1]).double()
    d = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], d, dtype=torch.float64)
    for i in range(rows.shape[0]):
        for j in range(d):
            out[i, j] = _SCALAR[act](float(rows[i, j])) * float(rows[i, d + j])
    return out.reshape(*x.shape[:-1], d)


@pytest.mark.parametrize("act", sorted(FNS))
def test_reference_matches_scalar_formula(act):
    x = testing.randn((3, 2, 2 * 9), torch.float32, seed=1, scale=3.0)
    torch.testing.assert_close(act_and_mul_reference(x, act).double(), _naive(x, act),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("act", sorted(FNS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_backend_any_leading_shape(act, dtype):
    x = testing.randn((2, 3, 4, 2 * 11), dtype, seed=2)
    out = testing.empty_poisoned((2, 3, 4, 11), dtype, "cpu")
    assert FNS[act](x, out=out) is out
    testing.assert_close(out, _naive(x.float(), act).to(dtype))
    testing.assert_close(FNS[act](x[0, 0, 0]), _naive(x[0, 0, 0][None].float(), act)[0].to(dtype))


def test_cpu_strided_rows():
    base = testing.randn((5, 100), torch.bfloat16, seed=3)
    x = base[:, 10:74]  # row stride 100, last dim contiguous
    testing.assert_close(activation.silu_and_mul(x), _naive(x.float(), "silu").to(torch.bfloat16))


def test_torch_compile_fullgraph_cpu():
    x = testing.randn((6, 2 * 24), torch.bfloat16, seed=4)

    def f(x):
        return activation.silu_and_mul(x) + activation.gelu_and_mul(x) * activation.gelu_tanh_and_mul(x)

    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


def test_rejects_odd_last_dim():
    with pytest.raises(InputError, match="last dimension must be even"):
        activation.silu_and_mul(torch.randn(3, 7, dtype=torch.bfloat16))


def test_rejects_bad_dtype_and_layout():
    with pytest.raises(InputTypeError, match="input must be float16 or bfloat16 or float32, got int64"):
        activation.silu_and_mul(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(InputError, match="contiguous in its last dimension"):
        activation.silu_and_mul(torch.randn(8, 4, dtype=torch.bfloat16).t())
    with pytest.raises(InputError, match="at least 1 dimension"):
        activation.silu_and_mul(torch.tensor(1.0))


def test_rejects_bad_out():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"out must have shape \[3, 4\]"):
        activation.gelu_and_mul(x, out=torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(InputTypeError, match="out must have the dtype of input"):
        activation.gelu_and_mul(x, out=torch.empty(3, 4, dtype=torch.float16))
    with pytest.raises(InputTypeError, match="enable_pdl must be None or a bool"):
        activation.gelu_and_mul(x, enable_pdl="yes")
