/* memwall's prefill matmuls with int8 activations: K-quant weights, q8 weights with a float
 * scale a 32-value block and narrow codes (Q5_0, Q5_1), and (opt-in) q4 weights with float
 * scales (see kernels.h for the other files).
 *
 * Why: prefill is compute-bound, and int_gemm.c's int16 activations spend one vpmaddwd per 16
 * multiply-adds plus a float convert, scale and FMA per 64 values and token. GGUF's K-quants
 * (Q4_K, Q5_K, Q6_K: layout.py's two-level tables) store each 16- or 32-value group's scale as
 * an integer sub-scale times a float d per 256-value superblock. With activations as one int8
 * per value and one scale per token and superblock (llama.cpp's Q8_K), everything inside a
 * superblock stays integer:
 *
 *   p16 = vpmaddubsw(codes, acts)          32 multiply-adds, pairs summed into int16
 *   i32 += vpmaddwd(p16, sub-scales)       the group's integer sub-scale applied while reducing
 *
 * and float work is left once per superblock and token: y += d_w * d_x * float(i32). On a
 * 2-core AMD EPYC (Zen 3, AVX2) a q4 row kernel ran at 110-117 GFLOP/s on one core where the
 * int16 one ran 72-74 (K = 1536), and 100-107 against 55-56 at K = 8960.
 *
 * Precision: int8 activations round each value to 1/254 of its superblock's largest magnitude,
 * as llama.cpp's CPU backend does for every K-quant matmul. Only batches of more than
 * MW_I8T_MIN_TOKENS tokens take this path (prefill chunks, and decode rows that share a step with
 * one): decode batches and speculative verification (int_gemm.c's row-by-row kernels,
 * int8_dot.c) keep int16 / two-digit activations, whose greedy tokens track the exact path.
 * Qwen2.5-Coder-1.5B Q4_K_M's greedy tokens with int8 prefill equalled int16's at all 1,280
 * positions measured (benchmarks/quality.py --reference int16). mw_set_int8_tiles(0), or integer
 * activations off altogether, sends prefill back to int_gemm.c.
 *
 *   y[m, n] = sum_sb d_s[n, sb] * d_x[m, sb] * sum_{g in sb} sub_s[n, g] * dot(q[n, g], a[m, g])
 *           + sum_g c[n, g] * d_x[m, g] * sum_{k in g} a[m, k]
 *
 * The offset term multiplies the quantized activations too (their group sums, as llama.cpp's
 * Q8_1/Q8_K keep them), not the exact sums: then the whole dequantized weight s * q + c meets the
 * same rounded x, and the rounding error scales with the weight w (centered on 0) instead of
 * with s * q (codes 0..15, all of one sign). With exact sums SmolLM2-135M Q4_1's perplexity was
 * 1.23% above int16's. The offset table c (Q4_1, Q4_K/Q5_K's mins) is widened to float: its term
 * is one FMA per group and 8 tokens, and rows whose offsets are all zero (Q6_K) skip it.
 *
 * Layout of the quantized activations: tokens in tiles of TILE8 tokens; in a tile, pair p
 * (blocks 2p and 2p + 1, 64 values) of token m is 64 bytes at (p * tm + m) * 64: first values
 * 0..15 of block 2p then values 0..15 of block 2p + 1 (one 128-bit lane each), then values
 * 16..31 of both. A q4 pair of code blocks unpacks to the same order with one mask and one
 * shift; q8 codes take one 128-bit permute per pair and row.
 *
 * Float tables a block (Q5_0, Q5_1, and Q4_0 / Q4_1 when asked): activations take a scale a
 * 32-value block (llama.cpp's Q8_0), and four blocks share one float convert, scale and FMA
 * (row_tile_i8_blocks). Q5_0's codes (-16..15) shift into 0..31 for vpmaddubsw's unsigned side,
 * the shift coming off in the offset term; on a 2-core AMD EPYC (Zen 3, 2 threads) Q5_0-shaped
 * weights ran at 83-114 GFLOP/s against 66-100 with int16 activations and 37-80 for dequantize +
 * BLAS (128 and 512 tokens, Gemma 3 270M's and Qwen2.5-0.5B's shapes); Gemma 3 270M's 512-token
 * prefill went from 252-350 to 318-418 tokens/s. Q8_0's full-range codes (a q8 float-table
 * weight whose codes span more than 64 values) stay on int16: with the sign trick they ran at
 * int16's speed, at int8's precision.
 *
 * Returns 0 (the caller then runs int_gemm.c) where the shape does not fit: not AVX2, switched
 * off, at most MW_I8T_MIN_TOKENS tokens, two-level tables without 256-value superblocks or K not
 * a multiple of 256, float tables with groups other than 32 values or K not a multiple of 64,
 * q8 float-table codes spanning more than 64 values (Q8_0), q4 float tables in mode 1, or out of
 * memory.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define TILE8 MW_TILE  /* tokens a row kernel holds accumulators for */
