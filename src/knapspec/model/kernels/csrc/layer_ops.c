/* The small per-layer operations of a decoder layer, one call each (knapspec).
 *
 * A decode step of a 135M model is ~1,200 tiny PyTorch operations besides its products:
 * RMSNorm alone is eight (cast, square, mean, add, rsqrt, multiply, cast, scale), rotary
 * fourteen, a K/V write two indexed copies. Each costs a few microseconds of dispatch
 * whatever the row count, which on a 2-core CPU was a fifth of a 16-row batched round.
 * Here each is one loop:
 *
 *   rms_norm   out = weight * cast(x * 1/sqrt(mean(x^2) + eps))   (Llama/Qwen/Mistral form)
 *              out = cast(x * 1/sqrt(mean(x^2) + eps) * (1 + weight))   (Gemma's unit offset)
 *   rotary     x = x * cos + rotate_half(x) * sin, in place, per token and head
 *   scatter    copy each token's K/V heads into its (row, position) of a cache buffer
 *
 * Rows never share arithmetic, so each is row-invariant by construction (the exactness
 * contract: a row's result does not depend on what else is in the call). Rotary and the
 * scatter are bitwise PyTorch's (element-wise, each operation rounded to the tensor's
 * dtype as PyTorch rounds it). RMSNorm's mean is within a unit in the last place of
 * PyTorch's, not bitwise (another summation order), so an engine normalises with it on
 * every path or on none. (A SiLU-and-multiply loop here ran slower than PyTorch's two
 * vectorised operations at 16 rows and was dropped.)
 *
 * float32 and bfloat16 (dtype 0 / 1); bfloat16 is widened to float32 and rounded back to
 * nearest even where PyTorch rounds. Built with -ffp-contract=off so that a*b+c stays two
 * roundings. Plain C; called through ctypes, which releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"

/* Row buffers: a row is widened to float32 into one of these, worked on, and narrowed
 * back; every loop over one runs the same arithmetic per element and vectorises. */
#define MAX_WIDTH 16384

static inline void widen(const void *src, int64_t n, int dtype, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static inline void narrow(const float *src, int64_t n, int dtype, void *dst) {
    if (dtype == DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* In place: each value rounded to the dtype and widened again (what PyTorch's result of
 * one operation on tensors of that dtype holds). */
static inline void round_to(float *v, int64_t n, int dtype) {
    if (dtype != DTYPE_BF16) return;
    for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

static inline int64_t element_size(int dtype) { return dtype == DTYPE_BF16 ? 2 : 4; }

static inline const char *at(const void *base, int64_t element, int dtype) {
    return (const char *)base + element * element_size(dtype);
}

/* RMSNorm of rows x[r, 0:d] (row stride x_stride elements) into out[r, 0:d] (contiguous):
 * variance in float32 (squares summed in 16 interleaved partial sums, then those by a
 * fixed tree), normalised in float32, cast to the dtype, times the weight in the dtype.
 * With unit_offset (Gemma's form) the normalised row stays in float32 and is scaled by
 * 1 + weight (the weight widened first) before the one cast to the dtype. */
int knapspec_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t d,
                      int64_t x_stride, float eps, int dtype, int threads, int unit_offset) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (d > MAX_WIDTH || d < 1) return 2;
    if (threads < 1) threads = 1;
    float w[MAX_WIDTH];
    widen(weight, d, dtype, w);
    if (unit_offset)
        for (int64_t i = 0; i < d; i++) w[i] = 1.0f + w[i];
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[MAX_WIDTH];
        widen(at(x, r * x_stride, dtype), d, dtype, v);
        float partial[16] = {0};
        int64_t full = d - d % 16;
        for (int64_t i = 0; i < full; i += 16)
            for (int j = 0; j < 16; j++) partial[j] += v[i + j] * v[i + j];
        for (int64_t i = full; i < d; i++) partial[i - full] += v[i] * v[i];
        for (int width = 8; width >= 1; width /= 2)
            for (int j = 0; j < width; j++) partial[j] += partial[j + width];
        float scale = 1.0f / sqrtf(partial[0] / (float)d + eps);
        for (int64_t i = 0; i < d; i++) v[i] = v[i] * scale;
        if (!unit_offset) round_to(v, d, dtype);
        for (int64_t i = 0; i < d; i++) v[i] = w[i] * v[i];
        narrow(v, d, dtype, (char *)out + r * d * element_size(dtype));
    }
    return 0;
}

/* Rotary embedding in place on tokens x[t] (token stride x_stride elements), each holding
 * `heads` heads of head_dim side by side from its start, with token t's cos/sin rows
 * cos[t, 0:head_dim] and sin[t, 0:head_dim] (contiguous): HF's
 * x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]), each product
 * and the sum rounded to the dtype as PyTorch rounds them. */
int knapspec_rotary(void *x, const void *cos, const void *sin, int64_t tokens, int64_t heads,
                    int64_t head_dim, int64_t x_stride, int dtype) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (head_dim % 2 || head_dim > 1024 || heads * head_dim > MAX_WIDTH) return 2;
    int64_t half = head_dim / 2, width = heads * head_dim;
    float c[1024], s[1024], v[MAX_WIDTH], left[MAX_WIDTH], right[MAX_WIDTH];
    for (int64_t t = 0; t < tokens; t++) {
        widen(at(cos, t * head_dim, dtype), head_dim, dtype, c);
        widen(at(sin, t * head_dim, dtype), head_dim, dtype, s);
        char *row = (char *)x + t * x_stride * element_size(dtype);
        widen(row, width, dtype, v);
        for (int64_t h = 0; h < width; h += head_dim) {
            for (int64_t i = 0; i < half; i++) {
                left[h + i] = v[h + i] * c[i];
                right[h + i] = -v[h + half + i] * s[i];
                left[h + half + i] = v[h + half + i] * c[half + i];
                right[h + half + i] = v[h + i] * s[half + i];
            }
        }
        round_to(left, width, dtype);
        round_to(right, width, dtype);
        for (int64_t i = 0; i < width; i++) v[i] = left[i] + right[i];
        narrow(v, width, dtype, row);
    }
    return 0;
}

/* Copy token t's heads x head_dim values (source token stride src_token, heads side by
 * side, elements contiguous) to dst[row[t], head, position[t], :] of a cache buffer laid
 * out (slots, heads, capacity, head_dim), contiguous. Bitwise a copy; an index outside the
 * buffer writes nothing and returns 3. */
int knapspec_scatter(const void *src, void *dst, const int64_t *row, const int64_t *position,
                     int64_t tokens, int64_t heads, int64_t head_dim, int64_t src_token,
                     int64_t slots, int64_t capacity, int64_t element_size) {
    if (element_size != 2 && element_size != 4) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (row[t] < 0 || row[t] >= slots || position[t] < 0 || position[t] >= capacity) return 3;
    size_t bytes = (size_t)(head_dim * element_size);
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const char *from = (const char *)src + (t * src_token + h * head_dim) * element_size;
            char *to = (char *)dst +
                       (((row[t] * heads + h) * capacity + position[t]) * head_dim) * element_size;
            memcpy(to, from, bytes);
        }
    }
    return 0;
}
