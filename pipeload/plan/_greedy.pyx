# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The reader choice of the global plan (:mod:`pipeload.globalplan`), over arrays: the greedy
(:func:`assign_readers`) and the stream cutting of sets it cannot balance (:func:`cut_stream`).

Every rank runs this on the same arrays, so every rank takes the same decisions. The rule is the
design's greedy: shards in the given order (largest first, ties by key), each to the member of its
holder set with the fewest bytes so far, ties to the lower rank. Sets share ranks, so a rank's bytes
grow through every set it is in; each set keeps a heap of (bytes, rank) that is refreshed lazily: an
entry whose bytes are out of date is re-keyed when it reaches the top. Bytes only grow, so the fresh
top is always the member with the fewest bytes (then the lowest rank): the choice does not depend on
the heap's layout.
"""

from libc.math cimport llrint

import numpy as np


cdef inline bint _less(long long la, long long ra, long long lb, long long rb) noexcept nogil:
    return la < lb or (la == lb and ra < rb)


cdef void _sift_down(long long[:] hl, long long[:] hr, Py_ssize_t base, Py_ssize_t n, Py_ssize_t i) noexcept nogil:
    cdef Py_ssize_t c
    cdef long long l = hl[base + i], r = hr[base + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(hl[base + c + 1], hr[base + c + 1], hl[base + c], hr[base + c]):
            c += 1
        if not _less(hl[base + c], hr[base + c], l, r):
            break
        hl[base + i] = hl[base + c]
        hr[base + i] = hr[base + c]
        i = c
    hl[base + i] = l
    hr[base + i] = r


cdef bint _contains(const long long[:] members, Py_ssize_t lo, Py_ssize_t end, long long x) noexcept nogil:
    """Whether ``x`` is in the ascending ``members[lo:end]`` (binary search)."""
    cdef Py_ssize_t mid, hi = end
    while lo < hi:
        mid = (lo + hi) // 2
        if members[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < end and members[lo] == x


def assign_readers(const long long[:] order, const long long[:] weight, const long long[:] sid,
                   const long long[:] prefer, const long long[:] cap, const long long[:] set_start,
                   const long long[:] set_size, const long long[:] members, long long[:] loads):
    """Readers of the shards ``order`` lists (indices into ``weight``/``sid``/``prefer``), in that order.

    ``members[set_start[s] : set_start[s] + set_size[s]]`` are the ascending ranks of holder set ``s``;
    ``loads`` (bytes per rank so far) is updated in place. First, in ``order``, a shard whose
    ``prefer`` rank (its writer, >= 0) is a member of its set goes to it while that keeps the rank
    within ``cap[s]``; then the greedy places the rest. Returns the reader of each index (-1 where
    ``order`` does not list it).
    """
    cdef Py_ssize_t n = len(order), k, i, s, base, m, j
    cdef long long h, w, r
    reader_arr = np.full(len(weight), -1, dtype=np.int64)
    cdef long long[:] reader = reader_arr
    heap_l_arr = np.empty(len(members), dtype=np.int64)
    heap_r_arr = np.empty(len(members), dtype=np.int64)
    built_arr = np.zeros(len(set_start), dtype=np.uint8)
    cdef long long[:] hl = heap_l_arr
    cdef long long[:] hr = heap_r_arr
    cdef unsigned char[:] built = built_arr
    with nogil:
        if len(prefer):
            for k in range(n):
                i = order[k]
                h = prefer[i]
                if h < 0:
                    continue
                s = sid[i]
                # membership first: a writer rank read from a file name is used only when it is a holder
                if (_contains(members, set_start[s], set_start[s] + set_size[s], h)
                        and loads[h] + weight[i] <= cap[s]):
                    reader[i] = h
                    loads[h] += weight[i]
        for k in range(n):
            i = order[k]
            if reader[i] >= 0:
                continue
            s = sid[i]
            base = set_start[s]
            m = set_size[s]
            if not built[s]:
                for j in range(m):
                    hl[base + j] = loads[members[base + j]]
                    hr[base + j] = members[base + j]
                j = m // 2 - 1
                while j >= 0:
                    _sift_down(hl, hr, base, m, j)
                    j -= 1
                built[s] = 1
            while hl[base] != loads[hr[base]]:  # out of date: this rank took bytes through another set
                hl[base] = loads[hr[base]]
                _sift_down(hl, hr, base, m, 0)
            r = hr[base]
            w = weight[i]
            reader[i] = r
            loads[r] += w
            hl[base] = loads[r]
            _sift_down(hl, hr, base, m, 0)
    return reader_arr



def cut_stream(const long long[:] weight, const long long[:] rows, const long long[:] sizes):
    """Stream cutting of a holder set whose shards the greedy cannot balance.

    The set's shards, in key order, form one byte stream; it is cut at row boundaries of each shard's
    first dimension into contiguous segments of ``sizes`` bytes, segment ``i`` read by member ``i``.
    Every member reads one contiguous run of the stream, within a row of its size (a shard with no rows
    to cut, or no bytes, goes whole to the segment it starts in); a segment's end is rounded to the
    nearest row boundary (half to even), but each piece holds at least one row.

    ``weight``/``rows``: bytes and first-dimension rows of the set's shards, in key order (rows < 1: a
    shard that cannot be cut); ``sizes``: the bytes of each member's segment, in member order. Returns
    (shard, first row, end row, segment) per piece, as int64 arrays: a piece is rows [first, end) of
    its shard (first 0 and end its rows: the whole shard).
    """
    cdef Py_ssize_t n = len(sizes), s_count = len(weight), j, k = 0, seg = 0
    cdef long long pos = 0, acc = 0, w, r_all, row, r0, r1, x
    if n < 1 or len(rows) != s_count:
        raise ValueError("cut_stream: no segments, or rows and weights of different lengths")
    for j in range(s_count):
        if rows[j] >= 1 and 0 < weight[j] < rows[j]:
            raise ValueError(f"cut_stream: shard {j} has {rows[j]} rows but {weight[j]} bytes")
    bounds_arr = np.zeros(max(n - 1, 0), dtype=np.int64)
    cdef long long[:] bounds = bounds_arr
    for j in range(n - 1):
        acc += sizes[j]
        bounds[j] = acc
    cap = s_count + n + 1
    out_arr = np.empty((4, cap), dtype=np.int64)
    cdef long long[:, :] out = out_arr
    with nogil:
        for j in range(s_count):
            w = weight[j]
            r_all = rows[j]
            if r_all < 1 or w == 0:
                while seg < n - 1 and bounds[seg] <= pos:
                    seg += 1
                out[0, k] = j
                out[1, k] = 0
                out[2, k] = r_all
                out[3, k] = seg
                k += 1
                pos += w
                continue
            row = w // r_all
            r0 = 0
            while r0 < r_all:
                while seg < n - 1 and bounds[seg] <= pos + r0 * row:
                    seg += 1
                if seg == n - 1:
                    r1 = r_all
                else:
                    x = llrint(<double>(bounds[seg] - pos) / <double>row)
                    r1 = r0 + 1 if x < r0 + 1 else x
                    if r1 > r_all:
                        r1 = r_all
                out[0, k] = j
                out[1, k] = r0
                out[2, k] = r1
                out[3, k] = seg
                k += 1
                if r1 < r_all:
                    seg += 1
                r0 = r1
            pos += w
    return out_arr[:, :k]


def batch_ops(const long long[:] group, const long long[:] weight, long long batch_bytes, long long align):
    """The broadcasts of one rank's pieces: which op each piece joins, ops numbered in the global order.

    ``group``: per piece (in key order) its (holder set, reader) pair as a small integer; ``weight``: its
    bytes. A piece of ``batch_bytes`` or more is an op of its own; smaller ones join the open batch of
    their pair, which closes (becomes the next op) once its bytes, each piece rounded up to ``align``,
    reach ``batch_bytes``. Batches still open at the end follow, in the order of their first piece.
    Returns the op index of every piece (int64).
    """
    cdef Py_ssize_t n = len(group), i, b, nb = 0
    cdef long long g, n_groups = 0, next_op = 0
    if len(weight) != n or align < 1:
        raise ValueError("batch_ops: groups and weights of different lengths, or no alignment")
    for i in range(n):
        if group[i] < 0:
            raise ValueError("batch_ops: negative group")
        if group[i] + 1 > n_groups:
            n_groups = group[i] + 1
    label_arr = np.empty(n, dtype=np.int64)
    op_of_label_arr = np.full(n, -1, dtype=np.int64)
    open_arr = np.full(n_groups, -1, dtype=np.int64)
    size_arr = np.zeros(n_groups, dtype=np.int64)
    out_arr = np.empty(n, dtype=np.int64)
    cdef long long[:] label = label_arr, op_of_label = op_of_label_arr, open_ = open_arr, size = size_arr
    cdef long long[:] out = out_arr
    with nogil:
        for i in range(n):
            if weight[i] >= batch_bytes:
                label[i] = nb
                op_of_label[nb] = next_op
                next_op += 1
                nb += 1
                continue
            g = group[i]
            if open_[g] < 0:
                open_[g] = nb
                size[g] = 0
                nb += 1
            b = open_[g]
            label[i] = b
            size[g] += (weight[i] + align - 1) // align * align
            if size[g] >= batch_bytes:
                op_of_label[b] = next_op
                next_op += 1
                open_[g] = -1
        for b in range(nb):  # labels open in the order of their first piece
            if op_of_label[b] < 0:
                op_of_label[b] = next_op
                next_op += 1
        for i in range(n):
            out[i] = op_of_label[label[i]]
    return out_arr
