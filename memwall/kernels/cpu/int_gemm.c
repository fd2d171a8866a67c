/* memwall's q4/q8 matmuls with integer activations, for any number of tokens (see kernels.h
 * for the other files).
 *
 * Why: the fp32 kernels (quant_gemm.c) rebuild every weight as s * q + c in float and spend
 * one FMA per weight and token. Here the weight codes stay integers: a 32-value block of codes
 * meets a token's 32 quantized activations in two integer multiply-adds (vpmaddwd with AVX2,
 * vpdpwssd with AVX-512 VNNI), and float work is left only once per block and token.
 *
 * Activations as int16, a scale per 32 values: x ~= u * a with u = max|x| / 32767 and
 * a = round(x / u). One int8 code per activation (llama.cpp's Q8 activations) is too coarse for
 * small models: SmolLM2's greedy tokens leave the float path's after a few tokens. int16 keeps
 * a relative error of ~2e-5 (fp16-like). Two int8 digits a value (int8_dot.c's encoding: vpmaddubsw
 * on AVX2) give the same precision but took 8 vector ops per block and token where int16 takes
 * 6: on a Zen 3 EPYC (AVX2) 16 tokens ran 1.5x faster as int16. The offset term of a q4_1 weight,
 * c * sum(x), uses the exact float sums.
 *
 *   y[m, n] = sum_b s[n, g(b)] * u[m, b] * dot(q[n, b], a[m, b]) + sum_g c[n, g] * xsum[m, g]
 *
 * Layout of the quantized activations (qacts): tokens in tiles of TILE_M; inside a tile, block b
 * of token m holds its 32 int16 values at ((b * tm + m) * 32), so the row kernels reach every
 * token of a tile through one pointer and constant offsets.
 *
 * Returns 0 (and the caller runs the fp32 kernel) where a shape does not fit: K not a multiple
 * of 32, or a q8 group that is neither 16 nor a multiple of 32.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE_M MW_TILE  /* tokens a row kernel holds accumulators for (16 ymm registers in AVX2) */
#define QBLOCK 32    /* activation values per quantization block */

#if defined(__AVX2__) && defined(__FMA__)
#define MW_INT_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MW_INT_VNNI 1
#endif
#endif

/* integer activations for every q4/q8 matmul (here and int8_dot.c's one-token kernels), or
 * the exact fp32 kernels of quant_gemm.c (the quality benchmark's reference) */
int mw_int_acts = 1;
void mw_set_int_acts(int on) { mw_int_acts = on; }
int mw_int_acts_on(void) { return mw_int_acts; }

/* which code path this build runs: 3 VNNI, 2 AVX2, 1 plain C */
int mw_int_gemm_isa(void) {
#if defined(MW_INT_VNNI)
    return 3;
#elif defined(MW_INT_AVX2)
    return 2;
#else
    return 1;
#endif
}

typedef struct {
    int64_t M, K, G;   /* tokens, inputs, weight group (for xsum) */
    int16_t* acts;     /* tiles: [M / TILE_M rounded up][K / 32][tm][32] */
    float* u;          /* [M][K / 32]: each block's scale */
    float* xsum_t;     /* tiles: [M / TILE_M rounded up][K / G][TILE_M]: exact sums of x over
                          each weight group, a tile's tokens side by side (zeros past M) */
    float* xsum_m;     /* the same sums token by token: [M][K / G] */
    int pairs;         /* blocks two at a time: PAIRS_Q4 (rows_tile_q4, the nibble order below) or
                          PAIRS_Q8 (rows_tile_q8, the byte order below); 0: one block at a time */
    float* upair;      /* pairs only: [M][K / 64][8], u of blocks 2p and 2p + 1, four times each */
} qacts;

/* The pair layout. A q4 block holds value j in the low nibble of byte j and value j + 16 in the
 * high nibble. 32 bytes are two blocks (one per 128-bit lane), and as int16 lanes each holds
 * four nibbles: values 2e, 2e + 16, 2e + 1, 2e + 17 of its block (e = 0..7). Masks and shifts
 * inside the 16-bit lanes take them apart with no lane-crossing widening, if the activations
 * wait in the same order: pair p of a token is four vectors of 16 int16, vector t holding in
 * lane L (block 2p + L), element e, the activation of value 2e (t=0), 2e+16 (1), 2e+1 (2),
 * 2e+17 (3). 9 vector ops a block and token instead of 11 for one token (1.4-1.6x, AMD EPYC
 * Zen 3, in cache and from DRAM); the integer dot products are the same. */
static inline int pair_source(int t, int e) { return 2 * e + (t & 1) * 16 + (t >> 1); }

/* The q8 pair layout: vector t (0..3) of pair p holds values 8t .. 8t + 7 of block 2p in its low
 * 128-bit lane and the same values of block 2p + 1 in its high lane, the order in which
 * rows_tile_q8 widens two blocks of int8 codes (one 64-bit unpack and one widening a vector).
 * Then one int32 vector of dot products covers two blocks, and the float work (convert, scale,
 * FMA) is paid once a pair and token instead of once a block: 10 vector ops a pair and token
 * where one block at a time took 16. */
