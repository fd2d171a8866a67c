/* memwall's batched q4/q8 matmuls on AVX-512 VNNI: output rows across the vector lanes (see
 * kernels.h for the other files).
 *
 * Why: prefill and large decode batches are compute-bound. The fp32 tiles (quant_gemm.c) spend
 * one FMA per weight and token: 16 multiply-adds an instruction. int_gemm.c's int16 kernels
 * put a block's 32 inputs across the lanes, so every block and token ends in a reduction
 * across lanes and a float convert, scale and FMA of a vector that is mostly partial sums.
 * Here the 16 lanes of a vector are 16 output rows ("a panel"), and each 32-bit lane holds two
 * consecutive inputs of its row as int16. One vpdpwssd then does 32 multiply-adds for 16 rows
 * with one token's input pair broadcast from memory, and a 32-value block costs a token
 *
 *   16 x vpdpwssd (512 multiply-adds)  +  convert, scale, FMA of 16 finished row sums
 *
 * with no reduction across lanes at all; the 16 outputs of a token are one contiguous store.
 * On a 2-core AMD EPYC (Zen 4, AVX-512 VNNI) SmolLM2-135M's four projections ran at 2.2-2.6x
 * the fp32 tiles' speed for 128-480 tokens (see the commit that added this file).
 *
 * The weight stays quantized in memory. A panel's codes are widened to int16 and transposed
 * into the lane order once (16 rows x K inputs, K * 64 bytes: 48 KB at K = 1536, in L2) and
 * every token of the batch then runs over them, 8 tokens at a time (8 independent
 * accumulator chains hide vpdpwssd's latency). Scales and offsets of the panel's rows are
 * widened to float32 side by side the same way (any table format of kernels.h).
 *
 * Precision: activations as int16 with a scale per 32 values, as int_gemm.c (relative error
 * ~2e-5; the exact float sums of x meet the offsets): the same arithmetic as the int16 path
 * every batch of up to quant_ops.INT_ACTS_MAX_TOKENS tokens takes on AVX2 machines.
 *
 *   y[m, n] = sum_b s[n, g(b)] * u[m, b] * sum_{k in b} q[n, k] * a[m, k] + sum_g c[n, g] * xsum[m, g]
 *
 * Returns 0 (the caller then takes its next path) where the build has no AVX-512 VNNI, integer
 * activations are off, the shape does not fit (K not a multiple of 32; a q8 group of 16 with K
 * not a multiple of 32) or memory runs out.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MW_PANEL_VNNI 1
#endif

#define PANEL 16   /* output rows a panel: one 32-bit lane each */
#define PT 8       /* tokens a panel kernel holds accumulators for */
#define ABLOCK 32  /* activation values a scale */

int mw_panel_available(void) {
#if defined(MW_PANEL_VNNI)
    return 1;
#else
    return 0;
#endif
}

#if defined(MW_PANEL_VNNI)

typedef struct {
    int32_t* acts;  /* [M][K / 2]: int16 pairs, input k in the low half, k + 1 in the high */
    float* u;       /* [M][K / 32]: each block's scale, max|x| / 32767 */
    float* xsum;    /* [M][K / G]: exact float sums of x over each weight group */
} p16acts;

static void free_p16acts(p16acts* a) { free(a->acts); free(a->u); free(a->xsum); }

/* x [M, K] -> p16acts (K a multiple of 32, G 16 or a multiple of 32); 0 when out of memory.
 * quads: each 4 values stored in the order 0, 2, 1, 3 (the pairs packed panels unpack to) */