#define SUPER 256      /* values per superblock: one activation scale, one weight d */
#define QUAD 128       /* values per step of the float-table kernel: two pairs, four blocks */
#define ROW_CHUNK 16   /* rows a thread takes at once: their codes stay in L2 across the tiles */

/* 0: off; 1: K-quants (the default); 2: K-quants and q4 with float scales (Q4_0 / Q4_1, per-32
 * activation scales), which SmolLM2-135M Q4_1 failed the quality bar with: 87.9% of greedy
 * positions equal to int16 prefill's (20 prompts x 64 tokens; perplexity +0.15%), where
 * Qwen2.5-Coder-1.5B Q4_K_M kept 100% (+0.006%) on the K-quants */
int mw_int8_tiles = 1;
void mw_set_int8_tiles(int mode) { mw_int8_tiles = mode; }
int mw_int8_tiles_on(void) { return mw_int8_tiles; }

/* whether a weight's shape and table format take this path for a prefill-sized batch */
int mw_int8_tiles_fit(int is_q4, int64_t K, int64_t G, int half) {
#if defined(__AVX2__) && defined(__FMA__)
    if (!mw_int8_tiles || !mw_int_acts || K <= 0) return 0;
    if (half < 2)  /* float tables a block: whole pairs; Q4_0 / Q4_1 when asked (see above) */
        return K % 64 == 0 && G == 32 && (is_q4 ? mw_int8_tiles >= 2 : 1);
    if (K % SUPER) return 0;
    if (is_q4) return G == 32 && half == 8;
    return (G == 32 && half == 8) || (G == 16 && half == 16);
#else
    (void)is_q4; (void)K; (void)G; (void)half;
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)

typedef struct {
    int8_t* acts;   /* [tiles][K / 64][tm][64] (see the layout above) */
    float* dx;      /* two-level tables: [M][K / 256], each superblock's scale max|x| / 127;
                       float tables: [M][quads][8] (a last half quad when K % 128 = 64),
                       each block's scale in the order row_tile_i8_blocks adds the four
                       blocks of a quad (0 0 2 2 1 1 3 3; absent blocks 0) */
    float* xsum_t;  /* [tiles][ng][TILE8]: sums of the quantized x over each weight group
                       (d * sum of the int8 values), a tile's tokens side by side (zeros past M) */
} i8acts;


/* 16 floats * id -> 16 int8 (round to nearest even, as cvtps does) */
static inline __m128i round16(const float* x, __m256 id) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);  /* 16 int16 in order */
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

/* the sum of 16 int8 (exact) */
static inline int32_t sum16(__m128i v) {
    const __m256i w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(v), _mm256_set1_epi16(1));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

static void free_i8acts(i8acts* a) { free(a->acts); free(a->dx); free(a->xsum_t); }