static inline int pair_source_q8(int t, int e) { return 8 * t + e; }

enum { PAIRS_Q4 = 1, PAIRS_Q8 = 2 };


/* x [M, K] float -> qacts. Returns 0 when out of memory. */
static int quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, int pairs, qacts* a) {
    const int64_t nb = K / QBLOCK, ng = K / G;
    a->M = M; a->K = K; a->G = G; a->pairs = pairs;
    a->acts = (int16_t*)aligned_alloc(64, (size_t)((M * K * 2 + 63) / 64 * 64));
    a->u = (float*)malloc(sizeof(float) * (size_t)(M * nb));
    const int64_t tiles = (M + TILE_M - 1) / TILE_M;
    a->xsum_t = (float*)calloc((size_t)(tiles * ng * TILE_M), sizeof(float));
    a->xsum_m = (float*)malloc(sizeof(float) * (size_t)(M * ng));
    a->upair = pairs ? (float*)aligned_alloc(32, sizeof(float) * (size_t)(M * nb * 4)) : NULL;
    if (!a->acts || !a->u || !a->xsum_t || !a->xsum_m || (pairs && !a->upair)) {
        free(a->acts); free(a->u); free(a->xsum_t); free(a->xsum_m); free(a->upair);
        return 0;
    }
    #pragma omp parallel for schedule(static) if (M * K >= 32768)
    for (int64_t m = 0; m < M; m++) {
        const int64_t m0 = m / TILE_M * TILE_M, tm = mw_tile_rows(M, m0);
        int16_t* tile = a->acts + m0 * K;
        const float* xm = x + m * K;
        for (int64_t g = 0; g < ng; g++) {
            float sum = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) sum += xm[k];
            a->xsum_t[m0 * ng + g * TILE_M + (m - m0)] = sum;
            a->xsum_m[m * ng + g] = sum;
        }
        for (int64_t b = 0; b < nb; b++) {
            const float* xb = xm + b * QBLOCK;
            float amax = 0.f;
            for (int j = 0; j < QBLOCK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            const float id = amax > 0.f ? 32767.f / amax : 0.f;
            a->u[m * nb + b] = amax / 32767.f;
            if (pairs) {  /* pair p = b / 2, lane b % 2 (see pair_source) */
                int16_t* q = tile + ((b / 2) * tm + (m - m0)) * 2 * QBLOCK + (b % 2) * 8;
                for (int t = 0; t < 4; t++)
                    for (int e = 0; e < 8; e++)
                        q[t * 16 + e] = (int16_t)nearbyintf(
                            xb[pairs == PAIRS_Q4 ? pair_source(t, e) : pair_source_q8(t, e)] * id);
                float* up = a->upair + (m * (nb / 2) + b / 2) * 8 + (b % 2) * 4;
                for (int i = 0; i < 4; i++) up[i] = amax / 32767.f;
            } else {
                int16_t* q = tile + (b * tm + (m - m0)) * QBLOCK;
                for (int j = 0; j < QBLOCK; j++) q[j] = (int16_t)nearbyintf(xb[j] * id);
            }
        }
    }
    return 1;
}

static void free_acts(qacts* a) {
    free(a->acts); free(a->u); free(a->xsum_t); free(a->xsum_m); free(a->upair);
}

#if defined(MW_INT_AVX2)
/* int32 pair sums w0 . a0 + w1 . a1 (16 int16 each) */
static inline __m256i dot16(__m256i w0, __m256i a0, __m256i w1, __m256i a1) {
#if defined(MW_INT_VNNI)
    return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), w0, a0), w1, a1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w0, a0), _mm256_madd_epi16(w1, a1));
#endif
}

static inline __attribute__((always_inline)) void store_sums(
        const int R, const int TM, const __m256* acc, const float* cr, const float* xsum_t,
        const float* xsum_m, int64_t ng, float* y, int64_t N);

/* R weight rows (n .. n + R - 1: codes qr + r * row_bytes, scales sr / cr + r * ng) against
 * the TM tokens of a tile; R * TM <= 8 accumulators, all compile-time constants so they stay
 * in registers. Several rows for few tokens: one token alone would leave a single FMA chain
 * (4 cycles a block of latency) and pay a row's reductions for little work. is_q4: codes are
 * q4 nibbles (16 bytes a block), else q8 (32 signed bytes a block, group G; G = 16 gives each
 * half-block its own scale). Writes y[m * N + r]. */
