/* memwall's fp32 matmuls on block-quantized weights (see kernels.h for the other files).
 *
 * Why our own: torch's int4/int8 weight-only ops are only fast with bf16 activations and round
 * their OUTPUT to bf16, which makes greedy decoding of small models leave the float path's
 * tokens (benchmarks/quant_linear.py). Here everything stays fp32: each weight is rebuilt as
 * s * q + c exactly as the reference dequantizer does (multiply, then add; built with
 * -ffp-contract=off so no fused multiply-add changes a weight) and dotted with fp32 activations.
 *
 * Two layouts, both row-major, blocks along the input dimension K:
 *
 *     q4: codes uint8 [N, K/2]   32-value block = 16 bytes: byte j = q[j] | q[j+16] << 4
 *         s, c [N, K/32]         w = s * q + c,  q in 0..15
 *     q8: codes int8 [N, K]      s, c [N, K/G], G a multiple of 16 dividing K
 *                                w = s * q + c
 *
 * s and c are float32, or float16 when the caller passes half = 1 (kernels.h): the exact
 * kernels below read float32 and get a widened copy of the tables (mw_tables_f32).
 *
 * q4_gemm and q8_gemm are the exact kernels only while integer activations are switched off
 * (mw_set_int_acts(0)); otherwise they hand the work to int_gemm.c (int8_dot.c for one token
 * on AVX-512 VNNI) and fall back here for shapes those do not take.
 *
 * Batches: 1..MAXM tokens go through every weight row together (q4_gemm, q8_gemm; more are
 * taken MAXM at a time); prefill goes in MAXM-token tiles, a tile per thread (*_gemm_tiles,
 * AVX-512 only), with the same row kernels, so no float copy of a weight is ever made.
 * M = 0 or N = 0 does nothing; K = 0 gives zeros.
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#define MAXM MW_MAX_ROWS

#if defined(__AVX512F__)
/* one token, rows r..r+3 together (as q8_gemv4) */
static void q4_gemv4(const float* x, int64_t K, const uint8_t* codes, const float* s,
                     const float* c, float* y, int64_t r) {
    const int64_t nb = K / 32;
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 x0 = _mm512_loadu_ps(x + b * 32), x1 = _mm512_loadu_ps(x + b * 32 + 16);
        for (int i = 0; i < 4; i++) {
            __m128i raw = _mm_loadu_si128((const __m128i*)(codes + (r + i) * (K / 2) + b * 16));
            __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
            __m512 vs = _mm512_set1_ps(s[(r + i) * nb + b]), vc = _mm512_set1_ps(c[(r + i) * nb + b]);
            __m512 w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vs), vc);
            __m512 w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vs), vc);
            acc[2 * i] = _mm512_fmadd_ps(w0, x0, acc[2 * i]);
            acc[2 * i + 1] = _mm512_fmadd_ps(w1, x1, acc[2 * i + 1]);
        }
    }
    for (int i = 0; i < 4; i++) y[r + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
}
#endif


#if defined(__AVX512F__)
/* Row kernels for a batch of M tokens, one output row n, input blocks [b0, b1). Each is
   instantiated for every M in 1..16 (Q_CASES): with M a compile-time constant the M
   accumulators live in registers and the token loop is unrolled. With M a run-time value GCC
   kept a compare-and-branch per FMA and reloaded pointers from the stack, which ran the q8
   kernel at a third of the FMA rate. */
#define Q_CASES(fn, ...) \
    case 1: fn(1, __VA_ARGS__); break;   case 2: fn(2, __VA_ARGS__); break; \
    case 3: fn(3, __VA_ARGS__); break;   case 4: fn(4, __VA_ARGS__); break; \
    case 5: fn(5, __VA_ARGS__); break;   case 6: fn(6, __VA_ARGS__); break; \
    case 7: fn(7, __VA_ARGS__); break;   case 8: fn(8, __VA_ARGS__); break; \
    case 9: fn(9, __VA_ARGS__); break;   case 10: fn(10, __VA_ARGS__); break; \
    case 11: fn(11, __VA_ARGS__); break; case 12: fn(12, __VA_ARGS__); break; \
    case 13: fn(13, __VA_ARGS__); break; case 14: fn(14, __VA_ARGS__); break; \
    case 15: fn(15, __VA_ARGS__); break; default: fn(16, __VA_ARGS__); break;

