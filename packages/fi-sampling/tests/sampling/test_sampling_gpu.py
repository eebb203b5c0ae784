"""GPU tests of the sampling kernels: frequencies vs the exact filtered distribution, hard
invariants on a real vocabulary, determinism, CUDA-graph replay with device seeds, NaN rows, and
renorm / mask / softmax vs the references."""

import pytest
import torch

from fi_core import knobs, testing
from fi_core.errors import InputError
from fi_sampling import sampling as S
from fi_sampling.sampling import reference as R

pytestmark = testing.gpu_only()

VOCAB = 128256


def _probs(b, v, seed=0, scale=1.0, device="cuda"):
    return torch.softmax(testing.randn((b, v), torch.float32, "cpu", seed=seed, scale=scale), -1).to(device)


# ---- frequencies ------------------------------------------------------------------------------
# N samples of one row of a vocab-111 distribution (the batch repeats row 0 through `indices`;
# every output row draws from its own Philox stream). The empirical distribution's total
# variation from the exact one has mean <= 0.5 * sqrt(2 V / (pi N)) = 0.0094 for N = 200k, and a
# single sample moves it by <= 1/N, so by McDiarmid P(TV > 0.02) <= exp(-2 N 0.0106^2) ~ e^-45.
N_SAMPLES = 200_000
TV_BOUND = 0.02

CASES = [
    ("plain", dict()),
    ("top_k", dict(top_k=1)),
    ("top_k", dict(top_k=10)),
    ("top_k", dict(top_k=111)),  # k covers every positive token: the cut is 0 (plain draw)
    ("top_p", dict(top_p=0.5)),
    ("top_p", dict(top_p=0.9)),
    ("min_p", dict(min_p=0.1)),
    ("joint", dict(top_k=10, top_p=0.6)),
    ("top_k_first", dict(top_k=10, top_p=0.6)),
]


def _run(kind, probs, idx, kw, seed=0, offset=0):
    common = dict(indices=idx, seed=seed, offset=offset)
    if kind == "plain":
        return S.sampling_from_probs(probs, **common)
    if kind == "top_k":
        return S.top_k_sampling_from_probs(probs, kw["top_k"], **common)
    if kind == "top_p":
        return S.top_p_sampling_from_probs(probs, kw["top_p"], **common)
    if kind == "min_p":
        return S.min_p_sampling_from_probs(probs, kw["min_p"], **common)
    order = "joint" if kind == "joint" else "top_k_first"
    return S.top_k_top_p_sampling_from_probs(probs, kw["top_k"], kw["top_p"],
                                             filter_apply_order=order, **common)


def _exact(kind, probs, kw):
    if kind in ("joint", "top_k_first"):
        order = "joint" if kind == "joint" else "top_k_first"
        return R.filtered_probs(probs, "top_k_top_p", top_k=kw["top_k"], top_p=kw["top_p"],
                                filter_apply_order=order)[0]
    return R.filtered_probs(probs, kind, top_k=kw.get("top_k"), top_p=kw.get("top_p"),
                            min_p=kw.get("min_p"))[0]


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{c}-{list(k.values())}" for c, k in CASES])
def test_frequencies_match_exact_distribution(kind, kw):
    probs = _probs(1, 111, seed=3, scale=2.0)
    idx = torch.zeros(N_SAMPLES, dtype=torch.int32, device="cuda")
    toks = _run(kind, probs, idx, kw, seed=1234, offset=7)
    assert toks.dtype == torch.int32 and toks.shape == (N_SAMPLES,)
    exact = _exact(kind, probs, kw)
    counts = torch.bincount(toks.long().cpu(), minlength=111).double()
    assert counts.numel() == 111, "token id out of range"
    assert (counts[exact == 0] == 0).all(), "a filtered-out token was returned"
    tv = 0.5 * (counts / N_SAMPLES - exact).abs().sum().item()
    assert tv <= TV_BOUND, f"total variation {tv:.4f} > {TV_BOUND}"


