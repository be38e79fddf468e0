/* bfloat16 for the CPU kernels, stored as uint16_t: a bf16 value is the top half of a float32.
   Widening is a 16-bit shift (exact); narrowing rounds to nearest even as torch's
   .to(torch.bfloat16) does, any NaN becoming torch's quiet NaN 0x7fc0. Integer code only: the
   compiler vectorizes it at every ISA, no BF16 instructions needed. Bits are tested as integers,
   so -ffast-math's finite-math assumption cannot drop the NaN case. */

#ifndef BATCHGEN_BF16_H
#define BATCHGEN_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0u;
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void widen_bf16(const bf16_t *src, float *dst, long n) {
    for (long i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void narrow_bf16(const float *src, bf16_t *dst, long n) {
    for (long i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

#endif