static inline __attribute__((always_inline)) void rows_tile(
        const int R, const int TM, const int is_q4, const uint8_t* qr, int64_t row_bytes,
        const float* sr, const float* cr, int64_t G, const int16_t* tile, const float* u,
        const float* xsum_t, const float* xsum_m, int64_t nb, int64_t ng, float* y, int64_t N) {
    __m256 acc[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(15);
    const int split = !is_q4 && G == 16;
    for (int64_t b = 0; b < nb; b++) {
        const int16_t* xb = tile + b * TM * QBLOCK;
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t* q = qr + r * row_bytes;
            const float* s = sr + r * ng;
            if (TM <= 2 && (b & (is_q4 ? 3 : 1)) == 0)  /* few tokens: the rows stream from DRAM:
                ask for the same line of the next row group (rows are short, 4-9 lines) */
                _mm_prefetch((const char*)(q + R * row_bytes + (is_q4 ? 16 : 32) * b), _MM_HINT_T0);
            __m256i w0, w1;  /* values 0..15 and 16..31 of the block, as int16 */
            if (is_q4) {
                const __m128i raw = _mm_loadu_si128((const __m128i*)(q + b * 16));
                w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
                w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
            } else {
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32)));
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32 + 16)));
            }
            const __m256 vs = _mm256_set1_ps(split ? s[2 * b] : is_q4 ? s[b] : s[b * QBLOCK / G]);
            #pragma GCC unroll 8
            for (int m = 0; m < TM; m++) {
                const __m256i* am = (const __m256i*)(xb + m * QBLOCK);
                const __m256 um = _mm256_set1_ps(u[m * nb + b]);
                if (split) {
                    const __m256 vs1 = _mm256_set1_ps(s[2 * b + 1]);
                    const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_load_si256(am)));
                    const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_load_si256(am + 1)));
                    acc[r * TM + m] = _mm256_fmadd_ps(d0, _mm256_mul_ps(vs, um), acc[r * TM + m]);
                    acc[r * TM + m] = _mm256_fmadd_ps(d1, _mm256_mul_ps(vs1, um), acc[r * TM + m]);
                } else {
                    const __m256i d = dot16(w0, _mm256_load_si256(am), w1, _mm256_load_si256(am + 1));
                    acc[r * TM + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(vs, um),
                                                      acc[r * TM + m]);
                }
            }
        }
    }
    store_sums(R, TM, acc, cr, xsum_t, xsum_m, ng, y, N);
}

/* R rows x TM tokens of 8-lane accumulators -> y, with the offset term c * xsum added */
static inline __attribute__((always_inline)) void store_sums(
        const int R, const int TM, const __m256* acc, const float* cr, const float* xsum_t,
        const float* xsum_m, int64_t ng, float* y, int64_t N) {
    /* all R * TM sums as one vector: a transpose-and-add tree instead of a reduction each */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    float out[8];
    if (R == 1) {  /* the offset term of all the tile's tokens at once: sum_g c[g] * xsum_t[g][:] */
        _mm256_storeu_ps(out, mw_add_offsets8(sums, cr, xsum_t, ng));  /* TILE_M = 8 */
    } else {  /* R rows x TM tokens: a dot each (independent, so they overlap) */
        _mm256_storeu_ps(out, sums);
        #pragma GCC unroll 8
        for (int i = 0; i < R * TM; i++) out[i] += dot_f32(cr + (i / TM) * ng, xsum_m + (i % TM) * ng, ng);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) y[m * N + r] = out[r * TM + m];
}

/* A q4 pair (32 bytes: blocks 2p and 2p + 1, one a lane) as four int16 vectors in the pair
 * layout's order (see pair_source): masks and shifts inside the 16-bit lanes */
static inline __attribute__((always_inline)) void unpack_q4_pair(__m256i v, __m256i* w) {
    const __m256i low4 = _mm256_set1_epi16(15);
    w[0] = _mm256_and_si256(v, low4);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
    w[3] = _mm256_srli_epi16(v, 12);
}

/* the pair's int32 dot products (block 2p in the low lane, 2p + 1 in the high) with one token's
 * activations in the pair layout */
static inline __attribute__((always_inline)) __m256i pair_dot(const __m256i* w, const int16_t* xp) {
    const __m256i* am = (const __m256i*)xp;
    return _mm256_add_epi32(dot16(w[0], _mm256_load_si256(am), w[1], _mm256_load_si256(am + 1)),
                            dot16(w[2], _mm256_load_si256(am + 2), w[3], _mm256_load_si256(am + 3)));
}

/* rows_tile for q4 weights in the pair layout (see pair_source): blocks 2p and 2p + 1 of a row
 * in one 256-bit load, their int32 dot products in the two 128-bit lanes of one vector, scaled
 * by [s u of block 2p, four times | s u of block 2p + 1, four times]. upair: this tile's first
 * token's per-pair scales ([tm][nb / 2][8]). */
static inline __attribute__((always_inline)) void rows_tile_q4(
        const int R, const int TM, const uint8_t* qr, int64_t row_bytes, const float* sr,
        const float* cr, const int16_t* tile, const float* upair, const float* xsum_t,
        const float* xsum_m, int64_t nb, int64_t ng, float* y, int64_t N) {
    __m256 acc[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) {
        const int16_t* xp = tile + p * TM * 2 * QBLOCK;
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t* q = qr + r * row_bytes;
            if (TM <= 2 && (p & 1) == 0)  /* few tokens: the rows stream from DRAM, and are short
                (4-9 lines): ask for the same line of the next row group */
                _mm_prefetch((const char*)(q + R * row_bytes + 32 * p), _MM_HINT_T0);
            __m256i w[4];
            unpack_q4_pair(_mm256_loadu_si256((const __m256i*)(q + 32 * p)), w);
            const float* s = sr + r * ng + 2 * p;
            const __m256 sv = _mm256_set_m128(_mm_broadcast_ss(s + 1), _mm_broadcast_ss(s));
            #pragma GCC unroll 8
            for (int m = 0; m < TM; m++) {
                const __m256i d = pair_dot(w, xp + m * 2 * QBLOCK);
                const __m256 um = _mm256_load_ps(upair + (m * np + p) * 8);
                acc[r * TM + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, um),
                                                  acc[r * TM + m]);
            }
        }
    }
    store_sums(R, TM, acc, cr, xsum_t, xsum_m, ng, y, N);
}

