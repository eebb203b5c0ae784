"""CPU tests of the sampling ops: validation, references vs naive formulas, the CPU backend."""

import pytest
import torch

from fi_core.errors import InputError, InputTypeError
from fi_sampling import sampling as S
from fi_sampling.sampling import reference as R


def _probs(b=3, v=37, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g)
    if ties:
        x = x.round()  # many exact ties
    return torch.softmax(x, dim=-1)


# ---- validation -------------------------------------------------------------------------------
def test_rejects_wrong_dtype():
    with pytest.raises(InputTypeError, match="float32"):
        S.sampling_from_probs(_probs().double(), seed=0)


def test_rejects_wrong_ndim():
    with pytest.raises(InputError, match="2-D"):
        S.top_p_sampling_from_probs(_probs()[0], 0.9, seed=0)


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan")])
def test_rejects_top_p_out_of_range(p):
    with pytest.raises(InputError, match=r"top_p must be in \(0.0, 1.0\]"):
        S.top_p_sampling_from_probs(_probs(), p, seed=0)


def test_top_k_first_checks_top_p_before_its_first_step(monkeypatch):
    """top_k_first runs the top-k renorm, then top-p sampling: a bad top_p (a value out of range,
    a tensor on another device) must fail before the renorm launches anything."""
    from fi_sampling.sampling import api  # noqa: PLC0415

    ran = []
    monkeypatch.setattr(api, "top_k_renorm_probs", lambda *a, **k: ran.append(1))
    for top_p, match in ((1.5, "top_p must be in"), (torch.full((3,), 0.5, device="meta"), "top_p must be on")):
        with pytest.raises(InputError, match=match):
            S.top_k_top_p_sampling_from_probs(_probs(), 3, top_p, seed=0)
    assert ran == []


def test_rejects_bad_top_k():
    with pytest.raises(InputError, match="top_k"):
        S.top_k_sampling_from_probs(_probs(), 0, seed=0)
    with pytest.raises(InputTypeError, match="top_k must be an int"):
        S.top_k_sampling_from_probs(_probs(), 2.5, seed=0)
    with pytest.raises(InputTypeError, match="int32 or int64"):
        S.top_k_sampling_from_probs(_probs(), torch.ones(3), seed=0)
    with pytest.raises(InputError, match=r"shape \[3\]"):
        S.top_k_sampling_from_probs(_probs(), torch.ones(4, dtype=torch.int32), seed=0)


