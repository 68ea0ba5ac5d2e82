"""``pipeload.move.schedule``: the compiled region copies against torch's own copies of the same views.

Random regions of random boxes of tensors of rank 0-5, whose source and destination tensors have
strides of every kind (permuted dimensions, slices of larger tensors, steps): packing a message out of
the sources, unpacking it into the destinations and a local copy must give exactly the bytes torch's
views give; pieces the rows cannot take (a region whose innermost run is one element, more than three
outer dimensions, a cast, a conjugate view) are left to torch and named as such; a change of strides
under the same plan compiles the rows again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeload.move.plan import Answers, Box, Op
from pipeload.move.run import CODES, layout, view
from pipeload.move.schedule import Schedule, buffer_base, run_rows

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.complex64]


class _Side:
    def __init__(self, boxes, views):
        self.boxes, self.views = boxes, views


def _strided(lengths, dtype, rng: np.random.Generator) -> torch.Tensor:
    """A tensor of ``lengths`` whose memory is laid out at random: permuted, inside a larger one, stepped."""
    nd = len(lengths)
    perm = rng.permutation(nd).tolist() if nd else []
    pad = [int(rng.integers(0, 3)) for _ in range(nd)]
    step = [int(rng.integers(1, 3)) if rng.random() < 0.3 else 1 for _ in range(nd)]
    big = [(lengths[d] + pad[d]) * step[d] for d in range(nd)]
    base = torch.zeros([big[d] for d in perm], dtype=dtype).permute(*np.argsort(perm).tolist()) if nd else \
        torch.zeros((), dtype=dtype)
    index = tuple(slice(0, lengths[d] * step[d], step[d]) for d in range(nd))
    out = base[index] if nd else base
    assert tuple(out.shape) == tuple(lengths)
    return out


def _values(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def _box(rng, shape):
    off = [int(rng.integers(0, s)) for s in shape]
    ln = [int(rng.integers(1, s - o + 1)) for s, o in zip(shape, off)]
    return tuple(off), tuple(ln)


def _inside(rng, off, ln):
    o = [int(rng.integers(a, a + n)) for a, n in zip(off, ln)]
    return tuple(o), tuple(int(rng.integers(1, a + n - x + 1)) for a, n, x in zip(off, ln, o))


def _case(seed: int):
    """(global values, source box + view, destination box + view, piece) with the piece in both boxes."""
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(0, 6))
    shape = tuple(int(x) for x in rng.integers(1, 7, size=nd))
    dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
    full = _values(shape, dtype, seed)
    piece_off, piece_len = _box(rng, shape) if nd else ((), ())
    sides = []
    for _ in range(2):  # a box around the piece, on each side
        off = tuple(int(rng.integers(0, o + 1)) for o in piece_off)
        end = tuple(int(rng.integers(o + n, s + 1)) for o, n, s in zip(piece_off, piece_len, shape))
        ln = tuple(e - o for o, e in zip(off, end))
        v = _strided(ln, dtype, rng)
        sides.append((Box(7, CODES[dtype], shape, off, ln), v))
    op = Op(7, 1, 1, 0, 0, CODES[dtype], piece_off, piece_len)
    return full, sides[0], sides[1], op


def _region(full, op):
    return full[tuple(slice(o, o + n) for o, n in zip(op.offsets, op.lengths))]


def _fill(box, v, full):
    v.copy_(full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))])


def _schedule(op, src_box, src_view, dst_box, dst_view, sending: bool | None):
    sends, recvs, local = ([op], [], []) if sending else ([], [op], []) if sending is False else ([], [], [op])
    sched = Schedule(Answers(sends, recvs, local, []))
    bound = sched.bind([src_view], lambda o: (0, src_box), [dst_view], [dst_box])
    return sched, bound


def test_rows_copy_what_torch_views_copy():
    compiled = sum(_check(seed) for seed in range(400))
    assert compiled > 3 * 400 * 0.4  # (random strides: many innermost runs are one element, left to torch)


def _check(seed: int) -> int:
    """Copies of case ``seed`` that ran as rows (of 3), each checked against torch."""
    full, (sbox, sview), (dbox, dview), op = _case(seed)
    _fill(sbox, sview, full)
    want = _region(full, op)
    starts, n = layout([op])
    compiled = 0
    for sending in (True, False, None):
        dview.zero_()
        sched, bound = _schedule(op, sbox, sview, dbox, dview, sending)
        (it,), (prog,) = sched.items, bound.programs
        fast = prog is not None and not prog.slow
        compiled += fast
        if sending:  # packing: the message's bytes are the region's, contiguous
            buf = torch.zeros(n, dtype=torch.uint8)
            if fast:
                run_rows(prog.rows, bound.src, buffer_base(buf))
                got = buf.view(want.dtype).view(want.shape) if want.dim() else buf.view(want.dtype)[0]
                assert torch.equal(got, want), (seed, prog.rows)
        elif sending is False:  # unpacking a message that holds the region
            buf = want.contiguous().reshape(-1).view(torch.uint8).clone()
            if fast:
                run_rows(prog.rows, buffer_base(buf), bound.dst)
                assert torch.equal(view(_Side([dbox], [dview]), 0, op), want), (seed, prog.rows)
        elif fast:  # a local copy, strided on both sides
            run_rows(prog.rows, bound.src, bound.dst)
            assert torch.equal(view(_Side([dbox], [dview]), 0, op), want), (seed, prog.rows)
        if fast and not sending:  # nothing else of the destination written
            outside = dview.clone()
            view(_Side([dbox], [outside]), 0, op).zero_()
            assert not outside.any(), seed
    return compiled


def test_pieces_rows_cannot_take_are_left_to_torch():
    box = Box(7, CODES[torch.float32], (8, 8), (0, 0), (8, 8))
    src = torch.arange(64, dtype=torch.float32).view(8, 8)
    op = Op(7, 1, 1, 0, 0, CODES[torch.float32], (2, 0), (3, 8))
    # a transposed destination: every run is one element
    _, bound = _schedule(op, box, src, box, torch.zeros(8, 8).t(), None)
    assert bound.programs[0] is None
    # a destination of another dtype (a cast) and a conjugate view
    _, bound = _schedule(op, box, src, box, torch.zeros(8, 8, dtype=torch.float64), None)
    assert bound.programs[0] is None
    cbox = Box(7, CODES[torch.complex64], (8, 8), (0, 0), (8, 8))
    cop = op._replace(dtype=CODES[torch.complex64])
    csrc = torch.zeros(8, 8, dtype=torch.complex64)
    _, bound = _schedule(cop, cbox, csrc.conj(), cbox, torch.zeros(8, 8, dtype=torch.complex64), None)
    assert bound.programs[0] is None
    # five cut dimensions, every one strided apart: four outer dimensions
    shape = (3, 3, 3, 3, 4)
    box5 = Box(7, CODES[torch.float32], shape, (0,) * 5, shape)
    op5 = Op(7, 1, 1, 0, 0, CODES[torch.float32], (1, 1, 1, 1, 1), (2, 2, 2, 2, 2))
    _, bound = _schedule(op5, box5, torch.zeros(shape), box5, torch.zeros(shape), None)
    assert bound.programs[0] is None
    # a region reaching past its box, or a view that is not the box's shape: no row (torch raises)
    _, bound = _schedule(op._replace(lengths=(7, 8)), box, src, box, torch.zeros(8, 8), None)
    assert bound.programs[0] is None
    _, bound = _schedule(op, box, src, box, torch.zeros(4, 8), None)
    assert bound.programs[0] is None
    # an expanded destination (every row the same memory): torch's copy refuses it by name, no row writes it
    _, bound = _schedule(op, box, src, box, torch.zeros(1, 8).expand(8, 8), None)
    assert bound.programs[0] is None
    # a row block of a row-major tensor into a column block: one outer dimension
    _, bound = _schedule(op, box, src, box, torch.zeros(8, 16)[:, 4:12], None)
    assert bound.programs[0].rows[0, 4] == 8 * 4 and bound.programs[0].rows[0, 5] == 3


def test_changed_strides_compile_again():
    box = Box(7, CODES[torch.float32], (4, 6), (0, 0), (4, 6))
    op = Op(7, 1, 1, 0, 0, CODES[torch.float32], (1, 2), (2, 3))
    src = torch.arange(24, dtype=torch.float32).view(4, 6)
    sched = Schedule(Answers([], [], [op], []))
    layouts = (torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(6, 4).t(), torch.zeros(4, 12)[:, ::2], torch.zeros(4, 6))
    for dst in layouts:
        bound = sched.bind([src], lambda o: (0, box), [dst], [box])
        prog = bound.programs[0]
        if prog is None:
            dst[1:3, 2:5].copy_(src[1:3, 2:5])
        else:
            run_rows(prog.rows, bound.src, bound.dst)
        assert torch.equal(dst[1:3, 2:5], src[1:3, 2:5])
        assert dst.sum() == src[1:3, 2:5].sum()


@pytest.mark.parametrize("n", [0, 1])
def test_empty_bases_refused(n):
    rows = np.zeros((n, 14), dtype=np.int64)
    if n:
        with pytest.raises(ValueError):
            run_rows(rows, np.zeros(0, dtype=np.uintp), np.zeros(1, dtype=np.uintp))
    else:
        run_rows(rows, np.zeros(0, dtype=np.uintp), np.zeros(0, dtype=np.uintp))


def test_messages_cut_alike_on_both_ends_and_within_bounds():
    """A sender's ops to one receiver and that receiver's ops from it (the same keys) are cut into the
    same messages; no message holds more than PIECE bytes, a piece of SMALL bytes or more travels alone,
    pieces start aligned and do not overlap."""
    from pipeload.move.mover import PIECE, SMALL
    from pipeload.move.schedule import ALIGN, messages

    rng = np.random.default_rng(3)
    code = CODES[torch.bfloat16]
    sends, recvs = [], []
    for i in range(4000):
        rows = int(rng.choice([1, 7, 300, 2048, 9000]))
        peer, hop = int(rng.integers(0, 5)), int(rng.random() < 0.1)
        key = dict(name=int(rng.integers(0, 50)), dst=i, dtype=code, offsets=(i, 0), lengths=(rows, 64), hop=hop)
        sends.append(Op(receiver=peer, peer=peer, src=i, **key))
        recvs.append(Op(receiver=9, peer=peer, src=-1, **key))  # (rank 9 receiving, as the peer sent)
    sends.sort(key=lambda o: o.key)
    recvs.sort(key=lambda o: o.key)
    out, inn = messages(sends, True), messages(recvs, False)
    assert [[op.dst for op in it.msg] for it in out] == [[op.dst for op in it.msg] for it in inn]
    assert [(it.starts, it.nbytes) for it in out] == [(it.starts, it.nbytes) for it in inn]
    assert sum(len(it.msg) for it in out) == len(sends)
    for it in out:
        assert len({(op.hop, op.peer) for op in it.msg}) == 1
        sizes = [2 * op.lengths[0] * 64 for op in it.msg]
        if len(it.msg) > 1:
            assert it.nbytes <= PIECE and max(sizes) < SMALL
        assert all(s % ALIGN == 0 for s in it.starts)
        assert all(a + n <= b for a, n, b in zip(it.starts, sizes, it.starts[1:]))
        assert it.nbytes == it.starts[-1] + sizes[-1]
        assert (it.starts, it.nbytes) == layout(it.msg)


class _HostWire:
    """A wire that is not the host's by type (so ``bind`` gives batches, not rows) but holds host
    tensors: the accelerator's code path, run on the host."""

    type = "host-as-accelerator"

    def __eq__(self, other):
        return other == torch.device("cpu")

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return 0