/* Up to a tile of tokens (decode, a speculative verify): the rows come from DRAM and the kernel
 * is bound by how many lines are in flight, not by arithmetic. Row by row from start to end is
 * one sequential stream per thread (R rows in lockstep are R short streams the hardware
 * prefetcher follows poorly), asked for SEQ_PREFETCH bytes ahead. AMD EPYC Zen 3, 2 threads,
 * q4 8960 x 1536 from DRAM: 13.6 GB/s of codes against 9.6 GB/s for 4 rows in lockstep (a
 * plain streaming read: 14.5). */
#define SEQ_PREFETCH 1024
#ifndef MW_SEQ_TM
#define MW_SEQ_TM 8  /* tokens up to which rows go one at a time (one tile) */
#endif

/* Eight consecutive scale-table entries of a row as floats, from a table in format fmt (0 float32,
 * 1 fp16, E = 8 or 16 two-level: a float d, then E int8 sub-scales a superblock, see kernels.h).
 * unit: the index of the 8-entry run. The two-level entries are d * sub, as
 * mw_two_level_to_floats widens them, so every format gives the float32 table's results. */
static inline __attribute__((always_inline)) __m256 table8(const int fmt, const void* row, int64_t unit) {
    if (fmt == 0) return _mm256_loadu_ps((const float*)row + unit * 8);
    if (fmt == 1) {
#if defined(__F16C__)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + unit * 8)));
#else
        float f[8];
        mw_halves_to_floats((const uint16_t*)row + unit * 8, f, 8);
        return _mm256_loadu_ps(f);
#endif
    }
    const uint8_t* sb = (const uint8_t*)row + unit * 8 / fmt * (4 + fmt);  /* its superblock */
    float d;
    int64_t sub;
    memcpy(&d, sb, sizeof d);
    memcpy(&sub, sb + 4 + unit * 8 % fmt, sizeof sub);  /* the run's 8 sub-scales */
    return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(sub))));
}

/* one scale-table entry of a row as a float (the groups past the last run of 8; fmt 0 or 1) */
static inline __attribute__((always_inline)) float table1(const int fmt, const void* row, int64_t i) {
    return fmt == 0 ? ((const float*)row)[i] : mw_half_to_float(((const uint16_t*)row)[i]);
}

/* the offset term of a run of 8 groups for the TM tokens: off[m] += c[run] * xsum_m[m][run]
 * (xsum_m rows `stride` apart); ct NULL: the offsets are all zero (MW_NO_OFFSETS, kernels.h) */
static inline __attribute__((always_inline)) void offsets_run(
        const int TM, const int fmt, const void* ct, int64_t unit, const float* xsum_m,
        int64_t stride, __m256* off) {
    if (!ct) return;
    const __m256 c8 = table8(fmt, ct, unit);
    #pragma GCC unroll 8
    for (int m = 0; m < TM; m++)
        off[m] = _mm256_fmadd_ps(c8, _mm256_loadu_ps(xsum_m + m * stride + unit * 8), off[m]);
}

/* y[m * N] for the TM tokens of a row_seq_*_tables kernel: its accumulators, offset vectors and
 * scalar tails. One accumulator a token, for every batch size, so a token's result does not
 * depend on what it was batched with (pipeline stages and the speculative verify batch
 * differently from a plain decode); 4 chains for one token measured no faster from DRAM. */
static inline __attribute__((always_inline)) void store_row_sums(
        const int TM, const __m256* acc, const __m256* off, const float* tail, float* y, int64_t N) {
    #pragma GCC unroll 8
    for (int m = 0; m < TM; m++) {
        y[m * N] = mw_hsum256(_mm256_add_ps(off[m], acc[m])) + tail[m];
    }
}

/* One q4 row (pair layout) against the tile's tokens, start to end, reading the row's scale and
 * offset tables in place, 8 groups (4 pairs) at a time, instead of widening them into float
 * copies first (that pass cost 15% of a decode step on Q4_K): a pair's [s of block 2p x4 |
 * s of block 2p + 1 x4] is one permute of the run's 8, and the offset term c * xsum one FMA
 * a run. st, ct: this row's tables (fmt as table8);
 * acts, upair, xsum_m: the only tile (M <= TILE_M tokens); writes y[m * N], m < TM. */
