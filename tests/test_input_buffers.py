"""InputBuffers on CPU: in-place updates at fixed addresses, -1 / 0 padding past the step's
extent (also where a previous, larger step wrote), capacity errors, the view table patched from
view deltas (ViewRows) with O(batch) bytes staged per decode step. Graph replay: tests/gpu."""
import numpy as np
import pytest
import torch

from vllm.worker.input_buffers import InputBuffers
from vllm.worker.view_rows import ViewRows, flat_ranges


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
    from vllm.kernels import ops
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
    host_ptrs = {m["patch"].data_ptr() for m in staged.mirrors}
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


def test_flat_ranges_and_view_rows_example():
    assert flat_ranges(np.array([0, 2]), np.array([1, 0]), np.array([3, 2]), 4).tolist() == \
        [1, 2, 8, 9]
    rows = ViewRows(4, 10)
    views = [np.arange(5), np.arange(10, 12), np.arange(20, 24)]
    rows.patch(views, np.array([7, 8, 9]), np.zeros(3, np.int64))
    views = [np.append(v, 99 + i) for i, v in enumerate(views)]
    p = rows.patch(views, np.array([7, 8, 9]), np.array([5, 2, 4]))
    assert p.idx.tolist() == [5, 12, 24] and p.val.tolist() == [99, 100, 101]
    assert len(p.move_src) == 0
    # request 8 finished: row 2 moves up into row 1, row 2 is cleared
    p = rows.patch([np.append(views[0], 50), np.append(views[2], 51)], np.array([7, 9]),
                   np.array([6, 5]))
    assert (p.move_src.tolist(), p.move_dst.tolist(), p.move_width) == ([2], [1], 5)
    assert p.idx.tolist()[:2] == [6, 15] and p.val.tolist()[:2] == [50, 51]
    assert sorted(p.idx.tolist()[2:]) == list(range(20, 25)) and set(p.val[2:]) == {-1}


def test_moved_row_squeezes_a_drop_past_its_kept_prefix():
    """Request 7 finished, so 8 moves from row 1 to row 0 (which held 3 slots); 8 evicted
    position 25 of its 30 and relocated from position 5 on (keep 5): the move must carry the
    columns the squeeze reads, not only the kept ones."""
    buf = InputBuffers(max_tokens=4, max_seqs=2, max_view_len=32)
    old = [np.arange(3), np.arange(100, 130)]
    none = np.zeros(2, np.int64)
    buf.update(np.arange(2), np.arange(2), np.arange(2), old, np.array([7, 8]), none, none,
               np.empty(0, np.int64))
    new = np.concatenate([np.arange(100, 105), np.arange(500, 525)])     # 30 - 1 dropped + 1
    buf.update(np.arange(1), np.arange(1), np.arange(1), [new], np.array([8]), np.array([5]),
               np.array([1]), np.array([25]))
    assert buf.view_slots.numpy().tolist() == expected_table([new], 2, 32).tolist()


class Traffic:
    """Decode steps as the engine sends them: requests arrive and finish, rows reorder, most
    rows append one slot, some evict (drops), some relocate (keep up to the first moved slot)
    or go whole; a request that sat out a step comes back whole (the ViewStore forgot it).
    Yields (views, handles, keep, drop_lens, drops)."""

    def __init__(self, seed: int, max_seqs: int, max_view_len: int):
        self.rng = np.random.default_rng(seed)
        self.max_seqs, self.width = max_seqs, max_view_len
        self.views, self.previous, self.next_handle = {}, set(), 0

    def step(self):
        rng = self.rng
        for h in list(self.views):
            if rng.random() < 0.08 or len(self.views[h]) >= self.width:
                del self.views[h]
        while len(self.views) < self.max_seqs and rng.random() < 0.4:
            self.views[self.next_handle] = rng.integers(0, 1000, rng.integers(1, self.width))
            self.next_handle += 1
        handles = [h for h in self.views if rng.random() < 0.9]     # the rest sit out
        if rng.random() < 0.3:
            rng.shuffle(handles)
        keep, drops = [], []
        for h in handles:
            v, d = self.views[h], np.empty(0, np.int64)
            r = rng.random()
            if h not in self.previous or r < 0.1:                    # sent whole
                k = 0
                if h in self.previous:
                    v = rng.integers(0, 1000, rng.integers(1, self.width))
            else:
                if r < 0.4:                                          # evicted positions
                    d = np.sort(rng.choice(len(v), int(rng.integers(1, len(v) + 1)),
                                           replace=False))
                    v = np.delete(v, d)
                k = len(v)
                if rng.random() < 0.2:                               # relocated from k on
                    k = int(rng.integers(0, len(v) + 1))
                    v = np.concatenate([v[:k], rng.integers(0, 1000, len(v) - k)])
            self.views[h] = np.append(v, rng.integers(0, 1000))[:self.width]
            keep.append(min(k, len(self.views[h])))
            drops.append(d)
        self.previous = set(handles)
        return ([self.views[h].copy() for h in handles], np.array(handles, np.int64),
                np.array(keep, np.int64), np.array([len(d) for d in drops], np.int64),
                np.concatenate(drops + [np.empty(0, np.int64)]).astype(np.int64))


