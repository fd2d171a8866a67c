/* memwall's matmuls on weights packed into 16-row panels at load (AVX-512 VNNI builds; see
 * kernels.h for the other files, memwall/kernels/cpu/panels.py for the packing).
 *
 * Why: a decode batch of 2-16 tokens is neither bandwidth- nor compute-bound on the row
 * kernels. int8_dot.c puts a block's inputs across the vector lanes, so every row and token
 * ends in a reduction across lanes, and its row kernels unpack each 32-value block once per
 * row; panel_gemm.c puts rows across the lanes but transposes every panel anew on each call,
 * which a 16-token batch cannot pay back. Here the transpose is done once, when the model
 * loads: 16 rows' codes for a 32-value block lie side by side as the lanes want them, and a
 * block costs a token
 *
 *   16 x vpdpbusd (1024 multiply-adds: two int8 digits of the token, broadcast from memory)
 *   + convert, scale and FMA of the 16 finished row sums
 *
 * with no reduction across lanes, whatever the number of tokens. The panel's codes are read
 * once for up to PK_TM tokens (then again from L1: a panel is K * 8 bytes of q4 codes).
 *
 * Packing permutes a weight in place, within each group of 16 rows (N a multiple of 16), so a
 * packed weight takes exactly the memory it took before; its three tensors stay apart:
 *
 *   codes   panel p, block b (nb = K / 32 blocks a row): CB bytes at codes + (p nb + b) CB.
 *           Vector i (64 bytes, lane r = row 16p + r) holds dword i of that row's block:
 *           q4 (CB 256): GGUF's 16 bytes, byte j = input j in the low nibble, j + 16 in the
 *           high, so vector i's low nibbles are inputs 4i..4i+3 and its high ones
 *           16+4i..16+4i+3; q8 (CB 512): 8 vectors, the signed codes + 128 (vpdpbusd's
 *           unsigned operand)
 *   s, c    16 entries (lane r = row 16p + r) at (p nb + b) 16: float32, or float16 with
 *           MW_PK_HALF; with MW_PK_TWO_LEVEL (Q4_K, Q5_K: 8 blocks a superblock) per panel and
 *           superblock 16 float32 d, then 8 x 16 int8 sub-values (entry = d * sub); with
 *           MW_PK_G16 (Q6_K) the same with a scale each 16 values, 16 sub-values a superblock;
 *           c only with MW_PK_OFFSETS (all-zero offsets are left out, as layout.py allows)
 *
 * Activations: each 32-value block of a token as d * (256 hi + lo), two int8 digits
 * (int8_dot.c's encoding: hi = round(x / d), d = max|x| / 127, lo the rounded remainder in
 * units of d / 256; relative error ~2e-5). Per block, token and row:
 *
 *   dot = 256 * sum q hi + sum q lo   (int32, exact; q8: minus 128 * sum(256 hi + lo))
 *   y  += s * (d / 256) * dot + c * (d / 256) * sum(256 hi + lo)
 *
 * Every token's arithmetic is the same whatever the batch and whichever tile it falls in, so
 * a batch's rows are bit-identical to one-token calls (speculative verification reproduces
 * one-token decode; prefill computes what decode would). With integer activations off
 * (mw_set_int_acts(0)) the same layout runs in fp32: w = s * q + c (rounded as the reference
 * dequantizer rounds it) times x, the quality reference.
 *
 * Returns 0 where the build has no AVX-512 VNNI (then there are no packed weights: panels.py
 * packs only where mw_packed_available() says so) or the shape does not fit the flags (K a
 * multiple of 32, of 256 with two-level tables; N of 16); out of memory for the digits it
 * computes in fp32, so decode.c need not handle a failure.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "kernels.h"

int mw_packed_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

/* bytes of one block of a panel's codes */
static inline int64_t pk_code_bytes(int flags) { return flags & MW_PK_Q8 ? 512 : 256; }