static inline __attribute__((always_inline)) void row_seq_q4_tables(
        const int TM, const int fmt, const uint8_t* q, const void* st, const void* ct,
        const int16_t* acts, const float* upair, const float* xsum_m, int64_t nb, float* y,
        int64_t N) {
    __m256 acc[8], off[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = off[i] = _mm256_setzero_ps();
    const int64_t np = nb / 2, units = nb / 8;
    for (int64_t unit = 0; unit < units; unit++) {
        _mm_prefetch((const char*)(q + SEQ_PREFETCH + 128 * unit), _MM_HINT_T0);
        _mm_prefetch((const char*)(q + SEQ_PREFETCH + 128 * unit + 64), _MM_HINT_T0);
        const __m256 s8 = table8(fmt, st, unit);
        offsets_run(TM, fmt, ct, unit, xsum_m, nb, off);
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const int64_t p = unit * 4 + j;
            __m256i w[4];
            unpack_q4_pair(_mm256_loadu_si256((const __m256i*)(q + 32 * p)), w);
            const __m256 sv = _mm256_permutevar8x32_ps(
                s8, _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1));
            #pragma GCC unroll 8
            for (int m = 0; m < TM; m++) {
                const __m256i d = pair_dot(w, acts + (p * TM + m) * 2 * QBLOCK);
                const __m256 um = _mm256_load_ps(upair + (m * np + p) * 8);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, um), acc[m]);
            }
        }
    }
    float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  /* offset terms of the groups past the last run of 8 */
    for (int64_t p = units * 4; p < np; p++) {
        __m256i w[4];
        unpack_q4_pair(_mm256_loadu_si256((const __m256i*)(q + 32 * p)), w);
        const float s0 = table1(fmt, st, 2 * p), s1 = table1(fmt, st, 2 * p + 1);
        const float c0 = ct ? table1(fmt, ct, 2 * p) : 0.f, c1 = ct ? table1(fmt, ct, 2 * p + 1) : 0.f;
        const __m256 sv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) {
            const __m256i d = pair_dot(w, acts + (p * TM + m) * 2 * QBLOCK);
            const __m256 um = _mm256_load_ps(upair + (m * np + p) * 8);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, um), acc[m]);
            tail[m] += c0 * xsum_m[m * nb + 2 * p] + c1 * xsum_m[m * nb + 2 * p + 1];
        }
    }
    store_row_sums(TM, acc, off, tail, y, N);
}

/* row_seq_q4_tables for q8 codes in the natural order (32 signed bytes a block, a group of G = 32 values, or
 * G = 16: a scale per half-block, then two FMAs a block; other groups take rows_tile). A run of 8 table entries covers 8
 * blocks (G = 32) or 4 (G = 16); a block's scale is a permute of the run's 8. u: the tile's
 * block scales [TM][nb]; xsum_m: [TM][ng]. */
static inline __attribute__((always_inline)) void row_seq_q8_tables(
        const int TM, const int fmt, const int split, const uint8_t* q, const void* st,
        const void* ct, const int16_t* acts, const float* u, const float* xsum_m, int64_t nb,
        int64_t ng, float* y, int64_t N) {
    const int per_run = split ? 4 : 8;  /* blocks a run of 8 table entries covers */
    __m256 acc[8], off[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = off[i] = _mm256_setzero_ps();
    const int64_t units = ng / 8;
    for (int64_t unit = 0; unit < units; unit++) {
        #pragma GCC unroll 4
        for (int l = 0; l < per_run / 2; l++)  /* per_run * 32 bytes of codes, a line at a time */
            _mm_prefetch((const char*)(q + SEQ_PREFETCH + 32 * per_run * unit + 64 * l), _MM_HINT_T0);
        const __m256 s8 = table8(fmt, st, unit);
        offsets_run(TM, fmt, ct, unit, xsum_m, ng, off);
        #pragma GCC unroll 8
        for (int j = 0; j < per_run; j++) {
            const int64_t b = unit * per_run + j;
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32 + 16)));
            #pragma GCC unroll 8
            for (int m = 0; m < TM; m++) {
                const __m256i* am = (const __m256i*)(acts + (b * TM + m) * QBLOCK);
                const __m256 um = _mm256_set1_ps(u[m * nb + b]);
                if (split) {
                    const __m256 s0 = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(2 * j));
                    const __m256 s1 = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(2 * j + 1));
                    const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_load_si256(am)));
                    const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_load_si256(am + 1)));
                    acc[m] = _mm256_fmadd_ps(d0, _mm256_mul_ps(s0, um), acc[m]);
                    acc[m] = _mm256_fmadd_ps(d1, _mm256_mul_ps(s1, um), acc[m]);
                } else {
                    const __m256 sv = _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(j));
                    const __m256i d = dot16(w0, _mm256_load_si256(am), w1, _mm256_load_si256(am + 1));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, um), acc[m]);
                }
            }
        }
    }
    float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  /* offset terms of the groups past the last run of 8 */
    for (int64_t b = units * per_run; b < nb; b++) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32 + 16)));
        const int64_t g = split ? 2 * b : b;
        const float s0 = table1(fmt, st, g), s1 = split ? table1(fmt, st, g + 1) : s0;
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) {
            const __m256i* am = (const __m256i*)(acts + (b * TM + m) * QBLOCK);
            const __m256 um = _mm256_set1_ps(u[m * nb + b]);
            if (split) {
                const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, _mm256_load_si256(am)));
                const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, _mm256_load_si256(am + 1)));
                acc[m] = _mm256_fmadd_ps(d0, _mm256_mul_ps(_mm256_set1_ps(s0), um), acc[m]);
                acc[m] = _mm256_fmadd_ps(d1, _mm256_mul_ps(_mm256_set1_ps(s1), um), acc[m]);
                if (ct) tail[m] += table1(fmt, ct, g) * xsum_m[m * ng + g] + table1(fmt, ct, g + 1) * xsum_m[m * ng + g + 1];
            } else {
                const __m256i d = dot16(w0, _mm256_load_si256(am), w1, _mm256_load_si256(am + 1));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(_mm256_set1_ps(s0), um), acc[m]);
                if (ct) tail[m] += table1(fmt, ct, g) * xsum_m[m * ng + g];
            }
        }
    }
    store_row_sums(TM, acc, off, tail, y, N);
}

