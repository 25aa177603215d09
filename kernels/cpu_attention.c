/*
 * A decode step's attention on a CPU load (kernels/cpu_attention.py): each row's one query token over that
 * row's cache in place. torch's CPU attention splits a step over rows and key/value heads only, so one
 * sequence's step reads its whole cache with as many threads as the model has key/value heads, and it runs on
 * torch's threads, which a CPU load keeps at one beside the native kernels' pool (engine/generation/runner.py).
 * Here the keys are split into pieces the pool's threads take (phase 1: a piece's scores, softmax maximum and
 * sum and weighted values, for every query head), then each row and head's pieces are merged by their maxima
 * (phase 2). Float32 throughout; needs AVX2 and FMA, head_dim a multiple of 8.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>

static void pool_set_spin_us(int64_t us) __attribute__((unused)); /* the pool borrowed spins as its owner sets */
#include "native_exp.h"
#include "native_pool.h"

#define MAX_HEADS 128  /* query heads, at most (the Python side checks) */
#define MAX_PIECE 128  /* keys a work item, at most: its scores stay in L1 */
#define MIN_PIECE 16

typedef void (*run_fn)(pool_fn, void *, int, int);
static run_fn pool_runner = pool_run; /* cpu_experts' moe_pool_run once ca_use_pool was called */
static int (*pool_threads)(void) = pool_get_threads;

typedef struct {
    const float *q, *k, *v;  /* q [B, H * G, D]; k, v [rows, length, H, D] */
    const int64_t *rows, *lengths;
    float *out, *part;       /* out [B, H * G, D]; part [B, pieces, H * G, D + 2] */
    int64_t B, H, G, D, pieces, piece, row_stride;
    float scale;
    _Atomic int64_t next;
} Job;

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Phase 1, item (b, p): keys [p * piece, min(length, (p + 1) * piece)) of row b, every head: a key's heads are
 * one contiguous row of the cache, read in order (a head alone would stride across pages). */
static void piece_of(const Job *j, int64_t item) {
    const int64_t p = item % j->pieces, b = item / j->pieces;
    const int64_t Q = j->H * j->G, G = j->G, D = j->D, HD = j->H * D;
    float *part = j->part + item * Q * (D + 2);
    const int64_t start = p * j->piece, length = j->lengths[b];
    const int64_t end = start + j->piece < length ? start + j->piece : length;
    if (start >= end) { /* past this row's keys: weighs nothing in the merge */
        for (int64_t i = 0; i < Q; i++) part[i * (D + 2)] = -INFINITY, part[i * (D + 2) + 1] = 0.0f;
        return;
    }
    const int64_t row = j->rows ? j->rows[b] : b;
    const float *keys = j->k + row * j->row_stride + start * HD, *values = j->v + row * j->row_stride + start * HD;
    const float *q = j->q + b * Q * D;
    const int64_t n = end - start;
    float s[MAX_HEADS][MAX_PIECE];
    float m[MAX_HEADS];
    for (int64_t i = 0; i < Q; i++) m[i] = -INFINITY;
    for (int64_t t = 0; t < n; t++) /* query head i = h * G + g reads key/value head h */
        for (int64_t i = 0; i < Q; i++) {
            const float x = dot(q + i * D, keys + t * HD + (i / G) * D, D) * j->scale;
            s[i][t] = x;
            if (x > m[i]) m[i] = x;
        }
    for (int64_t i = 0; i < Q; i++) {
        const __m256 top = _mm256_set1_ps(m[i]);
        __m256 sums = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s[i] + t), top));
            _mm256_storeu_ps(s[i] + t, e);
            sums = _mm256_add_ps(sums, e);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, sums);
        for (int l = 0; l < 8; l++) sum += lanes[l];
        for (; t < n; t++) sum += s[i][t] = expf(s[i][t] - m[i]);
        float *acc = part + i * (D + 2);
        acc[0] = m[i];
        acc[1] = sum;
        for (int64_t d = 0; d < D; d++) acc[2 + d] = 0.0f;
    }
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < Q; i++) {
            const float *value = values + t * HD + (i / G) * D;
            float *acc = part + i * (D + 2) + 2;
            const __m256 w = _mm256_set1_ps(s[i][t]);
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(value + d), _mm256_loadu_ps(acc + d)));
        }
}

