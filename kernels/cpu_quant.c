/*
 * All CPU-resident experts of one MoE layer for one step, from packed GGUF blocks (q4_0, q8_0,
 * q4_k, q5_k, q6_k, mxfp4; kernels/quant_formats.py has the layouts), in one parallel region.
 * gpt-oss's experts compute their biases and clamped SwiGLU in the same call (Job's gu_bias ... limit).
 *
 * Shape of a call, as cpu_experts.c for bf16: phase 0 quantises the x rows (shared among the
 * threads); phase-1 items (group, block of F rows) compute gate and up together, act = silu(gate) *
 * up in fp32, and quantise their own slice of the act rows; phase-2 items (group, block of H rows)
 * compute the down projection once their group's phase 1 is done. Items come from one atomic
 * counter, the last round of phase-2 blocks in quarters (QUARTERS). Each weight byte is read from DRAM once per call whatever the token count: an item's
 * rows are worked 4 at a time, 256 weights (one k-quant super-block) at a time, and every token of
 * the group uses them while they are in L1.
 *
 * Arithmetic: the activation rows are quantised to int8 per 32 values (scale = max|x| / 127, round
 * to nearest), as llama.cpp's q8_0 does, and weights are dotted in integers. A finer scale keeps
 * outliers from costing the rest of the row its precision; the tests emulate exactly this.
 *
 * VNNI path (the one that matters): nothing is unpacked to memory. Weights become unsigned bytes in
 * registers, fed to vpdpbusd with the token's signed int8 x; the format's offset (q4_0 8, q8_0 128, q6_k
 * 32) is folded into the accumulator start, xc = -off * (lane sum of x), stored with the quantised row,
 * so each int32 lane holds sum(q_w * q_x) exactly.
 *
 * Whole 256-weight segments (every k-quant row; q4_0 / q8_0 rows but their last K % 256): x is stored
 * in a layout of the weight format's own (quantize_block) such that each of the 16 int32 lanes belongs
 * to one scale block in all four 64-weight chunks of the segment: lane L is block L / 2 (q4_0, q8_0,
 * q4_k, q5_k: 32 weights, two lanes each) or 16-weight group L (q6_k). So the four vpdpbusd of a row and token
 * chain into one int32 accumulator, and the convert, scale product (the row's 16 lane scales times the
 * token's) and FMA happen once per segment instead of once per chunk: per segment, row and token 4
 * vpdpbusd + 3 float ops (+ the q4_k/q5_k min FMA), per segment and row the unpack: q4_0 two 16-bit
 * permutes gather the 8 blocks' nibble bytes (blocks are 18 bytes: every piece starts on an even byte,
 * AVX512BW is enough), a third their scales, then AND / shift; q4_k/q5_k one 64-bit permute of the
 * nibbles per chunk (qword p of chunk m: sub-block p's weights 8m..), q5_k's fifth bits by test-mask
 * add, the 6-bit scale pairs decoded in one xmm; q6_k a 32-bit permute of the low nibbles and one of
 * the high bit pairs per chunk, a rotate to bits 4-5 and one ternary-logic OR; q8_0 an 8 x 4 qword
 * transpose of the 8 blocks (4 inserts, 4 vpermt2q, 4 vshufi64x2) and two 16-bit permutes for the
 * scales. The rest (a q4_0 / q8_0 row's last K % 256) is in order, 64 weights and two blocks per chunk:
 * per chunk, row and token vpdpbusd, convert, scale product, FMA. Register tiles: 4 rows x 1-4 tokens, 2 rows x 5-8 (more
 * tokens: tiles of 8 over the same rows, from L1/L2); every array of vectors in a tile is fixed-size
 * and indexed by unrolled loops so the accumulators stay in registers (the variable-length arrays
 * this code had put each one in memory: a load and a store around every FMA). One transposed
 * horizontal sum per 4 rows and token. Each segment prefetches PREFETCH bytes ahead along its rows, past the
 * part of a long row the tile reads on into the next tile's row (prefetch_next).
 *
 * Per segment a tile unpacks all its rows first, then loops over tokens outside the rows, so a token's x segment is
 * loaded once for the tile's rows rather than once per row (at 4 x 4 GCC keeps some unpacked weights on the stack;
 * still faster). A server core that is slow at this kernel, with 16 threads at 4 tokens an expert bound by it,
 * gained from the token-outer order; one token, bound by RAM, did not change (docs/measurements.md, "The packed CPU
 * kernel"). The same arithmetic in the same order: results equal bit for bit.
 *
 * Against the in-register per-chunk kernel before this layout, one core computing rows resident in L2 (the
 * instruction-bound rate) read about twice the packed bytes a second at every token count (docs/measurements.md,
 * "The packed CPU kernel").
 *
 * AMX path (mq_set_path(2), opt-in: MOEDESK_QUANT_PATH=amx): experts with AMX_MIN+ tokens on AMX-INT8 tiles
 * with the same arithmetic, the rest on VNNI; see the AMX section. Not yet run on AMX hardware: its logic is
 * tested through an emulated build (-DMQ_AMX_EMULATE).
 *
 * AVX2 path (fallback, CPUs without AVX-512): weights unpacked in registers as on the VNNI path, 256 bits wide,
 * with maddubs for vpdpbusd (the AVX2 lane path; its section says how), several times the rate of the path it
 * replaced (before 511723d: each segment unpacked to signed bytes in memory first, then float work per 32 weights).
 * Built with -DMQ_AVXVNNI (cpu_quant.py does where the CPU has AVX-VNNI: Intel's desktop cores since Alder Lake,
 * AMD's since Zen 4), the lane path's products go through vpdpbusd's VEX form, a little faster still
 * (docs/measurements.md, "The packed CPU kernel").
 * The path is picked at load (mq_set_path; cpu_quant.py: VNNI where cpuid says so,
 * MOEDESK_QUANT_PATH=avx2 forces the fallback). The library is built for AVX2+FMA+F16C; the VNNI
 * functions carry their own target attribute, so one build serves both.
 *
 * Threads: the pool of native_pool.h. Where cpu_experts' library is loaded, cpu_quant.py hands us
 * its moe_pool_run (mq_use_pool), so bf16 and packed layers share one set of workers.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <cpuid.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "native_pool.h"
#include "native_call.h"
#include "routed_pairs.h"
#include "native_exp.h"
#ifdef MQ_AMX_EMULATE
#define NATIVE_AMX_EMULATE
#endif
#include "native_amx.h" /* the tile configuration, instructions and permission request */

typedef uint16_t bf16;

enum { Q4_0 = 0, Q8_0 = 1, Q4_K = 2, Q5_K = 3, Q6_K = 4, MXFP4 = 5, NFMT };
static const int BLOCK[NFMT] = {32, 32, 256, 256, 256, 32};
static const int BLOCK_BYTES[NFMT] = {18, 34, 144, 176, 210, 17};

#define ROWS 4       /* weight rows worked together */
#define TOK 32       /* token rows per pass over a group of rows (more: the rows again, from L2) */
/* Packed weight bytes per work item: small enough to balance, large enough to amortise. 1 MiB beat 256 KiB on
 * Mixtral's large experts and matched or beat it on Qwen3's small ones; 512 KiB and 2 MiB came within a few percent
 * (bench_cpu_quant.py --define; docs/measurements.md, "The packed CPU kernel"). */
#ifndef ITEM_BYTES
#define ITEM_BYTES (1024 * 1024)
#endif
/* The last round of phase-2 blocks in quarters (native_call.h), as cpu_experts.c hands them out: a few percent
 * faster on Mixtral's two experts, within noise on Qwen3's eight small ones (bench_cpu_quant.py --define;
 * docs/measurements.md, "The packed CPU kernel"). QUARTERS=0: whole blocks, for measuring. */
#ifndef QUARTERS
#define QUARTERS 1
#endif

/* Groups handed out most tokens first (BUSIEST_FIRST=0: in expert order, for measuring): with a batch's skewed
 * routing a group's items cost in proportion to its tokens, and the costliest ones taken last would leave threads
 * idle while one finishes them (docs/measurements.md, "Session 60"). BUSIEST_FIRST=2, for measuring: the busiest
 * and the idlest in turns, so that items bound by arithmetic run beside items bound by memory. */
#ifndef BUSIEST_FIRST
#define BUSIEST_FIRST 1
#endif

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* ---------------------------------------------------------------- quantised activation rows */

/*
 * A row of K values (K a multiple of 32), Kc = K rounded up to 64, in one buffer:
 *   i8  xb[Kc]      q = round(x / d) in [-127, 127]; padding q = 0
 *   f32 xd[Kc / 4]  d of each lane of 4 values; padding 0
 *   i32 xc[Kc / 4]  -off * (sum of the lane's 4 q), off the weight format's unsigned offset
 *                   (q4_0 8, q8_0 128, q6_k 32, q4_k/q5_k 0); padding 0
 * in the order of the weights' layout for the path (quantize_block).
 *   f32 xm[Kc / 32] d * sum(q) of each block of 32 (the k-quant min term); padding 0
 */
static int64_t qrow_bytes(int64_t K) { const int64_t Kc = round_up(K, 64); return 3 * Kc + Kc / 8; }
#define XD(row, Kc) ((float *)((row) + (Kc)))
#define XC(row, Kc) ((int32_t *)((row) + 2 * (Kc)))
#define XM(row, Kc) ((float *)((row) + 3 * (Kc)))

static void qrow_pad(uint8_t *row, int64_t K) {
    const int64_t Kc = round_up(K, 64);
    if (Kc == K) return;
    memset(row + K, 0, (size_t)(Kc - K));
    memset(row + Kc + K, 0, (size_t)(Kc - K));
    memset(row + 2 * Kc + K, 0, (size_t)(Kc - K));
    memset(row + 3 * Kc + K / 8, 0, (size_t)(Kc - K) / 8);
}

/* The unsigned offset of each format's weights as the VNNI kernels feed them to vpdpbusd. */
static const int W_OFFSET[NFMT] = {8, 128, 0, 0, 32, 12};

/*
 * Where the VNNI kernels want the 256 values of a whole segment of x (the layouts are the VNNI
 * section's; NATURAL: in order, as the AVX2 path, q8_0 and a q4_0 row's last K % 256 values have them).
 * Every layout keeps a 32-value block's bytes inside its own segment and gives each block two lanes of
 * its own, so a block quantises into place without touching another block's bytes: the phase-1 items
 * that write act rows own whole 32-blocks, not whole segments.
 */
enum { LAY_NATURAL, LAY_Q4_0, LAY_QK, LAY_Q6_K };
static const int SEG_LAYOUT[NFMT] = {LAY_Q4_0, LAY_QK, LAY_QK, LAY_QK, LAY_Q6_K, LAY_Q4_0};
/* quantize_block's fmt for the AVX2 lane path (the AVX2 section): LANE8 | the weights' format. Whole segments
 * in that path's layout, the rest in order as the VNNI path has it (signed q, lane d and offset sums). */
#define LANE8 16

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline int32_t hsum4i(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 32 fp32 values as int8s of scale d = amax / 127, each rounded to nearest (ties to even): the 32 bytes in
 * order, and the same values as int32s, eight a vector, for the sums of q the dot products subtract. */
typedef struct {
    __m256i bytes, q[4];
    float d;
} Quant32;

static inline Quant32 quantize32(const float *v) {
    __m256 a[4], m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; i++) {
        a[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h), id = amax > 0.f ? 127.f / amax : 0.f;
    Quant32 r = {.d = amax / 127.f};
    for (int i = 0; i < 4; i++) r.q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], _mm256_set1_ps(id)));
    /* packs interleave 128-bit halves; the permute puts the 32 bytes back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(r.q[0], r.q[1]), _mm256_packs_epi32(r.q[2], r.q[3]));
    r.bytes = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    return r;
}

/* 32 fp32 values into block b of a quantised row of K values; fmt: the format of the weights the VNNI
 * kernels will dot it with (its offset and segment layout), or LANE8 + that format for the AVX2 lane path. */
