/* memwall's paged decode attention (see kernels.h for the other files): one query token per
 * sequence attends over its KV blocks where they lie in the pool, nothing gathered or copied.
 *
 * KV cache layout per layer: [num_blocks, block_size, kv_heads, head_dim] in one element type
 * (kernels.h MW_KV_*: float32, float16, bfloat16, int8 with a float scale per token, KV head
 * and 16 values, float8 e4m3); token t of a sequence sits in block block_table[t / block_size]
 * at offset t % block_size. Quantized rows are widened to float in registers as q.k and p.v
 * read them (an int8 row's 16 codes times their scale): long decodes are bound by the bytes
 * they read, so a 1-byte cache reads about a third of fp32's.
 * mw_kv_write is the one writer of the formats (the fused decode step's new tokens); the
 * torch side (memwall/attention/kv_quant.py) rounds the same way, byte for byte.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MW_INLINE static inline __attribute__((always_inline))
/* v[i] = exp(v[i] - shift) for n floats; returns their sum (exp512 with AVX-512, else expf) */
static float exp_shift_sum(float* v, int64_t n, float shift) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), sh = _mm512_set1_ps(shift);
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(v + i), sh));
        _mm512_storeu_ps(v + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, v + i), sh));
        _mm512_mask_storeu_ps(v + i, mask, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
        i = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; i < n; i++) { v[i] = expf(v[i] - shift); sum += v[i]; }
    return sum;
}

/* the largest of n floats (NaNs ignored, as `x > mx ? x : mx` does): max is exact, so any
 * order gives the same bits; a scalar chain cost ~3 cycles a score */
static float max_f32(const float* v, int64_t n) {
    int64_t i = 0;
    float mx = -INFINITY;
#if defined(__AVX512F__)
    __m512 acc = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) acc = _mm512_max_ps(_mm512_loadu_ps(v + i), acc);
    mx = _mm512_reduce_max_ps(acc);
#elif defined(__AVX2__)
    __m256 acc = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(v + i), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
#endif
    for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    return mx;
}

/* ------------------------------------------------------------------ element formats */

static int64_t kv_elem_size(int kt) {
    return kt == MW_KV_F32 ? 4 : (kt == MW_KV_F16 || kt == MW_KV_BF16) ? 2 : 1;
}

/* an int8 row's scales: one per MW_KV_GROUP values (a last group may be shorter) */
static inline int64_t kv_groups(int64_t D) { return (D + MW_KV_GROUP - 1) / MW_KV_GROUP; }

/* the scales of cache row r (slot * Hkv + head) of an int8 cache; NULL for the other formats */
static inline const float* kv_row_scales(const float* scales, int kt, int64_t r, int64_t D) {
    return kt == MW_KV_I8 ? scales + r * kv_groups(D) : NULL;
}

/* round to nearest even, saturating at +-65504 (as kv_quant.py clamps before converting) */
static inline uint16_t float_to_half(float f) {
    const uint16_t sign = (uint16_t)((mw_float_to_bits(f) >> 16) & 0x8000);
    float a = fabsf(f);
    if (a != a) return sign | 0x7E00;
    if (a > 65504.f) a = 65504.f;
    if (a < 6.103515625e-05f) return sign | (uint16_t)nearbyintf(a * 16777216.f);  /* subnormal */
    uint32_t u = mw_float_to_bits(a);
    u += 0xFFF + ((u >> 13) & 1);
    return sign | (uint16_t)((((u >> 23) - 112) << 10) | ((u >> 13) & 0x3FF));
}

static float fp8_table[256];  /* e4m3fn byte -> float, filled when the library loads */
__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e ? ldexpf(1.f + (float)m / 8.f, e - 7) : ldexpf((float)m, -9);
        if ((b & 0x7F) == 0x7F) v = NAN;
        fp8_table[b] = (b & 0x80) ? -v : v;
    }
}

/* round to nearest even, saturating at +-448 (e4m3fn has no infinity) */
static inline uint8_t float_to_fp8(float f) {
    const uint8_t sign = (uint8_t)((mw_float_to_bits(f) >> 24) & 0x80);
    float a = fabsf(f);
    if (a != a) return sign | 0x7F;
    if (a >= 448.f) return sign | 0x7E;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f);  /* subnormal: m * 2^-9 */
    uint32_t u = mw_float_to_bits(a);
    u += 0x7FFFF + ((u >> 20) & 1);
    return sign | (uint8_t)((((u >> 23) - 120) << 3) | ((u >> 20) & 7));
}

/* element i of a cache row as float (int8: its code times its group's scale, srow the row's
 * scales; the other formats ignore srow) */
MW_INLINE float kv_get(const void* row, const float* srow, int64_t i, int kt) {
    switch (kt) {
    case MW_KV_F16: return mw_half_to_float(((const uint16_t*)row)[i]);
    case MW_KV_BF16: return mw_bf16_to_float(((const uint16_t*)row)[i]);
    case MW_KV_I8: return (float)((const int8_t*)row)[i] * srow[i / MW_KV_GROUP];
    case MW_KV_FP8: return fp8_table[((const uint8_t*)row)[i]];
    default: return ((const float*)row)[i];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 elements i..i+7 of a cache row as floats, widened in registers (i a multiple of 8, so
 * an int8 row's 8 share one scale) */
MW_INLINE __m256 kv_load8(const void* row, const float* srow, int64_t i, int kt) {
    switch (kt) {
    case MW_KV_F16: {
        const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + i));
#if defined(__F16C__)
        return _mm256_cvtph_ps(h);
#else   /* exponent rebias in the integer unit; subnormals (< 2^-14) through a multiply */
        const __m256i w = _mm256_cvtepu16_epi32(h);
        const __m256i em = _mm256_and_si256(w, _mm256_set1_epi32(0x7FFF));
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_xor_si256(w, em), 16));
        const __m256 normal = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(112 << 23)));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(5.9604644775390625e-8f));
        const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), em));
        return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), sign);
#endif
    }
    case MW_KV_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + i))), 16));
    case MW_KV_I8:
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64((const __m128i*)((const int8_t*)row + i)))),
                             _mm256_set1_ps(srow[i / MW_KV_GROUP]));
    case MW_KV_FP8: {  /* as f16 above: e4m3's exponent rebiased by 120, subnormals m * 2^-9 */
        const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)row + i)));
        const __m256i em = _mm256_and_si256(w, _mm256_set1_epi32(0x7F));
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_xor_si256(w, em), 24));
        const __m256 normal = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.f / 512.f));
        const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
        return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), sign);
    }
    default: return _mm256_loadu_ps((const float*)row + i);
    }
}

/* dots[jj][i] = the 8-lane partial sums of q_jj . row for JN query heads (q rows D apart):
 * each element of the row is widened once for all JN heads */