/* entry r of panel p, group g (ng a row) of a scale or offset table (mw_packed_table's
 * formats), plain C */
static inline float pk_entry(const void* t, int64_t p, int64_t g, int64_t ng, int r, int flags) {
    const uint8_t* u = (const uint8_t*)t;
    if (flags & (MW_PK_TWO_LEVEL | MW_PK_G16)) {
        const int64_t E = flags & MW_PK_G16 ? 16 : 8;
        const uint8_t* sb = u + (p * (ng / E) + g / E) * 16 * (4 + E);
        float d;
        memcpy(&d, sb + 4 * r, 4);
        return d * (float)(int8_t)sb[64 + 16 * (g % E) + r];
    }
    const int64_t e = (p * ng + g) * 16 + r;
    if (flags & MW_PK_HALF) {
        uint16_t h;
        memcpy(&h, u + e * 2, 2);
        return mw_half_to_float(h);
    }
    float f;
    memcpy(&f, u + e * 4, 4);
    return f;
}

/* Rows ids[0..T-1] of the packed weight as float32 [T, K]: s * q + c, the reference
 * dequantizer's rounding (an embedding lookup in a table tied to a packed LM head). Plain C:
 * it runs for a step's tokens, not for a matmul. */
void mw_packed_rows(const uint8_t* codes, const void* s, const void* c, int64_t K, int flags,
                    const int64_t* ids, int64_t T, float* out) {
    const int64_t nb = K / 32, cb = pk_code_bytes(flags);
    const int q8 = flags & MW_PK_Q8, g16 = (flags & MW_PK_G16) != 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t p = ids[t] / 16;
        const int r = (int)(ids[t] % 16);
        float* row = out + t * K;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* blk = codes + (p * nb + b) * cb;
            /* Q6_K: a scale each 16 values; else one a block */
            const float s0 = g16 ? pk_entry(s, p, 2 * b, 2 * nb, r, flags) : pk_entry(s, p, b, nb, r, flags);
            const float s1 = g16 ? pk_entry(s, p, 2 * b + 1, 2 * nb, r, flags) : s0;
            const float cv = flags & MW_PK_OFFSETS ? pk_entry(c, p, b, nb, r, flags) : 0.f;
            for (int j = 0; j < 32; j++) {
                int q;
                if (q8) {
                    q = (int)blk[(j / 4) * 64 + 4 * r + j % 4] - 128;
                } else {
                    const int jj = j % 16;
                    const uint8_t byte = blk[(jj / 4) * 64 + 4 * r + jj % 4];
                    q = j < 16 ? byte & 15 : byte >> 4;
                }
                row[b * 32 + j] = (j < 16 ? s0 : s1) * (float)q + cv;
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

#define PK_TM MW_TILE  /* tokens a tile holds accumulators for (8 x 16 rows in zmm registers) */
#ifndef PK_NP
#define PK_NP 4  /* panels one token takes a pass */
#endif
/* How far ahead (bytes) a tile asks for its panel's codes and tables: a panel is one stream,
 * and a decode step reads every weight from DRAM once */
#ifndef PK_PREFETCH
#define PK_PREFETCH 8192
#endif

typedef struct {
    int8_t* hi;     /* [M][K] high digits, natural order */
    int8_t* lo;     /* [M][K] low digits */
    float* dq;      /* [M][nb] d / 256 */
    int32_t* asum;  /* [M][2 nb] sum(256 hi + lo) of each 16 values: a block's two halves */
    float* xs;      /* [M][nb] dq * the block's sum: its quantized sum of x, for the offsets */
} pk_acts;

static void free_pk_acts(pk_acts* a) { free(a->hi); free(a->dq); free(a->asum); }

/* x [M, K] -> pk_acts; 0 when out of memory. Vector form of int8_dot.c's quantize_x (the
 * same rounding: cvtps rounds to nearest even as nearbyintf does). */
static int quantize_pk(const float* x, int64_t M, int64_t K, pk_acts* a) {
    const int64_t nb = K / 32;
    a->hi = (int8_t*)malloc((size_t)(2 * M * K) + 64);
    a->dq = (float*)malloc(sizeof(float) * (size_t)(2 * M * nb));
    a->asum = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * M * nb));
    if (!a->hi || !a->dq || !a->asum) { free_pk_acts(a); return 0; }
    a->lo = a->hi + M * K;
    a->xs = a->dq + M * nb;
    const __m512 sign = _mm512_set1_ps(-0.f), k256 = _mm512_set1_ps(256.f);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    #pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float* xb = x + m * K + b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0),
                                                                  _mm512_andnot_ps(sign, v1)));
            const float d = amax / 127.f;
            const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            const __m512 t0 = _mm512_mul_ps(v0, id), t1 = _mm512_mul_ps(v1, id);
            const __m512i h0 = _mm512_cvtps_epi32(t0), h1 = _mm512_cvtps_epi32(t1);
            __m512i l0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t0, _mm512_cvtepi32_ps(h0)), k256));
            __m512i l1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t1, _mm512_cvtepi32_ps(h1)), k256));
            l0 = _mm512_max_epi32(_mm512_min_epi32(l0, lim), nlim);
            l1 = _mm512_max_epi32(_mm512_min_epi32(l1, lim), nlim);
            int8_t* hi = a->hi + m * K + b * 32;
            int8_t* lo = a->lo + m * K + b * 32;
            _mm_storeu_si128((__m128i*)hi, _mm512_cvtepi32_epi8(h0));
            _mm_storeu_si128((__m128i*)(hi + 16), _mm512_cvtepi32_epi8(h1));
            _mm_storeu_si128((__m128i*)lo, _mm512_cvtepi32_epi8(l0));
            _mm_storeu_si128((__m128i*)(lo + 16), _mm512_cvtepi32_epi8(l1));
            const int32_t a0 = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0));
            const int32_t a1 = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1));
            a->asum[(m * nb + b) * 2] = a0;
            a->asum[(m * nb + b) * 2 + 1] = a1;
            a->dq[m * nb + b] = d / 256.f;
            a->xs[m * nb + b] = d / 256.f * (float)(a0 + a1);
        }
    return 1;
}

