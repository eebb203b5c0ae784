"""GPU tests of the gated activation kernel against the fp32 reference (computed on the GPU).

Grid reduction: d in {111 (2-byte accesses), 4096, 8191, 14336} x batch {1, 7, 99} x all three
activations x both dtypes, batch 989 only with d 111 and 4096 to keep host comparisons small.
Leading 3-D shapes, strided rows and outputs embedded in a NaN-poisoned buffer are separate tests.
"""

import pytest
import torch

from fi_core import testing
from fi_sampling import activation
from fi_sampling.activation.reference import act_and_mul_reference

pytestmark = testing.gpu_only()

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)
FNS = {"silu": activation.silu_and_mul, "gelu": activation.gelu_and_mul,
       "gelu_tanh": activation.gelu_tanh_and_mul}
SHAPES = [(b, d) for d in (111, 4096, 8191, 14336) for b in (1, 7, 99)] + [(989, 111), (989, 4096)]


def _x(shape, dtype, seed):
    return testing.randn(shape, dtype, DEV, seed=seed, scale=3.0)


@pytest.mark.parametrize("act", sorted(FNS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", SHAPES)
def test_act_and_mul(rows, d, dtype, act):
    x = _x((rows, 2 * d), dtype, seed=rows + d)
    out = testing.empty_poisoned((rows, d), dtype, DEV)
    assert FNS[act](x, out=out) is out
    testing.assert_close(out, act_and_mul_reference(x, act))


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_3d_shape(dtype):
    x = _x((3, 33, 2 * 1024), dtype, seed=1)
    for act, fn in FNS.items():
        testing.assert_close(fn(x), act_and_mul_reference(x, act))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,stride", [(7, 4096, 2 * 4096 + 64), (99, 111, 300), (5, 2048, 4097)])
def test_strided_rows_and_stray_writes(rows, d, stride, dtype):
    x = _x((rows, stride), dtype, seed=2)[:, : 2 * d]
    obuf = testing.empty_poisoned((rows, d + 16), dtype, DEV)
    out = obuf[:, 8: 8 + d]
    activation.silu_and_mul(x, out=out)
    testing.assert_close(out, act_and_mul_reference(x, "silu"))
    assert torch.isnan(obuf[:, :8]).all() and torch.isnan(obuf[:, 8 + d:]).all(), "stray write"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_dense_sweep(dtype):
    # The kernel's erf is a rational-exponential fit (|err| <= 1.5e-7), not erff: check every
    # representable gate value in [-12, 12] (both tails and the x >= 0 switch), up = 1 and up = 8.
    g = torch.arange(-12.0, 12.0, 2.0 ** -8, device=DEV).to(dtype).unique()
    for up in (1.0, 8.0):
        x = torch.cat([g, torch.full_like(g, up)]).view(1, -1)
        testing.assert_close(activation.gelu_and_mul(x), act_and_mul_reference(x, "gelu"))


def test_extreme_inputs_stay_finite():
    # silu's exp(-x) overflows to inf for x << 0; the result must be -0, not NaN.
    x = torch.tensor([[-200.0, -20.0, 0.0, 20.0, 1.0, 1.0, 1.0, 1.0]], device=DEV).to(torch.bfloat16)
    for act, fn in FNS.items():
        testing.assert_close(fn(x), act_and_mul_reference(x, act))


def test_empty_is_a_no_op():
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    assert activation.silu_and_mul(x).shape == (0, 32)
