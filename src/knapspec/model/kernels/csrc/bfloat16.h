/* bfloat16 <-> float32 and the dtype codes, shared by knapspec's compiled kernels.
 *
 * bf16 is the top half of a float32: widening is exact; narrowing rounds to nearest even
 * (as PyTorch rounds) and keeps a NaN a NaN (quiet). Each kernel's cache key hashes this
 * header with its source (knapspec.model.kernels.compiled), so editing it rebuilds them all.
 */
#ifndef KNAPSPEC_BFLOAT16_H
#define KNAPSPEC_BFLOAT16_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)((bits + rounding) >> 16);
}

#endif