/* A token's two digits (h, l: the block's 8 words of each) against a block's 8 weight
 * vectors: the exact integer sums 256 q.hi + q.lo of inputs 0..15 (*first) and 16..31
 * (*second). Two chains a digit also hide vpdpbusd's latency when one token is alone. q8: w[i]
 * holds inputs 4i..4i+3; q4: w[2i] inputs 4i.., w[2i + 1] inputs 16 + 4i.. */
static inline __attribute__((always_inline)) void pk_dot(const int Q8, const __m512i* w,
        const int32_t* h, const int32_t* l, __m512i* first, __m512i* second) {
    __m512i ah = _mm512_setzero_si512(), al = _mm512_setzero_si512();
    __m512i ah2 = _mm512_setzero_si512(), al2 = _mm512_setzero_si512();
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512i w1 = Q8 ? w[i] : w[2 * i], w2 = Q8 ? w[4 + i] : w[2 * i + 1];
        ah = _mm512_dpbusd_epi32(ah, w1, _mm512_set1_epi32(h[i]));
        al = _mm512_dpbusd_epi32(al, w1, _mm512_set1_epi32(l[i]));
        ah2 = _mm512_dpbusd_epi32(ah2, w2, _mm512_set1_epi32(h[4 + i]));
        al2 = _mm512_dpbusd_epi32(al2, w2, _mm512_set1_epi32(l[4 + i]));
    }
    *first = _mm512_add_epi32(_mm512_slli_epi32(ah, 8), al);
    *second = _mm512_add_epi32(_mm512_slli_epi32(ah2, 8), al2);
}

