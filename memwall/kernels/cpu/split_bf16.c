/* Operands for split-bf16 matmuls (memwall/kernels/cpu/amx.py; see kernels.h for the other
 * files): every float a becomes hi + lo with hi = bf16(a), rounded to nearest even, and
 * lo = a - hi (exact in float), both stored as float32 so that oneDNN's bf16 conversion of
 * hi rounds nothing and of lo loses only ~2^-17 of a. Weights come straight from the q4/q8
 * layouts, rebuilt as s * q + c exactly as q4_dequant/q8_dequant do (quant_gemm.c), so no
 * float weight is written twice: dequantizing each block first and splitting it after took
 * 1.5x as long (3072 x 576 q4, 2-core Sapphire Rapids: 0.57 vs 0.39 ms).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static inline void split_one(float a, float* hi, float* lo) {
    const float h = mw_round_bf16(a);
    *hi = h;
    *lo = a - h;
}

void mw_split_bf16(const float* x, int64_t n, float* hi, float* lo) {
    #pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i++) split_one(x[i], hi + i, lo + i);
}

void mw_q4_dequant_split(const uint8_t* codes, const void* s16, const void* c16, float* hi,
                         float* lo, int64_t N, int64_t K, int half) {
    mw_f32_tables t = mw_tables_f32(s16, c16, N * (K / 32), half);
    const float *s = t.s, *c = t.c;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t* q = codes + n * (K / 2) + b * 16;
            const float sb = s[n * (K / 32) + b], cb = c[n * (K / 32) + b];
            const int64_t o = n * K + b * 32;
            for (int j = 0; j < 16; j++) {
                split_one((float)(q[j] & 15) * sb + cb, hi + o + j, lo + o + j);
                split_one((float)(q[j] >> 4) * sb + cb, hi + o + j + 16, lo + o + j + 16);
            }
        }
    mw_free_tables(&t);
}

void mw_q8_dequant_split(const int8_t* codes, const void* s16, const void* c16, float* hi,
                         float* lo, int64_t N, int64_t K, int64_t G, int half) {
    mw_f32_tables t = mw_tables_f32(s16, c16, N * (K / G), half);
    const float *s = t.s, *c = t.c;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t g = n * (K / G) + k / G;
            split_one((float)codes[n * K + k] * s[g] + c[g], hi + n * K + k, lo + n * K + k);
        }
    mw_free_tables(&t);
}