MW_INLINE void qk_key(const float* q, int64_t D, const void* row, const float* srow, int kt,
                      const int JN, __m256 dots[4][8], int i) {
    __m256 a[4];
    for (int jj = 0; jj < JN; jj++) a[jj] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
        const __m256 k = kv_load8(row, srow, c, kt);
        for (int jj = 0; jj < JN; jj++) a[jj] = _mm256_fmadd_ps(_mm256_loadu_ps(q + jj * D + c), k, a[jj]);
    }
    for (int jj = 0; jj < JN; jj++) dots[jj][i] = a[jj];
}

/* o[jj][d0 .. d0 + 8 CN) += sum over u of p[jj][u] v_u[...] for JN heads: 4 x 2 accumulators
 * stay in registers, each value vector is widened once for all JN heads */
MW_INLINE void pv_pass(const float* p, int64_t n, float* o, int64_t D, const char* base,
                       const float* scales, int64_t row_bytes, const int64_t* rows, int64_t u0,
                       int64_t u1, int64_t d0, int kt, const int JN, const int CN) {
    __m256 acc[4][2];
    for (int jj = 0; jj < JN; jj++)
        for (int cc = 0; cc < CN; cc++) acc[jj][cc] = _mm256_loadu_ps(o + jj * D + d0 + 8 * cc);
    for (int64_t u = u0; u < u1; u++) {
        const void* row = base + rows[u] * row_bytes;
        const float* srow = kv_row_scales(scales, kt, rows[u], D);
        __m256 v[2];
        for (int cc = 0; cc < CN; cc++) v[cc] = kv_load8(row, srow, d0 + 8 * cc, kt);
        for (int jj = 0; jj < JN; jj++) {
            const __m256 pj = _mm256_set1_ps(p[jj * n + u]);
            for (int cc = 0; cc < CN; cc++) acc[jj][cc] = _mm256_fmadd_ps(pj, v[cc], acc[jj][cc]);
        }
    }
    for (int jj = 0; jj < JN; jj++)
        for (int cc = 0; cc < CN; cc++) _mm256_storeu_ps(o + jj * D + d0 + 8 * cc, acc[jj][cc]);
}

#if defined(__AVX512F__)
/* 16 elements i..i+15 of a cache row as floats (head dims a multiple of 16: an int8 row's
 * 16 are one group) */
MW_INLINE __m512 kv_load16(const void* row, const float* srow, int64_t i, int kt) {
    switch (kt) {
    case MW_KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i)));
    case MW_KV_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i))), 16));
    case MW_KV_I8:
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_loadu_si128((const __m128i*)((const int8_t*)row + i)))),
                             _mm512_set1_ps(srow[i / MW_KV_GROUP]));
    case MW_KV_FP8:  /* kv_load8's bit trick, twice */
        return _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castps_pd(_mm512_castps256_ps512(kv_load8(row, srow, i, kt))),
            _mm256_castps_pd(kv_load8(row, srow, i + 8, kt)), 1));
    default: return _mm512_loadu_ps((const float*)row + i);
    }
}

/* qk_key for head dims a multiple of 16: 16-wide products, folded to the 8-lane partial sums
 * qk_key leaves (each element of the row is widened once for all JN heads) */
MW_INLINE void qk_key16(const float* q, int64_t D, const void* row, const float* srow, int kt,
                        const int JN, __m256 dots[4][8], int i) {
    __m512 a[4];
    for (int jj = 0; jj < JN; jj++) a[jj] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 k = kv_load16(row, srow, c, kt);
        for (int jj = 0; jj < JN; jj++) a[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(q + jj * D + c), k, a[jj]);
    }
    for (int jj = 0; jj < JN; jj++)
        dots[jj][i] = _mm256_add_ps(_mm512_castps512_ps256(a[jj]),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[jj]), 1)));
}

/* pv_pass for head dims a multiple of 16: o[jj][d0 .. d0 + 16 CN) for JN heads, CN <= 4
 * (64 dims a pass: 16 accumulators in registers, each value vector widened once) */
MW_INLINE void pv_pass16(const float* p, int64_t n, float* o, int64_t D, const char* base,
                         const float* scales, int64_t row_bytes, const int64_t* rows, int64_t u0,
                         int64_t u1, int64_t d0, int kt, const int JN, const int CN) {
    __m512 acc[4][4];
    for (int jj = 0; jj < JN; jj++)
        for (int cc = 0; cc < CN; cc++) acc[jj][cc] = _mm512_loadu_ps(o + jj * D + d0 + 16 * cc);
    for (int64_t u = u0; u < u1; u++) {
        const void* row = base + rows[u] * row_bytes;
        const float* srow = kv_row_scales(scales, kt, rows[u], D);
        __m512 v[4];
        for (int cc = 0; cc < CN; cc++) v[cc] = kv_load16(row, srow, d0 + 16 * cc, kt);
        for (int jj = 0; jj < JN; jj++) {
            const __m512 pj = _mm512_set1_ps(p[jj * n + u]);
            for (int cc = 0; cc < CN; cc++) acc[jj][cc] = _mm512_fmadd_ps(pj, v[cc], acc[jj][cc]);
        }
    }
    for (int jj = 0; jj < JN; jj++)
        for (int cc = 0; cc < CN; cc++) _mm512_storeu_ps(o + jj * D + d0 + 16 * cc, acc[jj][cc]);
}

/* Longest head dim the 16-key score path takes (its widened keys sit on the stack: 16 x D floats) */
#define MW_ATT_MAX_D 256

/* hadd_ps of two vectors in each 128-bit lane: [x0 + x1, x2 + x3, y0 + y1, y2 + y3] */
MW_INLINE __m512 hadd512(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

/* 16 vectors of partial sums -> one vector whose lane k is the sum of v[k]'s 16 lanes, each
 * added in exactly the order the 8-key code adds them (its 256-bit halves, then hsum8x8's
 * tree), so a key's score is the same bits whichever code computed it: keys k and k + 8 share
 * a vector, one a 256-bit half, through hsum8x8's steps */
MW_INLINE __m512 hsum16x16(const __m512* v) {
    __m512 u[8];
    for (int k = 0; k < 8; k++)  /* [v_k.lo + v_k.hi | v_k+8.lo + v_k+8.hi] */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44),
                             _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
    /* 128-bit lanes: a = keys 0-3 (their partials' first, second half), keys 8-11 (same);
       b = keys 4-7, keys 12-15 */
    const __m512 a = hadd512(hadd512(u[0], u[1]), hadd512(u[2], u[3]));
    const __m512 b = hadd512(hadd512(u[4], u[5]), hadd512(u[6], u[7]));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
    return _mm512_shuffle_f32x4(r, r, 0xD8);  /* keys 0-3, 8-11, 4-7, 12-15 -> in order */
}

/* scores[j n + i0 ..] (scaled) of the `group` heads of qh against keys i0 .. i0 + 15 (rows
 * padded past n with the last key, whose scores are not stored). The 16 keys are widened to
 * float once, into kbuf [16, D], and every head reads them from there: with GQA a KV head
 * serves several query heads, and a verification run stacks up to 17 rows' heads. A head's 16
 * dot products are 16 independent FMA chains (dims across the lanes, as qk_key16 runs them),
 * then one hsum16x16: the scores are the 8-key code's bits. D a multiple of 16, at most
 * MW_ATT_MAX_D. */