static int quantize_p16(const float* x, int64_t M, int64_t K, int64_t G, int quads, p16acts* a) {
    const int64_t nb = K / ABLOCK, ng = K / G;
    a->acts = (int32_t*)aligned_alloc(64, (size_t)((M * K * 2 + 63) / 64 * 64));
    a->u = (float*)malloc(sizeof(float) * (size_t)(M * nb));
    a->xsum = (float*)malloc(sizeof(float) * (size_t)(M * ng));
    if (!a->acts || !a->u || !a->xsum) { free_p16acts(a); return 0; }
    const __m512 sign = _mm512_set1_ps(-0.f);
    #pragma omp parallel for schedule(static) if (M * K >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        int16_t* q = (int16_t*)(a->acts + m * (K / 2));
        float* xs = a->xsum + m * ng;
        for (int64_t g = 0; g < ng; g++) xs[g] = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            const __m512 v0 = _mm512_loadu_ps(xm + b * ABLOCK), v1 = _mm512_loadu_ps(xm + b * ABLOCK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0),
                                                                  _mm512_andnot_ps(sign, v1)));
            const __m512 id = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
            a->u[m * nb + b] = amax / 32767.f;
            /* round to nearest even (nearbyintf's), saturated into int16 */
            __m256i q0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id)));
            __m256i q1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id)));
            if (quads) {  /* 0 1 2 3 -> 0 2 1 3 in every 4 */
                q0 = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(q0, 0xD8), 0xD8);
                q1 = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(q1, 0xD8), 0xD8);
            }
            _mm256_storeu_si256((__m256i*)(q + b * ABLOCK), q0);
            _mm256_storeu_si256((__m256i*)(q + b * ABLOCK + 16), q1);
            if (G == 16) {
                xs[2 * b] = _mm512_reduce_add_ps(v0);
                xs[2 * b + 1] = _mm512_reduce_add_ps(v1);
            } else {
                xs[b * ABLOCK / G] += _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            }
        }
    }
    return 1;
}

/* Rows n0 .. n0 + rows - 1 (rows <= 16; the lanes past them zero) in the panel layout:
 * W[k / 2] holds, in lane r, inputs k and k + 1 of row n0 + r as int16; S[g] / C[g] the rows'
 * scales / offsets of group g as float (C NULL-equivalent: *has_off 0 when all are zero).
 * tmp: 16 x ng floats of scratch. */
static void unpack_panel(int is_q4, const uint8_t* codes, int64_t K, int64_t G, const void* s,
                         const void* c, int half, int64_t n0, int rows, __m512i* W, float* S,
                         float* C, int* has_off, float* tmp) {
    const int64_t nb = K / ABLOCK, ng = K / G, row_bytes = is_q4 ? K / 2 : K;
    for (int64_t b = 0; b < nb; b++) {
        __m512i r[PANEL];
        for (int i = 0; i < PANEL; i++) {
            if (i >= rows) { r[i] = _mm512_setzero_si512(); continue; }
            const uint8_t* q = codes + (n0 + i) * row_bytes;
            if (is_q4) {  /* byte j: input j in the low nibble, j + 16 in the high */
                const __m128i raw = _mm_loadu_si128((const __m128i*)(q + b * 16));
                const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
                r[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
            } else {
                r[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + b * 32)));
            }
        }
        mw_transpose16(r);
        for (int j = 0; j < PANEL; j++) _mm512_store_si512(W + b * PANEL + j, r[j]);
    }
    /* the tables, row by row into tmp, then lane by lane */
    for (int which = 0; which < 2; which++) {
        float* dst = which ? C : S;
        const void* table = which ? c : s;
        for (int i = 0; i < PANEL; i++) {
            float* row = tmp + i * ng;
            if (i >= rows || (which && !table)) { memset(row, 0, sizeof(float) * (size_t)ng); continue; }
            const float* view = mw_scales_f32(table, half, (n0 + i) * ng, ng, row);
            if (view != row) memcpy(row, view, sizeof(float) * (size_t)ng);
        }
        int nonzero = 0;
        for (int64_t g = 0; g < ng; g++)
            for (int i = 0; i < PANEL; i++) {
                dst[g * PANEL + i] = tmp[i * ng + g];
                nonzero |= tmp[i * ng + g] != 0.f;
            }
        if (which) *has_off = nonzero;
    }
}

/* TM tokens (acts rows of K / 2 dwords) against one panel; D dwords a unit (16: 32-value
 * units; 8: a q8 group of 16, two units a block), a unit's scale S[g(unit)]. Writes the 16
 * outputs of each token to y[t * N ...] under mask. */
