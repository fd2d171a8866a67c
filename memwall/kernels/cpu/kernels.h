/* memwall's CPU kernels: what the .c files beside this one export (to each other, and through
 * ctypes to Python: memwall/kernels/cpu/build.py declares the same signatures), and the small
 * vector helpers they share. build.py compiles them into one library:
 *
 *     quant_gemm.c       fp32 matmuls on q4/q8 block-quantized weights, prefill tiles, dequantize
 *     int_gemm.c         q4/q8 matmuls with int16 activations for any number of tokens
 *                        (AVX2 vpmaddwd, AVX-512 VNNI vpdpwssd, plain C)
 *     int8_dot.c         q4/q8 matmuls of 1..MW_I8_MAX_ROWS tokens with int8-digit
 *                        activations (AVX512-VNNI)
 *     int8_tiles.c       prefill matmuls on K-quant weights with int8 activations (AVX2)
 *     packed_gemm.c      q4/q8 matmuls of any number of tokens on weights packed into
 *                        16-row panels at load, int8-digit activations (AVX-512 VNNI)
 *     panel_gemm.c       q4/q8 matmuls of more than MW_I8_MAX_ROWS tokens with int16
 *                        activations, 16 output rows across the lanes (AVX-512 VNNI)
 *     paged_attention.c  decode and prefill attention over paged KV blocks, read where they lie
 *     decode.c           the fused decode step: all layers of a Llama-family model in one call
 *     elementwise.c      RMSNorm (after the residual add), gated activations, rotary
 *                        embeddings: the forward pass's row-wise ops outside decode.c
 *     split_bf16.c       hi + lo bf16 operands for split-bf16 (AMX) prefill matmuls (amx.py)
 *     shm_comm.c         all-reduce, all-gather and barrier of tensor-parallel ranks on one
 *                        host, through shared memory (memwall/distributed/shm_comm.py)
 *     gguf_codes.c       GGUF blocks (Q4_K, Q6_K, Q5_0/Q5_1) -> the layouts' codes (and the
 *                        K-quants' 6-bit scales), at load
 *
 * Each file picks its code path from the compiler's target macros (__AVX512F__, __AVX2__ with
 * __FMA__, or plain C), so one source builds for every CPU. Sizes: every function takes zero
 * tokens, rows or outputs (and does nothing); the layout rules the arithmetic needs (K a
 * multiple of 32 for q4, a q8 group a multiple of 16, ...) are checked in Python before a call
 * (memwall/kernels/cpu/quant_ops.py, layout.py, decode.py).
 */
#ifndef MEMWALL_KERNELS_H
#define MEMWALL_KERNELS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MW_MAX_ROWS 16  /* tokens a q4/q8 row kernel takes at once; more go MW_MAX_ROWS at a time */
#define MW_TILE 8       /* tokens int_gemm.c's and int8_tiles.c's tile kernels hold accumulators for */

/* tokens in the tile that starts at token m0 of M: MW_TILE, or what is left */
static inline int64_t mw_tile_rows(int64_t M, int64_t m0) { return M - m0 < MW_TILE ? M - m0 : MW_TILE; }

/* switch cases 1..MW_TILE calling fn(TM, ...) with TM a compile-time constant (the tile
 * kernels keep TM accumulators in registers); anything else takes MW_TILE */
#define MW_TM_CASES(fn, ...) \
    case 1: fn(1, __VA_ARGS__); break; case 2: fn(2, __VA_ARGS__); break; \
    case 3: fn(3, __VA_ARGS__); break; case 4: fn(4, __VA_ARGS__); break; \
    case 5: fn(5, __VA_ARGS__); break; case 6: fn(6, __VA_ARGS__); break; \
    case 7: fn(7, __VA_ARGS__); break; default: fn(8, __VA_ARGS__); break;

/* What the checked entry points return (Python turns each into an error that says which). */
enum {
    MW_OK = 0,
    MW_OUT_OF_MEMORY = -1,
    MW_BAD_SEQ_LEN = -2,    /* a sequence length outside 1..table_width * block_size */
    MW_BAD_BLOCK = -3,      /* a block id a sequence reads outside 0..num_blocks - 1 */
    MW_BAD_POSITION = -4,   /* a position outside the rotary table */
    MW_BAD_SLOT = -5,       /* a cache slot outside 0..num_blocks * block_size - 1 */
    MW_BAD_LORA_SLOT = -6,  /* a token's LoRA slot outside -1..n_slots - 1 (decode.c) */
    MW_COMM_TIMEOUT = -7,   /* another tensor-parallel rank never arrived (shm_comm.c) */
    MW_COMM_ABORTED = -8,   /* the ranks' group was aborted: a rank timed out or failed */
    MW_UNSUPPORTED = -9,    /* this build has no kernel for the shape (the caller's reference runs) */
};

