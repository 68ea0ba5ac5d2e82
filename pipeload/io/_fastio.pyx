# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Zero-copy safetensors reader: mmap, header validation, name index, views, and a small file LRU.

The header is validated with the rules of the reference Rust implementation (safetensors 0.8,
``SafeTensors::read_metadata`` + ``Metadata::validate`` + its serde/serde_json deserialisation), so a
file this module accepts is one ``safetensors.safe_open`` accepts and vice versa. The JSON is read
by a hand-written scanner into C arrays; Python objects are made only for the tensor names, the
name -> index dict and the ``__metadata__`` map. See docs/READER.md for the rules and their order.

This module does not import torch: it deals in bytes and buffers. Hand a view to
``torch.frombuffer(f.buffer(name), dtype=torch.uint8)`` for a zero-copy tensor.
"""

import os
from collections import OrderedDict

from pipeload.errors import CheckpointFormatError, HeaderError, ReadError, TensorNotFoundError

from cpython.buffer cimport PyBuffer_FillInfo
from cpython.dict cimport PyDict_SetDefault
from cpython.memoryview cimport PyMemoryView_FromObject
from cpython.ref cimport PyObject
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.errno cimport EINTR, ENOMEM, errno
from libc.math cimport isinf
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcmp, memcpy, strerror
from posix.mman cimport (
    MADV_DONTNEED,
    MADV_NORMAL,
    MADV_RANDOM,
    MADV_SEQUENTIAL,
    MADV_WILLNEED,
    MAP_FAILED,
    MAP_NORESERVE,
    MAP_PRIVATE,
    PROT_READ,
    PROT_WRITE,
    madvise,
    mmap,
    munmap,
)
from posix.stat cimport S_ISDIR, S_ISREG, fstat, struct_stat
from posix.unistd cimport close as c_close
from posix.unistd cimport _SC_PAGESIZE, sysconf
from posix.fcntl cimport POSIX_FADV_RANDOM, posix_fadvise
from posix.types cimport off_t
from posix.unistd cimport pread

# --------------------------------------------------------------------------------------------------
# dtypes: the 22 names safetensors 0.8 accepts, in its enum order, with their size in bits.

_DTYPE_TABLE = (
    ("BOOL", 8), ("F4", 4), ("F6_E2M3", 6), ("F6_E3M2", 6), ("U8", 8), ("I8", 8),
    ("F8_E5M2", 8), ("F8_E4M3", 8), ("F8_E8M0", 8), ("F8_E4M3FNUZ", 8), ("F8_E5M2FNUZ", 8),
    ("I16", 16), ("U16", 16), ("F16", 16), ("BF16", 16), ("I32", 32), ("U32", 32), ("F32", 32),
    ("C64", 64), ("F64", 64), ("I64", 64), ("U64", 64),
)
cdef enum: N_DTYPES = 22

#: bits per element of every dtype name safetensors accepts (sub-byte ones included).
DTYPE_BITS = {name: bits for name, bits in _DTYPE_TABLE}
#: bytes per element of every dtype with a whole-byte element size. The sub-byte dtypes
#: (F4, F6_E2M3, F6_E3M2) are in DTYPE_BITS only: their byte size is numel * bits / 8.
DTYPE_SIZES = {name: bits // 8 for name, bits in _DTYPE_TABLE if bits % 8 == 0}

cdef tuple _DT_NAMES = tuple(name for name, _ in _DTYPE_TABLE)
cdef tuple _DT_NAME_BYTES = tuple(name.encode("ascii") for name, _ in _DTYPE_TABLE)
cdef const char* _dt_name[N_DTYPES]
cdef size_t _dt_len[N_DTYPES]
cdef uint64_t _dt_bits[N_DTYPES]

cdef int _k
for _k in range(N_DTYPES):
    _dt_name[_k] = <const char*>(<bytes>_DT_NAME_BYTES[_k])
    _dt_len[_k] = len(_DT_NAME_BYTES[_k])
    _dt_bits[_k] = _DTYPE_TABLE[_k][1]

# Powers of ten as serde_json uses them to range-check floats (1e0 .. 1e308, correctly rounded).
cdef double _pow10[309]
for _k in range(309):
    _pow10[_k] = float("1e%d" % _k)

# String scanning stops at '"', '\\' and control characters.
cdef uint8_t _str_stop[256]
for _k in range(256):
    _str_stop[_k] = 1 if (_k < 0x20 or _k == 0x22 or _k == 0x5C) else 0

cdef size_t _PAGE = <size_t>sysconf(_SC_PAGESIZE)
cdef size_t _WILLNEED_PIECE = 1 << 20

cdef enum: MAX_HEADER = 100000000
cdef enum: MAX_DEPTH = 127          # serde_json's recursion limit: 128 levels refused, 127 accepted
cdef enum: NOGIL_HEADER = 65536     # release the GIL while scanning headers at least this long

# Guarded copies (see _guard.h and guarded_copy below).
cdef extern from "_guard.h" nogil:
    int pl_copy_nd(char* dst, const int64_t* dstr, const char* src, const int64_t* sstr,
                   const int64_t* shape, int ndim, size_t itemsize, void** fault)


# Test hook: pretend a writable private mapping is refused (as under vm.overcommit_memory=2).
cdef bint _force_readonly = False


cdef int _willneed(char* addr, uint64_t start, uint64_t stop) noexcept nogil:
    """madvise(WILLNEED) [start, stop) of a mapping at ``addr`` (start widened to its page) in 1 MiB
    pieces: the kernel caps one WILLNEED at the readahead window (8 MiB here, 128 KiB on many disks) and
    silently drops the rest (measured on a cold 134 MiB file: one call for the whole range 1.16 s, 1 MiB
    pieces 0.12 s, default readahead 0.18 s). Returns 0, or the errno of the first piece refused (the
    rest is then not asked for); callers that treat it as a hint ignore it."""
    cdef size_t a0 = <size_t>start & ~(_PAGE - 1)
    cdef size_t ln
    while a0 < <size_t>stop:
        ln = min(<size_t>_WILLNEED_PIECE, <size_t>stop - a0)
        if madvise(addr + a0, ln, MADV_WILLNEED) != 0:
            return errno
        a0 += ln
    return 0


cdef size_t _PREAD_MIN = 16384  # boxes at least this large and contiguous are pread(), not copied from the mapping


cdef bint _c_order(const int64_t* strides, const int64_t* shape, int n, size_t isz) noexcept nogil:
    """Whether a box of ``shape`` with byte ``strides`` is one C-ordered contiguous run."""
    cdef int64_t expect = <int64_t>isz
    cdef int k
    for k in range(n - 1, -1, -1):
        if shape[k] == 1:
            continue
        if strides[k] != expect:
            return False
        expect *= shape[k]
    return True


cdef int _pread_all(int fd, uint8_t* buf, size_t n, uint64_t offset, str path, str what="the header") except -1:
    """Read exactly ``n`` bytes at ``offset`` without the GIL; ReadError on an I/O error or a short file."""
    cdef ssize_t got
    cdef size_t done = 0
    cdef int err = 0
    with nogil:
        while done < n:
            got = pread(fd, buf + done, n - done, <off_t>(offset + done))
            if got < 0:
                err = errno
                if err == EINTR:
                    continue
                break
            if got == 0:
                break
            done += <size_t>got
    if done < n:
        if err:
            raise ReadError(f"{path}: cannot read {what}: {os.strerror(err)}")
        raise ReadError(f"{path}: file ended while {what} was read (it was truncated after it was opened)")
    return 0


def _set_pread_min(size_t nbytes):
    """Testing and measuring: the smallest contiguous box ``copy_box`` preads (larger than any box: never)."""
    global _PREAD_MIN
    old = _PREAD_MIN
    _PREAD_MIN = nbytes
    return old


def _set_force_readonly(bint value):
    """Testing only: make the next opens take the read-only mapping fallback."""
    global _force_readonly
    _force_readonly = value


# --------------------------------------------------------------------------------------------------
# The mapping: owns the mmap, unmaps it when the last reference (file or exported view) goes away.

cdef class _Mapping:
    """Owner of one mmap of a whole file; exports it through the buffer protocol."""
    cdef char* addr
    cdef Py_ssize_t length
    cdef readonly int exports
    cdef readonly bint readonly
    cdef object __weakref__

    def __cinit__(self):
        self.addr = NULL
        self.length = 0
        self.exports = 0
        self.readonly = False

    def __dealloc__(self):
        if self.addr != NULL:
            munmap(self.addr, <size_t>self.length)
            self.addr = NULL

    def __getbuffer__(self, Py_buffer* buf, int flags):
        PyBuffer_FillInfo(buf, self, self.addr, self.length, self.readonly, flags)
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* buf):
        self.exports -= 1

    @property
    def nbytes(self):
        return self.length


# --------------------------------------------------------------------------------------------------
# Header scanner: plain C over the header bytes, no Python objects, no GIL.

cdef struct Entry:
    uint64_t start          # relative to the data section while scanning; absolute afterwards
    uint64_t end
    size_t dims_at          # index of the first dim in the dims array
    size_t name_at          # name span in the header (between the quotes, still escaped)
    size_t name_len
    uint32_t ndim
    uint8_t dtype
    uint8_t name_esc
    uint8_t dead            # replaced by a later entry of the same name (serde: last one wins)

cdef struct MetaPair:
    size_t k_at
    size_t k_len
    size_t v_at
    size_t v_len
    uint8_t k_esc
    uint8_t v_esc

cdef struct SortKey:
    uint64_t start
    uint64_t end
    size_t idx              # position in the header: ties keep header order, like a stable sort

cdef struct Scan:
    const uint8_t* p
    size_t n
    size_t i
    Entry* ents
    size_t n_ents
    size_t cap_ents
    uint64_t* dims
    size_t n_dims
    size_t cap_dims
    MetaPair* meta
    size_t n_meta
    size_t cap_meta
    int meta_state          # 0 absent, 1 null, 2 object
    int last_dtype          # last dtype found (lookup cache), -1 at first
    Py_ssize_t cur          # entry being parsed, -1 outside entries
    int err
    int sub
    size_t pos
    Py_ssize_t err_ent
    size_t span_at          # a string span the message quotes (unknown dtype)
    size_t span_len
    uint8_t span_esc
    uint64_t a              # numbers the validation messages quote
    uint64_t b

# error codes
cdef enum: E_NOMEM = 1
cdef enum: E_UTF8 = 2
cdef enum: E_JSON = 3
cdef enum: E_NOT_OBJECT = 4
cdef enum: E_META_DUP = 5
cdef enum: E_META_TYPE = 6
cdef enum: E_ENTRY_TYPE = 7
cdef enum: E_FIELD_DUP = 8
cdef enum: E_FIELD_MISSING = 9
cdef enum: E_DTYPE_TYPE = 10
cdef enum: E_DTYPE_UNKNOWN = 11
cdef enum: E_SHAPE_TYPE = 12
cdef enum: E_OFFSETS_TYPE = 13
cdef enum: E_SEQ_LEN = 14
cdef enum: V_OFFSETS = 20
cdef enum: V_OVERFLOW = 21
cdef enum: V_MISALIGNED = 22
cdef enum: V_SIZE = 23
cdef enum: V_COVER = 24

# JSON sub-reasons
cdef enum: J_EOF = 1
cdef enum: J_CONTROL = 2
cdef enum: J_ESCAPE = 3
cdef enum: J_SURROGATE = 4
cdef enum: J_NUMBER = 5
cdef enum: J_RANGE = 6
cdef enum: J_VALUE = 7
cdef enum: J_IDENT = 8
cdef enum: J_COLON = 9
cdef enum: J_COMMA_OBJ = 10
cdef enum: J_COMMA_ARR = 11
cdef enum: J_KEY = 12
cdef enum: J_TRAILING_COMMA = 13
cdef enum: J_DEPTH = 14
cdef enum: J_TRAILING = 15

_JSON_REASONS = {
    J_EOF: "unexpected end of the header",
    J_CONTROL: "control character inside a string",
    J_ESCAPE: "invalid escape in a string",
    J_SURROGATE: "unpaired surrogate in a \\u escape",
    J_NUMBER: "invalid number",
    J_RANGE: "number out of range",
    J_VALUE: "expected a value",
    J_IDENT: "invalid literal",
    J_COLON: "expected ':'",
    J_COMMA_OBJ: "expected ',' or '}'",
    J_COMMA_ARR: "expected ',' or ']'",
    J_KEY: "object key must be a string",
    J_TRAILING_COMMA: "trailing comma",
    J_DEPTH: "nesting deeper than 127 levels",
    J_TRAILING: "trailing characters after the JSON object",
}
_FIELDS = ("dtype", "shape", "data_offsets")

# number kinds (serde_json's ParserNumber)
cdef enum: K_UINT = 0
cdef enum: K_NEGINT = 1
cdef enum: K_FLOAT = 2


cdef inline bint _fail(Scan* s, int code, int sub, size_t pos) noexcept nogil:
    if s.err == 0:
        s.err = code
        s.sub = sub
        s.pos = pos
        s.err_ent = s.cur
    return False


cdef inline int _peek(Scan* s) noexcept nogil:
    if s.i < s.n:
        return s.p[s.i]
    return -1


cdef inline void _skip_ws(Scan* s) noexcept nogil:
    cdef size_t i = s.i
    cdef size_t n = s.n
    cdef const uint8_t* p = s.p
    cdef uint8_t c
    while i < n:
        c = p[i]
        if c == 0x20 or c == 0x0A or c == 0x0D or c == 0x09:
            i += 1
        else:
            break
    s.i = i


cdef inline int _hexval(uint8_t c) noexcept nogil:
    if 0x30 <= c <= 0x39:
        return c - 0x30
    if 0x61 <= c <= 0x66:
        return c - 0x61 + 10
    if 0x41 <= c <= 0x46:
        return c - 0x41 + 10
    return -1


cdef inline int _hex4(const uint8_t* p, size_t i, size_t n) noexcept nogil:
    """The 4 hex digits at p[i:i+4] as a number, -1 if missing or not hex."""
    cdef int v = 0, d, k
    if i + 4 > n:
        return -1
    for k in range(4):
        d = _hexval(p[i + k])
        if d < 0:
            return -1
        v = (v << 4) | d
    return v


cdef bint _validate_utf8(const uint8_t* p, size_t n, size_t* bad) noexcept nogil:
    """Strict UTF-8 (RFC 3629: no overlongs, no surrogates, nothing above U+10FFFF)."""
    cdef size_t i = 0
    cdef uint64_t w
    cdef uint8_t c, c1
    cdef size_t need
    cdef uint8_t lo, hi
    while i < n:
        while i + 8 <= n:
            memcpy(&w, p + i, 8)
            if w & <uint64_t>0x8080808080808080ULL:
                break
            i += 8
        if i >= n:
            break
        c = p[i]
        if c < 0x80:
            i += 1
            continue
        lo = 0x80
        hi = 0xBF
        if 0xC2 <= c <= 0xDF:
            need = 1
        elif c == 0xE0:
            need = 2
            lo = 0xA0
        elif (0xE1 <= c <= 0xEC) or c == 0xEE or c == 0xEF:
            need = 2
        elif c == 0xED:
            need = 2
            hi = 0x9F
        elif c == 0xF0:
            need = 3
            lo = 0x90
        elif 0xF1 <= c <= 0xF3:
            need = 3
        elif c == 0xF4:
            need = 3
            hi = 0x8F
        else:
            bad[0] = i
            return False
        if i + need >= n:
            bad[0] = i
            return False
        c1 = p[i + 1]
        if c1 < lo or c1 > hi:
            bad[0] = i
            return False
        if need >= 2 and (p[i + 2] & 0xC0) != 0x80:
            bad[0] = i
            return False
        if need == 3 and (p[i + 3] & 0xC0) != 0x80:
            bad[0] = i
            return False
        i += need + 1
    return True


cdef inline uint64_t _str_special(uint64_t w) noexcept nogil:
    """Non-zero iff one of the 8 bytes of w is '"', '\\' or below 0x20 (SWAR zero-byte tests)."""
    cdef uint64_t ones = 0x0101010101010101ULL
    cdef uint64_t q = w ^ (ones * 0x22)
    cdef uint64_t b = w ^ (ones * 0x5C)
    return (((q - ones) & ~q) | ((b - ones) & ~b) | ((w - ones * 0x20) & ~w)) \
        & 0x8080808080808080ULL


cdef bint _scan_string(Scan* s, size_t* at, size_t* ln, uint8_t* esc) noexcept nogil:
    """A JSON string at s.i (which is '"'): its raw span, whether it has escapes; checks escapes."""
    cdef const uint8_t* p = s.p
    cdef size_t n = s.n
    cdef size_t i = s.i + 1
    cdef size_t start = i
    cdef uint8_t e = 0
    cdef uint8_t c
    cdef int cp, lo
    cdef uint64_t w
    while True:
        # 8 bytes at a time up to the word holding the next '"', '\\' or control character
        while i + 8 <= n:
            memcpy(&w, p + i, 8)
            if _str_special(w):
                break
            i += 8
        while i < n and not _str_stop[p[i]]:
            i += 1
        if i >= n:
            return _fail(s, E_JSON, J_EOF, n)
        c = p[i]
        if c == 0x22:
            break
        if c == 0x5C:
            e = 1
            if i + 1 >= n:
                return _fail(s, E_JSON, J_EOF, n)
            c = p[i + 1]
            if c == 0x22 or c == 0x5C or c == 0x2F or c == 0x62 or c == 0x66 or c == 0x6E \
                    or c == 0x72 or c == 0x74:
                i += 2
                continue
            if c != 0x75:
                return _fail(s, E_JSON, J_ESCAPE, i)
            cp = _hex4(p, i + 2, n)
            if cp < 0:
                return _fail(s, E_JSON, J_ESCAPE, i)
            i += 6
            if 0xD800 <= cp <= 0xDBFF:
                if i + 1 < n and p[i] == 0x5C and p[i + 1] == 0x75:
                    lo = _hex4(p, i + 2, n)
                    if lo < 0:
                        return _fail(s, E_JSON, J_ESCAPE, i)
                    if lo < 0xDC00 or lo > 0xDFFF:
                        return _fail(s, E_JSON, J_SURROGATE, i)
                    i += 6
                else:
                    return _fail(s, E_JSON, J_SURROGATE, i)
            elif 0xDC00 <= cp <= 0xDFFF:
                return _fail(s, E_JSON, J_SURROGATE, i - 6)
            continue
        return _fail(s, E_JSON, J_CONTROL, i)
    at[0] = start
    ln[0] = i - start
    esc[0] = e
    s.i = i + 1
    return True


cdef size_t _decode_string(const uint8_t* p, size_t at, size_t ln, uint8_t* out) noexcept nogil:
    """Unescape a string span already checked by _scan_string into UTF-8; returns the length.

    The output is never longer than the input.
    """
    cdef size_t i = at
    cdef size_t end = at + ln
    cdef size_t j = 0
    cdef uint8_t c
    cdef uint32_t cp, lo
    while i < end:
        c = p[i]
        if c != 0x5C:
            out[j] = c
            j += 1
            i += 1
            continue
        c = p[i + 1]
        if c == 0x75:
            cp = <uint32_t>_hex4(p, i + 2, end)
            i += 6
            if 0xD800 <= cp <= 0xDBFF:
                lo = <uint32_t>_hex4(p, i + 2, end)
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                i += 6
            if cp < 0x80:
                out[j] = <uint8_t>cp
                j += 1
            elif cp < 0x800:
                out[j] = <uint8_t>(0xC0 | (cp >> 6))
                out[j + 1] = <uint8_t>(0x80 | (cp & 0x3F))
                j += 2
            elif cp < 0x10000:
                out[j] = <uint8_t>(0xE0 | (cp >> 12))
                out[j + 1] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
                out[j + 2] = <uint8_t>(0x80 | (cp & 0x3F))
                j += 3
            else:
                out[j] = <uint8_t>(0xF0 | (cp >> 18))
                out[j + 1] = <uint8_t>(0x80 | ((cp >> 12) & 0x3F))
                out[j + 2] = <uint8_t>(0x80 | ((cp >> 6) & 0x3F))
                out[j + 3] = <uint8_t>(0x80 | (cp & 0x3F))
                j += 4
            continue
        if c == 0x62:
            out[j] = 0x08
        elif c == 0x66:
            out[j] = 0x0C
        elif c == 0x6E:
            out[j] = 0x0A
        elif c == 0x72:
            out[j] = 0x0D
        elif c == 0x74:
            out[j] = 0x09
        else:                       # '"', '\\', '/'
            out[j] = c
        j += 1
        i += 2
    return j


cdef bint _str_is(const uint8_t* p, size_t at, size_t ln, uint8_t esc,
                  const char* lit, size_t litlen) noexcept nogil:
    """Does the (possibly escaped) string span equal the ASCII literal?"""
    cdef uint8_t buf[128]
    cdef size_t m
    if not esc:
        return ln == litlen and memcmp(p + at, lit, litlen) == 0
    if ln > 128:                    # decodes to > 21 bytes: longer than any literal used here
        return False
    m = _decode_string(p, at, ln, buf)
    return m == litlen and memcmp(buf, lit, litlen) == 0


cdef int _lookup_dtype(Scan* s, size_t at, size_t ln, uint8_t esc) noexcept nogil:
    cdef int k = s.last_dtype
    if k >= 0 and _str_is(s.p, at, ln, esc, _dt_name[k], _dt_len[k]):
        return k                    # checkpoints repeat a few dtypes: try the last one first
    for k in range(N_DTYPES):
        if _str_is(s.p, at, ln, esc, _dt_name[k], _dt_len[k]):
            s.last_dtype = k
            return k
    return -1


cdef inline bint _isdigit(int c) noexcept nogil:
    return 0x30 <= c <= 0x39


cdef inline bint _mul10_overflows(uint64_t v, uint64_t d) noexcept nogil:
    # serde_json's overflow!(v * 10 + d, u64::MAX)
    return v >= 1844674407370955161ULL and (v > 1844674407370955161ULL or d > 5)


cdef bint _f64_from_parts(Scan* s, uint64_t sig, int64_t exponent, size_t pos) noexcept nogil:
    """serde_json's range check of a float (without its float_roundtrip feature): error on inf."""
    cdef double f = <double>sig
    cdef int64_t ae
    while True:
        ae = -exponent if exponent < 0 else exponent
        if ae <= 308:
            if exponent >= 0:
                f *= _pow10[ae]
                if isinf(f):
                    return _fail(s, E_JSON, J_RANGE, pos)
            else:
                f /= _pow10[ae]
            return True
        if f == 0.0:
            return True
        if exponent >= 0:
            return _fail(s, E_JSON, J_RANGE, pos)
        f /= 1e308
        exponent += 308