/* max |x| over n floats (n a multiple of 8) */
static inline float max_abs(const float* x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* x [M, K] -> i8acts with a scale per `unit` values (SUPER, or 32 for float tables); 0 when
 * out of memory */
static int quantize_i8(const float* x, int64_t M, int64_t K, int64_t G, int64_t unit, i8acts* a) {
    const int64_t ng = K / G, tiles = (M + TILE8 - 1) / TILE8;
    const int64_t scales = unit == SUPER ? K / SUPER : (K + QUAD - 1) / QUAD * 8;  /* a token's dx */
    a->acts = (int8_t*)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    a->dx = (float*)calloc((size_t)(M * scales), sizeof(float));
    a->xsum_t = (float*)calloc((size_t)(tiles * ng * TILE8), sizeof(float));
    if (!a->acts || !a->dx || !a->xsum_t) { free_i8acts(a); return 0; }
    #pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int64_t m0 = m / TILE8 * TILE8, tm = mw_tile_rows(M, m0);
        int8_t* tile = a->acts + m0 * K;
        const float* xm = x + m * K;
        float* xsum = a->xsum_t + m0 * ng + (m - m0);  /* group g at xsum[g * TILE8] */
        float* dx = a->dx + m * scales;
        __m256 id[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  /* blocks 2p and 2p + 1 */
        float d[2] = {0.f, 0.f};
        for (int64_t p = 0; p < K / 64; p++) {
            const float* b0 = xm + p * 64;  /* block 2p; block 2p + 1 at b0 + 32 */
            if (unit == SUPER && p % (SUPER / 64) == 0) {
                const float amax = max_abs(b0, SUPER);
                dx[p / (SUPER / 64)] = d[0] = d[1] = amax / 127.f;
                id[0] = id[1] = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            } else if (unit != SUPER) {
                for (int j = 0; j < 2; j++) {
                    const int64_t b = 2 * p + j;  /* block i = b % 4 of quad b / 4 sits at 0 0 2 2 1 1 3 3 */
                    const float amax = max_abs(b0 + 32 * j, 32);
                    const int i = (int)(b % 4), at = (i & 1) * 4 + (i >> 1) * 2;
                    dx[b / 4 * 8 + at] = dx[b / 4 * 8 + at + 1] = d[j] = amax / 127.f;
                    id[j] = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
                }
            }
            int8_t* q = tile + (p * tm + (m - m0)) * 64;
            const __m128i r[4] = {round16(b0, id[0]), round16(b0 + 32, id[1]),
                                  round16(b0 + 16, id[0]), round16(b0 + 48, id[1])};
            for (int i = 0; i < 4; i++) _mm_store_si128((__m128i*)(q + 16 * i), r[i]);
            /* the groups' sums of the quantized values (r: 2p low, 2p + 1 low, 2p high, 2p + 1 high) */
            const float h[4] = {d[0] * (float)sum16(r[0]), d[1] * (float)sum16(r[1]),
                                d[0] * (float)sum16(r[2]), d[1] * (float)sum16(r[3])};
            if (G == 16) {
                xsum[(4 * p) * TILE8] = h[0];
                xsum[(4 * p + 1) * TILE8] = h[2];
                xsum[(4 * p + 2) * TILE8] = h[1];
                xsum[(4 * p + 3) * TILE8] = h[3];
            } else {  /* G = 32 */
                xsum[(2 * p) * TILE8] = h[0] + h[2];
                xsum[(2 * p + 1) * TILE8] = h[1] + h[3];
            }
        }
    }
    return 1;
}

/* [v x8 | w x8] as int16 */
static inline __m256i two_scales(int8_t v, int8_t w) {
    return _mm256_set_m128i(_mm_set1_epi16(w), _mm_set1_epi16(v));
}

/* acc[m]'s lanes summed, plus the offset term sum_g coff[g] * xsum[m, g] (coff NULL: none),
 * written to y[m * N] for m < TM */
static inline __attribute__((always_inline)) void finish_tile(
        const int TM, const __m256* acc, const float* coff, const float* xsum_t, int64_t ng,
        float* y, int64_t N) {
    /* the sums as one vector (lane m: token m), then the offset term of all tokens at once */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    __m256 out = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    if (coff) out = mw_add_offsets8(out, coff, xsum_t, ng);  /* TILE8 = 8 */
    float sums[TILE8];
    _mm256_storeu_ps(sums, out);
    #pragma GCC unroll 8
    for (int m = 0; m < TM; m++) y[m * N] = sums[m];
}

/* One weight row against the TM tokens of a tile. is_q4: q4 codes (16 bytes a 32-value block),
 * E = 8 sub-scales a superblock (one a block); else q8 codes with E = 8 (G = 32) or E = 16
 * (G = 16: each half-block its own sub-scale). st: the row's scale table ([K / 256][4 + E]:
 * float d, E int8 sub-scales); coff: the row's offsets as floats ([ng]) or NULL when all zero.
 * Writes y[m * N] for m < TM. */
static inline __attribute__((always_inline)) void row_tile_i8(
        const int TM, const int is_q4, const int E, const uint8_t* q, const uint8_t* st,
        const float* coff, const int8_t* tile, const float* dx, int64_t nsb,
        const float* xsum_t, int64_t ng, float* y, int64_t N) {
    __m256 acc[TILE8];
    #pragma GCC unroll 8
    for (int m = 0; m < TILE8; m++) acc[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t* head = st + sb * (4 + E);
        float dw;
        memcpy(&dw, head, sizeof dw);
        const int8_t* sub = (const int8_t*)(head + 4);
        __m256i ia[TILE8];
        #pragma GCC unroll 8
        for (int m = 0; m < TILE8; m++) ia[m] = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int pp = 0; pp < SUPER / 64; pp++) {
            const int64_t p = sb * (SUPER / 64) + pp;
            const int8_t* xp = tile + p * TM * 64;
            if (is_q4) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * p));
                const __m256i w_lo = _mm256_and_si256(v, low4);
                const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                const __m256i sc = two_scales(sub[2 * pp], sub[2 * pp + 1]);
                #pragma GCC unroll 8
                for (int m = 0; m < TM; m++) {
                    const __m256i* am = (const __m256i*)(xp + m * 64);
                    /* each int16 lane at most 2 * 2 * 15 * 127: no saturation */
                    const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(w_lo, _mm256_load_si256(am)),
                                                         _mm256_maddubs_epi16(w_hi, _mm256_load_si256(am + 1)));
                    ia[m] = _mm256_add_epi32(ia[m], _mm256_madd_epi16(p16, sc));
                }
            } else {
                const __m256i v0 = _mm256_loadu_si256((const __m256i*)(q + 64 * p));
                const __m256i v1 = _mm256_loadu_si256((const __m256i*)(q + 64 * p + 32));
                const __m256i w_lo = _mm256_permute2x128_si256(v0, v1, 0x20);  /* values 0..15 of both */
                const __m256i w_hi = _mm256_permute2x128_si256(v0, v1, 0x31);  /* values 16..31 */
                /* vpmaddubsw multiplies unsigned by signed: |w| times x with w's sign
                   (|w| <= 128, |x| <= 127: a lane at most 2 * 128 * 127, no saturation) */
                const __m256i abs_lo = _mm256_abs_epi8(w_lo), abs_hi = _mm256_abs_epi8(w_hi);
                /* G = 32: block 2p's sub-scale in the low lanes, 2p + 1's in the high;
                   G = 16: w_lo covers groups 4p and 4p + 2, w_hi groups 4p + 1 and 4p + 3 */
                const __m256i sc_lo = E == 8 ? two_scales(sub[2 * pp], sub[2 * pp + 1])
                                             : two_scales(sub[4 * pp], sub[4 * pp + 2]);
                const __m256i sc_hi = E == 8 ? sc_lo : two_scales(sub[4 * pp + 1], sub[4 * pp + 3]);
                #pragma GCC unroll 8
                for (int m = 0; m < TM; m++) {
                    const __m256i* am = (const __m256i*)(xp + m * 64);
                    const __m256i p_lo = _mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(_mm256_load_si256(am), w_lo));
                    const __m256i p_hi = _mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(_mm256_load_si256(am + 1), w_hi));
                    ia[m] = _mm256_add_epi32(ia[m], _mm256_add_epi32(_mm256_madd_epi16(p_lo, sc_lo),
                                                                     _mm256_madd_epi16(p_hi, sc_hi)));
                }
            }
        }
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(dw * dx[m * nsb + sb]), acc[m]);
    }
    finish_tile(TM, acc, coff, xsum_t, ng, y, N);
}