/* quant_gemm.c: y [M, N] = x [M, K] @ W^T with W = s * q + c per block of K (row-major).
 * Every q4/q8 entry point below takes s and c as float32, or float16 when half is 1. */
void q4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
             const void* c, float* y, int64_t N, int half);
void q8_gemm(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
             const void* s, const void* c, float* y, int64_t N, int half);
/* the batch size from which q4_gemm/q8_gemm take the fp32 tiles (AVX-512 builds), else 0 */
int64_t mw_tiles_from(void);
int q4_gemm_tiles(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half);
int q8_gemm_tiles(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                  const void* s, const void* c, float* y, int64_t N, int half);
void q4_dequant(const uint8_t* codes, const void* s, const void* c, float* w, int64_t N,
                int64_t K, int half);
void q8_dequant(const int8_t* codes, const void* s, const void* c, float* w, int64_t N,
                int64_t K, int64_t G, int half);

/* int_gemm.c: any M; 0 when it cannot (switched off, a shape it does not take) */
extern int mw_int_acts;  /* 1: q4/q8 matmuls quantize activations; 0: the exact fp32 kernels */
void mw_set_int_acts(int on);
int mw_int_acts_on(void);
int mw_int_gemm_isa(void);  /* 3 VNNI, 2 AVX2, 1 plain C */
int mw_q4_gemm_i16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half);
int mw_q8_gemm_i16(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half);

/* int8_tiles.c: more than MW_I8T_MIN_TOKENS tokens (prefill; decode batches stay on the
 * int16 / int8-digit kernels) on two-level tables with 256-value superblocks; 0 when it cannot */
#define MW_I8T_MIN_TOKENS MW_MAX_ROWS
void mw_set_int8_tiles(int mode);  /* 0 off, 1 K-quants (default), 2 also Q4_0 / Q4_1 */
int mw_int8_tiles_on(void);
int mw_int8_tiles_fit(int is_q4, int64_t K, int64_t G, int half);
int mw_q4_gemm_i8t(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half);
int mw_q8_gemm_i8t(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half);

/* int8_dot.c: one token; 0 when it cannot (no VNNI, switched off, a shape it does not take) */
int mw_q4_gemv_i8(const float* x, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half);
int mw_q8_gemv_i8(const float* x, int64_t K, int64_t G, const int8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half);
int mw_int8_dot_available(void);
/* 1..MW_I8_MAX_ROWS tokens, y [M, N]: each row bit-identical to the gemv above on that token
 * alone (speculative verification reproduces one-token decode); 0 when it cannot, as above */
#define MW_I8_MAX_ROWS 8
int mw_q4_gemm_i8(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                  const void* c, float* y, int64_t N, int half);
int mw_q8_gemm_i8(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                  const void* s, const void* c, float* y, int64_t N, int half);

/* panel_gemm.c: more than MW_I8_MAX_ROWS tokens on AVX-512 VNNI builds (int16 activations,
 * a scale per 32 values); 0 when it cannot (no VNNI, integer activations off, K not a multiple
 * of 32, out of memory) */
int mw_panel_available(void);
int mw_q4_gemm_p16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, float* y, int64_t N, int half);
int mw_q8_gemm_p16(const float* x, int64_t M, int64_t K, int64_t G, const int8_t* codes,
                   const void* s, const void* c, float* y, int64_t N, int half);

/* packed_gemm.c: q4/q8 weights (32-value groups, or Q6_K's 16; N a multiple of 16) packed
 * into 16-row panels in place (memwall/kernels/cpu/panels.py packs them where
 * mw_packed_available()); flags say the format. y [M, N] with row stride ldy; 0 when it cannot
 * (no AVX-512 VNNI, K not a multiple of 32 or, with two-level tables, of 256, N not a multiple
 * of 16) */