static inline __attribute__((always_inline)) void q4_row_m(
        const int M, const float* xp, const uint8_t* qr, const float* sr,
        const float* cr, int64_t b0, int64_t b1, float* y, int64_t N, int64_t n) {
    __m512 acc[MAXM];
    #pragma GCC unroll 16
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i*)(qr + b * 16));
        __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
        __m512 vs = _mm512_set1_ps(sr[b]), vc = _mm512_set1_ps(cr[b]);
        __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
        __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
        w0 = _mm512_add_ps(_mm512_mul_ps(w0, vs), vc);
        w1 = _mm512_add_ps(_mm512_mul_ps(w1, vs), vc);
        #pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            const float* xb = xp + (2 * b * M + m) * 16;
            acc[m] = _mm512_fmadd_ps(w1, _mm512_load_ps(xb + M * 16),
                                     _mm512_fmadd_ps(w0, _mm512_load_ps(xb), acc[m]));
        }
    }
    #pragma GCC unroll 16
    for (int m = 0; m < M; m++)
        y[m * N + n] = (b0 ? y[m * N + n] : 0.f) + _mm512_reduce_add_ps(acc[m]);
}

static inline __attribute__((always_inline)) void q8_row_m(
        const int M, const float* xp, int64_t G, const int8_t* qr, const float* sr,
        const float* cr, int64_t g0, int64_t g1, float* y, int64_t N, int64_t n) {
    __m512 acc[MAXM];
    #pragma GCC unroll 16
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        __m512 vs = _mm512_set1_ps(sr[g]), vc = _mm512_set1_ps(cr[g]);
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qr + k))));
            w = _mm512_add_ps(_mm512_mul_ps(w, vs), vc);
            #pragma GCC unroll 16
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(w, _mm512_load_ps(xp + (k / 16 * M + m) * 16), acc[m]);
        }
    }
    #pragma GCC unroll 16
    for (int m = 0; m < M; m++)
        y[m * N + n] = (g0 ? y[m * N + n] : 0.f) + _mm512_reduce_add_ps(acc[m]);
}
#endif

#if defined(__AVX512F__)
/* x [M, K] -> chunks of 16 values, token-minor: chunk j of token m at xp + (j * M + m) * 16.
   The row kernels then reach every token's slice through one pointer and constant offsets;
   with M separate row pointers they ran out of general registers and reloaded them. */
static float* pack_x16(const float* x, int64_t M, int64_t K) {
    float* xp = aligned_alloc(64, (size_t)(M * K * sizeof(float) + 63) / 64 * 64);
    if (xp)
        for (int64_t j = 0; j < K / 16; j++)
            for (int64_t m = 0; m < M; m++) memcpy(xp + (j * M + m) * 16, x + m * K + j * 16, 64);
    return xp;
}

/* A kernel that cannot get its scratch (up to 16 tokens of x) must not return a y it never
   wrote: stop with a message (the process is out of memory; torch fails at its next step). */
static void out_of_memory(const char* where, size_t bytes) {
    fprintf(stderr, "memwall: %s could not allocate %zu bytes\n", where, bytes);
    abort();
}
#endif

/* Several tokens go through K in blocks small enough that their slice of x stays in L1
   while every weight row streams past it: for a down projection (K = 1536) 16 tokens' x is
   96 KB, and re-reading it from L2 for each row made it as slow as gate_up at twice the
   weights. Each thread keeps the same output rows for every block (static schedule), so the
   partial sums it adds into y are its own. Returns values per block, a multiple of align. */
#define L1_X_BYTES (40 * 1024)
static int64_t k_block(int64_t M, int64_t K, int64_t align) {
    int64_t kc = L1_X_BYTES / (4 * (M > 0 ? M : 1)) / align * align;
    if (kc < align) kc = align;
    return kc < K ? kc : K;
}

