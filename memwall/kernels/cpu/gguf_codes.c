/* GGUF blocks -> the codes of memwall's q4/q8 layouts at load (memwall/quant/gguf_repack.py
 * holds the same shuffles as torch byte operations, the reference the tests compare against).
 *
 * Why in C: torch's uint8 operations ran at ~3 ns a byte on a Cascade Lake Xeon (2 threads),
 * and Qwen2.5-Coder-1.5B Q4_K_M's repacking (Q4_K and Q6_K codes) took 3.5 s of a 10.7 s
 * load; a byte loop here is bound by reading the file's bytes once.
 *
 * Each function takes n blocks of `stride` bytes (a GGUF type's block size) and writes a
 * fixed number of code bytes a block; blocks are independent, so threads split them. */
#include "kernels.h"

/* Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 code bytes) -> 128 bytes a block in the q4
 * layout (per 32-value block byte j = q[j] | q[j + 16] << 4). Code chunk c's 32 bytes hold
 * values 64c + j (low nibbles) and 64c + 32 + j (high nibbles): our block 2c takes the low
 * nibbles of bytes j and j + 16, block 2c + 1 their high nibbles. */
void mw_gguf_q4_k_codes(const uint8_t* blocks, int64_t n, int64_t stride, uint8_t* out) {
    #pragma omp parallel for schedule(static) if (n >= 4096)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t* q = blocks + b * stride + 16;
        uint8_t* o = out + b * 128;
        for (int c = 0; c < 4; c++)
            for (int j = 0; j < 16; j++) {
                const uint8_t lo = q[32 * c + j], hi = q[32 * c + 16 + j];
                o[32 * c + j] = (uint8_t)((lo & 0x0F) | (hi << 4));
                o[32 * c + 16 + j] = (uint8_t)((lo >> 4) | (hi & 0xF0));
            }
    }
}

/* Q6_K (210 bytes: ql 128, qh 64, 16 int8 scales, d) -> 256 signed codes q - 32 a block
 * (ggml's dequantize_row_q6_K: per 128-value half, ql bytes a = 0..31 and b = 32..63 give the
 * low 4 bits, qh byte h the top 2 of values j, 32 + j, 64 + j, 96 + j). */
void mw_gguf_q6_k_codes(const uint8_t* blocks, int64_t n, int64_t stride, int8_t* out) {
    #pragma omp parallel for schedule(static) if (n >= 2048)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t* x = blocks + b * stride;
        int8_t* o = out + b * 256;
        for (int half = 0; half < 2; half++)
            for (int j = 0; j < 32; j++) {
                const uint8_t a = x[64 * half + j], bb = x[64 * half + 32 + j];
                const uint8_t h = x[128 + 32 * half + j];
                int8_t* t = o + 128 * half + j;
                t[0] = (int8_t)(((a & 0x0F) | ((h & 0x03) << 4)) - 32);
                t[32] = (int8_t)(((bb & 0x0F) | ((h & 0x0C) << 2)) - 32);
                t[64] = (int8_t)(((a >> 4) | (h & 0x30)) - 32);
                t[96] = (int8_t)(((bb >> 4) | ((h >> 2) & 0x30)) - 32);
            }
    }
}

/* Q5_0 / Q5_1 (qh: 4 bytes at qh_at, bit j the fifth bit of value j; qs: 16 bytes at qs_at,
 * value j's low 4 bits in byte j's low nibble, value 16 + j's in its high one) -> 32 codes
 * minus `bias` a block (Q5_0: 16, signed; Q5_1: 0). */
void mw_gguf_q5_codes(const uint8_t* blocks, int64_t n, int64_t stride, int64_t qh_at,
                      int64_t qs_at, int bias, int8_t* out) {
    #pragma omp parallel for schedule(static) if (n >= 8192)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t* x = blocks + b * stride;
        const uint32_t qh = (uint32_t)x[qh_at] | (uint32_t)x[qh_at + 1] << 8 |
                            (uint32_t)x[qh_at + 2] << 16 | (uint32_t)x[qh_at + 3] << 24;
        const uint8_t* qs = x + qs_at;
        int8_t* o = out + b * 32;
        for (int j = 0; j < 16; j++) {
            o[j] = (int8_t)(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - bias);
            o[16 + j] = (int8_t)(((qs[j] >> 4) | (((qh >> (16 + j)) & 1) << 4)) - bias);
        }
    }
}

/* Q4_K / Q5_K's 12-byte scale field (at byte 4 of a block) -> 8 six-bit scales and 8 mins a
 * block (ggml's get_scale_min_k4): sub-blocks 0..3 take the low 6 bits of bytes 0..3 (scales)
 * and 4..7 (mins); sub-blocks 4..7 the nibbles of bytes 8..11 and the spare top 2 bits of
 * bytes 0..7. */
void mw_gguf_k_scales(const uint8_t* blocks, int64_t n, int64_t stride, int8_t* scales,
                      int8_t* mins) {
    #pragma omp parallel for schedule(static) if (n >= 8192)
    for (int64_t b = 0; b < n; b++) {
        const uint8_t* s = blocks + b * stride + 4;
        int8_t* sc = scales + b * 8;
        int8_t* mn = mins + b * 8;
        for (int j = 0; j < 4; j++) {
            sc[j] = (int8_t)(s[j] & 0x3F);
            mn[j] = (int8_t)(s[4 + j] & 0x3F);
            sc[4 + j] = (int8_t)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
            mn[4 + j] = (int8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
        }
    }
}