/* rows_tile_q4 for q8 codes in the q8 pair layout (pair_source_q8), one row against the TM tokens
 * of a tile (prefill): blocks 2p and 2p + 1 widened into four vectors [2p: 8t..8t+7 | 2p + 1:
 * 8t..8t+7], their dot products in the two lanes of one vector. G = 32: one scale a block, one
 * float FMA a pair; G = 16: values 0-15 and 16-31 of a block have their own scales, two. */
static inline __attribute__((always_inline)) void rows_tile_q8(
        const int TM, const int split, const uint8_t* q, const float* sr, const float* cr,
        const int16_t* tile, const float* upair, const float* xsum_t, const float* xsum_m,
        int64_t nb, int64_t ng, float* y, int64_t N) {
    __m256 acc[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    const int64_t np = nb / 2;
    for (int64_t p = 0; p < np; p++) {
        const uint8_t* qp = q + 64 * p;
        const __m128i a0 = _mm_loadu_si128((const __m128i*)qp), a1 = _mm_loadu_si128((const __m128i*)(qp + 16));
        const __m128i b0 = _mm_loadu_si128((const __m128i*)(qp + 32)), b1 = _mm_loadu_si128((const __m128i*)(qp + 48));
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(a0, b0));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi64(a0, b0));
        const __m256i w2 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(a1, b1));
        const __m256i w3 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi64(a1, b1));
        /* G = 32: [s of 2p x4 | s of 2p + 1 x4]; G = 16: the first halves' scales, then the seconds' */
        const float* s = sr + (split ? 4 * p : 2 * p);
        const __m256 s_lo = _mm256_set_m128(_mm_broadcast_ss(s + (split ? 2 : 1)), _mm_broadcast_ss(s));
        const __m256 s_hi = split ? _mm256_set_m128(_mm_broadcast_ss(s + 3), _mm_broadcast_ss(s + 1)) : s_lo;
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) {
            const __m256i* am = (const __m256i*)(tile + (p * TM + m) * 2 * QBLOCK);
            const __m256 um = _mm256_load_ps(upair + (m * np + p) * 8);
            const __m256i d_lo = dot16(w0, _mm256_load_si256(am), w1, _mm256_load_si256(am + 1));
            const __m256i d_hi = dot16(w2, _mm256_load_si256(am + 2), w3, _mm256_load_si256(am + 3));
            if (split) {
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_lo), _mm256_mul_ps(s_lo, um), acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_hi), _mm256_mul_ps(s_hi, um), acc[m]);
            } else {
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d_lo, d_hi)),
                                         _mm256_mul_ps(s_lo, um), acc[m]);
            }
        }
    }
    store_sums(1, TM, acc, cr, xsum_t, xsum_m, ng, y, N);
}

/* rows_tile_q8 for rows [n0, n1) */
static inline __attribute__((always_inline)) void rows_for_tile_q8(
        const int TM, const int split, const uint8_t* codes, int64_t row_bytes, const float* s,
        const float* c, const int16_t* tile, const float* upair, const float* xsum_t,
        const float* xsum_m, int64_t nb, int64_t ng, float* y, int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        rows_tile_q8(TM, split, codes + n * row_bytes, s + n * ng, c + n * ng, tile, upair, xsum_t,
                     xsum_m, nb, ng, y + n, N);
}

/* rows a row kernel takes at once against TM tokens: 4 for one or two tokens (8 rows for one
 * token measured no faster), 2 for three or four, else 1 (R * TM <= 8 accumulators) */
static inline __attribute__((always_inline)) int row_group(const int TM) { return TM <= 2 ? 4 : TM <= 4 ? 2 : 1; }

/* rows_for_tile for the pair layout */
static inline __attribute__((always_inline)) void rows_for_tile_q4(
        const int TM, const uint8_t* codes, int64_t row_bytes, const float* s, const float* c,
        const int16_t* tile, const float* upair, const float* xsum_t, const float* xsum_m,
        int64_t nb, int64_t ng, float* y, int64_t N, int64_t n0, int64_t n1) {
    const int R = row_group(TM);
    int64_t n = n0;
    for (; n + R <= n1; n += R)
        rows_tile_q4(R, TM, codes + n * row_bytes, row_bytes, s + n * ng, c + n * ng, tile, upair,
                     xsum_t, xsum_m, nb, ng, y + n, N);
    for (; n < n1; n++)
        rows_tile_q4(1, TM, codes + n * row_bytes, row_bytes, s + n * ng, c + n * ng, tile, upair,
                     xsum_t, xsum_m, nb, ng, y + n, N);
}