static inline void quantize_block(const float *v, uint8_t *row, int64_t K, int64_t b, int fmt) {
    const int64_t Kc = round_up(K, 64);
    const Quant32 qb = quantize32(v);
    const __m256i *q = qb.q;
    const __m256i ordered = qb.bytes;
    const __m256i q01 = _mm256_add_epi32(q[0], q[1]), q23 = _mm256_add_epi32(q[2], q[3]);
    const float d = qb.d;
    XM(row, Kc)[b] = d * (float)hsum8i(_mm256_add_epi32(q01, q23));
    const int lane8 = fmt >= LANE8;
    if (lane8) fmt -= LANE8;
    const int off = W_OFFSET[fmt];
    if (lane8 && b / 8 < K / 256) {
        const int64_t s = b / 8, i = b % 8;
        _Alignas(32) int32_t dw[8];
        _mm256_store_si256((__m256i *)dw, ordered);
        uint8_t *seg = row + 256 * s;
        float *xd = XD(row, Kc) + 64 * s;
        int32_t *xc = XC(row, Kc) + 64 * s;
        if (fmt == Q6_K) { /* half h = i / 4, lanes 2 (i % 4) and the next (16 values each), chunks 4h + c: dword 4e + c of
                            * the block to lane 2 (i % 4) + e of chunk 4h + c; the lanes' d and offset sums */
            const int64_t h = i / 4, L = 2 * (i % 4);
            for (int e = 0; e < 2; e++)
                for (int c = 0; c < 4; c++) memcpy(seg + 32 * (4 * h + c) + 4 * (L + e), &dw[4 * e + c], 4);
            xd[8 * h + L] = xd[8 * h + L + 1] = d;
            xc[8 * h + L] = -off * hsum8i(q01);
            xc[8 * h + L + 1] = -off * hsum8i(q23);
            return;
        }
        /* block i: dword c of its 32 bytes to lane i of chunk c (32 bytes) */
        for (int c = 0; c < 8; c++) memcpy(seg + 32 * c + 4 * i, &dw[c], 4);
        xd[i] = d;
        xc[i] = -off * hsum8i(_mm256_add_epi32(q01, q23));
        return;
    }
    const int lay = !lane8 && b / 8 < K / 256 ? SEG_LAYOUT[fmt] : LAY_NATURAL;
    if (lay == LAY_NATURAL) {
        _mm256_storeu_si256((__m256i *)(row + 32 * b), ordered);
        _mm256_storeu_ps(XD(row, Kc) + 8 * b, _mm256_set1_ps(d));
        /* lane L = q 4L..4L+3: two hadds give lanes 0 2 4 6 | 1 3 5 7, the permute orders them */
        const __m256i l = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
        const __m256i lanes = _mm256_permutevar8x32_epi32(l, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(XC(row, Kc) + 8 * b), _mm256_mullo_epi32(lanes, _mm256_set1_epi32(-off)));
        return;
    }
    /* block i of segment s: its 8-byte groups go to qword i of the segment's four 64-byte chunks, its
     * two lanes (i.e. lanes 2i, 2i + 1 of every chunk) get its d and the offset's lane sums */
    const int64_t s = b / 8, i = b % 8;
    uint8_t *seg = row + 256 * s;
    __m128i lo = _mm256_castsi256_si128(ordered), hi = _mm256_extracti128_si256(ordered, 1);
    int32_t s0, s1;
    if (lay == LAY_Q6_K) { /* chunk m: values 4m..4m+3 and 16+4m..16+4m+3 (the lanes are the 16-value scale groups) */
        const __m128i c01 = _mm_unpacklo_epi32(lo, hi), c23 = _mm_unpackhi_epi32(lo, hi);
        lo = c01;
        hi = c23;
        s0 = hsum8i(q01);
        s1 = hsum8i(q23);
    } else { /* chunk m: values 8m..8m+7 (q4_k, q5_k, q8_0) or 0-7, 16-23, 8-15, 24-31 (q4_0); lane j: the 4 of 8 from 4j */
        if (lay == LAY_Q4_0) {
            const __m128i c02 = _mm_unpacklo_epi64(lo, hi), c13 = _mm_unpackhi_epi64(lo, hi);
            lo = c02;
            hi = c13;
        }
        const __m256i t = _mm256_add_epi32(q01, q23);
        s0 = hsum4i(_mm256_castsi256_si128(t));
        s1 = hsum4i(_mm256_extracti128_si256(t, 1));
    }
    _mm_storel_epi64((__m128i *)(seg + 8 * i), lo);
    _mm_storel_epi64((__m128i *)(seg + 64 + 8 * i), _mm_unpackhi_epi64(lo, lo));
    _mm_storel_epi64((__m128i *)(seg + 128 + 8 * i), hi);
    _mm_storel_epi64((__m128i *)(seg + 192 + 8 * i), _mm_unpackhi_epi64(hi, hi));
    float *xd = XD(row, Kc) + 64 * s + 2 * i;
    int32_t *xc = XC(row, Kc) + 64 * s + 2 * i;
    xd[0] = xd[1] = d;
    xc[0] = -off * s0;
    xc[1] = -off * s1;
}

static inline void bf16_to_f32(const bf16 *src, float *dst, int n) {
    for (int i = 0; i < n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
}

/* ---------------------------------------------------------------- unpacking weights */

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/*
 * mxfp4 (gpt-oss's experts): a block is an E8M0 exponent e and 16 bytes of E2M1 codes, byte j holding weight j in
 * its low nibble and j + 16 in its high one, as q4_0 keeps them. Twice an E2M1 value is an integer in [-12, 12],
 * so a 16-entry table turns a nibble into a byte the integer dot products take as they take q4_0's (offset 12,
 * unsigned for vpdpbusd; signed for AMX), and the block's scale is 2^(e - 128), exact for every e: 2^(e - 128) as
 * float bits, (e - 1) << 23 for e >= 2, the subnormals 2^-127 and 2^-128 for e = 1, 0.
 */
static const int8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  /* 2 fp4 + 12 */
static const int8_t MXFP4_S[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  /* 2 fp4 */

static inline float e8m0(uint8_t e) {
    const uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* e8m0 of 8 exponents (int32 lanes). */
static inline __m256 e8m0_8(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1))));
}

/* The exponents of the 8 blocks from b (17 bytes apart) as one byte each, in order. */
static inline uint64_t mxfp4_exponents(const uint8_t *b) {
    uint64_t e = 0;
    for (int i = 0; i < 8; i++) e |= (uint64_t)b[17 * i] << (8 * i);
    return e;
}

/* ---------------------------------------------------------------- AVX2 lane path: weights unpacked in registers */

/*
 * Where AVX-512 is missing (AMD before Zen 4, Intel's desktop cores), packed weights are unpacked in registers as
 * the VNNI path does, in 256-bit vectors: a whole segment (8 blocks or sub-blocks of 32)
 * as 8 chunks whose int32 lane L holds 4 weights of block L in each chunk (x stored to match: quantize_block with
 * LANE8; q6_k: two halves of 4 chunks, lane L the half's 16-weight scale group L). maddubs of the unsigned
 * weights with signed x gives pairs of at most 2 x max|w| x 127, so runs of chunks add up in 16 bits (4-bit: all
 * eight, 8 x 3810 < 32768; q5_k four, q6_k two) before one madd makes them the lanes' int32 sums; the convert,
 * scale product and FMA happen once per segment (half), row and token, where the path before it did them
 * per 32 weights. One row at a time: 8 weight chunks and up to LANE8_TT tokens' accumulators fill the 16 ymm
 * registers; the weights are unpacked again for each LANE8_TT tokens. q8_0's signed weights: |w| against
 * sign(w) x, a madd per chunk.
 */
#define LANE8_TT 4
#ifdef MQ_AVXVNNI /* CPUs with AVX-VNNI (cpu_quant.py builds this where cpuinfo says avx_vnni): the lane path's
                   * products in vpdpbusd's 256-bit VEX form, straight into int32 */
#pragma GCC push_options
#pragma GCC target("avxvnni")
#endif
typedef struct { __m256i w[8]; __m256 s, mn; } SegW8; /* q6_k: mn the second half's scales */

static inline int16_t ld16(const uint8_t *p) { int16_t v; memcpy(&v, p, 2); return v; }

/* G[m]'s dword L = bytes 4m..4m+3 of the 16 at p + L * stride (L < 8): two unpack steps transpose 8 such pieces. */
static inline __attribute__((always_inline)) void transpose16(const uint8_t *p, int stride, __m256i G[4]) {
    __m256i y[4];
    for (int L = 0; L < 4; L++)
        y[L] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + stride * L))),
                                       _mm_loadu_si128((const __m128i *)(p + stride * (L + 4))), 1);
    const __m256i a01 = _mm256_unpacklo_epi32(y[0], y[1]), b01 = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i a23 = _mm256_unpacklo_epi32(y[2], y[3]), b23 = _mm256_unpackhi_epi32(y[2], y[3]);
    G[0] = _mm256_unpacklo_epi64(a01, a23);
    G[1] = _mm256_unpackhi_epi64(a01, a23);
    G[2] = _mm256_unpacklo_epi64(b01, b23);
    G[3] = _mm256_unpackhi_epi64(b01, b23);
}

/* q4_0: dword L of G[m] is block L's quant bytes 4m..4m+3: their low nibbles are chunk m, their high nibbles
 * chunk m + 4. */
static inline __attribute__((always_inline)) void seg8_q4_0(const uint8_t *b, SegW8 *g) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i G[4];
    transpose16(b + 2, 18, G);
    for (int m = 0; m < 4; m++) {
        g->w[m] = _mm256_and_si256(G[m], lo4);
        g->w[m + 4] = _mm256_and_si256(_mm256_srli_epi16(G[m], 4), lo4);
    }
    g->s = _mm256_cvtph_ps(_mm_setr_epi16(ld16(b), ld16(b + 18), ld16(b + 36), ld16(b + 54), ld16(b + 72),
                                          ld16(b + 90), ld16(b + 108), ld16(b + 126)));
}

/* mxfp4: as q4_0 (blocks 17 bytes apart, the codes from byte 1), each nibble through the offset table. */
static inline __attribute__((always_inline)) void seg8_mxfp4(const uint8_t *b, SegW8 *g) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_U));
    __m256i G[4];
    transpose16(b + 1, 17, G);
    for (int m = 0; m < 4; m++) {
        g->w[m] = _mm256_shuffle_epi8(table, _mm256_and_si256(G[m], lo4));
        g->w[m + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(G[m], 4), lo4));
    }
    g->s = e8m0_8(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mxfp4_exponents(b))));
}

/* q4_k / q5_k: sub-block L is the low (L even) or high nibbles of qs bytes 32 (L / 2)..; with Q[j] those 32 bytes,
 * the transpose gives W[c] = dword c of Q[0..3] | dword c + 4 of Q[0..3], and a permute doubles each dword so that
 * lanes 2j and 2j + 1 both hold Q[j]'s, of which a per-lane shift keeps the right nibble. q5_k: bit L of qh[i] is
 * the fifth bit of sub-block L's weight i, so chunk c takes qh's dword c shifted right by its lane. Scales and
 * mins: the 6-bit pairs as the VNNI path decodes them. */
static inline __attribute__((always_inline)) void seg8_qk(const int fmt, const uint8_t *b, SegW8 *g) {
    const uint8_t *qs = b + (fmt == Q4_K ? 16 : 48);
    __m256i Q[4];
    for (int j = 0; j < 4; j++) Q[j] = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
    const __m256i a01 = _mm256_unpacklo_epi32(Q[0], Q[1]), b01 = _mm256_unpackhi_epi32(Q[0], Q[1]);
    const __m256i a23 = _mm256_unpacklo_epi32(Q[2], Q[3]), b23 = _mm256_unpackhi_epi32(Q[2], Q[3]);
    const __m256i W[4] = {_mm256_unpacklo_epi64(a01, a23), _mm256_unpackhi_epi64(a01, a23),
                          _mm256_unpacklo_epi64(b01, b23), _mm256_unpackhi_epi64(b01, b23)};
    const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), second = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i nibble = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), lo4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        g->w[c] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(W[c], first), nibble), lo4);
        g->w[c + 4] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(W[c], second), nibble), lo4);
    }
    if (fmt == Q5_K) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), bit0 = _mm256_set1_epi8(1);
        for (int c = 0; c < 8; c++) {
            int32_t h;
            memcpy(&h, b + 16 + 4 * c, 4);
            const __m256i fifth = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h), lane), bit0);
            g->w[c] = _mm256_or_si256(g->w[c], _mm256_slli_epi32(fifth, 4));
        }
    }
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i sm = _mm_or_si128(lo, hi); /* bytes 0-7 the scales, 8-15 the mins */
    g->s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_set1_ps(f16(b)));
    g->mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))), _mm256_set1_ps(f16(b + 2)));
}

/* q6_k: two halves of 128 weights, chunks 4h..4h+3 for half h, lane L the half's scale group L (16 weights: 4 in
 * each chunk). Group L = 2 qt + e of half h holds weights 32 qt + 16 e + l (l < 16), whose low nibbles are in ql
 * dword 16h + 8 (qt & 1) + 4e + l / 4 (the high nibbles when qt >= 2) and top bits at 2qt of qh dword 8h + 4e +
 * l / 4: per chunk a permute of each of the half's two ql vectors, a blend, and one permute of its qh vector. */
static inline __attribute__((always_inline)) void seg8_q6_k(const uint8_t *b, SegW8 *g) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    const __m256i nib = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4), top = _mm256_setr_epi32(0, 0, 2, 2, 4, 4, 6, 6);
    for (int h = 0; h < 2; h++) {
        const __m256i A = _mm256_loadu_si256((const __m256i *)(b + 64 * h)), B = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i H = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        for (int c = 0; c < 4; c++) {
            const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), _mm256_set1_epi32(c));
            const __m256i q = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(A, idx), _mm256_permutevar8x32_epi32(B, idx), 0xCC);
            const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(q, nib), lo4);
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(H, idx), top), three);
            g->w[4 * h + c] = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
        }
    }
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    g->s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    g->mn = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
}

/* i + the lane sums of one chunk: unsigned w times signed x, 4 bytes a lane (a single maddubs pair stays below
 * 32768 for every format, q8_0's |w| of 128 included). */
