/* memwall's fused CPU decode step: every layer of a Llama-family model for a batch of
 * sequences that each add one token, in one call from Python.
 *
 * Why: a decode step is a few hundred small operations (30 layers x ~15 ops for a 135M model).
 * Dispatched one by one from Python each costs microseconds of overhead, which for a small
 * model is more than the arithmetic. Here the whole stack runs in C; only the embedding lookup
 * and the LM head stay in torch. Parallel loops use OpenMP (torch's own libgomp, so
 * torch.set_num_threads applies).
 *
 * It calls the other kernel files (kernels.h) for quantized weights and attention. Everything
 * is float32, and each formula follows the torch path (memwall/models/llama.py) so results
 * agree to float rounding:
 *
 *   h = rms_norm(x) * w_in           q, k, v = h @ Wqkv (+ bias)     [q/k norm] rotate-half rope
 *   cache[slot] = k, v               a = softmax(q k^T * scale) v    over the sequence's blocks
 *   x = x + a @ Wo                   h = rms_norm(x) * w_post
 *   x = x + (silu(h @ Wg) * (h @ Wu)) @ Wd                           final: rms_norm(x) * w_final
 *
 * LoRA (memwall/lora): a step's tokens may each use a different adapter resident in the
 * LoRASlots (memwall/lora/slots.py), or none. After each projection, every token t with slot
 * s >= 0 gets, for each target segment of that projection the adapter has (rank r > 0),
 *
 *   y_t[col:col+n] += (A[s, :r] x_t) @ Bt[s, :r]          A [r, k], Bt [r, n] = B^T * scaling
 *
 * as memwall/lora/layers.py computes it in torch (batched heterogeneous LoRA, as Punica and
 * S-LoRA do on GPUs), so a mixed-adapter decode batch still runs in this one call.
 *
 * Gemma 3's layout is the same with three options: the attention and MLP outputs are normed
 * before they join the residual (attn_out_norm, ffn_out_norm), the gate is GeLU (tanh form)
 * instead of SiLU, and a layer may have rotary tables of its own (the sliding layers' local
 * base). A sliding layer's window goes to the attention (mw_layer.window): each row attends
 * its last `window` keys, as the model's reference does, at any context length.
 *
 * KV cache layout per layer: [num_blocks, block_size, kv_heads, head_dim] in the model's
 * kv_type (float32, float16, bfloat16, int8 + scales, float8: paged_attention.c writes and
 * reads every format; the activations stay float32). The structs below are mirrored by
 * ctypes in memwall/kernels/cpu/decode.py.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

/* Rows from which the step's per-row work between the matmuls (norms, rope and the KV writes,
 * the gated activation) is shared out between the threads: alone on one thread while the
 * others spun, it took 2.0 of a 34.7 ms 16-row SmolLM2 step on a 2-core Cascade Lake Xeon.
 * Each row's arithmetic is the same on any thread. */
#define MW_ROW_PARALLEL 4

enum { MW_F32 = 1, MW_Q4 = 2, MW_Q8 = 3, MW_PANELS = 4 };

typedef struct {            /* one weight matrix [n, k]; y = x @ W^T (+ bias) */
    int32_t kind;           /* MW_F32 (w: float [n, k]), MW_Q4, MW_Q8 or MW_PANELS (w: codes, s, c) */
    int32_t group;          /* MW_Q8: values per (s, c) pair */
    int64_t n, k;
    const void* w;
    const void* s;          /* a scale table in the format half names (kernels.h) */
    const void* c;
    const float* bias;      /* [n] or NULL */
    int64_t half;           /* MW_PANELS: the MW_PK_* flags instead */
} mw_part;

typedef struct {            /* a projection: up to 3 parts whose outputs sit side by side */
    int64_t nparts;
    mw_part parts[3];
} mw_proj;

typedef struct {            /* one LoRA target (SlotSegment of memwall/lora/slots.py) */
    int64_t col, n, k;      /* its outputs are columns col..col+n-1 of the projection; k inputs */
    const float* a;         /* [n_slots, max_rank, k]: A, rows 0..rank[s]-1 of slot s used */
    const float* bt;        /* [n_slots, max_rank, n]: B^T with the adapter's scaling folded in */
    const int32_t* rank;    /* [n_slots]; 0: the slot's adapter does not target this */
} mw_lora_seg;