/* 1 when there is nothing to multiply: no tokens or no outputs (a prefill chunk that asks the
   LM head for no rows), or K = 0 (y is then zeros) */
static int nothing_to_do(int64_t M, int64_t K, float* y, int64_t N) {
    if (M <= 0 || N <= 0) return 1;
    if (K <= 0) memset(y, 0, sizeof(float) * M * N);
    return K <= 0;
}

/* AVX-512 builds: with a full tile of MAXM tokens for every thread, the fp32 tiles (exact)
 * beat int16 activations, whose 256-bit VNNI rows pay per token (2-core Xeon, Sapphire
 * Rapids, SmolLM2's four projections per layer: 32 tokens 1.1 vs 1.4 ms, 64: 2.1 vs 2.7 ms,
 * 96: 3.2 vs 4.2 ms; 16 tokens, one tile for two threads: 1.1 vs 0.74 ms). */
int64_t mw_tiles_from(void) {
#if defined(__AVX512F__)
    return MAXM * (int64_t)omp_get_max_threads();
#else
    return 0;  /* no tiles: int16 activations up to quant_ops.INT_ACTS_MAX_TOKENS */
#endif
}

static int tiles_pay(int64_t M) {
    const int64_t from = mw_tiles_from();
    return from > 0 && M >= from;
}

/* the exact fp32 kernel (float32 scales), MAXM tokens at a time */
static void q4_gemm_exact(const float* x, int64_t M, int64_t K, const uint8_t* codes,
                          const float* s, const float* c, float* y, int64_t N) {
    if (M > MAXM) {
        for (int64_t m0 = 0; m0 < M; m0 += MAXM)
            q4_gemm_exact(x + m0 * K, M - m0 < MAXM ? M - m0 : MAXM, K, codes, s, c, y + m0 * N, N);
        return;
    }
    const int64_t nb = K / 32;
#if defined(__AVX512F__)
    if (M == 1 && N % 4 == 0) {
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < N; r += 4) q4_gemv4(x, K, codes, s, c, y, r);
        return;
    }
#endif
    const int64_t kb = k_block(M, K, 32) / 32;
#if defined(__AVX512F__)
    float* xp = pack_x16(x, M, K);
    if (!xp) out_of_memory("q4_gemm/q8_gemm", (size_t)(M * K * sizeof(float)));
#endif
    #pragma omp parallel
    for (int64_t b0 = 0; b0 < nb; b0 += kb) {
        const int64_t b1 = b0 + kb < nb ? b0 + kb : nb;
        #pragma omp for schedule(static) nowait
        for (int64_t n = 0; n < N; n++) {
            const uint8_t* qr = codes + n * (K / 2);
            const float* sr = s + n * nb;
            const float* cr = c + n * nb;
#define ADD_Y(m, v) (y[(m) * N + n] = (b0 ? y[(m) * N + n] : 0.f) + (v))
#if defined(__AVX512F__)
            switch (M) { Q_CASES(q4_row_m, xp, qr, sr, cr, b0, b1, y, N, n) }
#elif defined(HAVE_AVX2)
            /* 4 accumulators a row: one FMA chain per 8-value slice, so a single token is not
               held up by FMA latency */
            __m256 acc[MAXM][4];
            for (int64_t m = 0; m < M; m++)
                for (int i = 0; i < 4; i++) acc[m][i] = _mm256_setzero_ps();
            for (int64_t b = b0; b < b1; b++) {
                __m128i raw = _mm_loadu_si128((const __m128i*)(qr + b * 16));
                __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
                __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
                __m256 vs = _mm256_set1_ps(sr[b]), vc = _mm256_set1_ps(cr[b]);
                __m256 w[4];
                w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(_mm256_mul_ps(w[i], vs), vc);
                for (int64_t m = 0; m < M; m++) {
                    const float* xb = x + m * K + b * 32;
                    for (int i = 0; i < 4; i++)
                        acc[m][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i]);
                }
            }
            for (int64_t m = 0; m < M; m++)
                ADD_Y(m, mw_hsum256(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                            _mm256_add_ps(acc[m][2], acc[m][3]))));
