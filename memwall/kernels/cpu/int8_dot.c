/* memwall's one-token matmuls with int8 activations (see kernels.h for the other files).
 *
 * One token (a decode row) is bandwidth-light but instruction-heavy on the fp32 kernels: each
 * weight is widened, scaled, offset and multiplied (5 vector ops per 16 weights). With
 * AVX512-VNNI one vpdpbusd multiplies 64 weight codes by 64 int8 activations instead.
 *
 * Activations as two int8 digits. One int8 code per activation (llama.cpp's Q8 activations)
 * is too coarse for small models: SmolLM2's greedy tokens leave the float path's after a
 * few tokens. So each 32-value block is written x ~= d * (256 * hi + lo): hi = round(x / d)
 * with d = max|x| / 127, and lo the rounded remainder in units of d / 256. Both digits are
 * int8, both go through vpdpbusd, and (dot(hi) << 8) + dot(lo) is exact in int32. What is
 * left is the rounding of lo: relative ~2e-5, fp16-like, and greedy decoding keeps to the
 * exact path (tests/quant/test_int8_dot.py).
 *
 *   y[n] = sum_g  s[n,g] * (d_b / 256) * sum_{k in g} q[n,k] * (256 hi[k] + lo[k])
 *        + c[n,g] * xsum_g                     xsum_g = sum of the group's quantized x
 *
 * mw_set_int_acts(0) (int8_gemm.c) switches back to the exact fp32 kernels. Needs K % 64 == 0 (else the
 * entry points return 0 and the caller runs the fp32 kernel).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

int mw_int8_dot_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MW_VNNI 1

/* Where activation k of a q4 row goes in the digit arrays. q4 codes unpack 128 at a time:
 * 64 bytes = four 32-value blocks, whose low nibbles (values 0..15 of each block) fill one
 * vector and high nibbles (values 16..31) another, so the activations are laid out the same
 * way; a 64-value tail (two blocks) is split the same way. */
static inline int64_t q4_position(int64_t K, int64_t b, int j) {
    const int64_t full = K / 128;
    int64_t base, i, nb;
    if (b < 4 * full) { base = (b / 4) * 128; i = b % 4; nb = 4; }
    else { base = full * 128; i = b - 4 * full; nb = 2; }
    return base + (j < 16 ? i * 16 + j : nb * 16 + i * 16 + (j - 16));
}

/* block b's two 16-value sums (in units of d / 256) into the per-group sums of the quantized
 * activations: G = 16 and 32 one or two groups a block, G % 64 == 0 several blocks a group */
static inline void group_sums(float* gsum, int64_t b, int64_t G, float unit, const int64_t sums[2]) {
    if (G == 16) {
        gsum[b * 2] = unit * (float)sums[0];
        gsum[b * 2 + 1] = unit * (float)sums[1];
    } else if (G == 32) {
        gsum[b] = unit * (float)(sums[0] + sums[1]);
    } else {
        if ((b * 32) % G == 0) gsum[b * 32 / G] = 0.f;
        gsum[b * 32 / G] += unit * (float)(sums[0] + sums[1]);
    }
}

/* x [K] -> signed digit codes hi, lo [K] (q4 order, above, or natural order for q8),
 * per-lane scales dlane [K/4] (d / 256 of the block each 4-value lane belongs to),
 * per-group sums gsum [K/G] of the quantized activations, and for q8 rows (whose signed
 * codes are read as unsigned, + 128) the per-lane correction 128 * sum(256 hi + lo). */