cdef inline int64_t _sat_i32(int64_t v) noexcept nogil:
    if v > 2147483647:
        return 2147483647
    if v < -2147483648:
        return -2147483648
    return v


cdef bint _scan_exponent(Scan* s, uint64_t sig, int64_t start_exp, size_t pos) noexcept nogil:
    # at 'e' / 'E'
    cdef bint positive_exp = True
    cdef int c
    cdef int64_t e
    s.i += 1
    c = _peek(s)
    if c == 0x2B:
        s.i += 1
    elif c == 0x2D:
        s.i += 1
        positive_exp = False
    c = _peek(s)
    if c < 0:
        return _fail(s, E_JSON, J_EOF, s.i)
    if not _isdigit(c):
        return _fail(s, E_JSON, J_NUMBER, s.i)
    s.i += 1
    e = c - 0x30
    while True:
        c = _peek(s)
        if not _isdigit(c):
            break
        s.i += 1
        if e >= 214748364 and (e > 214748364 or (c - 0x30) > 7):
            # exponent overflows i32: serde_json errors for a non-zero significand and a positive
            # exponent, else the value is zero
            while _isdigit(_peek(s)):
                s.i += 1
            if sig != 0 and positive_exp:
                return _fail(s, E_JSON, J_RANGE, pos)
            return True
        e = e * 10 + (c - 0x30)
    if positive_exp:
        e = _sat_i32(start_exp + e)
    else:
        e = _sat_i32(start_exp - e)
    return _f64_from_parts(s, sig, e, pos)


