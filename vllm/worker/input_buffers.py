"""InputBuffers: persistent, preallocated model inputs, rewritten in place every step.

A CUDA graph replays on fixed addresses, so a step's inputs are written into the same tensors
every time; after a relocation only their contents change (no recapture). Layout (int64):

    input_ids     [max_tokens]             padding 0
    positions     [max_tokens]             logical ids (RoPE); padding 0
    slot_mapping  [max_tokens]             where each token's K/V is written; padding -1 (no write)
    view_slots    [max_seqs, max_view_len] attention views, live slots in logical order; padding -1
    view_lens     [max_seqs]               entries per view row; padding rows 0

    views [[5, 9], [7]] -> view_slots [[5, 9, -1, ...], [7, -1, -1, ...], [-1, ...]], lens [2, 1, 0]

Everything past this step's extent is padding, so a graph captured for a larger batch reads
padding rows.

The view table is patched, not rewritten: ViewRows (worker/view_rows.py) knows which handle's
view each row holds, so a steady decode step sends one slot per row, an eviction its evicted
positions (the row closes up on the device), a relocation the view from its first moved token
on, and only a new row goes whole. A step's upload is O(batch + evicted): its tokens,
view_lens and the patch; `staged_bytes` counts it.

Staging. On CUDA a step's values are written into a pinned host mirror and uploaded with
non-blocking copies on the current stream. There are two mirrors, used in turn:

    step k     write mirror k % 2, upload it, record its event
    step k+1   write mirror (k+1) % 2 while step k's upload may still be in flight
    step k+2   mirror k % 2 again: wait for its event (the upload of two steps ago; long done)

so `update` never waits for the previous step's upload. Token uploads cover everything up to
the larger of this and the previous step's extent, and every mirror entry sent is rewritten this
step, so what a mirror held two steps ago never reaches the device. The patch goes up through a
fixed device staging area: moves, squeezes and drops first (at most max_tokens drops a step;
more and those rows go whole), then the writes in pieces of at most `chunk` (index, value)
pairs, each applied before the next is copied (stream order). On CPU the host tensors are the buffers and the patch is
applied directly, unless `staging=2` is asked for, which runs the same path with CPU tensors as
mirrors (tests).
"""
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from vllm.worker.view_rows import ViewPatch, ViewRows, apply_patch

_TOKEN_PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1}