static void quantize_x(const float* x, int64_t K, int q4_order, int64_t G, int8_t* hi,
                       int8_t* lo, float* dlane, float* gsum, int32_t* xcorr) {
    if (xcorr) memset(xcorr, 0, sizeof(int32_t) * (K / 4));
    for (int64_t b = 0; b < K / 32; b++) {
        const float* xb = x + b * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int64_t sums[2] = {0, 0};  /* per 16 values, in units of d / 256 */
        for (int j = 0; j < 32; j++) {
            float t = xb[j] * id;
            int h = (int)nearbyintf(t);
            int l = (int)nearbyintf((t - (float)h) * 256.f);
            l = l > 127 ? 127 : (l < -127 ? -127 : l);
            int64_t pos = q4_order ? q4_position(K, b, j) : b * 32 + j;
            hi[pos] = (int8_t)h;
            lo[pos] = (int8_t)l;
            sums[j / 16] += 256 * h + l;
            if (xcorr) xcorr[pos / 4] += 128 * (256 * h + l);
            if (pos % 4 == 0) dlane[pos / 4] = d / 256.f;
        }
        group_sums(gsum, b, G, d / 256.f, sums);
    }
}

static const int32_t LANES_2[16] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};  /* q4 tail */
static const int32_t LANES_32[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
static const int32_t LANES_16[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* 16 lane scales from the n consecutive floats at s (n = 2 or 4) */
static inline __m512 spread(const float* s, int n, __m512i idx) {
    __m128 v = n == 4 ? _mm_loadu_ps(s) : _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)s));
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

/* How far ahead of the row being read its codes are asked for (bytes): rows follow one another
 * in memory, and asking one or two rows ahead kept more loads in flight than the hardware
 * prefetcher alone */
#ifndef I8_PREFETCH
#define I8_PREFETCH 1024
#endif

/* one row of a q4 weight (codes [K/2], s, c [K/32]) against a quantized token */
static inline float q4_row_i8(const uint8_t* codes, const float* s, const float* c, int64_t K,
                              const int8_t* hi, const int8_t* lo, const float* dlane,
                              const float* gsum) {
    const __m512i idx4 = _mm512_loadu_si512(LANES_16), idx2 = _mm512_loadu_si512(LANES_2);
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc = _mm512_setzero_ps();
    int64_t c128 = 0;
    for (; c128 < K / 128; c128++) {  /* 128 weights: both nibble vectors share lane scales */
        const int64_t o = c128 * 128;
        _mm_prefetch((const char*)(codes + c128 * 64 + I8_PREFETCH), _MM_HINT_T0);
        __m512i raw = _mm512_loadu_si512(codes + c128 * 64);
        __m512i wl = _mm512_and_si512(raw, low4);
        __m512i wh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, _mm512_loadu_si512(hi + o));
        dh = _mm512_dpbusd_epi32(dh, wh, _mm512_loadu_si512(hi + o + 64));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), wl, _mm512_loadu_si512(lo + o));
        dot = _mm512_dpbusd_epi32(dot, wh, _mm512_loadu_si512(lo + o + 64));
        __m512 scale = _mm512_mul_ps(spread(s + c128 * 4, 4, idx4), _mm512_loadu_ps(dlane + o / 4));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    }
    if (K % 128) {  /* a 64-weight tail: two blocks, nibble halves side by side */
        const int64_t o = c128 * 128;
        const __m256i low4h = _mm256_set1_epi8(15);
        __m256i raw = _mm256_loadu_si256((const __m256i*)(codes + c128 * 64));
        __m256i wl = _mm256_and_si256(raw, low4h);
        __m256i wh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4h);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(wl), wh, 1);
        __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(hi + o));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), w, _mm512_loadu_si512(lo + o));
        __m512 scale = _mm512_mul_ps(spread(s + c128 * 4, 2, idx2), _mm512_loadu_ps(dlane + o / 4));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    }
    const float sum = _mm512_reduce_add_ps(acc);
    return c ? sum + dot_f32(c, gsum, K / 32) : sum;  /* c NULL: no offsets (MW_NO_OFFSETS) */
}

/* one row of a q8 weight (signed codes [K], s, c [K/G]). The codes are read as unsigned
 * (xor 0x80 = code + 128) and the 128 * sum(x) that adds is taken back with xcorr. */
