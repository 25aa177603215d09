/*
 * All CPU-resident experts of one MoE layer for one step, in one parallel region.
 *
 * Decode puts 1..32 tokens on each expert, so the work is memory-bound: every weight byte
 * should cross the memory bus once per call, with all cores pulling at once. Phase 0 converts the
 * input rows, shared among the threads. Phase 1 hands out (group, block of F rows) items and
 * computes gate and up rows together into act = bf16(bf16(silu(bf16(gate))) * bf16(up)), the same
 * roundings torch's bf16 path makes; phase 2 hands out (group, block of H rows) items of the down
 * projection, the last round of blocks in quarters so that the threads finish close together. A
 * phase-2 item waits only for its own group's phase-1 items, not for a global barrier. Items come
 * from one atomic counter, so groups with more tokens simply take more items.
 *
 * Inner loop (dot4): 4 weight rows x up to 6 tokens of fp32 accumulators live in registers;
 * each 64-byte weight chunk is loaded once and used for every token of the tile, and all tiles
 * of a group run while the 4 rows are still in L1/L2, so DRAM sees the weights once whatever
 * the number of tokens. bf16 weights become fp32 with a shift or a mask and go through FMAs:
 * on Sapphire Rapids vdpbf16ps issues at a fraction of vfmadd's rate, which made the FMA form the faster
 * (docs/measurements.md, "The CPU experts kernel"). So the kernel
 * needs only AVX512F/BW/VL, not AVX512_BF16.
 *
 * Threads: the persistent pool of native_pool.h (shared with cpu_quant.c, which borrows this
 * library's pool through moe_pool_run so that one process has one set of workers).
 *
 * AMX path (moe_set_path(1), opt-in: MOEDESK_EXPERTS_PATH=amx): groups of AMX_MIN+ tokens on AMX-BF16 tiles,
 * the same sums of exact bf16 products in fp32, the rest on the FMAs; see the AMX section. Not yet run on AMX
 * hardware: its logic is tested through an emulated build (-DMOE_AMX_EMULATE).
 *
 * The Python side checks the CPU before loading this; moe_cpu_supported() checks again,
 * including the OS's support for the zmm state.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <cpuid.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "native_pool.h"
#include "native_call.h"
#include "routed_pairs.h"
#ifdef MOE_AMX_EMULATE
#define NATIVE_AMX_EMULATE
#endif
#include "native_amx.h"

typedef uint16_t bf16;

/* Software prefetch distance along each weight row. Past a row's end it lands on the rows the next iteration reads,
 * past the tensor's end it is harmless (the distances measured: docs/measurements.md, "The CPU experts kernel"). */
#ifndef PREFETCH /* this, PREFETCH_HINT and SHORT_AHEAD: -D... to measure others (tests/perf/probe_kernel_trace.py) */
#define PREFETCH 1024
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* Rows of at most this many bytes prefetch the next iteration's rows instead (same column): along a
 * short row the first KiB of every row went unprefetched. Qwen3's short rows gained; Mixtral's long ones lost that
 * way, so they keep prefetching along the row (docs/measurements.md, "The CPU experts kernel"). */
#define SHORT_ROW_BYTES 4096
#ifndef SHORT_AHEAD
#define SHORT_AHEAD 1 /* iterations ahead along short rows */
#endif
#ifndef ITEM_BYTES /* -DITEM_BYTES=... to measure others (tests/perf/probe_bank_pages.py) */
#define ITEM_BYTES (256 * 1024) /* weight bytes per work item: small enough to balance, large enough to amortise */
#endif

/* ---------------------------------------------------------------- arithmetic */

static inline bf16 f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

#ifndef MOE_AVX2
/* AVX-512: 16 lanes */
#define TILE 6 /* tokens per register tile: 4 rows x 6 tokens = 24 accumulators */

static inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 bf16_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
}

/* Round to the nearest bfloat16 (ties to even), kept in fp32: torch's float -> bfloat16 rounding,
 * denormals and NaNs included, so the act values match its bf16 path. */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

/* exp(x) to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, Taylor polynomial of degree 6, times 2^n. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-100.f), _mm512_min_ps(_mm512_set1_ps(100.f), x)); /* NaN passes */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu16(__m512 x) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

/* act = bf16(bf16(silu(bf16(gate))) * bf16(up)), as torch's bf16 F.silu(gate) * up rounds it. */
static inline __m512 act16(__m512 gate, __m512 up) {
    return round_bf16(_mm512_mul_ps(round_bf16(silu16(round_bf16(gate))), round_bf16(up)));
}

/* The horizontal sums of 4 vectors, together: a transpose-and-add tree instead of 4 separate reductions. */
static inline __m128 sum4(const __m512 a[4]) {
    const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
    y = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, _MM_SHUFFLE(1, 0, 3, 2)));
    y = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(y);
}

static inline __attribute__((always_inline)) void
dot4_step(__m512 acc[TILE][4], const __m512i v[4], const float *const *xs, const int T, int64_t k) {
    __m512 wc[4];
    for (int r = 0; r < 4; r++) wc[r] = bf16_even(v[r]);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        const __m512 xe = _mm512_loadu_ps(xs[t] + k);
        for (int r = 0; r < 4; r++) acc[t][r] = _mm512_fmadd_ps(wc[r], xe, acc[t][r]);
    }
    for (int r = 0; r < 4; r++) wc[r] = bf16_odd(v[r]);
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) {
        const __m512 xo = _mm512_loadu_ps(xs[t] + k + 16);
        for (int r = 0; r < 4; r++) acc[t][r] = _mm512_fmadd_ps(wc[r], xo, acc[t][r]);
    }
}

/*
 * out[t*4 + r] = dot(w[r][0:K], x_t) for T tokens and 4 bf16 weight rows, in fp32.
 * x_t is "split" fp32: for every 32 elements of the row, first the 16 at even positions, then
 * the 16 at odd ones, zero-padded to a multiple of 32. A 64-byte weight chunk becomes its even
 * and odd halves with one shift and one mask, each then an FMA against every token: two FMAs
 * per 32 multiply-adds where vdpbf16ps needs one instruction at half the rate (measured).
 * Products of two bf16 are exact in fp32, so this is torch's bf16 matmul arithmetic up to the
 * order of the fp32 sum. Always inlined with a constant T so the accumulators stay in registers.
 */
static inline __attribute__((always_inline)) void
dot4(const bf16 *const w[4], const float *const *xs, const int T, int64_t K, int64_t ahead, float *out) {
    __m512 acc[TILE][4];
    __m512i v[4];
#pragma GCC unroll 6
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 4; r++) acc[t][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w[r] + k + ahead), PREFETCH_HINT);
        for (int r = 0; r < 4; r++) v[r] = _mm512_loadu_si512(w[r] + k);