typedef struct {            /* a projection's LoRA targets (nsegs 0: none) */
    int64_t nsegs;
    mw_lora_seg segs[3];
} mw_lora_proj;

typedef struct {
    const float* in_norm;   /* [hidden]; NULL: the layer takes x as it is (an EAGLE head's layer) */
    const float* post_norm; /* [hidden] */
    const float* q_norm;    /* [head_dim] or NULL (Qwen3 normalizes each head's q and k) */
    const float* k_norm;
    mw_proj qkv, o, gate_up, down;
    void* k_cache;          /* [n_blocks, block_size, n_kv_heads, head_dim] of kv_type */
    void* v_cache;
    float* k_scale;         /* MW_KV_I8: [n_blocks, block_size, n_kv_heads, ceil(D / 16)]; else NULL */
    float* v_scale;
    const float* attn_out_norm; /* [hidden] or NULL: Gemma norms the attention output ... */
    const float* ffn_out_norm;  /* ... and the MLP output before the residual add */
    const float* rope_cos;      /* [max_positions, head_dim / 2] or NULL: the step's tables */
    const float* rope_sin;
    mw_lora_proj lora_qkv, lora_o, lora_gate_up, lora_down;
    int64_t window;             /* a sliding layer's window (keys it attends), or 0: all */
} mw_layer;

typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, block_size;
    int64_t n_blocks;       /* blocks in each layer's KV cache */
    int64_t max_positions;  /* rows of the rotary tables */
    int64_t kv_type;        /* MW_KV_* of kernels.h */
    float eps, scale;
    const mw_layer* layers;
    const float* final_norm;  /* NULL: return the last layer's output (a pipeline stage) */
    int64_t act;            /* the gate's activation: MW_ACT_SILU or MW_ACT_GELU_TANH */
    int64_t max_rank;       /* LoRA: rank rows per slot (the a/bt row stride of a slot) */
    int64_t n_slots;        /* LoRA slots (0: the model was described without LoRA) */
    /* Tensor parallel (memwall/distributed/tensor_parallel.py): this rank holds a share of
     * the heads and MLP columns, so the o and down projections give partial sums that
     * allreduce(ctx, buf, n) sums over the ranks in place (shm_comm.c's mw_shm_allreduce, or
     * a callback into torch.distributed); NULL: one rank. Returns MW_OK or an MW_COMM_* error. */
    int (*allreduce)(void* ctx, float* buf, int64_t n);
    void* comm_ctx;
} mw_model;

enum { MW_ACT_SILU = 0, MW_ACT_GELU_TANH = 1 };

/* ------------------------------------------------------------------ small helpers */

static void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
    float ss = dot_f32(x, x, n);
    float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* out[b] = rms_norm(x[b] (+ add[b], first added into x[b]: the residual)) * w for B rows of n */
