/* memwall's fused CPU decode step: every layer of a Llama-family model for a batch of
 * sequences that each add one token, in one call from Python.
 *
 * Why: a decode step is a few hundred small operations (30 layers x ~15 ops for a 135M model).
 * Dispatched one by one from Python each costs microseconds of overhead, which for a small
 * model is more than the arithmetic. Here the whole stack runs in C; only the embedding lookup
 * and the LM head stay in torch. Parallel loops use OpenMP (torch's own libgomp, so
 * torch.set_num_threads applies).
 *
 * Compiled together with memwall/quant/native.py's kernels (q4_gemm, q8_gemm), which it calls
 * for quantized weights. Everything is float32, and each formula follows the torch path
 * (memwall/models/llama.py) so results agree to float rounding:
 *
 *   h = rms_norm(x) * w_in           q, k, v = h @ Wqkv (+ bias)     [q/k norm] rotate-half rope
 *   cache[slot] = k, v               a = softmax(q k^T * scale) v    over the sequence's blocks
 *   x = x + a @ Wo                   h = rms_norm(x) * w_post
 *   x = x + (silu(h @ Wg) * (h @ Wu)) @ Wd                           final: rms_norm(x) * w_final
 *
 * KV cache layout per layer: [num_blocks, block_size, kv_heads, head_dim] float32; token t of a
 * sequence sits in block block_table[t / block_size] at offset t % block_size. Nothing is
 * gathered or copied: attention reads the blocks where they are.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* s,
             const float* c, float* y, int64_t N);
void q8_gemm(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
             const float* s, const float* c, float* y, int64_t N);

#define MW_MAX_ROWS 16  /* rows per q4/q8 kernel call (their MAXM) */

enum { MW_F32 = 1, MW_Q4 = 2, MW_Q8 = 3 };

typedef struct {            /* one weight matrix [n, k]; y = x @ W^T (+ bias) */
    int32_t kind;           /* MW_F32 (w: float [n, k]), MW_Q4 or MW_Q8 (w: codes, s, c) */
    int32_t group;          /* MW_Q8: values per (s, c) pair */
    int64_t n, k;
    const void* w;
    const float* s;
    const float* c;
    const float* bias;      /* [n] or NULL */
} mw_part;

typedef struct {            /* a projection: up to 3 parts whose outputs sit side by side */
    int64_t nparts;
    mw_part parts[3];
} mw_proj;

typedef struct {
    const float* in_norm;   /* [hidden] */
    const float* post_norm; /* [hidden] */
    const float* q_norm;    /* [head_dim] or NULL (Qwen3 normalizes each head's q and k) */
    const float* k_norm;
    mw_proj qkv, o, gate_up, down;
    float* k_cache;
    float* v_cache;
} mw_layer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    const mw_layer* layers;
    const float* final_norm;
} mw_model;

/* ------------------------------------------------------------------ small vector helpers */

static inline float dot_f32(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    for (; i + 16 <= n; i += 16)
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    sum = _mm_cvtss_f32(h);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* y += a * x */
static inline void axpy_f32(float a, const float* x, float* y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

static void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
    float ss = dot_f32(x, x, n);
    float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* rotate-half (NeoX / HF) rope of one head in place; cos, sin: [head_dim / 2] */
static void rope(float* v, const float* cos, const float* sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i] + a * sin[i];
    }
}

/* ------------------------------------------------------------------ int8 dot products
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
 * mw_set_int8_dot(0) switches back to the exact fp32 kernels. Needs K % 64 == 0.
 */