#ifdef MOE_READ_ONLY /* tests/perf/probe_kernel_trace.py: the same reads without the arithmetic (wrong results) */
        for (int r = 0; r < 4; r++) acc[0][r] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[0][r]), v[r]));
        continue;
#endif
        dot4_step(acc, v, xs, T, k);
    }
    if (k < K) { /* tail: read nothing past the row; x is zero-padded there */
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        for (int r = 0; r < 4; r++) v[r] = _mm512_maskz_loadu_epi16(m, w[r] + k);
        dot4_step(acc, v, xs, T, k);
    }
#pragma GCC unroll 6
    for (int t = 0; t < T; t++) _mm_storeu_ps(out + t * 4, sum4(acc[t]));
}

/* A bf16 row of n elements into split fp32 (see dot4), zero-padded to a multiple of 32. */
static void split_row(const bf16 *src, int64_t n, float *dst) {
    for (int64_t k = 0; k < n; k += 32, dst += 32) {
        const __mmask32 m = n - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (n - k)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi16(m, src + k);
        _mm512_storeu_ps(dst, bf16_even(v));
        _mm512_storeu_ps(dst + 16, bf16_odd(v));
    }
}

/* act of the gate and up sums of values [f0, f1) (f0 a multiple of 32) into split act rows (see dot4), zero past f1
 * in its last 32: act(0, 0) = 0. */
static void act_split(const float *g_row, const float *u_row, int64_t f0, int64_t f1, float *act) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t f = f0; f < f1; f += 32) {
        const int64_t left = f1 - f;
        const __mmask16 lo = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __mmask16 hi = left >= 32 ? (__mmask16)0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
        const __m512 a0 = act16(_mm512_maskz_loadu_ps(lo, g_row + f), _mm512_maskz_loadu_ps(lo, u_row + f));
        const __m512 a1 = act16(_mm512_maskz_loadu_ps(hi, g_row + f + 16), _mm512_maskz_loadu_ps(hi, u_row + f + 16));
        _mm512_storeu_ps(act + f, _mm512_permutex2var_ps(a0, even, a1));
        _mm512_storeu_ps(act + f + 16, _mm512_permutex2var_ps(a0, odd, a1));
    }
}
#else
/* AVX2 and FMA, for CPUs without AVX-512 (most desktop CPUs): the same arithmetic and layouts 8 lanes at a time. A
 * 64-byte chunk of a weight row is two 16-value halves; half h's even and odd values meet x's split values
 * [8h, 8h + 8) and [16 + 8h, 16 + 8h + 8), and one accumulator per token and row sums all four products. */
#include "native_exp.h"

#ifndef TILE /* -DTILE=... to measure others */
#define TILE 2 /* 4 rows x 2 tokens = 8 of the 16 ymm registers as accumulators, the rest for weights and x */
#endif

static inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 bf16_odd(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000)));
}

/* torch's float -> bfloat16 rounding, kept in fp32 (the AVX-512 round_bf16's). */
static inline __m256 round_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000));
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

static inline __m256 silu8(__m256 x) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}

static inline __m256 act8(__m256 gate, __m256 up) {
    return round_bf16(_mm256_mul_ps(round_bf16(silu8(round_bf16(gate))), round_bf16(up)));
}

static inline __m128 sum4(const __m256 a[4]) {
    const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* One 32-value chunk of 4 rows (w[r] + k, all 32 there) against T tokens. */
static inline __attribute__((always_inline)) void
dot4_step(__m256 acc[TILE][4], const bf16 *const w[4], const float *const *xs, const int T, int64_t k) {
    for (int h = 0; h < 2; h++) {
        __m256i v[4];
        for (int r = 0; r < 4; r++) v[r] = _mm256_loadu_si256((const __m256i *)(w[r] + k + 16 * h));
        for (int r = 0; r < 4; r++) {
            const __m256 we = bf16_even(v[r]);
            for (int t = 0; t < T; t++) acc[t][r] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs[t] + k + 8 * h), acc[t][r]);
        }
        for (int r = 0; r < 4; r++) {
            const __m256 wo = bf16_odd(v[r]);
            for (int t = 0; t < T; t++)
                acc[t][r] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs[t] + k + 16 + 8 * h), acc[t][r]);
        }
    }
}

/* The AVX-512 dot4's contract: out[t*4 + r] = dot(w[r][0:K], x_t) in fp32, x_t split and zero-padded. */
static inline __attribute__((always_inline)) void
dot4(const bf16 *const w[4], const float *const *xs, const int T, int64_t K, int64_t ahead, float *out) {
    __m256 acc[TILE][4];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 4; r++) acc[t][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w[r] + k + ahead), PREFETCH_HINT);
        dot4_step(acc, w, xs, T, k);
    }
    if (k < K) { /* tail: the row's last values staged in zeros, so nothing past the row is read */
        _Alignas(32) bf16 buf[4][32] = {{0}};
        const bf16 *b[4] = {buf[0], buf[1], buf[2], buf[3]};
        for (int r = 0; r < 4; r++) memcpy(buf[r], w[r] + k, (size_t)(K - k) * sizeof(bf16));
        const float *xk[TILE];
        for (int t = 0; t < T; t++) xk[t] = xs[t] + k;
        dot4_step(acc, b, xk, T, 0);
    }
    for (int t = 0; t < T; t++) _mm_storeu_ps(out + t * 4, sum4(acc[t]));
}

/* A bf16 row of n elements into split fp32 (see dot4), zero-padded to a multiple of 32. */
static void split_row(const bf16 *src, int64_t n, float *dst) {
    for (int64_t k = 0; k < n; k += 32, dst += 32) {
        _Alignas(32) bf16 buf[32];
        const bf16 *at = src + k;
        if (n - k < 32) { /* the row's last values staged in zeros, so nothing past it is read */
            memset(buf, 0, sizeof buf);
            memcpy(buf, at, (size_t)(n - k) * sizeof(bf16));
            at = buf;
        }
        for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(at + 16 * h));
            _mm256_storeu_ps(dst + 8 * h, bf16_even(v));
            _mm256_storeu_ps(dst + 16 + 8 * h, bf16_odd(v));
        }
    }
}