/* How a row's codes meet the int8 activations in row_tile_i8_blocks: vpmaddubsw multiplies
 * unsigned bytes by signed ones. q4 codes are 0..15; q8 codes with float tables that span at
 * most 64 values (Q5_0's -16..15, Q5_1's 0..31; narrow_span below) are shifted by a constant
 * into 0..63 and the shift comes off in the offset term (c - shift * s, against the quantized
 * activations' group sums, so the algebra is exact). Q8_0's full range stays on int16: with the
 * sign trick (as row_tile_i8 does for Q5_K/Q6_K) it ran no faster than int16 (AMD EPYC Zen 3)
 * and cost int8's precision. */
enum { CODES_Q4 = 0, CODES_Q8_SHIFTED = 1 };

/* pair p of a row's codes in the tile's activation order, unsigned: values 0..15 of blocks 2p
 * and 2p + 1 in *lo, values 16..31 in *hi */
static inline __attribute__((always_inline)) void pair_codes(
        const int kind, const uint8_t* q, int64_t p, __m256i shift, __m256i* lo, __m256i* hi) {
    if (kind == CODES_Q4) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * p)), low4 = _mm256_set1_epi8(15);
        *lo = _mm256_and_si256(v, low4);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        return;
    }
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(q + 64 * p));
    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(q + 64 * p + 32));
    *lo = _mm256_add_epi8(_mm256_permute2x128_si256(v0, v1, 0x20), shift);
    *hi = _mm256_add_epi8(_mm256_permute2x128_si256(v0, v1, 0x31), shift);
}

