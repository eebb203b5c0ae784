"""Every kernel family on a GPU that is not the current one.

torch lets a caller hold tensors on cuda:1 while cuda:0 is the current device, and its own ops
run where their tensors are. fi's launchers enqueue on the current device, so each launch sits
in a device guard (``fi_core.on_device``; the decode launcher's is in C). Each case runs an op on cuda:1 twice: once with
cuda:1 made current (the reference run) and once with cuda:0 current, and the two results must
agree; the current device must still be cuda:0 afterwards. Without the guard these calls read
cuda:1's memory from a kernel on cuda:0 and fault. Needs two GPUs (skips otherwise).
"""

import pytest
import torch

import flashinfer
from fi_core import testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not testing.has_cuda() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

BF16 = torch.bfloat16


def _cc(d) -> tuple:
    """Compute capability of cuda:1: the fp8 GEMMs need sm_89+, the fa3 prefill sm_90."""
    return torch.cuda.get_device_capability(d)


def _rn(shape, d, seed, dtype=BF16, scale=1.0):
    return testing.randn(shape, dtype, device=d, seed=seed, scale=scale)


def _norms(d):
    x, w, r = _rn((64, 4096), d, 1), _rn((4096,), d, 2), _rn((64, 4096), d, 3)
    x2, r2 = x.clone(), r.clone()
    flashinfer.norm.fused_add_rmsnorm(x2, r2, w)
    gamma, beta = _rn((4096,), d, 4, torch.float32), _rn((4096,), d, 5, torch.float32)
    return (flashinfer.norm.rmsnorm(x, w), x2, r2, flashinfer.norm.layernorm(x, gamma, beta))


def _activation_rope(d):
    act = flashinfer.activation.silu_and_mul(_rn((32, 2 * 1024), d, 1))
    q, k = _rn((40, 8, 128), d, 2), _rn((40, 2, 128), d, 3)
    pos = torch.arange(40, dtype=torch.int32, device=d)
    return (act, *flashinfer.rope.apply_rope_pos_ids(q, k, pos))


def _sampling(d):
    logits = _rn((8, 32000), d, 1, torch.float32, scale=3.0)
    probs = flashinfer.sampling.softmax(logits)
    renorm = flashinfer.sampling.top_k_renorm_probs(probs, 50)
    tokens = flashinfer.sampling.sampling_from_probs(probs, seed=7, offset=0)
    draft = flashinfer.sampling.softmax(_rn((8, 3, 32000), d, 2, torch.float32).view(24, -1)).view(8, 3, -1)
    target = flashinfer.sampling.softmax(_rn((8, 4, 32000), d, 3, torch.float32).view(32, -1)).view(8, 4, -1)
    ids = torch.argmax(draft, -1).int()
    spec = flashinfer.sampling.chain_speculative_sampling(draft, ids, target, seed=7, offset=0)
    return (probs, renorm, tokens, *spec)


def _gemm(d):
    out = []
    for m in (4, 256):  # the weight-streaming kernel (and its fast path, on the repeat) and CUTLASS
        a, w = _rn((m, 1024), d, m), _rn((2048, 1024), d, m + 1)
        out += [flashinfer.gemm.mm_bf16(a, w.T), flashinfer.gemm.mm_bf16(a, w.T)]
        if _cc(d) < (8, 9):
            continue
        a8, sa = flashinfer.gemm.quantize_fp8_per_token_group(a.float(), scale_major_mode="MN")
        w8, sw = flashinfer.gemm.quantize_fp8_block(w.float(), scale_major_mode="MN")
        out += [flashinfer.gemm.gemm_fp8_nt_groupwise(a8, w8, sa, sw, scale_major_mode="MN")
                for _ in range(2)]
    if _cc(d) >= (8, 9):
        a8, sa = flashinfer.gemm.quantize_fp8_per_tensor(_rn((1, 64, 512), d, 5).float())
        b8, sb = flashinfer.gemm.quantize_fp8_per_tensor(_rn((1, 256, 512), d, 6).float())
        out.append(flashinfer.gemm.bmm_fp8(a8, b8.transpose(-2, -1), sa, sb, BF16))
    seg = flashinfer.gemm.SegmentGEMMWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=d))
    x, ws = _rn((10, 256), d, 7), _rn((3, 512, 256), d, 8)
    seg_indptr = torch.tensor([0, 3, 4, 10], dtype=torch.int64, device=d)
    out += [seg.run(x, ws, 3, weight_column_major=True, seg_indptr=seg_indptr) for _ in range(2)]
    return tuple(out)


