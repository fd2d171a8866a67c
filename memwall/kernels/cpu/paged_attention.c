/* memwall's paged decode attention (see kernels.h for the other files): one query token per
 * sequence attends over its KV blocks where they lie in the pool, nothing gathered or copied.
 *
 * KV cache layout per layer: [num_blocks, block_size, kv_heads, head_dim] float32; token t of a
 * sequence sits in block block_table[t / block_size] at offset t % block_size.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

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
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {  /* 8 keys at a time: 8 partial-sum vectors, one reduction tree */
        for (; t + 8 <= t1; t += 8) {
            const float* kp[8];
            for (int i = 0; i < 8; i++) kp[i] = KV_AT(k_cache, t + i);
            for (int64_t j = 0; j < group; j++) {
                const float* qj = qh + j * D;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) {
                    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_loadu_ps(kp[i]));
                    for (int64_t c = 8; c < D; c += 8)
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_loadu_ps(kp[i] + c), a);
                    acc[i] = a;
                }
                _mm256_storeu_ps(scores + j * n + (t - t0), _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
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
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && D / 8 <= 12) {  /* one head's output in registers, head by head */
        const int64_t nd = D / 8;
        for (int64_t j = 0; j < group; j++) {
            __m256 acc[12];
            for (int64_t c = 0; c < nd; c++) acc[c] = _mm256_setzero_ps();
            const float* sj = scores + j * n - t0;
            for (int64_t u = t0; u < t1; u++) {
                const float* vp = KV_AT(v_cache, u);
                const __m256 p = _mm256_set1_ps(sj[u]);
                for (int64_t c = 0; c < nd; c++)
                    acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + 8 * c), acc[c]);
            }
            for (int64_t c = 0; c < nd; c++) _mm256_storeu_ps(o + j * D + 8 * c, acc[c]);
        }
        t = t1;
    }
#endif
    for (; t < t1; t++) {
        const float* vp = KV_AT(v_cache, t);
        for (int64_t j = 0; j < group; j++) axpy_f32(scores[j * n + (t - t0)], vp, o + j * D, D);
    }
#undef KV_AT
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
 * Work items are (sequence, KV head, key range): with few sequences (B = 1 has only Hkv
 * items) long contexts are split into ranges, each thread takes some, and the ranges' partial
 * softmax sums are merged (flash-decoding's split-K). Unchecked: mw_check_tables first (the
 * decode step checks once for all its layers). Returns MW_OK or MW_OUT_OF_MEMORY. */
int mw_paged_attention_run(const float* q, const float* k_cache, const float* v_cache,
                           const int64_t* block_tables, int64_t table_width,
                           const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t block_size, float scale, float* out) {
    if (B <= 0 || H <= 0 || Hkv <= 0 || D <= 0) return MW_OK;
    const int64_t group = H / Hkv;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    const int64_t threads = omp_get_max_threads();
    int64_t splits = (4 * threads + B * Hkv - 1) / (B * Hkv);  /* enough items to balance */
    const int64_t most = (max_len + 127) / 128;                 /* ranges of >= 128 keys */
    splits = splits < most ? splits : most;
    splits = splits < 1 ? 1 : splits;
    /* per item: unnormalized o [group, D], m and l [group] */
    float* part = splits > 1 ? (float*)malloc(sizeof(float) * B * Hkv * splits * group * (D + 2)) : NULL;
    if (splits > 1 && !part) splits = 1;
    int failed = 0;  /* set when a thread could not get its scratch (then out is not valid) */
    #pragma omp parallel
    {
        /* scores [group, len] and the row offsets attend_range keeps after them */
        const int64_t cap = max_len > 0 ? max_len : 1;
        float* scores = (float*)malloc(sizeof(float) * group * cap + sizeof(int64_t) * (cap + 1));
        float* ml = (float*)malloc(sizeof(float) * 2 * group);
        const int ready = scores && ml;
        if (!ready) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < B * Hkv * splits; it++) {
            if (!ready) continue;
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
        int any_failed;  /* the same for every thread: set before the loop's closing barrier */
        #pragma omp atomic read
        any_failed = failed;
        if (splits > 1 && !any_failed) {
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
    return failed ? MW_OUT_OF_MEMORY : MW_OK;
}

/* The checked entry point: mw_check_tables, then the attention. */
int mw_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                              const int64_t* block_tables, int64_t table_width,
                              const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                              float* out) {
    const int rc = mw_check_tables(block_tables, table_width, seq_lens, B, block_size, num_blocks);
    return rc != MW_OK ? rc : mw_paged_attention_run(q, k_cache, v_cache, block_tables, table_width,
                                                     seq_lens, B, H, Hkv, D, block_size, scale, out);
}