#else
            float acc[MAXM] = {0};
            for (int64_t b = b0; b < b1; b++) {
                float w[32];
                for (int j = 0; j < 16; j++) {
                    w[j] = (float)(qr[b * 16 + j] & 15) * sr[b] + cr[b];
                    w[j + 16] = (float)(qr[b * 16 + j] >> 4) * sr[b] + cr[b];
                }
                for (int64_t m = 0; m < M; m++)
                    for (int j = 0; j < 32; j++) acc[m] += w[j] * x[m * K + b * 32 + j];
            }
            for (int64_t m = 0; m < M; m++) ADD_Y(m, acc[m]);
#endif
#undef ADD_Y
        }
    }
#if defined(__AVX512F__)
    free(xp);
#endif
}

/* y[m, n] = sum_k x[m, k] * (s[n, k/G] * q[n, k] + c[n, k/G]);  G % 16 == 0 */
#if defined(__AVX512F__)
/* one token, rows r..r+3 together: four independent FMA chains sharing each x load */
static void q8_gemv4(const float* x, int64_t K, int64_t G, const int8_t* codes,
                     const float* s, const float* c, float* y, int64_t r) {
    const int64_t ng = K / G;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < ng; g++) {
        __m512 vs[4], vc[4];
        for (int i = 0; i < 4; i++) {
            vs[i] = _mm512_set1_ps(s[(r + i) * ng + g]);
            vc[i] = _mm512_set1_ps(c[(r + i) * ng + g]);
        }
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            __m512 xk = _mm512_loadu_ps(x + k);
            for (int i = 0; i < 4; i++) {
                __m128i raw = _mm_loadu_si128((const __m128i*)(codes + (r + i) * K + k));
                __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
                w = _mm512_add_ps(_mm512_mul_ps(w, vs[i]), vc[i]);
                acc[i] = _mm512_fmadd_ps(w, xk, acc[i]);
            }
        }
    }
    for (int i = 0; i < 4; i++) y[r + i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

static void q8_gemm_exact(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                          const float* s, const float* c, float* y, int64_t N) {
    if (M > MAXM) {
        for (int64_t m0 = 0; m0 < M; m0 += MAXM)
            q8_gemm_exact(x + m0 * K, M - m0 < MAXM ? M - m0 : MAXM, K, G, codes, s, c,
                          y + m0 * N, N);
        return;
    }
    const int64_t ng = K / G;
#if defined(__AVX512F__)
    if (M == 1 && N % 4 == 0) {
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < N; r += 4) q8_gemv4(x, K, G, codes, s, c, y, r);
        return;
    }
#endif
    const int64_t kg = k_block(M, K, G) / G;
#if defined(__AVX512F__)
    float* xp = pack_x16(x, M, K);
    if (!xp) out_of_memory("q4_gemm/q8_gemm", (size_t)(M * K * sizeof(float)));
#endif
    #pragma omp parallel
    for (int64_t g0 = 0; g0 < ng; g0 += kg) {
        const int64_t g1 = g0 + kg < ng ? g0 + kg : ng;
        #pragma omp for schedule(static) nowait
        for (int64_t n = 0; n < N; n++) {
            const int8_t* qr = codes + n * K;
            const float* sr = s + n * ng;
            const float* cr = c + n * ng;
#define ADD_Y(m, v) (y[(m) * N + n] = (g0 ? y[(m) * N + n] : 0.f) + (v))
#if defined(__AVX512F__)
            switch (M) { Q_CASES(q8_row_m, xp, G, qr, sr, cr, g0, g1, y, N, n) }
#elif defined(HAVE_AVX2)
            __m256 acc[MAXM][2];  /* two FMA chains a row (G % 16 == 0) */
            for (int64_t m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
            for (int64_t g = g0; g < g1; g++) {
                __m256 vs = _mm256_set1_ps(sr[g]), vc = _mm256_set1_ps(cr[g]);
                for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                    __m128i raw = _mm_loadu_si128((const __m128i*)(qr + k));
                    __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                    __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
                    w0 = _mm256_add_ps(_mm256_mul_ps(w0, vs), vc);
                    w1 = _mm256_add_ps(_mm256_mul_ps(w1, vs), vc);
                    for (int64_t m = 0; m < M; m++) {
                        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), acc[m][0]);
                        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), acc[m][1]);
                    }
                }
            }
            for (int64_t m = 0; m < M; m++) ADD_Y(m, mw_hsum256(_mm256_add_ps(acc[m][0], acc[m][1])));