/* TM tokens (digits at hi/lo + t * K) against NP consecutive panels from panel p (one token
 * alone takes PK_NP panels a pass: more independent work hides vpdpbusd's latency and keeps
 * more of the weight stream in flight); the 16 outputs of token t and panel p + u go to
 * y + t * ldy + 16 u. NP, TM, Q8, FMT (mw_packed_table's), OFF compile-time. */
static inline __attribute__((always_inline)) void pk_tile(
        const int NP, const int TM, const int Q8, const int FMT, const int OFF,
        const uint8_t* codes, const void* S, const void* C, int64_t p, int64_t K,
        const int8_t* hi, const int8_t* lo, const float* dq, const int32_t* asum,
        const float* xs, float* y, int64_t ldy) {
    const int64_t nb = K / 32, cb = Q8 ? 512 : 256;
    const int64_t tb = FMT == 3 ? 40 : FMT == 2 ? 24 : (FMT ? 32 : 64);  /* table bytes a block */
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 f[PK_NP][PK_TM];
    for (int u = 0; u < NP; u++)
        #pragma GCC unroll 8
        for (int t = 0; t < TM; t++) f[u][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        #pragma GCC unroll 4
        for (int u = 0; u < NP; u++) {
            const int64_t e = (p + u) * nb + b;  /* the panel block */
            const uint8_t* blk = codes + e * cb;
            #pragma GCC unroll 8
            for (int i = 0; i < cb / 64; i++) _mm_prefetch((const char*)(blk + PK_PREFETCH + 64 * i), _MM_HINT_T0);
            if (((e * tb) & 63) < tb) {  /* the block whose entries start a new line */
                _mm_prefetch((const char*)S + e * tb + PK_PREFETCH / 8, _MM_HINT_T0);
                if (OFF) _mm_prefetch((const char*)C + e * tb + PK_PREFETCH / 8, _MM_HINT_T0);
            }
            __m512i w[8];
            if (Q8) {
                #pragma GCC unroll 8
                for (int i = 0; i < 8; i++) w[i] = _mm512_loadu_si512(blk + 64 * i);
            } else {  /* w[2i]: inputs 4i..4i+3; w[2i+1]: 16+4i..16+4i+3 */
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m512i raw = _mm512_loadu_si512(blk + 64 * i);
                    w[2 * i] = _mm512_and_si512(raw, low4);
                    w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                }
            }
            /* Q6_K (FMT 3): a scale each 16 values, no offsets; else one a block */
            const __m512 s0 = mw_packed_table(S, p + u, FMT == 3 ? 2 * b : b, FMT == 3 ? 2 * nb : nb, FMT);
            const __m512 s1 = FMT == 3 ? mw_packed_table(S, p + u, 2 * b + 1, 2 * nb, 3) : s0;
            const __m512 cv = OFF ? mw_packed_table(C, p + u, b, nb, FMT) : _mm512_setzero_ps();
            #pragma GCC unroll 8
            for (int t = 0; t < TM; t++) {
                __m512i d0, d1;
                pk_dot(Q8, w, (const int32_t*)(hi + t * K + 32 * b), (const int32_t*)(lo + t * K + 32 * b), &d0, &d1);
                const __m512 dv = _mm512_set1_ps(dq[t * nb + b]);
                const int32_t* ab = asum + (t * nb + b) * 2;  /* the block's halves' sums */
                if (FMT == 3) {  /* the codes were read + 128: each half's own correction */
                    d0 = _mm512_sub_epi32(d0, _mm512_set1_epi32(ab[0] * 128));
                    d1 = _mm512_sub_epi32(d1, _mm512_set1_epi32(ab[1] * 128));
                    f[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, dv), f[u][t]);
                    f[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, dv), f[u][t]);
                    continue;
                }
                __m512i dot = _mm512_add_epi32(d0, d1);
                if (Q8)  /* the codes were read + 128 */
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32((ab[0] + ab[1]) * 128));
                f[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s0, dv), f[u][t]);
                if (OFF) f[u][t] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xs[t * nb + b]), f[u][t]);
            }
        }
    }
    for (int u = 0; u < NP; u++)
        #pragma GCC unroll 8
        for (int t = 0; t < TM; t++) _mm512_storeu_ps(y + t * ldy + 16 * u, f[u][t]);
}

