/*
 * Probe (GPU box; an AMX-INT8 Xeon): can AMX-INT8 tiles beat the VNNI tiles of kernels/cpu_quant.c at 2-4 tokens an
 * expert (16 sequences decoding together give Mixtral's experts ~4 tokens each, where one of the box's cores is
 * bound by instructions)? A q4_0 layout of its own for AMX: the VNNI path's segment layout (lane L of each 64-weight chunk
 * belongs to block L / 2 of the segment) with C tile columns = (token, block) pairs, so one C tile per 16 rows and
 * token pair sums a segment's four chunks in int32 and the float epilogue runs once per segment, not once per
 * block as the opt-in AMX path's does. The B tiles are the tokens' quantised rows spread over their blocks'
 * columns (7/8 zeros). Software-pipelined: segment s + 1 is unpacked and s - 1's epilogue done while the tiles work
 * on segment s. One thread, rows of 4,096 weights, every token count against the VNNI tiles (rows_dot), the two
 * results compared.
 *
 *     gcc -O3 -std=gnu11 -mavx2 -mfma -mf16c -o /tmp/amx tests/perf/probe_amx_segments.c -lpthread -lm
 *     /tmp/amx 4096 30      # rows (4,096: 9.4 MB, in the last-level cache), repeats
 *     (-DMQ_AMX_EMULATE: the tile instructions in C, to check the layout on a CPU without AMX)
 *
 * Measured on the GPU box (2026-11-27, one H200 machine's Xeon, one thread): AMX 2-3x slower than VNNI at every
 * token count from the cache (4,096 rows, T = 1-4: VNNI 26.2 / 20.8 / 17.6 / 14.6 GB/s, AMX 8.2 / 7.9 / 5.6 / 5.7),
 * about 2x from DRAM (65,536 rows); without the pipelining the same. The time grows with the token pairs, i.e. with
 * the tdpbusd: 32,768 of them (4,096 rows, 4 tokens) took 2.2 ms, 67 ns each, where the instruction issues every 16
 * cycles. Not built into the kernel.
 */
#include "../../kernels/cpu_quant.c"
#include <math.h>
#include <stdio.h>
#include <time.h>

#ifdef MQ_AMX_EMULATE
#define DPBUSD(c, a, b) emu_dpb(c, a, b, 0)
#else
#define DPBUSD(c, a, b) __asm__ volatile("tdpbusd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#endif

static const TileCfg CFG7 = {.palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16}};

/* B tiles [S][4][P][16][64], corrections and x scales [S][P][16] from VNNI-layout rows */
static void build_b(uint8_t *const *x, int T, int64_t K, int8_t *B, int32_t *corr, float *xdp) {
    const int64_t S = K / 256, Kc = round_up(K, 64);
    const int P = (T + 1) / 2;
    memset(B, 0, (size_t)S * 4 * P * 1024);
    for (int64_t s = 0; s < S; s++)
        for (int p = 0; p < P; p++) {
            for (int tl = 0; tl < 2; tl++) {
                const int t = 2 * p + tl;
                for (int b = 0; b < 8; b++) {
                    const int n = tl * 8 + b;
                    corr[(s * P + p) * 16 + n] = t < T ? XC(x[t], Kc)[64 * s + 2 * b] + XC(x[t], Kc)[64 * s + 2 * b + 1] : 0;
                    xdp[(s * P + p) * 16 + n] = t < T ? XD(x[t], Kc)[64 * s + 2 * b] : 0.f;
                }
                if (t >= T) continue;
                for (int m = 0; m < 4; m++)
                    for (int kk = 0; kk < 16; kk++)
                        memcpy(B + (((s * 4 + m) * P + p) * 16 + kk) * 64 + 4 * (tl * 8 + kk / 2), x[t] + 256 * s + 64 * m + 4 * kk, 4);
            }
        }
}

#define AMXP __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

/* 32 rows w[0..31], P token pairs: out[r * T + t]. Software-pipelined: segment s+1 unpacked and segment s-1's
 * epilogue done while the tiles work on segment s, so no tile load reads stores just made (and no vector load
 * reads a tile store just made). */