#define MW_PK_Q8 1       /* int8 codes (stored + 128); else q4 nibbles */
#define MW_PK_HALF 2     /* float16 scale and offset tables; else float32 */
#define MW_PK_OFFSETS 4  /* an offset table c; else all offsets are zero (c not read) */
#define MW_PK_TWO_LEVEL 8  /* two-level tables, 8 sub-values a superblock (Q4_K, Q5_K) */
#define MW_PK_G16 16       /* q8 in 16-value groups, two-level tables with 16 sub-values a
                              superblock and no offsets (Q6_K) */
int mw_packed_available(void);
int mw_packed_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                   const void* c, int flags, float* y, int64_t N, int64_t ldy);
/* panel_gemm.c's int16 panels on a packed weight (what mw_packed_gemm runs for more than
 * MW_MAX_ROWS tokens); 0 when it cannot, as mw_q4_gemm_p16 */
int mw_packed_gemm_p16(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* s,
                       const void* c, int flags, float* y, int64_t N, int64_t ldy);
void mw_packed_rows(const uint8_t* codes, const void* s, const void* c, int64_t K, int flags,
                    const int64_t* ids, int64_t T, float* out);

#if defined(__AVX512F__)
/* A packed weight's 16 scales (or offsets) of panel p, group g (ng groups a row: the 32-value
 * blocks, or 16-value groups with MW_PK_G16) as float: FMT 0 float32, 1 float16 (16 entries a
 * group), 2 and 3 two-level: per panel and superblock of E groups (E 8, or 16 for FMT 3), 16
 * float32 d then E x 16 int8 sub-values, entry = d * sub (layout.py's rounding) */
static inline __m512 mw_packed_table(const void* t, int64_t p, int64_t g, int64_t ng, int FMT) {
    if (FMT >= 2) {
        const int64_t E = FMT == 3 ? 16 : 8;
        const uint8_t* sb = (const uint8_t*)t + (p * (ng / E) + g / E) * 16 * (4 + E);
        const __m128i sub = _mm_loadu_si128((const __m128i*)(sb + 64 + 16 * (g % E)));
        return _mm512_mul_ps(_mm512_loadu_ps((const float*)sb), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)));
    }
    const int64_t e = (p * ng + g) * 16;
    return FMT ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)t + e)))
               : _mm512_loadu_ps((const float*)t + e);
}
/* its format number from the flags */
static inline int mw_packed_fmt(int flags) {
    return flags & MW_PK_G16 ? 3 : flags & MW_PK_TWO_LEVEL ? 2 : (flags & MW_PK_HALF ? 1 : 0);
}
#endif

/* elementwise.c: rows of float32, each computed alone (see the file) */
void mw_rms_norm(const float* x, const float* residual, const float* w, float* out,
                 float* sum_out, int64_t rows, int64_t n, float eps);
void mw_gated_act(const float* gu, int64_t rows, int64_t inter, int act, float* out);
int mw_rope(float* x, int64_t ld, const int64_t* positions, int64_t rows, int64_t heads,
            int64_t head_dim, const float* cos, const float* sin, int64_t max_positions);

/* gguf_codes.c: n blocks of `stride` bytes -> their codes (memwall/quant/gguf_repack.py) */
void mw_gguf_q4_k_codes(const uint8_t* blocks, int64_t n, int64_t stride, uint8_t* out);
void mw_gguf_q6_k_codes(const uint8_t* blocks, int64_t n, int64_t stride, int8_t* out);
void mw_gguf_q5_codes(const uint8_t* blocks, int64_t n, int64_t stride, int64_t qh_at,
                      int64_t qs_at, int bias, int8_t* out);
void mw_gguf_k_scales(const uint8_t* blocks, int64_t n, int64_t stride, int8_t* scales,
                      int8_t* mins);

/* split_bf16.c: a = hi + lo, hi = bf16(a) (nearest even), lo = a - hi, both as float32 */
void mw_split_bf16(const float* x, int64_t n, float* hi, float* lo);
void mw_q4_dequant_split(const uint8_t* codes, const void* s, const void* c, float* hi,
                         float* lo, int64_t N, int64_t K, int half);
void mw_q8_dequant_split(const int8_t* codes, const void* s, const void* c, float* hi,
                         float* lo, int64_t N, int64_t K, int64_t G, int half);

/* paged_attention.c: KV caches [num_blocks, block_size, kv_heads, head_dim] in one of these
 * element types (memwall/attention/kv_quant.py); MW_KV_I8 has a float scale per token, KV head
 * and MW_KV_GROUP values, scales [num_blocks, block_size, kv_heads, ceil(D / MW_KV_GROUP)],
 * value = scale * code. */