static inline __attribute__((always_inline)) __m256i lane8_add(__m256i i, __m256i w, __m256i x) {
#ifdef MQ_AVXVNNI
    return _mm256_dpbusd_avx_epi32(i, w, x);
#else
    return _mm256_add_epi32(i, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* The int32 lane sums of chunks [c0, c0 + n) of a segment against its x (xr): with maddubs, `run` chunks' products
 * added in 16 bits before each madd (run x 2 x max|w| x 127 < 32768). */
static inline __attribute__((always_inline)) __m256i lane8_dot(const __m256i *w, const uint8_t *xr, int c0, int n, int run) {
    __m256i i = _mm256_setzero_si256();
#ifdef MQ_AVXVNNI
    (void)run;
    for (int c = c0; c < c0 + n; c++) i = _mm256_dpbusd_avx_epi32(i, w[c], _mm256_loadu_si256((const __m256i *)(xr + 32 * c)));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int c = c0; c < c0 + n; c += run) {
        __m256i h = _mm256_maddubs_epi16(w[c], _mm256_loadu_si256((const __m256i *)(xr + 32 * c)));
        for (int k = 1; k < run; k++) h = _mm256_add_epi16(h, _mm256_maddubs_epi16(w[c + k], _mm256_loadu_si256((const __m256i *)(xr + 32 * (c + k)))));
        i = _mm256_add_epi32(i, _mm256_madd_epi16(h, ones));
    }
#endif
    return i;
}

static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* out[t] = dot(row w, token t) for TT tokens of quantised rows x[t] (LANE8 layout), K weights; a q4_0 row's last
 * K % 256 weights in order, one block at a time. Always inlined with constant fmt and TT. */
static inline __attribute__((always_inline)) void lane8_row(const int fmt, const int TT, const uint8_t *w,
                                                            uint8_t *const *x, int64_t K, float *out, int64_t ahead) {
    const int64_t Kc = round_up(K, 64), Kf = K / 256 * 256;
    const int bb = BLOCK_BYTES[fmt], per = BLOCK[fmt];
    __m256 acc[LANE8_TT];
    for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < Kf; k0 += 256) {
        const int64_t at = k0 / per * bb;
        for (int o = 0; o < 256 / per * bb; o += 64) _mm_prefetch((const char *)(w + at + ahead + o), _MM_HINT_T0);
        if (fmt == Q8_0) { /* signed weights: |w| against sign(w) x (pairs of at most 2 x 128 x 127), a madd per
                            * chunk; the segment in two halves of 4 chunks (bytes 0-15, 16-31 of each block) */
            const __m256 d = _mm256_cvtph_ps(_mm_setr_epi16(ld16(w + at), ld16(w + at + 34), ld16(w + at + 68), ld16(w + at + 102),
                                                            ld16(w + at + 136), ld16(w + at + 170), ld16(w + at + 204), ld16(w + at + 238)));
            for (int h = 0; h < 2; h++) {
                __m256i G[4], A[4];
                transpose16(w + at + 2 + 16 * h, 34, G);
                for (int m = 0; m < 4; m++) A[m] = _mm256_sign_epi8(G[m], G[m]);
                for (int t = 0; t < TT; t++) {
                    const uint8_t *xr = x[t] + k0 + 128 * h;
                    __m256i i = _mm256_setzero_si256();
                    for (int m = 0; m < 4; m++)
                        i = lane8_add(i, A[m], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + 32 * m)), G[m]));
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(XD(x[t], Kc) + k0 / 4)), acc[t]);
                }
            }
            continue;
        }
        SegW8 g;
        if (fmt == Q4_0) seg8_q4_0(w + at, &g);
        else if (fmt == MXFP4) seg8_mxfp4(w + at, &g);
        else if (fmt == Q6_K) seg8_q6_k(w + at, &g);
        else seg8_qk(fmt, w + at, &g);
        for (int t = 0; t < TT; t++) {
            const uint8_t *xr = x[t] + k0;
            const int32_t *xc = XC(x[t], Kc) + k0 / 4;
            const float *xd = XD(x[t], Kc) + k0 / 4;
            if (fmt == Q6_K) { /* two halves, each with its own scales, lane sums and d of x; 6-bit weights: runs of 2 */
                const __m256i i0 = _mm256_add_epi32(lane8_dot(g.w, xr, 0, 4, 2), _mm256_loadu_si256((const __m256i *)xc));
                const __m256i i1 = _mm256_add_epi32(lane8_dot(g.w, xr, 4, 4, 2), _mm256_loadu_si256((const __m256i *)(xc + 8)));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(g.s, _mm256_loadu_ps(xd)), acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(g.mn, _mm256_loadu_ps(xd + 8)), acc[t]);
                continue;
            }
            /* 5-bit weights and mxfp4's (up to 24): runs of 4 */
            __m256i i = lane8_dot(g.w, xr, 0, 8, fmt == Q5_K || fmt == MXFP4 ? 4 : 8);
            if (fmt == Q4_0 || fmt == MXFP4) i = _mm256_add_epi32(i, _mm256_loadu_si256((const __m256i *)xc));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(g.s, _mm256_loadu_ps(xd)), acc[t]);
            if (fmt == Q4_K || fmt == Q5_K) acc[t] = _mm256_fnmadd_ps(g.mn, _mm256_loadu_ps(XM(x[t], Kc) + k0 / 32), acc[t]);
        }
    }
    for (int64_t k = Kf; fmt == Q4_0 && k < K; k += 32) { /* natural layout: weights 0-15 low nibbles, 16-31 high */
        const uint8_t *b = w + k / 32 * 18;
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2)), lo4 = _mm_set1_epi8(0x0F);
        const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo4), _mm_and_si128(q, lo4));
        const __m256 d = _mm256_set1_ps(f16(b));
        for (int t = 0; t < TT; t++) {
            const __m256i i = lane8_add(_mm256_loadu_si256((const __m256i *)(XC(x[t], Kc) + k / 4)), wv,
                                        _mm256_loadu_si256((const __m256i *)(x[t] + k)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(XD(x[t], Kc) + k / 4)), acc[t]);
        }
    }
    for (int64_t k = Kf; fmt == MXFP4 && k < K; k += 32) { /* natural layout, as q4_0's */
        const uint8_t *b = w + k / 32 * 17;
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1)), lo4 = _mm_set1_epi8(0x0F);
        const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_U);
        const __m256i wv = _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), lo4)),
                                            _mm_shuffle_epi8(table, _mm_and_si128(q, lo4)));
        const __m256 d = _mm256_set1_ps(e8m0(b[0]));
        for (int t = 0; t < TT; t++) {
            const __m256i i = lane8_add(_mm256_loadu_si256((const __m256i *)(XC(x[t], Kc) + k / 4)), wv,
                                        _mm256_loadu_si256((const __m256i *)(x[t] + k)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(XD(x[t], Kc) + k / 4)), acc[t]);
        }
    }
    for (int64_t k = Kf; fmt == Q8_0 && k < K; k += 32) { /* natural layout, signed weights */
        const uint8_t *b = w + k / 32 * 34;
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(b + 2)), aw = _mm256_sign_epi8(wv, wv);
        const __m256 d = _mm256_set1_ps(f16(b));
        for (int t = 0; t < TT; t++) {
            const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[t] + k)), wv);
            const __m256i i = lane8_add(_mm256_setzero_si256(), aw, xs);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(XD(x[t], Kc) + k / 4)), acc[t]);
        }
    }
    for (int t = 0; t < TT; t++) out[t] = hsum8f(acc[t]);
}

#define LANE8_FORMAT(name, FMT)                                                                                   \
    static void name(const uint8_t *w, uint8_t *const *x, int n, int64_t K, float *out, int64_t ahead) {        \
        for (int t0 = 0; t0 < n; t0 += LANE8_TT) {                                                                \
            switch (n - t0) {                                                                                     \
            case 1: lane8_row(FMT, 1, w, x + t0, K, out + t0, ahead); break;                                      \
            case 2: lane8_row(FMT, 2, w, x + t0, K, out + t0, ahead); break;                                      \
            case 3: lane8_row(FMT, 3, w, x + t0, K, out + t0, ahead); break;                                      \
            default: lane8_row(FMT, 4, w, x + t0, K, out + t0, ahead); break;                                     \
            }                                                                                                     \
        }                                                                                                         \
    }
LANE8_FORMAT(lane8_q4_0, Q4_0)
LANE8_FORMAT(lane8_q4_k, Q4_K)
LANE8_FORMAT(lane8_q5_k, Q5_K)
LANE8_FORMAT(lane8_q6_k, Q6_K)
LANE8_FORMAT(lane8_q8_0, Q8_0)
LANE8_FORMAT(lane8_mxfp4, MXFP4)
#ifdef MQ_AVXVNNI
#pragma GCC pop_options
#endif
typedef void (*lane8_fn)(const uint8_t *, uint8_t *const *, int, int64_t, float *, int64_t);
static const lane8_fn LANE8_DOT[NFMT] = {lane8_q4_0, lane8_q8_0, lane8_q4_k, lane8_q5_k, lane8_q6_k, lane8_mxfp4};

static int use_vnni = 0;
static int use_amx = 0; /* groups of AMX_MIN+ tokens on AMX tiles (mq_set_path) */


/* ---------------------------------------------------------------- VNNI: weights unpacked in registers */

#define VI static inline __attribute__((always_inline)) VNNI

#ifndef PREFETCH
#define PREFETCH 1024 /* bytes ahead along each row (past its end: the rows read next) */
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0 /* a knob for bench_cpu_quant.py --define, as in cpu_experts.c */
#endif
/* Rows of at most this many packed bytes prefetch the next tile's rows at the same column instead: along
 * a short row most of the prefetches land on rows the same tile is reading (Qwen3-30B-A3B's q4_k rows are
 * 1152 and 432 bytes). The bf16 kernel measured the same rule on the GPU box (cpu_experts.c). */
#ifndef SHORT_ROW_BYTES
#define SHORT_ROW_BYTES 4096
#endif

/* Prefetch offset from a row's current segment for rows of row_bytes, the next tile starting `step` rows on. */
static inline int64_t prefetch_ahead(int64_t row_bytes, int step) {
    return row_bytes <= SHORT_ROW_BYTES ? step * row_bytes : PREFETCH;
}

/* Long rows: where a row's prefetches go on once they pass the end of the weights the tile reads: into the row
 * the next tile reads in its place, `step` rows on (0: on along memory). Along memory they landed on the rows this
 * tile reads beside it, or, where the GPU computes the rows' last columns (a row split), on those columns, while
 * the next tile's rows started unprefetched. -DPREFETCH_NEXT=0 measures the old way
 * (tests/perf/probe_split_decode.py --define; docs/measurements.md, "The packed CPU kernel"). */
#ifndef PREFETCH_NEXT
#define PREFETCH_NEXT 1
#endif
static inline int64_t prefetch_next(int64_t row_bytes, int step) {
    return PREFETCH_NEXT && row_bytes > SHORT_ROW_BYTES ? step * row_bytes : 0;
}

/* --- natural layout (q8_0 rows, a q4_0 row's last K % 256 weights): 64 weights at a time, lanes 0-7
 * the first block, 8-15 the second; w as vpdpbusd's unsigned bytes, s the 16 lane scales. */

VI __m512 d2_lanes(const uint8_t *b0, const uint8_t *b1, int half) { /* fp16 d at b0, b1: [d0 x8, d1 x8] */
    uint16_t h0, h1 = 0;
    memcpy(&h0, b0, 2);
    if (!half) memcpy(&h1, b1, 2);
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)), _mm_set1_epi16((short)h1), 1);
    return _mm512_cvtph_ps(h);
}

/* 16 lanes of e8m0 (lane 2i, 2i + 1: byte i of the low qword of e): the scales of 8 mxfp4 blocks, two lanes each. */
VI __m512 e8m0_pairs(uint64_t e8) {
    const __m128i v = _mm_cvtsi64_si128((long long)e8);
    const __m512i e = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(1)), tiny, normal));
}

/* Weights k..k+63 of a q4_0 / q8_0 / mxfp4 row (k a multiple of 64); half: only k..k+31 exist. */
VI void chunk_nat(const int fmt, const uint8_t *row, int64_t k, const int half, __m512i *w, __m512 *s) {
    if (fmt == MXFP4) { /* q4_0's order; each nibble through the table */
        const uint8_t *b = row + k / 32 * 17;
        __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 1)));
        if (!half) z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128((const __m128i *)(b + 18)));
        const __m512i nib = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4), _mm512_set1_epi8(0x0F));
        *w = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_U)), nib);
        const __m512 e = e8m0_pairs(0x0101010101010101ull * b[0]);
        *s = half ? _mm512_maskz_mov_ps(0x00FF, e) : _mm512_mask_mov_ps(e, 0xFF00, e8m0_pairs(0x0101010101010101ull * b[17]));
        return;
    }
    if (fmt == Q4_0) {
        const uint8_t *b = row + k / 32 * 18;
        __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 2)));
        if (!half) z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128((const __m128i *)(b + 20)));
        /* [q0 q0 q1 q1] -> [q0 lo, q0 hi, q1 lo, q1 hi]: weights in order */
        *w = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4), _mm512_set1_epi8(0x0F));
        *s = d2_lanes(b, b + 18, half);
    } else {
        const uint8_t *b = row + k / 32 * 34;
        __m512i z = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2)));
        if (!half) z = _mm512_inserti64x4(z, _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
        *w = _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80)); /* q + 128 */
        *s = d2_lanes(b, b + 34, half);
    }
}

