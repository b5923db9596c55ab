"""InputBuffers on CPU: in-place updates at fixed addresses, -1 / 0 padding past the step's
extent (also where a previous, larger step wrote), capacity errors. Graph replay: tests/gpu."""
import numpy as np
import pytest
import torch

from vllm.worker.input_buffers import InputBuffers


def addresses(b):
    return [t.data_ptr() for t in (b.input_ids, b.positions, b.slot_mapping, b.view_slots,
                                   b.view_lens)]


def test_updates_in_place_and_pads():
    b = InputBuffers(max_tokens=8, max_seqs=3, max_view_len=6)
    before = addresses(b)
    b.update([11, 12, 13], [4, 5, 9], [20, 21, 30], [np.array([5, 9, 20]), np.array([7, 30])])
    assert b.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert b.positions.tolist() == [4, 5, 9, 0, 0, 0, 0, 0]
    assert b.slot_mapping.tolist() == [20, 21, 30, -1, -1, -1, -1, -1]
    assert b.view_slots.tolist() == [[5, 9, 20, -1, -1, -1], [7, 30, -1, -1, -1, -1], [-1] * 6]
    assert b.view_lens.tolist() == [3, 2, 0]
    # a smaller step (after relocation: new slots) leaves nothing of the larger one behind
    b.update([14], [10], [31], [np.array([40, 41])])
    assert b.input_ids.tolist() == [14] + [0] * 7 and b.slot_mapping.tolist() == [31] + [-1] * 7
    assert b.view_slots.tolist() == [[40, 41, -1, -1, -1, -1], [-1] * 6, [-1] * 6]
    assert b.view_lens.tolist() == [2, 0, 0]
    assert addresses(b) == before
    ids, pos, slots, views, lens = b.step_inputs()
    assert ids.tolist() == [14] and views.tolist() == [[40, 41]] and lens.tolist() == [2]


def test_capacity_is_checked():
    b = InputBuffers(max_tokens=2, max_seqs=1, max_view_len=3)
    with pytest.raises(ValueError, match="exceeds"):
        b.update([1, 2, 3], [0, 1, 2], [0, 1, 2], [np.array([1])])
    with pytest.raises(ValueError, match="exceeds"):
        b.update([1], [0], [0], [np.arange(4)])
    b.update([], [], [], [])                  # an empty step is all padding
    assert (b.view_slots == -1).all() and (b.slot_mapping == -1).all()


def test_views_feed_decode_attention():
    """The -1-padded views and lens drive ops.decode_attention directly."""
    from vllm import _custom_ops as ops
    kv = torch.randn(64, 2, 2, 8)
    b = InputBuffers(max_tokens=4, max_seqs=4, max_view_len=10)
    views = [np.array([3, 9, 17]), np.array([60])]
    b.update([1, 2], [3, 1], [17, 60], views)
    q = torch.randn(4, 4, 8)
    out = ops.decode_attention(q, kv, b.view_slots, b.view_lens, 0.3)
    for i, v in enumerate(views):
        alone = ops.decode_attention(q[i:i + 1], kv, torch.from_numpy(v)[None],
                                     torch.tensor([len(v)]), 0.3)
        assert torch.allclose(out[i], alone[0], atol=1e-6)


class LoggedEvent:
    """A mirror's upload event that logs when update() waits on it and when it is recorded."""

    def __init__(self, log, mirror):
        self.log, self.mirror = log, mirror

    def record(self):
        self.log.append(("record", self.mirror))

    def synchronize(self):
        self.log.append(("wait", self.mirror))


def random_step(rng, max_tokens, max_seqs, max_view_len):
    rows = int(rng.integers(0, max_seqs + 1))
    views = [rng.choice(100, int(rng.integers(1, max_view_len + 1)), replace=False)
             for _ in range(rows)]
    n = int(rng.integers(rows, max_tokens + 1))
    return (rng.integers(0, 50, n), rng.integers(0, 500, n), rng.integers(0, 100, n), views)


def test_double_buffered_staging_alternates_and_matches_unstaged():
    """Two host mirrors in turn (the CUDA path's staging, run with CPU tensors): each step waits
    only on the mirror it is about to write (uploaded two steps before), never on the previous
    step's upload, and the buffers hold exactly what unstaged updates give, padding included,
    whatever a mirror held two steps ago."""
    plain = InputBuffers(max_tokens=12, max_seqs=4, max_view_len=9)
    staged = InputBuffers(max_tokens=12, max_seqs=4, max_view_len=9, staging=2)
    log = []
    for i, m in enumerate(staged.mirrors):
        m.uploaded = LoggedEvent(log, i)
    host_ptrs = {m["view_slots"].data_ptr() for m in staged.mirrors}
    assert len(host_ptrs) == 2 and staged.view_slots.data_ptr() not in host_ptrs
    before = addresses(staged)
    rng = np.random.default_rng(0)
    for step in range(40):
        args = random_step(rng, 12, 4, 9)
        plain.update(*args)
        staged.update(*args)
        assert log[-2:] == [("wait", step % 2), ("record", step % 2)]
        for a, b in zip(plain.step_inputs(), staged.step_inputs()):
            assert torch.equal(a, b)
        for name in ("input_ids", "positions", "slot_mapping", "view_slots", "view_lens"):
            assert torch.equal(getattr(plain, name), getattr(staged, name)), name
    assert addresses(staged) == before
    assert [m.uses for m in staged.mirrors] == [20, 20]


def test_staging_is_cpu_optional_and_cuda_only_by_default():
    assert InputBuffers(4, 2, 3).mirrors == []          # CPU: the host tensors are the buffers
    with pytest.raises(AssertionError, match="staging"):
        InputBuffers(4, 2, 3, staging=1)