enum { MW_KV_F32 = 0, MW_KV_F16 = 1, MW_KV_BF16 = 2, MW_KV_I8 = 3, MW_KV_FP8 = 4 };
#define MW_KV_GROUP 16
int mw_check_tables(const int64_t* block_tables, int64_t table_width, const int64_t* seq_lens,
                    int64_t B, int64_t block_size, int64_t num_blocks);
int mw_paged_attention_run(const float* q, const void* k_cache, const void* v_cache,
                           const float* k_scales, const float* v_scales, int kv_type,
                           const int64_t* block_tables, int64_t table_width,
                           const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t block_size, float scale, int64_t window,
                           float* out);
int mw_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache,
                              const int64_t* block_tables, int64_t table_width,
                              const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                              float* out);
int mw_paged_decode_attention_kv(const float* q, const void* k_cache, const void* v_cache,
                                 const float* k_scales, const float* v_scales, int kv_type,
                                 const int64_t* block_tables, int64_t table_width,
                                 const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv,
                                 int64_t D, int64_t block_size, int64_t num_blocks, float scale,
                                 int64_t window, float* out);
/* one sequence's prefill chunk q [Q, H, D] (positions seq_len - Q .. seq_len - 1, its K/V
 * already written) attending causally over its blocks (table [table_width]; window > 0: each
 * query its last `window` keys) -> out [Q, H, D]; MW_UNSUPPORTED where the build has no
 * kernel for D (mw_prefill_attention_available), else as mw_paged_decode_attention_kv */
int mw_prefill_attention_available(int64_t D);
int mw_paged_prefill_attention(const float* q, const void* k_cache, const void* v_cache,
                               const float* k_scales, const float* v_scales, int kv_type,
                               const int64_t* table, int64_t table_width, int64_t seq_len,
                               int64_t Q, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                               int64_t num_blocks, float scale, int64_t window, float* out);
/* x [n, Hkv, D] float -> cache rows slots[0..n-1] in kv_type (int8: scales too); MW_BAD_SLOT
 * for a slot outside 0..num_slots - 1 (nothing written) */
int mw_kv_write(const float* x, int64_t n, const int64_t* slots, int64_t num_slots, int64_t Hkv,
                int64_t D, int kv_type, void* cache, float* scales);

/* shm_comm.c: collectives of the tensor-parallel ranks of one host over a shared-memory
 * segment (layout and ordering argument at the top of shm_comm.c). The parent sizes the
 * segment with mw_shm_bytes and writes its header with mw_shm_init; each rank fills its
 * mw_shm_comm with mw_shm_attach (0, or 1: not a segment mw_shm_init made; 2: made for
 * another world size). Every rank makes the same calls with the same sizes. The collectives
 * return MW_OK, MW_COMM_TIMEOUT (this rank gave up waiting and aborted the group) or
 * MW_COMM_ABORTED (the group was aborted before or during the call). */
typedef struct {
    void* base;          /* the mapped segment */
    int64_t rank, world;
    int64_t capacity;    /* floats per slot, from the segment's header */
    int64_t seq;         /* synchronisation rounds this rank has entered (private) */
    double timeout_s;    /* the longest wait for another rank; <= 0: no limit */
} mw_shm_comm;
/* an in-place sum over ranks, as C callers (decode.c) take it: fn(ctx, buf, n) */
typedef int (*mw_allreduce_fn)(void* ctx, float* buf, int64_t n);
int64_t mw_shm_bytes(int64_t world, int64_t capacity);
void mw_shm_init(void* base, int64_t world, int64_t capacity);
int mw_shm_attach(mw_shm_comm* c, void* base, int64_t rank, int64_t world, double timeout_s);
/* buf [n] = sum over ranks of buf, in rank order (bit-identical on every rank); comm is an
 * mw_shm_comm*, so that the function is an mw_allreduce_fn */
int mw_shm_allreduce(void* comm, float* buf, int64_t n);
/* rank r's src [rows, cols[r]] -> dst [rows, sum(cols)], rank r's columns at
 * sum(cols[:r]); every rank passes the same rows and cols (1-D pieces: rows = 1) */
int mw_shm_allgather(mw_shm_comm* c, const float* src, int64_t rows, const int64_t* cols,
                     float* dst);
int mw_shm_barrier(mw_shm_comm* c);
/* sets the segment's abort flag: every waiting and later call returns MW_COMM_ABORTED */
void mw_shm_abort(void* base);