/* act_split as the AVX-512 one computes it: act of values [f0, f1) into split act rows, zero past f1. */
static void act_split(const float *g_row, const float *u_row, int64_t f0, int64_t f1, float *act) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int64_t f = f0; f < f1; f += 32) {
        _Alignas(32) float gs[32], us[32];
        const float *g = g_row + f, *u = u_row + f;
        if (f1 - f < 32) { /* past f1: zeros, whose act is 0 */
            memset(gs, 0, sizeof gs);
            memset(us, 0, sizeof us);
            memcpy(gs, g, (size_t)(f1 - f) * sizeof(float));
            memcpy(us, u, (size_t)(f1 - f) * sizeof(float));
            g = gs;
            u = us;
        }
        for (int q = 0; q < 2; q++) { /* values 16q .. 16q + 15: evens to act[8q ..), odds to act[16 + 8q ..) */
            const __m256 a0 = act8(_mm256_loadu_ps(g + 16 * q), _mm256_loadu_ps(u + 16 * q));
            const __m256 a1 = act8(_mm256_loadu_ps(g + 16 * q + 8), _mm256_loadu_ps(u + 16 * q + 8));
            const __m256 ev = _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
            const __m256 od = _mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
            _mm256_storeu_ps(act + f + 8 * q, _mm256_permutevar8x32_ps(ev, order));
            _mm256_storeu_ps(act + f + 16 + 8 * q, _mm256_permutevar8x32_ps(od, order));
        }
    }
}
#endif

/* Prefetch distance in elements for rows of K elements read `rows` at a time (see SHORT_ROW_BYTES). */
static inline int64_t prefetch_ahead(int64_t K, int rows) {
    return K * (int64_t)sizeof(bf16) <= SHORT_ROW_BYTES ? SHORT_AHEAD * rows * K : PREFETCH / (int64_t)sizeof(bf16);
}

/* dot4 for 1..TILE tokens. */
static void dot4_tile(const bf16 *const w[4], const float *const *xs, int n, int64_t K, int64_t ahead, float *out) {
    switch (n < TILE ? n : TILE) {
    case 1: dot4(w, xs, 1, K, ahead, out); break;
#if TILE > 2
    case 2: dot4(w, xs, 2, K, ahead, out); break;
#endif
#if TILE > 3
    case 3: dot4(w, xs, 3, K, ahead, out); break;
#endif
#if TILE > 4
    case 4: dot4(w, xs, 4, K, ahead, out); break;
#endif
#if TILE > 5
    case 5: dot4(w, xs, 5, K, ahead, out); break;
#endif
    default: dot4(w, xs, TILE, K, ahead, out); break;
    }
}

/* ---------------------------------------------------------------- one call's work */

typedef struct {
    const bf16 *gate_up, *down;
    bf16 *out;
    const int64_t *out_rows; /* where result row i goes in out; NULL: row i */
    /* Scratch rows count only the native groups' rows: natively computed row t of native group k
     * is scratch row first[k] + t. */
    float *act;           /* [rows][Fp] split fp32, holding bf16 values */
    float *gu;            /* [rows][2R] fp32 gate and up sums before rounding */
    float *x;             /* [rows][Hp] split fp32 copies of the x rows, written in phase 0 */
    const bf16 *x_src;    /* the caller's x; scratch row r copies its row x_row[r] */
    const int64_t *x_row;
    int64_t x_stride, rows_n;
    const int64_t *off, *eid;
    const int32_t *groups; /* native groups, in order */
    const int64_t *first;  /* per native group: its first scratch row */
    _Atomic int32_t *done1; /* per native group: phase-1 items finished */
    const int64_t *tbase;  /* per native group: its first token tile in xt / at; -1: not an AMX group */
    const int32_t *row_gi; /* scratch row -> native group */
    uint8_t *xt, *at;      /* AMX groups' x rows and act rows as token tiles (see the AMX section) */
    int64_t xt_bytes, at_bytes;
    /* R: the intermediate rows computed, [0, R) of F (the call's `rows`): gate / up rows [0, R) and the first R
     * values of each down row (F apart); act rows have R values, Fp = round_up(R, 32) */
    int64_t H, F, R, Fp, out_stride, n1, coarse, total, FB, HB, nb1, nb2;
    /* Phase-2 items from `coarse` on are quarters of a block: the call ends when the slowest thread finishes its
     * last item, and a short last item leaves the others less time idle. */
    _Alignas(64) _Atomic int64_t next; /* its own cache line: every item bumps it */
    _Alignas(64) _Atomic int64_t next_row; /* phase 0: the next x row to split */
    _Atomic int64_t rows_split;
    char pad[48];
} Job;

/* ---------------------------------------------------------------- AMX-BF16: groups of AMX_MIN+ tokens */
#ifndef MOE_AVX2

/*
 * out^T = W x^T on tiles: a C tile is 16 weight rows x 16 tokens of fp32 sums, and tdpbf16ps adds 32 values of
 * K to it at a time: sums of exact bf16 products in fp32, as the FMA path computes (up to the order of the sum;
 * the tiles also treat denormal inputs and sums as zero).
 * A tiles are the weights as stored: 16 rows of 32 bf16 (64 bytes) at a stride of K * 2 bytes, no re-layout.
 * B tiles are a group's x rows (packed in phase 0) and act rows (written by phase 1's epilogue) as token tiles
 * of 16 tokens: block b (K values 32b .. 32b + 31) is 1 KiB, 16 rows of 64 bytes, row k holding every token's
 * pair (32b + 2k, 32b + 2k + 1), token n at byte 4n: the pair order tdpbf16ps takes. Values past K and tokens
 * past the group's are 0, so the C tiles' columns of absent tokens are 0 too (act(0, 0) = 0). Where a tile
 * would reach past a matrix's rows (N % 16) or past a row's end (K % 32), its rows go through a 1 KiB
 * zero-padded copy instead (amx_stage), so no load reads beyond a row; whole tiles load from the weights.
 * Phase 1 works 16 gate and 16 up rows against up to 2 token tiles (C tiles 0-3, A 4-5, B 6-7), and its
 * epilogue computes act from the gate and up C tiles with act16's roundings, storing it as bf16 pairs straight
 * into the act token tiles (one 64-byte store per two rows); phase 2 works 32 down rows (two A tiles) against up
 * to 2 token tiles. More tokens: passes of 32 over the same rows (from L2). The tile configuration is per thread:
 * run_job sets it at a thread's first AMX item of a call and releases it at the end. Chosen by moe_set_path(1)
 * where the CPU and OS allow (moe_amx_supported); built with -DMOE_AMX_EMULATE the tile instructions are done in
 * C (native_amx.h, emu_dpbf16ps), so that the layouts and the epilogues are tested on CPUs without AMX
 * (tests/kernels/test_cpu_experts_amx.py).
 */
#ifndef AMX_MIN
#define AMX_MIN 8 /* tokens of a group from which it goes to AMX (the FMA path turned compute-bound at about 8) */
#endif
#define AMX_T 16 /* tokens per token tile */

static int use_amx = 0; /* groups of AMX_MIN+ tokens on AMX tiles (moe_set_path) */

/* Bytes of one token tile of K-value rows. */
static inline int64_t amx_tile_bytes(int64_t K) { return 32 * round_up(K, 32); }