def _decode(d):
    B, L, P, hq, hkv, D = 4, 1024, 16, 32, 8, 128
    n = B * L // P
    cache = _rn((n, 2, P, hkv, D), d, 1)
    indptr = torch.arange(0, n + 1, L // P, dtype=torch.int32)
    idx = torch.randperm(n, generator=testing.generator(2)).int()
    last = torch.full((B,), P, dtype=torch.int32)
    w = flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=d))
    w.plan(indptr, idx, last, hq, hkv, D, P, q_data_type=BF16)
    q = _rn((B, hq, D), d, 3)
    runs = [w.run(q, cache) for _ in range(2)]  # the checked path, then the launch path
    single = flashinfer.decode.single_decode_with_kv_cache(q[0], _rn((L, hkv, D), d, 4), _rn((L, hkv, D), d, 5))
    # append: 5 new tokens to request 0's page table
    k_new, v_new = _rn((5, hkv, D), d, 6), _rn((5, hkv, D), d, 7)
    append_indptr = torch.tensor([0, 5], dtype=torch.int32, device=d)
    kv_indptr = torch.tensor([0, 2], dtype=torch.int32, device=d)
    kv_indices = idx[:2].to(d)
    kv_last = torch.tensor([5], dtype=torch.int32, device=d)
    bi, pos = flashinfer.page.get_batch_indices_positions(
        append_indptr, flashinfer.page.get_seq_lens(kv_indptr, kv_last, P), 5)
    flashinfer.page.append_paged_kv_cache(k_new, v_new, bi, pos, cache, kv_indices, kv_indptr, kv_last)
    return (*runs, single, cache)


def _prefill(d):
    out = []
    L, hq, hkv, D = 1000, 32, 8, 128
    q, k, v = _rn((L, hq, D), d, 1), _rn((L, hkv, D), d, 2), _rn((L, hkv, D), d, 3)
    for backend in ("fa2", "fa3") if _cc(d)[0] == 9 else ("fa2",):
        out.append(flashinfer.prefill.single_prefill_with_kv_cache(q, k, v, causal=True, backend=backend))
    qo_indptr = torch.tensor([0, 300, 1000], dtype=torch.int32, device=d)
    ragged = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=d))
    ragged.plan(qo_indptr, qo_indptr, hq, hkv, D, causal=True, q_data_type=BF16)
    out.append(ragged.run(q, k, v))
    P = 16
    cache = _rn((L // P + 2, 2, P, hkv, D), d, 4)
    pages = torch.randperm(cache.shape[0], generator=testing.generator(5)).int().to(d)
    kv_indptr = torch.tensor([0, 20, 64], dtype=torch.int32, device=d)
    last = torch.tensor([P, 12], dtype=torch.int32, device=d)
    paged = flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=d))
    paged.plan(qo_indptr, kv_indptr, pages[:64], last, hq, hkv, D, P, causal=True, q_data_type=BF16)
    out.append(paged.run(q, cache))
    va, vb = _rn((L, hq, D), d, 6), _rn((L, hq, D), d, 7)
    sa, sb = _rn((L, hq), d, 8, torch.float32), _rn((L, hq), d, 9, torch.float32)
    out += [*flashinfer.cascade.merge_state(va, sa, vb, sb),
            *flashinfer.cascade.merge_states(torch.stack([va, vb], 1), torch.stack([sa, sb], 1))]
    return tuple(out)


CASES = {"norms": _norms, "activation_rope": _activation_rope, "sampling": _sampling, "gemm": _gemm,
         "decode_page": _decode, "prefill_cascade": _prefill}


@pytest.mark.parametrize("name", list(CASES))
def test_op_on_a_gpu_that_is_not_current(name):
    d = torch.device("cuda", 1)
    with torch.cuda.device(d):
        expected = CASES[name](d)
        torch.cuda.synchronize(d)
    torch.cuda.set_device(0)
    got = CASES[name](d)
    assert torch.cuda.current_device() == 0, "an op left another device current"
    torch.cuda.synchronize(d)  # raises if a kernel faulted
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.device == d, f"{name} result {i} is on {g.device}"
        if g.is_floating_point():
            torch.testing.assert_close(g.float(), e.float(), atol=1e-3, rtol=1e-3, msg=f"{name} result {i}")
        else:
            assert torch.equal(g, e), f"{name} result {i}"
    assert torch.ones(2, device=0).sum().item() == 2  # cuda:0's context is intact