static inline float q8_row_i8(const int8_t* codes, const float* s, const float* c, int64_t K,
                              int64_t G, const int8_t* hi, const int8_t* lo,
                              const float* dlane, const float* gsum, const int32_t* xcorr) {
    const __m512i idx = _mm512_loadu_si512(G == 16 ? LANES_16 : LANES_32);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 64; p++) {
        _mm_prefetch((const char*)(codes + p * 64 + I8_PREFETCH), _MM_HINT_T0);
        __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes + p * 64), flip);
        __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(hi + p * 64));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), w, _mm512_loadu_si512(lo + p * 64));
        dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(xcorr + p * 16));
        __m512 sv = G == 16 ? spread(s + p * 4, 4, idx) : G == 32 ? spread(s + p * 2, 2, idx)
                                                                 : _mm512_set1_ps(s[p * 64 / G]);
        __m512 scale = _mm512_mul_ps(sv, _mm512_loadu_ps(dlane + p * 16));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    }
    const float sum = _mm512_reduce_add_ps(acc);
    return c ? sum + dot_f32(c, gsum, K / G) : sum;
}
#endif

#ifdef MW_VNNI
/* rows a thread takes at once: enough that short rows' fp16 scales are widened in one span,
   one where a row alone has plenty (a bound on the stack buffers below) */
static inline int64_t rows_per_run(int64_t groups) { return groups < 128 ? 16 : 1; }

/* One token quantized for the int8 kernels, in one allocation (free with free(t.hi)). */
typedef struct { int8_t *hi, *lo; float *dlane, *gsum; int32_t* xcorr; } qtoken;

static int quantize_token(const float* x, int64_t K, int q4_order, int64_t G, qtoken* t) {
    const int64_t groups = K / (G < 32 ? G : 32);  /* gsum entries (at most K/16) */
    t->hi = (int8_t*)malloc(2 * K + sizeof(float) * (K / 4 + groups) + sizeof(int32_t) * (K / 4));
    if (!t->hi) return 0;
    t->lo = t->hi + K;
    t->dlane = (float*)(t->lo + K);
    t->gsum = t->dlane + K / 4;
    t->xcorr = q4_order ? NULL : (int32_t*)(t->gsum + groups);
    quantize_x(x, K, q4_order, G, t->hi, t->lo, t->dlane, t->gsum, t->xcorr);
    return 1;
}
#endif

/* y[N] = x[K] @ W^T for one token with int8 dot products; returns 0 when it cannot (no VNNI,
 * switched off, or a shape it does not take), and the caller runs the fp32 kernel. */
int mw_q4_gemv_i8(const float* x, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half) {
#ifdef MW_VNNI
    qtoken t;
    if (N <= 0) return 1;  /* nothing to compute */
    if (!mw_int_acts || K <= 0 || K % 64 || !quantize_token(x, K, 1, 32, &t)) return 0;
    const int64_t nb = K / 32;
    /* runs of rows: their fp16 scales are one contiguous span, widened at once (row by row,
       converting 18 values cost a good part of a 576-wide row's work) */
    const int64_t run = rows_per_run(nb);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += run) {
        const int64_t rows = N - n0 < run ? N - n0 : run;
        float sbuf[run * nb], cbuf[run * nb];  /* unused for float32 scales */
        const float* sr = mw_scales_f32(s, half, n0 * nb, rows * nb, sbuf);
        const float* cr = c ? mw_scales_f32(c, half, n0 * nb, rows * nb, cbuf) : NULL;
        for (int64_t r = 0; r < rows; r++)
            y[n0 + r] = q4_row_i8(codes + (n0 + r) * (K / 2), sr + r * nb, cr ? cr + r * nb : NULL, K, t.hi,
                                  t.lo, t.dlane, t.gsum);
    }
    free(t.hi);
    return 1;
#else
    (void)x; (void)K; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}