MW_INLINE void scores16(const float* qh, int64_t group, int64_t D, const char* kb,
                        const float* k_scales, int kt, int64_t row_bytes, const int64_t* rows,
                        int64_t i0, int64_t n, float scale, float* scores, float* kbuf) {
    for (int k = 0; k < 16; k++) {
        const void* row = kb + rows[i0 + k] * row_bytes;
        const float* srow = kv_row_scales(k_scales, kt, rows[i0 + k], D);
        for (int64_t c = 0; c < D; c += 16) _mm512_store_ps(kbuf + k * D + c, kv_load16(row, srow, c, kt));
    }
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t take = n - i0 < 16 ? n - i0 : 16;
    for (int64_t j = 0; j < group; j++) {
        const float* q = qh + j * D;
        __m512 acc[16];
        #pragma GCC unroll 16
        for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 qc = _mm512_loadu_ps(q + c);
            #pragma GCC unroll 16
            for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(qc, _mm512_load_ps(kbuf + k * D + c), acc[k]);
        }
        const __m512 s = _mm512_mul_ps(hsum16x16(acc), sc);
        if (take == 16)
            _mm512_storeu_ps(scores + j * n + i0, s);
        else
            _mm512_mask_storeu_ps(scores + j * n + i0, (__mmask16)((1u << take) - 1), s);
    }
}
#endif
#endif

/* a cache row widened to D floats (the plain-C paths and head dims off the 8-wide vectors) */
MW_INLINE void kv_row(const void* row, const float* srow, int64_t D, int kt, float* out) {
    for (int64_t i = 0; i < D; i++) out[i] = kv_get(row, srow, i, kt);
}

/* Attention of the `group` query heads that share KV head h over tokens t0..t1 of one
 * sequence: o [group, D] = sum_t exp(s_t - m) v_t, unnormalized, with m [group] the max score
 * and l [group] the sum of the weights (so ranges can be merged). Query head j sees only the
 * first limit[j] >= 1 of the range's keys (verification rows of one sequence attend together,
 * each up to its own position): its scores past them are zero weights, so what it gets does
 * not depend on the others. Every key's score comes from the same 8-key vector code (a last
 * partial group is padded with its last key), so a head's result is the same bits whatever
 * the range's length. Scratch: scores [group, t1 - t0], rows [t1 - t0 + 15], rowbuf [D].
 * Inlined once per element type kt. */
MW_INLINE void attend_range(const float* qh, int64_t group, int64_t D, const void* k_cache,
                            const void* v_cache, const float* k_scales, const float* v_scales,
                            int kt, const int64_t* table, int64_t block_size, int64_t Hkv,
                            int64_t h, int64_t t0, int64_t t1, const int64_t* limit, float scale,
                            float* scores, int64_t* rows, float* rowbuf, float* o, float* m,
                            float* l, int64_t pf_bytes) {
    const int64_t n = t1 - t0, row_bytes = D * kv_elem_size(kt);
    /* each token's (slot, head) row, walked block by block: an integer division per token
       (t / block_size with a run-time block size) cost more than its dot product */
    {
        int64_t blk = t0 / block_size, off = t0 % block_size;
        for (int64_t i = 0; i < n; i++) {
            rows[i] = (table[blk] * block_size + off) * Hkv + h;
            if (++off == block_size) { off = 0; blk++; }
        }
        for (int64_t i = n; i < n + 15; i++) rows[i] = rows[n - 1];  /* the padded keys */
    }
    const char* kb = (const char*)k_cache;
    const char* vb = (const char*)v_cache;
    int64_t i = 0;
    /* the first keys' rows are asked for at once; the loop below asks 16 keys ahead (rows lie
       wherever their blocks are, so the hardware prefetcher loses them at every block) */
    for (int64_t w = 0; w < 16 && w < n; w++)
        for (int64_t off = 0; off < pf_bytes; off += 64)
            __builtin_prefetch(kb + rows[w] * row_bytes + off, 0, 3);
#if defined(__AVX512F__)
    /* more heads than one pass of the 8-key code takes (a verification run's rows, GQA groups
       over 4): 16 keys at a time, widened once for all of them (a 5-row run over 700 keys,
       30 layers, a Cascade Lake Xeon: 3.9-4.0 -> 3.7-3.8 ms). With 4 heads or fewer the
       8-key code widens a key once anyway, and was as fast or faster (int8 keys: ~4%) */
    if (group > 4 && D % 16 == 0 && D <= MW_ATT_MAX_D) {
        float kbuf[16 * MW_ATT_MAX_D] __attribute__((aligned(64)));
        for (; i < n; i += 16) {
            /* the next 16 keys' rows, and these keys' values for p . V below */
            for (int64_t k = i + 16; k < i + 32 && k < n; k++)
                for (int64_t off = 0; off < pf_bytes; off += 64)
                    __builtin_prefetch(kb + rows[k] * row_bytes + off, 0, 3);
            for (int64_t k = i; k < i + 16 && k < n; k++)
                for (int64_t off = 0; off < pf_bytes; off += 64)
                    __builtin_prefetch(vb + rows[k] * row_bytes + off, 0, 2);
            scores16(qh, group, D, kb, k_scales, kt, row_bytes, rows, i, n, scale, scores, kbuf);
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {  /* 8 keys at a time: 8 partial-sum vectors a head, one reduction tree */
        for (; i < n; i += 8) {
            const __m256 sc = _mm256_set1_ps(scale);
            for (int64_t j0 = 0; j0 < group; j0 += 4) {
                const int64_t jn = group - j0 < 4 ? group - j0 : 4;
                const float* qj = qh + j0 * D;
                __m256 dots[4][8];
                for (int k = 0; k < 8; k++) {
                    const void* row = kb + rows[i + k] * row_bytes;
                    const float* srow = kv_row_scales(k_scales, kt, rows[i + k], D);
                    if (j0 == 0) {  /* the key 16 on, and this key's value for p . V below */
                        const char* ka = kb + rows[i + k + 16 < n + 7 ? i + k + 16 : n + 6] * row_bytes;
                        const char* va = vb + rows[i + k] * row_bytes;
                        for (int64_t off = 0; off < pf_bytes; off += 64) {
                            __builtin_prefetch(ka + off, 0, 3);
                            __builtin_prefetch(va + off, 0, 2);
                        }
                    }
#define QK(FN) switch (jn) { case 1: FN(qj, D, row, srow, kt, 1, dots, k); break; \
                               case 2: FN(qj, D, row, srow, kt, 2, dots, k); break; \
                               case 3: FN(qj, D, row, srow, kt, 3, dots, k); break; \
                               default: FN(qj, D, row, srow, kt, 4, dots, k); }
#if defined(__AVX512F__)
                    if (D % 16 == 0) {
                        QK(qk_key16)
                        continue;
                    }
#endif
                    QK(qk_key)
#undef QK
                }
                for (int64_t jj = 0; jj < jn; jj++) {
                    const __m256 s8 = _mm256_mul_ps(hsum8x8(dots[jj]), sc);
                    if (i + 8 <= n) {
                        _mm256_storeu_ps(scores + (j0 + jj) * n + i, s8);
                    } else {  /* the padded group: its real keys only */
                        float tail[8];
                        _mm256_storeu_ps(tail, s8);
                        memcpy(scores + (j0 + jj) * n + i, tail, sizeof(float) * (n - i));
                    }
                }
            }
        }
    }
#endif
    for (; i < n; i++) {
        kv_row(kb + rows[i] * row_bytes, kv_row_scales(k_scales, kt, rows[i], D), D, kt, rowbuf);
        for (int64_t j = 0; j < group; j++) scores[j * n + i] = dot_f32(qh + j * D, rowbuf, D) * scale;
    }
    for (int64_t j = 0; j < group; j++) {
        float* sj = scores + j * n;
        const int64_t nj = limit[j];
        const float mx = max_f32(sj, nj);
        m[j] = mx;
        l[j] = exp_shift_sum(sj, nj, mx);
        memset(sj + nj, 0, sizeof(float) * (n - nj));  /* keys past this head's position */
    }
    memset(o, 0, sizeof(float) * group * D);
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        /* 32 tokens' rows stay in L1 while passes of (4 heads x 64 dims) sweep them */
        const int64_t nd = D / 16;
        for (int64_t u0 = 0; u0 < n; u0 += 32) {
            const int64_t u1 = u0 + 32 < n ? u0 + 32 : n;
            for (int64_t j0 = 0; j0 < group; j0 += 4) {
                const int64_t jn = group - j0 < 4 ? group - j0 : 4;
                for (int64_t c0 = 0; c0 < nd; c0 += 4) {
                    const float* p = scores + j0 * n;
                    float* oj = o + j0 * D;
                    const int64_t d0 = 16 * c0, cn = nd - c0 < 4 ? nd - c0 : 4;
#define PV16(JN, CN) pv_pass16(p, n, oj, D, vb, v_scales, row_bytes, rows, u0, u1, d0, kt, JN, CN)
#define PV16_JN(CN) switch (jn) { case 1: PV16(1, CN); break; case 2: PV16(2, CN); break; \
                                  case 3: PV16(3, CN); break; default: PV16(4, CN); }
                    switch (cn) { case 1: PV16_JN(1); break; case 2: PV16_JN(2); break;
                                  case 3: PV16_JN(3); break; default: PV16_JN(4); }
#undef PV16_JN
#undef PV16
                }
            }
        }
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        /* 32 tokens' rows stay in L1 while passes of (4 heads x 16 dims) sweep them */
        const int64_t nd = D / 8;
        for (int64_t u0 = 0; u0 < n; u0 += 32) {
            const int64_t u1 = u0 + 32 < n ? u0 + 32 : n;
            for (int64_t j0 = 0; j0 < group; j0 += 4) {
                const int64_t jn = group - j0 < 4 ? group - j0 : 4;
                for (int64_t c0 = 0; c0 < nd; c0 += 2) {
                    const float* p = scores + j0 * n;
                    float* oj = o + j0 * D;
                    const int64_t d0 = 8 * c0;
#define PV(JN, CN) pv_pass(p, n, oj, D, vb, v_scales, row_bytes, rows, u0, u1, d0, kt, JN, CN)
                    if (nd - c0 >= 2) {
                        switch (jn) { case 1: PV(1, 2); break; case 2: PV(2, 2); break;
                                      case 3: PV(3, 2); break; default: PV(4, 2); }
                    } else {
                        switch (jn) { case 1: PV(1, 1); break; case 2: PV(2, 1); break;
                                      case 3: PV(3, 1); break; default: PV(4, 1); }
                    }
#undef PV
                }
            }
        }
        return;
    }