/* Every tile 16 rows x 64 bytes: C (0-3) 16 x 16 fp32, A (4-5) 16 rows x 32 bf16, B (6-7) 16 pairs x 16 tokens. */
static const TileCfg AMX_CFG = {.palette = 1,
                                .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

#ifdef NATIVE_AMX_EMULATE
static _Atomic int64_t emu_dps; /* tdpbf16ps done, for tests: which groups went to the tiles */

static inline float emu_daz(uint32_t u) { /* a denormal as 0 (keeping its sign), as the tiles read and write them */
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float emu_ftz(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return emu_daz(u);
}
/* tdpbf16ps as the SDM describes it: per C element, the even and the odd products of the 16 pairs summed apart
 * (fp32, RNE, denormals flushed), then C + even + odd. */
static void emu_dpbf16ps(int c, int a, int b) {
    atomic_fetch_add_explicit(&emu_dps, 1, memory_order_relaxed);
    for (int m = 0; m < emu.cfg.rows[c]; m++) {
        float even[16] = {0}, odd[16] = {0};
        for (int k = 0; k < emu.cfg.colsb[a] / 4; k++)
            for (int n = 0; n < emu.cfg.colsb[c] / 4; n++) {
                uint16_t pa[2], pb[2];
                memcpy(pa, &emu.t[a][m][4 * k], 4);
                memcpy(pb, &emu.t[b][k][4 * n], 4);
                even[n] = emu_ftz(even[n] + emu_ftz(emu_daz((uint32_t)pa[0] << 16) * emu_daz((uint32_t)pb[0] << 16)));
                odd[n] = emu_ftz(odd[n] + emu_ftz(emu_daz((uint32_t)pa[1] << 16) * emu_daz((uint32_t)pb[1] << 16)));
            }
        for (int n = 0; n < emu.cfg.colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, &emu.t[c][m][4 * n], 4);
            acc = emu_ftz(emu_ftz(emu_ftz(acc) + even[n]) + odd[n]);
            memcpy(&emu.t[c][m][4 * n], &acc, 4);
        }
    }
}
#define TILE_DPBF16PS(c, a, b) emu_dpbf16ps(c, a, b)
#else
#define TILE_DPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#endif

static void amx_begin(void) { TILE_CONFIG(&AMX_CFG); }
static void amx_end(void) { TILE_RELEASE(); }

/* Rows w[0 .. rn) (ld apart), values [k0, k0 + 32) of their first K as an A tile in buf, zero where there is no
 * row or value. */
static void amx_stage(bf16 buf[16][32], const bf16 *w, int rn, int64_t K, int64_t ld, int64_t k0) {
    const int kn = K - k0 < 32 ? (int)(K - k0) : 32;
    memset(buf, 0, 16 * 32 * sizeof(bf16));
    for (int r = 0; r < rn; r++) memcpy(buf[r], w + r * ld + k0, (size_t)kn * sizeof(bf16));
}

/* A tile T of rows w (rn of 16 there), values [k0, k0 + 32): from the weights themselves where all of it is
 * there, else staged. The asm's memory operand names the first row only: the weights are never written. */
#define AMX_LOAD_A(T, w, rn, K, ld, k0, buf)                                               \
    do {                                                                                  \
        if ((rn) == 16 && (k0) + 32 <= (K)) {                                             \
            TILE_LOAD(T, (w) + (k0), (ld) * (int64_t)sizeof(bf16), *(const bf16(*)[32])((w) + (k0))); \
        } else {                                                                          \
            amx_stage(buf, w, rn, K, ld, k0);                                             \
            TILE_LOAD(T, buf, 64, *(bf16(*)[16][32])buf);                                 \
        }                                                                                 \
    } while (0)

/*
 * c[i][u] = row set i x token tile u over K values (C tile: [16 rows][16 tokens]) for i < NA, u < NT. Row set i
 * starts at a[i], its rows ld apart (ld >= K: the down rows' first R values), rn[i] of its 16 there; bt[u]: token
 * tile u. Needs amx_begin in this thread.
 */
static inline __attribute__((always_inline)) void amx_tiles(const int NA, const int NT, const bf16 *const a[2],
                                                           const int rn[2], const uint8_t *const bt[2], int64_t K,
                                                           int64_t ld, int64_t ahead, float c[2][2][16][16]) {
    _Alignas(64) bf16 buf[16][32];
    TILE_ZERO(0);
    if (NT > 1) TILE_ZERO(1);
    if (NA > 1) TILE_ZERO(2);
    if (NA > 1 && NT > 1) TILE_ZERO(3);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        for (int i = 0; i < NA; i++)
            for (int r = 0; r < rn[i]; r++) _mm_prefetch((const char *)(a[i] + r * ld + k0 + ahead), PREFETCH_HINT);
        const uint8_t *b0 = bt[0] + k0 / 32 * 1024, *b1 = bt[NT - 1] + k0 / 32 * 1024;
        TILE_LOAD(6, b0, 64, *(const uint8_t(*)[1024])b0);
        if (NT > 1) TILE_LOAD(7, b1, 64, *(const uint8_t(*)[1024])b1);
        AMX_LOAD_A(4, a[0], rn[0], K, ld, k0, buf);
        TILE_DPBF16PS(0, 4, 6);
        if (NT > 1) TILE_DPBF16PS(1, 4, 7);
        if (NA > 1) {
            AMX_LOAD_A(5, a[1], rn[1], K, ld, k0, buf);
            TILE_DPBF16PS(2, 5, 6);
            if (NT > 1) TILE_DPBF16PS(3, 5, 7);
        }
    }
    TILE_STORE(0, c[0][0], 64, c[0][0]);
    if (NT > 1) TILE_STORE(1, c[0][1], 64, c[0][1]);
    if (NA > 1) TILE_STORE(2, c[1][0], 64, c[1][0]);
    if (NA > 1 && NT > 1) TILE_STORE(3, c[1][1], 64, c[1][1]);
}

typedef void (*amx_fn)(const bf16 *const[2], const int[2], const uint8_t *const[2], int64_t, int64_t, int64_t,
                       float[2][2][16][16]);
#define AMX_VARIANT(name, NA, NT)                                                                                    \
    static __attribute__((noinline)) void name(const bf16 *const a[2], const int rn[2], const uint8_t *const bt[2], \
                                               int64_t K, int64_t ld, int64_t ahead, float c[2][2][16][16]) {        \
        amx_tiles(NA, NT, a, rn, bt, K, ld, ahead, c);                                                               \
    }
AMX_VARIANT(amx_1x1, 1, 1)
AMX_VARIANT(amx_1x2, 1, 2)
AMX_VARIANT(amx_2x1, 2, 1)
AMX_VARIANT(amx_2x2, 2, 2)
static const amx_fn AMX_TILES[2][2] = {{amx_1x1, amx_1x2}, {amx_2x1, amx_2x2}};