def test_top_k_sparse_row_frequencies():
    # 30 positive tokens of 1000: k = 50 keeps all of them (zeros are never drawn); k = 7 cuts
    # inside the positive ones. Same TV bound as above (V = 30 effective tokens is smaller).
    dense = _probs(1, 30, seed=5, scale=2.0)
    probs = torch.zeros(1, 1000, device="cuda")
    probs[0, ::33][:30] = dense[0, :30]
    idx = torch.zeros(N_SAMPLES, dtype=torch.int32, device="cuda")
    for k in (50, 7):
        toks = S.top_k_sampling_from_probs(probs, k, indices=idx, seed=99, offset=k)
        exact = R.filtered_probs(probs, "top_k", top_k=k)[0]
        counts = torch.bincount(toks.long().cpu(), minlength=1000).double()
        assert counts.numel() == 1000 and (counts[exact == 0] == 0).all()
        tv = 0.5 * (counts / N_SAMPLES - exact).abs().sum().item()
        assert tv <= TV_BOUND, f"k={k}: total variation {tv:.4f} > {TV_BOUND}"


def test_logits_frequencies_both_orders():
    logits = testing.randn((1, 111), torch.float32, "cuda", seed=9, scale=2.0)
    idx = torch.zeros(N_SAMPLES, dtype=torch.int32, device="cuda")
    probs = torch.softmax(logits.double(), -1)
    for order in ("top_k_first", "joint"):
        toks = S.top_k_top_p_sampling_from_logits(logits, 20, 0.8, indices=idx,
                                                  filter_apply_order=order, seed=5, offset=0)
        exact = R.filtered_probs(probs, "top_k_top_p", top_k=20, top_p=0.8, filter_apply_order=order)[0]
        counts = torch.bincount(toks.long().cpu(), minlength=111).double()
        assert (counts[exact == 0] == 0).all()
        assert 0.5 * (counts / N_SAMPLES - exact).abs().sum().item() <= TV_BOUND
    toks = S.sampling_from_logits(logits, indices=idx, seed=5)
    counts = torch.bincount(toks.long().cpu(), minlength=111).double()
    assert 0.5 * (counts / N_SAMPLES - probs[0].cpu()).abs().sum().item() <= TV_BOUND


# ---- hard invariants on the real vocabulary ---------------------------------------------------
def _allowed(kind, probs, kw):
    """Kept sets with a sliver of slack at the cutoff: the kernel sums mass in float32, the
    reference in float64, so a token within ~1e-6 of the top-p / min-p cutoff may go either way."""
    if kind == "top_k":
        return R.top_k_mask(probs, kw["top_k"])
    if kind == "top_p":  # float64 sort on the device: the host sort of 989 x 128256 is slow
        return R.top_p_mask(probs, kw["top_p"] + 1e-5, device=probs.device).cpu()
    return R.min_p_mask(probs, kw["min_p"] * (1 - 1e-6))


# Llama-3 vocab at every batch size, Llama-2's 32000 at two (the kernels take any vocab; 111 and
# 4097 are covered by the frequency and renorm tests).
@pytest.mark.parametrize("batch,vocab", [(1, VOCAB), (7, VOCAB), (99, VOCAB), (989, VOCAB),
                                         (7, 32000), (99, 32000)])
@pytest.mark.parametrize("kind,kw", [("top_k", dict(top_k=50)), ("top_p", dict(top_p=0.9)),
                                     ("min_p", dict(min_p=0.1)), ("top_k", dict(top_k=1))])
def test_never_outside_the_filtered_set(batch, vocab, kind, kw):
    probs = _probs(batch, vocab, seed=batch)
    toks = _run(kind, probs, None, kw, seed=batch, offset=1)
    assert toks.dtype == torch.int32 and toks.shape == (batch,)
    t = toks.long().cpu()
    assert ((t >= 0) & (t < vocab)).all()
    if kind == "top_k":  # exact and cheap on the device
        kth = torch.topk(probs, kw["top_k"], dim=-1).values[:, -1:]
        ok = probs.gather(1, toks.long().unsqueeze(1)) >= kth
        assert ok.all()
    else:
        keep = _allowed(kind, probs, kw)
        assert keep[torch.arange(batch), t].all()


