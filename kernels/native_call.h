/*
 * One native experts call's state and work split, shared by cpu_experts.c (bf16) and cpu_quant.c
 * (packed): a lock that lets one call at a time use the library's job and scratch memory, the
 * scratch itself (grown on demand, never shrunk), and how many weight rows make one work item.
 * Everything here is static, so each library that includes it has a lock and a scratch of its own.
 */
#ifndef MOEDESK_NATIVE_CALL_H
#define MOEDESK_NATIVE_CALL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static pthread_mutex_t call = PTHREAD_MUTEX_INITIALIZER; /* one call at a time: the job and scratch */
static void *scratch_mem; /* owned by whoever holds `call` */
static size_t scratch_bytes;

/* A child forked while another thread held the lock must not inherit it held. */
static void call_after_fork_child(void) { pthread_mutex_init(&call, NULL); }
__attribute__((constructor)) static void install_call_fork_handler(void) {
    pthread_atfork(NULL, NULL, call_after_fork_child);
}

static void *scratch(size_t bytes) {
    if (scratch_bytes < bytes) {
        free(scratch_mem);
        bytes = (size_t)round_up((int64_t)bytes + (int64_t)(bytes >> 2), 4096);
        scratch_mem = aligned_alloc(64, bytes);
        scratch_bytes = scratch_mem ? bytes : 0;
    }
    return scratch_mem;
}

/* The end of a call: its scratch is kept for the next, unless the call was unusually large. */
static void end_call(void) {
    if (scratch_bytes > ((size_t)64 << 20)) {
        free(scratch_mem);
        scratch_mem = NULL;
        scratch_bytes = 0;
    }
    pthread_mutex_unlock(&call);
}

/* n parts of sizes[i] bytes laid out in the scratch, each on a 64-byte line of its own: at[i] receives
 * part i's offset. NULL when the memory could not be had. */
static char *scratch_parts(const size_t *sizes, int n, size_t *at) {
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        at[i] = bytes;
        bytes += (size_t)round_up((int64_t)sizes[i], 64);
    }
    return scratch(bytes);
}

/* Rows per item: about item_bytes of weights, a multiple of `align`, and at least 4 items per thread
 * where the rows allow it, so that dynamic hand-out can even out the threads' finish. */
static int64_t block_rows(int64_t rows, int64_t bytes_per_row, int64_t align, int64_t groups, int threads,
                          int64_t item_bytes) {
    int64_t b = item_bytes / bytes_per_row / align * align;
    if (b < align) b = align;
    while (b > align && groups * ((rows + b - 1) / b) < 4 * (int64_t)threads) b -= align;
    return b < round_up(rows, align) ? b : round_up(rows, align);
}

/*
 * Item hand-out with the last round of phase-2 blocks in quarters: a call ends when its slowest thread finishes its
 * last item, and short last items leave the others less time idle. Items [0, n1) are phase 1's; [n1, coarse) one
 * phase-2 block each; from `coarse` on, each remaining block is four items. last_round: how many blocks go out in
 * quarters (one per thread, at most all of phase 2's); the call hands out blocks + 3 * last_round items.
 */
static inline int64_t last_round(int64_t phase2_blocks, int threads) {
    return phase2_blocks < threads ? phase2_blocks : threads;
}

/* Phase-2 item i's block (i >= n1), phase 2's blocks counted from 0. */
static inline int64_t phase2_block(int64_t i, int64_t n1, int64_t coarse) {
    return i < coarse ? i - n1 : coarse - n1 + (i - coarse) / 4;
}

/* Item i's rows of its phase-2 block [*h0, *h1): all of them, or for a quarter its part, in multiples of `align`
 * (an empty range where the block is too short to have four). */
static inline void quarter_rows(int64_t i, int64_t coarse, int64_t align, int64_t *h0, int64_t *h1) {
    if (i < coarse) return;
    const int64_t quarter = round_up((*h1 - *h0 + 3) / 4, align);
    *h0 += (i - coarse) % 4 * quarter;
    if (*h1 > *h0 + quarter) *h1 = *h0 + quarter;
}

#endif