#endif
    for (int64_t u = 0; u < n; u++) {
        kv_row(vb + rows[u] * row_bytes, kv_row_scales(v_scales, kt, rows[u], D), D, kt, rowbuf);
        for (int64_t j = 0; j < group; j++) axpy_f32(scores[j * n + u], rowbuf, o + j * D, D);
    }
}

/* attend_range with its element type a constant: one specialized copy per format */
static void attend(const float* qh, int64_t group, int64_t D, const void* k_cache,
                   const void* v_cache, const float* k_scales, const float* v_scales, int kt,
                   const int64_t* table, int64_t block_size, int64_t Hkv, int64_t h, int64_t t0,
                   int64_t t1, const int64_t* limit, float scale, float* scores, int64_t* rows,
                   float* rowbuf, float* o, float* m, float* l, int64_t pf_bytes) {
#define ATTEND(KT) attend_range(qh, group, D, k_cache, v_cache, k_scales, v_scales, KT, table, \
                                block_size, Hkv, h, t0, t1, limit, scale, scores, rows, rowbuf, \
                                o, m, l, pf_bytes)
    switch (kt) {
    case MW_KV_F16: ATTEND(MW_KV_F16); break;
    case MW_KV_BF16: ATTEND(MW_KV_BF16); break;
    case MW_KV_I8: ATTEND(MW_KV_I8); break;
    case MW_KV_FP8: ATTEND(MW_KV_FP8); break;
    default: ATTEND(MW_KV_F32); break;
    }
#undef ATTEND
}