/* --- whole segments of 256 weights: the four 64-weight chunks w[m] share their lanes' blocks (lane L:
 * block L / 2 of the segment, or 16-weight group L for q6_k), so one int32 lane sums all four and is
 * converted and scaled once per segment. s: the 16 lane scales; mn (q4_k, q5_k): lanes 0-7 dmin * min. */
typedef struct { __m512i w[4]; __m512 s, mn; } SegW;

static const uint16_t Q4_0_PIECES[32] = { /* qword i: bytes 18i+2.. of the segment, from [0,64) and [72,136) */
    1, 2, 3, 4, 10, 11, 12, 13, 19, 20, 21, 22, 28, 29, 30, 31,
    33, 34, 35, 36, 42, 43, 44, 45, 51, 52, 53, 54, 60, 61, 62, 63};
static const uint16_t Q4_0_SCALES[32] = { /* words 2i, 2i+1: d of block i, from the same two tables */
    0, 0, 9, 9, 18, 18, 27, 27, 32, 32, 41, 41, 50, 50, 59, 59};

/* q4_0: qword i of chunk 0 is the low nibbles of block i's bytes 0-7 (weights 0-7), chunk 1 their high
 * nibbles (16-23), chunks 2, 3 the same of bytes 8-15 (8-15, 24-31). The byte gathers are 16-bit permutes
 * (AVX512BW: the blocks are 18 bytes, so every piece starts on an even byte), all loads inside the segment. */
VI void seg_q4_0(const uint8_t *b, SegW *g) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), pieces = _mm512_loadu_si512(Q4_0_PIECES);
    const __m512i A = _mm512_loadu_si512(b), B = _mm512_loadu_si512(b + 72);
    const __m512i c0 = _mm512_permutex2var_epi16(A, pieces, B);
    const __m512i c1 = _mm512_permutex2var_epi16(_mm512_loadu_si512(b + 8), pieces, _mm512_loadu_si512(b + 80));
    g->w[0] = _mm512_and_si512(c0, lo4);
    g->w[1] = _mm512_and_si512(_mm512_srli_epi16(c0, 4), lo4);
    g->w[2] = _mm512_and_si512(c1, lo4);
    g->w[3] = _mm512_and_si512(_mm512_srli_epi16(c1, 4), lo4);
    g->s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(A, _mm512_loadu_si512(Q4_0_SCALES), B)));
}

static const uint16_t Q8_0_SCALES[2][32] = { /* words 2i, 2i+1: d of block i; blocks 0-3 from [0,128), 4-7 from [128,256) */
    {0, 0, 17, 17, 34, 34, 51, 51},
    {0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 21, 21, 38, 38, 55, 55}};

/* q8_0: qword i of chunk m is block i's bytes 8m..8m+7 (an 8 x 4 qword transpose of the 8 blocks' 32
 * bytes), + 128 for vpdpbusd's unsigned side. */
VI void seg_q8_0(const uint8_t *b, SegW *g) {
    __m512i p[4]; /* blocks 2k, 2k + 1 */
    for (int k = 0; k < 4; k++)
        p[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 68 * k + 2))),
                                  _mm256_loadu_si256((const __m256i *)(b + 68 * k + 36)), 1);
    const __m512i lo = _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13), hi = _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i a01 = _mm512_permutex2var_epi64(p[0], lo, p[1]), a23 = _mm512_permutex2var_epi64(p[0], hi, p[1]);
    const __m512i b01 = _mm512_permutex2var_epi64(p[2], lo, p[3]), b23 = _mm512_permutex2var_epi64(p[2], hi, p[3]);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    g->w[0] = _mm512_xor_si512(_mm512_shuffle_i64x2(a01, b01, 0x44), flip);
    g->w[1] = _mm512_xor_si512(_mm512_shuffle_i64x2(a01, b01, 0xEE), flip);
    g->w[2] = _mm512_xor_si512(_mm512_shuffle_i64x2(a23, b23, 0x44), flip);
    g->w[3] = _mm512_xor_si512(_mm512_shuffle_i64x2(a23, b23, 0xEE), flip);
    const __m512i d03 = _mm512_permutex2var_epi16(_mm512_loadu_si512(b), _mm512_loadu_si512(Q8_0_SCALES[0]), _mm512_loadu_si512(b + 64));
    const __m512i d47 = _mm512_permutex2var_epi16(_mm512_loadu_si512(b + 128), _mm512_loadu_si512(Q8_0_SCALES[1]), _mm512_loadu_si512(b + 192));
    g->s = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_mask_mov_epi16(d03, 0xFF00, d47)));
}

/* AVX512-VBMI's two-table byte permute (Ice Lake, Sapphire Rapids and later; Zen 4). In asm: the library's VNNI
 * functions are built for AVX512F/BW/VL/VNNI, which the compiler would not let use it; it runs only where
 * mq_set_path found VBMI (use_vbmi). */
static int use_vbmi = 0;
VI __m512i permt2b(__m512i a, __m512i idx, __m512i b) {
    __asm__("vpermt2b %[b], %[idx], %[a]" : [a] "+v"(a) : [idx] "v"(idx), [b] "v"(b));
    return a;
}

/* qword i: bytes 17i + 1 .. 17i + 8 (block i's code bytes 0-7 from a segment; 8-15 from 8 bytes on); words
 * 32 + i: byte 17i twice (block i's exponent, for its two lanes) */
static const uint8_t MXFP4_GATHER[64] = {
    1, 2, 3, 4, 5, 6, 7, 8, 18, 19, 20, 21, 22, 23, 24, 25, 35, 36, 37, 38, 39, 40, 41, 42,
    52, 53, 54, 55, 56, 57, 58, 59, 69, 70, 71, 72, 73, 74, 75, 76, 86, 87, 88, 89, 90, 91, 92, 93,
    103, 104, 105, 106, 107, 108, 109, 110, 120, 121, 122, 123, 124, 125, 126, 127};
static const uint8_t MXFP4_EXPONENTS[16] = {0, 0, 17, 17, 34, 34, 51, 51, 68, 68, 85, 85, 102, 102, 119, 119};

/* mxfp4: q4_0's layout (qword i of chunks 0, 1: the low, high nibbles of block i's code bytes 0-7; chunks 2, 3 of
 * bytes 8-15); the nibbles through the table, the scales 2^(e - 128) by scalef (exact, subnormals included).
 * The blocks are 17 bytes, so the pieces start on odd bytes: with VBMI one byte permute per pair of chunks and one
 * for the exponents; without, four 16-byte loads per zmm, then a 64-bit permute per pair of chunks, and the
 * exponents one by one. */
VI void seg_mxfp4(const uint8_t *b, SegW *g) {
    __m512i c0, c1;
    __m128i e2;
    if (use_vbmi) {
        const __m512i idx = _mm512_loadu_si512(MXFP4_GATHER), A = _mm512_loadu_si512(b), B = _mm512_loadu_si512(b + 64);
        c0 = permt2b(A, idx, B);
        c1 = permt2b(_mm512_loadu_si512(b + 8), idx, _mm512_loadu_si512(b + 72));
        e2 = _mm512_castsi512_si128(permt2b(A, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)MXFP4_EXPONENTS)), B));
    } else {
        __m512i Z[2];
        for (int h = 0; h < 2; h++) {
            const uint8_t *p = b + 68 * h + 1;
            Z[h] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
            Z[h] = _mm512_inserti32x4(Z[h], _mm_loadu_si128((const __m128i *)(p + 17)), 1);
            Z[h] = _mm512_inserti32x4(Z[h], _mm_loadu_si128((const __m128i *)(p + 34)), 2);
            Z[h] = _mm512_inserti32x4(Z[h], _mm_loadu_si128((const __m128i *)(p + 51)), 3);
        }
        c0 = _mm512_permutex2var_epi64(Z[0], _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), Z[1]);
        c1 = _mm512_permutex2var_epi64(Z[0], _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), Z[1]);
        const __m128i v = _mm_cvtsi64_si128((long long)mxfp4_exponents(b));
        e2 = _mm_unpacklo_epi8(v, v);
    }
    const __m512i lo4 = _mm512_set1_epi8(0x0F), table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_U));
    g->w[0] = _mm512_shuffle_epi8(table, _mm512_and_si512(c0, lo4));
    g->w[1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(c0, 4), lo4));
    g->w[2] = _mm512_shuffle_epi8(table, _mm512_and_si512(c1, lo4));
    g->w[3] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(c1, 4), lo4));
    g->s = _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e2)), _mm512_set1_ps(128.f)));
}

/* q4_k / q5_k: sub-block p = 2c + h is the low (h 0) or high (h 1) nibbles of bytes 32c.. of qs; qword p of
 * chunk m is its weights 8m..8m+7, one 64-bit permute of qs per chunk. q5_k: bit p of qh[8m..8m+7] is
 * their fifth bit. Scales and mins: the 6-bit pairs, four bytes at a time. */
VI void seg_qk(const int fmt, const uint8_t *b, SegW *g) {
    const uint8_t *qs = b + (fmt == Q4_K ? 16 : 48);
    const __m512i Q0 = _mm512_loadu_si512(qs), Q1 = _mm512_loadu_si512(qs + 64), lo4 = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < 4; m++) {
        const __m512i idx = _mm512_add_epi64(_mm512_setr_epi64(0, 0, 4, 4, 8, 8, 12, 12), _mm512_set1_epi64(m));
        const __m512i z = _mm512_permutex2var_epi64(Q0, idx, Q1);
        __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xF0F0F0F0u, z, 4), lo4);
        if (fmt == Q5_K) {
            uint64_t h;
            memcpy(&h, b + 16 + 8 * m, 8);
            const __m512i bit = _mm512_setr_epi64(0x0101010101010101ll, 0x0202020202020202ll, 0x0404040404040404ll, 0x0808080808080808ll,
                                                  0x1010101010101010ll, 0x2020202020202020ll, 0x4040404040404040ll, (long long)0x8080808080808080ull);
            q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(_mm512_set1_epi64((long long)h), bit), q, _mm512_set1_epi8(16));
        }
        g->w[m] = q;
    }
    /* the 6-bit pairs from dwords a, c, e of the 12 bytes: scales [a & 63, (e & 15) | (a >> 6) << 4], mins
     * [c & 63, (e >> 4) | (c >> 6) << 4], each byte of a dword one sub-block; bytes 16-19 are not used */
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4)), /* a e c e */
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)); /* a a c c */
    const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(lo, hi)));
    uint32_t d2;
    memcpy(&d2, b, 4);
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d2))));
    const __m512 sv = _mm512_mul_ps(sm, dd); /* lanes 0-7 d * scale_p, 8-15 dmin * min_p */
    g->s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), sv);
    g->mn = _mm512_maskz_permutexvar_ps(0x00FF, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0), sv);
}

/* q6_k: lane L of chunk m is weights 16L + 4m.. (scale group L). Weight n = 32 qt + l of half h (L = 8h +
 * 2qt + e, l = 16e + 4m..) has its low nibble in ql[64h + 32(qt & 1) + l] (high half when qt >= 2) and
 * its top bits at 2qt of qh[32h + l]: one 32-bit permute of ql and one of qh per chunk, a rotate brings
 * each lane's two bits to 4-5. */
VI void seg_q6_k(const uint8_t *b, SegW *g) {
    const __m512i L0 = _mm512_loadu_si512(b), L1 = _mm512_loadu_si512(b + 64), H = _mm512_loadu_si512(b + 128);
    const __m512i ql_idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 16, 20, 24, 28, 16, 20, 24, 28);
    const __m512i qh_idx = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 8, 12, 8, 12, 8, 12, 8, 12);
    const __m512i rot = _mm512_setr_epi32(4, 4, 2, 2, 0, 0, 30, 30, 4, 4, 2, 2, 0, 0, 30, 30);
    for (int m = 0; m < 4; m++) {
        const __m512i mm = _mm512_set1_epi32(m);
        __m512i lo = _mm512_permutex2var_epi32(L0, _mm512_add_epi32(ql_idx, mm), L1);
        lo = _mm512_and_si512(_mm512_mask_srli_epi32(lo, 0xF0F0, lo, 4), _mm512_set1_epi8(0x0F));
        const __m512i hi = _mm512_rolv_epi32(_mm512_permutexvar_epi32(_mm512_add_epi32(qh_idx, mm), H), rot);
        g->w[m] = _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x30), 0xF8); /* lo | (hi & 0x30) */
    }
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
    g->s = _mm512_mul_ps(sc, _mm512_set1_ps(f16(b + 208)));
}

VI void seg_unpack(const int fmt, const uint8_t *b, SegW *g) {
    if (fmt == Q4_0) seg_q4_0(b, g);
    else if (fmt == MXFP4) seg_mxfp4(b, g);
    else if (fmt == Q8_0) seg_q8_0(b, g);
    else if (fmt == Q6_K) seg_q6_k(b, g);
    else seg_qk(fmt, b, g);
}