class _Done:
    """Stands in for a CUDA event where uploads are synchronous (CPU staging)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Mirror:
    """One host copy of the token buffers, view_lens and the patch (pinned on CUDA), and the
    event of its last upload. The patch area grows when a step's patch does not fit."""

    def __init__(self, max_tokens: int, max_seqs: int, patch_entries: int, pinned: bool):
        self.pinned = pinned
        full = lambda n, v: torch.full((n,), v, dtype=torch.int64, pin_memory=pinned)  # noqa: E731
        self.tensors: Dict[str, torch.Tensor] = {name: full(max_tokens, pad)
                                                 for name, pad in _TOKEN_PAD.items()}
        self.tensors["view_lens"] = full(max_seqs, 0)
        self.tensors["patch"] = full(patch_entries, 0)
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}  # same memory
        self.uploaded = torch.cuda.Event() if pinned else _Done()
        self.uses = 0                      # steps written through this mirror

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def patch_area(self, entries: int) -> np.ndarray:
        if entries > len(self.arrays["patch"]):
            t = torch.zeros(max(entries, 2 * len(self.arrays["patch"])), dtype=torch.int64,
                            pin_memory=self.pinned)
            self.tensors["patch"], self.arrays["patch"] = t, t.numpy()
        return self.arrays["patch"]


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_view_len: int, device="cpu",
                 staging: Optional[int] = None, chunk: Optional[int] = None):
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs, self.max_view_len = max_tokens, max_seqs, max_view_len
        self.chunk = chunk or patch_chunk(max_tokens, max_seqs)
        cuda = self.device.type == "cuda"
        staging = (2 if cuda else 0) if staging is None else staging
        assert staging in (0, 2) and (staging or not cuda), "staging: 0 (CPU only) or 2 mirrors"
        # the device staging area: two pieces of writes, or every move, squeeze and drop
        entries = max(2 * self.chunk, 2 * patch_chunk(max_tokens, max_seqs))
        self.mirrors = [_Mirror(max_tokens, max_seqs, entries, cuda)
                        for _ in range(staging)]
        self._turn = 0
        # the buffers themselves: on the device, or (no staging) the host tensors written directly
        if self.mirrors:
            self._dev = {k: torch.empty_like(v, device=self.device).copy_(v)
                         for k, v in self.mirrors[0].tensors.items()}
            self._unstaged = None
        else:
            self._unstaged = _Mirror(max_tokens, max_seqs, 0, False)
            self._dev = self._unstaged.tensors
        self.view_slots = torch.full((max_seqs, max_view_len), -1, dtype=torch.int64,
                                     device=self.device)
        self.rows = ViewRows(max_seqs, max_view_len, max_drops=max_tokens)
        self.num_tokens = self.num_seqs = self.width = 0
        self.staged_bytes = 0              # host-to-device bytes of the last update

    # the buffers a graph captures (full size; rows and tokens past this step are padding)
    input_ids = property(lambda self: self._dev["input_ids"])
    positions = property(lambda self: self._dev["positions"])
    slot_mapping = property(lambda self: self._dev["slot_mapping"])
    view_lens = property(lambda self: self._dev["view_lens"])

    def update(self, input_ids: Sequence[int], positions: Sequence[int],
               slot_mapping: Sequence[int], views: List[np.ndarray],
               handles: Optional[np.ndarray] = None, keep: Optional[np.ndarray] = None,
               drop_lens: Optional[np.ndarray] = None, drops: Optional[np.ndarray] = None
               ) -> None:
        """Write one step's inputs in place; what the previous step used beyond them is reset.
        handles, keep, drop_lens, drops: the views' deltas (StepInput.view_handles, view_keep,
        view_drop_lens, view_drops); without them every row is sent whole."""
        n, rows = len(input_ids), len(views)
        lens = np.fromiter((len(v) for v in views), np.int64, rows)
        width = int(lens.max()) if rows else 0
        if n > self.max_tokens or rows > self.max_seqs or width > self.max_view_len:
            raise ValueError(f"step of {n} tokens, {rows} views of up to {width} slots exceeds "
                             f"the buffers ({self.max_tokens}, {self.max_seqs}, "
                             f"{self.max_view_len})")
        host = self._next_mirror()
        a = host.arrays                    # numpy views of the host tensors: no torch op here
        t_hi, r_hi = max(n, self.num_tokens), max(rows, self.num_seqs)
        for name, values in (("input_ids", input_ids), ("positions", positions),
                             ("slot_mapping", slot_mapping)):
            a[name][n:t_hi] = _TOKEN_PAD[name]
            a[name][:n] = values
        a["view_lens"][:r_hi] = 0
        a["view_lens"][:rows] = lens
        patch = self.rows.patch(views, handles, keep, drop_lens, drops)
        self._upload(host, t_hi, r_hi)
        self._apply(host, patch)
        self.staged_bytes = 8 * (3 * t_hi + r_hi + patch.num_entries)
        self.num_tokens, self.num_seqs, self.width = n, rows, width

    def _next_mirror(self):
        """The host tensors to write this step: the mirror whose turn it is, once its previous
        upload (two steps ago) has read it; without staging, the buffers themselves."""
        if not self.mirrors:
            return self._unstaged
        mirror = self.mirrors[self._turn]
        self._turn = (self._turn + 1) % len(self.mirrors)
        mirror.uploaded.synchronize()
        mirror.uses += 1
        return mirror

    def _upload(self, host, tokens: int, rows: int) -> None:
        if host is self._unstaged:
            return
        for name in ("input_ids", "positions", "slot_mapping"):
            self._dev[name][:tokens].copy_(host[name][:tokens], non_blocking=True)
        self._dev["view_lens"][:rows].copy_(host["view_lens"][:rows], non_blocking=True)

    def _apply(self, host, patch: ViewPatch) -> None:
        """The patch onto view_slots: directly without staging, else through the mirror's patch
        area and the device staging area. Mirror layout, for writes in pieces of c pairs:

            [moves, squeezes, drops (h entries)] [idx[0:c], val[0:c]] [idx[c:2c], val[c:2c]] ...
        """
        arrays = patch.arrays()
        if host is self._unstaged:
            apply_patch(self.view_slots, patch, [torch.from_numpy(a) for a in arrays])
            return
        head = arrays[:-2]
        h = sum(len(a) for a in head)
        area = host.patch_area(patch.num_entries)
        area[:h] = np.concatenate(head) if h else area[:0]
        pieces, at = [], h
        for lo in range(0, len(patch.idx), self.chunk):
            hi = min(lo + self.chunk, len(patch.idx))
            area[at:at + hi - lo], area[at + hi - lo:at + 2 * (hi - lo)] = \
                patch.idx[lo:hi], patch.val[lo:hi]
            pieces.append((at, hi - lo))
            at += 2 * (hi - lo)
        staging, sent = self._dev["patch"], host["patch"]
        if h:
            staging[:h].copy_(sent[:h], non_blocking=True)
        parts = list(torch.split(staging[:h], [len(a) for a in head])) + [None, None]
        apply_patch(self.view_slots, patch, parts, writes=False)
        table = self.view_slots.view(-1)
        for at, c in pieces:   # stream order: a piece is applied before the next overwrites it
            staging[:2 * c].copy_(sent[at:at + 2 * c], non_blocking=True)
            table[staging[:c]] = staging[c:2 * c]
        host.uploaded.record()             # after the last read of this mirror

    def check_views(self, views: Dict[int, np.ndarray]) -> None:
        """The table's rows are the views (handle -> slots) of the handles they hold, -1 after
        each and in every row past the last step's (debugging: copies the table to the host)."""
        table, rows = self.view_slots.cpu().numpy(), self.rows
        for r in range(rows.rows):
            n, h = rows.lens[r], rows.held[r]
            assert h < 0 or np.array_equal(table[r, :n], views.get(h)), \
                f"view table row {r} differs from view {h} (its patch went astray)"
            assert (table[r, n:] == -1).all(), f"view table row {r}: slots past its length"
        assert (table[rows.rows:] == -1).all(), "view table: slots in rows past the step's"

    def step_inputs(self):
        """This step's extent: (input_ids, positions, slot_mapping, view_slots, view_lens)."""
        n, b = self.num_tokens, self.num_seqs
        return (self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                self.view_slots[:b, :max(self.width, 1)], self.view_lens[:b])


def patch_chunk(max_tokens: int, max_seqs: int) -> int:
    """(index, value) pairs per piece of a staged patch (the staging area holds two pieces): a
    steady decode step goes in one piece, and so do a step's moves, squeezes and drops."""
    return max_tokens + 2 * max_seqs