def test_per_row_thresholds_and_indices():
    probs = _probs(5, VOCAB, seed=11)
    idx = torch.tensor([4, 0, 0, 3, 1, 2, 4], dtype=torch.int32, device="cuda")
    ks = torch.tensor([1, 5, 50, 1000, 2, 7, 3], dtype=torch.int32, device="cuda")
    toks = S.top_k_sampling_from_probs(probs, ks, indices=idx, seed=3)
    rows = probs[idx.long()]
    keep = R.top_k_mask(rows, ks)
    assert keep[torch.arange(7), toks.long().cpu()].all()
    assert toks[0].item() == int(rows[0].argmax())  # k = 1 is greedy
    ps = torch.tensor([0.1, 0.5, 0.9, 1.0, 0.3, 0.7, 0.05], device="cuda")
    toks = S.top_p_sampling_from_probs(probs, ps, indices=idx, seed=3)
    assert R.top_p_mask(rows, ps.cpu() + 1e-5)[torch.arange(7), toks.long().cpu()].all()


# ---- determinism and CUDA graphs --------------------------------------------------------------
def test_same_seed_same_tokens():
    probs = _probs(64, VOCAB, seed=1)
    for fn in (lambda s, o: S.top_k_sampling_from_probs(probs, 50, seed=s, offset=o),
               lambda s, o: S.top_p_sampling_from_probs(probs, 0.9, seed=s, offset=o),
               lambda s, o: S.sampling_from_probs(probs, seed=s, offset=o)):
        a, b = fn(42, 3), fn(42, 3)
        assert torch.equal(a, b)
        c = fn(42, 4)
        assert not torch.equal(a, c), "a different offset should give a different stream"


def test_generator_draws_and_advances():
    probs = _probs(64, 1000, seed=2)
    g = torch.Generator(device="cuda").manual_seed(7)
    a = S.sampling_from_probs(probs, generator=g)
    b = S.sampling_from_probs(probs, generator=g)
    g2 = torch.Generator(device="cuda").manual_seed(7)
    assert torch.equal(S.sampling_from_probs(probs, generator=g2), a)
    assert not torch.equal(a, b)


def test_cuda_graph_replay_reads_device_seed():
    probs = _probs(16, VOCAB, seed=4)
    seed = torch.tensor([123], dtype=torch.int64, device="cuda")
    offset = torch.tensor([0], dtype=torch.int64, device="cuda")
    fn = lambda: S.top_p_sampling_from_probs(probs, 0.9, seed=seed, offset=offset)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    for sd, off in ((123, 0), (123, 5), (99, 1)):
        seed.fill_(sd)
        offset.fill_(off)
        g.replay()
        torch.cuda.synchronize()
        eager = S.top_p_sampling_from_probs(probs, 0.9, seed=sd, offset=off)
        assert torch.equal(out, eager), f"replay differs from eager for seed={sd} offset={off}"


def test_per_row_seed_tensor():
    probs = _probs(4, 500, seed=6)
    seeds = torch.tensor([1, 2, 3, 4], dtype=torch.int64, device="cuda")
    a = S.sampling_from_probs(probs, seed=seeds, offset=0)
    for r in range(4):
        one = S.sampling_from_probs(probs, seed=r + 1, offset=0)
        assert a[r] == one[r]