int mw_q8_gemv_i8(const float* x, int64_t K, int64_t G, const int8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half) {
#ifdef MW_VNNI
    qtoken t;
    if (N <= 0) return 1;
    if (!mw_int_acts || K <= 0 || K % 64 || G <= 0 || !(G == 16 || G == 32 || G % 64 == 0) ||
        !quantize_token(x, K, 0, G, &t))
        return 0;
    const int64_t ng = K / G;
    const int64_t run = rows_per_run(ng);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += run) {
        const int64_t rows = N - n0 < run ? N - n0 : run;
        float sbuf[run * ng], cbuf[run * ng];
        const float* sr = mw_scales_f32(s, half, n0 * ng, rows * ng, sbuf);
        const float* cr = c ? mw_scales_f32(c, half, n0 * ng, rows * ng, cbuf) : NULL;
        for (int64_t r = 0; r < rows; r++)
            y[n0 + r] = q8_row_i8(codes + (n0 + r) * K, sr + r * ng, cr ? cr + r * ng : NULL, K, G, t.hi,
                                  t.lo, t.dlane, t.gsum, t.xcorr);
    }
    free(t.hi);
    return 1;
#else
    (void)x; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}

/* ------------------------------------------------------------------ 1..MW_I8_MAX_ROWS tokens
 *
 * A few tokens at once (speculative decoding's k + 1 verification rows, small decode batches),
 * each row of y bit-identical to the gemv above on that token alone, so a verified draft
 * reproduces the one-token decode. What the gemv's float arithmetic sees is kept exactly:
 * per 64- or 128-weight chunk the same int32 lane sums, the same cvt, s * dlane product and
 * fmadd into a 16-lane accumulator, chunks in the same order, then _mm512_reduce_add_ps and
 * + dot_f32(c, gsum). Integer sums are exact, so how a lane's sum is formed is free:
 *
 *   - activations as int16 a = 256 hi + lo (the gemv's two digits of the value; |a| <= 32639)
 *     and weights widened to int16 pairs, so one vpdpwssd does the work of the gemv's two
 *     vpdpbusd (hi, lo) and its shift. For the dword lane j of a chunk (weight bytes 4j..4j+3),
 *     the even bytes (4j, 4j+2) go to one word vector and the odd bytes to another, the
 *     activations laid out to match (quantize_rows), and both vpdpwssd add into lane j.
 *     q8 codes are signed words, which makes the gemv's xor/+128 correction unnecessary.
 *   - the weight codes of a chunk are loaded and unpacked once for all M tokens, and two
 *     rows share each token's activation loads.
 *
 * Per token and 128 weights that leaves 4 vpdpwssd, cvt, mul, fmadd (the gemv: 4 vpdpbusd,
 * shift, cvt, mul, fmadd plus the weight's load, 3 unpack ops and scale spread). */
#ifdef MW_VNNI
/* Tokens quantized for the row kernels. Per chunk (q4: 128 values, a 64-value tail; q8: 64),
 * the M tokens side by side: a holds token m's chunk at (chunk start * M + m * chunk size),
 * as the int16 word vectors the chunk's weight vectors meet (q4: low nibbles of the even
 * bytes, of the odd bytes, high nibbles of the even, of the odd; q4 tail and q8: even bytes,
 * odd bytes); dl holds (chunk * M + m) * 16: the 16 lane scales d / 256 the gemv loads from
 * dlane for that chunk; gsum [M][K / G] as the gemv's. */
typedef struct { int16_t* a; float *dl, *gsum; } qrows;

/* a block's 16 int32 values -> 8 even-indexed int16 (low 128 bits) and 8 odd (high 128) */
static inline __m256i evens_odds(__m512i v) {
    const __m512i perm = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(perm, v));
}

/* quantize_x's arithmetic, vectorized, for M tokens into the qrows layout: the same amax
 * (max of |x| over the block, NaN skipped), d, 1 / d, rounding (cvtps2dq: the current
 * rounding mode, as nearbyintf), clamp, int8 hi, and the same gsum sums in the same order. */