/* Phase 2, item (b, h): its pieces merged into out, each weighed by exp(its maximum - the largest). */
static void merge_of(const Job *j, int64_t item) {
    const int64_t G = j->G, D = j->D, Q = j->H * G, b = item / j->H, h = item % j->H;
    const int64_t stride = Q * (D + 2);
    for (int64_t i = h * G; i < (h + 1) * G; i++) {
        const float *parts = j->part + b * j->pieces * stride + i * (D + 2);
        float top = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < j->pieces; p++)
            if (parts[p * stride] > top) top = parts[p * stride];
        float *out = j->out + (b * Q + i) * D;
        for (int64_t d = 0; d < D; d++) out[d] = 0.0f;
        for (int64_t p = 0; p < j->pieces; p++) {
            const float *acc = parts + p * stride;
            if (acc[1] == 0.0f) continue;
            const float w = expf(acc[0] - top);
            sum += w * acc[1];
            for (int64_t d = 0; d < D; d++) out[d] += w * acc[2 + d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; d++) out[d] *= inv;
    }
}

static void run_pieces(void *arg, int tid) {
    (void)tid;
    Job *j = arg;
    const int64_t total = j->B * j->pieces;
    for (int64_t i; (i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < total;) piece_of(j, i);
}

static void run_merges(void *arg, int tid) {
    (void)tid;
    Job *j = arg;
    const int64_t total = j->B * j->H;
    for (int64_t i; (i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < total;) merge_of(j, i);
}

/* Keys a piece: enough pieces that every thread has about four items, none longer than MAX_PIECE. */
int64_t ca_piece(int64_t B, int64_t longest, int threads) {
    const int64_t want = 4 * (int64_t)threads;
    int64_t piece = B >= want ? longest : (longest * B + want - 1) / want;
    piece = (piece + 15) / 16 * 16;
    return piece < MIN_PIECE ? MIN_PIECE : piece > MAX_PIECE ? MAX_PIECE : piece;
}

int ca_threads(void) { return pool_threads(); }

/* softmax(q·kᵀ·scale)·v per row and query head; part: scratch of B * pieces * H * G * (D + 2) floats, pieces
 * = ceil(longest / piece). Returns 0, or -1 for a shape this kernel does not take. */
int ca_decode(const float *q, int64_t B, int64_t H, int64_t G, int64_t D, const float *k, const float *v,
              int64_t row_stride, const int64_t *rows, const int64_t *lengths, int64_t piece, int64_t pieces,
              float scale, float *part, float *out) {
    if (G < 1 || H * G > MAX_HEADS || D % 8 || piece < 1 || piece > MAX_PIECE) return -1;
    Job j = {.q = q, .k = k, .v = v, .rows = rows, .lengths = lengths, .out = out, .part = part, .B = B, .H = H,
             .G = G, .D = D, .pieces = pieces, .piece = piece, .row_stride = row_stride, .scale = scale};
    atomic_store(&j.next, 0);
    pool_runner(run_pieces, &j, 0, 1);
    atomic_store(&j.next, 0);
    pool_runner(run_merges, &j, 0, 1);
    return 0;
}

int ca_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

void ca_set_threads(int n) { pool_set_threads(n); }

/* Run on another library's pool (cpu_experts' moe_pool_run and moe_get_threads) instead of this one's. */
void ca_use_pool(void *run, void *threads) {
    pool_runner = run ? (run_fn)run : pool_run;
    pool_threads = threads ? (int (*)(void))threads : pool_get_threads;
}