cdef bint _scan_number(Scan* s, int* kind, uint64_t* val) noexcept nogil:
    """A JSON number at s.i, classified as serde_json does (u64 / negative i64 / f64)."""
    cdef size_t pos = s.i
    cdef bint neg = False
    cdef int c
    cdef uint64_t sig = 0
    cdef int64_t exponent = 0
    cdef bint overflowed = False
    c = _peek(s)
    if c == 0x2D:
        neg = True
        s.i += 1
        c = _peek(s)
        if c < 0:
            return _fail(s, E_JSON, J_EOF, s.i)
    if c == 0x30:
        s.i += 1
        if _isdigit(_peek(s)):
            return _fail(s, E_JSON, J_NUMBER, s.i)
    elif 0x31 <= c <= 0x39:
        s.i += 1
        sig = c - 0x30
        while True:
            c = _peek(s)
            if not _isdigit(c):
                break
            if _mul10_overflows(sig, c - 0x30):
                overflowed = True
                break
            sig = sig * 10 + (c - 0x30)
            s.i += 1
        if overflowed:
            # too long for u64: further integer digits only scale the float
            while _isdigit(_peek(s)):
                s.i += 1
                exponent += 1
    else:
        return _fail(s, E_JSON, J_NUMBER, s.i)
    c = _peek(s)
    if c == 0x2E:
        s.i += 1
        c = _peek(s)
        if not _isdigit(c):
            if c < 0:
                return _fail(s, E_JSON, J_EOF, s.i)
            return _fail(s, E_JSON, J_NUMBER, s.i)
        while True:
            c = _peek(s)
            if not _isdigit(c):
                break
            if _mul10_overflows(sig, c - 0x30):
                while _isdigit(_peek(s)):
                    s.i += 1
                break
            sig = sig * 10 + (c - 0x30)
            exponent -= 1
            s.i += 1
        kind[0] = K_FLOAT
        if _peek(s) == 0x45 or _peek(s) == 0x65:
            return _scan_exponent(s, sig, exponent, pos)
        return _f64_from_parts(s, sig, exponent, pos)
    if c == 0x45 or c == 0x65:
        kind[0] = K_FLOAT
        return _scan_exponent(s, sig, exponent, pos)
    if overflowed:
        kind[0] = K_FLOAT
        return _f64_from_parts(s, sig, exponent, pos)
    if not neg:
        kind[0] = K_UINT
        val[0] = sig
    elif sig != 0 and sig <= 9223372036854775808ULL:
        kind[0] = K_NEGINT
    else:
        kind[0] = K_FLOAT            # -0 and below i64::MIN are floats to serde_json
    return True


cdef bint _expect_lit(Scan* s, const char* lit, size_t ln) noexcept nogil:
    if s.i + ln <= s.n and memcmp(s.p + s.i, lit, ln) == 0:
        s.i += ln
        return True
    if s.i + ln > s.n:
        # a truncated literal is an EOF to serde_json only if what is there matches so far
        if memcmp(s.p + s.i, lit, s.n - s.i) == 0:
            return _fail(s, E_JSON, J_EOF, s.n)
    return _fail(s, E_JSON, J_IDENT, s.i)


cdef bint _skip_value(Scan* s, int depth) noexcept nogil:
    """Check and skip any JSON value; `depth` is the nesting depth of its container."""
    cdef int c, kind
    cdef uint64_t v
    cdef size_t at, ln
    cdef uint8_t esc
    _skip_ws(s)
    c = _peek(s)
    if c < 0:
        return _fail(s, E_JSON, J_EOF, s.i)
    if c == 0x22:
        return _scan_string(s, &at, &ln, &esc)
    if c == 0x2D or _isdigit(c):
        return _scan_number(s, &kind, &v)
    if c == 0x7B:                                   # {
        if depth + 1 > MAX_DEPTH:
            return _fail(s, E_JSON, J_DEPTH, s.i)
        s.i += 1
        _skip_ws(s)
        if _peek(s) == 0x7D:
            s.i += 1
            return True
        while True:
            _skip_ws(s)
            c = _peek(s)
            if c != 0x22:
                if c < 0:
                    return _fail(s, E_JSON, J_EOF, s.i)
                return _fail(s, E_JSON, J_KEY, s.i)
            if not _scan_string(s, &at, &ln, &esc):
                return False
            _skip_ws(s)
            c = _peek(s)
            if c != 0x3A:
                return _fail(s, E_JSON, J_EOF if c < 0 else J_COLON, s.i)
            s.i += 1
            if not _skip_value(s, depth + 1):
                return False
            _skip_ws(s)
            c = _peek(s)
            if c == 0x2C:
                s.i += 1
                _skip_ws(s)
                if _peek(s) == 0x7D:
                    return _fail(s, E_JSON, J_TRAILING_COMMA, s.i)
                continue
            if c == 0x7D:
                s.i += 1
                return True
            return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_OBJ, s.i)
    if c == 0x5B:                                   # [
        if depth + 1 > MAX_DEPTH:
            return _fail(s, E_JSON, J_DEPTH, s.i)
        s.i += 1
        _skip_ws(s)
        if _peek(s) == 0x5D:
            s.i += 1
            return True
        while True:
            if not _skip_value(s, depth + 1):
                return False
            _skip_ws(s)
            c = _peek(s)
            if c == 0x2C:
                s.i += 1
                _skip_ws(s)
                if _peek(s) == 0x5D:
                    return _fail(s, E_JSON, J_TRAILING_COMMA, s.i)
                continue
            if c == 0x5D:
                s.i += 1
                return True
            return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)
    if c == 0x74:
        return _expect_lit(s, "true", 4)
    if c == 0x66:
        return _expect_lit(s, "false", 5)
    if c == 0x6E:
        return _expect_lit(s, "null", 4)
    return _fail(s, E_JSON, J_VALUE, s.i)


cdef bint _type_error(Scan* s, int code, int depth) noexcept nogil:
    """A value of the wrong JSON type where a typed field was expected.

    serde_json reports a syntax error first when the value is not valid JSON either; both reject,
    this keeps the message about the first real problem."""
    cdef size_t pos = s.i
    if not _skip_value(s, depth):
        return False
    return _fail(s, code, 0, pos)