/* a pair's dot products with one token (am: its 64 activation bytes), as int32, four lanes a
 * block: unsigned codes <= 63 keep every int16 sum <= 2 * 2 * 63 * 127 (no saturation) */
static inline __attribute__((always_inline)) __m256i pair_dot_i8(__m256i lo, __m256i hi, const __m256i* am) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(am)),
                                         _mm256_maddubs_epi16(hi, _mm256_load_si256(am + 1)));
    return _mm256_madd_epi16(p16, ones);
}

/* One row with float scales a block (Q4_0 / Q4_1 q4 codes; Q5_0 / Q5_1 q8 codes, kind as
 * above; sf, the row's scales widened to float; coff its offsets or NULL) against the TM tokens
 * of a tile, activations with a scale a block (dx: the tile's [tm][K / 128][8]). A quad of four
 * blocks (two pairs) is one step: each pair's products reduce to int32 (four lanes a block), one
 * vphaddd folds the two pairs into two lanes a block, and one convert, multiply and FMA scale
 * all four blocks: 12 vector ops per 128 values and token for unsigned codes (20 with int16
 * activations). */
static inline __attribute__((always_inline)) void row_tile_i8_blocks(
        const int TM, const int kind, const uint8_t* q, __m256i shift, const float* sf,
        const float* coff, const int8_t* tile, const float* dx, int64_t npairs,
        const float* xsum_t, int64_t ng, float* y, int64_t N) {
    const int64_t nq = npairs / 2, dx_row = (npairs + 1) / 2 * 8;
    __m256 acc[TILE8];
    #pragma GCC unroll 8
    for (int m = 0; m < TILE8; m++) acc[m] = _mm256_setzero_ps();
    const __m256i order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);  /* the lanes vphaddd leaves */
    for (int64_t qd = 0; qd < nq; qd++) {
        __m256i a_lo, a_hi, b_lo, b_hi;
        pair_codes(kind, q, 2 * qd, shift, &a_lo, &a_hi);
        pair_codes(kind, q, 2 * qd + 1, shift, &b_lo, &b_hi);
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sf + 4 * qd)), order);
        const int8_t* xa = tile + 2 * qd * TM * 64;
        const int8_t* xb = xa + TM * 64;
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) {
            const __m256i i32 = _mm256_hadd_epi32(pair_dot_i8(a_lo, a_hi, (const __m256i*)(xa + m * 64)),
                                                  pair_dot_i8(b_lo, b_hi, (const __m256i*)(xb + m * 64)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32),
                                     _mm256_mul_ps(sv, _mm256_loadu_ps(dx + m * dx_row + qd * 8)), acc[m]);
        }
    }
    if (npairs % 2) {  /* K % 128 = 64: a last pair, folded with zeros into the quad's lanes */
        __m256i a_lo, a_hi;
        pair_codes(kind, q, 2 * nq, shift, &a_lo, &a_hi);
        const __m256 sv = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd((const double*)(sf + 4 * nq)))), order);
        const int8_t* xa = tile + 2 * nq * TM * 64;
        #pragma GCC unroll 8
        for (int m = 0; m < TM; m++) {
            const __m256i i32 = _mm256_hadd_epi32(pair_dot_i8(a_lo, a_hi, (const __m256i*)(xa + m * 64)),
                                                  _mm256_setzero_si256());
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32),
                                     _mm256_mul_ps(sv, _mm256_loadu_ps(dx + m * dx_row + nq * 8)), acc[m]);
        }
    }
    finish_tile(TM, acc, coff, xsum_t, ng, y, N);
}