/* ------------------------------------------------------------------ shared vector helpers */

static inline float mw_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t mw_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half -> float, exact (subnormals, inf and NaN included) */
static inline float mw_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7FFF;
    if (em >= 0x7C00) return mw_bits_to_float(sign | 0x7F800000 | ((em & 0x3FF) << 13));
    if (em >= 0x400) return mw_bits_to_float(sign | ((em << 13) + (112u << 23)));
    return mw_bits_to_float(sign | mw_float_to_bits((float)em * 5.9604644775390625e-8f));  /* 2^-24 */
}

static inline float mw_bf16_to_float(uint16_t h) { return mw_bits_to_float((uint32_t)h << 16); }

/* f rounded to bf16 (nearest even), as a float; a NaN stays a (quiet) NaN */
static inline float mw_round_bf16(float f) {
    const uint32_t u = mw_float_to_bits(f);
    const uint32_t bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? u | 0x400000u  /* NaN */
                                                          : u + 0x7FFFu + ((u >> 16) & 1u);
    return mw_bits_to_float(bits & 0xFFFF0000u);
}

static inline uint16_t mw_float_to_bf16(float f) {
    return (uint16_t)(mw_float_to_bits(mw_round_bf16(f)) >> 16);
}

/* n halves -> floats (F16C where the build has it) */
static inline void mw_halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#endif
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(src[i]);
#endif
    for (; i < n; i++) dst[i] = mw_half_to_float(src[i]);
}

/* The scales and offsets of a q4/q8 weight (s, c [N, K/group]) come in one of three table
 * formats, which every kernel takes as its ``half`` argument (the name is older than the third):
 *
 *   0    float32, an entry each
 *   1    float16 (GGUF's Q4_0/Q4_1/Q8_0 store theirs so: half the bytes, no weight changes)
 *   E>1  two-level, as GGUF's K-quants store them: runs of E entries ("superblocks") share one
 *        float32 d, and each entry is a signed 8-bit sub-value: entry = d * (float)sub, one
 *        fp32 multiply, which is ggml's own arithmetic (d * sc), so the weights are the same
 *        bits as from a float32 table. A superblock is 4 + E bytes: d, then its E int8 subs.
 *        E = 8 for 32-value groups in 256-value superblocks (Q4_K, Q5_K, IQ4_XS), 16 for
 *        16-value groups (Q6_K, Q3_K, Q2_K). A Q4_K weight then costs 0.59 bytes a value
 *        instead of 0.75, a Q6_K one 1.16 instead of 1.5.
 *
 * Kernels read float32: count entries from index first of a table, as float32 -- the table
 * itself when it is float32, else converted into buf. Callers ask for whole rows, so first and
 * count are multiples of E.
 *
 * MW_NO_OFFSETS: every entry point takes c = NULL for a weight whose offsets are all zero
 * (Q8_0, Q5_0 and Q6_K keep their codes signed, so c is 0 throughout): the one-token kernels
 * then skip the offset term and never read the table -- 5.5% of a Q8_0 / Q5_0 weight's bytes
 * (an fp16 entry per 32 codes) and 6.7% of a Q6_K one's -- and the others read zeros. */
static inline void mw_two_level_to_floats(const uint8_t* table, int64_t E, int64_t first,
                                          int64_t count, float* dst) {
    const uint8_t* sb = table + first / E * (4 + E);
    for (int64_t done = 0; done < count; done += E, sb += 4 + E) {
        float d;
        memcpy(&d, sb, sizeof d);  /* unaligned-safe: a superblock is 4 + E bytes */
        const int8_t* sub = (const int8_t*)(sb + 4);
        int64_t j = 0;
#if defined(__AVX2__)
        /* the decode step widens these per row group while the rows stream: 8 at a time */
        const __m256 vd = _mm256_set1_ps(d);
        for (; j + 8 <= E; j += 8) {
            int64_t bytes;
            memcpy(&bytes, sub + j, sizeof bytes);
            const __m256i wide = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes));
            _mm256_storeu_ps(dst + done + j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(wide)));
        }
#endif
        for (; j < E; j++) dst[done + j] = d * (float)sub[j];
    }
}

static inline const float* mw_scales_f32(const void* table, int half, int64_t first,
                                         int64_t count, float* buf) {
    if (!table) {  /* an offset table left out: all zeros (see MW_NO_OFFSETS below) */
        memset(buf, 0, sizeof(float) * (size_t)count);
        return buf;
    }
    if (half == 0) return (const float*)table + first;
    if (half == 1) mw_halves_to_floats((const uint16_t*)table + first, buf, count);
    else mw_two_level_to_floats((const uint8_t*)table, half, first, count, buf);
    return buf;
}

