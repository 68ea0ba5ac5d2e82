/* Copies out of a file mapping that survive the file changing underneath.
 *
 * Touching a mapped page whose file was truncated (or whose storage failed: an NFS error, a bad
 * sector) raises SIGBUS, whose default action kills the process. pl_copy_nd() runs a strided box
 * copy with a SIGBUS handler armed for the calling thread only: a fault inside it jumps back
 * (siglongjmp) and the copy returns -1 with the faulting address; the caller turns that into an
 * ordinary error for that one read.
 *
 * - The handler is installed once per process (pthread_once) and chains to whatever handler was
 *   there before (Python's faulthandler, a debugger's, the default action) for every fault that does
 *   not happen inside a guarded copy, on any thread.
 * - The jump buffer is thread-local: a fault is delivered to the thread that touched the page, so
 *   concurrent guarded copies on several threads each get their own fault back.
 * - Only plain loads and memcpy run between sigsetjmp and a possible siglongjmp: no locks, no
 *   allocation, no Python — jumping out of them leaves nothing half-done except the destination
 *   bytes, which the caller must treat as garbage.
 */
#ifndef PIPELOAD_GUARD_H
#define PIPELOAD_GUARD_H

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

static __thread sigjmp_buf *pl_jump = NULL;
static __thread void *volatile pl_fault_addr = NULL;
static struct sigaction pl_previous;
static int pl_installed = 0;
static pthread_once_t pl_once = PTHREAD_ONCE_INIT;

static void pl_on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jump = pl_jump;
    if (jump != NULL) {
        pl_jump = NULL;
        pl_fault_addr = info ? info->si_addr : NULL;
        siglongjmp(*jump, 1);
    }
    /* Not ours: hand it to the previous handler, as if we were not here. */
    if (pl_previous.sa_flags & SA_SIGINFO) {
        if (pl_previous.sa_sigaction != NULL) {
            pl_previous.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (pl_previous.sa_handler == SIG_IGN) {
        return;
    } else if (pl_previous.sa_handler != SIG_DFL) {
        pl_previous.sa_handler(sig);
        return;
    }
    /* Default action: restore it; returning re-executes the faulting access, which then kills the
     * process exactly as it would have without this handler (a raise() covers a sent signal). */
    sigaction(sig, &pl_previous, NULL);
    if (info == NULL || info->si_code <= 0) {
        raise(sig);
    }
}

static void pl_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = pl_on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &pl_previous) == 0) {
        pl_installed = 1;
    }
}

/* Whether the SIGBUS handler is in place (installs it on first call). */
static int pl_guard_ready(void) {
    pthread_once(&pl_once, pl_install);
    return pl_installed;
}

static void pl_copy_rec(char *dst, const int64_t *dstr, const char *src, const int64_t *sstr,
                        const int64_t *shape, int ndim, size_t itemsize) {
    int64_t i;
    if (ndim == 0) {
        memcpy(dst, src, itemsize);
        return;
    }
    if (ndim == 1) {
        if (dstr[0] == (int64_t)itemsize && sstr[0] == (int64_t)itemsize) {
            memcpy(dst, src, (size_t)shape[0] * itemsize);
            return;
        }
        for (i = 0; i < shape[0]; i++) {
            memcpy(dst + i * dstr[0], src + i * sstr[0], itemsize);
        }
        return;
    }
    for (i = 0; i < shape[0]; i++) {
        pl_copy_rec(dst + i * dstr[0], dstr + 1, src + i * sstr[0], sstr + 1, shape + 1, ndim - 1,
                    itemsize);
    }
}

/* Copy the box ``shape`` (elements; ``ndim`` <= 64) from ``src`` to ``dst``, both strided in bytes.
 * Adjacent dims that are contiguous on both sides are merged first, so a contiguous box is one
 * memcpy. Returns 0, -1 after a SIGBUS (``*fault`` = the faulting address; ``dst`` partly written),
 * or -2 when the guard could not be installed or the box has too many dims (nothing copied). */
static int pl_copy_nd(char *dst, const int64_t *dstr, const char *src, const int64_t *sstr,
                      const int64_t *shape, int ndim, size_t itemsize, void **fault) {
    int64_t ds[64], ss[64], sh[64];
    int n = 0, k;
    sigjmp_buf jump;
    if (ndim > 64 || !pl_guard_ready()) {
        return -2;
    }
    for (k = 0; k < ndim; k++) {
        if (shape[k] == 0) {
            return 0;
        }
        if (shape[k] == 1) {
            continue;
        }
        if (n > 0 && ds[n - 1] == dstr[k] * shape[k] && ss[n - 1] == sstr[k] * shape[k]) {
            sh[n - 1] *= shape[k];
            ds[n - 1] = dstr[k];
            ss[n - 1] = sstr[k];
            continue;
        }
        ds[n] = dstr[k];
        ss[n] = sstr[k];
        sh[n] = shape[k];
        n++;
    }
    if (sigsetjmp(jump, 1) != 0) {
        *fault = pl_fault_addr;
        return -1;
    }
    pl_jump = &jump;
    pl_copy_rec(dst, ds, src, ss, sh, n, itemsize);
    pl_jump = NULL;
    return 0;
}

#endif
