"""The device copy of a decode plan's int32 metadata, written by one host-to-device copy per plan().

plan() fills a pinned host mirror (work items, merge offsets and, for host page tables, the
table itself) and queues one asynchronous copy. The mirrors form a ring: plan() may be called
again while an earlier copy still waits behind GPU work, and it only waits when the ring wraps
onto a copy that has not run yet.
"""

from __future__ import annotations

import numpy as np
import torch

from .launch import raw_stream

# Copies are rounded up to whole blocks (4 KiB) so that a few views per buffer serve every plan:
# building a tensor view costs about as much as the copy call itself.
BLOCK = 1024
RING = 4


class MetadataStaging:
    """``size`` int32 entries on ``device`` (``device_ptr``) and a ring of pinned mirrors.

    Examples
    --------
    >>> st = MetadataStaging(torch.device("cuda", 0), 4096)        # doctest: +SKIP
    >>> host = st.host()              # numpy int32 [4096], the next mirror   # doctest: +SKIP
    >>> host[:3] = (1, 2, 3)                                          # doctest: +SKIP
    >>> st.upload(3)                  # queued on the current stream  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, size: int):
        self.size = size
        self.device_buf = torch.empty(size, dtype=torch.int32, device=device)
        self.device_ptr = self.device_buf.data_ptr()
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._dst: dict = {}  # blocks -> device view
        # per slot: [pinned tensor, its numpy view, event, copy queued, {blocks: host view}, address]
        self._ring = []
        for _ in range(RING):
            pinned = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._ring.append([pinned, pinned.numpy(), torch.cuda.Event(), False, {}, pinned.data_ptr()])
        self._pos = 0
        self._streams: dict = {}  # raw cudaStream_t -> torch Stream, for Event.record

    def host(self) -> np.ndarray:
        """The next mirror, once the copy it last fed has run."""
        return self.host_and_address()[0]

    def host_and_address(self) -> tuple:
        """:meth:`host` and the address of its data (for native code that fills it)."""
        slot = self._ring[self._pos]
        if slot[3]:
            slot[2].synchronize()
        return slot[1], slot[5]

    def upload(self, n: int) -> None:
        """Queue the copy of the first ``n`` entries of the mirror :meth:`host` returned (rounded
        up to a whole block) on the current stream, and move to the next mirror."""
        slot = self._ring[self._pos]
        self._pos = (self._pos + 1) % RING
        blocks = -(-n // BLOCK)
        src = slot[4].get(blocks)
        if src is None:
            if len(slot[4]) >= 64:
                slot[4].clear()
            src = slot[4][blocks] = slot[0][: min(blocks * BLOCK, self.size)]
        dst = self._dst.get(blocks)
        if dst is None:
            if len(self._dst) >= 64:
                self._dst.clear()
            dst = self._dst[blocks] = self.device_buf[: min(blocks * BLOCK, self.size)]
        dst.copy_(src, non_blocking=True)
        slot[2].record(self._current_stream())
        slot[3] = True

    def _current_stream(self) -> torch.cuda.Stream:
        """torch's current stream object, looked up by its raw handle: Event.record() without an
        argument builds a new Stream object on every call."""
        raw = raw_stream(self._index)
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            s = self._streams[raw] = torch.cuda.current_stream(self._index)
        return s