/* A group's token tiles: the first of xt (x) or at (act). */
static inline uint8_t *amx_group_tiles(uint8_t *base, int64_t bytes, const Job *j, int64_t gi) {
    return base + j->tbase[gi] * bytes;
}

/* Phase 0 for a row of an AMX group: bf16 row src (K values) as token t's column of its token tile; the group's
 * last token also zeroes the columns of the tokens its last tile lacks. */
static void amx_pack_row(const bf16 *src, int64_t K, uint8_t *tile, int t, int last) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(64));
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        uint8_t *blk = tile + k / 32 * 1024;
        _mm512_i32scatter_epi32(blk + 4 * t, at, _mm512_maskz_loadu_epi16(m, src + k), 1);
        for (int u = last ? t + 1 : AMX_T; u < AMX_T; u++)
            _mm512_i32scatter_epi32(blk + 4 * u, at, _mm512_setzero_si512(), 1);
    }
}

/* Phase 1's epilogue: act of rows f .. f + 15 (f a multiple of 16) for a token tile's 16 tokens, from the gate
 * and up C tiles, into the act token tile: rows f + 2i, f + 2i + 1 are one row of 16 pairs. */
static void amx_act(const float cg[16][16], const float cu[16][16], uint8_t *tile, int64_t f) {
    uint8_t *row = tile + f / 32 * 1024 + (f % 32) / 2 * 64;
    for (int r = 0; r < 16; r += 2) {
        const __m512i lo = _mm512_castps_si512(act16(_mm512_load_ps(cg[r]), _mm512_load_ps(cu[r])));
        const __m512i hi = _mm512_castps_si512(act16(_mm512_load_ps(cg[r + 1]), _mm512_load_ps(cu[r + 1])));
        /* act16's values are bf16 already: their high halves, exactly */
        const __m512i pair =
            _mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(hi, _mm512_set1_epi32((int)0xffff0000)));
        _mm512_storeu_si512(row + r / 2 * 64, pair);
    }
}

/* Phase 1 of an AMX group: gate and up rows [f0, f1), 16 of each at a time, into its act token tiles. */
static void phase1_amx(const Job *j, int64_t gi, int64_t f0, int64_t f1) {
    const int64_t g = j->groups[gi], n = j->off[g + 1] - j->off[g], H = j->H, F = j->F, R = j->R;
    const bf16 *gate = j->gate_up + j->eid[g] * 2 * F * H, *up = gate + F * H;
    const uint8_t *xt = amx_group_tiles(j->xt, j->xt_bytes, j, gi);
    uint8_t *at = amx_group_tiles(j->at, j->at_bytes, j, gi);
    const int64_t tiles = (n + AMX_T - 1) / AMX_T, ahead = prefetch_ahead(H, 16);
    _Alignas(64) float c[2][2][16][16];
    for (int64_t u0 = 0; u0 < tiles; u0 += 2) {
        const int nt = tiles - u0 >= 2 ? 2 : 1;
        const uint8_t *bt[2] = {xt + u0 * j->xt_bytes, xt + (u0 + nt - 1) * j->xt_bytes};
        for (int64_t f = f0; f < f1; f += 16) {
            const int rn = f1 - f < 16 ? (int)(f1 - f) : 16; /* f1 <= R: rows past it only at R's end, staged as 0 */
            const bf16 *a[2] = {gate + f * H, up + f * H};
            const int rns[2] = {rn, rn};
            AMX_TILES[1][nt - 1](a, rns, bt, H, H, ahead, c);
            for (int u = 0; u < nt; u++) amx_act(c[0][u], c[1][u], at + (u0 + u) * j->at_bytes, f);
        }
        /* R's last 32-block past round_up(R, 16): rows no item computes, zero (a down A tile's staged zeros there
         * must not meet garbage); only where R = F, R < F being a multiple of 32 */
        const int64_t F16 = round_up(R, 16);
        if (f1 == R && F16 % 32)
            for (int u = 0; u < nt; u++) memset(at + (u0 + u) * j->at_bytes + F16 / 32 * 1024 + 8 * 64, 0, 8 * 64);
    }
}

/* Phase 2 of an AMX group: down rows [h0, h1) (h0 a multiple of 16), 32 at a time, over their first R values,
 * into out. */
static void phase2_amx(const Job *j, int64_t gi, int64_t h0, int64_t h1) {
    const int64_t g = j->groups[gi], a0 = j->off[g], n = j->off[g + 1] - a0, F = j->F, R = j->R;
    const bf16 *down = j->down + j->eid[g] * j->H * F;
    const uint8_t *at = amx_group_tiles(j->at, j->at_bytes, j, gi);
    const int64_t tiles = (n + AMX_T - 1) / AMX_T, ahead = prefetch_ahead(F, 32);
    _Alignas(64) float c[2][2][16][16];
    for (int64_t u0 = 0; u0 < tiles; u0 += 2) {
        const int nt = tiles - u0 >= 2 ? 2 : 1;
        const uint8_t *bt[2] = {at + u0 * j->at_bytes, at + (u0 + nt - 1) * j->at_bytes};
        for (int64_t h = h0; h < h1; h += 32) {
            const int64_t left = h1 - h;
            const int rn[2] = {left < 16 ? (int)left : 16, left <= 16 ? 0 : left < 32 ? (int)(left - 16) : 16};
            const int na = rn[1] ? 2 : 1;
            const bf16 *a[2] = {down + h * F, down + (h + 16) * F};
            AMX_TILES[na - 1][nt - 1](a, rn, bt, R, F, ahead, c);
            for (int u = 0; u < nt; u++) {
                const int64_t t0 = (u0 + u) * AMX_T, tn = n - t0 < AMX_T ? n - t0 : AMX_T;
                for (int64_t t = 0; t < tn; t++) {
                    const int64_t i = a0 + t0 + t;
                    bf16 *o = j->out + (j->out_rows ? j->out_rows[i] : i) * j->out_stride + h;
                    for (int s = 0; s < na; s++)
                        for (int r = 0; r < rn[s]; r++) o[16 * s + r] = f32_to_bf16(c[s][u][r][t]);
                }
            }
        }
    }
}
#else
/* The AVX2 build has no AMX path (a CPU with AMX has AVX-512, and the AVX-512 build): no group gets token tiles. */
#define AMX_MIN 8
#define AMX_T 16
static int use_amx = 0;
static inline int64_t amx_tile_bytes(int64_t K) { return 32 * round_up(K, 32); }
#endif

/*
 * Token tiles are the outer loop: the first tile streams the item's rows from DRAM and later
 * tiles find them in L2 (an item is ITEM_BYTES), while the tile's x rows stay in L1. Rows outer
 * would instead re-read every token's x (fp32, twice the bytes) from L2 for each 4 rows, which
 * measured slower from 8 tokens up.
 */