/* one row of D floats -> its cache format at dst (int8: its kv_groups(D) scales at scale) */
static void write_row(const float* x, int64_t D, int kt, void* dst, float* scale) {
    switch (kt) {
    case MW_KV_F16: {
        int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
        /* the hardware's nearest-even conversion after the same saturation (NaN stays NaN:
           max/min return their second operand, x, when it is NaN) */
        const __m256 top = _mm256_set1_ps(65504.f), bottom = _mm256_set1_ps(-65504.f);
        for (; i + 8 <= D; i += 8) {
            const __m256 v = _mm256_max_ps(bottom, _mm256_min_ps(top, _mm256_loadu_ps(x + i)));
            _mm_storeu_si128((__m128i*)((uint16_t*)dst + i),
                             _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; i < D; i++) ((uint16_t*)dst)[i] = float_to_half(x[i]);
        break;
    }
    case MW_KV_BF16:
        for (int64_t i = 0; i < D; i++) ((uint16_t*)dst)[i] = mw_float_to_bf16(x[i]);
        break;
    case MW_KV_FP8:
        for (int64_t i = 0; i < D; i++) ((uint8_t*)dst)[i] = float_to_fp8(x[i]);
        break;
    case MW_KV_I8:  /* symmetric per group, as kv_quant.quantize: code = round(x / (max|x| / 127)) */
        for (int64_t g0 = 0; g0 < D; g0 += MW_KV_GROUP) {
            const int64_t g1 = g0 + MW_KV_GROUP < D ? g0 + MW_KV_GROUP : D;
            float amax = 0.f;
            for (int64_t i = g0; i < g1; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const float s = amax / 127.f, safe = s > 0.f ? s : 1.f;
            for (int64_t i = g0; i < g1; i++) {
                float c = nearbyintf(x[i] / safe);
                ((int8_t*)dst)[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
            }
            scale[g0 / MW_KV_GROUP] = s;
        }
        break;
    default: memcpy(dst, x, sizeof(float) * D);
    }
}

int mw_kv_write(const float* x, int64_t n, const int64_t* slots, int64_t num_slots, int64_t Hkv,
                int64_t D, int kt, void* cache, float* scales) {
    for (int64_t b = 0; b < n; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return MW_BAD_SLOT;
    const int64_t row_bytes = D * kv_elem_size(kt);
    #pragma omp parallel for schedule(static) if (n * Hkv * D >= 32768)
    for (int64_t b = 0; b < n; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t r = slots[b] * Hkv + h;
            write_row(x + (b * Hkv + h) * D, D, kt, (char*)cache + r * row_bytes,
                      scales ? scales + r * kv_groups(D) : NULL);
        }
    return MW_OK;
}

/* MW_OK when every sequence's length is 1..table_width * block_size and every block it reads
 * is in 0..num_blocks - 1 (the kernel reads memory at those ids, so they are checked first);
 * else MW_BAD_SEQ_LEN or MW_BAD_BLOCK. */
int mw_check_tables(const int64_t* block_tables, int64_t table_width, const int64_t* seq_lens,
                    int64_t B, int64_t block_size, int64_t num_blocks) {
    if (block_size <= 0) return MW_BAD_SEQ_LEN;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b];
        if (len < 1 || len > table_width * block_size) return MW_BAD_SEQ_LEN;
        for (int64_t i = 0; i < (len + block_size - 1) / block_size; i++) {
            const int64_t id = block_tables[b * table_width + i];
            if (id < 0 || id >= num_blocks) return MW_BAD_BLOCK;
        }
    }
    return MW_OK;
}

/* One query token per sequence. q: [B, H, D]; out: [B, H, D]; block_tables: [B, table_width];
 * seq_lens: [B] (keys 0..len-1 are attended, including the token just written). The `group`
 * query heads that share a KV head are done together, so each key and value is read once.
 * So are the rows of a verification run (speculative decoding puts the k + 1 tokens of one
 * sequence in as rows with its block table and lengths len, len + 1, ...): their query heads
 * attend together, each up to its own position, and the run reads its KV once, not k + 1 times.
 * Work items are (run, key range), its KV heads in turn (one KV head an item where runs x
 * ranges are fewer than the threads): contexts longer than SPLIT_KEYS are split into
 * ranges of SPLIT_KEYS keys, threads take them, and the ranges' partial softmax sums are merged
 * in order (flash-decoding's split-K). A slot's KV heads lie side by side, so the
 * first head's pass prefetches every head's rows: DRAM is read in whole stretches of a block
 * and the other heads' passes find their rows in this core's cache (items were (run, KV head,
 * range), each reading a third of every slot's lines). With max_f32: B = 16, fp16, 30 layers on
 * a 2-core EPYC Zen 4, 200 keys 5.46 / 5.14 / 5.53 -> 5.28 / 4.86 / 5.31 ms, 1,000 keys
 * 25.2 / 24.8 / 25.0 -> 23.4 / 23.3 / 23.9 ms. The ranges depend on the row's own length only,
 * never on the batch, its runs or the thread count, so a row's result is the same bits in any
 * batch: verification reproduces the one-token steps exactly. window > 0 (a sliding layer,
 * Gemma's): a row of length len attends keys len - window .. len - 1 only, as the model's
 * reference does (a query at position p sees p - window + 1 .. p); each row is then a run of
 * its own, and ranges wholly before its window are skipped. Unchecked: mw_check_tables
 * first (the decode step checks once for all its layers). Returns MW_OK or MW_OUT_OF_MEMORY. */
#define SPLIT_KEYS 128
#define MAX_RUN 17  /* rows a run takes at most: 1 + the most drafts a step verifies (16) */

/* rows b and b + 1 of a run: the next length, the same blocks, and the same side of
   SPLIT_KEYS (a row attended whole is normalized in place, a split one merged later) */
static int continues_run(const int64_t* tables, int64_t width, const int64_t* lens, int64_t b,
                         int64_t block_size) {
    if (lens[b + 1] != lens[b] + 1 || (lens[b] > SPLIT_KEYS) != (lens[b + 1] > SPLIT_KEYS))
        return 0;
    const int64_t used = (lens[b + 1] + block_size - 1) / block_size;
    return memcmp(tables + b * width, tables + (b + 1) * width, sizeof(int64_t) * used) == 0;
}

int mw_paged_attention_run(const float* q, const void* k_cache, const void* v_cache,
                           const float* k_scales, const float* v_scales, int kv_type,
                           const int64_t* block_tables, int64_t table_width,
                           const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t block_size, float scale, int64_t window,
                           float* out) {
    if (B <= 0 || H <= 0 || Hkv <= 0 || D <= 0) return MW_OK;
    const int64_t group = H / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int64_t splits = (max_len + SPLIT_KEYS - 1) / SPLIT_KEYS;  /* ranges of the longest row */
    splits = splits < 1 ? 1 : splits;
    /* runs: first row and row count; per split item: unnormalized o [group, D], m and l [group] */
    int64_t* run_first = (int64_t*)malloc(sizeof(int64_t) * 2 * B);
    float* part = splits > 1 ? (float*)malloc(sizeof(float) * B * Hkv * splits * group * (D + 2)) : NULL;
    if (!run_first || (splits > 1 && !part)) {
        free(run_first);
        free(part);
        return MW_OUT_OF_MEMORY;
    }
    int64_t* run_rows = run_first + B;
    int64_t runs = 0;
    for (int64_t b = 0; b < B;) {
        int64_t r = 1;
        while (b + r < B && r < MAX_RUN && window <= 0 &&  /* a window: each row alone */
               continues_run(block_tables, table_width, seq_lens, b + r - 1, block_size))
            r++;
        run_first[runs] = b, run_rows[runs] = r, runs++;
        b += r;
    }
    /* a sequence's KV heads go in one item where there are two items a thread or more; else
       one head an item (one short sequence alone would otherwise keep one thread busy, and
       one of 129..256 keys split 128 + the rest gave one thread 128 keys' work, the other
       the rest's: 0.44 -> 0.32 ms a step at 150 keys with heads apart, 2 threads) */
    const int64_t heads_per_item = runs * splits >= 2 * (int64_t)omp_get_max_threads() ? Hkv : 1;
    const int64_t head_groups = Hkv / heads_per_item, row_bytes = D * kv_elem_size(kv_type);
    int failed = 0;  /* set when a thread could not get its scratch (then out is not valid) */
    #pragma omp parallel
    {
        /* a run's query heads side by side: qs [G, D], o [G, D], m, l, limit [G]
           (G = MAX_RUN * group); attend_range's scratch for a range of at most `span` keys:
           scores [G, span] then rowbuf [D], rows [span + 15] */
        const int64_t span = max_len < SPLIT_KEYS ? max_len : SPLIT_KEYS;
        const int64_t G = MAX_RUN * group;
        float* scores = (float*)malloc(sizeof(float) * (G * span + D));
        int64_t* rows = (int64_t*)malloc(sizeof(int64_t) * (span + 16));
        float* qs = (float*)malloc(sizeof(float) * G * (2 * D + 2));
        int64_t* limit = (int64_t*)malloc(sizeof(int64_t) * G);
        const int ready = scores && rows && qs && limit;
        if (!ready) {
            #pragma omp atomic write
            failed = 1;
        }
        float *o = qs + G * D, *ml = o + G * D;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < runs * splits * head_groups; it++) {
            const int64_t run = it / (splits * head_groups), sp = (it / head_groups) % splits;
            const int64_t h0 = (it % head_groups) * heads_per_item;
            for (int64_t h = h0; h < h0 + heads_per_item; h++) {
                if (!ready) continue;
                const int64_t b0 = run_first[run], r = run_rows[run];
                const int64_t last = seq_lens[b0 + r - 1];
                const int whole = last <= SPLIT_KEYS;  /* every row of the run, as continues_run */
                /* a sliding window (a run of one row then): keys last - window .. last - 1 only,
                   so a range below them is empty and the one they start in starts there */
                const int64_t first = window > 0 && last > window ? last - window : 0;
                const int64_t t0 = sp * SPLIT_KEYS > first ? sp * SPLIT_KEYS : first;
                const int64_t t1 = sp * SPLIT_KEYS + SPLIT_KEYS < last ? sp * SPLIT_KEYS + SPLIT_KEYS : last;
                if (whole && sp > 0) continue;
                if (t0 >= t1) {  /* an empty range (a shorter run): contributes nothing */
                    for (int64_t i = 0; i < r; i++) {
                        float* m = part + (((b0 + i) * Hkv + h) * splits + sp) * group * (D + 2) + group * D;
                        for (int64_t j = 0; j < group; j++) { m[j] = -INFINITY; m[group + j] = 0.f; }
                    }
                    continue;
                }
                /* the rows whose range this is not empty, and how far each head may look */
                int64_t live = 0;
                for (int64_t i = 0; i < r; i++) {
                    const int64_t len = seq_lens[b0 + i];
                    const int64_t end = t1 < len ? t1 : len;
                    if (end <= t0) continue;
                    memcpy(qs + live * group * D, q + ((b0 + i) * H + h * group) * D,
                           sizeof(float) * group * D);
                    for (int64_t j = 0; j < group; j++) limit[live * group + j] = end - t0;
                    live++;
                }
                /* the last row's table: every row's blocks are a prefix of it (continues_run) */
                const int64_t* table = block_tables + (b0 + r - 1) * table_width;
                /* an item of all the heads: the first head's pass asks for the keys' and values'
                   rows of every KV head (a slot's heads lie side by side), the passes of the
                   others then find them in this core's cache and ask for nothing (their
                   prefetches, of lines already in L2, took ~12% of a 1,024-key item), and DRAM is
                   read in whole runs of a block, not a head's 1/Hkv */
                attend(qs, live * group, D, k_cache, v_cache, k_scales, v_scales, kv_type, table,
                       block_size, Hkv, h, t0, t1, limit, scale, scores, rows, scores + G * span, o,
                       ml, ml + G, heads_per_item > 1 ? (h == 0 ? Hkv * row_bytes : 0) : row_bytes);
                for (int64_t i = 0, k = 0; i < r; i++) {
                    const int64_t len = seq_lens[b0 + i];
                    if (whole) {  /* one range: normalized in place */
                        float* oh = out + ((b0 + i) * H + h * group) * D;
                        for (int64_t j = 0; j < group; j++) {
                            const float inv = 1.f / ml[G + k * group + j];
                            for (int64_t d = 0; d < D; d++) oh[j * D + d] = o[(k * group + j) * D + d] * inv;
                        }
                        k++;
                        continue;
                    }
                    float* po = part + (((b0 + i) * Hkv + h) * splits + sp) * group * (D + 2);
                    float* pm = po + group * D;
                    if (len <= t0) {  /* past this row's end */
                        for (int64_t j = 0; j < group; j++) { pm[j] = -INFINITY; pm[group + j] = 0.f; }
                        continue;
                    }
                    memcpy(po, o + k * group * D, sizeof(float) * group * D);
                    for (int64_t j = 0; j < group; j++) {
                        pm[j] = ml[k * group + j];
                        pm[group + j] = ml[G + k * group + j];
                    }
                    k++;
                }
            }
        }
        free(scores);
        free(rows);
        free(qs);
        free(limit);
        int any_failed;  /* the same for every thread: set before the loop's closing barrier */
        #pragma omp atomic read
        any_failed = failed;
        if (splits > 1 && !any_failed) {
            #pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * Hkv; bh++) {
                const int64_t b = bh / Hkv, h = bh % Hkv;
                if (seq_lens[b] <= SPLIT_KEYS) continue;  /* written whole above */
                float* oh = out + (b * H + h * group) * D;
                for (int64_t j = 0; j < group; j++) {
                    float mx = -INFINITY, total = 0.f;
                    for (int64_t sp = 0; sp < splits; sp++) {
                        const float* m = part + (bh * splits + sp) * group * (D + 2) + group * D;
                        mx = m[j] > mx ? m[j] : mx;
                    }
                    memset(oh + j * D, 0, sizeof(float) * D);
                    for (int64_t sp = 0; sp < splits; sp++) {
                        const float* o = part + (bh * splits + sp) * group * (D + 2);
                        const float* m = o + group * D;
                        if (m[group + j] == 0.f) continue;
                        const float w = expf(m[j] - mx);
                        total += w * m[group + j];
                        axpy_f32(w, o + j * D, oh + j * D, D);
                    }
                    const float inv = 1.f / total;
                    for (int64_t d = 0; d < D; d++) oh[j * D + d] *= inv;
                }
            }
        }
    }
    free(run_first);
    free(part);
    return failed ? MW_OUT_OF_MEMORY : MW_OK;
}