/* The fp32 reference on the same layout: TM tokens of x (row stride K) against one panel. */
static inline __attribute__((always_inline)) void pk_tile_f32(
        const int TM, const int Q8, const int FMT, const int OFF, const uint8_t* codes,
        const void* S, const void* C, int64_t p, int64_t K, const float* x, float* y,
        int64_t ldy) {
    const int64_t nb = K / 32, cb = Q8 ? 512 : 256;
    const __m512i low4 = _mm512_set1_epi32(15), bias = _mm512_set1_epi32((int)0x80808080u);
    __m512 f[PK_TM];
    #pragma GCC unroll 8
    for (int t = 0; t < TM; t++) f[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t e = p * nb + b;
        const uint8_t* blk = codes + e * cb;
        const __m512 s0 = FMT == 3 ? mw_packed_table(S, p, 2 * b, 2 * nb, 3) : mw_packed_table(S, p, b, nb, FMT);
        const __m512 s1 = FMT == 3 ? mw_packed_table(S, p, 2 * b + 1, 2 * nb, 3) : s0;
        const __m512 cv = OFF ? mw_packed_table(C, p, b, nb, FMT) : _mm512_setzero_ps();
        for (int i = 0; i < (Q8 ? 8 : 4); i++) {
            const __m512 sv = i < 4 ? s0 : s1;  /* Q6_K: vectors 4..7 are inputs 16..31 */
            __m512i raw = _mm512_loadu_si512(blk + 64 * i);
            if (Q8) raw = _mm512_xor_si512(raw, bias);  /* back to signed bytes */
            for (int half_ = 0; half_ < (Q8 ? 1 : 2); half_++)
                for (int j = 0; j < 4; j++) {
                    __m512i q;
                    int k;
                    if (Q8) {
                        q = _mm512_srai_epi32(_mm512_slli_epi32(raw, 24 - 8 * j), 24);
                        k = 4 * i + j;
                    } else {
                        q = _mm512_and_si512(_mm512_srli_epi32(raw, 8 * j + 4 * half_), low4);
                        k = 16 * half_ + 4 * i + j;
                    }
                    __m512 w = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(q));
                    if (OFF) w = _mm512_add_ps(w, cv);
                    #pragma GCC unroll 8
                    for (int t = 0; t < TM; t++)
                        f[t] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[t * K + b * 32 + k]), f[t]);
                }
        }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TM; t++) _mm512_storeu_ps(y + t * ldy, f[t]);
}

/* one format's work for the panels of this thread, the format's flags compile-time: one token
 * takes PK_NP panels a pass; more tokens PK_TM at a time against each panel.
 *
 * One token: each thread takes an equal run of panels (its share of the weight stream), PK_NP
 * a pass, then two, then one. Handing out PK_NP-panel items instead left a decoder's small
 * projections uneven (SmolLM2's o and down projections, 36 panels: 9 items, 5 against 4), and
 * the thread with less waited at the barrier; a panel's outputs are the same bits whichever
 * pass takes it. */