static AMXP void unpack32(const uint8_t *const *w, int64_t s, uint8_t (*abuf)[16][64], float (*sw)[16]) {
    const __m512i sidx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
    for (int r = 0; r < 32; r++) {
        _mm_prefetch((const char *)(w[r] + 144 * s + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(w[r] + 144 * s + 1024 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w[r] + 144 * s + 1024 + 128), _MM_HINT_T0);
        SegW g;
        seg_q4_0(w[r] + 144 * s, &g);
        for (int m = 0; m < 4; m++) _mm512_store_si512(abuf[(r / 16) * 4 + m][r % 16], g.w[m]);
        _mm512_store_ps(sw[r], _mm512_permutexvar_ps(sidx, g.s));
    }
}

static AMXP void epilogue32(int P, int64_t s, const int32_t (*cbuf)[16][16], const float (*sw)[16], const int32_t *corr,
                            const float *xdp, float (*acc)[2][16]) {
    for (int p = 0; p < P; p++) {
        const __m512i cv = _mm512_loadu_si512(corr + (s * P + p) * 16);
        const __m512 xv = _mm512_loadu_ps(xdp + (s * P + p) * 16);
        for (int r = 0; r < 32; r++) {
            const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(cbuf[(r / 16) * 2 + p][r % 16]), cv));
            _mm512_store_ps(acc[r][p], _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_load_ps(sw[r]), xv), _mm512_load_ps(acc[r][p])));
        }
    }
}