static int mw_int8_dot = 1;
void mw_set_int8_dot(int on) { mw_int8_dot = on; }
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
        const float unit = d / 256.f;
        if (G == 16) {
            gsum[b * 2] = unit * (float)sums[0];
            gsum[b * 2 + 1] = unit * (float)sums[1];
        } else if (G == 32) {
            gsum[b] = unit * (float)(sums[0] + sums[1]);
        } else {  /* G % 64 == 0: several blocks a group */
            if ((b * 32) % G == 0) gsum[b * 32 / G] = 0.f;
            gsum[b * 32 / G] += unit * (float)(sums[0] + sums[1]);
        }
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
    return _mm512_reduce_add_ps(acc) + dot_f32(c, gsum, K / 32);
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
        __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes + p * 64), flip);
        __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(hi + p * 64));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dh, 8), w, _mm512_loadu_si512(lo + p * 64));
        dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(xcorr + p * 16));
        __m512 sv = G == 16 ? spread(s + p * 4, 4, idx) : G == 32 ? spread(s + p * 2, 2, idx)
                                                                 : _mm512_set1_ps(s[p * 64 / G]);
        __m512 scale = _mm512_mul_ps(sv, _mm512_loadu_ps(dlane + p * 16));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    }
    return _mm512_reduce_add_ps(acc) + dot_f32(c, gsum, K / G);
}
#endif

#ifdef MW_VNNI
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
int mw_q4_gemv_i8(const float* x, int64_t K, const uint8_t* codes, const float* s,
                  const float* c, float* y, int64_t N) {
#ifdef MW_VNNI
    qtoken t;
    if (!mw_int8_dot || K % 64 || !quantize_token(x, K, 1, 32, &t)) return 0;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        y[n] = q4_row_i8(codes + n * (K / 2), s + n * (K / 32), c + n * (K / 32), K, t.hi, t.lo,
                         t.dlane, t.gsum);
    free(t.hi);
    return 1;
#else
    (void)x; (void)K; (void)codes; (void)s; (void)c; (void)y; (void)N;
    return 0;
#endif
}

int mw_q8_gemv_i8(const float* x, int64_t K, int64_t G, const int8_t* codes, const float* s,
                  const float* c, float* y, int64_t N) {
#ifdef MW_VNNI
    qtoken t;
    if (!mw_int8_dot || K % 64 || !(G == 16 || G == 32 || G % 64 == 0) ||
        !quantize_token(x, K, 0, G, &t))
        return 0;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        y[n] = q8_row_i8(codes + n * K, s + n * (K / G), c + n * (K / G), K, G, t.hi, t.lo,
                         t.dlane, t.gsum, t.xcorr);
    free(t.hi);
    return 1;
#else
    (void)x; (void)K; (void)G; (void)codes; (void)s; (void)c; (void)y; (void)N;
    return 0;
#endif
}

/* ------------------------------------------------------------------ projections */

static void f32_gemm(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N,
                     int64_t ldy) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = dot_f32(x + m * K, w + n * K, K);
}

/* y[:M, :p->n] (row stride ldy) = x[:M] @ W^T + bias */
static void part_apply(const mw_part* p, const float* x, int64_t M, float* y, int64_t ldy,
                       float* tmp) {
    if (p->kind == MW_F32) {
        f32_gemm(x, M, p->k, (const float*)p->w, y, p->n, ldy);
    } else {
        for (int64_t m0 = 0; m0 < M; m0 += MW_MAX_ROWS) {
            int64_t rows = M - m0 < MW_MAX_ROWS ? M - m0 : MW_MAX_ROWS;
            /* the kernels write rows of exactly n values: straight into y when that is y's
               layout (one row, or one part filling whole rows), else through tmp */
            int direct = rows == 1 || ldy == p->n;
            float* out = direct ? y + m0 * ldy : tmp;
            if (rows == 1 && p->kind == MW_Q4 &&
                mw_q4_gemv_i8(x + m0 * p->k, p->k, (const uint8_t*)p->w, p->s, p->c, out, p->n))
                continue;
            if (rows == 1 && p->kind == MW_Q8 &&
                mw_q8_gemv_i8(x + m0 * p->k, p->k, p->group, (const int8_t*)p->w, p->s, p->c, out, p->n))
                continue;
            if (p->kind == MW_Q4)
                q4_gemm(x + m0 * p->k, rows, p->k, (const uint8_t*)p->w, p->s, p->c, out, p->n);
            else
                q8_gemm(x + m0 * p->k, rows, p->k, p->group, (const int8_t*)p->w, p->s, p->c,
                        out, p->n);
            if (!direct)
                for (int64_t r = 0; r < rows; r++)
                    memcpy(y + (m0 + r) * ldy, tmp + r * p->n, p->n * sizeof(float));
        }
    }
    if (p->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < p->n; i++) y[m * ldy + i] += p->bias[i];
}

