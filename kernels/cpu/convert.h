/* The half-width floats the kernels read and write, converted in one place: bf16 (the KV pool at
 * --kv-cache-dtype bf16, bf16 weight rows, a bf16 GEMM's activations) and fp16 (GGUF block scales, F16 rows).
 * Widening is exact; narrowing rounds to nearest even, as torch does, a NaN staying a quiet NaN. */
#ifndef PAGEDSERVE_CONVERT_H
#define PAGEDSERVE_CONVERT_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* bf16 bits -> fp32: the 16 bits are fp32's upper half. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* NaN: quiet, sign kept */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* float_to_bf16 without a branch (a loop of it vectorizes): the same result. */
static inline uint16_t float_to_bf16_nobranch(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t nearest = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, quiet = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
}

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
/* Eight bf16 or fp16 values at p (any alignment) -> eight fp32 lanes, exactly. */
static inline __m256 bf16x8_to_ps(const void* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 halfx8_to_ps(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

/* An fp16 stored as two bytes at any alignment (a GGUF block's scale) -> fp32. */
static inline float half_at(const uint8_t* h) {
    uint16_t v;
    memcpy(&v, h, 2);
    return half_to_float(v);
}

/* fp32 -> fp16 bits, rounded to nearest even (only exact values reach it here: -8 d of a Q4_0 block). */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0); /* inf, NaN */
    if (ax >= 0x477ff000) return sign | 0x7c00;                                  /* rounds past 65504 */
    if (ax < 0x38800000) {                                                        /* fp16 subnormal or 0 */
        if (ax < 0x33000000) return sign;
        const uint32_t mant = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
        uint32_t h = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1))) h++;
        return sign | (uint16_t)h;
    }
    uint32_t h = ((ax >> 13) - (112u << 10));
    const uint32_t rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
#endif
}

#endif