cdef bint _grow_dims(Scan* s) noexcept nogil:
    cdef size_t cap = s.cap_dims * 2 if s.cap_dims else 64
    cdef uint64_t* d = <uint64_t*>realloc(s.dims, cap * sizeof(uint64_t))
    if d == NULL:
        return _fail(s, E_NOMEM, 0, s.i)
    s.dims = d
    s.cap_dims = cap
    return True


cdef bint _parse_dtype(Scan* s, Entry* e, int depth) noexcept nogil:
    cdef size_t at, ln, vpos
    cdef uint8_t esc
    cdef int c, k
    _skip_ws(s)
    c = _peek(s)
    if c == 0x22:
        if not _scan_string(s, &at, &ln, &esc):
            return False
        k = _lookup_dtype(s, at, ln, esc)
        if k < 0:
            s.span_at = at
            s.span_len = ln
            s.span_esc = esc
            return _fail(s, E_DTYPE_UNKNOWN, 0, at)
        e.dtype = <uint8_t>k
        return True
    if c == 0x7B:
        # serde also takes an enum as a map with one key, the variant, and a null value
        vpos = s.i
        s.i += 1
        _skip_ws(s)
        if _peek(s) != 0x22:
            s.i = vpos
            return _type_error(s, E_DTYPE_TYPE, depth)
        if not _scan_string(s, &at, &ln, &esc):
            return False
        _skip_ws(s)
        c = _peek(s)
        if c != 0x3A:
            return _fail(s, E_JSON, J_EOF if c < 0 else J_COLON, s.i)
        s.i += 1
        k = _lookup_dtype(s, at, ln, esc)
        if k < 0:
            s.span_at = at
            s.span_len = ln
            s.span_esc = esc
            return _fail(s, E_DTYPE_UNKNOWN, 0, at)
        _skip_ws(s)
        if _peek(s) != 0x6E:
            return _type_error(s, E_DTYPE_TYPE, depth + 1)
        if not _expect_lit(s, "null", 4):
            return False
        _skip_ws(s)
        c = _peek(s)
        if c == 0x7D:
            s.i += 1
            e.dtype = <uint8_t>k
            return True
        if c == 0x2C:
            return _fail(s, E_DTYPE_TYPE, 0, vpos)
        return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_OBJ, s.i)
    return _type_error(s, E_DTYPE_TYPE, depth)


cdef bint _parse_shape(Scan* s, Entry* e, int depth) noexcept nogil:
    cdef int c, kind
    cdef uint64_t v
    cdef size_t pos
    _skip_ws(s)
    if _peek(s) != 0x5B:
        return _type_error(s, E_SHAPE_TYPE, depth)
    pos = s.i
    s.i += 1
    e.dims_at = s.n_dims
    e.ndim = 0
    _skip_ws(s)
    if _peek(s) == 0x5D:
        s.i += 1
        return True
    while True:
        _skip_ws(s)
        c = _peek(s)
        if c == 0x2D or _isdigit(c):
            if not _scan_number(s, &kind, &v):
                return False
            if kind != K_UINT:
                return _fail(s, E_SHAPE_TYPE, 0, pos)
        else:
            s.i = pos
            return _type_error(s, E_SHAPE_TYPE, depth)
        if s.n_dims == s.cap_dims and not _grow_dims(s):
            return False
        s.dims[s.n_dims] = v
        s.n_dims += 1
        e.ndim += 1
        _skip_ws(s)
        c = _peek(s)
        if c == 0x2C:
            s.i += 1
            continue
        if c == 0x5D:
            s.i += 1
            return True
        return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)


cdef bint _parse_offsets(Scan* s, Entry* e, int depth) noexcept nogil:
    cdef int c, kind, k
    cdef uint64_t v
    cdef uint64_t vals[2]
    cdef size_t pos
    _skip_ws(s)
    pos = s.i
    if _peek(s) != 0x5B:
        return _type_error(s, E_OFFSETS_TYPE, depth)
    s.i += 1
    for k in range(2):
        _skip_ws(s)
        c = _peek(s)
        if not (c == 0x2D or _isdigit(c)):
            s.i = pos
            return _type_error(s, E_OFFSETS_TYPE, depth)
        if not _scan_number(s, &kind, &v):
            return False
        if kind != K_UINT:
            return _fail(s, E_OFFSETS_TYPE, 0, pos)
        vals[k] = v
        _skip_ws(s)
        c = _peek(s)
        if k == 0:
            if c != 0x2C:
                if c == 0x5D:
                    return _fail(s, E_OFFSETS_TYPE, 0, pos)
                return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)
            s.i += 1
    if c == 0x5D:
        s.i += 1
        e.start = vals[0]
        e.end = vals[1]
        return True
    if c == 0x2C:
        return _fail(s, E_OFFSETS_TYPE, 0, pos)
    return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)


cdef bint _parse_entry(Scan* s, Entry* e) noexcept nogil:
    """One tensor's info: {"dtype", "shape", "data_offsets"} (any order, other keys ignored) or,
    as serde also accepts for a struct, the sequence [dtype, shape, data_offsets]."""
    cdef int c, field
    cdef int have = 0
    cdef size_t at, ln
    cdef uint8_t esc
    _skip_ws(s)
    c = _peek(s)
    if c == 0x7B:
        s.i += 1
        _skip_ws(s)
        if _peek(s) == 0x7D:
            s.i += 1
        else:
            while True:
                _skip_ws(s)
                c = _peek(s)
                if c != 0x22:
                    return _fail(s, E_JSON, J_EOF if c < 0 else J_KEY, s.i)
                if not _scan_string(s, &at, &ln, &esc):
                    return False
                _skip_ws(s)
                c = _peek(s)
                if c != 0x3A:
                    return _fail(s, E_JSON, J_EOF if c < 0 else J_COLON, s.i)
                s.i += 1
                if _str_is(s.p, at, ln, esc, "dtype", 5):
                    field = 0
                elif _str_is(s.p, at, ln, esc, "shape", 5):
                    field = 1
                elif _str_is(s.p, at, ln, esc, "data_offsets", 12):
                    field = 2
                else:
                    field = -1
                if field >= 0:
                    if have & (1 << field):
                        return _fail(s, E_FIELD_DUP, field, at)
                    have |= 1 << field
                    if field == 0:
                        if not _parse_dtype(s, e, 2):
                            return False
                    elif field == 1:
                        if not _parse_shape(s, e, 2):
                            return False
                    elif not _parse_offsets(s, e, 2):
                        return False
                elif not _skip_value(s, 2):
                    return False
                _skip_ws(s)
                c = _peek(s)
                if c == 0x2C:
                    s.i += 1
                    _skip_ws(s)
                    if _peek(s) == 0x7D:
                        return _fail(s, E_JSON, J_TRAILING_COMMA, s.i)
                    continue
                if c == 0x7D:
                    s.i += 1
                    break
                return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_OBJ, s.i)
        for field in range(3):
            if not (have & (1 << field)):
                return _fail(s, E_FIELD_MISSING, field, s.i)
        return True
    if c == 0x5B:
        s.i += 1
        for field in range(3):
            _skip_ws(s)
            if field == 0 and _peek(s) == 0x5D:
                return _fail(s, E_SEQ_LEN, 0, s.i)
            if field == 0:
                if not _parse_dtype(s, e, 2):
                    return False
            elif field == 1:
                if not _parse_shape(s, e, 2):
                    return False
            elif not _parse_offsets(s, e, 2):
                return False
            _skip_ws(s)
            c = _peek(s)
            if field < 2:
                if c == 0x5D:
                    return _fail(s, E_SEQ_LEN, field + 1, s.i)
                if c != 0x2C:
                    return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)
                s.i += 1
        if c == 0x5D:
            s.i += 1
            return True
        if c == 0x2C:
            return _fail(s, E_SEQ_LEN, 4, s.i)
        return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_ARR, s.i)
    return _type_error(s, E_ENTRY_TYPE, 1)


cdef bint _parse_metadata(Scan* s) noexcept nogil:
    cdef int c
    cdef size_t at, ln, vat, vln
    cdef uint8_t esc, vesc
    cdef MetaPair* m
    cdef size_t cap
    _skip_ws(s)
    c = _peek(s)
    if c == 0x6E:
        if not _expect_lit(s, "null", 4):
            return False
        s.meta_state = 1
        return True
    if c != 0x7B:
        return _type_error(s, E_META_TYPE, 1)
    s.meta_state = 2
    s.i += 1
    _skip_ws(s)
    if _peek(s) == 0x7D:
        s.i += 1
        return True
    while True:
        _skip_ws(s)
        c = _peek(s)
        if c != 0x22:
            return _fail(s, E_JSON, J_EOF if c < 0 else J_KEY, s.i)
        if not _scan_string(s, &at, &ln, &esc):
            return False
        _skip_ws(s)
        c = _peek(s)
        if c != 0x3A:
            return _fail(s, E_JSON, J_EOF if c < 0 else J_COLON, s.i)
        s.i += 1
        _skip_ws(s)
        if _peek(s) != 0x22:
            return _type_error(s, E_META_TYPE, 2)
        if not _scan_string(s, &vat, &vln, &vesc):
            return False
        if s.n_meta == s.cap_meta:
            cap = s.cap_meta * 2 if s.cap_meta else 8
            m = <MetaPair*>realloc(s.meta, cap * sizeof(MetaPair))
            if m == NULL:
                return _fail(s, E_NOMEM, 0, s.i)
            s.meta = m
            s.cap_meta = cap
        m = &s.meta[s.n_meta]
        m.k_at = at
        m.k_len = ln
        m.k_esc = esc
        m.v_at = vat
        m.v_len = vln
        m.v_esc = vesc
        s.n_meta += 1
        _skip_ws(s)
        c = _peek(s)
        if c == 0x2C:
            s.i += 1
            _skip_ws(s)
            if _peek(s) == 0x7D:
                return _fail(s, E_JSON, J_TRAILING_COMMA, s.i)
            continue
        if c == 0x7D:
            s.i += 1
            return True
        return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_OBJ, s.i)