static void norm_rows(float* x, const float* add, const float* w, float* out, int64_t B, int64_t n,
                      float eps) {
    #pragma omp parallel for schedule(static) if (B >= MW_ROW_PARALLEL)
    for (int64_t b = 0; b < B; b++) {
        if (add)
            for (int64_t i = 0; i < n; i++) x[b * n + i] += add[b * n + i];
        rms_norm(x + b * n, w, out + b * n, n, eps);
    }
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
    } else if (p->kind == MW_PANELS) {
        /* MW_MAX_ROWS tokens a call: every decode row takes the int8-digit tiles, bit for bit
           what it would get alone (panels.py checked the shape: this cannot fail) */
        for (int64_t m0 = 0; m0 < M; m0 += MW_MAX_ROWS)
            mw_packed_gemm(x + m0 * p->k, M - m0 < MW_MAX_ROWS ? M - m0 : MW_MAX_ROWS, p->k,
                           (const uint8_t*)p->w, p->s, p->c, (int)p->half, y + m0 * ldy, p->n, ldy);
    } else {
        for (int64_t m0 = 0; m0 < M; m0 += MW_MAX_ROWS) {
            int64_t rows = M - m0 < MW_MAX_ROWS ? M - m0 : MW_MAX_ROWS;
            /* the kernels write rows of exactly n values: straight into y when that is y's
               layout (one row, or one part filling whole rows), else through tmp */
            int direct = rows == 1 || ldy == p->n;
            float* out = direct ? y + m0 * ldy : tmp;
            if (rows == 1 && p->kind == MW_Q4 &&
                mw_q4_gemv_i8(x + m0 * p->k, p->k, (const uint8_t*)p->w, p->s, p->c, out, p->n,
                              (int)p->half))
                continue;
            if (rows == 1 && p->kind == MW_Q8 &&
                mw_q8_gemv_i8(x + m0 * p->k, p->k, p->group, (const int8_t*)p->w, p->s, p->c, out, p->n,
                              (int)p->half))
                continue;
            if (p->kind == MW_Q4)
                q4_gemm(x + m0 * p->k, rows, p->k, (const uint8_t*)p->w, p->s, p->c, out, p->n,
                        (int)p->half);
            else
                q8_gemm(x + m0 * p->k, rows, p->k, p->group, (const int8_t*)p->w, p->s, p->c,
                        out, p->n, (int)p->half);
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

/* ------------------------------------------------------------------ LoRA deltas */

typedef struct {            /* one work item of lora_apply */
    int32_t group, seg;
    int64_t rank;           /* the segment's rank for the group's slot (lora_rank) */
    int64_t at;             /* shrink: the rank row; expand: the first column */
} mw_lora_job;

/* The step's tokens grouped by LoRA slot, built once per step: a group's tokens share their
 * adapter's A and Bt, so each row of those is read from memory once per group (and reused from
 * L1 for the group's other tokens) rather than once per token. */
typedef struct {
    int64_t n_groups;
    int64_t max_rank;
    int64_t* slot;          /* [n_groups] */
    int64_t* start;         /* [n_groups + 1]: the group's tokens are order[start[g]..start[g+1]) */
    int64_t* order;         /* [B] token indexes, by group, in batch order within one */
    float* u;               /* [B, 3, max_rank]: A x of each token, segment and rank row */
    mw_lora_job* jobs;      /* scratch for one projection's work items */
} mw_lora_step;

#define MW_LORA_COLS 64               /* output columns per expand work item */
#define MW_LORA_PARALLEL_WORK 16384   /* multiply-adds from which a projection's deltas go
                                         parallel (below that, waking threads costs more) */

static void lora_step_free(mw_lora_step* st) {  /* leaves st empty: safe to call again */
    free(st->slot); free(st->start); free(st->order); free(st->u); free(st->jobs);
    memset(st, 0, sizeof(*st));
}

/* Groups the tokens whose slot is >= 0; MW_OUT_OF_MEMORY or MW_OK (n_groups 0: no LoRA). The
 * jobs scratch holds the most work items one projection can make: per group and segment,
 * max_rank shrink rows plus one expand item per MW_LORA_COLS of at most `widest` columns. */
static int lora_step_init(mw_lora_step* st, const int32_t* token_slots, int64_t B,
                          int64_t max_rank, int64_t widest) {
    memset(st, 0, sizeof(*st));
    if (!token_slots) return MW_OK;
    st->max_rank = max_rank;
    st->slot = (int64_t*)malloc(sizeof(int64_t) * B);
    st->start = (int64_t*)malloc(sizeof(int64_t) * (B + 1));
    st->order = (int64_t*)malloc(sizeof(int64_t) * B);
    if (!st->slot || !st->start || !st->order) { lora_step_free(st); return MW_OUT_OF_MEMORY; }
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {  /* B is at most a few dozen: quadratic is fine */
        int64_t s = token_slots[b], seen = 0;
        for (int64_t g = 0; g < st->n_groups; g++) seen |= st->slot[g] == s;
        if (s < 0 || seen) continue;
        st->slot[st->n_groups] = s;
        st->start[st->n_groups++] = n;
        for (int64_t t = b; t < B; t++)
            if (token_slots[t] == s) st->order[n++] = t;
    }
    st->start[st->n_groups] = n;
    if (st->n_groups == 0) return MW_OK;
    const int64_t jobs = st->n_groups * 3 * (max_rank + widest / MW_LORA_COLS + 1);
    st->u = (float*)malloc(sizeof(float) * B * 3 * max_rank);
    st->jobs = (mw_lora_job*)malloc(sizeof(mw_lora_job) * jobs);
    if (!st->u || !st->jobs) { lora_step_free(st); return MW_OUT_OF_MEMORY; }
    return MW_OK;
}

/* rank rows of slot s this segment uses (rank[] is the caller's: kept inside 0..max_rank).
 * Read once per projection into the work items, so shrink and expand agree on it. */
static inline int64_t lora_rank(const mw_lora_seg* seg, int64_t s, int64_t max_rank) {
    int64_t r = seg->rank[s];
    return r < 0 ? 0 : r > max_rank ? max_rank : r;
}

/* shrink: u[t, seg, j] = A[s, j] . x_t for the group's tokens t (one rank row j) */
static void lora_shrink(const mw_lora_seg* seg, const mw_lora_step* st, const mw_lora_job* job,
                        const float* x) {
    const int64_t s = st->slot[job->group], R = st->max_rank;
    const float* arow = seg->a + (s * R + job->at) * seg->k;
    for (int64_t i = st->start[job->group]; i < st->start[job->group + 1]; i++) {
        const int64_t t = st->order[i];
        st->u[(t * 3 + job->seg) * R + job->at] = dot_f32(arow, x + t * seg->k, seg->k);
    }
}

/* y[c] += sum over j < r of u[j] * bt[j * ld + c], for c < w: the delta of each column summed
 * in j order in registers (bt read once, y once), then added, as torch adds (x A^T) Bt to y */
static void lora_add_delta(const float* u, int64_t r, const float* bt, int64_t ld, float* y,
                           int64_t w) {
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 64 <= w; c += 64) {
        __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t j = 0; j < r; j++) {
            const __m512 uj = _mm512_set1_ps(u[j]);
            const float* b = bt + j * ld + c;
            d0 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(b), d0);
            d1 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(b + 16), d1);
            d2 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(b + 32), d2);
            d3 = _mm512_fmadd_ps(uj, _mm512_loadu_ps(b + 48), d3);
        }
        _mm512_storeu_ps(y + c, _mm512_add_ps(_mm512_loadu_ps(y + c), d0));
        _mm512_storeu_ps(y + c + 16, _mm512_add_ps(_mm512_loadu_ps(y + c + 16), d1));
        _mm512_storeu_ps(y + c + 32, _mm512_add_ps(_mm512_loadu_ps(y + c + 32), d2));
        _mm512_storeu_ps(y + c + 48, _mm512_add_ps(_mm512_loadu_ps(y + c + 48), d3));
    }
    for (; c + 16 <= w; c += 16) {
        __m512 d = _mm512_setzero_ps();
        for (int64_t j = 0; j < r; j++)
            d = _mm512_fmadd_ps(_mm512_set1_ps(u[j]), _mm512_loadu_ps(bt + j * ld + c), d);
        _mm512_storeu_ps(y + c, _mm512_add_ps(_mm512_loadu_ps(y + c), d));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; c + 32 <= w; c += 32) {
        __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t j = 0; j < r; j++) {
            const __m256 uj = _mm256_set1_ps(u[j]);
            const float* b = bt + j * ld + c;
            d0 = _mm256_fmadd_ps(uj, _mm256_loadu_ps(b), d0);
            d1 = _mm256_fmadd_ps(uj, _mm256_loadu_ps(b + 8), d1);
            d2 = _mm256_fmadd_ps(uj, _mm256_loadu_ps(b + 16), d2);
            d3 = _mm256_fmadd_ps(uj, _mm256_loadu_ps(b + 24), d3);
        }
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), d0));
        _mm256_storeu_ps(y + c + 8, _mm256_add_ps(_mm256_loadu_ps(y + c + 8), d1));
        _mm256_storeu_ps(y + c + 16, _mm256_add_ps(_mm256_loadu_ps(y + c + 16), d2));
        _mm256_storeu_ps(y + c + 24, _mm256_add_ps(_mm256_loadu_ps(y + c + 24), d3));
    }
    for (; c + 8 <= w; c += 8) {
        __m256 d = _mm256_setzero_ps();
        for (int64_t j = 0; j < r; j++)
            d = _mm256_fmadd_ps(_mm256_set1_ps(u[j]), _mm256_loadu_ps(bt + j * ld + c), d);
        _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), d));
    }