/* Lane r of the result: the sum of a_r's 16 lanes. */
VI __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xDD));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
    c = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), c));
}

/* Row w's prefetch address for its bytes from `at`: ahead bytes on, or past the `used` bytes the tile reads, that
 * far into the row `next` bytes away (prefetch_next). */
VI const char *prefetch_at(const uint8_t *w, int64_t at, int64_t ahead, int64_t used, int64_t next) {
    const int64_t p = at + ahead;
    return (const char *)(w + (next && p >= used ? p - used + next : p));
}

/*
 * out[r * ostride + t] = dot(row w[r], token t) for R rows and TT tokens (x[t]: quantised rows laid out
 * for fmt), K weights. Always inlined with constant fmt, R, TT, and every array of vectors fixed-size
 * and indexed by unrolled loops, so that the R x TT accumulators stay in registers (variable-length
 * arrays here put every accumulator in memory: 3 memory operations per FMA).
 */
VI void vnni_tile(const int fmt, const int R, const int TT, const uint8_t *const *w, uint8_t *const *x, int64_t K,
                  float *out, int ostride, int64_t ahead, int64_t next) {
    const int64_t Kc = round_up(K, 64);
    const int64_t Kf = SEG_LAYOUT[fmt] != LAY_NATURAL ? K / 256 * 256 : 0; /* whole segments */
    const int has_off = W_OFFSET[fmt] != 0, mins = fmt == Q4_K || fmt == Q5_K;
    const int bb = BLOCK_BYTES[fmt], per = BLOCK[fmt];
    const int64_t used = K / per * bb;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < Kf; k0 += 256) {
        const int64_t at = k0 / per * bb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int o = 0; o < 256 / per * bb; o += 64) _mm_prefetch(prefetch_at(w[r], at + o, ahead, used, next), PREFETCH_HINT);
#ifdef MQ_READ_ONLY /* bench_cpu_quant.py --define ro=-DMQ_READ_ONLY: the same reads of whole segments without the
                     * arithmetic (wrong results), the memory's ceiling for this traversal */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_ternarylogic_epi32(_mm512_loadu_si512(w[r] + at), _mm512_loadu_si512(w[r] + at + 64),
                                                        _mm512_loadu_si512(w[r] + at + 256 / per * bb - 64), 0x96);
            acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_castsi512_ps(v));
        }
        continue;
#endif
        SegW g[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) seg_unpack(fmt, w[r] + at, &g[r]);
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const uint8_t *xr = x[t] + k0;
            const __m512i xc = has_off ? _mm512_loadu_si512(XC(x[t], Kc) + k0 / 4) : _mm512_setzero_si512();
            __m512i i[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) i[r] = xc;
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
                const __m512i xv = _mm512_loadu_si512(xr + 64 * m);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) i[r] = _mm512_dpbusd_epi32(i[r], g[r].w[m], xv);
            }
            const __m512 xd = _mm512_loadu_ps(XD(x[t], Kc) + k0 / 4);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[r]), _mm512_mul_ps(g[r].s, xd), acc[r][t]);
            if (mins) {
                const __m512 xm = _mm512_maskz_loadu_ps(0x00FF, XM(x[t], Kc) + k0 / 32);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][t] = _mm512_fnmadd_ps(g[r].mn, xm, acc[r][t]);
            }
        }
    }
    for (int64_t k = Kf; (fmt == Q4_0 || fmt == Q8_0 || fmt == MXFP4) && k < K; k += 64) { /* natural layout (k-quant rows are whole segments) */
        const int half = K - k == 32;
        const int64_t at = k / per * bb;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 2
            for (int o = 0; o < 2 * bb; o += 64) _mm_prefetch(prefetch_at(w[r], at + o, ahead, used, next), PREFETCH_HINT);
        __m512i wv[4];
        __m512 s[4];
        if (half) {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) chunk_nat(fmt, w[r], k, 1, &wv[r], &s[r]);
        } else {
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) chunk_nat(fmt, w[r], k, 0, &wv[r], &s[r]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            const __m512i xv = _mm512_loadu_si512(x[t] + k);
            const __m512 xd = _mm512_loadu_ps(XD(x[t], Kc) + k / 4);
            const __m512i xc = _mm512_loadu_si512(XC(x[t], Kc) + k / 4);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(xc, wv[r], xv)), _mm512_mul_ps(s[r], xd), acc[r][t]);
        }
    }
    float v[4];
    if (R == 4) {
#pragma GCC unroll 8
        for (int t = 0; t < TT; t++) {
            _mm_storeu_ps(v, sum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
            for (int r = 0; r < 4; r++) out[r * ostride + t] = v[r];
        }
    } else { /* 2 rows: two tokens per transposed sum (one vector reduced alone cost as much as a 256-weight dot) */
#pragma GCC unroll 4
        for (int t = 0; t < TT; t += 2) {
            const __m512 z = _mm512_setzero_ps();
            _mm_storeu_ps(v, sum4(acc[0][t], acc[1][t], t + 1 < TT ? acc[0][t + 1] : z, t + 1 < TT ? acc[1][t + 1] : z));
            out[t] = v[0];
            out[ostride + t] = v[1];
            if (t + 1 < TT) {
                out[t + 1] = v[2];
                out[ostride + t + 1] = v[3];
            }
        }
    }
}

/* One format's tiles: 4 rows x 1-4 tokens, 2 rows x 5-8 (at most 16 accumulators). 1 row x 9-16 tokens was
 * slower (docs/measurements.md, "The packed CPU kernel"): x read from L2 once per row. */
#define VNNI_FORMAT(name, FMT)                                                                                    \
    static VNNI void name(const uint8_t *const *w, uint8_t *const *x, int n, int64_t K, float *out, int os, int64_t ah, \
                          int64_t nx) {                                                                           \
        switch (n) {                                                                                              \
        case 1: vnni_tile(FMT, 4, 1, w, x, K, out, os, ah, nx); break;                                            \
        case 2: vnni_tile(FMT, 4, 2, w, x, K, out, os, ah, nx); break;                                            \
        case 3: vnni_tile(FMT, 4, 3, w, x, K, out, os, ah, nx); break;                                            \
        case 4: vnni_tile(FMT, 4, 4, w, x, K, out, os, ah, nx); break;                                            \
        default:                                                                                                  \
            for (int r = 0; r < 4; r += 2) {                                                                      \
                switch (n) {                                                                                      \
                case 5: vnni_tile(FMT, 2, 5, w + r, x, K, out + r * os, os, ah, nx); break;                       \
                case 6: vnni_tile(FMT, 2, 6, w + r, x, K, out + r * os, os, ah, nx); break;                       \
                case 7: vnni_tile(FMT, 2, 7, w + r, x, K, out + r * os, os, ah, nx); break;                       \
                default: vnni_tile(FMT, 2, 8, w + r, x, K, out + r * os, os, ah, nx); break;                      \
                }                                                                                                 \
            }                                                                                                     \
            break;                                                                                                \
        }                                                                                                         \
    }
VNNI_FORMAT(vnni_q4_0, Q4_0)
VNNI_FORMAT(vnni_q8_0, Q8_0)
VNNI_FORMAT(vnni_q4_k, Q4_K)
VNNI_FORMAT(vnni_q5_k, Q5_K)
VNNI_FORMAT(vnni_q6_k, Q6_K)
VNNI_FORMAT(vnni_mxfp4, MXFP4)

#ifndef MAX_TT
#define MAX_TT 8
#endif
typedef void (*vnni_fn)(const uint8_t *const *, uint8_t *const *, int, int64_t, float *, int, int64_t, int64_t);
static const vnni_fn VNNI_DOT[NFMT] = {vnni_q4_0, vnni_q8_0, vnni_q4_k, vnni_q5_k, vnni_q6_k, vnni_mxfp4};

/*
 * out[r * n + t] = dot(row rows[r] of W, token row t) for ROWS weight rows (indices may repeat) and n
 * quantised token rows of K values (n <= TOK). ahead, next: prefetch_ahead, prefetch_next (the VNNI path's tiles; the
 * AVX2 path reads one row after the other and prefetches along memory).
 */
static inline void rows_dot(int fmt, const uint8_t *W, int64_t row_bytes, int64_t K, const int64_t rows[ROWS],
                            uint8_t *const *xq, int n, float *out, int64_t ahead, int64_t next) {
    if (!use_vnni) {
        for (int r = 0; r < ROWS; r++) LANE8_DOT[fmt](W + rows[r] * row_bytes, xq, n, K, out + r * n, ahead);
        return;
    }
    const uint8_t *w[ROWS];
    for (int r = 0; r < ROWS; r++) w[r] = W + rows[r] * row_bytes;
    for (int t0 = 0; t0 < n;) { /* tiles of MAX_TT tokens, the rest in one tile */
        const int tn = n - t0 > MAX_TT ? MAX_TT : n - t0;
        VNNI_DOT[fmt](w, xq + t0, tn, K, out + t0, n, ahead, next);
        t0 += tn;
    }
}

/* ---------------------------------------------------------------- AMX-INT8: groups of AMX_MIN+ tokens */

/*
 * The same arithmetic as the VNNI path (x and act rows quantised per 32, an exact integer dot per 32-block,
 * then the block's scales in fp32), for 16 weight rows x 16 tokens at a time: tdpbssd per 32-block into one
 * int32 C tile, then an epilogue converts its 16 x 16 sums and accumulates them scaled into 16 zmm (one per
 * row, a lane per token). A group's x / act rows are quantised straight into B-tile order (amx_quantize) so
 * B tiles load as they are; a row's weights are unpacked per 256 to signed bytes (q4_0 q - 8, q8_0 as stored,
 * q4_k / q5_k q, mxfp4 twice the E2M1 value) in an L1 buffer that the A tile loads. q6_k's 16-weight scales would halve the block and
 * double the epilogue: q6_k stays on the VNNI path. Chosen by mq_set_path(2) where the CPU and OS allow
 * (mq_amx_supported); built with -DMQ_AMX_EMULATE the tile instructions are emulated in C, so that the
 * layouts and the epilogue are tested on CPUs without AMX (tests/kernels/test_cpu_quant_amx.py).
 */
#ifndef AMX_MIN
#define AMX_MIN 8 /* tokens of a group from which it goes to AMX */
#endif
#define AMX_T 16 /* tokens per tile */

/* A token tile of a K-value row set: q as B tiles (block b: 8 rows of 16 tokens x 4 bytes), then per block
 * the 16 tokens' d and d * sum(q). */
static int64_t amx_tile_bytes(int64_t K) { return 16 * K + 2 * (K / 32) * 64; }
#define AMX_XD(tile, K) ((float *)((tile) + 16 * (K)))
#define AMX_XM(tile, K) ((float *)((tile) + 16 * (K) + (K) / 32 * 64))

static inline int amx_format(int fmt) { return fmt != Q6_K; }

/* 32 fp32 values as block b of token t (0-15) of a token tile, rounded as quantize_block rounds (quantize32). */
static inline void amx_quantize(const float *v, uint8_t *tile, int64_t K, int64_t b, int t) {
    const Quant32 q = quantize32(v);
    _Alignas(32) uint32_t dw[8];
    _mm256_store_si256((__m256i *)dw, q.bytes);
    for (int i = 0; i < 8; i++) memcpy(tile + (8 * b + i) * 64 + 4 * t, &dw[i], 4);
    AMX_XD(tile, K)[16 * b + t] = q.d;
    AMX_XM(tile, K)[16 * b + t] = q.d * (float)hsum8i(_mm256_add_epi32(_mm256_add_epi32(q.q[0], q.q[1]),
                                                                        _mm256_add_epi32(q.q[2], q.q[3])));
}

#define AMXF __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

/* tmm0: C, 16 rows x 16 int32; tmm1: A, 16 weight rows x 32 bytes; tmm2: B, 8 rows (32 values / 4) x 16 tokens x 4 */
static const TileCfg AMX_CFG = {.palette = 1, .colsb = {64, 32, 64}, .rows = {16, 16, 8}};

#ifdef MQ_AMX_EMULATE
/* C[m][n] += sum_k sum_i A[m][4k + i] * B[k][4n + i]: B's bytes signed, A's signed (tdpbssd) or not (tdpbusd) */
static void emu_dpb(int c, int a, int b, int a_signed) {
    for (int m = 0; m < emu.cfg.rows[c]; m++)
        for (int n = 0; n < emu.cfg.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &emu.t[c][m][4 * n], 4);
            for (int k = 0; k < emu.cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t w = emu.t[a][m][4 * k + i];
                    acc += (a_signed ? (int8_t)w : w) * (int8_t)emu.t[b][k][4 * n + i];
                }
            memcpy(&emu.t[c][m][4 * n], &acc, 4);
        }
}
#define TILE_DPBSSD(c, a, b) emu_dpb(c, a, b, 1)
#else
#define TILE_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#endif

static AMXF void amx_begin(void) { TILE_CONFIG(&AMX_CFG); }
static AMXF void amx_end(void) { TILE_RELEASE(); }

/* Blocks [b0, b0 + nb) of a packed row, nb <= 8, b0 a multiple of 8 (one 256-weight segment), as signed bytes
 * into a[32 * i], and each block's scale (and, q4_k / q5_k, min) into sc[i] (sc[8 + i]). */