# ---- NaN / degenerate rows --------------------------------------------------------------------
def test_nan_and_degenerate_rows_stay_in_range():
    probs = _probs(4, VOCAB, seed=8)
    probs[0] = float("nan")
    probs[1] = 0.0
    probs[2, ::3] = -1.0
    probs[3, 17] = float("nan")
    for fn in (lambda: S.sampling_from_probs(probs, seed=0),
               lambda: S.top_k_sampling_from_probs(probs, 50, seed=0),
               lambda: S.top_p_sampling_from_probs(probs, 0.9, seed=0),
               lambda: S.min_p_sampling_from_probs(probs, 0.1, seed=0),
               lambda: S.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint", seed=0)):
        t = fn()
        torch.cuda.synchronize()
        assert ((t >= 0) & (t < VOCAB)).all()
        assert t[0].item() == 0 and t[1].item() == 0  # documented: no positive mass -> token 0
        assert probs[2, t[2].long()] > 0 and probs[3, t[3].long()] > 0
    with pytest.raises(InputError, match="NaN"):
        S.top_p_sampling_from_probs(probs, 0.9, check_nan=True, seed=0)


def test_bad_indices_never_fault():
    probs = _probs(3, 1000, seed=1)
    idx = torch.tensor([0, 5, -1, 2], dtype=torch.int32, device="cuda")
    with knobs.override(FI_CHECK_INPUTS="1"):
        with pytest.raises(InputError, match="indices must lie"):
            S.sampling_from_probs(probs, indices=idx, seed=0)
    with knobs.override(FI_CHECK_INPUTS="0"):  # unchecked: the kernel guards the read
        t = S.sampling_from_probs(probs, indices=idx, seed=0)
    torch.cuda.synchronize()
    assert t[1].item() == 0 and t[2].item() == 0


# ---- renorm / mask / softmax ------------------------------------------------------------------
@pytest.mark.parametrize("batch,vocab", [(1, 111), (7, 4097), (5, 32000), (3, VOCAB)])
def test_renorm_mask_softmax_match_reference(batch, vocab):
    probs = _probs(batch, vocab, seed=vocab)
    out = testing.empty_poisoned((batch, vocab), torch.float32, "cuda")
    out.copy_(S.top_k_renorm_probs(probs, 20))
    testing.assert_close(out, R.top_k_renorm_probs(probs.cpu(), 20), dtype=torch.float32)
    ks = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda") * 3
    testing.assert_close(S.top_k_renorm_probs(probs, ks), R.top_k_renorm_probs(probs.cpu(), ks),
                         dtype=torch.float32)
    if vocab <= 4097:  # float32 vs float64 mass at the cutoff: keep gaps >> 1e-7 (see _allowed)
        testing.assert_close(S.top_p_renorm_probs(probs, 0.7), R.top_p_renorm_probs(probs.cpu(), 0.7),
                             dtype=torch.float32)
    logits = testing.randn((batch, vocab), torch.float32, "cuda", seed=vocab + 1)
    testing.assert_close(S.top_k_mask_logits(logits, 33), R.top_k_mask_logits(logits.cpu(), 33),
                         dtype=torch.float32)
    temp = torch.linspace(0.5, 2.0, batch, device="cuda")
    testing.assert_close(S.softmax(logits, temperature=temp), R.softmax(logits.cpu(), temp.cpu()),
                         dtype=torch.float32)
    testing.assert_close(S.softmax(logits, 0.7), R.softmax(logits.cpu(), 0.7), dtype=torch.float32)


def test_non_contiguous_rows():
    big = _probs(6, 2 * 1003, seed=2)
    probs = big[:, :1003]  # row stride 2006, vocab not a multiple of 4: scalar loads
    probs = probs / probs.sum(-1, keepdim=True)
    probs = big[:, :1003].copy_(probs)
    toks = S.top_k_sampling_from_probs(probs, 5, seed=0)
    assert R.top_k_mask(probs, 5)[torch.arange(6), toks.long().cpu()].all()
    testing.assert_close(S.top_k_renorm_probs(probs, 5), R.top_k_renorm_probs(probs.cpu(), 5),
                         dtype=torch.float32)


def test_ties_at_the_cutoff_are_kept():
    # A uniform row: every token ties with the k-th, so top-k keeps all of them (FlashInfer's rule);
    # this also drives the threshold search through its exact key-space fallback.
    v = 4096
    probs = torch.full((2, v), 1.0 / v, device="cuda")
    testing.assert_close(S.top_k_renorm_probs(probs, 5), probs, dtype=torch.float32)
    logits = torch.zeros(2, v, device="cuda")
    assert torch.equal(S.top_k_mask_logits(logits, 5), logits)
    idx = torch.zeros(20000, dtype=torch.int32, device="cuda")
    toks = S.top_k_sampling_from_probs(probs, 5, indices=idx, seed=0)
    assert torch.unique(toks).numel() > 4000  # far more than 5 distinct tokens
    # Two-level ties: 3 tokens share the top value, the rest tie below; k = 2 keeps the top 3.
    p = torch.full((1, 1000), 1.0, device="cuda")
    p[0, [10, 500, 999]] = 5.0
    p = p / p.sum()
    out = S.top_k_renorm_probs(p, 2)
    assert torch.equal((out[0] > 0).nonzero().flatten().cpu(), torch.tensor([10, 500, 999]))


# ---- chain speculative sampling ---------------------------------------------------------------
def test_chain_speculative_output_follows_target():
    # Draft tokens drawn from q; the speculative-sampling theorem says the first output token is
    # distributed exactly as the target row 0, and a draft is accepted with prob sum(min(p, q)).
    v, n_req = 111, N_SAMPLES
    q = _probs(1, v, seed=21, scale=1.5)
    p = _probs(2, v, seed=22, scale=1.5)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.multinomial(q[0], n_req, replacement=True, generator=g).view(n_req, 1)
    draft = q.view(1, 1, v).expand(n_req, 1, v).contiguous()
    target = p.view(1, 2, v).expand(n_req, 2, v).contiguous()
    out, acc, emi = S.chain_speculative_sampling(draft, ids, target, seed=3, offset=0)
    assert out.shape == (n_req, 2) and out.dtype == torch.int32
    assert torch.equal(acc, emi)
    accepted = acc.bool()
    assert torch.equal(out[accepted, 0].long(), ids[accepted, 0])
    assert (out[~accepted, 1] == -1).all() and (out[accepted, 1] >= 0).all()
    counts = torch.bincount(out[:, 0].long().cpu(), minlength=v).double()
    tv = 0.5 * (counts / n_req - p[0].double().cpu()).abs().sum().item()
    assert tv <= TV_BOUND, f"first token: total variation {tv:.4f}"
    rate = torch.minimum(p[0], q[0]).sum().item()
    sd = (rate * (1 - rate) / n_req) ** 0.5
    assert abs(accepted.double().mean().item() - rate) < 6 * sd
    # same seed -> same result; counters accumulate into caller buffers
    out2, _, _ = S.chain_speculative_sampling(draft, ids, target, seed=3, offset=0)
    assert torch.equal(out, out2)
    a = torch.ones(n_req, dtype=torch.int32, device="cuda")
    e = torch.ones(n_req, dtype=torch.int32, device="cuda")
    _, a2, e2 = S.chain_speculative_sampling(draft, ids, target, a, e, seed=3, offset=0)
    assert a2 is a and torch.equal(a, acc + 1) and torch.equal(e, emi + 1)


def test_chain_speculative_all_accepted_and_padding():
    b, n, v = 5, 4, VOCAB
    p = _probs(b * (n + 1), v, seed=30).view(b, n + 1, v)
    ids = torch.randint(0, v, (b, n), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    # draft == target on the first n rows: every draft is accepted (u * q < q for u < 1, q > 0)
    out, acc, emi = S.chain_speculative_sampling(p[:, :n], ids, p, seed=0)
    assert torch.equal(out[:, :n].long(), ids) and (out[:, n] >= 0).all() and (out[:, n] < v).all()
    assert (acc == n).all() and (emi == n).all()
    # draft puts all mass where the target has none: every draft is rejected at position 0
    draft = torch.zeros(b, n, v, device="cuda")
    draft[:, :, 7] = 1.0
    tgt = p.clone()
    tgt[:, :, 7] = 0.0
    out, acc, emi = S.chain_speculative_sampling(draft, torch.full((b, n), 7, device="cuda"), tgt, seed=1)
    assert (acc == 0).all() and (emi == 0).all()
    assert (out[:, 1:] == -1).all() and (out[:, 0] != 7).all() and (out[:, 0] >= 0).all()


@pytest.mark.parametrize("batch", [1, 7, 99])
def test_top_k_first_from_logits_invariants(batch):
    # The fused kernel (top-k cut on the logits, softmax over the kept set, top-p) on a real vocab.
    logits = testing.randn((batch, VOCAB), torch.float32, "cuda", seed=40 + batch)
    toks = S.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=1, offset=2)
    probs = torch.softmax(logits.double(), dim=-1)
    keep = R.filtered_probs(probs, "top_k_top_p", top_k=50, top_p=0.9 + 1e-5) > 0
    assert keep[torch.arange(batch), toks.long().cpu()].all()
    assert torch.equal(toks, S.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=1, offset=2))
    # per-row parameters; k = 1 is greedy whatever top_p is
    ks = torch.ones(batch, dtype=torch.int32, device="cuda")
    ps = torch.full((batch,), 0.5, device="cuda")
    greedy = S.top_k_top_p_sampling_from_logits(logits, ks, ps, seed=0)
    assert torch.equal(greedy.long(), logits.argmax(dim=-1))


def test_top_k_first_from_logits_degenerate_rows():
    logits = testing.randn((3, VOCAB), torch.float32, "cuda", seed=50)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, :100] = float("nan")
    toks = S.top_k_top_p_sampling_from_logits(logits, 50, 0.9, seed=0)
    torch.cuda.synchronize()
    assert toks[0].item() == 0 and toks[1].item() == 0
    assert 0 <= toks[2].item() < VOCAB and not torch.isnan(logits[2, toks[2].long()])
