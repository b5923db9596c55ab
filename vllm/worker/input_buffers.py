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
padding rows. On CUDA the host side is a pinned mirror uploaded with non-blocking copies; the
mirror is not rewritten before the previous upload has finished.
"""
from typing import List, Sequence

import numpy as np
import torch

_TOKEN_PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1}


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_view_len: int, device="cpu"):
        self.device = torch.device(device)
        self.max_tokens, self.max_seqs, self.max_view_len = max_tokens, max_seqs, max_view_len
        cuda = self.device.type == "cuda"
        self._host = {name: torch.full((max_tokens,), pad, dtype=torch.int64, pin_memory=cuda)
                      for name, pad in _TOKEN_PAD.items()}
        self._host["view_lens"] = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=cuda)
        self._host["view_slots"] = torch.full((max_seqs * max_view_len,), -1, dtype=torch.int64,
                                              pin_memory=cuda)   # staging: [rows, width] packed
        self._dev = {k: v.to(self.device) if cuda else v for k, v in self._host.items()}
        self.view_slots = torch.full((max_seqs, max_view_len), -1, dtype=torch.int64,
                                     device=self.device)
        self._uploaded = torch.cuda.Event() if cuda else None
        self.num_tokens = self.num_seqs = self.width = 0

    # the buffers a graph captures (full size; rows and tokens past this step are padding)
    input_ids = property(lambda self: self._dev["input_ids"])
    positions = property(lambda self: self._dev["positions"])
    slot_mapping = property(lambda self: self._dev["slot_mapping"])
    view_lens = property(lambda self: self._dev["view_lens"])

    def update(self, input_ids: Sequence[int], positions: Sequence[int],
               slot_mapping: Sequence[int], views: List[np.ndarray]) -> None:
        """Write one step's inputs in place; what the previous step used beyond them is reset."""
        n, rows = len(input_ids), len(views)
        lens = np.fromiter((len(v) for v in views), np.int64, rows)
        width = int(lens.max()) if rows else 0
        if n > self.max_tokens or rows > self.max_seqs or width > self.max_view_len:
            raise ValueError(f"step of {n} tokens, {rows} views of up to {width} slots exceeds "
                             f"the buffers ({self.max_tokens}, {self.max_seqs}, "
                             f"{self.max_view_len})")
        if self._uploaded is not None:
            self._uploaded.synchronize()     # the previous upload has read the pinned mirror
        t_hi, r_hi, w_hi = max(n, self.num_tokens), max(rows, self.num_seqs), max(width, self.width)
        for name, values in (("input_ids", input_ids), ("positions", positions),
                             ("slot_mapping", slot_mapping)):
            host = self._host[name]
            host[n:t_hi] = _TOKEN_PAD[name]
            host[:n] = torch.as_tensor(np.asarray(values, dtype=np.int64))
        self._host["view_lens"][:r_hi] = 0
        self._host["view_lens"][:rows] = torch.from_numpy(lens)
        grid = self._host["view_slots"][:r_hi * w_hi].view(r_hi, w_hi).fill_(-1)
        valid = torch.arange(w_hi)[None, :] < torch.from_numpy(lens)[:, None]
        if rows:
            grid[:rows][valid] = torch.from_numpy(np.concatenate(views).astype(np.int64))
        self._upload(t_hi, r_hi, w_hi)
        self.num_tokens, self.num_seqs, self.width = n, rows, width

    def _upload(self, tokens: int, rows: int, width: int) -> None:
        if self._uploaded is None:          # CPU: the host tensors are the buffers
            packed = self._host["view_slots"][:rows * width]
            self.view_slots[:rows, :width] = packed.view(rows, width)
            return
        for name in ("input_ids", "positions", "slot_mapping"):
            self._dev[name][:tokens].copy_(self._host[name][:tokens], non_blocking=True)
        self._dev["view_lens"][:rows].copy_(self._host["view_lens"][:rows], non_blocking=True)
        packed = self._dev["view_slots"][:rows * width]
        packed.copy_(self._host["view_slots"][:rows * width], non_blocking=True)
        self.view_slots[:rows, :width].copy_(packed.view(rows, width))
        self._uploaded.record()

    def step_inputs(self):
        """This step's extent: (input_ids, positions, slot_mapping, view_slots, view_lens)."""
        n, b = self.num_tokens, self.num_seqs
        return (self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                self.view_slots[:b, :max(self.width, 1)], self.view_lens[:b])