cdef bint _parse_header(Scan* s) noexcept nogil:
    cdef int c
    cdef size_t at, ln, cap
    cdef uint8_t esc
    cdef bint meta_seen = False
    cdef Entry* e
    _skip_ws(s)
    c = _peek(s)
    if c != 0x7B:
        if c < 0:
            return _fail(s, E_JSON, J_EOF, s.i)
        if not _skip_value(s, 0):
            return False
        _skip_ws(s)
        if s.i < s.n:
            return _fail(s, E_JSON, J_TRAILING, s.i)
        return _fail(s, E_NOT_OBJECT, 0, 0)
    s.i += 1
    _skip_ws(s)
    if _peek(s) == 0x7D:
        s.i += 1
    else:
        while True:
            _skip_ws(s)
            c = _peek(s)
            if c != 0x22:
                return _fail(s, E_JSON, J_EOF if c < 0 else J_KEY, s.i)
            if not _scan_string(s, &at, &ln, &esc):
                return False
            _skip_ws(s)
            c = _peek(s)
            if c != 0x3A:
                return _fail(s, E_JSON, J_EOF if c < 0 else J_COLON, s.i)
            s.i += 1
            if _str_is(s.p, at, ln, esc, "__metadata__", 12):
                if meta_seen:
                    return _fail(s, E_META_DUP, 0, at)
                meta_seen = True
                if not _parse_metadata(s):
                    return False
            else:
                if s.n_ents == s.cap_ents:
                    cap = s.cap_ents * 2 if s.cap_ents else 16
                    e = <Entry*>realloc(s.ents, cap * sizeof(Entry))
                    if e == NULL:
                        return _fail(s, E_NOMEM, 0, s.i)
                    s.ents = e
                    s.cap_ents = cap
                e = &s.ents[s.n_ents]
                e.name_at = at
                e.name_len = ln
                e.name_esc = esc
                e.dead = 0
                e.ndim = 0
                e.dims_at = s.n_dims
                s.cur = <Py_ssize_t>s.n_ents
                s.n_ents += 1
                if not _parse_entry(s, e):
                    return False
                s.cur = -1
            _skip_ws(s)
            c = _peek(s)
            if c == 0x2C:
                s.i += 1
                _skip_ws(s)
                if _peek(s) == 0x7D:
                    return _fail(s, E_JSON, J_TRAILING_COMMA, s.i)
                continue
            if c == 0x7D:
                s.i += 1
                break
            return _fail(s, E_JSON, J_EOF if c < 0 else J_COMMA_OBJ, s.i)
    _skip_ws(s)
    if s.i < s.n:
        return _fail(s, E_JSON, J_TRAILING, s.i)
    return True


cdef bint _scan_all(Scan* s) noexcept nogil:
    cdef size_t bad = 0
    if not _validate_utf8(s.p, s.n, &bad):
        return _fail(s, E_UTF8, 0, bad)
    return _parse_header(s)


cdef int _cmp_keys(const void* a, const void* b) noexcept nogil:
    cdef const SortKey* x = <const SortKey*>a
    cdef const SortKey* y = <const SortKey*>b
    if x.start != y.start:
        return -1 if x.start < y.start else 1
    if x.end != y.end:
        return -1 if x.end < y.end else 1
    if x.idx != y.idx:
        return -1 if x.idx < y.idx else 1
    return 0


cdef bint _validate(Scan* s, Entry* ents, size_t n, const uint64_t* dims,
                    uint64_t data_len) noexcept nogil:
    """safetensors' Metadata::validate over entries sorted by (start, end), then the coverage check."""
    cdef uint64_t cur = 0
    cdef uint64_t numel, nbits, d
    cdef size_t i, k
    cdef Entry* e
    for i in range(n):
        e = &ents[i]
        if e.start != cur or e.end < e.start:
            s.cur = <Py_ssize_t>i
            s.a = cur
            return _fail(s, V_OFFSETS, 0, 0)
        cur = e.end
        numel = 1
        for k in range(e.ndim):
            d = dims[e.dims_at + k]
            if d != 0 and numel > <uint64_t>0xFFFFFFFFFFFFFFFFULL / d:
                s.cur = <Py_ssize_t>i
                return _fail(s, V_OVERFLOW, 0, 0)
            numel *= d
        if numel > <uint64_t>0xFFFFFFFFFFFFFFFFULL / _dt_bits[e.dtype]:
            s.cur = <Py_ssize_t>i
            return _fail(s, V_OVERFLOW, 0, 0)
        nbits = numel * _dt_bits[e.dtype]
        if nbits % 8 != 0:
            s.cur = <Py_ssize_t>i
            s.a = numel
            return _fail(s, V_MISALIGNED, 0, 0)
        if e.end - e.start != nbits // 8:
            s.cur = <Py_ssize_t>i
            s.a = nbits // 8
            return _fail(s, V_SIZE, 0, 0)
    if cur != data_len:
        s.cur = -1
        s.a = cur
        s.b = data_len
        return _fail(s, V_COVER, 0, 0)
    return True


cdef void _free_scan(Scan* s) noexcept nogil:
    free(s.ents)
    free(s.dims)
    free(s.meta)
    s.ents = NULL
    s.dims = NULL
    s.meta = NULL


cdef void memset_scan(Scan* s) noexcept nogil:
    s.p = NULL
    s.n = 0
    s.i = 0
    s.ents = NULL
    s.n_ents = 0
    s.cap_ents = 0
    s.dims = NULL
    s.n_dims = 0
    s.cap_dims = 0
    s.meta = NULL
    s.n_meta = 0
    s.cap_meta = 0
    s.meta_state = 0
    s.last_dtype = -1
    s.cur = -1
    s.err = 0
    s.sub = 0
    s.pos = 0
    s.err_ent = -1
    s.span_at = 0
    s.span_len = 0
    s.span_esc = 0
    s.a = 0
    s.b = 0


cdef str _span_str(const uint8_t* p, size_t at, size_t ln, uint8_t esc):
    cdef uint8_t* buf
    cdef size_t m
    if not esc:
        return PyUnicode_DecodeUTF8(<const char*>(p + at), <Py_ssize_t>ln, NULL)
    buf = <uint8_t*>malloc(ln + 1)
    if buf == NULL:
        raise MemoryError()
    try:
        m = _decode_string(p, at, ln, buf)
        return PyUnicode_DecodeUTF8(<const char*>buf, <Py_ssize_t>m, NULL)
    finally:
        free(buf)


# --------------------------------------------------------------------------------------------------

cdef _check_unchanged(str path, int fd, Py_ssize_t size, uint64_t dev, uint64_t ino, int64_t mtime_s,
                      int64_t mtime_ns):
    """ReadError unless the open file ``fd`` still has the size, inode and mtime it had when mapped."""
    cdef struct_stat st
    cdef int err
    if fstat(fd, &st) != 0:
        err = errno
        raise ReadError(f"{path}: cannot stat the open file: {os.strerror(err)}")
    if st.st_size < size:
        raise ReadError(f"{path}: file was truncated to {st.st_size} bytes after it was opened ({size} bytes mapped)")
    if (st.st_size != size or <uint64_t>st.st_ino != ino or <uint64_t>st.st_dev != dev
            or <int64_t>st.st_mtim.tv_sec != mtime_s or <int64_t>st.st_mtim.tv_nsec != mtime_ns):
        raise ReadError(f"{path}: file changed on disk after it was opened")