static void quantize_rows(const float* x, int64_t M, int64_t K, int q4, int64_t G, qrows* t) {
    const int64_t full = q4 ? K / 128 : 0, ng = K / G;
    const __m512 zero = _mm512_setzero_ps(), k256 = _mm512_set1_ps(256.f);
    const __m512i lmax = _mm512_set1_epi32(127), lmin = _mm512_set1_epi32(-127);
    for (int64_t m = 0; m < M; m++) {
        float* gsum = t->gsum + m * ng;
        for (int64_t b = 0; b < K / 32; b++) {
            const float* xb = x + m * K + b * 32;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            /* vmaxps returns its second operand when one is NaN: NaNs leave amax alone */
            const float amax = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), zero)));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            const __m512 vid = _mm512_set1_ps(id);
            __m512i a[2];
            int64_t sums[2];
            for (int i = 0; i < 2; i++) {
                const __m512 tv = _mm512_mul_ps(i ? x1 : x0, vid);
                const __m512i h = _mm512_cvtps_epi32(tv);
                __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(tv, _mm512_cvtepi32_ps(h)), k256));
                l = _mm512_min_epi32(_mm512_max_epi32(l, lmin), lmax);
                /* the gemv's sums take h as computed, its digits h as stored (int8) */
                sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l));
                const __m512i h8 = _mm512_srai_epi32(_mm512_slli_epi32(h, 24), 24);
                a[i] = _mm512_add_epi32(_mm512_slli_epi32(h8, 8), l);
            }
            const float unit = d / 256.f;
            group_sums(gsum, b, G, unit, sums);
            /* where the block's words and lane scales go (see qrows) */
            const __m256i p0 = evens_odds(a[0]), p1 = evens_odds(a[1]);
            const __m128 dv = _mm_set1_ps(unit);
            int64_t chunk, q, size, off[4];  /* off: even/odd words of values 0..15, of 16..31 */
            if (q4 && b < 4 * full) {
                chunk = b / 4, q = b % 4, size = 128;
                off[0] = 8 * q, off[1] = 32 + 8 * q, off[2] = 64 + 8 * q, off[3] = 96 + 8 * q;
            } else if (q4) {  /* tail: [low nibbles of both blocks | high nibbles] */
                chunk = full, q = b - 4 * full, size = 64;
                off[0] = 8 * q, off[1] = 32 + 8 * q, off[2] = 16 + 8 * q, off[3] = 48 + 8 * q;
            } else {
                chunk = b / 2, q = b % 2, size = 64;
                off[0] = 16 * q, off[1] = 32 + 16 * q, off[2] = 8 + 16 * q, off[3] = 40 + 16 * q;
            }
            int16_t* dst = t->a + chunk * (q4 ? 128 : 64) * M + m * size;
            _mm_storeu_si128((__m128i*)(dst + off[0]), _mm256_castsi256_si128(p0));
            _mm_storeu_si128((__m128i*)(dst + off[1]), _mm256_extracti128_si256(p0, 1));
            _mm_storeu_si128((__m128i*)(dst + off[2]), _mm256_castsi256_si128(p1));
            _mm_storeu_si128((__m128i*)(dst + off[3]), _mm256_extracti128_si256(p1, 1));
            float* dl = t->dl + (chunk * M + m) * 16;
            if (q4 && b < 4 * full) _mm_storeu_ps(dl + 4 * q, dv);
            else if (q4) _mm_storeu_ps(dl + 4 * q, dv), _mm_storeu_ps(dl + 8 + 4 * q, dv);
            else _mm_storeu_ps(dl + 8 * q, dv), _mm_storeu_ps(dl + 8 * q + 4, dv);
        }
    }
}

static int alloc_rows(int64_t M, int64_t K, int64_t G, qrows* t) {
    /* a: M * K words; dl: 16 a chunk of at least 64 values; gsum: K / G a token */
    const size_t abytes = (size_t)(M * K) * sizeof(int16_t);
    t->a = (int16_t*)aligned_alloc(64, (abytes + sizeof(float) * (size_t)(M * (K / 4 + K / G)) + 63) / 64 * 64);
    if (!t->a) return 0;
    t->dl = (float*)((char*)t->a + abytes);
    t->gsum = t->dl + M * (K / 4);
    return 1;
}