#endif
    for (; c < w; c++) {
        float d = 0.f;
        for (int64_t j = 0; j < r; j++) d += u[j] * bt[j * ld + c];
        y[c] += d;
    }
}

/* expand: y_t[col + c0 .. col + c0 + w) += u[t, seg, :r] @ Bt[s, :r, c0 .. c0 + w) for the
 * group's tokens (the r x w block of Bt stays in L1 from one token to the next) */
static void lora_expand(const mw_lora_seg* seg, const mw_lora_step* st, const mw_lora_job* job,
                        float* y, int64_t ldy) {
    const int64_t s = st->slot[job->group], R = st->max_rank;
    const int64_t c0 = job->at, w = seg->n - c0 < MW_LORA_COLS ? seg->n - c0 : MW_LORA_COLS;
    const float* bt = seg->bt + s * R * seg->n + c0;
    for (int64_t i = st->start[job->group]; i < st->start[job->group + 1]; i++) {
        const int64_t t = st->order[i];
        lora_add_delta(st->u + (t * 3 + job->seg) * R, job->rank, bt, seg->n,
                       y + t * ldy + seg->col + c0, w);
    }
}

/* y [B, ldy] (the projection's output) += the LoRA deltas of every token with a slot, x [B, k]
 * its input. Work items: one per (group, segment, rank row) to shrink, then one per (group,
 * segment, MW_LORA_COLS columns) to expand; each writes its own u entries or y columns, so
 * the items split over threads with no locks, and the sums do not depend on the thread
 * count. */