def expected_table(views, max_seqs, width):
    grid = np.full((max_seqs, width), -1, np.int64)
    for i, v in enumerate(views):
        grid[i, :len(v)] = v
    return grid


@pytest.mark.parametrize("staging,chunk", [(0, None), (2, None), (2, 6)])
def test_patched_view_table_equals_the_views(staging, chunk):
    """Random decode traffic through the delta path (appends, evictions, relocations, moves):
    after every step the table is exactly the views, -1 past each row's length and in every row
    past the step's last (unstaged, staged, and staged in pieces of 6 pairs)."""
    max_seqs, width = 6, 24
    buf = InputBuffers(max_tokens=8, max_seqs=max_seqs, max_view_len=width, staging=staging,
                       chunk=chunk)
    traffic = Traffic(1, max_seqs, width)
    for _ in range(200):
        views, handles, keep, drop_lens, drops = traffic.step()
        b = len(views)
        buf.update(np.arange(b), np.arange(b), np.arange(b), views, handles, keep, drop_lens,
                   drops)
        assert buf.view_slots.numpy().tolist() == expected_table(views, max_seqs, width).tolist()
        assert buf.view_lens[:b].tolist() == [len(v) for v in views]


def test_decode_step_stages_bytes_in_proportion_to_the_batch():
    """A steady decode step uploads 48 bytes per row (3 token buffers, view_lens, one (index,
    value) pair), however long the views; an eviction adds its positions (the row closes up on
    the device); a row sent whole adds its view and the -1s over what it no longer holds."""
    b, width = 4, 4096
    buf = InputBuffers(max_tokens=16, max_seqs=8, max_view_len=width, staging=2)
    views = [np.arange(1000 * i, 1000 * i + 900) for i in range(b)]
    handles = np.arange(b)
    buf.update(np.zeros(b), np.zeros(b), np.zeros(b), views, handles, np.zeros(b, np.int64))
    for step in range(5):
        keep = np.array([len(v) for v in views])
        views = [np.append(v, 5000 + step) for v in views]
        buf.update(np.zeros(b), np.zeros(b), np.zeros(b), views, handles, keep)
        assert buf.staged_bytes == 48 * b
    keep = np.array([len(v) for v in views])
    views = [np.append(v, 6000) for v in views]
    views[2] = np.delete(views[2], [3, 500])      # two tokens evicted: their positions go up
    keep[2] -= 2
    buf.update(np.zeros(b), np.zeros(b), np.zeros(b), views, handles, keep,
               np.array([0, 0, 2, 0]), np.array([3, 500]))
    squeeze = 2 + 2 * 2                           # the row and its length, two (row, position)
    assert buf.staged_bytes == 48 * b + 8 * squeeze
    assert buf.view_slots.numpy().tolist() == expected_table(views, 8, width).tolist()
    keep = np.array([len(v) for v in views])
    views = [np.append(v, 7000) for v in views]
    views[1] = views[1][::3]                      # sent whole (keep 0): the row and -1s after it
    old = keep[1]
    keep[1] = 0
    buf.update(np.zeros(b), np.zeros(b), np.zeros(b), views, handles, keep)
    assert buf.staged_bytes == 48 * b - 16 + 16 * old
    assert buf.view_slots.numpy().tolist() == expected_table(views, 8, width).tolist()
