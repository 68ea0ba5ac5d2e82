# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""A pickle stream without the memo entries nothing reads back: what keeps rank 0's DCP decode small.

Pickle memoizes almost every object it writes (each tuple, dict, instance, string), and an unpickler
keeps each memoized object alive until the load ends: for DCP's ``.metadata`` that is ~15 objects a
chunk (two ``torch.Size`` and their argument tuples, the state dicts, the instances), ~1 KB a chunk
that no stand-in class can release. Only a few entries are ever read back (the class globals, the
attribute names, a tensor's fqn, a file's name). :func:`pruned` scans the pickle once, marks the
memo indices some ``BINGET``/``LONG_BINGET`` reads, and returns a file-like object that replays the
same opcodes with only those entries memoized (the gets renumbered, the stream re-framed): the
unpickler builds the same objects, calls the same ``find_class``, and keeps a memo the size of the
back-references.

Only binary opcodes (protocols 2-5) with implicit memo indices (``MEMOIZE``) are rewritten; anything
else (a text opcode, an explicit ``PUT``, an opcode this scan does not know, a get of an index not yet
memoized, a truncated argument) makes :func:`pruned` return None and the caller unpickles the bytes
as they are. The scan only decides what is memoized; the unpickler still checks everything else.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cdef enum:
    A_NONE = 0      # no argument
    A_FIXED = 1     # a fixed-length argument (ARGLEN bytes)
    A_COUNTED = 2   # a little-endian length of ARGLEN bytes, then that many bytes
    A_MEMOIZE = 3
    A_GET1 = 4
    A_GET4 = 5
    A_FRAME = 6
    A_STOP = 7
    A_PROTO = 8
    A_BAD = 9       # not rewritten: the caller unpickles the bytes unchanged

cdef uint8_t KIND[256]
cdef uint8_t ARGLEN[256]
cdef int64_t FRAME_TARGET = 1 << 18


cdef void _op(int code, uint8_t kind, uint8_t arglen):
    KIND[code] = kind
    ARGLEN[code] = arglen


cdef void _init_table():
    cdef int i
    for i in range(256):
        KIND[i] = A_BAD
        ARGLEN[i] = 0
    for c in b"(.012N]ael)t}dsu\x85\x86\x87\x8f\x90\x91\x93Rb\x81\x92o\x88\x89\x97\x98Q":
        _op(c, A_NONE, 0)
    _op(ord("J"), A_FIXED, 4)
    _op(ord("K"), A_FIXED, 1)
    _op(ord("M"), A_FIXED, 2)
    _op(ord("G"), A_FIXED, 8)
    _op(0x82, A_FIXED, 1)  # EXT1
    _op(0x83, A_FIXED, 2)  # EXT2
    _op(0x84, A_FIXED, 4)  # EXT4
    _op(ord("T"), A_COUNTED, 4)  # BINSTRING
    _op(ord("U"), A_COUNTED, 1)  # SHORT_BINSTRING
    _op(ord("X"), A_COUNTED, 4)  # BINUNICODE
    _op(0x8C, A_COUNTED, 1)  # SHORT_BINUNICODE
    _op(0x8D, A_COUNTED, 8)  # BINUNICODE8
    _op(ord("B"), A_COUNTED, 4)  # BINBYTES
    _op(ord("C"), A_COUNTED, 1)  # SHORT_BINBYTES
    _op(0x8E, A_COUNTED, 8)  # BINBYTES8
    _op(0x96, A_COUNTED, 8)  # BYTEARRAY8
    _op(0x8A, A_COUNTED, 1)  # LONG1
    _op(0x8B, A_COUNTED, 4)  # LONG4 (a negative length is refused below)
    _op(0x94, A_MEMOIZE, 0)
    _op(ord("h"), A_GET1, 1)
    _op(ord("j"), A_GET4, 4)
    _op(0x95, A_FRAME, 8)
    _op(ord("."), A_STOP, 0)
    _op(0x80, A_PROTO, 1)


_init_table()


cdef inline uint64_t _le(const uint8_t *p, int n) nogil:
    cdef uint64_t v = 0
    cdef int k
    for k in range(n):
        v |= (<uint64_t>p[k]) << (8 * k)
    return v


cdef inline int popcount64(uint64_t x) nogil:
    x = x - ((x >> 1) & 0x5555555555555555ULL)
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL
    return <int>((x * 0x0101010101010101ULL) >> 56)