#define PK_FORMAT(Q8, FMT, OFF)                                                            \
    if (M == 1 && !exact) {                                                                 \
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();              \
        const int64_t p_end = panels * (tid + 1) / nt;                                      \
        int64_t p = panels * tid / nt;                                                      \
        for (; p + PK_NP <= p_end; p += PK_NP)                                              \
            pk_tile(PK_NP, 1, Q8, FMT, OFF, codes, s, c, p, K, a.hi, a.lo, a.dq, a.asum,   \
                    a.xs, y + p * 16, ldy);                                                 \
        for (; p + 2 <= p_end; p += 2)                                                      \
            pk_tile(2, 1, Q8, FMT, OFF, codes, s, c, p, K, a.hi, a.lo, a.dq, a.asum, a.xs, \
                    y + p * 16, ldy);                                                       \
        for (; p < p_end; p++)                                                              \
            pk_tile(1, 1, Q8, FMT, OFF, codes, s, c, p, K, a.hi, a.lo, a.dq, a.asum, a.xs, \
                    y + p * 16, ldy);                                                       \
    } else {                                                                                \
        _Pragma("omp for schedule(static)")                                                 \
        for (int64_t p = 0; p < panels; p++)                                                \
            for (int64_t m0 = 0; m0 < M; m0 += PK_TM) {                                     \
                const int64_t tm = M - m0 < PK_TM ? M - m0 : PK_TM, o = m0 * nb;            \
                float* yt = y + m0 * ldy + p * 16;                                          \
                if (exact) {                                                                \
                    const float* xt = x + m0 * K;                                           \
                    switch (tm) { MW_TM_CASES(PK_F32, Q8, FMT, OFF) }                      \
                } else {                                                                    \
                    switch (tm) { MW_TM_CASES(PK_I8, Q8, FMT, OFF) }                       \
                }                                                                           \
            }                                                                               \
    }
#define PK_F32(tm, Q8, FMT, OFF) pk_tile_f32(tm, Q8, FMT, OFF, codes, s, c, p, K, xt, yt, ldy)
#define PK_I8(tm, Q8, FMT, OFF) pk_tile(1, tm, Q8, FMT, OFF, codes, s, c, p, K, a.hi + m0 * K, \
                                         a.lo + m0 * K, a.dq + o, a.asum + 2 * o, a.xs + o, yt, ldy)

int mw_packed_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, int flags, float* y, int64_t N, int64_t ldy) {
    if (M <= 0 || N <= 0) return 1;
    if (K <= 0 || K % 32 || N % 16 || (flags & (MW_PK_TWO_LEVEL | MW_PK_G16) && K % 256)) return 0;
    if (flags & MW_PK_G16 && (!(flags & MW_PK_Q8) || flags & MW_PK_OFFSETS)) return 0;
    if (M > MW_MAX_ROWS && mw_packed_gemm_p16(x, M, K, codes, s, c, flags, y, N, ldy)) return 1;
    const int64_t nb = K / 32, panels = N / 16;
    pk_acts a = {0};
    /* no memory for the digits: the fp32 path, which needs none (so this never fails) */
    const int exact = !mw_int_acts || !quantize_pk(x, M, K, &a);
    #pragma omp parallel
    switch ((flags & MW_PK_Q8) * 8 + mw_packed_fmt(flags) * 2 + !!(flags & MW_PK_OFFSETS)) {
        case 0: PK_FORMAT(0, 0, 0) break;
        case 1: PK_FORMAT(0, 0, 1) break;
        case 2: PK_FORMAT(0, 1, 0) break;
        case 3: PK_FORMAT(0, 1, 1) break;
        case 4: PK_FORMAT(0, 2, 0) break;
        case 5: PK_FORMAT(0, 2, 1) break;
        case 8: PK_FORMAT(1, 0, 0) break;
        case 9: PK_FORMAT(1, 0, 1) break;
        case 10: PK_FORMAT(1, 1, 0) break;
        case 11: PK_FORMAT(1, 1, 1) break;
        case 12: PK_FORMAT(1, 2, 0) break;
        case 14: PK_FORMAT(1, 3, 0) break;
        default: PK_FORMAT(1, 2, 1) break;
    }
    if (!exact) free_pk_acts(&a);
    return 1;
}

#else

int mw_packed_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, int flags, float* y, int64_t N, int64_t ldy) {
    (void)x; (void)M; (void)K; (void)codes; (void)s; (void)c; (void)flags; (void)y; (void)N;
    (void)ldy;
    return 0;
}

#endif