def test_rejects_bad_indices_and_seed():
    with pytest.raises(InputTypeError, match="indices"):
        S.sampling_from_probs(_probs(), indices=torch.zeros(2), seed=0)
    with pytest.raises(InputTypeError, match="seed"):
        S.sampling_from_probs(_probs(), seed=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(InputError, match="seed as a tensor"):
        S.sampling_from_probs(_probs(), seed=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(InputTypeError, match="seed must be an int"):
        S.sampling_from_probs(_probs(), seed=1.5)


def test_rejects_bad_order_and_min_p():
    with pytest.raises(InputError, match="filter_apply_order"):
        S.top_k_top_p_sampling_from_probs(_probs(), 3, 0.9, filter_apply_order="top_p_first")
    with pytest.raises(InputError, match=r"min_p must be in \[0.0, 1.0\]"):
        S.min_p_sampling_from_probs(_probs(), 1.5, seed=0)


def test_rejects_bad_temperature():
    with pytest.raises(InputError, match="temperature"):
        S.softmax(torch.randn(2, 5), temperature=0.0)


def test_check_nan_raises():
    p = _probs()
    p[1, 3] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        S.top_p_sampling_from_probs(p, 0.9, check_nan=True, seed=0)


# ---- references vs naive definitions ----------------------------------------------------------
def _naive_keep(p, kind, k=None, tp=None, mp=None):
    v = len(p)
    keep = []
    for j in range(v):
        above = [p[i] for i in range(v) if p[i] > p[j]]
        if kind == "top_k":
            keep.append(len(above) < k)
        elif kind == "top_p":
            keep.append(sum(above) < tp)
        else:
            keep.append(p[j] >= mp * max(p))
    return torch.tensor(keep)


@pytest.mark.parametrize("ties", [False, True])
def test_masks_match_naive_definition(ties):
    probs = _probs(4, 23, seed=5, ties=ties).double()
    for r in range(4):
        p = probs[r].tolist()
        for k in (1, 3, 10):
            assert torch.equal(R.top_k_mask(probs[r:r + 1], k)[0], _naive_keep(p, "top_k", k=k))
        for tp in (0.05, 0.5, 0.9, 1.0):
            assert torch.equal(R.top_p_mask(probs[r:r + 1], tp)[0], _naive_keep(p, "top_p", tp=tp))
        for mp in (0.0, 0.1, 0.5):
            assert torch.equal(R.min_p_mask(probs[r:r + 1], mp)[0], _naive_keep(p, "min_p", mp=mp))


def test_filtered_probs_orders_differ_as_defined():
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    joint = R.filtered_probs(p, "top_k_top_p", top_k=3, top_p=0.6, filter_apply_order="joint")
    first = R.filtered_probs(p, "top_k_top_p", top_k=3, top_p=0.6)
    # joint: top-p on the original keeps {0.4, 0.3}; top-k first renormalises to 4/9, 3/9, 2/9,
    # whose mass above 2/9 is 7/9 >= 0.6, so it keeps the same two tokens.
    assert torch.allclose(joint, torch.tensor([[4 / 7, 3 / 7, 0, 0]], dtype=torch.float64))
    assert torch.allclose(first, joint)
    # k=2, p=0.5: joint keeps {0.4, 0.3} (mass above 0.3 is 0.4 < 0.5); top-k first renormalises
    # to 4/7, 3/7, and the mass above 3/7 is 4/7 >= 0.5, so only the first token stays.
    joint2 = R.filtered_probs(p, "top_k_top_p", top_k=2, top_p=0.5, filter_apply_order="joint")
    assert torch.allclose(joint2, torch.tensor([[4 / 7, 3 / 7, 0, 0]], dtype=torch.float64))
    first2 = R.filtered_probs(p, "top_k_top_p", top_k=2, top_p=0.5)
    assert torch.allclose(first2, torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64))


def test_renorm_and_mask_references_naive():
    p = _probs(2, 17, seed=2)
    out = S.top_k_renorm_probs(p, 4)
    for r in range(2):
        keep = _naive_keep(p[r].double().tolist(), "top_k", k=4)
        exp = torch.where(keep, p[r], torch.zeros_like(p[r]))
        assert torch.allclose(out[r], exp / exp.sum(), atol=1e-6)
    x = torch.randn(2, 17)
    m = S.top_k_mask_logits(x, 5)
    assert ((m > float("-inf")).sum(dim=-1) == 5).all()
    assert torch.equal(m.max(dim=-1).values, x.max(dim=-1).values)


def test_softmax_reference():
    x = torch.randn(3, 11)
    t = torch.tensor([0.5, 1.0, 2.0])
    got = S.softmax(x, temperature=t)
    for r in range(3):
        e = torch.exp((x[r] - x[r].max()) / t[r])
        assert torch.allclose(got[r], e / e.sum(), atol=1e-6)


# ---- CPU backend ------------------------------------------------------------------------------
def test_cpu_backend_invariants_and_determinism():
    p = _probs(8, 301, seed=7)
    for k in (1, 5):
        toks = S.top_k_sampling_from_probs(p, k, seed=3, offset=1)
        keep = R.top_k_mask(p, k)
        assert toks.dtype == torch.int32 and toks.shape == (8,)
        assert keep[torch.arange(8), toks.long()].all()
    toks = S.top_p_sampling_from_probs(p, 0.3, seed=3)
    assert R.top_p_mask(p, 0.3)[torch.arange(8), toks.long()].all()
    toks = S.min_p_sampling_from_probs(p, 0.5, seed=3)
    assert R.min_p_mask(p, 0.5)[torch.arange(8), toks.long()].all()
    a = S.top_p_sampling_from_probs(p, 0.9, seed=11, offset=4)
    b = S.top_p_sampling_from_probs(p, 0.9, seed=11, offset=4)
    assert torch.equal(a, b)


def test_cpu_indices_map_rows():
    p = torch.zeros(3, 10)
    p[0, 2] = p[1, 5] = p[2, 9] = 1.0
    idx = torch.tensor([2, 0, 1, 1], dtype=torch.int64)
    assert S.sampling_from_probs(p, indices=idx, seed=0).tolist() == [9, 2, 5, 5]


def test_cpu_generator_advances():
    g = torch.Generator().manual_seed(0)
    p = _probs(64, 50)
    a = S.sampling_from_probs(p, generator=g)
    b = S.sampling_from_probs(p, generator=g)
    assert not torch.equal(a, b)


def test_chain_speculative_reference_all_accepted():
    # draft == target: every draft token is accepted and the bonus token comes from the last row
    t = _probs(2, 9, seed=1).reshape(2, 1, 9).expand(2, 3, 9).contiguous()
    ids = torch.tensor([[1, 2], [3, 4]])
    out, acc, emi = S.chain_speculative_sampling(t[:, :2], ids, t, seed=0)
    assert out[:, :2].tolist() == ids.tolist() and (out[:, 2] >= 0).all()
    assert acc.tolist() == [2, 2] and emi.tolist() == [2, 2]


def test_torch_compile_fullgraph_cpu():
    def f(x):
        return S.top_p_sampling_from_probs(torch.softmax(x, -1), 0.9, seed=1, offset=0)

    x = torch.randn(4, 33)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


def test_chain_speculative_validation():
    d = _probs(2, 9).reshape(2, 1, 9)
    with pytest.raises(InputError, match=r"target_probs must have shape \[2, 2, 9\]"):
        S.chain_speculative_sampling(d, torch.zeros(2, 1, dtype=torch.int32), d, seed=0)
    t = _probs(4, 9).reshape(2, 2, 9)
    with pytest.raises(InputTypeError, match="maybe_output_accepted_token_num"):
        S.chain_speculative_sampling(d, torch.zeros(2, 1, dtype=torch.int32), t,
                                     maybe_output_accepted_token_num=torch.zeros(2), seed=0)


def test_docstring_examples_run():
    import doctest

    from fi_sampling.sampling import api, speculative

    for mod in (api, speculative):
        res = doctest.testmod(mod, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
        assert res.failed == 0, f"{mod.__name__}: {res.failed} docstring example(s) failed"


def test_rejects_nan_min_p_and_temperature():
    with pytest.raises(InputError, match=r"min_p must be in \[0.0, 1.0\], got nan"):
        S.min_p_sampling_from_probs(_probs(), float("nan"), seed=0)
    with pytest.raises(InputError, match=r"temperature must be in \(0.0, inf\], got nan"):
        S.softmax(_probs(), temperature=float("nan"))
