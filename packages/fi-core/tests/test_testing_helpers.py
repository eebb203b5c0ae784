import pytest
import torch

from fi_core import testing


def test_assert_close_passes_within_and_fails_outside_tolerance():
    e = torch.linspace(-2, 2, 101)
    testing.assert_close(e.to(torch.bfloat16), e, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="1/101 elements outside"):
        a = e.clone()
        a[7] += 0.1
        testing.assert_close(a, e, dtype=torch.bfloat16)


def test_assert_close_catches_nan_and_shape():
    e = torch.ones(4)
    a = e.clone()
    a[2] = float("nan")
    with pytest.raises(AssertionError, match="elements outside"):
        testing.assert_close(a, e)
    with pytest.raises(AssertionError, match="shape mismatch"):
        testing.assert_close(torch.ones(3), e)


def test_poison_and_random_inputs():
    t = testing.empty_poisoned((5,), torch.float16, "cpu")
    assert torch.isnan(t).all()
    i = testing.poison_(torch.empty(3, dtype=torch.int32))
    assert (i == -0x5A5A5A5A).all()
    x = testing.randn((64,), torch.bfloat16, seed=3)
    assert x.dtype == torch.bfloat16 and (x != 0).all()
    assert torch.equal(x, testing.randn((64,), torch.bfloat16, seed=3))


def test_reference_run_bound():
    exact = torch.randn(100, dtype=torch.float64)
    same = exact.to(torch.bfloat16)
    testing.assert_close_to_reference_run(same, same, exact)
    with pytest.raises(AssertionError, match="same-precision error"):
        testing.assert_close_to_reference_run(exact + 0.5, same, exact)


def test_tolerance_table_is_complete_for_kernel_dtypes():
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        atol, rtol = testing.tolerance(dt)
        assert 0 < atol < 1 and 0 < rtol < 1
    with pytest.raises(KeyError, match="add it to"):
        testing.tolerance(torch.int8)