def _batches(sched, src, source_of, dst, boxes):
    return sched.bind(src, source_of, dst, boxes, _HostWire()).batches


def test_batches_move_what_rows_move():
    """A message on an accelerator's wire is packed and unpacked by one ``_foreach_copy_`` of its
    contiguous pieces (here the wire is the host, the code path the same): the message's bytes and the
    destinations equal the compiled rows' (or torch's, for a strided piece, left out of the batch); the
    batch is made again when a tensor's address changes, and a source that packs itself gets none."""
    from pipeload.move.schedule import pack_batch, unpack_batch

    code = CODES[torch.bfloat16]
    shapes = [(16, 8), (5, 12), (9, 4)]
    src = [_values(s, torch.bfloat16, i) for i, s in enumerate(shapes)]
    boxes = [Box(i, code, s, (0, 0), s) for i, s in enumerate(shapes)]
    pieces = [(0, (2, 0), (5, 8)), (1, (0, 0), (5, 12)), (2, (1, 1), (4, 2)), (0, (10, 0), (3, 8))]  # (2: strided)
    sends = [Op(b, 1, 1, b, b, code, o, n) for b, o, n in pieces]
    recvs = [op._replace(receiver=0, peer=0) for op in sends]
    sched = Schedule(Answers(sends, recvs, [], []))
    (out, inn) = sorted(sched.items, key=lambda it: it.sending, reverse=True)
    batches = _batches(sched, src, lambda o: (o.src, boxes[o.src]), [torch.zeros(s, dtype=torch.bfloat16)
                                                                      for s in shapes], boxes)
    b_out, b_in = (batches[sched.items.index(out)], batches[sched.items.index(inn)])
    assert [out.msg[i].src for i in b_out.slow] == [2] and len(b_out.views) == 3
    buf = torch.zeros(out.nbytes, dtype=torch.uint8)
    pack_batch(b_out, buf)
    for i in b_out.slow:  # (what the source packs itself)
        op, at = out.msg[i], out.starts[i]
        buf[at: at + 16].view(torch.bfloat16).view(4, 2).copy_(src[2][1:5, 1:3])
    want = torch.zeros(out.nbytes, dtype=torch.uint8)
    run_rows(sched.bind(src, lambda o: (o.src, boxes[o.src]), src, boxes).programs[sched.items.index(out)].rows,
             np.array([t.data_ptr() for t in src], dtype=np.uintp), buffer_base(want))
    assert torch.equal(buf, want)
    dst = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]  # new tensors: the batch is made again
    b_in = _batches(sched, src, lambda o: (o.src, boxes[o.src]), dst, boxes)[sched.items.index(inn)]
    unpack_batch(b_in, buf)
    for i in b_in.slow:
        dst[2][1:5, 1:3] = buf[inn.starts[i]: inn.starts[i] + 16].view(torch.bfloat16).view(4, 2)
    for b, o, n in pieces:
        region = (slice(o[0], o[0] + n[0]), slice(o[1], o[1] + n[1]))
        assert torch.equal(dst[b][region], src[b][region])
    assert int(sum((d != 0).sum() for d in dst)) == sum(n[0] * n[1] for _, _, n in pieces)
    none = _batches(sched, None, None, dst, boxes)
    assert none[sched.items.index(out)] is None and none[sched.items.index(inn)] is not None
