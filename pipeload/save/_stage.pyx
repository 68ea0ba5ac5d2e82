# cython: language_level=3, boundscheck=False, wraparound=False
"""The background save's host snapshot, compiled: one call copies every host tensor a rank owns.

A trainer's state dict has thousands of small tensors; in Python each costs several torch calls and a
``memmove`` call (~10 us before a byte moves), which on a 64 MiB rank was as much as the copying. Here
the checks are C calls into the tensors and the copy is one loop over addresses without the GIL, so
the trainer's other threads run while it copies.
"""

from libc.stdint cimport int64_t, uintptr_t
from libc.stdlib cimport free, malloc

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    /* Copy with non-temporal stores: the staged bytes are read back only by the writer, long after,
       so they need not pass through the cache, and a streaming store skips reading each destination
       line before writing it (a third of the memory traffic of a cached copy). */
    static void stage_copy(char* dst, const char* src, size_t n) {
        size_t lead = (size_t)(-(uintptr_t)dst & 15);
        if (n < 256 || lead >= n) { memcpy(dst, src, n); return; }
        memcpy(dst, src, lead);
        dst += lead; src += lead; n -= lead;
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i*)src), b = _mm_loadu_si128((const __m128i*)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i*)(src + 32)), d = _mm_loadu_si128((const __m128i*)(src + 48));
            _mm_stream_si128((__m128i*)dst, a); _mm_stream_si128((__m128i*)(dst + 16), b);
            _mm_stream_si128((__m128i*)(dst + 32), c); _mm_stream_si128((__m128i*)(dst + 48), d);
            dst += 64; src += 64; n -= 64;
        }
        memcpy(dst, src, n);
    }
    static void stage_fence(void) { _mm_sfence(); }
    #else
    static void stage_copy(char* dst, const char* src, size_t n) { memcpy(dst, src, n); }
    static void stage_fence(void) {}
    #endif
    """
    void stage_copy(char* dst, const char* src, size_t n) nogil
    void stage_fence() nogil


def gather_host(list items, const int64_t[:] index, const int64_t[:] offset, const int64_t[:] length,
                uintptr_t base):
    """Copy ``items[index[i]][3]`` (a tensor of ``length[i]`` bytes) to ``base + offset[i]`` for each ``i``.

    Only tensors whose memory holds their values as laid out are copied here: a host tensor, C-contiguous,
    neither a conjugate nor a negative view, of exactly ``length[i]`` bytes. The positions ``i`` of the
    others are returned, for the caller to copy with torch (which raises on a wrong size or device).
    """
    cdef Py_ssize_t n = index.shape[0], i
    cdef uintptr_t* src = <uintptr_t*>malloc(max(n, 1) * sizeof(uintptr_t))
    cdef uintptr_t p
    cdef list slow = []
    if src == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            t = (<tuple>items[index[i]])[3]
            p = 0
            if (t.is_cpu and t.nbytes == length[i] and t.is_contiguous() and not t.is_conj()
                    and not t.is_neg()):
                p = t.data_ptr()
            src[i] = p
            if p == 0:
                slow.append(i)
        with nogil:
            for i in range(n):
                if src[i] != 0:
                    stage_copy(<char*>(base + <uintptr_t>offset[i]), <const char*>src[i], <size_t>length[i])
            stage_fence()
    finally:
        free(src)
    return slow