cdef class PrunedStream:
    """The rewritten pickle, produced a frame at a time as the unpickler reads it (``read``)."""

    cdef object owner          # keeps the source buffer alive
    cdef const uint8_t[::1] src
    cdef int64_t n, pos
    cdef uint64_t *used        # bit i: memo index i is read back
    cdef uint32_t *rank        # kept entries before word k
    cdef int64_t n_memo, n_kept, next_old
    cdef bytes out
    cdef int64_t out_pos
    cdef bint done

    def __dealloc__(self):
        free(self.used)
        free(self.rank)

    cdef int scan(self) except -1:
        """Pass 1: 1 when the stream is one this rewrite follows (the used bits set), else 0."""
        cdef const uint8_t *s = &self.src[0]
        cdef int64_t n = self.n, i = 0, memo = 0, ln
        cdef uint64_t idx
        cdef int kind, a
        cdef uint8_t c
        while i < n:
            c = s[i]
            kind = KIND[c]
            a = ARGLEN[c]
            i += 1
            if kind == A_BAD or i + a > n:
                return 0
            if kind == A_NONE:
                continue
            if kind == A_FIXED or kind == A_FRAME or kind == A_PROTO:
                i += a
            elif kind == A_COUNTED:
                ln = <int64_t>_le(s + i, a)
                if ln < 0 or (a == 4 and c == 0x8B and ln >= 0x80000000) or ln > n - i - a:
                    return 0
                i += a + ln
            elif kind == A_MEMOIZE:
                memo += 1
            elif kind == A_GET1 or kind == A_GET4:
                idx = _le(s + i, a)
                if <int64_t>idx >= memo:
                    return 0
                self.used[idx >> 6] |= (<uint64_t>1) << (idx & 63)
                i += a
            elif kind == A_STOP:
                self.n_memo = memo
                self.n = i  # what follows STOP is never read
                return 1
        return 0  # no STOP: truncated

    cdef void ranks(self):
        cdef int64_t k, words = (self.n_memo >> 6) + 1
        cdef uint32_t total = 0
        for k in range(words):
            self.rank[k] = total
            total += popcount64(self.used[k])
        self.n_kept = total

    cdef inline uint32_t new_index(self, uint64_t old):
        cdef uint64_t mask = ((<uint64_t>1) << (old & 63)) - 1
        return self.rank[old >> 6] + popcount64(self.used[old >> 6] & mask)

    cdef bint frame(self):
        """Pass 2, one frame: whole opcodes of at least FRAME_TARGET bytes (or the rest) into ``out``."""
        cdef const uint8_t *s = &self.src[0]
        cdef int64_t i = self.pos, n = self.n, start, ln, w = 0, cap
        cdef uint64_t idx
        cdef uint32_t new
        cdef int kind, a, k
        cdef uint64_t keep
        cdef uint8_t c
        cdef uint8_t *o
        if self.done:
            return False
        cap = FRAME_TARGET + 16
        buf = bytearray(9 + cap)
        o = <uint8_t *><char *>buf + 9
        while i < n and w < FRAME_TARGET:
            c = s[i]
            kind = KIND[c]
            a = ARGLEN[c]
            start = i
            i += 1
            if kind == A_COUNTED:
                ln = <int64_t>_le(s + i, a)
                i += a + ln
            elif kind == A_MEMOIZE:
                keep = (self.used[self.next_old >> 6] >> (self.next_old & 63)) & 1
                self.next_old += 1
                if not keep:
                    continue
            elif kind == A_GET1 or kind == A_GET4:
                new = self.new_index(_le(s + i, a))
                i += a
                if w + 5 > cap:
                    i = start
                    break
                if new < 256:
                    o[w] = ord("h")
                    o[w + 1] = <uint8_t>new
                    w += 2
                else:
                    o[w] = ord("j")
                    o[w + 1] = new & 0xFF
                    o[w + 2] = (new >> 8) & 0xFF
                    o[w + 3] = (new >> 16) & 0xFF
                    o[w + 4] = (new >> 24) & 0xFF
                    w += 5
                continue
            elif kind == A_FRAME:
                i += a
                continue  # re-framed below
            else:
                i += a
            ln = i - start
            if w + ln > cap:
                if w == 0:  # one opcode larger than a frame: a frame of its own
                    buf.extend(bytes(ln - cap))
                    cap = ln
                    o = <uint8_t *><char *>buf + 9
                else:
                    i = start
                    break
            memcpy(o + w, s + start, ln)
            w += ln
        self.pos = i
        if i >= n:
            self.done = True
        o = <uint8_t *><char *>buf
        o[0] = 0x95
        for k in range(8):
            o[1 + k] = (w >> (8 * k)) & 0xFF
        del buf[9 + w:]
        self.out = bytes(buf)
        self.out_pos = 0
        return True

    def read(self, Py_ssize_t size=-1):
        """Up to ``size`` bytes of the rewritten stream (fewer only at its end)."""
        parts = []
        cdef Py_ssize_t want = size, have
        while want != 0:
            have = len(self.out) - self.out_pos
            if have == 0:
                if not self.frame():
                    break
                continue
            if want < 0 or want >= have:
                parts.append(self.out[self.out_pos:] if self.out_pos else self.out)
                self.out_pos += have
                want = want - have if want > 0 else want
            else:
                parts.append(self.out[self.out_pos:self.out_pos + want])
                self.out_pos += want
                want = 0
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readline(self):
        """Never needed: a stream with a text opcode is not rewritten."""
        raise ValueError("readline on a pruned pickle stream")

    @property
    def memo_entries(self):
        """(memoized by the original stream, kept here)."""
        return self.n_memo, self.n_kept


def pruned(data):
    """A :class:`PrunedStream` over the pickle in ``data`` (a buffer), or None when the stream is not one
    this rewrite follows (see the module docstring)."""
    cdef const uint8_t[::1] view = memoryview(data).cast("B")
    cdef int64_t n = view.shape[0]
    cdef PrunedStream p
    cdef int64_t words = (n >> 6) + 2
    if n < 2 or view[0] != 0x80 or view[1] < 2:
        return None
    p = PrunedStream.__new__(PrunedStream)
    p.owner = data
    p.src = view
    p.n = n
    p.used = <uint64_t *>calloc(words, sizeof(uint64_t))
    p.rank = <uint32_t *>malloc(words * sizeof(uint32_t))
    if p.used == NULL or p.rank == NULL:
        raise MemoryError()
    if not p.scan():
        return None
    p.ranks()
    p.out = b""
    return p
