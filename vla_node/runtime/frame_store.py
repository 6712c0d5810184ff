"""Device-resident image tokens of recent frames, keyed by frame identity.

A frame is encoded, pooled and projected once; every later window that contains it reads its
row (exact: frames are encoded independently). Rows are recycled least-recently-used, never
while the current window still needs them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional, Sequence

import torch


class FrameStore:
    def __init__(self, capacity: int, tokens_per_image: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.capacity = capacity
        # One extra scratch row receives the padding frames of a partly filled vision batch.
        self.tokens = torch.zeros((capacity + 1, tokens_per_image, dim), dtype=dtype, device=device)
        self.scratch_row = capacity
        self._rows: OrderedDict[Hashable, int] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._rows.clear()

    def plan(self, frame_ids: Sequence[Optional[Hashable]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Rows holding each frame of the window, and (image index, row) of the frames that must
        be encoded now. A frame id of None is never looked up or kept."""
        if len(frame_ids) > self.capacity // 2 and any(f is not None for f in frame_ids):
            raise ValueError(f"frame store of {self.capacity} rows is too small for windows of {len(frame_ids)}")
        window_rows: list[int] = []
        to_encode: list[tuple[int, int]] = []
        in_window = {f for f in frame_ids if f is not None}
        for i, fid in enumerate(frame_ids):
            row = self._rows.get(fid) if fid is not None else None
            if row is not None:
                self._rows.move_to_end(fid)
                self.hits += 1
            else:
                row = self._free_row(in_window, set(window_rows))
                if fid is not None:
                    self._rows[fid] = row
                to_encode.append((i, row))
                self.misses += 1
            window_rows.append(row)
        return window_rows, to_encode

    def _free_row(self, keep_ids: set, taken_rows: set[int]) -> int:
        used = set(self._rows.values()) | taken_rows
        for row in range(self.capacity):
            if row not in used:
                return row
        for fid, row in self._rows.items():  # least recently used first
            if fid not in keep_ids and row not in taken_rows:
                del self._rows[fid]
                return row
        raise RuntimeError("frame store has no free row")  # unreachable with capacity >= 2 windows

    def write(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """tokens [len(rows), tokens_per_image, dim] into the store's rows `rows` (a device tensor)."""
        _words(self.tokens).index_copy_(0, rows, _words(tokens))

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The tokens of rows `rows` (a device tensor), [len(rows), tokens_per_image, dim]: a copy."""
        return _words(self.tokens).index_select(0, rows).view(self.tokens.dtype).view(-1, *self.tokens.shape[1:])


def _words(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] as n rows of 8-byte words (where a row's bytes allow): torch's index_copy_ and
    index_select move one element a thread, and a row of bf16 tokens as words is a quarter of the
    elements (the DROID prefill's read of its 4 rows on an H100: 8.1 us as bf16, 5.1 as words;
    BENCHMARKS.md, forty-sixth session)."""
    rows = x.reshape(x.shape[0], -1)
    return rows.view(torch.int64) if rows.shape[1] * x.element_size() % 8 == 0 else rows