static inline AMXF void amx_unpack(const int fmt, const uint8_t *row, int64_t b0, int nb, int8_t *a, float *sc) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    if (fmt == Q4_0) {
        const uint8_t *blk = row + b0 * 18;
        for (int i = 0; i < nb; i += 2) { /* two blocks per zmm: [q0 q0 q1 q1], high copies shifted: weights in order */
            const int two = i + 1 < nb;
            __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + 18 * i + 2)));
            if (two) z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128((const __m128i *)(blk + 18 * i + 20)));
            const __m512i w = _mm512_sub_epi8(_mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4), lo4), _mm512_set1_epi8(8));
            if (two) _mm512_storeu_si512(a + 32 * i, w);
            else _mm256_storeu_si256((__m256i *)(a + 32 * i), _mm512_castsi512_si256(w));
            sc[i] = f16(blk + 18 * i);
            if (two) sc[i + 1] = f16(blk + 18 * i + 18);
        }
    } else if (fmt == MXFP4) { /* as q4_0, through the signed table */
        const uint8_t *blk = row + b0 * 17;
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_S));
        for (int i = 0; i < nb; i += 2) {
            const int two = i + 1 < nb;
            __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + 17 * i + 1)));
            if (two) z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128((const __m128i *)(blk + 17 * i + 18)));
            const __m512i w = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4), lo4));
            if (two) _mm512_storeu_si512(a + 32 * i, w);
            else _mm256_storeu_si256((__m256i *)(a + 32 * i), _mm512_castsi512_si256(w));
            sc[i] = e8m0(blk[17 * i]);
            if (two) sc[i + 1] = e8m0(blk[17 * i + 17]);
        }
    } else if (fmt == Q8_0) {
        const uint8_t *blk = row + b0 * 34;
        for (int i = 0; i < nb; i++) {
            _mm256_storeu_si256((__m256i *)(a + 32 * i), _mm256_loadu_si256((const __m256i *)(blk + 34 * i + 2)));
            sc[i] = f16(blk + 34 * i);
        }
    } else { /* q4_k, q5_k: a whole super-block; sub-blocks 2c, 2c + 1 are the low and high nibbles of qs[32c..] */
        const uint8_t *sb = row + b0 / 8 * BLOCK_BYTES[fmt];
        const uint8_t *qs = sb + (fmt == Q4_K ? 16 : 48);
        for (int c = 0; c < 4; c++) {
            const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(z, 0xFFFF0000u, z, 4), lo4);
            if (fmt == Q5_K) { /* bit s of qh[l]: the fifth bit of weight l of sub-block s */
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb + 16)));
                const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))), _mm256_set1_epi8((char)(2 << (2 * c))), 1);
                q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(16));
            }
            _mm512_storeu_si512(a + 64 * c, q);
        }
        const __m128i v = _mm_loadu_si128((const __m128i *)(sb + 4));
        const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x98), _mm_setr_epi32(0, 0, 0, 4)),
                                         _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, 0x50), 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
        const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(lo, hi)));
        const __m512 dd = _mm512_mask_mov_ps(_mm512_set1_ps(f16(sb)), 0xFF00, _mm512_set1_ps(f16(sb + 2)));
        _mm512_storeu_ps(sc, _mm512_mul_ps(sm, dd)); /* 0-7 d * scale, 8-15 dmin * min */
    }
}

/*
 * out[16 r + t] = dot(row w[r], token t of the tile) for 16 rows and tn tokens (the rest of out's lanes are
 * 0), K weights. Needs amx_begin in this thread.
 */
static inline __attribute__((always_inline)) AMXF void amx_rows_fmt(const int fmt, const uint8_t *const *w,
                                                                   const uint8_t *tile, int tn, int64_t K, int64_t ahead,
                                                                   float *out) {
    _Alignas(64) int8_t a[16][256];
    _Alignas(64) float sc[16][16];
    _Alignas(64) int32_t c[16][16];
    const __mmask16 tm = (__mmask16)((1u << tn) - 1);
    const int mins = fmt == Q4_K || fmt == Q5_K;
    const float *xd = AMX_XD(tile, K), *xm = AMX_XM(tile, K);
    /* the sums live in registers only across a segment's epilogues: across the unpack loop GCC kept all 16
     * in memory, a load and a store around every FMA */
    for (int r = 0; r < 16; r++) _mm512_storeu_ps(out + 16 * r, _mm512_setzero_ps());
    for (int64_t b0 = 0; b0 < K / 32; b0 += 8) {
        const int nb = K / 32 - b0 < 8 ? (int)(K / 32 - b0) : 8;
        const int64_t at = b0 * BLOCK_BYTES[fmt] / (BLOCK[fmt] / 32);
        for (int r = 0; r < 16; r++) {
            for (int64_t o = 0; o < nb * BLOCK_BYTES[fmt] / (BLOCK[fmt] / 32); o += 64)
                _mm_prefetch((const char *)(w[r] + at + ahead + o), _MM_HINT_T0);
            amx_unpack(fmt, w[r], b0, nb, a[r], sc[r]);
        }
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_loadu_ps(out + 16 * r);
        for (int i = 0; i < nb; i++) {
            TILE_ZERO(0);
            TILE_LOAD(1, &a[0][32 * i], 256, a);
            TILE_LOAD(2, tile + (b0 + i) * 512, 64, *(const uint8_t(*)[512])(tile + (b0 + i) * 512));
            TILE_DPBSSD(0, 1, 2);
            TILE_STORE(0, c, 64, c);
            const __m512 dx = _mm512_maskz_loadu_ps(tm, xd + 16 * (b0 + i));
            const __m512 xmv = mins ? _mm512_maskz_loadu_ps(tm, xm + 16 * (b0 + i)) : _mm512_setzero_ps();
            for (int r = 0; r < 16; r++) {
                const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[r])), dx);
                acc[r] = _mm512_fmadd_ps(v, _mm512_set1_ps(sc[r][i]), acc[r]);
                if (mins) acc[r] = _mm512_fnmadd_ps(xmv, _mm512_set1_ps(sc[r][8 + i]), acc[r]);
            }
        }
        for (int r = 0; r < 16; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
    }
}

typedef void (*amx_fn)(const uint8_t *const *, const uint8_t *, int, int64_t, int64_t, float *);
#define AMX_FORMAT(name, FMT)                                                                                      \
    static AMXF __attribute__((noinline)) void name(const uint8_t *const *w, const uint8_t *tile, int tn, int64_t K, \
                                                    int64_t ahead, float *out) {                                    \
        amx_rows_fmt(FMT, w, tile, tn, K, ahead, out);                                                             \
    }
AMX_FORMAT(amx_q4_0, Q4_0)
AMX_FORMAT(amx_q8_0, Q8_0)
AMX_FORMAT(amx_q4_k, Q4_K)
AMX_FORMAT(amx_q5_k, Q5_K)
AMX_FORMAT(amx_mxfp4, MXFP4)
static const amx_fn AMX_ROWS[NFMT] = {amx_q4_0, amx_q8_0, amx_q4_k, amx_q5_k, NULL, amx_mxfp4}; /* q6_k: see amx_format */

static inline void amx_rows(int fmt, const uint8_t *const *w, const uint8_t *tile, int tn, int64_t K, int64_t ahead,
                            float *out) {
    AMX_ROWS[fmt](w, tile, tn, K, ahead, out);
}

/* ---------------------------------------------------------------- one call's work */

typedef struct {
    const uint8_t *gate_up, *down;
    int fmt_gu, fmt_d, x_f32, out_f32;
    int qfmt_gu, qfmt_d;  /* quantize_block's fmt for x (gate_up's format) and act (down's) */
    void *out;
    const int64_t *out_rows;
    const void *x_src;
    const int64_t *x_row; /* scratch row r quantises x row x_row[r] */
    int64_t x_stride, rows_n;
    uint8_t *xq;          /* [rows][qrow_bytes(H)] */
    uint8_t *aq;          /* [rows][qrow_bytes(R)] */
    float *act, *up;      /* [rows][R] fp32: gate, then act; up */
    const int64_t *off, *eid;
    const int32_t *groups;
    const int64_t *first;
    _Atomic int32_t *done1;
    int amx_gu, amx_d;    /* AMX groups' phase 1 / phase 2 on AMX tiles (their formats allow it) */
    const int64_t *tbase; /* per group: its first token tile in xt / at; -1: not an AMX group */
    const int32_t *row_gi; /* scratch row -> group */
    uint8_t *xt, *at;     /* AMX groups' x rows (gate_up's) and act rows (down's) as token tiles */
    int64_t xt_bytes, at_bytes;
    /* gpt-oss's expert function (NULL / 0: plain SwiGLU): gate_up's bias [E][2F] added before the activation,
     * down's [E][H] to the output (only where R = F: with a split the other part's owner adds it), both bf16 or
     * fp32 (bias_f32); glu 1: the clamped SwiGLU with alpha and limit instead of silu(gate) * up */
    const void *gu_bias, *d_bias;
    int bias_f32, glu;
    float alpha, limit;
    /* linear 1 (mq_linear): one matrix, `down` [H][row_bytes(F)], no phase 1: phase 0 quantises the x rows (F
     * values) straight into the act rows phase 2 reads */
    int linear;
    /* R: the intermediate rows computed, [0, R) of F (the call's `rows`): gate / up rows [0, R), the first R
     * weights of each down row (d_row, from F, stays the stride); the act rows have R values */
    int64_t H, F, R, gu_row, d_row, xq_row, aq_row, out_stride, n1, coarse, total, FB, HB, nb1, nb2;
    /* phase-2 items from `coarse` on are quarters of a block (native_call.h's last_round) */
    _Alignas(64) _Atomic int64_t next;
    _Alignas(64) _Atomic int64_t next_row;
    _Atomic int64_t rows_split;
    char pad[48];
} Job;

/* act = silu(gate) * up in fp32, 8 at a time. */
static inline __m256 act8(__m256 gate, __m256 up) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), e)), up);
}

/* gpt-oss's act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), 8 at a time
 * (kernels/expert_weights.py's ClampedSwiGLU; min and max with the input second pass a NaN on, as torch's clamp). */
static inline __m256 clamped8(__m256 gate, __m256 up, float alpha, float limit) {
    const __m256 lim = _mm256_set1_ps(limit);
    const __m256 g = _mm256_min_ps(lim, gate);
    const __m256 u = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), _mm256_min_ps(lim, up));
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-alpha), g));
    const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
    return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.f)), glu);
}