cdef class SafetensorsFile:
    """One open safetensors file: validated header, name index and zero-copy views of its bytes.

    The whole file is mapped MAP_PRIVATE with PROT_READ|PROT_WRITE (copy-on-write): the views are
    writable, writes never reach the file. The mapping lives as long as the file object or any view
    handed out, whichever is last; ``close()`` only closes the descriptor and drops the file's own
    reference.
    """

    cdef readonly str path
    cdef readonly Py_ssize_t size
    cdef readonly Py_ssize_t data_offset
    cdef readonly object metadata
    cdef readonly bint closed
    cdef int _fd
    cdef _Mapping _map
    cdef dict _index
    cdef list _names
    cdef Entry* _ents
    cdef uint64_t* _dims
    cdef size_t _n
    cdef uint64_t _st_dev
    cdef uint64_t _st_ino
    cdef int64_t _mtime_s
    cdef int64_t _mtime_ns
    cdef bint _ready

    def __cinit__(self):
        self._fd = -1
        self._ents = NULL
        self._dims = NULL
        self._n = 0
        self.closed = True
        self._ready = False

    def __dealloc__(self):
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1
        free(self._ents)
        free(self._dims)
        self._ents = NULL
        self._dims = NULL

    def __init__(self, path):
        if self._ready:
            raise RuntimeError("SafetensorsFile is already initialised")
        p = os.fspath(path)
        self.path = os.fsdecode(p) if isinstance(p, bytes) else p
        # O_NONBLOCK: a FIFO must not block the open (it is refused below); no effect on files.
        self._fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            self._open()
        except BaseException:
            c_close(self._fd)
            self._fd = -1
            self._map = None
            raise
        self.closed = False
        self._ready = True

    cdef _open(self):
        cdef struct_stat st
        cdef void* addr
        cdef _Mapping m
        cdef uint8_t head[8]
        cdef uint8_t* hbuf
        cdef uint64_t hlen = 0
        cdef int k
        cdef int err = 0
        if fstat(self._fd, &st) != 0:
            err = errno
            raise OSError(err, os.strerror(err), self.path)
        if S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, os.strerror(21), self.path)
        if not S_ISREG(st.st_mode):
            raise HeaderError(f"{self.path}: not a regular file")
        self.size = st.st_size
        self._st_dev = <uint64_t>st.st_dev
        self._st_ino = <uint64_t>st.st_ino
        self._mtime_s = <int64_t>st.st_mtim.tv_sec
        self._mtime_ns = <int64_t>st.st_mtim.tv_nsec
        if self.size < 8:
            raise HeaderError(
                f"{self.path}: file is {self.size} bytes, too short for the 8-byte header length")
        m = _Mapping.__new__(_Mapping)
        addr = MAP_FAILED
        if not _force_readonly:
            addr = mmap(NULL, <size_t>self.size, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_NORESERVE, self._fd, 0)
            err = errno
        if addr == MAP_FAILED and (_force_readonly or err == ENOMEM):
            # strict overcommit refuses a writable private map of a big file: read-only views
            addr = mmap(NULL, <size_t>self.size, PROT_READ, MAP_PRIVATE, self._fd, 0)
            err = errno
            m.readonly = True
        if addr == MAP_FAILED:
            raise ReadError(f"{self.path}: cannot map the file: {os.strerror(err)}")
        m.addr = <char*>addr
        m.length = self.size
        self._map = m
        # Readahead starts off: a fault reads its page, not the next 8 MiB of tensors the caller may
        # never want (another rank's share of the file). Only the header is requested, whole; callers
        # ask for their ranges with advise("willneed") or turn readahead back on ("normal").
        madvise(addr, <size_t>self.size, MADV_RANDOM)
        # The header is read with pread() into a buffer of its own, never by faulting the mapping's
        # pages: on a busy or throttled device the read waits behind every request queued before it
        # (measured: seconds), and a page fault taken while this thread holds the GIL stalls every
        # other thread of the process for that long, however the fault is wrapped.
        # Readahead off for the descriptor too: a read of the header must not pull in the next
        # megabytes of tensors (another rank's share of the file, on shared storage).
        posix_fadvise(self._fd, 0, 0, POSIX_FADV_RANDOM)
        _pread_all(self._fd, head, 8, 0, self.path)
        for k in range(8):
            hlen |= (<uint64_t>head[k]) << (8 * k)
        if hlen > MAX_HEADER:
            # The length is the file's first 8 bytes: never echoed (the file may not be ours).
            raise HeaderError(
                f"{self.path}: header length is over the 100,000,000-byte limit "
                f"(not a safetensors file?)")
        if hlen > <uint64_t>(self.size - 8):
            raise HeaderError(
                f"{self.path}: header length runs past the end of the file "
                f"({self.size} bytes; not a safetensors file?)")
        self.data_offset = 8 + <Py_ssize_t>hlen
        hbuf = <uint8_t*>malloc(<size_t>hlen if hlen else 1)
        if hbuf == NULL:
            raise MemoryError()
        try:
            _pread_all(self._fd, hbuf, <size_t>hlen, 8, self.path)
            self._parse(hbuf, <size_t>hlen)
        finally:
            free(hbuf)

    cdef _parse(self, const uint8_t* hp, size_t hn):
        cdef Scan s
        cdef bint ok
        cdef size_t i, j, n_live
        cdef Entry* e
        cdef Entry* live = NULL
        cdef SortKey* keys = NULL
        cdef bint sorted_ = True
        cdef PyObject* prev
        cdef object pos, name
        cdef uint64_t data_len = <uint64_t>(self.size - self.data_offset)
        memset_scan(&s)
        s.p = hp
        s.n = hn
        s.cur = -1
        try:
            if hn >= NOGIL_HEADER:
                with nogil:
                    ok = _scan_all(&s)
            else:
                ok = _scan_all(&s)
            if not ok:
                self._raise_scan_error(&s)
            # names and index; a repeated name replaces the earlier entry (as in safetensors)
            index = {}
            names = []
            for i in range(s.n_ents):
                e = &s.ents[i]
                name = _span_str(hp, e.name_at, e.name_len, e.name_esc)
                pos = i
                prev = PyDict_SetDefault(index, name, pos)
                if prev != <PyObject*>pos:
                    s.ents[<size_t>(<object>prev)].dead = 1
                    index[name] = pos
                    sorted_ = False
                names.append(name)
            n_live = len(index)
            if sorted_:
                for i in range(1, s.n_ents):
                    if s.ents[i].start < s.ents[i - 1].start or (
                            s.ents[i].start == s.ents[i - 1].start
                            and s.ents[i].end < s.ents[i - 1].end):
                        sorted_ = False
                        break
            if sorted_:
                live = s.ents
                s.ents = NULL
            else:
                keys = <SortKey*>malloc((n_live if n_live else 1) * sizeof(SortKey))
                live = <Entry*>malloc((n_live if n_live else 1) * sizeof(Entry))
                if keys == NULL or live == NULL:
                    raise MemoryError()
                j = 0
                for i in range(s.n_ents):
                    if not s.ents[i].dead:
                        keys[j].start = s.ents[i].start
                        keys[j].end = s.ents[i].end
                        keys[j].idx = i
                        j += 1
                qsort(keys, n_live, sizeof(SortKey), _cmp_keys)
                old_names = names
                names = []
                for j in range(n_live):
                    live[j] = s.ents[keys[j].idx]
                    name = old_names[keys[j].idx]
                    names.append(name)
                    index[name] = j
            self._ents = live
            live = NULL
            self._dims = s.dims
            s.dims = NULL
            self._n = n_live
            if n_live >= 4096:
                with nogil:
                    ok = _validate(&s, self._ents, n_live, self._dims, data_len)
            else:
                ok = _validate(&s, self._ents, n_live, self._dims, data_len)
            if not ok:
                self._raise_validation_error(&s, names)
            for i in range(n_live):
                self._ents[i].start += <uint64_t>self.data_offset
                self._ents[i].end += <uint64_t>self.data_offset
            self._index = index
            self._names = names
            if s.meta_state == 2:
                md = {}
                for i in range(s.n_meta):
                    md[_span_str(hp, s.meta[i].k_at, s.meta[i].k_len, s.meta[i].k_esc)] = \
                        _span_str(hp, s.meta[i].v_at, s.meta[i].v_len, s.meta[i].v_esc)
                self.metadata = md
            else:
                self.metadata = None
        finally:
            free(keys)
            free(live)
            _free_scan(&s)

    cdef _raise_scan_error(self, Scan* s):
        cdef int code = s.err
        cdef Entry* e
        where = ""
        tensor = ""
        if s.err_ent >= 0:
            e = &s.ents[s.err_ent]
            tensor = f"tensor {_span_str(s.p, e.name_at, e.name_len, e.name_esc)!r}"
            where = tensor + ": "
        if code == E_NOMEM:
            raise MemoryError()
        if code == E_UTF8:
            msg = f"header is not valid UTF-8 (byte {8 + s.pos} of the file)"
            where = ""
        elif code == E_JSON:
            msg = (f"header is not valid JSON: {_JSON_REASONS[s.sub]} "
                   f"at byte {8 + s.pos} of the file")
            if where:
                msg = f"{msg} (in {tensor})"
                where = ""
        elif code == E_NOT_OBJECT:
            msg = "header is JSON but not an object"
        elif code == E_META_DUP:
            msg = "header has __metadata__ twice"
        elif code == E_META_TYPE:
            msg = "__metadata__ must be an object mapping strings to strings, or null"
        elif code == E_ENTRY_TYPE:
            msg = "entry must be an object with dtype, shape and data_offsets"
        elif code == E_FIELD_DUP:
            msg = f"field {_FIELDS[s.sub]!r} appears twice"
        elif code == E_FIELD_MISSING:
            msg = f"missing field {_FIELDS[s.sub]!r}"
        elif code == E_DTYPE_TYPE:
            msg = "dtype must be a string naming a safetensors dtype"
        elif code == E_DTYPE_UNKNOWN:
            msg = f"unknown dtype {_span_str(s.p, s.span_at, s.span_len, s.span_esc)!r}"
        elif code == E_SHAPE_TYPE:
            msg = "shape must be a list of non-negative integers"
        elif code == E_OFFSETS_TYPE:
            msg = "data_offsets must be a list of two non-negative integers"
        elif code == E_SEQ_LEN:
            msg = "entry given as a list must be exactly [dtype, shape, data_offsets]"
        else:
            msg = f"invalid header (error {code})"
        raise HeaderError(f"{self.path}: {where}{msg}")

    cdef _raise_validation_error(self, Scan* s, list names):
        cdef int code = s.err
        cdef Entry* e
        if code == V_COVER:
            if s.b > s.a:
                msg = (f"{s.b - s.a} trailing bytes: the data section is {s.b} bytes but the "
                       f"tensors end at {s.a}")
            else:
                msg = (f"file is truncated: the tensors end at byte {s.a} of the data section "
                       f"but it has only {s.b}")
            raise HeaderError(f"{self.path}: {msg}")
        e = &self._ents[s.cur]
        where = f"tensor {names[s.cur]!r}: "
        dt = _DT_NAMES[e.dtype]
        shape = [self._dims[e.dims_at + k] for k in range(e.ndim)]
        if code == V_OFFSETS:
            if e.end < e.start:
                msg = f"data_offsets [{e.start}, {e.end}] end before they start"
            elif s.cur == 0:
                msg = (f"data_offsets [{e.start}, {e.end}] start at {e.start}: the first tensor "
                       f"must start at 0")
            elif e.start > s.a:
                msg = (f"data_offsets [{e.start}, {e.end}] leave a gap: the previous tensor "
                       f"ends at {s.a}")
            else:
                msg = (f"data_offsets [{e.start}, {e.end}] overlap the previous tensor, which "
                       f"ends at {s.a}")
        elif code == V_OVERFLOW:
            msg = f"shape {shape} of {dt} overflows a 64-bit byte count"
        elif code == V_MISALIGNED:
            msg = f"{s.a} elements of {dt} do not fill whole bytes"
        elif code == V_SIZE:
            msg = (f"data_offsets [{e.start}, {e.end}] hold {e.end - e.start} bytes but shape "
                   f"{shape} of {dt} needs {s.a}")
        else:
            msg = f"invalid header (error {code})"
        raise HeaderError(f"{self.path}: {where}{msg}")

    # ---- queries -----------------------------------------------------------------------------

    def __len__(self):
        return <Py_ssize_t>self._n

    def __contains__(self, name):
        return name in self._index

    def __iter__(self):
        return iter(self._names)

    def keys(self):
        """Tensor names in the order of their bytes in the file."""
        return list(self._names)

    cdef size_t _find(self, name) except? 0:
        cdef object i = self._index.get(name) if self._index is not None else None
        if i is None:
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}")
        return <size_t>i

    def entry(self, name):
        """(dtype, shape, start, end): start/end are absolute file offsets of the tensor's bytes."""
        cdef size_t i = self._find(name)
        cdef Entry* e = &self._ents[i]
        cdef uint32_t k
        shape = tuple([self._dims[e.dims_at + k] for k in range(e.ndim)])
        return (_DT_NAMES[e.dtype], shape, e.start, e.end)

    cdef _view(self, uint64_t start, uint64_t end):
        if self.closed:
            raise ValueError(f"{self.path}: file is closed")
        mv = PyMemoryView_FromObject(self._map)
        return mv[start:end]

    def buffer(self, name):
        """The tensor's bytes: a 1-D uint8 memoryview over the mapping, writable (copy-on-write)."""
        cdef size_t i = self._find(name)
        return self._view(self._ents[i].start, self._ents[i].end)

    def span(self, Py_ssize_t start, Py_ssize_t end):
        """Raw bytes [start, end) of the file (absolute offsets), as buffer() hands them out."""
        if start < 0 or end < start:
            raise ValueError(f"{self.path}: invalid byte range [{start}, {end})")
        if end > self.size:
            raise ReadError(
                f"{self.path}: byte range [{start}, {end}) runs past the end of the file "
                f"({self.size} bytes)")
        return self._view(<uint64_t>start, <uint64_t>end)

    def check_unchanged(self):
        """Raise ReadError if the open file changed on disk since open (size, inode, mtime)."""
        if self.closed:
            raise ValueError(f"{self.path}: file is closed")
        _check_unchanged(self.path, self._fd, self.size, self._st_dev, self._st_ino, self._mtime_s, self._mtime_ns)

    def advise(self, advice, Py_ssize_t start=0, end=None):
        """madvise() over [start, end) of the mapping (widened to whole pages).

        advice: "normal", "sequential", "random", "willneed" or "dontneed". "dontneed" also
        drops copy-on-write pages written through views of that range.
        """
        cdef int adv
        cdef Py_ssize_t stop = self.size if end is None else <Py_ssize_t>end
        cdef size_t a0, ln
        cdef int err, rc
        cdef char* addr
        if advice == "normal":
            adv = MADV_NORMAL
        elif advice == "sequential":
            adv = MADV_SEQUENTIAL
        elif advice == "random":
            adv = MADV_RANDOM
        elif advice == "willneed":
            adv = MADV_WILLNEED
        elif advice == "dontneed":
            adv = MADV_DONTNEED
        else:
            raise ValueError(
                f"unknown advice {advice!r}: use normal, sequential, random, willneed or dontneed")
        if start < 0 or stop < start or stop > self.size:
            raise ValueError(f"{self.path}: invalid byte range [{start}, {stop})")
        if self.closed:
            raise ValueError(f"{self.path}: file is closed")
        if stop == start:
            return
        a0 = <size_t>start & ~(_PAGE - 1)
        addr = self._map.addr  # the mapping outlives this call: self holds it
        if adv == MADV_WILLNEED:
            # Without the GIL: under a throttled device queueing the reads blocks, and the caller's
            # other threads (the event loop, planning) must keep running meanwhile.
            with nogil:
                err = _willneed(addr, <uint64_t>start, <uint64_t>stop)
            if err:
                raise OSError(err, os.strerror(err), self.path)
            return
        ln = <size_t>stop - a0
        with nogil:
            rc = madvise(addr + a0, ln, adv)
            err = errno
        if rc != 0:
            raise OSError(err, os.strerror(err), self.path)

    def copy_box(self, name, str dtype, tuple chunk_shape, tuple src_offsets, tuple lengths,
                 size_t dst, tuple dst_offsets, tuple dst_strides, tuple dst_shape, bint willneed=False):
        """Copy the box (src_offsets, lengths) of tensor ``name`` to a strided host destination.

        The reader's fast path: one call per box, no Python object per view. ``dst`` is the address
        of element 0 of a tensor of ``dst_shape`` and ``dst_strides`` (elements); the box lands at
        ``dst_offsets`` there. The stored tensor must be ``dtype`` with shape ``chunk_shape``
        (CheckpointFormatError naming the file and tensor otherwise); both boxes must lie inside
        their tensors (ValueError: nothing is copied). ``willneed`` madvises the box's byte span
        first. The copy runs as ``guarded_copy``'s: without the GIL, a SIGBUS raises ReadError and
        leaves partial bytes in the box. The mapping stays referenced for the copy: a concurrent
        ``close()`` cannot unmap it underneath. Returns the bytes copied.
        """
        cdef size_t i = self._find(name)
        cdef Entry* e = &self._ents[i]
        cdef int k
        if self.closed or self._map is None:
            raise ValueError(f"{self.path}: file is closed")
        stored = _DT_NAMES[e.dtype]
        if stored != dtype or <int>e.ndim != len(chunk_shape) or _dt_bits[e.dtype] % 8 != 0 or any(
                <int64_t>self._dims[e.dims_at + k] != chunk_shape[k] for k in range(e.ndim)):
            shape = [self._dims[e.dims_at + k] for k in range(e.ndim)]
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is {stored} {shape}, "
                                        f"the metadata says {dtype} {list(chunk_shape)}")
        return _copy_box(self.path, self._map, self._fd, e.start, _dt_bits[e.dtype] // 8, name, chunk_shape,
                         src_offsets, lengths, dst, dst_offsets, dst_strides, dst_shape, willneed)

    def willneed_tensors(self, names, size_t merge_gap=1 << 20):
        """madvise(WILLNEED) the bytes of the named tensors: sorted, ranges closer than ``merge_gap``
        requested as one, in 1 MiB pieces without the GIL (see ``advise``). The prefetch of a reader
        in one call, with no Python object per tensor. Returns the bytes requested (gaps included).
        An unknown name raises TensorNotFoundError before anything is requested."""
        cdef Py_ssize_t n = len(names)
        cdef Py_ssize_t k
        cdef size_t i
        cdef SortKey* r
        cdef uint64_t lo, hi, total = 0
        cdef _Mapping m = self._map
        if self.closed or m is None:
            raise ValueError(f"{self.path}: file is closed")
        if n == 0:
            return 0
        r = <SortKey*>malloc(<size_t>n * sizeof(SortKey))
        if r == NULL:
            raise MemoryError()
        try:
            k = 0
            for name in names:
                i = self._find(name)
                r[k].start = self._ents[i].start
                r[k].end = self._ents[i].end
                r[k].idx = <size_t>k
                k += 1
            with nogil:
                qsort(r, <size_t>n, sizeof(SortKey), _cmp_keys)
                lo = r[0].start
                hi = r[0].end
                for k in range(1, n + 1):
                    if k < n and r[k].start <= hi + merge_gap:
                        if r[k].end > hi:
                            hi = r[k].end
                        continue
                    if hi > lo:
                        total += hi - lo
                        _willneed(m.addr, lo, hi)
                    if k < n:
                        lo = r[k].start
                        hi = r[k].end
        finally:
            free(r)
        return total

    def close(self):
        """Close the descriptor. Views handed out stay valid: the mapping goes with the last one."""
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1
        self._map = None
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def _mapping(self):
        """The mapping owner (None once closed); for tests and diagnostics."""
        return self._map

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<SafetensorsFile {self.path!r} {self._n} tensors, {state}>"