/* One chunk of 32 W weights (W int16 word vectors a row) for R rows and M tokens:
 * acc[r * M + m] += cvt(the chunk's lane sums) * (sv[r] * dl of token m), the gemv's float
 * arithmetic for that chunk. Token m's words start at ac + m * 32 W, its lane scales at
 * dc + m * 16. */
static inline __attribute__((always_inline)) void rows_chunk(
        const int R, const int M, const int W, __m512i w[][4], const __m512* sv,
        const int16_t* ac, const float* dc, __m512* acc) {
    for (int m = 0; m < M; m++) {
        const int16_t* am = ac + m * 32 * W;
        const __m512 dm = _mm512_loadu_ps(dc + m * 16);
        for (int r = 0; r < R; r++) {
            __m512i dot = _mm512_madd_epi16(w[r][0], _mm512_loadu_si512(am));
            for (int i = 1; i < W; i++)
                dot = _mm512_dpwssd_epi32(dot, w[r][i], _mm512_loadu_si512(am + 32 * i));
            acc[r * M + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sv[r], dm),
                                             acc[r * M + m]);
        }
    }
}

/* The row kernels of up to 4 tokens ask for their codes I8_PREFETCH bytes ahead where a row
 * has at least this many bytes. Measured from DRAM (60 matrices cycled, 2 threads, AMD EPYC
 * Zen 4), before -> after: SmolLM2's Q8_0 LM head (576-byte rows) 1.27-1.35x at 2 tokens,
 * 1.20-1.43x at 4; q4 down_proj (768-byte rows) 1.12-1.27x; q4 rows of 288 bytes (K = 576)
 * ran 0.90-1.0x with it and 8 tokens gained nothing, so those keep the code they had. */
#define ROWS_PREFETCH_MIN_BYTES 512

/* R q4 rows (codes q + r * K / 2, scales sr / cr + r * nb) against M tokens; R, M compile-time
 * constants so the R * M accumulators stay in registers. Writes y[m * N + r]. */
static inline __attribute__((always_inline)) void q4_rows_i8(
        const int R, const int M, const int PF, const uint8_t* q, const float* sr, const float* cr, int64_t K,
        const qrows* t, float* y, int64_t N) {
    const int64_t nb = K / 32, full = K / 128;
    const __m512i idx4 = _mm512_loadu_si512(LANES_16), idx2 = _mm512_loadu_si512(LANES_2);
    const __m512i nib = _mm512_set1_epi16(15);
    __m512 acc[R * M];
    for (int i = 0; i < R * M; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c++) {
        const int16_t* ac = t->a + c * 128 * M;
        const float* dc = t->dl + c * 16 * M;
        __m512i w[R][4];
        __m512 sv[R];
        for (int r = 0; r < R; r++) {
            if (PF)
                _mm_prefetch((const char*)(q + r * (K / 2) + c * 64 + I8_PREFETCH), _MM_HINT_T0);
            const __m512i raw = _mm512_loadu_si512(q + r * (K / 2) + c * 64);
            w[r][0] = _mm512_and_si512(raw, nib);
            w[r][1] = _mm512_and_si512(_mm512_srli_epi16(raw, 8), nib);
            w[r][2] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            w[r][3] = _mm512_srli_epi16(raw, 12);
            sv[r] = spread(sr + r * nb + c * 4, 4, idx4);
        }
        rows_chunk(R, M, 4, w, sv, ac, dc, acc);
    }
    if (K % 128) {  /* the gemv's 64-weight tail: [low nibbles | high nibbles] of two blocks */
        const int16_t* ac = t->a + full * 128 * M;
        const float* dc = t->dl + full * 16 * M;
        const __m256i low4 = _mm256_set1_epi8(15);
        __m512i w[R][4];
        __m512 sv[R];
        for (int r = 0; r < R; r++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + r * (K / 2) + full * 64));
            const __m512i wb = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(raw, low4)),
                _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), 1);
            w[r][0] = _mm512_and_si512(wb, _mm512_set1_epi16(255));
            w[r][1] = _mm512_srli_epi16(wb, 8);
            sv[r] = spread(sr + r * nb + full * 4, 2, idx2);
        }
        rows_chunk(R, M, 2, w, sv, ac, dc, acc);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)
            y[m * N + r] = cr ? _mm512_reduce_add_ps(acc[r * M + m]) + dot_f32(cr + r * nb, t->gsum + m * nb, nb)
                              : _mm512_reduce_add_ps(acc[r * M + m]);  /* as the gemv */
}