static inline __attribute__((always_inline)) void panel_tile(
        const int TM, const int D, const __m512i* W, const float* S, const float* C,
        int64_t K, int64_t G, const int32_t* acts, const float* u, const float* xsum,
        float* y, int64_t N, __mmask16 mask) {
    const int64_t K2 = K / 2, nb = K / ABLOCK, ng = K / G, units = K2 / D;
    __m512 acc[PT];
    #pragma GCC unroll 8
    for (int t = 0; t < PT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t e = 0; e < units; e++) {
        __m512i ia[PT];
        #pragma GCC unroll 8
        for (int t = 0; t < PT; t++) ia[t] = _mm512_setzero_si512();
        const __m512i* w = W + e * D;
        const int32_t* ae = acts + e * D;
        #pragma GCC unroll 16
        for (int j = 0; j < D; j++) {
            const __m512i wj = _mm512_load_si512(w + j);
            #pragma GCC unroll 8
            for (int t = 0; t < TM; t++) ia[t] = _mm512_dpwssd_epi32(ia[t], wj, _mm512_set1_epi32(ae[t * K2 + j]));
        }
        const int64_t b = e * D * 2 / ABLOCK, g = e * D * 2 / G;
        const __m512 sv = _mm512_load_ps(S + g * PANEL);
        #pragma GCC unroll 8
        for (int t = 0; t < TM; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(sv, _mm512_set1_ps(u[t * nb + b])), acc[t]);
    }
    if (C)
        for (int64_t g = 0; g < ng; g++) {
            const __m512 cv = _mm512_load_ps(C + g * PANEL);
            #pragma GCC unroll 8
            for (int t = 0; t < TM; t++) acc[t] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xsum[t * ng + g]), acc[t]);
        }
    #pragma GCC unroll 8
    for (int t = 0; t < TM; t++) _mm512_mask_storeu_ps(y + t * N, mask, acc[t]);
}

/* Where a panel's codes and tables come from: a weight in the row layout (unpack_panel
 * transposes 16 rows) or one packed at load (unpack_packed only widens) */
typedef struct {
    int packed;         /* 1: packed_gemm.c's layout, flags below; 0: rows, is_q4 and half */
    int is_q4, half, flags;
    const void* codes;
    const void* s;
    const void* c;
} panel_source;

/* One packed panel (packed_gemm.c's layout) as unpack_panel leaves a row-layout one: W[k / 2]
 * lane r = an int16 pair of row r, S / C the rows' tables as float. The pairs come out as
 * (4g, 4g + 2) and (4g + 1, 4g + 3) of each 4 inputs, which is why the activations go in
 * quad order (quantize_p16). */
static void unpack_packed(const uint8_t* codes, const void* s, const void* c, int64_t p,
                          int64_t K, int flags, __m512i* W, float* S, float* C) {
    const int64_t nb = K / ABLOCK, cb = flags & MW_PK_Q8 ? 512 : 256;
    const uint8_t* panel = codes + p * nb * cb;
    const __m512i m4 = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32((int)0x80808080u);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = panel + b * cb;
        __m512i* w = W + b * PANEL;
        if (flags & MW_PK_Q8) {  /* vector i: inputs 4i..4i+3, signed + 128 */
            for (int i = 0; i < 8; i++) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * i), bias);
                w[2 * i] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
                w[2 * i + 1] = _mm512_srai_epi16(v, 8);
            }
        } else {  /* vector i: low nibbles inputs 4i..4i+3, high nibbles 16+4i.. */
            for (int i = 0; i < 4; i++) {
                const __m512i v = _mm512_loadu_si512(blk + 64 * i);
                w[2 * i] = _mm512_and_si512(v, m4);
                w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), m4);
                w[8 + 2 * i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                w[8 + 2 * i + 1] = _mm512_srli_epi16(v, 12);
            }
        }
    }
    const int64_t ng = flags & MW_PK_G16 ? 2 * nb : nb;  /* groups of 16 or 32 values */
    for (int which = 0; which < (flags & MW_PK_OFFSETS ? 2 : 1); which++)
        for (int64_t g = 0; g < ng; g++)
            _mm512_store_ps((which ? C : S) + g * PANEL,
                            mw_packed_table(which ? c : s, p, g, ng, mw_packed_fmt(flags)));
}