static void proj_apply(const mw_proj* proj, const float* x, int64_t M, float* y, int64_t ldy,
                       float* tmp) {
    int64_t col = 0;
    for (int64_t i = 0; i < proj->nparts; i++) {
        part_apply(&proj->parts[i], x, M, y + col, ldy, tmp);
        col += proj->parts[i].n;
    }
}

static int64_t proj_out(const mw_proj* proj) {
    int64_t n = 0;
    for (int64_t i = 0; i < proj->nparts; i++) n += proj->parts[i].n;
    return n;
}

/* ------------------------------------------------------------------ paged attention */

/* exp over n floats in place, and their sum. AVX-512: Cephes' expf polynomial (relative error
 * ~2e-7, as expf) with the power of two applied by vscalefps; elsewhere libm's expf. */
#if defined(__AVX512F__)
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                      _mm512_set1_ps(-87.3365447505531f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(y, fx);
}
#endif

/* v[i] = exp(v[i] - shift); returns the sum */
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
#endif
    for (; i < n; i++) { v[i] = expf(v[i] - shift); sum += v[i]; }
    return sum;
}

#if defined(__AVX512F__)
/* r[i] = sum of the 16 lanes of v[i]: a transpose-and-add tree, ~3 ops a vector where a
 * horizontal reduction of each costs ~8 */
static inline __m512 hsum16(const __m512* v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: [a, b, c, d] partial sums */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* across 128-bit lanes */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

/* Attention of the `group` query heads that share KV head h over tokens t0..t1 of one
 * sequence: o [group, D] = sum_t exp(s_t - m) v_t, unnormalized, with m [group] the max score
 * and l [group] the sum of the weights (so ranges can be merged). scores: [group, t1 - t0]. */
static void attend_range(const float* qh, int64_t group, int64_t D, const float* k_cache,
                         const float* v_cache, const int64_t* table, int64_t block_size,
                         int64_t Hkv, int64_t h, int64_t t0, int64_t t1, float scale,
                         float* scores, float* o, float* m, float* l) {
    const int64_t n = t1 - t0;
    /* where each token's K/V row starts, walked block by block: an integer division per
       token (t / block_size with a run-time block size) cost more than its dot product */
    int64_t* rows = (int64_t*)(scores + ((group * n + 1) & ~(int64_t)1));  /* caller scratch: n more int64 */
    {
        int64_t blk = t0 / block_size, off = t0 % block_size;
        for (int64_t i = 0; i < n; i++) {
            rows[i] = ((table[blk] * block_size + off) * Hkv + h) * D;
            if (++off == block_size) { off = 0; blk++; }
        }
    }
#define KV_AT(cache, t) ((cache) + rows[(t) - t0])
    int64_t t = t0;
#if defined(__AVX512F__)
    if (D % 16 == 0) {  /* 16 keys at a time: 16 partial-sum vectors, one reduction tree */
        const int64_t nd = D / 16;
        for (int64_t i = t; i < t + 16 && i < t1; i++)
            for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(KV_AT(k_cache, i) + d), _MM_HINT_T0);
        for (; t + 16 <= t1; t += 16) {
            const float* kp[16];
            for (int i = 0; i < 16; i++) kp[i] = KV_AT(k_cache, t + i);
            /* the next 16 keys, a cache line at a time: blocks are scattered across the
               pool, so the hardware prefetcher rarely sees them coming */
            for (int64_t i = t + 16; i < t + 32 && i < t1; i++)
                for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(KV_AT(k_cache, i) + d), _MM_HINT_T0);
            for (int64_t j = 0; j < group; j++) {
                const float* qj = qh + j * D;
                __m512 acc[16];
                for (int i = 0; i < 16; i++) {
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), _mm512_loadu_ps(kp[i]));
                    for (int64_t c = 1; c < nd; c++)
                        a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), _mm512_loadu_ps(kp[i] + 16 * c), a);
                    acc[i] = a;
                }
                _mm512_storeu_ps(scores + j * n + (t - t0), _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
            }
        }
    }