/* R q8 rows (codes q + r * K, scales sr / cr + r * ng, group G) against M tokens */
static inline __attribute__((always_inline)) void q8_rows_i8(
        const int R, const int M, const int PF, const int8_t* q, const float* sr, const float* cr, int64_t K,
        int64_t G, const qrows* t, float* y, int64_t N) {
    const int64_t ng = K / G;
    const __m512i idx = _mm512_loadu_si512(G == 16 ? LANES_16 : LANES_32);
    __m512 acc[R * M];
    for (int i = 0; i < R * M; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 64; p++) {
        const int16_t* ac = t->a + p * 64 * M;
        const float* dc = t->dl + p * 16 * M;
        __m512i w[R][4];
        __m512 sv[R];
        for (int r = 0; r < R; r++) {
            if (PF)
                _mm_prefetch((const char*)(q + r * K + p * 64 + I8_PREFETCH), _MM_HINT_T0);
            const __m512i raw = _mm512_loadu_si512(q + r * K + p * 64);
            w[r][0] = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);  /* even bytes, signed */
            w[r][1] = _mm512_srai_epi16(raw, 8);                        /* odd bytes */
            const float* s = sr + r * ng;
            sv[r] = G == 16 ? spread(s + p * 4, 4, idx) : G == 32 ? spread(s + p * 2, 2, idx)
                                                                 : _mm512_set1_ps(s[p * 64 / G]);
        }
        rows_chunk(R, M, 2, w, sv, ac, dc, acc);
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)
            y[m * N + r] = cr ? _mm512_reduce_add_ps(acc[r * M + m]) + dot_f32(cr + r * ng, t->gsum + m * ng, ng)
                              : _mm512_reduce_add_ps(acc[r * M + m]);
}

/* rows [0, rows) of a run: groups of ROWS_R(M) rows, then one at a time */
#define ROWS_R(M) ((M) <= 4 ? 2 : 1)
#define Q4_RUN_PF(M, PF) do { int64_t r = 0; \
        for (; r + ROWS_R(M) <= rows; r += ROWS_R(M)) \
            q4_rows_i8(ROWS_R(M), M, PF, q + r * (K / 2), sr + r * nb, cr ? cr + r * nb : NULL, K, &t, yr + r, N); \
        for (; r < rows; r++) q4_rows_i8(1, M, PF, q + r * (K / 2), sr + r * nb, cr ? cr + r * nb : NULL, K, &t, yr + r, N); \
    } while (0)
#define Q8_RUN_PF(M, PF) do { int64_t r = 0; \
        for (; r + ROWS_R(M) <= rows; r += ROWS_R(M)) \
            q8_rows_i8(ROWS_R(M), M, PF, q + r * K, sr + r * ng, cr ? cr + r * ng : NULL, K, G, &t, yr + r, N); \
        for (; r < rows; r++) q8_rows_i8(1, M, PF, q + r * K, sr + r * ng, cr ? cr + r * ng : NULL, K, G, &t, yr + r, N); \
    } while (0)
