/*
 * The host's side of kernels/host_handoff.py: wait, without holding Python's GIL, until the GPU has
 * written a step's number into a flag in pinned memory.
 */
#include <sched.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

int moe_handoff_supported(void) { return 1; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 0 once *flag == value, 1 when timeout_ns passed first. A layer's handoff takes tens of microseconds, so
 * the first 2 ms spin; after that the wait is a long one (a stalled GPU, a debugger) and yields the core. */
int moe_wait_flag(const int32_t *flag, int32_t value, int64_t timeout_ns) {
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == value) return 0;
    const int64_t start = now_ns();
    for (uint64_t i = 1;; i++) {
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == value) return 0;
        RELAX();
        if ((i & 127) == 0) {
            const int64_t waited = now_ns() - start;
            if (waited > timeout_ns) return 1;
            if (waited > 2000000) sched_yield();
        }
    }
}
