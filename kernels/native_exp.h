/*
 * exp in 8 fp32 lanes (AVX2 and FMA), shared by cpu_experts.c's AVX2 build (silu, rounded to bf16 as torch rounds it),
 * cpu_quant.c (silu and gpt-oss's clamped SwiGLU in fp32) and cpu_attention.c (a decode step's softmax).
 */
#ifndef MOEDESK_NATIVE_EXP_H
#define MOEDESK_NATIVE_EXP_H

#include <immintrin.h>

/* exp(x) to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, Taylor polynomial of degree 6, times 2^n. x is clamped to
 * [-100, 100] (NaN passes), and 2^n is two factors 2^(n/2) and 2^(n - n/2), each a normal float, so that the result
 * rounds once to infinity or to a denormal or zero where it leaves the normal range, as AVX-512's scalef does. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-100.f), _mm256_min_ps(_mm256_set1_ps(100.f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
}

#endif