/* 8 values of a bias vector from index i, as fp32. */
static inline __m256 bias8(const void *b, int64_t i, int f32) {
    if (f32) return _mm256_loadu_ps((const float *)b + i);
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)b + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline float bias1(const void *b, int64_t i, int f32) {
    if (f32) return ((const float *)b)[i];
    const uint32_t u = (uint32_t)((const bf16 *)b)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Down's bias for output row h of expert e; 0 where there is none or the call computes part of the rows. */
static inline float down_bias(const Job *j, int64_t e, int64_t h) {
    return j->d_bias && j->R == j->F ? bias1(j->d_bias, e * j->H + h, j->bias_f32) : 0.f;
}

/* out[o] = v in out's dtype (bf16: round to nearest even, NaN kept a NaN). */
static inline void put_out(const Job *j, int64_t o, float v) {
    if (j->out_f32) {
        ((float *)j->out)[o] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
    ((bf16 *)j->out)[o] = (bf16)(u >> 16);
}

/* The token tile of token t (of the group's n) of an AMX group. */
static inline uint8_t *amx_tile(uint8_t *base, int64_t bytes, const Job *j, int64_t gi, int64_t t) {
    return base + (j->tbase[gi] + t / AMX_T) * bytes;
}

/* Phase 1 of an AMX group: gate and up rows [f0, f1), 16 of each per amx_rows, into act and up. */
static AMXF void phase1_amx(const Job *j, int64_t gi, int64_t f0, int64_t f1) {
    const int64_t g = j->groups[gi], n = j->off[g + 1] - j->off[g], r0 = j->first[gi], F = j->F, R = j->R;
    const uint8_t *W = j->gate_up + j->eid[g] * 2 * F * j->gu_row;
    const int64_t ahead = prefetch_ahead(j->gu_row, 16);
    _Alignas(64) float o[2][16 * 16];
    for (int64_t t0 = 0; t0 < n; t0 += AMX_T) {
        const int tn = n - t0 < AMX_T ? (int)(n - t0) : AMX_T;
        const uint8_t *tile = amx_tile(j->xt, j->xt_bytes, j, gi, t0);
        for (int64_t f = f0; f < f1; f += 16) {
            const uint8_t *wg[16], *wu[16];
            for (int r = 0; r < 16; r++) {
                const int64_t fr = f + r < R ? f + r : R - 1;
                wg[r] = W + fr * j->gu_row;
                wu[r] = W + (F + fr) * j->gu_row;
            }
            amx_rows(j->fmt_gu, wg, tile, tn, j->H, ahead, o[0]);
            amx_rows(j->fmt_gu, wu, tile, tn, j->H, ahead, o[1]);
            const int64_t rn = f1 - f < 16 ? f1 - f : 16;
            for (int t = 0; t < tn; t++) {
                float *act = j->act + (r0 + t0 + t) * R + f, *up = j->up + (r0 + t0 + t) * R + f;
                for (int64_t r = 0; r < rn; r++) {
                    act[r] = o[0][16 * r + t];
                    up[r] = o[1][16 * r + t];
                }
            }
        }
    }
}

/* Phase 2 of an AMX group: down rows [h0, h1), 16 per amx_rows. */
static AMXF void phase2_amx(const Job *j, int64_t gi, int64_t h0, int64_t h1) {
    const int64_t g = j->groups[gi], a = j->off[g], n = j->off[g + 1] - a, H = j->H;
    const uint8_t *W = j->down + j->eid[g] * H * j->d_row;
    const int64_t ahead = prefetch_ahead(j->d_row, 16);
    _Alignas(64) float o[16 * 16];
    for (int64_t t0 = 0; t0 < n; t0 += AMX_T) {
        const int tn = n - t0 < AMX_T ? (int)(n - t0) : AMX_T;
        const uint8_t *tile = amx_tile(j->at, j->at_bytes, j, gi, t0);
        for (int64_t h = h0; h < h1; h += 16) {
            const uint8_t *w[16];
            for (int r = 0; r < 16; r++) w[r] = W + (h + r < H ? h + r : H - 1) * j->d_row;
            amx_rows(j->fmt_d, w, tile, tn, j->R, ahead, o);
            const int64_t rn = h1 - h < 16 ? h1 - h : 16;
            float bias[16];
            for (int64_t r = 0; r < rn; r++) bias[r] = down_bias(j, j->eid[g], h + r);
            for (int t = 0; t < tn; t++) {
                const int64_t i = a + t0 + t, at = (j->out_rows ? j->out_rows[i] : i) * j->out_stride + h;
                for (int64_t r = 0; r < rn; r++) put_out(j, at + r, o[16 * r + t] + bias[r]);
            }
        }
    }
}

static void phase1_item(const Job *j, int64_t gi, int64_t blk) {
    const int64_t g = j->groups[gi], n = j->off[g + 1] - j->off[g], r0 = j->first[gi], F = j->F, R = j->R;
    const uint8_t *W = j->gate_up + j->eid[g] * 2 * F * j->gu_row;
    const int64_t f0 = blk * j->FB, f1 = f0 + j->FB < R ? f0 + j->FB : R;
    const int amx_in = j->amx_gu && j->tbase[gi] >= 0, amx_out = j->amx_d && j->tbase[gi] >= 0;
    uint8_t *xq[TOK];
    float s[ROWS * TOK];
    if (amx_in) phase1_amx(j, gi, f0, f1);
    for (int64_t t0 = 0; !amx_in && t0 < n; t0 += TOK) {
        const int tn = n - t0 < TOK ? (int)(n - t0) : TOK;
        for (int t = 0; t < tn; t++) xq[t] = j->xq + (r0 + t0 + t) * j->xq_row;
        for (int64_t f = f0; f < f1; f += 2) {
            const int64_t f2 = f + 1 < R ? f + 1 : f; /* an odd last row is computed twice, kept once */
            const int64_t rows[ROWS] = {f, f2, F + f, F + f2};
            rows_dot(j->fmt_gu, W, j->gu_row, j->H, rows, xq, tn, s, prefetch_ahead(j->gu_row, 2), prefetch_next(j->gu_row, 2));
            for (int t = 0; t < tn; t++) { /* gate into act, up into up; act8 below */
                float *act = j->act + (r0 + t0 + t) * R, *up = j->up + (r0 + t0 + t) * R;
                act[f] = s[t];
                up[f] = s[2 * tn + t];
                if (f2 != f) {
                    act[f + 1] = s[tn + t];
                    up[f + 1] = s[3 * tn + t];
                }
            }
        }
    }
    /* f0, f1 are multiples of 32: this item's blocks of the quantised act rows are its own (every layout
     * keeps a block's bytes, lanes and sums to itself) */
    for (int64_t t = 0; t < n; t++) {
        float *act = j->act + (r0 + t) * R;
        const float *up = j->up + (r0 + t) * R;
        uint8_t *row = j->aq + (r0 + t) * j->aq_row;
        for (int64_t f = f0; f < f1; f += 8) {
            __m256 gate = _mm256_loadu_ps(act + f), u = _mm256_loadu_ps(up + f);
            if (j->gu_bias) {
                gate = _mm256_add_ps(gate, bias8(j->gu_bias, j->eid[g] * 2 * F + f, j->bias_f32));
                u = _mm256_add_ps(u, bias8(j->gu_bias, j->eid[g] * 2 * F + F + f, j->bias_f32));
            }
            _mm256_storeu_ps(act + f, j->glu ? clamped8(gate, u, j->alpha, j->limit) : act8(gate, u));
        }
        if (amx_out) {
            uint8_t *tile = amx_tile(j->at, j->at_bytes, j, gi, t);
            for (int64_t f = f0; f < f1; f += 32) amx_quantize(act + f, tile, R, f / 32, (int)(t % AMX_T));
        } else {
            for (int64_t f = f0; f < f1; f += 32) quantize_block(act + f, row, R, f / 32, j->qfmt_d);
        }
    }
}

/* Down-projection rows [h0, h1) of group gi: each row's first R weights (d_row apart) against the act rows. */
static void phase2_item(const Job *j, int64_t gi, int64_t h0, int64_t h1) {
    const int64_t g = j->groups[gi], a = j->off[g], n = j->off[g + 1] - a, r0 = j->first[gi], H = j->H;
    const uint8_t *W = j->down + j->eid[g] * H * j->d_row;
    uint8_t *aq[TOK];
    float s[ROWS * TOK];
    for (int64_t t0 = 0; t0 < n; t0 += TOK) {
        const int tn = n - t0 < TOK ? (int)(n - t0) : TOK;
        for (int t = 0; t < tn; t++) aq[t] = j->aq + (r0 + t0 + t) * j->aq_row;
        for (int64_t h = h0; h < h1; h += ROWS) {
            int64_t rows[ROWS];
            for (int r = 0; r < ROWS; r++) rows[r] = h + r < H ? h + r : H - 1;
            rows_dot(j->fmt_d, W, j->d_row, j->R, rows, aq, tn, s, prefetch_ahead(j->d_row, ROWS), prefetch_next(j->d_row, ROWS));
            const int64_t rn = h1 - h < ROWS ? h1 - h : ROWS;
            float bias[ROWS];
            for (int64_t r = 0; r < rn; r++) bias[r] = down_bias(j, j->eid[g], h + r);
            for (int t = 0; t < tn; t++) {
                const int64_t i = a + t0 + t, o = (j->out_rows ? j->out_rows[i] : i) * j->out_stride + h;
                for (int64_t r = 0; r < rn; r++) put_out(j, o + r, s[r * tn + t] + bias[r]);
            }
        }
    }
}

/* Phase 0: the x rows quantised, shared by whoever is there; act rows' padding. A linear call's x rows (F values)
 * are its act rows, in the layout of down's format. */
static void quantize_rows(Job *j) {
    const int64_t K = j->linear ? j->F : j->H;
    const int amx = j->linear ? j->amx_d : j->amx_gu, qfmt = j->linear ? j->qfmt_d : j->qfmt_gu;
    uint8_t *const rows = j->linear ? j->aq : j->xq, *const tiles = j->linear ? j->at : j->xt;
    const int64_t row_bytes = j->linear ? j->aq_row : j->xq_row, tile_bytes = j->linear ? j->at_bytes : j->xt_bytes;
    _Alignas(32) float buf[32];
    for (;;) {
        const int64_t r = atomic_fetch_add_explicit(&j->next_row, 1, memory_order_relaxed);
        if (r >= j->rows_n) break;
        uint8_t *row = rows + r * row_bytes;
        const int64_t gi = j->row_gi[r], t = r - j->first[gi];
        uint8_t *tile = amx && j->tbase[gi] >= 0 ? amx_tile(tiles, tile_bytes, j, gi, t) : NULL;
        for (int64_t b = 0; b < K / 32; b++) {
            const float *v = buf;
            if (j->x_f32) v = (const float *)j->x_src + j->x_row[r] * j->x_stride + 32 * b;
            else bf16_to_f32((const bf16 *)j->x_src + j->x_row[r] * j->x_stride + 32 * b, buf, 32);
            if (tile) amx_quantize(v, tile, K, b, (int)(t % AMX_T));
            else quantize_block(v, row, K, b, qfmt);
        }
        if (!tile) qrow_pad(row, K);
        if (!j->linear && !(j->amx_d && j->tbase[gi] >= 0)) qrow_pad(j->aq + r * j->aq_row, j->R);
        atomic_fetch_add_explicit(&j->rows_split, 1, memory_order_release);
    }
    unsigned spins = 0;
    while (atomic_load_explicit(&j->rows_split, memory_order_acquire) < j->rows_n) relax(&spins);
}

static void run_job(void *arg, int tid) {
    (void)tid;
    Job *j = arg;
    int tiles = 0; /* whether this thread configured the AMX tiles (per thread state) */
    quantize_rows(j);
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->total) break;
        const int64_t k = i < j->n1 ? 0 : phase2_block(i, j->n1, j->coarse);
        const int64_t gi = i < j->n1 ? i / j->nb1 : k / j->nb2;
        if (!tiles && j->tbase[gi] >= 0 && (i < j->n1 ? j->amx_gu : j->amx_d)) {
            amx_begin();
            tiles = 1;
        }
        if (i < j->n1) {
            phase1_item(j, i / j->nb1, i % j->nb1);
            atomic_fetch_add_explicit(&j->done1[i / j->nb1], 1, memory_order_release);
        } else {
            unsigned spins = 0;
            while (atomic_load_explicit(&j->done1[gi], memory_order_acquire) < j->nb1) relax(&spins);
            const int amx = j->amx_d && j->tbase[gi] >= 0;
            int64_t h0 = (k % j->nb2) * j->HB, h1 = h0 + j->HB < j->H ? h0 + j->HB : j->H;
            quarter_rows(i, j->coarse, amx ? 16 : ROWS, &h0, &h1); /* AMX: the A tiles' 16 rows */
            if (h0 < h1 && amx) phase2_amx(j, gi, h0, h1);
            else if (h0 < h1) phase2_item(j, gi, h0, h1);
        }
    }
    if (tiles) amx_end();
}

/* ---------------------------------------------------------------- the pool and the call's state */

