import pytest
import torch

from fi_core import checks
from fi_core.errors import InputError, InputTypeError


def test_output_allocates_or_validates():
    out = checks.output("out", None, (3, 4), torch.bfloat16, torch.device("cpu"))
    assert out.shape == (3, 4) and out.dtype == torch.bfloat16
    given = torch.empty(3, 4, dtype=torch.bfloat16)
    assert checks.output("out", given, (3, 4), torch.bfloat16, torch.device("cpu")) is given
    with pytest.raises(InputError, match=r"out must have shape \[3, 5\], got \(3, 4\)"):
        checks.output("out", given, (3, 5), torch.bfloat16, torch.device("cpu"))
    with pytest.raises(InputTypeError, match="out must be float16, got bfloat16"):
        checks.output("out", given, (3, 4), torch.float16, torch.device("cpu"))
    with pytest.raises(InputError, match="out must be on meta, got cpu"):
        checks.output("out", given, (3, 4), torch.bfloat16, torch.device("meta"))
    with pytest.raises(InputError, match="contiguous in its last dimension"):
        checks.output("out", torch.empty(4, 3, dtype=torch.bfloat16).T, (3, 4), torch.bfloat16,
                      torch.device("cpu"))
    with pytest.raises(InputTypeError, match="must be a torch.Tensor"):
        checks.output("out", [1, 2], (2,), torch.float32, torch.device("cpu"))


def test_finite_float():
    import numpy as np

    assert checks.finite_float("s", 2) == 2.0 and checks.finite_float("s", np.float32(0.5)) == 0.5
    assert checks.finite_float("s", torch.tensor(1.5).item()) == 1.5
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(InputError, match="s must be finite"):
            checks.finite_float("s", bad)
    for bad in ("1", True, None, [1.0]):
        with pytest.raises(InputTypeError, match="s must be a real number"):
            checks.finite_float("s", bad)


def test_dtype_and_int_values():
    half = (torch.float16, torch.bfloat16)
    assert checks.dtype_value("q", "bf16", half) is torch.bfloat16
    with pytest.raises(InputTypeError, match="q must be float16 or bfloat16, got int8"):
        checks.dtype_value("q", torch.int8, half)
    with pytest.raises(InputTypeError, match="q must be a torch.dtype or its name, got 'bogus'"):
        checks.dtype_value("q", "bogus", half)
    assert checks.int_value("n", 3, 1) == 3 and checks.int_value("n", torch.tensor(2), 0) == 2
    for bad in (0, 2.0, True, "3"):
        with pytest.raises(InputError, match="n must be an int >= 1"):
            checks.int_value("n", bad, 1)


def test_indptr_values():
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    checks.indptr_values("p", i32([0, 2, 2, 5]), 5, exact=True)
    checks.indptr_values("p", i32([0, 2, 2, 5]), 7)
    with pytest.raises(InputError, match=r"p must start at 0 and be non-decreasing, got \[1, 2\]"):
        checks.indptr_values("p", i32([1, 2]))
    with pytest.raises(InputError, match=r"p must start at 0 and be non-decreasing, got \[0, 3, 2\]"):
        checks.indptr_values("p", i32([0, 3, 2]))
    with pytest.raises(InputError, match=r"p must start at 0, be non-decreasing and end at nnz=4, got \[0, 5\]"):
        checks.indptr_values("p", i32([0, 5]), 4, exact=True, end_name="nnz")
    with pytest.raises(InputError, match=r"p must start at 0, be non-decreasing and end <= 4, got \[0, 5\]"):
        checks.indptr_values("p", i32([0, 5]), 4)
    with pytest.raises(InputError, match="p must start at 0 and be non-decreasing, got \\[\\]"):
        checks.indptr_values("p", i32([]))


def test_index_values():
    checks.index_values("ids", torch.tensor([0, 3, 1]), 4)
    checks.index_values("ids", torch.tensor([], dtype=torch.int32), 0)
    with pytest.raises(InputError, match=r"^ids must be in \[0, 4\) \(the cache\), got \[-1, 3\]$"):
        checks.index_values("ids", torch.tensor([3, -1]), 4, " (the cache)")
    with pytest.raises(InputError, match=r"got \[0, 4\]"):
        checks.index_values("ids", torch.tensor([0, 4]), 4)


def test_same_device():
    a, b = torch.zeros(2), torch.zeros(3)
    assert checks.same_device(a=a, b=b, c=None) == torch.device("cpu")
    with pytest.raises(InputError, match="a on cpu, b on meta"):
        checks.same_device(a=a, b=b.to("meta"))
    # a non-tensor is named as such, not an AttributeError on .device
    with pytest.raises(InputTypeError, match="out must be a torch.Tensor, got float"):
        checks.same_device(a=a, out=1.0)