static void phase1_item(const Job *j, int64_t gi, int64_t blk) {
    const int64_t g = j->groups[gi], n = j->off[g + 1] - j->off[g], r0 = j->first[gi], H = j->H, F = j->F, R = j->R;
    const int64_t Hp = (H + 31) / 32 * 32;
    const bf16 *gate = j->gate_up + j->eid[g] * 2 * F * H, *up = gate + F * H;
    const int64_t f0 = blk * j->FB, f1 = f0 + j->FB < R ? f0 + j->FB : R;
#ifndef MOE_AVX2
    if (j->tbase[gi] >= 0) {
        phase1_amx(j, gi, f0, f1);
        return;
    }
#endif
    float *gu = j->gu + r0 * 2 * R, s[4 * TILE];
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int tn = n - t0 < TILE ? (int)(n - t0) : TILE;
        const float *xs[TILE];
        for (int t = 0; t < tn; t++) xs[t] = j->x + (r0 + t0 + t) * Hp;
        for (int64_t f = f0; f < f1; f += 2) {
            const int64_t f2 = f + 1 < R ? f + 1 : f; /* an odd last row is computed twice, kept once */
            const bf16 *w[4] = {gate + f * H, gate + f2 * H, up + f * H, up + f2 * H};
            dot4_tile(w, xs, tn, H, prefetch_ahead(H, 2), s);
            for (int t = 0; t < tn; t++) {
                float *row = gu + (t0 + t) * 2 * R;
                row[f] = s[t * 4 + 0];
                row[R + f] = s[t * 4 + 2];
                if (f2 != f) {
                    row[f + 1] = s[t * 4 + 1];
                    row[R + f + 1] = s[t * 4 + 3];
                }
            }
        }
    }
    /* act in split layout: blocks start at multiples of 32, so each 32-chunk is this item's own */
    for (int64_t t = 0; t < n; t++)
        act_split(gu + t * 2 * R, gu + t * 2 * R + R, f0, f1, j->act + (r0 + t) * j->Fp);
}

/* Down-projection rows [h0, h1) of group gi over their first R values (rows F apart); h0 is a multiple of 4. */
static void phase2_item(const Job *j, int64_t gi, int64_t h0, int64_t h1) {
    const int64_t g = j->groups[gi], a = j->off[g], n = j->off[g + 1] - a, r0 = j->first[gi], H = j->H, F = j->F,
                  R = j->R;
    const bf16 *down = j->down + j->eid[g] * H * F;
    float s[4 * TILE];
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int tn = n - t0 < TILE ? (int)(n - t0) : TILE;
        const float *xs[TILE];
        for (int t = 0; t < tn; t++) xs[t] = j->act + (r0 + t0 + t) * j->Fp;
        for (int64_t h = h0; h < h1; h += 4) {
            const bf16 *w[4];
            for (int r = 0; r < 4; r++) w[r] = down + (h + r < H ? h + r : H - 1) * F;
            dot4_tile(w, xs, tn, R, prefetch_ahead(F, 4), s);
            const int64_t rn = h1 - h < 4 ? h1 - h : 4;
            for (int t = 0; t < tn; t++) {
                const int64_t i = a + t0 + t;
                bf16 *o = j->out + (j->out_rows ? j->out_rows[i] : i) * j->out_stride + h;
                for (int64_t r = 0; r < rn; r++) o[r] = f32_to_bf16(s[t * 4 + r]);
            }
        }
    }
}


#ifdef MOE_TRACE
/* Built only by tests/perf/probe_kernel_trace.py: the last call's timeline, to see where a call's time goes
 * beyond streaming its weights. Per participant (0: the caller): when it took its first item, when it
 * finished its last, its items, and how long its phase-2 items waited for their group's phase 1. */
#define TRACE_THREADS 256
static struct {
    int64_t enter, start, exit;
    int64_t first[TRACE_THREADS], last[TRACE_THREADS], items[TRACE_THREADS], wait[TRACE_THREADS];
} trace;
#define TRACE(stmt) stmt
int moe_trace_words(void) { return (int)(sizeof trace / sizeof(int64_t)); }
void moe_trace_read(int64_t *words) { memcpy(words, &trace, sizeof trace); }
#else
#define TRACE(stmt)
#endif

/* Phase 0, shared by whoever is there, since the caller alone would take long over a batched call's rows
 * (docs/measurements.md, "The CPU experts kernel"): the x rows into split fp32, an AMX group's into its token
 * tiles. */
static void split_rows(Job *j) {
    const int64_t Hp = round_up(j->H, 32);
    for (;;) {
        const int64_t r = atomic_fetch_add_explicit(&j->next_row, 1, memory_order_relaxed);
        if (r >= j->rows_n) break;
        const bf16 *src = j->x_src + j->x_row[r] * j->x_stride;
#ifndef MOE_AVX2
        const int64_t gi = j->row_gi[r], t = r - j->first[gi];
        if (j->tbase[gi] >= 0) {
            const int64_t g = j->groups[gi], n = j->off[g + 1] - j->off[g];
            uint8_t *tile = amx_group_tiles(j->xt, j->xt_bytes, j, gi) + t / AMX_T * j->xt_bytes;
            amx_pack_row(src, j->H, tile, (int)(t % AMX_T), t == n - 1);
        } else
#endif
        split_row(src, j->H, j->x + r * Hp);
        atomic_fetch_add_explicit(&j->rows_split, 1, memory_order_release);
    }
    unsigned spins = 0;
    while (atomic_load_explicit(&j->rows_split, memory_order_acquire) < j->rows_n) relax(&spins);
}

static void run_job(Job *j, int tid) {
    (void)tid;
    TRACE(int64_t first = 0; int64_t items = 0; int64_t wait = 0);
    int tiles = 0; /* whether this thread configured the AMX tiles (per-thread state) */
    split_rows(j);
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->total) break;
        TRACE(if (!items++) first = now_ns());
        const int64_t k = i < j->n1 ? 0 : phase2_block(i, j->n1, j->coarse);
        const int64_t gi = i < j->n1 ? i / j->nb1 : k / j->nb2;
#ifndef MOE_AVX2
        if (!tiles && j->tbase[gi] >= 0) {
            amx_begin();
            tiles = 1;
        }
#endif
        if (i < j->n1) {
            phase1_item(j, gi, i % j->nb1);
            atomic_fetch_add_explicit(&j->done1[gi], 1, memory_order_release);
        } else {
            unsigned spins = 0;
            TRACE(const int64_t w = now_ns());
            while (atomic_load_explicit(&j->done1[gi], memory_order_acquire) < j->nb1) relax(&spins);
            TRACE(wait += now_ns() - w);
            int64_t h0 = (k % j->nb2) * j->HB, h1 = h0 + j->HB < j->H ? h0 + j->HB : j->H;
            quarter_rows(i, j->coarse, j->tbase[gi] >= 0 ? 16 : 4, &h0, &h1); /* AMX: the A tiles' 16 rows */
#ifndef MOE_AVX2
            if (h0 < h1 && j->tbase[gi] >= 0) phase2_amx(j, gi, h0, h1);
            else
#endif
            if (h0 < h1) phase2_item(j, gi, h0, h1);
        }
    }