/* The checked entry points: mw_check_tables, then the attention (a float32 cache, or any
 * MW_KV_* format with int8's scales). */
int mw_paged_decode_attention_kv(const float* q, const void* k_cache, const void* v_cache,
                                 const float* k_scales, const float* v_scales, int kv_type,
                                 const int64_t* block_tables, int64_t table_width,
                                 const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                                 int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                                 int64_t window, float* out) {
    const int rc = mw_check_tables(block_tables, table_width, seq_lens, B, block_size, num_blocks);
    return rc != MW_OK ? rc : mw_paged_attention_run(q, k_cache, v_cache, k_scales, v_scales,
                                                     kv_type, block_tables, table_width, seq_lens,
                                                     B, H, Hkv, D, block_size, scale, window, out);
}

int mw_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                              const int64_t* block_tables, int64_t table_width,
                              const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                              float* out) {
    return mw_paged_decode_attention_kv(q, k_cache, v_cache, NULL, NULL, MW_KV_F32, block_tables,
                                        table_width, seq_lens, B, H, Hkv, D, block_size,
                                        num_blocks, scale, 0, out);
}

/* ------------------------------------------------------------------ prefill chunks
 *
 * One sequence's prefill chunk: q [Q, H, D], the queries of positions seq_len - Q .. seq_len - 1,
 * attends causally (and, with window > 0, to its last `window` keys) over keys 0 .. seq_len - 1
 * where they lie in the paged cache (the chunk's own K/V already written), into out [Q, H, D].
 *
 * Why not the decode kernel: it scores one key at a time against a few query heads, with a
 * reduction across lanes a key. Here a chunk of 16 keys is widened to float once, transposed
 * (lanes = keys), and every query row of a tile meets it with D FMAs into one vector of 16
 * scores (a query element broadcast); the values' 16 x D block then takes 16 FMAs per 16
 * output dims a row. Flash attention's online softmax keeps a running max and sum a row, so
 * each key chunk is read once per tile of PF_TILE positions x the KV head's query heads.
 * fp32 throughout (the torch reference's precision); AVX-512 builds with D % 16 == 0, else
 * MW_UNSUPPORTED (the caller runs the reference).
 */