/* Every panel of the weight against every token: y [M, N] (row stride ldy) */
static int run_panels(const panel_source* src, const float* x, int64_t M, int64_t K, int64_t G,
                      float* y, int64_t N, int64_t ldy) {
    const int64_t ng = K / G, panels = (N + PANEL - 1) / PANEL;
    p16acts a;
    if (!quantize_p16(x, M, K, G, src->packed, &a)) return 0;
    int ok = 1;
    #pragma omp parallel
    {
        __m512i* W = (__m512i*)aligned_alloc(64, (size_t)(K / 2) * 64);
        float* S = (float*)aligned_alloc(64, sizeof(float) * (size_t)(ng * PANEL));
        float* C = (float*)aligned_alloc(64, sizeof(float) * (size_t)(ng * PANEL));
        float* tmp = (float*)malloc(sizeof(float) * (size_t)(ng * PANEL));
        const int fine = W && S && C && tmp;
        if (!fine) {
            #pragma omp atomic write
            ok = 0;
        }
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (!fine) continue;
            const int64_t n0 = p * PANEL;
            const int rows = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            const __mmask16 mask = (__mmask16)((1u << rows) - 1u);
            int has_off = 0;
            if (src->packed) {
                unpack_packed((const uint8_t*)src->codes, src->s, src->c, p, K, src->flags, W, S, C);
                has_off = (src->flags & MW_PK_OFFSETS) != 0;
            } else {
                unpack_panel(src->is_q4, (const uint8_t*)src->codes, K, G, src->s, src->c,
                             src->half, n0, rows, W, S, C, &has_off, tmp);
            }
            const float* co = has_off ? C : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += PT) {
                const int64_t tm = M - m0 < PT ? M - m0 : PT;
                const int32_t* at = a.acts + m0 * (K / 2);
                const float* ut = a.u + m0 * (K / ABLOCK);
                const float* xt = a.xsum + m0 * ng;
                float* yt = y + m0 * ldy + n0;
#define MW_PANEL_TILE(tm, d) panel_tile(tm, d, W, S, co, K, G, at, ut, xt, yt, ldy, mask)
#define MW_PANEL_D(tm, unused) if (G == 16) MW_PANEL_TILE(tm, 8); else MW_PANEL_TILE(tm, 16);
                switch (tm) { MW_TM_CASES(MW_PANEL_D, 0) }
#undef MW_PANEL_D
#undef MW_PANEL_TILE
            }
        }
        free(W); free(S); free(C); free(tmp);
    }
    free_p16acts(&a);
    return ok;
}

static int panel_gemm(int is_q4, const float* x, int64_t M, int64_t K, int64_t G, const void* codes,
                      const void* s, const void* c, float* y, int64_t N, int half) {
    if (!mw_int_acts || M <= 0 || N <= 0 || K <= 0 || K % ABLOCK) return 0;
    if (G != 16 && G % ABLOCK) return 0;
    const panel_source src = {0, is_q4, half, 0, codes, s, c};
    return run_panels(&src, x, M, K, G, y, N, N);
}

int mw_packed_gemm_p16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                       const void* c, int flags, float* y, int64_t N, int64_t ldy) {
    if (!mw_int_acts || M <= 0 || N <= 0 || K <= 0 || K % ABLOCK || N % PANEL) return 0;
    if (flags & (MW_PK_TWO_LEVEL | MW_PK_G16) && K % 256) return 0;
    const panel_source src = {1, 0, 0, flags, codes, s, c};
    return run_panels(&src, x, M, K, flags & MW_PK_G16 ? 16 : ABLOCK, y, N, ldy);
}

#else

int mw_packed_gemm_p16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                       const void* c, int flags, float* y, int64_t N, int64_t ldy) {
    (void)x; (void)M; (void)K; (void)codes; (void)s; (void)c; (void)flags; (void)y; (void)N;
    (void)ldy;
    return 0;
}

static int panel_gemm(int is_q4, const float* x, int64_t M, int64_t K, int64_t G, const void* codes,
                      const void* s, const void* c, float* y, int64_t N, int half) {
    (void)is_q4; (void)x; (void)M; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y;
    (void)N; (void)half;
    return 0;
}

#endif

int mw_q4_gemm_p16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half) {
    return panel_gemm(1, x, M, K, 32, codes, s, c, y, N, half);
}

int mw_q8_gemm_p16(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half) {
    return panel_gemm(0, x, M, K, G, codes, s, c, y, N, half);
}
