# cython: language_level=3, boundscheck=False, wraparound=False
"""Copies of tensor regions between host addresses, compiled: one call runs a message's pieces.

A planned movement packs each message out of many source regions and unpacks it into many destination
views (a fused ``qkv_proj`` gets a third from each of several senders, an expert its rows of ``w13``).
In Python each piece cost a view, a few checks and a ``memmove`` call (several microseconds before a
byte moved, and as much CPU as the copying at ~100 KiB pieces); here a message is one call over rows
of integers (:mod:`pipeload.move.schedule` makes them) and the loop runs without the GIL.

A row is one piece: ``src`` and ``dst`` index the two base address arrays, ``soff`` and ``doff`` are
byte offsets from those bases, ``inner`` contiguous bytes are copied per run, and up to three outer
dimensions (count, source stride, destination stride; strides in bytes, the innermost first) repeat
the run. Which rows are valid is the compiler's business: it emits a row only for host memory whose
strides it read from the very tensors whose addresses are passed here.
"""

from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy

cdef enum:
    C_SRC = 0
    C_SOFF = 1
    C_DST = 2
    C_DOFF = 3
    C_INNER = 4
    C_OUTER = 5  # (count, source stride, destination stride) x 3, the innermost first
    WIDTH = 14


cdef inline void _piece(const int64_t* r, const uintptr_t* src, const uintptr_t* dst) noexcept nogil:
    cdef char* s = <char*>(src[r[C_SRC]] + <uintptr_t>r[C_SOFF])
    cdef char* d = <char*>(dst[r[C_DST]] + <uintptr_t>r[C_DOFF])
    cdef size_t inner = <size_t>r[C_INNER]
    cdef int64_t n0 = r[C_OUTER], s0 = r[C_OUTER + 1], d0 = r[C_OUTER + 2]
    cdef int64_t n1 = r[C_OUTER + 3], s1 = r[C_OUTER + 4], d1 = r[C_OUTER + 5]
    cdef int64_t n2 = r[C_OUTER + 6], s2 = r[C_OUTER + 7], d2 = r[C_OUTER + 8]
    cdef int64_t i0, i1, i2
    if n0 == 1 and n1 == 1 and n2 == 1:
        memcpy(d, s, inner)
        return
    for i2 in range(n2):
        for i1 in range(n1):
            for i0 in range(n0):
                memcpy(d + i2 * d2 + i1 * d1 + i0 * d0, s + i2 * s2 + i1 * s1 + i0 * s0, inner)


def width():
    """The number of int64 columns of a row."""
    return WIDTH


def copy_rows(const int64_t[:, ::1] rows, const uintptr_t[::1] src, const uintptr_t[::1] dst):
    """Run every row (see the module docstring). The caller guarantees that each row's indices lie in
    ``src`` and ``dst`` and that its bytes lie in the memory of the tensors those addresses came from."""
    cdef Py_ssize_t i, n = rows.shape[0]
    if n == 0:
        return
    if rows.shape[1] != WIDTH or src.shape[0] == 0 or dst.shape[0] == 0:
        raise ValueError(f"rows of {WIDTH} columns and non-empty bases expected")
    cdef const int64_t* r = &rows[0, 0]
    cdef const uintptr_t* s = &src[0]
    cdef const uintptr_t* d = &dst[0]
    with nogil:
        for i in range(n):
            _piece(r + i * WIDTH, s, d)