static int by_key(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* order[gi] = the groups by descending tokens, ties in group order (keys: scratch of G int64). */
static void busiest_first(const int64_t *offsets, int64_t G, int64_t *keys, int32_t *order) {
    for (int64_t g = 0; g < G; g++)
        keys[g] = BUSIEST_FIRST ? ((int64_t)(INT32_MAX - (offsets[g + 1] - offsets[g])) << 32) | g : g;
    if (BUSIEST_FIRST) qsort(keys, (size_t)G, sizeof *keys, by_key);
    for (int64_t gi = 0; gi < G; gi++) {
        const int64_t at = BUSIEST_FIRST == 2 ? (gi % 2 ? G - 1 - gi / 2 : gi / 2) : gi;
        order[gi] = (int32_t)(keys[at] & 0xffffffff);
    }
}

typedef void (*run_fn)(pool_fn, void *, int, int);
static run_fn pool_runner = pool_run;          /* cpu_experts' moe_pool_run once mq_use_pool was called */
static int (*pool_threads)(void) = pool_get_threads;

static Job job; /* guarded by native_call.h's `call` */
static int run_grouped(Job *j, int64_t *index, int64_t M, int64_t G);

/* `call` taken and the job's kind and rows in and out set; the caller sets its weights and shapes. */
static Job *begin_job(int linear, const void *x, int64_t x_stride, int x_f32, void *out, int64_t out_stride,
                      int out_f32) {
    pthread_mutex_lock(&call);
    Job *j = &job;
    j->linear = linear;
    j->x_src = x;
    j->x_stride = x_stride;
    j->x_f32 = x_f32;
    j->out = out;
    j->out_stride = out_stride;
    j->out_f32 = out_f32;
    return j;
}

enum { OK = 0, BAD_ROW = -2, BAD_EXPERT = -3, NO_MEMORY = -4, BAD_OUT_ROW = -5, BAD_FORMAT = -6, BAD_SHAPE = -7 };

/*
 * The routed call: pair p (token p / k, rank p % k) goes to expert pair_expert[p]; the pairs of the
 * experts in `chosen` (n_chosen of them; NULL: all) are computed into out row p, every other row of out
 * is left alone. gate_up [E][2F][row_bytes(H)] and down [E][H][row_bytes(F)] are packed in fmt_gu /
 * fmt_d. x (N rows, x_stride elements apart) and out are bf16 or fp32 (x_f32, out_f32). index: int64
 * scratch of 2P + 2E + 1 entries. Returns OK or a negative error code.
 *
 * R (the Python side's `rows`): the intermediate rows computed, [0, R) of F; R = F is the whole experts. With
 * R < F each result is the head of its expert's output, act[0, R) . down[:, 0:R)^T from gate / up rows [0, R):
 * at one token the GPU computes the rest from pinned RAM (kernels/gpu_zero_copy.py), using the PCIe link that
 * idles while this call is bound by RAM bandwidth. R is a multiple of 32 and of fmt_d's block (whole quantised
 * act blocks; a down row's first R / BLOCK blocks, its stride still F's). Every path takes it, AMX included:
 * the act token tiles are laid out for K = R and amx_rows reads each down row's first R weights, as the VNNI
 * and AVX2 dots do. R = F computes exactly what the call computed before it had R.
 *
 * gu_bias, d_bias, bias_f32, glu, alpha, limit: gpt-oss's expert function (Job says how; NULL, NULL, 0, 0: plain
 * SwiGLU). Down's bias is added only with R = F.
 */
int mq_routed_forward(const void *x, int64_t N, int64_t x_stride, int x_f32, int64_t H,
                      const int64_t *pair_expert, int64_t P, int64_t k, const int64_t *chosen, int64_t n_chosen,
                      const uint8_t *gate_up, const uint8_t *down, int64_t E, int64_t F, int fmt_gu, int fmt_d,
                      void *out, int64_t out_stride, int64_t out_len, int out_f32, int64_t *index, int64_t R,
                      const void *gu_bias, const void *d_bias, int bias_f32, int glu, float alpha, float limit) {
    if (fmt_gu < 0 || fmt_gu >= NFMT || fmt_d < 0 || fmt_d >= NFMT) return BAD_FORMAT;
    if (H <= 0 || F <= 0 || H % BLOCK[fmt_gu] || F % BLOCK[fmt_d] || F % 32) return BAD_SHAPE;
    if (R <= 0 || R > F || R % BLOCK[fmt_d] || R % 32) return BAD_SHAPE;
    if (k < 1 || P < 0 || P > N * k) return BAD_ROW;
    if (P > out_len) return BAD_OUT_ROW;
    int64_t M, G;
    const int grouped = group_routed_pairs(pair_expert, P, k, chosen, n_chosen, E, index, &M, &G);
    if (grouped != 0) return grouped;
    if (G == 0) return OK;
    Job *j = begin_job(0, x, x_stride, x_f32, out, out_stride, out_f32);
    j->gate_up = gate_up;
    j->down = down;
    j->fmt_gu = fmt_gu;
    j->fmt_d = fmt_d;
    j->H = H;
    j->F = F;
    j->R = R;
    j->gu_bias = gu_bias;
    j->d_bias = d_bias;
    j->bias_f32 = bias_f32;
    j->glu = glu;
    j->alpha = alpha;
    j->limit = limit;
    return run_grouped(j, index, M, G);
}

/*
 * One matrix: out[n] = W x[n] (+ bias) for the N rows of x (K values each, x_stride elements apart),
 * W [M][row_bytes(K)] packed in fmt, bias NULL or M values (bf16 or fp32: bias_f32); x and out bf16 or fp32
 * (x_f32, out_f32). A non-expert weight of a CPU load (engine/model/packed_linear.py): the routed call's phase 2 for
 * one group of all N rows, its act rows quantised from x. index: int64 scratch of 2N + 3 entries. Returns OK or a
 * negative error code.
 */
int mq_linear(const void *x, int64_t N, int64_t x_stride, int x_f32, int64_t K, const uint8_t *w, int64_t M, int fmt,
              const void *bias, int bias_f32, void *out, int64_t out_stride, int out_f32, int64_t *index) {
    if (fmt < 0 || fmt >= NFMT) return BAD_FORMAT;
    if (K <= 0 || M <= 0 || K % BLOCK[fmt] || K % 32) return BAD_SHAPE;
    if (N < 0) return BAD_ROW;
    if (N == 0) return OK;
    /* group_routed_pairs' layout for one group of all N rows, in order */
    for (int64_t n = 0; n < N; n++) index[n] = index[N + n] = n;
    index[2 * N] = 0;
    index[2 * N + 1] = 0;
    index[2 * N + 2] = N;
    Job *j = begin_job(1, x, x_stride, x_f32, out, out_stride, out_f32);
    j->gate_up = NULL;
    j->down = w;
    j->fmt_gu = j->fmt_d = fmt;
    j->H = M;
    j->F = j->R = K;
    j->gu_bias = NULL;
    j->d_bias = bias;
    j->bias_f32 = bias_f32;
    j->glu = 0;
    j->alpha = j->limit = 0.f;
    return run_grouped(j, index, N, 1);
}

/* The call planned and run, `call` held and the job's operands set: M pairs in G groups as group_routed_pairs laid
 * them out in index. Releases `call`. */
static int run_grouped(Job *j, int64_t *index, int64_t M, int64_t G) {
    int64_t *out_rows = index, *rows = index + M, *expert_ids = index + 2 * M, *offsets = expert_ids + G;
    const int64_t H = j->H, F = j->F, R = j->R;
    const int fmt_gu = j->fmt_gu, fmt_d = j->fmt_d;
    int threads = pool_threads();
    const int64_t gu_row = j->linear ? 0 : H / BLOCK[fmt_gu] * BLOCK_BYTES[fmt_gu],
                  d_row = F / BLOCK[fmt_d] * BLOCK_BYTES[fmt_d];
    const int64_t xq_row = j->linear ? 0 : round_up(qrow_bytes(H), 64), aq_row = round_up(qrow_bytes(R), 64);
    /* phase-1 blocks start at multiples of 32 so that each quantised act block has one writer; a phase-2 row
     * reads its first R / BLOCK blocks */
    const int64_t FB = j->linear ? R : block_rows(R, 2 * gu_row, 32, G, threads, ITEM_BYTES),
                  HB = block_rows(H, R / BLOCK[fmt_d] * BLOCK_BYTES[fmt_d], ROWS, G, threads, ITEM_BYTES);
    const int64_t nb1 = j->linear ? 0 : (R + FB - 1) / FB, nb2 = (H + HB - 1) / HB, total = G * (nb1 + nb2);
    if (threads > total) threads = (int)total;
    /* groups of AMX_MIN+ tokens go to the AMX tiles where the path and their formats allow */
    const int amx_gu = use_amx && !j->linear && amx_format(fmt_gu), amx_d = use_amx && amx_format(fmt_d);
    int64_t tiles = 0;
    for (int64_t g = 0; (amx_gu || amx_d) && g < G; g++)
        if (offsets[g + 1] - offsets[g] >= AMX_MIN) tiles += (offsets[g + 1] - offsets[g] + AMX_T - 1) / AMX_T;
    const int64_t xt_bytes = amx_tile_bytes(H), at_bytes = amx_tile_bytes(R);
    const int64_t act_rows = j->linear ? 0 : M; /* fp32 gate / act and up rows: phase 1's */
    const size_t sizes[] = {
        (size_t)(M * xq_row), (size_t)(M * aq_row), (size_t)act_rows * (size_t)R * sizeof(float),
        (size_t)G * sizeof(int64_t), (size_t)G * sizeof(int32_t), (size_t)G * sizeof(_Atomic int32_t),
        (size_t)act_rows * (size_t)R * sizeof(float), (size_t)G * sizeof(int64_t), (size_t)M * sizeof(int32_t),
        (size_t)(amx_gu ? tiles * xt_bytes : 0), (size_t)(amx_d ? tiles * at_bytes : 0)};
    size_t at[11];
    char *base = scratch_parts(sizes, 11, at);
    if (!base) {
        pthread_mutex_unlock(&call);
        return NO_MEMORY;
    }
    j->qfmt_gu = use_vnni ? fmt_gu : LANE8 + fmt_gu;
    j->qfmt_d = use_vnni ? fmt_d : LANE8 + fmt_d;
    j->out_rows = j->linear ? NULL : out_rows;
    j->x_row = rows;
    j->rows_n = M;
    j->xq = (uint8_t *)(base + at[0]);
    j->aq = (uint8_t *)(base + at[1]);
    j->act = (float *)(base + at[2]);
    j->up = (float *)(base + at[6]);
    int64_t *first = (int64_t *)(base + at[3]);
    int32_t *groups = (int32_t *)(base + at[4]);
    j->done1 = (_Atomic int32_t *)(base + at[5]);
    int64_t *tbase = (int64_t *)(base + at[7]);
    int32_t *row_gi = (int32_t *)(base + at[8]);
    busiest_first(offsets, G, tbase, groups);
    for (int64_t gi = 0, t = 0; gi < G; gi++) { /* gi: the order items are handed out in; groups[gi] the group */
        const int64_t g = groups[gi], n = offsets[g + 1] - offsets[g];
        first[gi] = offsets[g]; /* every group is native: scratch row i is pair i */
        atomic_init(&j->done1[gi], 0);
        tbase[gi] = tiles && n >= AMX_MIN ? t : -1;
        t += tbase[gi] >= 0 ? (n + AMX_T - 1) / AMX_T : 0;
        for (int64_t i = offsets[g]; i < offsets[g + 1]; i++) row_gi[i] = (int32_t)gi;
    }
    j->amx_gu = amx_gu;
    j->amx_d = amx_d;
    j->tbase = tbase;
    j->row_gi = row_gi;
    j->xt = (uint8_t *)(base + at[9]);
    j->at = (uint8_t *)(base + at[10]);
    j->xt_bytes = xt_bytes;
    j->at_bytes = at_bytes;
    j->groups = groups;
    j->first = first;
    j->off = offsets;
    j->eid = expert_ids;
    j->gu_row = gu_row;
    j->d_row = d_row;
    j->xq_row = xq_row;
    j->aq_row = aq_row;
    j->FB = FB;
    j->HB = HB;
    j->nb1 = nb1;
    j->nb2 = nb2;
    j->n1 = G * nb1;
    const int64_t quartered = QUARTERS ? last_round(G * nb2, threads) : 0;
    j->coarse = total - quartered;
    j->total = total + 3 * quartered;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
    atomic_store_explicit(&j->next_row, 0, memory_order_relaxed);
    atomic_store_explicit(&j->rows_split, 0, memory_order_relaxed);
    pool_runner(run_job, j, threads, 1);
    end_call();
    return OK;
}

/* ---------------------------------------------------------------- settings and CPU checks */

static int os_saves(unsigned mask) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & mask) == mask;
}

/* AVX2, FMA and F16C, with the OS saving the ymm state: what this library needs at all. */
int mq_cpu_supported(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 12)) || !(c & (1u << 29))) return 0; /* FMA, F16C */
    if (!os_saves(0x6)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b & (1u << 5)) != 0; /* AVX2 */
}

/* AVX512F/BW/VL and AVX512_VNNI, with the OS saving the opmask and zmm state. */
int mq_vnni_supported(void) {
    unsigned a, b, c, d;
    if (!mq_cpu_supported() || !os_saves(0xe6)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned need = (1u << 16) | (1u << 30) | (1u << 31); /* F, BW, VL */
    return (b & need) == need && (c & (1u << 11));
}

/* AVX512-VBMI (the VNNI path's byte permutes for mxfp4, where it has them). */
int mq_vbmi_supported(void) {
    unsigned a, b, c, d;
    return mq_vnni_supported() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 1));
}

/* Whether the VNNI path may gather mxfp4's bytes with VBMI where the CPU has it (tests turn it off to run the other
 * gather); returns whether it does now. */
static int vbmi_allowed = 1;
int mq_allow_vbmi(int allow) {
    vbmi_allowed = allow;
    use_vbmi = use_vnni && mq_vbmi_supported() && vbmi_allowed;
    return use_vbmi;
}

/* AMX-TILE and AMX-INT8 with the OS saving the tile state, the VNNI path (its epilogue is AVX-512), and
 * Linux's permission for this process to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once:
 * it holds for every thread of the process). Built with -DMQ_AMX_EMULATE: the VNNI path is enough. */
int mq_amx_supported(void) {
    static int known = -1;
    if (known >= 0) return known;
#ifdef MQ_AMX_EMULATE
    known = mq_vnni_supported();
#else
    known = mq_vnni_supported() && amx_os_status(1u << 25 /* AMX-INT8 */) == 0;
#endif
    return known;
}

/* 2: AMX for groups of AMX_MIN+ tokens and VNNI for the rest, 1: VNNI, 0: AVX2. Returns the path in use (a
 * path the CPU or OS lacks is refused for the next best). */
int mq_set_path(int path) {
    use_vnni = path >= 1 && mq_vnni_supported();
    use_vbmi = use_vnni && mq_vbmi_supported() && vbmi_allowed;
    use_amx = path >= 2 && mq_amx_supported();
    return use_amx ? 2 : use_vnni;
}
int mq_get_path(void) { return use_amx ? 2 : use_vnni; }

/* Whether this build's AVX2 path uses AVX-VNNI (built with -DMQ_AVXVNNI). */
int mq_lane_vnni(void) {
#ifdef MQ_AVXVNNI
    return 1;
#else
    return 0;
#endif
}

void mq_set_threads(int n) { pool_set_threads(n); }
void mq_set_spin_us(int64_t us) { pool_set_spin_us(us); }

/* Run on another library's pool (cpu_experts' moe_pool_run and moe_get_threads) instead of this one's. */
void mq_use_pool(void *run, void *threads) {
    pool_runner = run ? (run_fn)run : pool_run;
    pool_threads = threads ? (int (*)(void))threads : pool_get_threads;
}