/* float32 views of a weight's whole scale and offset tables (the exact kernels, the tiles and
 * the dequantizers, which are not where decode spends its time): the tables themselves when
 * float32, else widened copies, freed by mw_free_tables. Out of memory stops the process with
 * a message: a kernel must not return a result it never wrote. */
typedef struct { const float *s, *c; float *own_s, *own_c; } mw_f32_tables;

static inline float* mw_widened(const void* table, int64_t count, int half) {
    float* copy = (float*)(table ? malloc(sizeof(float) * (size_t)(count > 0 ? count : 1))
                                 : calloc((size_t)(count > 0 ? count : 1), sizeof(float)));
    if (!copy) {
        fprintf(stderr, "memwall: a float32 copy of a scale table could not allocate %zu bytes\n",
                sizeof(float) * (size_t)count);
        abort();
    }
    mw_scales_f32(table, half, 0, count, copy);
    return copy;
}

static inline mw_f32_tables mw_tables_f32(const void* s, const void* c, int64_t count, int half) {
    mw_f32_tables t = {(const float*)s, (const float*)c, NULL, NULL};
    if (half) t.s = t.own_s = mw_widened(s, count, half);
    if (half || !c) t.c = t.own_c = mw_widened(c, count, half);  /* no table: zeros */
    return t;
}

static inline void mw_free_tables(mw_f32_tables* t) { free(t->own_s); free(t->own_c); }

#if defined(__AVX2__)
/* the sum of v's 8 lanes (halves, then pairs, then the last two) */
static inline float mw_hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* sums + the offset term of 8 tokens at once: sum_g c[g] * xsum_t[g * 8 .. g * 8 + 7] (a tile's
 * group sums, its tokens side by side), four FMA chains (one would wait on FMA latency ng
 * times); int_gemm.c's and int8_tiles.c's tile kernels end with it */
static inline __m256 mw_add_offsets8(__m256 sums, const float* c, const float* xsum_t, int64_t ng) {
    __m256 off[4] = {sums, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t g = 0;
    for (; g + 4 <= ng; g += 4)
        for (int i = 0; i < 4; i++)
            off[i] = _mm256_fmadd_ps(_mm256_set1_ps(c[g + i]), _mm256_loadu_ps(xsum_t + (g + i) * 8), off[i]);
    for (; g < ng; g++)
        off[0] = _mm256_fmadd_ps(_mm256_set1_ps(c[g]), _mm256_loadu_ps(xsum_t + g * 8), off[0]);
    return _mm256_add_ps(_mm256_add_ps(off[0], off[1]), _mm256_add_ps(off[2], off[3]));
}
#endif

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
    sum = mw_hsum256(_mm256_add_ps(acc0, acc1));
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

#if defined(__AVX512F__)
/* r[c] becomes column c of the 16 x 16 matrix of 32-bit elements whose rows were r[0..15]
 * (64 shuffles: within 128-bit lanes by 32 and 64 bits, then across lanes twice); the panel
 * matmuls' weights and the prefill attention's keys go through it */
static inline void mw_transpose16(__m512i* r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* b[4i + k], 128-bit lane L: column 4L + k, rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i lo01 = _mm512_shuffle_i32x4(b[k], b[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i hi01 = _mm512_shuffle_i32x4(b[k], b[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i lo23 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i hi23 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
        r[k] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + k] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + k] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + k] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#endif

/* e^x of 16 floats: Cephes' expf polynomial (relative error ~2e-7, as expf) with the power of
 * two applied by vscalefps */
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

/* e^x of 8 floats (AVX2): the same Cephes polynomial, the power of two built in the exponent
 * bits (x is clamped to [-87.3, 88.4], so 2^n stays a normal float) */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-87.3365447505531f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    /* fx in [-127, 128]: 2^fx as exponent bits; 128 (x near 88.4) is split in two halves */
    __m256i n = _mm256_cvtps_epi32(fx);
    __m256i half = _mm256_srai_epi32(n, 1);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(n, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* r[i] = sum of the 8 lanes of v[i], for 8 vectors: a transpose-and-add tree */
static inline __m256 hsum8x8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

#endif  /* MEMWALL_KERNELS_H */