#else
            float acc[MAXM] = {0};
            for (int64_t k = g0 * G; k < g1 * G; k++) {
                float w = (float)qr[k] * sr[k / G] + cr[k / G];
                for (int64_t m = 0; m < M; m++) acc[m] += w * x[m * K + k];
            }
            for (int64_t m = 0; m < M; m++) ADD_Y(m, acc[m]);
#endif
#undef ADD_Y
        }
    }
#if defined(__AVX512F__)
    free(xp);
#endif
}

#if defined(__AVX512F__)
/* q4 (is_q4: 32-value blocks, codes K/2 bytes a row) or q8 (groups of G, codes K bytes a row) */
static int gemm_tiles(int is_q4, const float* x, int64_t M, int64_t K, int64_t G,
                      const void* codes, const float* s, const float* c, float* y, int64_t N) {
    const int64_t ng = K / G, kg = k_block(MAXM, K, G) / G, row_bytes = is_q4 ? K / 2 : K;
    int ok = 1;  /* 0 when a tile's scratch could not be allocated */
    #pragma omp parallel for schedule(dynamic, 1) reduction(min: ok)
    for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
        const int64_t rows = M - m0 < MAXM ? M - m0 : MAXM;
        float* xp = pack_x16(x + m0 * K, rows, K);
        if (!xp) { ok = 0; continue; }
        float* yt = y + m0 * N;
        for (int64_t g0 = 0; g0 < ng; g0 += kg) {
            const int64_t g1 = g0 + kg < ng ? g0 + kg : ng;
            for (int64_t n = 0; n < N; n++) {
                const void* qr = (const uint8_t*)codes + n * row_bytes;
                const float *sr = s + n * ng, *cr = c + n * ng;
                if (is_q4)
                    switch (rows) { Q_CASES(q4_row_m, xp, qr, sr, cr, g0, g1, yt, N, n) }
                else
                    switch (rows) { Q_CASES(q8_row_m, xp, G, qr, sr, cr, g0, g1, yt, N, n) }
            }
        }
        free(xp);
    }
    return ok;
}
#endif

/* y[m, n] = sum_k x[m, k] * (s[n, k/32] * q[n, k] + c[n, k/32]), through the fastest path
   that takes the shape (VNNI int8 digits for up to MW_I8_MAX_ROWS tokens, each row as the
   one-token gemv computes it; int8 activations for prefill on K-quants; fp32 tiles; int16
   activations; exact kernel) */
void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
             const void* c, float* y, int64_t N, int half) {
    if (nothing_to_do(M, K, y, N)) return;
    if (M == 1 && mw_q4_gemv_i8(x, K, codes, s, c, y, N, half)) return;  /* AVX-512 VNNI gemv */
    if (M <= MW_I8_MAX_ROWS && mw_q4_gemm_i8(x, M, K, codes, s, c, y, N, half)) return;
    if (mw_q4_gemm_i8t(x, M, K, codes, s, c, y, N, half)) return;  /* prefill, K-quants */
    if (M > MW_I8_MAX_ROWS && mw_q4_gemm_p16(x, M, K, codes, s, c, y, N, half)) return;  /* VNNI */
    if (tiles_pay(M) && q4_gemm_tiles(x, M, K, codes, s, c, y, N, half)) return;
    if (mw_q4_gemm_i16(x, M, K, codes, s, c, y, N, half)) return;        /* int16 activations */
    mw_f32_tables t = mw_tables_f32(s, c, N * (K / 32), half);
    q4_gemm_exact(x, M, K, codes, t.s, t.c, y, N);
    mw_free_tables(&t);
}