#define PF_TILE 32  /* query positions a work item: with GQA's group, 32 x group rows share a key chunk */
#define PF_ROWS 12  /* rows whose scores stay in registers at once */

int mw_prefill_attention_available(int64_t D) {
#if defined(__AVX512F__)
    return D > 0 && D % 16 == 0 && D <= 512;
#else
    (void)D;
    return 0;
#endif
}

#if defined(__AVX512F__)
/* keys t0 .. t0 + n - 1 (n <= 16) of KV head h as floats: rows [16][D] (rows past n zero;
 * an int8 cache's scales applied) */
MW_INLINE void load_chunk(const void* cache, const float* scales, int kt, const int64_t* table,
                          int64_t block_size, int64_t Hkv, int64_t h, int64_t D, int64_t t0,
                          int64_t n, float* rows) {
    const int64_t row_bytes = D * kv_elem_size(kt);
    for (int64_t i = 0; i < 16; i++) {
        float* dst = rows + i * D;
        if (i >= n) { memset(dst, 0, sizeof(float) * D); continue; }
        const int64_t t = t0 + i;
        const int64_t slot_row = (table[t / block_size] * block_size + t % block_size) * Hkv + h;
        const void* src = (const char*)cache + slot_row * row_bytes;
        const float* srow = kv_row_scales(scales, kt, slot_row, D);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, kv_load8(src, srow, d, kt));
    }
}

/* kt: [D][16], column i = key i (from rows [16][D]) */
static void transpose_keys(const float* rows, int64_t D, float* kt) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(_mm512_loadu_ps(rows + i * D + d0));
        mw_transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512((__m512i*)(kt + (d0 + j) * 16), r[j]);
    }
}

/* RN rows' scores against a key chunk: s[r] = sum_d q_r[d] * kt[d] (16 keys a vector) */
MW_INLINE void chunk_scores(const int RN, const float* const* qr, const float* kt, int64_t D,
                            __m512* s) {
    for (int r = 0; r < RN; r++) s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k = _mm512_load_ps(kt + d * 16);
        for (int r = 0; r < RN; r++) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k, s[r]);
    }
}

/* RN rows against one key chunk (kt: its keys transposed; vrows: its values [16][D], zero past
 * the chunk's keys), flash attention's step: scores, each row's running max m and sum l
 * updated (masks: the keys a row may see; none: it is left as it was), o rescaled and
 * o += p . V. Rows are independent, so their exp and reductions overlap; two rows at a time
 * share each value vector of the p . V pass. */
MW_INLINE void chunk_rows(const int RN, const float* const* qr, const float* kt, const float* vrows,
                          int64_t D, const __mmask16* masks, float scale, float* m, float* l,
                          float* const* orow) {
    __m512 s[PF_ROWS];
    chunk_scores(RN, qr, kt, D, s);
    float pk[PF_ROWS][16] __attribute__((aligned(64)));
    float alpha[PF_ROWS];
    for (int r = 0; r < RN; r++) {
        const __m512 sv = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
        const float mx = masks[r] ? _mm512_mask_reduce_max_ps(masks[r], sv) : -INFINITY;
        const float m_new = mx > m[r] ? mx : m[r];
        /* the running sums were taken against a smaller max (none yet: nothing to keep) */
        alpha[r] = m_new > m[r] ? (m[r] == -INFINITY ? 0.f : expf(m[r] - m_new)) : 1.f;
        const __m512 p = _mm512_maskz_mov_ps(masks[r], exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
        _mm512_store_ps(pk[r], p);
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(p);
        m[r] = m_new;
    }
    for (int r = 0; r < RN; r += 2) {
        const int two = r + 1 < RN;
        float* o0 = orow[r];
        float* o1 = orow[two ? r + 1 : r];
        const __m512 a0 = _mm512_set1_ps(alpha[r]), a1 = _mm512_set1_ps(alpha[two ? r + 1 : r]);
        const float* p1 = pk[two ? r + 1 : r];
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) {
            __m512 x0[4], x1[4];
            for (int c = 0; c < 4; c++) {
                x0[c] = _mm512_mul_ps(a0, _mm512_loadu_ps(o0 + d + 16 * c));
                x1[c] = _mm512_mul_ps(a1, _mm512_loadu_ps(o1 + d + 16 * c));
            }
            for (int i = 0; i < 16; i++) {
                const __m512 b0 = _mm512_set1_ps(pk[r][i]), b1 = _mm512_set1_ps(p1[i]);
                for (int c = 0; c < 4; c++) {
                    const __m512 v = _mm512_loadu_ps(vrows + i * D + d + 16 * c);
                    x0[c] = _mm512_fmadd_ps(b0, v, x0[c]);
                    x1[c] = _mm512_fmadd_ps(b1, v, x1[c]);
                }
            }
            for (int c = 0; c < 4; c++) {
                _mm512_storeu_ps(o0 + d + 16 * c, x0[c]);
                if (two) _mm512_storeu_ps(o1 + d + 16 * c, x1[c]);
            }
        }
        for (; d < D; d += 16) {  /* head dims past a multiple of 64 */
            __m512 x0 = _mm512_mul_ps(a0, _mm512_loadu_ps(o0 + d));
            __m512 x1 = _mm512_mul_ps(a1, _mm512_loadu_ps(o1 + d));
            for (int i = 0; i < 16; i++) {
                const __m512 v = _mm512_loadu_ps(vrows + i * D + d);
                x0 = _mm512_fmadd_ps(_mm512_set1_ps(pk[r][i]), v, x0);
                x1 = _mm512_fmadd_ps(_mm512_set1_ps(p1[i]), v, x1);
            }
            _mm512_storeu_ps(o0 + d, x0);
            if (two) _mm512_storeu_ps(o1 + d, x1);
        }
    }
}