# --------------------------------------------------------------------------------------------------
# Raw byte ranges of any file (torch.distributed.checkpoint's .distcp files): no header to parse.

cdef class RawFile:
    """One open file of any layout, mapped whole; hands out zero-copy views of byte ranges.

    The mapping is made as SafetensorsFile makes it (MAP_PRIVATE|MAP_NORESERVE, copy-on-write,
    read-only fallback under strict overcommit, readahead off) and owned by the same ``_Mapping``:
    views outlive ``close()`` and eviction from a FileCache. Nothing is validated but the ranges
    asked for: the caller knows what the bytes mean.
    """
    cdef readonly str path
    cdef readonly Py_ssize_t size
    cdef readonly bint closed
    cdef int _fd
    cdef _Mapping _map
    cdef uint64_t _st_dev
    cdef uint64_t _st_ino
    cdef int64_t _mtime_s
    cdef int64_t _mtime_ns

    def __cinit__(self):
        self._fd = -1
        self.closed = True

    def __dealloc__(self):
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1

    def __init__(self, path):
        cdef struct_stat st
        cdef void* addr = MAP_FAILED
        cdef int err = 0
        cdef _Mapping m
        if self.path is not None:
            raise RuntimeError("RawFile is already initialised")
        p = os.fspath(path)
        self.path = os.fsdecode(p) if isinstance(p, bytes) else p
        self._fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if fstat(self._fd, &st) != 0:
                err = errno
                raise OSError(err, os.strerror(err), self.path)
            if S_ISDIR(st.st_mode):
                raise IsADirectoryError(21, os.strerror(21), self.path)
            if not S_ISREG(st.st_mode):
                raise ReadError(f"{self.path}: not a regular file")
            self.size = st.st_size
            self._st_dev = <uint64_t>st.st_dev
            self._st_ino = <uint64_t>st.st_ino
            self._mtime_s = <int64_t>st.st_mtim.tv_sec
            self._mtime_ns = <int64_t>st.st_mtim.tv_nsec
            m = _Mapping.__new__(_Mapping)
            if self.size > 0:
                if not _force_readonly:
                    addr = mmap(NULL, <size_t>self.size, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_NORESERVE, self._fd, 0)
                    err = errno
                if addr == MAP_FAILED and (_force_readonly or err == ENOMEM):
                    addr = mmap(NULL, <size_t>self.size, PROT_READ, MAP_PRIVATE, self._fd, 0)
                    err = errno
                    m.readonly = True
                if addr == MAP_FAILED:
                    raise ReadError(f"{self.path}: cannot map the file: {os.strerror(err)}")
                m.addr = <char*>addr
                m.length = self.size
                madvise(addr, <size_t>self.size, MADV_RANDOM)
            self._map = m
        except BaseException:
            c_close(self._fd)
            self._fd = -1
            self._map = None
            raise
        self.closed = False

    def view(self, Py_ssize_t offset, Py_ssize_t length):
        """Bytes [offset, offset + length) as a 1-D uint8 memoryview over the mapping, zero-copy.

        Raises ValueError for a negative offset or length or a closed file, ReadError when the
        range runs past the end of the file (naming the path and the range)."""
        if offset < 0 or length < 0:
            raise ValueError(f"{self.path}: invalid byte range at {offset} of length {length}")
        if self.closed:
            raise ValueError(f"{self.path}: file is closed")
        if offset + length > self.size:
            raise ReadError(
                f"{self.path}: byte range [{offset}, {offset + length}) runs past the end of the "
                f"file ({self.size} bytes)")
        if length == 0:
            return memoryview(b"")
        mv = PyMemoryView_FromObject(self._map)
        return mv[offset:offset + length]

    def check_unchanged(self):
        """Raise ReadError if the open file changed on disk since open (size, inode, mtime)."""
        if self.closed:
            raise ValueError(f"{self.path}: file is closed")
        _check_unchanged(self.path, self._fd, self.size, self._st_dev, self._st_ino, self._mtime_s, self._mtime_ns)

    def copy_box(self, name, Py_ssize_t start, size_t itemsize, tuple chunk_shape, tuple src_offsets,
                 tuple lengths, size_t dst, tuple dst_offsets, tuple dst_strides, tuple dst_shape,
                 bint willneed=False):
        """``SafetensorsFile.copy_box`` for a C-contiguous chunk of ``chunk_shape`` elements of ``itemsize``
        bytes stored at byte ``start`` of this file (the layout's reader knows where; ``name`` only
        names it in errors). ReadError if those bytes run past the end of the file."""
        cdef Py_ssize_t nbytes = <Py_ssize_t>itemsize
        if self.closed or self._map is None:
            raise ValueError(f"{self.path}: file is closed")
        for x in chunk_shape:
            nbytes *= <Py_ssize_t>x
        if start < 0 or itemsize == 0 or nbytes < 0 or start + nbytes > self.size:
            raise ReadError(f"{self.path}: item {name!r} of {list(chunk_shape)} x {itemsize} bytes at {start} "
                            f"runs past the end of the file ({self.size} bytes)")
        return _copy_box(self.path, self._map, self._fd, <uint64_t>start, itemsize, name, chunk_shape,
                         src_offsets, lengths, dst, dst_offsets, dst_strides, dst_shape, willneed)

    def willneed(self, Py_ssize_t start, Py_ssize_t end):
        """Ask the kernel for bytes [start, end) now (MADV_WILLNEED in 1 MiB pieces, no GIL).

        The range is clipped to the file; a hint only: errors are ignored."""
        cdef char* addr
        if self.closed or self.size == 0:
            return
        if start < 0:
            start = 0
        if end > self.size:
            end = self.size
        if end <= start:
            return
        addr = self._map.addr
        with nogil:
            _willneed(addr, <uint64_t>start, <uint64_t>end)

    def close(self):
        """Close the descriptor. Views handed out stay valid: the mapping goes with the last one."""
        if self._fd >= 0:
            c_close(self._fd)
            self._fd = -1
        self._map = None
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return f"<RawFile {self.path!r} {self.size} bytes, {'closed' if self.closed else 'open'}>"