#define Q4_RUN(M) Q4_RUN_PF(M, 0)
#define Q4_RUN_AHEAD(M) Q4_RUN_PF(M, 1)
#define Q8_RUN(M) Q8_RUN_PF(M, 0)
#define Q8_RUN_AHEAD(M) Q8_RUN_PF(M, 1)
/* up to 4 tokens, where asking ahead paid (more tokens are compute-bound: code left as it was) */
#define M_CASES_AHEAD(RUN, OTHER) switch (M) { \
    case 1: RUN(1); break; case 2: RUN(2); break; case 3: RUN(3); break; case 4: RUN(4); break; \
    default: M_CASES(OTHER) }
#define M_CASES(RUN) switch (M) { \
    case 1: RUN(1); break; case 2: RUN(2); break; case 3: RUN(3); break; case 4: RUN(4); break; \
    case 5: RUN(5); break; case 6: RUN(6); break; case 7: RUN(7); break; default: RUN(8); break; }
#endif

/* y[M, N] = x[M, K] @ W^T for 1..MW_I8_MAX_ROWS tokens, each row of y bit-identical to
 * mw_q4_gemv_i8 on that token; 0 when it cannot (no VNNI, switched off, more tokens, a shape
 * the gemv does not take, out of memory), and the caller runs another kernel. */
int mw_q4_gemm_i8(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half) {
#ifdef MW_VNNI
    if (M <= 0 || N <= 0) return 1;
    if (!mw_int_acts || M > MW_I8_MAX_ROWS || K <= 0 || K % 64) return 0;
    qrows t;
    if (!alloc_rows(M, K, 32, &t)) return 0;
    quantize_rows(x, M, K, 1, 32, &t);
    const int64_t nb = K / 32, run = rows_per_run(nb) < 4 ? 4 : rows_per_run(nb);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += run) {
        const int64_t rows = N - n0 < run ? N - n0 : run;
        float sbuf[run * nb], cbuf[run * nb];  /* unused for float32 scales */
        const float* sr = mw_scales_f32(s, half, n0 * nb, rows * nb, sbuf);
        const float* cr = c ? mw_scales_f32(c, half, n0 * nb, rows * nb, cbuf) : NULL;
        const uint8_t* q = codes + n0 * (K / 2);
        float* yr = y + n0;
        if (K / 2 >= ROWS_PREFETCH_MIN_BYTES) { M_CASES_AHEAD(Q4_RUN_AHEAD, Q4_RUN) } else { M_CASES(Q4_RUN) }
    }
    free(t.a);
    return 1;
#else
    (void)x; (void)M; (void)K; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}

int mw_q8_gemm_i8(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                  const void* s, const void* c, float* y, int64_t N, int half) {
#ifdef MW_VNNI
    if (M <= 0 || N <= 0) return 1;
    if (!mw_int_acts || M > MW_I8_MAX_ROWS || K <= 0 || K % 64 || G <= 0 ||
        !(G == 16 || G == 32 || G % 64 == 0) || K % G)
        return 0;
    qrows t;
    if (!alloc_rows(M, K, G, &t)) return 0;
    quantize_rows(x, M, K, 0, G, &t);
    const int64_t ng = K / G, run = rows_per_run(ng) < 4 ? 4 : rows_per_run(ng);
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += run) {
        const int64_t rows = N - n0 < run ? N - n0 : run;
        float sbuf[run * ng], cbuf[run * ng];
        const float* sr = mw_scales_f32(s, half, n0 * ng, rows * ng, sbuf);
        const float* cr = c ? mw_scales_f32(c, half, n0 * ng, rows * ng, cbuf) : NULL;
        const int8_t* q = codes + n0 * K;
        float* yr = y + n0;
        if (K >= ROWS_PREFETCH_MIN_BYTES) { M_CASES_AHEAD(Q8_RUN_AHEAD, Q8_RUN) } else { M_CASES(Q8_RUN) }
    }
    free(t.a);
    return 1;
#else
    (void)x; (void)M; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y; (void)N; (void)half;
    return 0;
#endif
}