/* one work item: KV head h, query positions p0 .. p0 + np - 1 (chunk rows), every query head
 * of the group; scratch: o [np * group][D], ml [2 * np * group], kt [D * 16], vrows, krows [16 * D] */
static void prefill_tile(const float* q, const void* k_cache, const void* v_cache,
                         const float* k_scales, const float* v_scales, int kt_type,
                         const int64_t* table, int64_t first_query, int64_t p0, int64_t np,
                         int64_t H, int64_t Hkv, int64_t h, int64_t D, int64_t block_size,
                         float scale, int64_t window, float* o, float* ml, float* kt,
                         float* krows, float* vrows, float* out) {
    const int64_t group = H / Hkv, R = np * group;
    float* m = ml;
    float* l = ml + R;
    memset(o, 0, sizeof(float) * R * D);
    for (int64_t r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    const int64_t pos_first = first_query + p0, pos_last = pos_first + np - 1;
    const int64_t kmin = window > 0 && pos_first - window + 1 > 0 ? pos_first - window + 1 : 0;
    const int64_t kend = pos_last + 1;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t0 = kmin; t0 < kend; t0 += 16) {
        const int64_t n = kend - t0 < 16 ? kend - t0 : 16;
        load_chunk(k_cache, k_scales, kt_type, table, block_size, Hkv, h, D, t0, n, krows);
        transpose_keys(krows, D, kt);
        load_chunk(v_cache, v_scales, kt_type, table, block_size, Hkv, h, D, t0, n, vrows);
        const __m512i keypos = _mm512_add_epi32(_mm512_set1_epi32((int)t0), lane);
        for (int64_t r0 = 0; r0 < R; r0 += PF_ROWS) {
            const int64_t rn = R - r0 < PF_ROWS ? R - r0 : PF_ROWS;
            /* rows are (position, head) with the head fastest: a sub-batch whose last position
               is before the chunk sees none of it (causal), nor one whose first position's
               window ends after it */
            const int64_t pos_lo = pos_first + r0 / group, pos_hi = pos_first + (r0 + rn - 1) / group;
            if (t0 > pos_hi) continue;
            if (window > 0 && t0 + n - 1 <= pos_lo - window) continue;
            const float* qr[PF_ROWS];
            for (int64_t r = 0; r < rn; r++) {
                const int64_t row = r0 + r, pos = row / group, j = row % group;
                qr[r] = q + ((p0 + pos) * H + h * group + j) * D;
            }
            __mmask16 masks[PF_ROWS];
            float* orows[PF_ROWS];
            for (int64_t r = 0; r < rn; r++) {
                const int64_t row = r0 + r, pos = pos_first + row / group;
                /* keys t <= pos, t > pos - window, and real (lane < n) */
                __mmask16 mask = _mm512_cmple_epi32_mask(keypos, _mm512_set1_epi32((int)pos));
                mask &= (__mmask16)((1u << n) - 1u);
                if (window > 0)
                    mask &= _mm512_cmpgt_epi32_mask(keypos, _mm512_set1_epi32((int)(pos - window)));
                masks[r] = mask;
                orows[r] = o + row * D;
            }
            switch (rn) {
#define PF_CASE(k) case k: chunk_rows(k, qr, kt, vrows, D, masks, scale, m + r0, l + r0, orows); break;
            PF_CASE(1) PF_CASE(2) PF_CASE(3) PF_CASE(4) PF_CASE(5) PF_CASE(6)
            PF_CASE(7) PF_CASE(8) PF_CASE(9) PF_CASE(10) PF_CASE(11)
            default: chunk_rows(PF_ROWS, qr, kt, vrows, D, masks, scale, m + r0, l + r0, orows); break;
#undef PF_CASE
            }
        }
    }
    for (int64_t row = 0; row < R; row++) {
        const int64_t pos = row / group, j = row % group;
        float* dst = out + ((p0 + pos) * H + h * group + j) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[row]);  /* every row sees its own key: l > 0 */
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o + row * D + d)));
    }
}
#endif

int mw_paged_prefill_attention(const float* q, const void* k_cache, const void* v_cache,
                               const float* k_scales, const float* v_scales, int kv_type,
                               const int64_t* table, int64_t table_width, int64_t seq_len,
                               int64_t Q, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                               int64_t num_blocks, float scale, int64_t window, float* out) {
    if (Q <= 0 || H <= 0) return MW_OK;
    if (!mw_prefill_attention_available(D) || Hkv <= 0 || H % Hkv) return MW_UNSUPPORTED;
    if (seq_len < Q || seq_len > table_width * block_size) return MW_BAD_SEQ_LEN;
    const int rc = mw_check_tables(table, table_width, &seq_len, 1, block_size, num_blocks);
    if (rc != MW_OK) return rc;
#if defined(__AVX512F__)
    const int64_t group = H / Hkv, tiles = (Q + PF_TILE - 1) / PF_TILE;
    int failed = 0;
    #pragma omp parallel
    {
        const int64_t R = PF_TILE * group;
        const int64_t ml_floats = (2 * R + 15) / 16 * 16;  /* keeps the key chunk 64-byte aligned */
        float* o = (float*)aligned_alloc(64, sizeof(float) * (size_t)(R * D + ml_floats + 16 * D * 3));
        if (!o) {
            #pragma omp atomic write
            failed = 1;
        }
        /* later tiles have more keys: the last ones first, then dynamic */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < tiles * Hkv; it++) {
            if (!o) continue;
            const int64_t tile = tiles - 1 - it / Hkv, h = it % Hkv;
            const int64_t p0 = tile * PF_TILE, np = Q - p0 < PF_TILE ? Q - p0 : PF_TILE;
            float* ml = o + R * D;
            float* kt = ml + ml_floats;
            prefill_tile(q, k_cache, v_cache, k_scales, v_scales, kv_type, table, seq_len - Q, p0,
                         np, H, Hkv, h, D, block_size, scale, window, o, ml, kt, kt + 16 * D,
                         kt + 32 * D, out);
        }
        free(o);
    }
    return failed ? MW_OUT_OF_MEMORY : MW_OK;
#else
    (void)q; (void)k_cache; (void)v_cache; (void)k_scales; (void)v_scales; (void)kv_type;
    (void)scale; (void)window; (void)out;
    return MW_UNSUPPORTED;
#endif
}