# --------------------------------------------------------------------------------------------------

cdef class FileCache:
    """LRU of open SafetensorsFile objects, keyed by the path string as given (one per load).

    A hit costs a dict lookup and a move to the front, no system call. An evicted file is closed;
    views already handed out of it stay valid.
    """

    cdef object _files
    cdef object _opener
    cdef readonly int capacity
    cdef readonly Py_ssize_t opens
    cdef readonly Py_ssize_t hits

    def __init__(self, int capacity=8, opener=None):
        if capacity < 1:
            raise ValueError(f"FileCache capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        # opener(path) makes the cached object (SafetensorsFile by default; RawFile, or a wrapper of
        # one, for other layouts): anything with ``closed`` and ``close()``.
        self._opener = opener
        self._files = OrderedDict()
        self.opens = 0
        self.hits = 0

    def get(self, path):
        cdef object f
        key = path if type(path) is str else os.fspath(path)
        if type(key) is bytes:
            key = os.fsdecode(key)
        obj = self._files.get(key)
        if obj is not None:
            f = obj
            if not f.closed:
                self._files.move_to_end(key)
                self.hits += 1
                return f
            del self._files[key]
        f = SafetensorsFile(key) if self._opener is None else self._opener(key)
        self.opens += 1
        obj = self._files.get(key)
        if obj is not None and not obj.closed:
            # another thread opened it meanwhile: keep one
            f.close()
            self._files.move_to_end(key)
            return obj
        self._files[key] = f
        while len(self._files) > self.capacity:
            _, old = self._files.popitem(last=False)
            old.close()
        return f

    def __len__(self):
        return len(self._files)

    def __contains__(self, path):
        key = path if type(path) is str else os.fspath(path)
        return key in self._files

    def close(self):
        """Close every cached file; views handed out stay valid."""
        while self._files:
            _, f = self._files.popitem(last=False)
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def read_header(path):
    """{name: (dtype, shape, start, end)} in file order, plus "__metadata__" (dict or None).

    start/end are absolute file offsets. Validates the whole file like SafetensorsFile."""
    with SafetensorsFile(path) as f:
        out = {name: f.entry(name) for name in f.keys()}
        out["__metadata__"] = f.metadata
    return out


# --------------------------------------------------------------------------------------------------
# Guarded copies: a fault on a mapped page (the file truncated underneath, a storage error) becomes a
# ReadError for that copy instead of killing the process with SIGBUS. The C side is in _guard.h.

def guarded_copy(size_t dst, dst_strides, size_t src, src_strides, shape, size_t itemsize, source):
    """Copy a strided box of ``shape`` from address ``src`` to address ``dst`` (strides in bytes).

    The copy runs without the GIL, with this thread's SIGBUS guard armed: a page fault that the
    kernel cannot serve (``source``'s file truncated or its storage failing mid-copy) raises
    ``ReadError`` naming ``source``; the destination then holds partial bytes. Addresses come from
    buffers the caller keeps alive (torch tensors over a mapping and a destination); nothing here
    checks them — this is the reader's internal primitive, not a public API.
    """
    cdef int64_t ds[64]
    cdef int64_t ss[64]
    cdef int64_t sh[64]
    cdef int n = len(shape)
    cdef int k, rc
    cdef void* fault = NULL
    if n > 64 or len(dst_strides) != n or len(src_strides) != n:
        raise ValueError("guarded_copy: strides and shape must have the same length (at most 64)")
    for k in range(n):
        ds[k] = dst_strides[k]
        ss[k] = src_strides[k]
        sh[k] = shape[k]
    with nogil:
        rc = pl_copy_nd(<char*>dst, ds, <const char*>src, ss, sh, n, itemsize, &fault)
    _guarded_result(rc, source, "")


cdef int _guarded_result(int rc, source, str what) except -1:
    """ReadError for a pl_copy_nd() that failed (-1: a SIGBUS in the copy; else: no guard), naming
    ``source`` and, when given, `` tensor 'name'``."""
    if rc == -1:
        raise ReadError(
            f"{source}: bus error while copying{what} from the mapped file (it was truncated or its "
            f"storage failed during the read)")
    if rc != 0:
        raise ReadError(f"{source}: cannot install the SIGBUS guard for a mapped copy")
    return 0


cdef object _copy_box(str path, _Mapping m, int fd, uint64_t start, size_t isz, name, tuple chunk_shape,
                      tuple src_offsets, tuple lengths, size_t dst, tuple dst_offsets, tuple dst_strides,
                      tuple dst_shape, bint willneed):
    """``copy_box`` of a C-contiguous chunk of ``chunk_shape`` stored at ``start`` of mapping ``m`` (its file
    open as ``fd``), after the caller checked that the chunk really is that. Returns the bytes copied."""
    cdef int n = len(lengths)
    cdef int k, rc
    cdef int64_t ds[64]
    cdef int64_t ss[64]
    cdef int64_t sh[64]
    cdef int64_t o, d, ln, dim, stride
    cdef size_t nbytes
    cdef int64_t first = 0, last = 0
    cdef char* base
    cdef char* out = <char*>dst
    cdef void* fault = NULL
    if n > 64 or len(src_offsets) != n or len(chunk_shape) != n or len(dst_offsets) != n \
            or len(dst_strides) != n or len(dst_shape) != n:
        raise ValueError(f"{path}: tensor {name!r}: box of {n} dims into a {len(chunk_shape)}-dim chunk "
                         f"and a {len(dst_shape)}-dim destination")
    base = m.addr + start
    nbytes = isz
    stride = <int64_t>isz
    for k in range(n - 1, -1, -1):
        o = src_offsets[k]
        ln = lengths[k]
        d = dst_offsets[k]
        dim = chunk_shape[k]
        if o < 0 or ln < 0 or d < 0 or o > dim - ln or d > <int64_t>dst_shape[k] - ln:
            raise ValueError(f"{path}: tensor {name!r}: box at {list(src_offsets)} of {list(lengths)} "
                             f"does not fit chunk {list(chunk_shape)} or destination {list(dst_shape)} "
                             f"at {list(dst_offsets)}")
        ss[k] = stride
        sh[k] = ln
        ds[k] = <int64_t>dst_strides[k] * <int64_t>isz
        base += o * stride
        out += d * ds[k]
        first += o * stride
        last += (o + ln - 1) * stride
        nbytes *= <size_t>ln
        stride *= dim
    if nbytes == 0:
        return 0
    if nbytes >= _PREAD_MIN and fd >= 0 and _c_order(ds, sh, n, isz) and _c_order(ss, sh, n, isz):
        # One contiguous range into one contiguous region: pread() it straight into the destination.
        # Still one copy per byte, but no page-table entries to fault in and tear down, and no shared
        # page mapcounts for the ranks of one host to bounce between them (measured: 4 processes
        # copying 257 MiB each out of a hot page cache, 0.15-0.49 s through mappings, 0.05-0.08 s
        # with pread). A short read (the file cut meanwhile) or an I/O error raises ReadError.
        _pread_all(fd, <uint8_t*>out, nbytes, start + <uint64_t>first, path, f"tensor {name!r}")
        return nbytes
    if willneed:
        with nogil:
            _willneed(m.addr, start + first, start + last + isz)
    with nogil:
        rc = pl_copy_nd(out, ds, base, ss, sh, n, isz, &fault)
    _guarded_result(rc, path, f" tensor {name!r}")
    return nbytes
