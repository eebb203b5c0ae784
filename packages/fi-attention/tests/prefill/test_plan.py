"""CPU tests of the fa2 planner: exact coverage, split bookkeeping, balance, and the launcher's
parameter layout."""

import re
from pathlib import Path

import numpy as np
import pytest

from fi_attention.prefill import launch
from fi_attention.prefill.plan import KV_TILE, plan_fa2


def _visible(qi, kv_len, qo_len, causal, window_left):
    """Bool [kv_len] of keys query `qi` may see."""
    j = np.arange(kv_len)
    p = qi + kv_len - qo_len
    keep = np.ones(kv_len, bool)
    if causal:
        keep &= j <= p
    if window_left >= 0:
        keep &= j >= p - window_left
    return keep


def _check_coverage(qo_lens, kv_lens, hkv, group, rows, causal, window_left, plan):
    cover = {}
    for b, (ql, kl) in enumerate(zip(qo_lens, kv_lens)):
        cover[b] = np.zeros((hkv, ql * group, kl), np.int32)
    row_tiles = set()
    for req, h, rs, ks, ke, _slot in plan.work.tolist():
        ql, kl = qo_lens[req], kv_lens[req]
        assert 0 <= ks <= ke <= kl and rs % rows == 0 and rs < ql * group
        row_tiles.add((req, h, rs))
        for r in range(rs, min(rs + rows, ql * group)):
            vis = _visible(r // group, kl, ql, causal, window_left)
            seg = np.zeros(kl, bool)
            seg[ks:ke] = True
            cover[req][h, r] += (seg & vis)
    for b, (ql, kl) in enumerate(zip(qo_lens, kv_lens)):
        for r in range(ql * group):
            vis = _visible(r // group, kl, ql, causal, window_left)
            np.testing.assert_array_equal(cover[b][:, r], np.broadcast_to(vis, (hkv, kl)).astype(np.int32),
                                          err_msg=f"request {b} row {r}")
        # Every row tile of every head has an item (its output is written even with no keys).
        for h in range(hkv):
            for rs in range(0, ql * group, rows):
                assert (b, h, rs) in row_tiles


CASES = [
    ([7], [7], 1, 1, True, -1),
    ([1, 0, 127, 5], [1000, 3, 127, 0], 2, 4, True, -1),
    ([33, 64, 1], [64, 200, 4097], 2, 1, False, -1),
    ([100, 17], [300, 17], 1, 8, True, 40),
    ([0, 0], [5, 0], 3, 2, False, -1),
    ([1], [4097], 4, 4, False, 10),
]


@pytest.mark.parametrize("qo_lens,kv_lens,hkv,group,causal,window_left", CASES)
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_every_visible_pair_covered_exactly_once(qo_lens, kv_lens, hkv, group, causal, window_left, num_ctas):
    rows = 64
    plan = plan_fa2(qo_lens, kv_lens, num_kv_heads=hkv, group=group, cta_rows=rows, causal=causal,
                    window_left=window_left, num_ctas=num_ctas, max_slots=10_000)
    _check_coverage(qo_lens, kv_lens, hkv, group, rows, causal, window_left, plan)
    assert plan.work_indptr[0] == 0 and plan.work_indptr[-1] == len(plan.work)
    assert np.all(np.diff(plan.work_indptr) >= 0) and len(plan.work_indptr) == num_ctas + 1


def test_split_kv_for_short_queries_over_long_kv():
    plan = plan_fa2([1, 3], [32768, 20000], num_kv_heads=8, group=4, cta_rows=128, causal=True,
                    window_left=-1, num_ctas=132, max_slots=10_000)
    assert len(plan.merge) == 16  # both requests, every kv head, were split
    slots = sorted(s for s in plan.work[:, 5].tolist() if s >= 0)
    assert slots == list(range(plan.num_slots))
    for req, h, rs, s0, n in plan.merge.tolist():
        items = plan.work[(plan.work[:, 5] >= s0) & (plan.work[:, 5] < s0 + n)]
        assert len(items) == n and set(items[:, 0]) == {req} and set(items[:, 1]) == {h}
        assert set(items[:, 2]) == {rs}
        ranges = sorted(zip(items[:, 3], items[:, 4]))
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous pieces
    # Balanced: no CTA carries more than the mean plus one item.
    cost = -(-(plan.work[:, 4] - plan.work[:, 3]) // KV_TILE) + 1
    assert plan.cta_loads.max() <= plan.cta_loads.mean() + cost.max()
    assert plan.cta_loads.max() < 2 * plan.cta_loads.mean()


def test_split_respects_workspace_slots():
    plan = plan_fa2([1], [65536], num_kv_heads=8, group=4, cta_rows=128, causal=False,
                    window_left=-1, num_ctas=132, max_slots=20)
    assert 0 < plan.num_slots <= 20
    plan0 = plan_fa2([1], [65536], num_kv_heads=8, group=4, cta_rows=128, causal=False,
                     window_left=-1, num_ctas=132, max_slots=0)
    assert plan0.num_slots == 0 and len(plan0.merge) == 0


def test_causal_single_prefill_is_balanced_without_splits():
    plan = plan_fa2([16384], [16384], num_kv_heads=8, group=4, cta_rows=128, causal=True,
                    window_left=-1, num_ctas=132, max_slots=10_000)
    assert plan.num_slots == 0
    assert plan.cta_loads.max() - plan.cta_loads.min() <= 260  # one longest item (256 tiles + 1)
    assert plan.cta_loads.max() <= 1.01 * plan.cta_loads.mean()


def test_empty_batch():
    plan = plan_fa2([0, 0], [0, 9], num_kv_heads=2, group=1, cta_rows=64, causal=True,
                    window_left=-1, num_ctas=4, max_slots=10)
    assert len(plan.work) == 0 and plan.work_indptr.tolist() == [0] * 5


def test_launcher_parameter_layout_matches_kernel_enums():
    src = (Path(launch.__file__).parent / "prefill_fa2.cu").read_text()
    ints = re.search(r"enum IntParam \{(.*?)\};", src, re.S).group(1)
    names = [n.strip()[3:] for n in ints.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "COUNT" and tuple(names[:-1]) == launch.INT_PARAMS
    fl = re.search(r"enum FloatParam \{(.*?)\};", src, re.S).group(1)
    fnames = [n.strip()[3:] for n in fl.split(",") if n.strip()]
    assert fnames[-1] == "COUNT" and tuple(fnames[:-1]) == launch.FLOAT_PARAMS
    assert re.search(r"kWorkFields = 6;", src) and re.search(r"kMergeFields = 5;", src)


@pytest.mark.parametrize("causal,window_left", [(True, -1), (False, -1), (True, 20)])
def test_work_list_replayed_with_reference_math_equals_attention(causal, window_left):
    """Emulate the kernel on the CPU: every work item attends its rows over its kv range (the
    reference on a key slice), split items go through slots and the merge; the result must equal
    plain attention. Checks the planner's ranges, slots and merge bookkeeping end to end."""
    import torch

    from fi_attention.reference import attention_reference, merge_states_reference

    qo_lens, kv_lens, hkv, group, rows = [1, 9, 0, 3], [300, 40, 7, 260], 2, 2, 8
    torch.manual_seed(0)
    qs = [torch.randn(n, hkv * group, 16) for n in qo_lens]
    ks = [torch.randn(n, hkv, 16) for n in kv_lens]
    vs = [torch.randn(n, hkv, 16) for n in kv_lens]
    plan = plan_fa2(qo_lens, kv_lens, num_kv_heads=hkv, group=group, cta_rows=rows, causal=causal,
                    window_left=window_left, num_ctas=40, max_slots=10_000)
    assert plan.num_slots > 0 or window_left >= 0  # long-KV requests are split (not needed with a window)
    out = [torch.full((n, hkv * group, 16), float("nan")) for n in qo_lens]
    tmp_o = torch.full((plan.num_slots, rows, 16), float("nan"))
    tmp_s = torch.full((plan.num_slots, rows), float("nan"))

    def partial(b, h, r, lo, hi):
        qi, hq = r // group, h * group + r % group
        off = kv_lens[b] - qo_lens[b]
        o, s = attention_reference(qs[b][qi:qi + 1, hq:hq + 1], ks[b][lo:hi, h:h + 1], vs[b][lo:hi, h:h + 1],
                                   causal=causal, window_left=window_left, q_offset=qi + off - lo,
                                   sm_scale=0.25, return_lse=True)
        return o[0, 0], s[0, 0]

    for b, h, rs, lo, hi, slot in plan.work.tolist():
        for r in range(rs, min(rs + rows, qo_lens[b] * group)):
            o, s = partial(b, h, r, lo, hi)
            if slot < 0:
                out[b][r // group, h * group + r % group] = o
            else:
                tmp_o[slot, r - rs], tmp_s[slot, r - rs] = o, s
    for b, h, rs, s0, n in plan.merge.tolist():
        for r in range(rs, min(rs + rows, qo_lens[b] * group)):
            o, _ = merge_states_reference(tmp_o[s0:s0 + n, r - rs][None, :, None], tmp_s[s0:s0 + n, r - rs][None, :, None])
            out[b][r // group, h * group + r % group] = o[0, 0]
    for b in range(len(qo_lens)):
        want = attention_reference(qs[b], ks[b], vs[b], causal=causal, window_left=window_left, sm_scale=0.25)
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-5)


def test_fa2_kv_tile_per_variant_keeps_cta_rows():
    """d = 128 compiles kv tiles of 64 on sm_90 for every variant (ALiBi, RoPE and fp8 KV ones with
    a declared spill budget, measured faster than 32) and 32 on sm_8x; the planner sees the same
    CTA rows either way (the kv tile is kernel-internal)."""
    from fi_core import Arch  # noqa: PLC0415
    from fi_attention.prefill.spec import cta_rows, fa2_spec  # noqa: PLC0415

    import torch  # noqa: PLC0415

    bf = torch.bfloat16
    hopper, ampere = Arch.parse("9.0a"), Arch.parse("8.0")

    def kv_tile(arch, paged=False, **kw):
        return int(dict(fa2_spec(bf, 128, 128, paged, arch, **kw).defines)["FI_KV_TILE"])

    assert kv_tile(hopper) == 64 and kv_tile(hopper, softcap=True) == 64
    assert kv_tile(hopper, kv_dtype=torch.float8_e4m3fn) == 64
    assert kv_tile(hopper, paged=True) == 64 and kv_tile(hopper, alibi=True) == 64 and kv_tile(hopper, rope=True) == 64
    assert kv_tile(ampere) == 32 and kv_tile(ampere, paged=True) == 32 and kv_tile(ampere, alibi=True) == 32
    assert fa2_spec(bf, 128, 128, True, hopper).spill_budget == 0
    assert fa2_spec(bf, 128, 128, False, hopper).spill_budget == 0
    assert fa2_spec(bf, 128, 128, True, hopper, kv_dtype=torch.float8_e4m3fn).spill_budget == 64
    assert fa2_spec(bf, 128, 128, False, hopper, rope=True).spill_budget == 64
    assert fa2_spec(bf, 128, 128, True, hopper, alibi=True).spill_budget == 64
    assert fa2_spec(bf, 128, 128, True, ampere).spill_budget == 0
    assert fa2_spec(bf, 128, 128, False, ampere, rope=True).spill_budget == 0
    assert kv_tile(hopper, custom_mask=True) == 64 and kv_tile(hopper, short=True) == 64
    # custom masks: the regular tile at d = 128 (kv 32 on sm_8x, budget 64 on sm_90), narrow at d = 64
    assert cta_rows(128, 128, custom_mask=True) == 128 and cta_rows(64, 64, custom_mask=True) == 64
    assert kv_tile(ampere, custom_mask=True) == 32
    assert fa2_spec(bf, 128, 128, True, hopper, custom_mask=True).spill_budget == 64
    assert fa2_spec(bf, 128, 128, True, ampere, custom_mask=True).spill_budget == 0
    assert cta_rows(128, 128, custom_mask=True, short=True) == 64
    assert int(dict(fa2_spec(bf, 64, 64, False, ampere).defines)["FI_KV_TILE"]) == 64
    assert cta_rows(128, 128) == 128
