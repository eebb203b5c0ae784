"""CPU emulation of the shared-memory ring of decode_mma.cu variant 3 (FI_MMA_VARIANT=3).

The functions below mirror the kernel's index arithmetic (ring_off, WarpRing::copy, WarpRing::next,
k_dim, v_dim); if one changes, change both. The checks: the cp.async copies of one tile fill its
slot exactly once, every fragment read finds the cache bytes that variant 0 loads into the same
register (so the MMA code is shared), and no read or copy phase has a shared-memory bank conflict.
"""

import itertools

import pytest

# (bytes per cache element, head_dim): bf16/fp16 and fp8 caches at head_dim 64 and 128
CASES = [(2, 128), (1, 128), (2, 64), (1, 64)]


class Layout:
    def __init__(self, esz, d):
        self.esz, self.d = esz, d
        self.row = d * esz                     # ROW: one K or V row of a token
        self.pe = 16 // esz                    # PE: elements per 16-byte piece
        self.kd, self.vd = d // 4, d // 8      # K / V elements per lane per token
        self.vp = min(self.vd, self.pe)        # VP
        self.kbytes, self.vbytes = self.kd * esz, self.vd * esz

    def ring_off(self, r, ch):
        if self.row >= 128:
            swz = (r & 2) | (((r ^ (r >> 2)) & 1) << 2)
            return r * self.row + ((ch ^ swz) << 4)
        return (r ^ ((r >> 1) & 1)) * self.row + ((ch ^ ((r >> 1) & 2)) << 4)

    def k_dim(self, c, e):
        return (e // self.pe) * 4 * self.pe + c * self.pe + e % self.pe

    def v_dim(self, g, e):
        return (e // self.vp) * 8 * self.vp + g * self.vp + e % self.vp

    def copies(self):
        """Per instruction, the 32 lanes' (shared offset, (block, row, byte in row)) of one tile:
        lane l copies chunk l % CPR of row l // CPR + RPI i (CPR 16-byte chunks per row)."""
        cpr = self.row // 16
        rpi = 32 // cpr
        for i, blk in itertools.product(range(16 // rpi), range(2)):
            yield [(blk * 16 * self.row + self.ring_off(lane // cpr + rpi * i, lane % cpr),
                    (blk, lane // cpr + rpi * i, (lane % cpr) * 16)) for lane in range(32)]

    def k_reads(self):
        """Per instruction, the lanes' (shared offset, bytes, cache elements expected there)."""
        for i, j in itertools.product(range(2), range(self.kbytes // 16)):
            ins = []
            for lane in range(32):
                g, c = lane >> 2, lane & 3
                want = [(0, 8 * i + g, self.k_dim(c, j * self.pe + u)) for u in range(self.pe)]
                ins.append((self.ring_off(8 * i + g, 4 * j + c), 16, want))
            yield ins

    def v_reads(self):
        pieces = max(1, self.vbytes // 16)
        for j, m in itertools.product(range(4), range(pieces)):
            ins = []
            for lane in range(32):
                g, c = lane >> 2, lane & 3
                r = 2 * c + (j & 1) + 8 * (j >> 1)
                if self.vbytes % 16 == 0:
                    off, size = self.ring_off(r, g + 8 * m), 16
                else:
                    off, size = self.ring_off(r, g >> 1) + 8 * (g & 1), 8
                n = size // self.esz
                want = [(1, r, self.v_dim(g, m * self.vp + u)) for u in range(n)]
                ins.append((16 * self.row + off, size, want))
            yield ins


def conflict_degree(accesses):
    """Worst bank conflict of one warp instruction: 16-byte accesses go 8 lanes per phase, 8-byte
    ones 16 lanes; within a phase, a bank serving k distinct 4-byte words costs k wavefronts."""
    size = accesses[0][1]
    per_phase = 8 if size == 16 else 16
    worst = 1
    for p0 in range(0, 32, per_phase):
        banks = {}
        for off, sz in accesses[p0:p0 + per_phase]:
            for w in range(off // 4, (off + sz) // 4):
                banks.setdefault(w % 32, set()).add(w)
        worst = max(worst, max(len(ws) for ws in banks.values()))
    return worst


@pytest.mark.parametrize("esz,d", CASES)
def test_copies_fill_the_slot_once(esz, d):
    lay = Layout(esz, d)
    dst = [off for ins in lay.copies() for off, _ in ins]
    assert len(dst) == len(set(dst)) == 32 * lay.row // 16
    assert all(off % 16 == 0 and 0 <= off < 32 * lay.row for off in dst)
    # each instruction covers whole rows (whole 128-byte lines, or 64-byte rows at fp8 d64)
    for ins in lay.copies():
        rows = {}
        for _, (blk, r, b) in ins:
            rows.setdefault((blk, r), []).append(b)
        assert len(rows) == 512 // lay.row
        assert all(sorted(bs) == list(range(0, lay.row, 16)) for bs in rows.values())


@pytest.mark.parametrize("esz,d", CASES)
def test_reads_find_variant0_fragments(esz, d):
    lay = Layout(esz, d)
    where = {}  # shared byte -> (block, row, byte of the cache row)
    for ins in lay.copies():
        for off, (blk, r, b) in ins:
            for k in range(16):
                where[off + k] = (blk, r, b + k)
    for ins in list(lay.k_reads()) + list(lay.v_reads()):
        for off, size, want in ins:
            got = [where[off + k] for k in range(size)]
            exp = [(blk, r, e * esz + k) for blk, r, e in want for k in range(esz)]
            assert got == exp
    # every fragment element of variant 0 is read once per lane set: K covers each row's head_dim
    # once per row quad, V each row's head_dim once per column of 8 lanes
    k_seen = sorted((w[1], w[2]) for ins in lay.k_reads() for _, _, ws in ins for w in ws)
    assert k_seen == sorted((r, dd) for r in range(16) for dd in range(d))
    v_seen = sorted((w[1], w[2]) for ins in lay.v_reads() for _, _, ws in ins for w in ws)
    assert v_seen == sorted((r, dd) for r in range(16) for dd in range(d))


@pytest.mark.parametrize("esz,d", CASES)
def test_no_bank_conflicts(esz, d):
    lay = Layout(esz, d)
    for ins in lay.copies():
        assert conflict_degree([(off, 16) for off, _ in ins]) == 1
    for ins in list(lay.k_reads()) + list(lay.v_reads()):
        assert conflict_degree([(off, size) for off, size, _ in ins]) == 1


def test_unswizzled_rows_would_conflict():
    """Why ring_off swizzles: plain rows give 2-way K and 4-way V conflicts at head_dim 128 (bf16)."""
    lay = Layout(2, 128)
    lay.ring_off = lambda r, ch: r * lay.row + ch * 16
    assert max(conflict_degree([(o, s) for o, s, _ in ins]) for ins in lay.k_reads()) == 2
    assert max(conflict_degree([(o, s) for o, s, _ in ins]) for ins in lay.v_reads()) == 4