/* rows [n0, n1) against the TM tokens of a tile: groups of row_group(TM) rows, then the
 * remaining rows one at a time */
static inline __attribute__((always_inline)) void rows_for_tile(
        const int TM, const int is_q4, const uint8_t* codes, int64_t row_bytes, const float* s,
        const float* c, int64_t G, const int16_t* tile, const float* u, const float* xsum_t,
        const float* xsum_m, int64_t nb, int64_t ng, float* y, int64_t N, int64_t n0, int64_t n1) {
    const int R = row_group(TM);
    int64_t n = n0;
    for (; n + R <= n1; n += R)
        rows_tile(R, TM, is_q4, codes + n * row_bytes, row_bytes, s + n * ng, c + n * ng, G, tile,
                  u, xsum_t, xsum_m, nb, ng, y + n, N);
    for (; n < n1; n++)
        rows_tile(1, TM, is_q4, codes + n * row_bytes, row_bytes, s + n * ng, c + n * ng, G, tile,
                  u, xsum_t, xsum_m, nb, ng, y + n, N);
}

#endif

/* the weight code at position j of 32-value block b of a row */
static inline int32_t code_at(int is_q4, const uint8_t* qr, int64_t b, int j) {
    if (!is_q4) return ((const int8_t*)qr)[b * QBLOCK + j];
    return j < 16 ? qr[b * 16 + j] & 15 : qr[b * 16 + j - 16] >> 4;
}

/* rows [n0, n1) against every token, tile by tile (the rows stay in L1 between tiles) */
static void rows_all_tokens(int is_q4, const qacts* a, const uint8_t* codes, const float* s,
                            const float* c, float* y, int64_t N, int64_t n0, int64_t n1) {
    const int64_t K = a->K, G = a->G, nb = K / QBLOCK, ng = K / G;
    const int64_t row_bytes = is_q4 ? K / 2 : K;
    for (int64_t m0 = 0; m0 < a->M; m0 += TILE_M) {
        const int64_t tm = mw_tile_rows(a->M, m0);
        const int16_t* tile = a->acts + m0 * K;
        const float* u = a->u + m0 * nb;
        const float* xsum_t = a->xsum_t + m0 * ng;  /* this tile's [ng][TILE_M] */
        const float* xsum_m = a->xsum_m + m0 * ng;  /* this tile's [tm][ng] */
        float* yt = y + m0 * N;
#if defined(MW_INT_AVX2)
        const float* upair = a->pairs ? a->upair + m0 * (nb / 2) * 8 : NULL;
        if (a->pairs == PAIRS_Q4) switch (tm) { MW_TM_CASES(rows_for_tile_q4, codes, row_bytes, s, c, tile, upair, xsum_t, xsum_m, nb, ng, yt, N, n0, n1) }
        else if (a->pairs == PAIRS_Q8 && G == 16) switch (tm) { MW_TM_CASES(rows_for_tile_q8, 1, codes, row_bytes, s, c, tile, upair, xsum_t, xsum_m, nb, ng, yt, N, n0, n1) }
        else if (a->pairs == PAIRS_Q8) switch (tm) { MW_TM_CASES(rows_for_tile_q8, 0, codes, row_bytes, s, c, tile, upair, xsum_t, xsum_m, nb, ng, yt, N, n0, n1) }
        else if (is_q4) switch (tm) { MW_TM_CASES(rows_for_tile, 1, codes, row_bytes, s, c, G, tile, u, xsum_t, xsum_m, nb, ng, yt, N, n0, n1) }
        else switch (tm) { MW_TM_CASES(rows_for_tile, 0, codes, row_bytes, s, c, G, tile, u, xsum_t, xsum_m, nb, ng, yt, N, n0, n1) }
#else
        (void)xsum_t;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* qr = codes + n * row_bytes;
            const float *sr = s + n * ng, *cr = c + n * ng;
            for (int64_t m = 0; m < tm; m++) {
                float acc = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const int16_t* am = tile + (b * tm + m) * QBLOCK;
                    int32_t half[2] = {0, 0};  /* per 16 values (a q8 group of 16 has a scale each) */
                    for (int j = 0; j < QBLOCK; j++) half[j / 16] += code_at(is_q4, qr, b, j) * am[j];
                    const float ub = u[m * nb + b];
                    if (!is_q4 && G == 16)
                        acc += sr[2 * b] * ub * (float)half[0] + sr[2 * b + 1] * ub * (float)half[1];
                    else
                        acc += (is_q4 ? sr[b] : sr[b * QBLOCK / G]) * ub * (float)(half[0] + half[1]);
                }
                for (int64_t g = 0; g < ng; g++) acc += cr[g] * xsum_m[m * ng + g];
                yt[m * N + n] = acc;
            }
        }
#endif
    }
}

