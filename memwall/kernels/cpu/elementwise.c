/* memwall's row-wise float32 kernels for the model's forward pass outside the fused decode step
 * (prefill chunks, mixed steps): RMSNorm (with the residual add before it), the MLP's gated
 * activation and rotary embeddings (see kernels.h for the other files).
 *
 * Why: once the matmuls ran on the integer panels, a 512-token prefill of SmolLM2-135M spent
 * ~15% of its time in torch's elementwise ops: each a pass over memory, a fresh output tensor,
 * and silu alone 0.37 ms on [512, 1536] (2 threads). Here each is one pass, rows split over
 * the threads, the vector work in registers (exp512 / exp256, kernels.h).
 *
 * Every row is computed alone and in the same order whatever the batch, so a token's result
 * does not depend on what else is in the step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* rows of n values each: threads only when there is enough work to share */
#define PAR_MIN 16384

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* out[i] = x[i] * inv * w[i] (the norm of one row) */
static void scale_row(const float* x, const float* w, float inv, float* out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 v = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), v), _mm512_loadu_ps(w + i)));
#elif defined(__AVX2__)
    const __m256 v = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), v), _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* out [rows, n] = x / sqrt(mean(x^2) + eps) * w; residual != NULL: the norm of
 * sum = x + residual instead, the sum written to sum_out (the stream the next layer adds to) */
void mw_rms_norm(const float* x, const float* residual, const float* w, float* out,
                 float* sum_out, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        if (residual) {
            const float* dr = residual + r * n;
            float* sr = sum_out + r * n;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(sr + i, _mm512_add_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(dr + i)));
#endif
            for (; i < n; i++) sr[i] = xr[i] + dr[i];
            xr = sr;
        }
        const float inv = 1.f / sqrtf(dot_f32(xr, xr, n) / (float)n + eps);
        scale_row(xr, w, inv, out + r * n, n);
    }
}

static inline float silu1(float g) { return g / (1.f + expf(-g)); }

static inline float gelu_tanh1(float g) {
    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (1.f + tanhf(inner));
}

#if defined(__AVX512F__)
/* silu(g) = g / (1 + e^-g); gelu_tanh(g) = g * sigmoid(2 * inner) (= 0.5 g (1 + tanh inner)) */
static inline __m512 act16(__m512 g, int act) {
    __m512 z = g;
    if (act == ACT_GELU_TANH) {
        const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        z = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f),
                          _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    }
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), z));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 act8(__m256 g, int act) {
    __m256 z = g;
    if (act == ACT_GELU_TANH) {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        z = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f),
                          _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    }
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), z));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

/* out [rows, inter] = act(gu[:, :inter]) * gu[:, inter:] (gu: the fused gate_up output,
 * [rows, 2 * inter]); act: 0 silu, 1 gelu (tanh approximation) */
void mw_gated_act(const float* gu, int64_t rows, int64_t inter, int act, float* out) {
    #pragma omp parallel for schedule(static) if (rows * inter >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gu + r * 2 * inter;
        const float* u = g + inter;
        float* o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(act16(_mm512_loadu_ps(g + i), act), _mm512_loadu_ps(u + i)));
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(act8(_mm256_loadu_ps(g + i), act), _mm256_loadu_ps(u + i)));
#endif
        for (; i < inter; i++) o[i] = (act == ACT_GELU_TANH ? gelu_tanh1(g[i]) : silu1(g[i])) * u[i];
    }
}

/* Rotate-half (NeoX / HF) rotary embedding in place: x [rows, heads, head_dim] (row stride
 * ld floats: q, k and v side by side in one buffer), row r at positions[r]; cos, sin
 * [max_positions, head_dim / 2]. Positions outside 0..max_positions - 1 -> MW_BAD_POSITION,
 * nothing written. */
int mw_rope(float* x, int64_t ld, const int64_t* positions, int64_t rows, int64_t heads,
            int64_t head_dim, const float* cos, const float* sin, int64_t max_positions) {
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return MW_BAD_POSITION;
    const int64_t half = head_dim / 2;
    #pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos + positions[r] * half;
        const float* s = sin + positions[r] * half;
        for (int64_t h = 0; h < heads; h++) {
            float* v = x + r * ld + h * head_dim;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= half; i += 16) {
                const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + half + i);
                const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
                _mm512_storeu_ps(v + i, _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si)));
                _mm512_storeu_ps(v + half + i, _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si)));
            }
#endif
            for (; i < half; i++) {
                const float a = v[i], b = v[half + i];
                v[i] = a * c[i] - b * s[i];
                v[half + i] = b * c[i] + a * s[i];
            }
        }
    }
    return MW_OK;
}