#endif
    for (; t < t1; t++) {
        const float* kp = KV_AT(k_cache, t);
        for (int64_t j = 0; j < group; j++) scores[j * n + (t - t0)] = dot_f32(qh + j * D, kp, D) * scale;
    }
    for (int64_t j = 0; j < group; j++) {
        float* sj = scores + j * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) mx = sj[i] > mx ? sj[i] : mx;
        m[j] = mx;
        l[j] = exp_shift_sum(sj, n, mx);
    }
    memset(o, 0, sizeof(float) * group * D);
    t = t0;
#if defined(__AVX512F__)
    if (D % 16 == 0 && group * (D / 16) <= 32) {  /* the group's outputs stay in registers */
        const int64_t nd = D / 16;
        __m512 acc[32];
        for (int64_t i = 0; i < group * nd; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t i = t; i < t + 8 && i < t1; i++)
            for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(KV_AT(v_cache, i) + d), _MM_HINT_T0);
        for (; t < t1; t++) {
            const float* vp = KV_AT(v_cache, t);
            if (t + 8 < t1)
                for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(KV_AT(v_cache, t + 8) + d), _MM_HINT_T0);
            for (int64_t c = 0; c < nd; c++) {
                const __m512 vc = _mm512_loadu_ps(vp + 16 * c);
                for (int64_t j = 0; j < group; j++)
                    acc[j * nd + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * n + (t - t0)]), vc, acc[j * nd + c]);
            }
        }
        for (int64_t i = 0; i < group * nd; i++) _mm512_storeu_ps(o + 16 * i, acc[i]);
    }
#endif
    for (; t < t1; t++) {
        const float* vp = KV_AT(v_cache, t);
        for (int64_t j = 0; j < group; j++) axpy_f32(scores[j * n + (t - t0)], vp, o + j * D, D);
    }
#undef KV_AT
}

/* One query token per sequence. q: [B, H, D]; out: [B, H, D]; block_tables: [B, table_width];
 * seq_lens: [B] (keys 0..len-1 are attended, including the token just written). The `group`
 * query heads that share a KV head are done together, so each key and value is read once.
 * Work items are (sequence, KV head, key range): with few sequences (B = 1 has only Hkv
 * items) long contexts are split into ranges, each thread takes some, and the ranges' partial
 * softmax sums are merged (flash-decoding's split-K). */