static void lora_apply(const mw_lora_proj* lp, const mw_lora_step* st, const float* x, float* y,
                       int64_t ldy) {
    if (lp->nsegs == 0 || st->n_groups == 0) return;
    mw_lora_job* jobs = st->jobs;
    int64_t n_shrink = 0, n_jobs, work = 0;
    for (int32_t g = 0; g < st->n_groups; g++)
        for (int32_t i = 0; i < lp->nsegs; i++) {
            const mw_lora_seg* seg = &lp->segs[i];
            const int64_t r = lora_rank(seg, st->slot[g], st->max_rank);
            for (int64_t j = 0; j < r; j++) jobs[n_shrink++] = (mw_lora_job){g, i, r, j};
            work += r * (seg->k + seg->n) * (st->start[g + 1] - st->start[g]);
        }
    n_jobs = n_shrink;
    for (int64_t q = 0; q < n_shrink; q++) {  /* each (group, segment) shrunk, from its row 0 */
        if (jobs[q].at != 0) continue;
        for (int64_t c = 0; c < lp->segs[jobs[q].seg].n; c += MW_LORA_COLS)
            jobs[n_jobs++] = (mw_lora_job){jobs[q].group, jobs[q].seg, jobs[q].rank, c};
    }
    if (n_shrink == 0) return;  /* no token's adapter targets this projection */
    #pragma omp parallel if (work >= MW_LORA_PARALLEL_WORK)
    {
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < n_shrink; q++)
            lora_shrink(&lp->segs[jobs[q].seg], st, &jobs[q], x);
        /* the implied barrier: every u is written before any expand reads it */
        #pragma omp for schedule(static)
        for (int64_t q = n_shrink; q < n_jobs; q++)
            lora_expand(&lp->segs[jobs[q].seg], st, &jobs[q], y, ldy);
    }
}

/* ------------------------------------------------------------------ the whole step */

/* Optional stage timers: seconds spent per stage, summed over steps while profiling is on
 * (from Python: lib = build.require(); lib.mw_profile(1, None) starts them, and
 * lib.mw_profile(0, buf), buf a ctypes double[10], reads and stops them). Stages: 0 norms,
 * 1 qkv, 2 rope + cache write, 3 attention, 4 o_proj, 5 gate_up, 6 silu*mul, 7 down, 8 LoRA
 * deltas (all four projections'), 9 tensor-parallel all-reduces (waiting for the other ranks
 * included). */