#ifndef MOE_AVX2
    if (tiles) amx_end();
#else
    (void)tiles;
#endif
    TRACE(if (tid < TRACE_THREADS) {
        trace.first[tid] = first;
        trace.last[tid] = items ? now_ns() : 0;
        trace.items[tid] = items;
        trace.wait[tid] = wait;
    });
}

/* ---------------------------------------------------------------- the call's state */

static Job job; /* guarded by native_call.h's `call` */

static void run_job_fn(void *j, int tid) { run_job((Job *)j, tid); }

/* ---------------------------------------------------------------- API */


enum { OK = 0, BAD_OFFSETS = -1, BAD_ROW = -2, BAD_EXPERT = -3, NO_MEMORY = -4, BAD_OUT_ROW = -5, BAD_ROWS = -6 };

/*
 * out[o(i), :] = down_e @ act(gate_e @ x[rows[i]], up_e @ x[rows[i]]) for i in group g, e = expert_ids[g],
 * where o(i) = out_rows[i] (each in [0, out_len)), or i when out_rows is NULL: the executor has each
 * result land where its (token, rank) pair belongs, so no scatter follows the call.
 * Groups with more than max_tokens entries are left untouched for the caller (torch's matmuls
 * win there); their count goes to *skipped. Returns OK or a negative error code.
 *
 * R (the Python side's `rows`): the intermediate rows computed, [0, R) of F; R = F is the whole experts,
 * exactly as before the parameter existed. With R < F each result is the head of its expert's output,
 * act[0, R) . down[:, 0:R)^T from gate / up rows [0, R): at one token the GPU computes the rest from pinned
 * RAM (kernels/gpu_zero_copy.py), using the PCIe link that idles while this call is bound by RAM bandwidth.
 * R < F must be a multiple of 32 (phase 1's blocks and the split act layout work in 32s); every path takes
 * it, AMX included (its A tiles load the down rows' first R values at the row stride of F).
 */
int moe_experts_forward(const bf16 *x, int64_t N, int64_t x_stride, int64_t H,
                        const int64_t *rows, int64_t M, const int64_t *expert_ids,
                        const int64_t *offsets, int64_t G, const bf16 *gate_up, const bf16 *down,
                        int64_t E, int64_t F, bf16 *out, int64_t out_stride, const int64_t *out_rows,
                        int64_t out_len, int64_t max_tokens, int64_t *skipped, int64_t R) {
    *skipped = 0;
    if (F > 0 && (R <= 0 || R > F || (R < F && R % 32))) return BAD_ROWS;
    if (G < 0 || (G == 0 ? M != 0 : offsets[0] != 0 || offsets[G] != M)) return BAD_OFFSETS;
    int64_t ng = 0, rows_n = 0; /* native groups and their rows */
    for (int64_t g = 0; g < G; g++) {
        const int64_t n = offsets[g + 1] - offsets[g];
        if (n < 0) return BAD_OFFSETS;
        if (n > 0 && (expert_ids[g] < 0 || expert_ids[g] >= E)) return BAD_EXPERT;
        if (n > max_tokens) (*skipped)++;
        else if (n > 0) {
            ng++;
            rows_n += n;
        }
    }
    for (int64_t i = 0; i < M; i++) {
        if (rows[i] < 0 || rows[i] >= N) return BAD_ROW;
        if (out_rows && (out_rows[i] < 0 || out_rows[i] >= out_len)) return BAD_OUT_ROW;
    }
    if (ng == 0 || H <= 0 || F <= 0) return OK; /* the caller handles empty shapes */

    pthread_mutex_lock(&call);
    TRACE(memset(&trace, 0, sizeof trace); trace.enter = now_ns());
    int threads = pool_get_threads();
    /* phase-1 blocks start at multiples of 32 so that each 32-chunk of split act has one writer */
    const int64_t FB = block_rows(R, 4 * H, 32, ng, threads, ITEM_BYTES),
                  HB = block_rows(H, 2 * R, 16, ng, threads, ITEM_BYTES);
    const int64_t nb1 = (R + FB - 1) / FB, nb2 = (H + HB - 1) / HB, total = ng * (nb1 + nb2);
    const int64_t Hp = round_up(H, 32), Fp = round_up(R, 32);
    if (threads > total) threads = (int)total;
    /* groups of AMX_MIN+ tokens go to the AMX tiles where the path is on */
    int64_t tiles = 0;
    for (int64_t g = 0; use_amx && g < G; g++) {
        const int64_t n = offsets[g + 1] - offsets[g];
        if (n >= AMX_MIN && n <= max_tokens) tiles += (n + AMX_T - 1) / AMX_T;
    }
    const int64_t xt_bytes = amx_tile_bytes(H), at_bytes = amx_tile_bytes(R);
    const size_t sizes[] = {
        (size_t)rows_n * 2 * R * sizeof(float),  /* gu */
        (size_t)rows_n * Fp * sizeof(float),     /* act */
        (size_t)rows_n * Hp * sizeof(float),     /* split x rows */
        (size_t)ng * sizeof(int64_t),            /* first */
        (size_t)ng * sizeof(int32_t),            /* groups */
        (size_t)ng * sizeof(_Atomic int32_t),    /* done1 */
        (size_t)rows_n * sizeof(int64_t),        /* x_row */
        (size_t)ng * sizeof(int64_t),            /* tbase */
        (size_t)rows_n * sizeof(int32_t),        /* row_gi */
        (size_t)(tiles * xt_bytes),              /* AMX groups' x token tiles */
        (size_t)(tiles * at_bytes)};             /* AMX groups' act token tiles */
    size_t at[11];
    char *base = scratch_parts(sizes, 11, at);
    if (!base) {
        pthread_mutex_unlock(&call);
        return NO_MEMORY;
    }
    Job *j = &job;
    j->gate_up = gate_up;
    j->down = down;
    j->out = out;
    j->out_rows = out_rows;
    j->gu = (float *)(base + at[0]);
    j->act = (float *)(base + at[1]);
    j->x = (float *)(base + at[2]);
    int64_t *x_row = (int64_t *)(base + at[6]);
    int64_t *first = (int64_t *)(base + at[3]);
    int32_t *groups = (int32_t *)(base + at[4]);
    j->done1 = (_Atomic int32_t *)(base + at[5]);
    int64_t *tbase = (int64_t *)(base + at[7]);
    int32_t *row_gi = (int32_t *)(base + at[8]);
    for (int64_t g = 0, k = 0, r = 0, t = 0; g < G; g++) {
        const int64_t n = offsets[g + 1] - offsets[g];
        if (n > 0 && n <= max_tokens) {
            groups[k] = (int32_t)g;
            first[k] = r;
            atomic_init(&j->done1[k], 0);
            tbase[k] = tiles && n >= AMX_MIN ? t : -1;
            t += tbase[k] >= 0 ? (n + AMX_T - 1) / AMX_T : 0;
            for (int64_t i = offsets[g]; i < offsets[g + 1]; i++, r++) {
                x_row[r] = rows[i];
                row_gi[r] = (int32_t)k;
            }
            k++;
        }
    }
    j->tbase = tbase;
    j->row_gi = row_gi;
    j->xt = (uint8_t *)(base + at[9]);
    j->at = (uint8_t *)(base + at[10]);
    j->xt_bytes = xt_bytes;
    j->at_bytes = at_bytes;
    j->x_src = x;
    j->x_row = x_row;
    j->x_stride = x_stride;
    j->rows_n = rows_n;
    j->first = first;
    j->groups = groups;
    j->off = offsets;
    j->eid = expert_ids;
    j->H = H;
    j->F = F;
    j->R = R;
    j->Fp = Fp;
    j->out_stride = out_stride;
    j->FB = FB;
    j->HB = HB;
    j->nb1 = nb1;
    j->nb2 = nb2;
    j->n1 = ng * nb1;
    const int64_t quartered = last_round(ng * nb2, threads);
    j->coarse = total - quartered;
    j->total = total + 3 * quartered;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
    atomic_store_explicit(&j->next_row, 0, memory_order_relaxed);
    atomic_store_explicit(&j->rows_split, 0, memory_order_relaxed);
    /* Torch works next on the skipped groups: spinning workers would only get in its way. */
    TRACE(trace.start = now_ns());
    pool_run(run_job_fn, j, threads, *skipped == 0);
    TRACE(trace.exit = now_ns());
    end_call();
    return OK;
}