void mw_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                               const int64_t* block_tables, int64_t table_width,
                               const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                               int64_t D, int64_t block_size, float scale, float* out) {
    const int64_t group = H / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const int64_t threads = omp_get_max_threads();
    int64_t splits = (4 * threads + B * Hkv - 1) / (B * Hkv);  /* enough items to balance */
    const int64_t most = (max_len + 127) / 128;                 /* ranges of >= 128 keys */
    splits = splits < most ? splits : most;
    splits = splits < 1 ? 1 : splits;
    const int64_t items = B * Hkv * splits;
    /* per item: unnormalized o [group, D], m and l [group] */
    float* part = splits > 1 ? (float*)malloc(sizeof(float) * items * group * (D + 2)) : NULL;
    if (splits > 1 && !part) splits = 1;
    #pragma omp parallel
    {
        /* scores [group, len] and the row offsets attend_range keeps after them */
        const int64_t cap = max_len > 0 ? max_len : 1;
        float* scores = (float*)malloc(sizeof(float) * group * cap + sizeof(int64_t) * (cap + 1));
        float* ml = (float*)malloc(sizeof(float) * 2 * group);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < B * Hkv * splits; it++) {
            const int64_t b = it / (Hkv * splits), h = (it / splits) % Hkv, sp = it % splits;
            const int64_t len = seq_lens[b], chunk = (len + splits - 1) / splits;
            const int64_t t0 = sp * chunk, t1 = t0 + chunk < len ? t0 + chunk : len;
            const int64_t* table = block_tables + b * table_width;
            const float* qh = q + (b * H + h * group) * D;
            if (splits == 1) {
                float* oh = out + (b * H + h * group) * D;
                attend_range(qh, group, D, k_cache, v_cache, table, block_size, Hkv, h, 0, len,
                             scale, scores, oh, ml, ml + group);
                for (int64_t j = 0; j < group; j++) {
                    const float inv = 1.f / ml[group + j];
                    for (int64_t d = 0; d < D; d++) oh[j * D + d] *= inv;
                }
            } else {
                float* o = part + it * group * (D + 2);
                float* m = o + group * D;
                if (t0 >= t1) {  /* an empty range (short sequence): contributes nothing */
                    for (int64_t j = 0; j < group; j++) { m[j] = -INFINITY; m[group + j] = 0.f; }
                    continue;
                }
                attend_range(qh, group, D, k_cache, v_cache, table, block_size, Hkv, h, t0, t1,
                             scale, scores, o, m, m + group);
            }
        }
        free(scores);
        free(ml);
        if (splits > 1) {
            #pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * Hkv; bh++) {
                const int64_t b = bh / Hkv, h = bh % Hkv;
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
    free(part);
}

/* ------------------------------------------------------------------ the whole step */

/* Optional stage timers (benchmarks/cpu_profile.py): seconds spent per stage, summed over
 * steps while profiling is on. Stages: 0 norms, 1 qkv, 2 rope + cache write, 3 attention,
 * 4 o_proj, 5 gate_up, 6 silu*mul, 7 down. */
#include <time.h>
#define MW_STAGES 8
static int mw_profiling = 0;
static double mw_stage_seconds[MW_STAGES];
void mw_profile(int on, double* out) {
    if (out) memcpy(out, mw_stage_seconds, sizeof(mw_stage_seconds));
    memset(mw_stage_seconds, 0, sizeof(mw_stage_seconds));
    mw_profiling = on;
}
static inline double mw_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define STAGE(i, ...) do { double t0_ = mw_profiling ? mw_now() : 0.; __VA_ARGS__; \
    if (mw_profiling) mw_stage_seconds[i] += mw_now() - t0_; } while (0)

/* q (its own buffer), k and v (in place in the qkv rows) get q/k norm and rope; k, v go to
 * their cache slots */
static void rope_and_write(const mw_model* m, const mw_layer* L, float* qkv, float* qbuf,
                           int64_t B, const int64_t* positions, const int64_t* slots,
                           const float* rope_cos, const float* rope_sin) {
    const int64_t H = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim;
    const int64_t q_size = H * D, kv_size = Hkv * D, half = D / 2;
    for (int64_t b = 0; b < B; b++) {
        float* row = qkv + b * (q_size + 2 * kv_size);
        float* q = qbuf + b * q_size;
        float* k = row + q_size;
        float* v = row + q_size + kv_size;
        memcpy(q, row, sizeof(float) * q_size);
        const float* cs = rope_cos + positions[b] * half;
        const float* sn = rope_sin + positions[b] * half;
        for (int64_t i = 0; i < H; i++) {
            if (L->q_norm) rms_norm(q + i * D, L->q_norm, q + i * D, D, m->eps);
            rope(q + i * D, cs, sn, D);
        }
        for (int64_t i = 0; i < Hkv; i++) {
            if (L->k_norm) rms_norm(k + i * D, L->k_norm, k + i * D, D, m->eps);
            rope(k + i * D, cs, sn, D);
        }
        memcpy(L->k_cache + slots[b] * kv_size, k, sizeof(float) * kv_size);
        memcpy(L->v_cache + slots[b] * kv_size, v, sizeof(float) * kv_size);
    }
}

/* act[b, i] = silu(gate[b, i]) * up[b, i], gate_up rows [B, gate | up] */
static void silu_mul(const float* gate_up, float* act, int64_t B, int64_t inter) {
    for (int64_t b = 0; b < B; b++) {
        const float* g = gate_up + b * 2 * inter;
        float* a = act + b * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= inter; i += 16) {
            __m512 gi = _mm512_loadu_ps(g + i);
            __m512 sig = _mm512_div_ps(gi, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gi))));
            _mm512_storeu_ps(a + i, _mm512_mul_ps(sig, _mm512_loadu_ps(g + inter + i)));
        }