static int int_gemm(int is_q4, const float* x, int64_t M, int64_t K, int64_t G,
                    const void* codes, const void* s, const void* c, float* y, int64_t N,
                    int half) {
    if (M <= 0 || N <= 0) return 1;  /* nothing to compute */
    if (!mw_int_acts || K <= 0 || K % QBLOCK || G <= 0 || K % G || !(G == 16 || G % QBLOCK == 0))
        return 0;
    qacts a;
    const int64_t ng = K / G;
#if defined(MW_INT_AVX2)
    /* Up to a tile of tokens go row by row, the tables read in place (row_seq_*_tables), where
       the group is 16 or 32 and a two-level table's superblocks hold whole runs of 8 entries:
       q4 in the pair layout, q8 in the natural order. More q8 tokens take q8 pairs. */
    const int seq_rows = M <= MW_SEQ_TM && (G == 16 || G == QBLOCK) &&
                         (half < 2 || ((half == 8 || half == 16) && ng % half == 0));
    const int pairs = (K / QBLOCK) % 2 ? 0 : is_q4 ? PAIRS_Q4 : !seq_rows && (G == 16 || G == QBLOCK) ? PAIRS_Q8 : 0;
#else
    const int pairs = 0;  /* the plain C rows read the natural order */
#endif
    if (!quantize_acts(x, M, K, G, pairs, &a)) return 0;
#if defined(MW_INT_AVX2)
    const int64_t nb = K / QBLOCK;
    const int64_t table_row = half == 0 ? ng * 4 : half == 1 ? ng * 2 : ng / half * (4 + half);  /* bytes */
    if (pairs == PAIRS_Q4 && seq_rows) {
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t* q = (const uint8_t*)codes + n * (K / 2);
            const uint8_t *st = (const uint8_t*)s + n * table_row, *ct = c ? (const uint8_t*)c + n * table_row : NULL;
#define MW_ROW_SEQ(tm, fmt) row_seq_q4_tables(tm, fmt, q, st, ct, a.acts, a.upair, a.xsum_m, nb, y + n, N)
#define MW_ROW_SEQ_FMT(tm, unused) \
            if (half == 0) MW_ROW_SEQ(tm, 0); else if (half == 1) MW_ROW_SEQ(tm, 1); \
            else if (half == 8) MW_ROW_SEQ(tm, 8); else MW_ROW_SEQ(tm, 16);
            switch (M) { MW_TM_CASES(MW_ROW_SEQ_FMT, 0) }
#undef MW_ROW_SEQ_FMT
#undef MW_ROW_SEQ
        }
        free_acts(&a);
        return 1;
    }
    if (!is_q4 && seq_rows) {
        const int split = G == 16;
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t* q = (const uint8_t*)codes + n * K;
            const uint8_t *st = (const uint8_t*)s + n * table_row, *ct = c ? (const uint8_t*)c + n * table_row : NULL;
#define MW_ROW_SEQ(tm, fmt, sp) row_seq_q8_tables(tm, fmt, sp, q, st, ct, a.acts, a.u, a.xsum_m, nb, ng, y + n, N)
#define MW_ROW_SEQ_FMT(tm, sp) \
            if (half == 0) MW_ROW_SEQ(tm, 0, sp); else if (half == 1) MW_ROW_SEQ(tm, 1, sp); \
            else if (half == 8) MW_ROW_SEQ(tm, 8, sp); else MW_ROW_SEQ(tm, 16, sp);
#define MW_ROW_SEQ_SPLIT(tm, unused) if (split) { MW_ROW_SEQ_FMT(tm, 1) } else { MW_ROW_SEQ_FMT(tm, 0) }
            switch (M) { MW_TM_CASES(MW_ROW_SEQ_SPLIT, 0) }
#undef MW_ROW_SEQ_SPLIT
#undef MW_ROW_SEQ_FMT
#undef MW_ROW_SEQ
        }
        free_acts(&a);
        return 1;
    }
#endif
    /* threads take runs of 8 rows (whole row groups of rows_for_tile); fp16 scales of a run
       are widened first, and the run is then addressed from its first row */
    const int64_t chunks = (N + 7) / 8, row_bytes = is_q4 ? K / 2 : K;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t n0 = i * 8, rows = (i + 1) * 8 < N ? 8 : N - n0;
        float sbuf[8 * ng], cbuf[8 * ng];  /* ng <= K / 16 */
        rows_all_tokens(is_q4, &a, (const uint8_t*)codes + n0 * row_bytes,
                        mw_scales_f32(s, half, n0 * ng, rows * ng, sbuf),
                        mw_scales_f32(c, half, n0 * ng, rows * ng, cbuf), y + n0, N, 0, rows);
    }
    free_acts(&a);
    return 1;
}

/* y [M, N] = x [M, K] @ W^T for a q4 weight (codes [N, K/2], s, c [N, K/32]) with int16
 * activations; 0 when it cannot (switched off, K not a multiple of 32, out of memory) */
int mw_q4_gemm_i16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half) {
    return int_gemm(1, x, M, K, 32, codes, s, c, y, N, half);
}

/* the same for a q8 weight (codes [N, K], s, c [N, K/G]) */
int mw_q8_gemm_i16(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half) {
    return int_gemm(0, x, M, K, G, codes, s, c, y, N, half);
}