#define MW_STAGES 10
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
    #pragma omp parallel for schedule(static) if (B >= MW_ROW_PARALLEL)
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
        /* slots were checked (check_inputs): the writes cannot fail */
        const int64_t num_slots = m->n_blocks * m->block_size;
        mw_kv_write(k, 1, slots + b, num_slots, Hkv, D, (int)m->kv_type, L->k_cache, L->k_scale);
        mw_kv_write(v, 1, slots + b, num_slots, Hkv, D, (int)m->kv_type, L->v_cache, L->v_scale);
    }
}

/* act[b, i] = g(gate[b, i]) * up[b, i], gate_up rows [B, gate | up]. Both activations are
 * x * sigmoid(z): SiLU with z = x, GeLU's tanh form with z = 2 sqrt(2/pi) (x + 0.044715 x^3)
 * (0.5 (1 + tanh(y)) = sigmoid(2y)). */
static void gate_mul(const float* gate_up, float* act, int64_t B, int64_t inter, int64_t kind) {
    const float c1 = kind == MW_ACT_GELU_TANH ? 1.5957691216057308f : 1.f;
    const float c3 = kind == MW_ACT_GELU_TANH ? 1.5957691216057308f * 0.044715f : 0.f;
    #pragma omp parallel for schedule(static) if (B >= MW_ROW_PARALLEL)
    for (int64_t b = 0; b < B; b++) {
        const float* g = gate_up + b * 2 * inter;
        float* a = act + b * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f), k1 = _mm512_set1_ps(c1), k3 = _mm512_set1_ps(c3);
        for (; i + 16 <= inter; i += 16) {
            __m512 gi = _mm512_loadu_ps(g + i);
            __m512 z = kind == MW_ACT_GELU_TANH  /* SiLU keeps z = x exactly (and x^3 cannot overflow) */
                ? _mm512_fmadd_ps(_mm512_mul_ps(k3, gi), _mm512_mul_ps(gi, gi), _mm512_mul_ps(k1, gi)) : gi;
            __m512 sig = _mm512_div_ps(gi, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), z))));
            _mm512_storeu_ps(a + i, _mm512_mul_ps(sig, _mm512_loadu_ps(g + inter + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.f), k1 = _mm256_set1_ps(c1), k3 = _mm256_set1_ps(c3);
        for (; i + 8 <= inter; i += 8) {
            __m256 gi = _mm256_loadu_ps(g + i);
            __m256 z = kind == MW_ACT_GELU_TANH
                ? _mm256_fmadd_ps(_mm256_mul_ps(k3, gi), _mm256_mul_ps(gi, gi), _mm256_mul_ps(k1, gi)) : gi;
            __m256 sig = _mm256_div_ps(gi, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), z))));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(sig, _mm256_loadu_ps(g + inter + i)));
        }
#endif
        for (; i < inter; i++) {
            float z = kind == MW_ACT_GELU_TANH ? c1 * g[i] + c3 * g[i] * g[i] * g[i] : g[i];
            a[i] = g[i] / (1.f + expf(-z)) * g[inter + i];
        }
    }
}

/* MW_OK when the step's inputs address only what the model holds: positions inside the rotary
 * tables, slots and block ids inside the KV cache, lengths 1..table_width * block_size, LoRA
 * slots -1..n_slots - 1 (token_slots may be NULL). */
static int check_inputs(const mw_model* m, int64_t B, const int64_t* positions,
                        const int64_t* slots, const int64_t* seq_lens,
                        const int64_t* block_tables, int64_t table_width,
                        const int32_t* token_slots) {
    for (int64_t b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= m->max_positions) return MW_BAD_POSITION;
        if (slots[b] < 0 || slots[b] >= m->n_blocks * m->block_size) return MW_BAD_SLOT;
        if (token_slots && (token_slots[b] < -1 || token_slots[b] >= m->n_slots))
            return MW_BAD_LORA_SLOT;
    }
    return mw_check_tables(block_tables, table_width, seq_lens, B, m->block_size, m->n_blocks);
}