#endif
        for (; i < inter; i++) a[i] = g[i] / (1.f + expf(-g[i])) * g[inter + i];
    }
}

/* x: [B, hidden], in: the token embeddings; out: the final-normed hidden states.
 * positions, slots, seq_lens: [B]; block_tables: [B, table_width];
 * rope_cos, rope_sin: [max_positions, head_dim / 2]. Returns 0, or -1 when out of memory. */
int mw_decode_step(const mw_model* m, float* x, int64_t B, const int64_t* positions,
                   const int64_t* slots, const int64_t* seq_lens, const int64_t* block_tables,
                   int64_t table_width, const float* rope_cos, const float* rope_sin) {
    const int64_t Hd = m->hidden, H = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim;
    const int64_t q_size = H * D, kv_size = Hkv * D;
    int64_t widest = Hd;  /* the widest projection output (scratch row size) */
    for (int64_t l = 0; l < m->n_layers; l++) {
        const mw_layer* L = &m->layers[l];
        int64_t w[4] = {proj_out(&L->qkv), proj_out(&L->o), proj_out(&L->gate_up), proj_out(&L->down)};
        for (int i = 0; i < 4; i++) widest = w[i] > widest ? w[i] : widest;
    }
    const int64_t inter = m->inter, qkv_size = q_size + 2 * kv_size;
    float* h = (float*)malloc(sizeof(float) * B * (Hd > q_size ? Hd : q_size));
    float* big = (float*)malloc(sizeof(float) * B * widest);     /* qkv or gate_up rows */
    float* attn = (float*)malloc(sizeof(float) * B * q_size);
    float* act = (float*)malloc(sizeof(float) * B * (inter > Hd ? inter : Hd));
    float* tmp = (float*)malloc(sizeof(float) * MW_MAX_ROWS * widest);
    float* qbuf = (float*)malloc(sizeof(float) * B * q_size);
    if (!h || !big || !attn || !act || !tmp || !qbuf) {
        free(h); free(big); free(attn); free(act); free(tmp); free(qbuf);
        return -1;
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        const mw_layer* L = &m->layers[l];
        STAGE(0, for (int64_t b = 0; b < B; b++) rms_norm(x + b * Hd, L->in_norm, h + b * Hd, Hd, m->eps));
        STAGE(1, proj_apply(&L->qkv, h, B, big, qkv_size, tmp));  /* [B, q | k | v] */
        STAGE(2, rope_and_write(m, L, big, qbuf, B, positions, slots, rope_cos, rope_sin));
        STAGE(3, mw_paged_decode_attention(qbuf, L->k_cache, L->v_cache, block_tables, table_width,
                                           seq_lens, B, H, Hkv, D, m->block_size, m->scale, attn));
        STAGE(4, proj_apply(&L->o, attn, B, act, Hd, tmp));
        STAGE(0, for (int64_t i = 0; i < B * Hd; i++) x[i] += act[i];
                 for (int64_t b = 0; b < B; b++) rms_norm(x + b * Hd, L->post_norm, h + b * Hd, Hd, m->eps));
        STAGE(5, proj_apply(&L->gate_up, h, B, big, 2 * inter, tmp));  /* [B, gate | up] */
        STAGE(6, silu_mul(big, act, B, inter));
        STAGE(7, proj_apply(&L->down, act, B, h, Hd, tmp));
        STAGE(0, for (int64_t i = 0; i < B * Hd; i++) x[i] += h[i]);
    }
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * Hd, m->final_norm, x + b * Hd, Hd, m->eps);
    free(h); free(big); free(attn); free(act); free(tmp); free(qbuf);
    return 0;
}