static AMXP void amx_rows32(const uint8_t *const *w, int T, int64_t K, const int8_t *B, const int32_t *corr,
                            const float *xdp, float *out) {
    const int64_t S = K / 256;
    const int P = (T + 1) / 2;
    _Alignas(64) float acc[32][2][16];
    _Alignas(64) uint8_t abuf[2][8][16][64]; /* [stage][group * 4 + chunk] */
    _Alignas(64) int32_t cbuf[2][4][16][16]; /* [stage][group * 2 + pair] */
    _Alignas(64) float sw[2][32][16];
    memset(acc, 0, sizeof acc);
    unpack32(w, 0, abuf[0], sw[0]);
    for (int64_t s = 0; s < S; s++) {
        const int st = s & 1;
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (P > 1) {
            TILE_ZERO(2);
            TILE_ZERO(3);
        }
        for (int m = 0; m < 4; m++) {
            const int8_t *bt = B + ((s * 4 + m) * P) * 1024;
            TILE_LOAD(5, bt, 64, *(const int8_t(*)[1024])bt);
            if (P > 1) TILE_LOAD(6, bt + 1024, 64, *(const int8_t(*)[1024])(bt + 1024));
            TILE_LOAD(4, abuf[st][m], 64, abuf[st][m]);
            DPBUSD(0, 4, 5);
            if (P > 1) DPBUSD(2, 4, 6);
            TILE_LOAD(4, abuf[st][4 + m], 64, abuf[st][4 + m]);
            DPBUSD(1, 4, 5);
            if (P > 1) DPBUSD(3, 4, 6);
        }
        TILE_STORE(0, cbuf[st][0], 64, cbuf[st][0]);
        TILE_STORE(1, cbuf[st][2], 64, cbuf[st][2]);
        if (P > 1) {
            TILE_STORE(2, cbuf[st][1], 64, cbuf[st][1]);
            TILE_STORE(3, cbuf[st][3], 64, cbuf[st][3]);
        }
        if (s + 1 < S) unpack32(w, s + 1, abuf[st ^ 1], sw[st ^ 1]);
        if (s > 0) epilogue32(P, s - 1, (const int32_t(*)[16][16])cbuf[st ^ 1], (const float(*)[16])sw[st ^ 1], corr, xdp, acc);
    }
    epilogue32(P, S - 1, (const int32_t(*)[16][16])cbuf[(S - 1) & 1], (const float(*)[16])sw[(S - 1) & 1], corr, xdp, acc);
    for (int r = 0; r < 32; r++)
        for (int t = 0; t < T; t++) {
            float v = 0;
            for (int b = 0; b < 8; b++) v += acc[r][t / 2][(t % 2) * 8 + b];
            out[r * T + t] = v;
        }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int64_t R = argc > 1 ? atoll(argv[1]) : 4096, K = 4096, S = K / 256, rb = K / 32 * 18;
    const int reps = argc > 2 ? atoi(argv[2]) : 20;
    if (!mq_vnni_supported() || !mq_amx_supported()) {
        printf("this CPU lacks AVX512-VNNI or AMX-INT8 (build with -DMQ_AMX_EMULATE to emulate the tiles)\n");
        return 2;
    }
    uint8_t *W = aligned_alloc(64, (size_t)(R * rb));
    srand(1);
    for (int64_t i = 0; i < R * rb; i++) W[i] = (uint8_t)rand();
    for (int64_t r = 0; r < R; r++) /* sane f16 scales: 1e-3 */
        for (int64_t b = 0; b < K / 32; b++) { W[r * rb + b * 18] = 0x19; W[r * rb + b * 18 + 1] = 0x14; }
    const int64_t qb = round_up(qrow_bytes(K), 64);
    uint8_t *xq = aligned_alloc(64, (size_t)(4 * qb));
    float *xf = malloc(sizeof(float) * K);
    uint8_t *xs[4];
    for (int t = 0; t < 4; t++) {
        xs[t] = xq + t * qb;
        for (int64_t k = 0; k < K; k++) xf[k] = (float)rand() / RAND_MAX - 0.5f;
        for (int64_t b = 0; b < K / 32; b++) quantize_block(xf + 32 * b, xs[t], K, b, Q4_0);
    }
    int8_t *B = aligned_alloc(64, (size_t)(S * 4 * 2 * 1024));
    int32_t *corr = aligned_alloc(64, (size_t)(S * 2 * 16 * 4));
    float *xdp = aligned_alloc(64, (size_t)(S * 2 * 16 * 4));
    float *o1 = malloc(sizeof(float) * R * 4), *o2 = malloc(sizeof(float) * R * 4);
    use_vnni = 1;
    int bad = 0;
    printf("R=%lld rows, K=%lld, %.1f MB of q4_0\n", (long long)R, (long long)K, R * rb / 1e6);
    for (int T = 1; T <= 4; T++) {
        build_b(xs, T, K, B, corr, xdp);
        double tv = 1e9, ta = 1e9;
        for (int rep = 0; rep < reps; rep++) {
            double t0 = now();
            for (int64_t r = 0; r < R; r += 4) {
                const int64_t rows[4] = {r, r + 1, r + 2, r + 3};
                rows_dot(Q4_0, W, rb, K, rows, xs, T, o1 + r * T, prefetch_ahead(rb, 4), prefetch_next(rb, 4));
            }
            double t1 = now();
            TILE_CONFIG(&CFG7);
            for (int64_t r = 0; r < R; r += 32) {
                const uint8_t *w[32];
                for (int i = 0; i < 32; i++) w[i] = W + (r + i) * rb;
                amx_rows32(w, T, K, B, corr, xdp, o2 + r * T);
            }
            TILE_RELEASE();
            double t2 = now();
            if (t1 - t0 < tv) tv = t1 - t0;
            if (t2 - t1 < ta) ta = t2 - t1;
        }
        double err = 0, mag = 0;
        for (int64_t i = 0; i < R * T; i++) {
            const double d = o1[i] - o2[i];
            err = fmax(err, fabs(d));
            mag = fmax(mag, fabs(o1[i]));
        }
        printf("T=%d  vnni %.3f ms %.1f GB/s   amx %.3f ms %.1f GB/s   (%.2fx)  max err %.2e of %.2e\n", T, tv * 1e3,
               R * rb / tv / 1e9, ta * 1e3, R * rb / ta / 1e9, tv / ta, err, mag);
        if (!(err <= 1e-5 * mag)) bad = 1; /* float sums in another order: ~1e-7 of the largest output */
    }
    return bad;
}