/* Whether n int8 codes span at most 64 values (then *shift moves them into 0..63); stops at the
 * first byte that widens the span past that (Q8_0's codes do within their first blocks) */
static int narrow_span(const int8_t* q, int64_t n, int* shift) {
    int lo = 127, hi = -128;
    for (int64_t i0 = 0; i0 < n; i0 += 4096) {
        const int64_t i1 = i0 + 4096 < n ? i0 + 4096 : n;
        __m256i mn = _mm256_set1_epi8(127), mx = _mm256_set1_epi8(-128);
        int64_t i = i0;
        for (; i + 32 <= i1; i += 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(q + i));
            mn = _mm256_min_epi8(mn, v);
            mx = _mm256_max_epi8(mx, v);
        }
        int8_t a[32], b[32];
        _mm256_storeu_si256((__m256i*)a, mn);
        _mm256_storeu_si256((__m256i*)b, mx);
        for (int j = 0; j < 32; j++) { lo = a[j] < lo ? a[j] : lo; hi = b[j] > hi ? b[j] : hi; }
        for (; i < i1; i++) { lo = q[i] < lo ? q[i] : lo; hi = q[i] > hi ? q[i] : hi; }
        if (hi - lo > 63) return 0;
    }
    *shift = lo < 0 ? -lo : 0;
    return 1;
}

/* whether a two-level table row's superblocks all have d == 0 (then every entry is 0) */
static int table_row_zero(const uint8_t* row, int64_t nsb, int E) {
    for (int64_t sb = 0; sb < nsb; sb++) {
        float d;
        memcpy(&d, row + sb * (4 + E), sizeof d);
        if (d != 0.f) return 0;
    }
    return 1;
}

/* whether all n floats are 0 */
static int all_zero(const float* v, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (v[i] != 0.f) return 0;
    return 1;
}