/*
 * The same from a router's output as it stands: pair p (token p / k, rank p % k) goes to expert
 * pair_expert[p]. The pairs of the experts listed in cpu_experts (n_cpu of them; NULL: every expert) are
 * grouped by expert here, ascending by pair within a group, and each result lands in out row p.
 * The grouping is written to `index` (capacity 2 P + 2 E + 1) as [out_rows | rows | expert_ids |
 * offsets] of M pairs and G groups, and shape receives {M, G}, so that the caller can find the groups
 * left to it (*skipped).
 * Grouping a decode step's few pairs costs nanoseconds here and tens of microseconds in numpy, for
 * every MoE layer of every token. R: moe_experts_forward's (the intermediate rows computed; F: all).
 */
int moe_routed_experts_forward(const bf16 *x, int64_t N, int64_t x_stride, int64_t H,
                               const int64_t *pair_expert, int64_t P, int64_t k,
                               const int64_t *cpu_experts, int64_t n_cpu, const bf16 *gate_up, const bf16 *down,
                               int64_t E, int64_t F, bf16 *out, int64_t out_stride, int64_t out_len,
                               int64_t max_tokens, int64_t *index, int64_t shape[2], int64_t *skipped, int64_t R) {
    *skipped = 0;
    shape[0] = shape[1] = 0;
    if (F > 0 && (R <= 0 || R > F || (R < F && R % 32))) return BAD_ROWS;
    if (k < 1 || P < 0 || P > N * k) return BAD_ROW;
    if (P > out_len) return BAD_OUT_ROW;
    int64_t M, G;
    const int grouped = group_routed_pairs(pair_expert, P, k, cpu_experts, n_cpu, E, index, &M, &G);
    if (grouped != 0) return grouped;
    int64_t *out_rows = index, *rows = index + M, *expert_ids = index + 2 * M, *offsets = expert_ids + G;
    shape[0] = M;
    shape[1] = G;
    return moe_experts_forward(x, N, x_stride, H, rows, M, expert_ids, offsets, G, gate_up, down, E, F, out,
                               out_stride, out_rows, out_len, max_tokens, skipped, R);
}

void moe_set_threads(int n) { pool_set_threads(n); }
int moe_get_threads(void) { return pool_get_threads(); }
void moe_set_spin_us(int64_t us) { pool_set_spin_us(us); }
/* The pool for other kernels of this process (cpu_quant.c): threads <= 0 means moe_set_threads' setting. */
void moe_pool_run(pool_fn fn, void *arg, int threads, int linger) { pool_run(fn, arg, threads, linger); }

/* This build's instructions present and the OS saving their registers: AVX512F/BW/VL with the opmask and zmm
 * registers, or in the AVX2 build AVX2 and FMA with the ymm registers. */
int moe_cpu_supported(void);

/* 0 where AMX-BF16 may be used: AMX-TILE and AMX-BF16 with the OS saving the tile state and Linux granting this
 * process the tile data, and the AVX-512 path (the epilogues are AVX-512); else why not (native_amx.h's
 * amx_os_status; -3: no AVX-512 path). Built with -DMOE_AMX_EMULATE: the AVX-512 path is enough. */
int moe_amx_status(void) {
    static int known, checked;
    if (checked) return known;
    known = -3;
#if defined(MOE_AVX2)
#elif defined(NATIVE_AMX_EMULATE)
    if (moe_cpu_supported()) known = 0;
#else
    if (moe_cpu_supported()) known = amx_os_status(1u << 22 /* AMX-BF16 */);
#endif
    checked = 1;
    return known;
}
int moe_amx_supported(void) { return moe_amx_status() == 0; }

/* 1: AMX for groups of AMX_MIN+ tokens and the FMAs for the rest, 0: the FMAs only. Returns the path in use
 * (AMX where the CPU or OS lacks it is refused for 0); the AVX2 build has one path, 2. */
int moe_get_path(void);
int moe_set_path(int path) {
    use_amx = path >= 1 && moe_amx_supported();
    return moe_get_path();
}
#ifdef MOE_AVX2
int moe_get_path(void) { return 2; }
#else
int moe_get_path(void) { return use_amx; }
#endif

#if defined(NATIVE_AMX_EMULATE) && !defined(MOE_AVX2)
/* The emulated build's count of tdpbf16ps done so far, for tests: which groups went to the tiles. */
int64_t moe_amx_emulated_dps(void) { return atomic_load(&emu_dps); }
#endif

int moe_cpu_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
#ifdef MOE_AVX2
    if ((lo & 0x6) != 0x6 || !(c & (1u << 12))) return 0; /* XMM and YMM state; FMA */
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 5)); /* AVX2 */
#else
    if ((lo & 0xe6) != 0xe6) return 0; /* XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned need = (1u << 16) | (1u << 30) | (1u << 31); /* F, BW, VL */
    return (b & need) == need;
#endif
}