void q8_gemm(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
             const void* s, const void* c, float* y, int64_t N, int half) {
    if (nothing_to_do(M, K, y, N)) return;
    if (M == 1 && mw_q8_gemv_i8(x, K, G, codes, s, c, y, N, half)) return;
    if (M <= MW_I8_MAX_ROWS && mw_q8_gemm_i8(x, M, K, G, codes, s, c, y, N, half)) return;
    if (mw_q8_gemm_i8t(x, M, K, G, codes, s, c, y, N, half)) return;
    if (M > MW_I8_MAX_ROWS && mw_q8_gemm_p16(x, M, K, G, codes, s, c, y, N, half)) return;
    if (tiles_pay(M) && q8_gemm_tiles(x, M, K, G, codes, s, c, y, N, half)) return;
    if (mw_q8_gemm_i16(x, M, K, G, codes, s, c, y, N, half)) return;
    mw_f32_tables t = mw_tables_f32(s, c, N * (K / G), half);
    q8_gemm_exact(x, M, K, G, codes, t.s, t.c, y, N);
    mw_free_tables(&t);
}

/* Many tokens (prefill): tiles of MAXM tokens, a tile per thread at a time, each tile through
   every output row with the same row kernels (its x packed, K-blocked for L1). The layer's
   quantized weights (a few MB) are re-read from cache once per tile, which is cheaper than the
   float copy BLAS needs: 1.2-1.6x dequantize + fp32 BLAS on a 2048-token prefill, and no
   [N, K] float buffer. Return 0 where there is no AVX-512 (the caller then uses BLAS). */
int q4_gemm_tiles(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half) {
#if defined(__AVX512F__)
    if (nothing_to_do(M, K, y, N)) return 1;
    mw_f32_tables t = mw_tables_f32(s, c, N * (K / 32), half);
    const int ok = gemm_tiles(1, x, M, K, 32, codes, t.s, t.c, y, N);
    mw_free_tables(&t);
    return ok;
#else
    (void)x; (void)M; (void)K; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}

int q8_gemm_tiles(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                  const void* s, const void* c, float* y, int64_t N, int half) {
#if defined(__AVX512F__)
    if (nothing_to_do(M, K, y, N)) return 1;
    mw_f32_tables t = mw_tables_f32(s, c, N * (K / G), half);
    const int ok = gemm_tiles(0, x, M, K, G, codes, t.s, t.c, y, N);
    mw_free_tables(&t);
    return ok;
#else
    (void)x; (void)M; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}

/* the weights as float32 [N, K], for large batches (then a BLAS matmul) */
void q4_dequant(const uint8_t* codes, const void* s16, const void* c16, float* w, int64_t N,
                int64_t K, int half) {
    mw_f32_tables t = mw_tables_f32(s16, c16, N * (K / 32), half);
    const float *s = t.s, *c = t.c;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < K / 32; b++) {
            const uint8_t* q = codes + n * (K / 2) + b * 16;
            float sb = s[n * (K / 32) + b], cb = c[n * (K / 32) + b];
            float* o = w + n * K + b * 32;
            for (int j = 0; j < 16; j++) {
                o[j] = (float)(q[j] & 15) * sb + cb;
                o[j + 16] = (float)(q[j] >> 4) * sb + cb;
            }
        }
    mw_free_tables(&t);
}

void q8_dequant(const int8_t* codes, const void* s16, const void* c16, float* w, int64_t N,
                int64_t K, int64_t G, int half) {
    mw_f32_tables t = mw_tables_f32(s16, c16, N * (K / G), half);
    const float *s = t.s, *c = t.c;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            w[n * K + k] = (float)codes[n * K + k] * s[n * (K / G) + k / G] + c[n * (K / G) + k / G];
    mw_free_tables(&t);
}