/* x: [B, hidden], in: the token embeddings (a later pipeline stage: the previous stage's
 * output); out: the final-normed hidden states (without final_norm: the last layer's output).
 * positions, slots, seq_lens: [B]; block_tables: [B, table_width];
 * rope_cos, rope_sin: [max_positions, head_dim / 2]; token_slots: [B] each token's LoRA slot
 * (-1: none), or NULL: no LoRA this step. Returns MW_OK (B = 0 does nothing), or an error of
 * kernels.h: inputs that check_inputs refuses (x and the caches untouched), or out of memory. */
int mw_decode_step(const mw_model* m, float* x, int64_t B, const int64_t* positions,
                   const int64_t* slots, const int64_t* seq_lens, const int64_t* block_tables,
                   int64_t table_width, const float* rope_cos, const float* rope_sin,
                   const int32_t* token_slots) {
    if (B <= 0) return MW_OK;
    int rc = check_inputs(m, B, positions, slots, seq_lens, block_tables, table_width,
                          token_slots);
    if (rc != MW_OK) return rc;
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
    mw_lora_step lora;
    int lora_rc = lora_step_init(&lora, token_slots, B, m->max_rank, widest);
    if (!h || !big || !attn || !act || !tmp || !qbuf || lora_rc != MW_OK) {
        free(h); free(big); free(attn); free(act); free(tmp); free(qbuf);
        lora_step_free(&lora);
        return MW_OUT_OF_MEMORY;
    }
    for (int64_t l = 0; l < m->n_layers; l++) {
        const mw_layer* L = &m->layers[l];
        if (L->in_norm) {
            STAGE(0, norm_rows(x, NULL, L->in_norm, h, B, Hd, m->eps));
        } else {
            memcpy(h, x, sizeof(float) * B * Hd);
        }
        STAGE(1, proj_apply(&L->qkv, h, B, big, qkv_size, tmp));  /* [B, q | k | v] */
        STAGE(8, lora_apply(&L->lora_qkv, &lora, h, big, qkv_size));
        STAGE(2, rope_and_write(m, L, big, qbuf, B, positions, slots,
                                L->rope_cos ? L->rope_cos : rope_cos,
                                L->rope_sin ? L->rope_sin : rope_sin));
        STAGE(3, rc = mw_paged_attention_run(qbuf, L->k_cache, L->v_cache, L->k_scale,
                                             L->v_scale, (int)m->kv_type, block_tables,
                                             table_width, seq_lens, B, H, Hkv, D, m->block_size,
                                             m->scale, L->window, attn));
        if (rc != MW_OK) break;
        STAGE(4, proj_apply(&L->o, attn, B, act, Hd, tmp));
        STAGE(8, lora_apply(&L->lora_o, &lora, attn, act, Hd));
        if (m->allreduce) {  /* before Gemma's output norm: it norms the whole sum */
            STAGE(9, rc = m->allreduce(m->comm_ctx, act, B * Hd));
            if (rc != MW_OK) break;
        }
        if (L->attn_out_norm)
            STAGE(0, norm_rows(act, NULL, L->attn_out_norm, act, B, Hd, m->eps));
        STAGE(0, norm_rows(x, act, L->post_norm, h, B, Hd, m->eps));
        STAGE(5, proj_apply(&L->gate_up, h, B, big, 2 * inter, tmp));  /* [B, gate | up] */
        STAGE(8, lora_apply(&L->lora_gate_up, &lora, h, big, 2 * inter));
        STAGE(6, gate_mul(big, act, B, inter, m->act));
        STAGE(7, proj_apply(&L->down, act, B, h, Hd, tmp));
        STAGE(8, lora_apply(&L->lora_down, &lora, act, h, Hd));
        if (m->allreduce) {
            STAGE(9, rc = m->allreduce(m->comm_ctx, h, B * Hd));
            if (rc != MW_OK) break;
        }
        if (L->ffn_out_norm)
            STAGE(0, norm_rows(h, NULL, L->ffn_out_norm, h, B, Hd, m->eps));
        STAGE(0, for (int64_t i = 0; i < B * Hd; i++) x[i] += h[i]);
    }
    if (rc == MW_OK && m->final_norm)  /* NULL: a pipeline stage before the last */
        norm_rows(x, NULL, m->final_norm, x, B, Hd, m->eps);
    free(h); free(big); free(attn); free(act); free(tmp); free(qbuf);
    lora_step_free(&lora);
    return rc;
}