static int i8_gemm(int is_q4, const float* x, int64_t M, int64_t K, int64_t G, const void* codes,
                   const void* s, const void* c, float* y, int64_t N, int half) {
    if (M <= MW_I8T_MIN_TOKENS || N <= 0 || !mw_int8_tiles_fit(is_q4, K, G, half)) return 0;
    const int E = half, two_level = half >= 2;
    const int64_t nsb = K / SUPER, npairs = K / 64, ng = K / G, row_bytes = is_q4 ? K / 2 : K;
    const int64_t table_row = two_level ? nsb * (4 + E) : 0;       /* bytes */
    const int64_t dx_row = two_level ? nsb : (npairs + 1) / 2 * 8;  /* a token's dx entries */
    /* q8 codes with float tables: only a narrow span (Q5_0, Q5_1), shifted to unsigned; Q8_0's
       full range would take the sign trick at int16's speed (measured) with int8's error */
    int shift = 0;
    if (!is_q4 && !two_level && !narrow_span((const int8_t*)codes, N * K, &shift)) return 0;
    i8acts a;
    if (!quantize_i8(x, M, K, G, two_level ? SUPER : 32, &a)) return 0;
    const int64_t chunks = (N + ROW_CHUNK - 1) / ROW_CHUNK;
    int ok = 1;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t n0 = i * ROW_CHUNK, n1 = n0 + ROW_CHUNK < N ? n0 + ROW_CHUNK : N;
        /* the chunk's offsets (and, for float tables, scales) widened to float once */
        float* coff = (float*)malloc(sizeof(float) * (size_t)(ROW_CHUNK * ng));
        float* sf = two_level ? NULL : (float*)malloc(sizeof(float) * (size_t)(ROW_CHUNK * ng));
        if (!coff || (!two_level && !sf)) {
            free(coff); free(sf);
            #pragma omp atomic write
            ok = 0;
            continue;
        }
        int has_off[ROW_CHUNK];
        for (int64_t n = n0; n < n1; n++) {
            float* cr = coff + (n - n0) * ng;
            if (two_level) {
                const uint8_t* ct = c ? (const uint8_t*)c + n * table_row : NULL;  /* NULL: zeros */
                has_off[n - n0] = ct && !table_row_zero(ct, nsb, E);
                if (has_off[n - n0]) mw_scales_f32(ct, half, 0, ng, cr);
            } else {
                float* sr = sf + (n - n0) * ng;
                const float* sview = mw_scales_f32(s, half, n * ng, ng, sr);
                if (sview != sr) memcpy(sr, sview, sizeof(float) * (size_t)ng);
                const float* cview = mw_scales_f32(c, half, n * ng, ng, cr);
                if (cview != cr) memcpy(cr, cview, sizeof(float) * (size_t)ng);
                for (int64_t g = 0; shift && g < ng; g++) cr[g] -= (float)shift * sr[g];
                has_off[n - n0] = !all_zero(cr, ng);
            }
        }
        for (int64_t m0 = 0; m0 < M; m0 += TILE8) {
            const int64_t tm = mw_tile_rows(M, m0);
            const int8_t* tile = a.acts + m0 * K;
            const float* dx = a.dx + m0 * dx_row;
            const float* xsum_t = a.xsum_t + m0 * ng;
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t* q = (const uint8_t*)codes + n * row_bytes;
                const float* co = has_off[n - n0] ? coff + (n - n0) * ng : NULL;
                float* yt = y + m0 * N + n;
                if (two_level) {
                    const uint8_t* st = (const uint8_t*)s + n * table_row;
#define MW_ROW(tm, q4, e) row_tile_i8(tm, q4, e, q, st, co, tile, dx, nsb, xsum_t, ng, yt, N)
#define MW_ROW_KIND(tm, unused) \
                    if (is_q4) MW_ROW(tm, 1, 8); else if (E == 8) MW_ROW(tm, 0, 8); else MW_ROW(tm, 0, 16);
                    switch (tm) { MW_TM_CASES(MW_ROW_KIND, 0) }
#undef MW_ROW_KIND
#undef MW_ROW
                } else {
                    const float* sr = sf + (n - n0) * ng;
                    const __m256i sh = _mm256_set1_epi8((char)shift);
#define MW_ROW(tm, k) row_tile_i8_blocks(tm, k, q, sh, sr, co, tile, dx, npairs, xsum_t, ng, yt, N)
#define MW_ROW_KIND(tm, unused) \
                    if (is_q4) MW_ROW(tm, CODES_Q4); else MW_ROW(tm, CODES_Q8_SHIFTED);
                    switch (tm) { MW_TM_CASES(MW_ROW_KIND, 0) }
#undef MW_ROW_KIND
#undef MW_ROW
                }
            }
        }
        free(coff);
        free(sf);
    }
    free_i8acts(&a);
    return ok;
}

#else

static int i8_gemm(int is_q4, const float* x, int64_t M, int64_t K, int64_t G, const void* codes,
                   const void* s, const void* c, float* y, int64_t N, int half) {
    (void)is_q4; (void)x; (void)M; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y;
    (void)N; (void)half;
    return 0;
}

#endif

/* y [M, N] = x [M, K] @ W^T for a q4 weight with a two-level table (Q4_K) or float scales
 * (Q4_0, Q4_1), int8 activations */
int mw_q4_gemm_i8t(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half) {
    return i8_gemm(1, x, M, K, 32, codes, s, c, y, N, half);
}

/* the same for a q8 weight: G = 32 with E = 8 (Q5_K), G = 16 with E = 16 (Q6_K) */
int mw_q8_gemm_i8t(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half) {
    return i8_gemm(0, x, M, K, G, codes, s, c, y, N, half);
}
