/* The KV pool's rows in either of its element types: fp32, or bf16 (--kv-cache-dtype bf16: half the bytes a
 * long context reads). The attention kernels widen a block's bf16 rows into an fp32 scratch that stays in L1
 * and run their fp32 code on it, so the pool is read at half the bytes and the arithmetic is unchanged.
 * The conversions are convert.h's: bf16 -> fp32 exact, fp32 -> bf16 to nearest even, as torch converts,
 * a NaN staying a (quiet) NaN. */
#ifndef PAGEDSERVE_KV_ROWS_H
#define PAGEDSERVE_KV_ROWS_H
#include <stdint.h>
#include <string.h>

#include "convert.h"

/* dst[0..n) = the n values at src, element `at` on (bf16: uint16 elements, else floats). */
static inline void kv_widen(const void* src, int64_t at, int bf16, float* dst, int n) {
    if (!bf16) {
        memcpy(dst, (const float*)src + at, sizeof(float) * (size_t)n);
        return;
    }
    const uint16_t* s = (const uint16_t*)src + at;
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
}


/* The n values of src stored at element `at` of dst (bf16: rounded to nearest even). */
static inline void kv_store(void* dst, int64_t at, int bf16, const float* src, int n) {
    if (!bf16) {
        memcpy((float*)dst + at, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t* d = (uint16_t*)dst + at;
#pragma omp simd
    for (int i = 0; i < n; i++) d[i] = float_to_bf16_nobranch(src[i]);
}

/* Ask the cache for n elements of a row (bf16 or fp32) at element `at`. */
static inline void kv_prefetch(const void* base, int64_t at, int bf16, int n) {
    const char* p = (const char*)base + at * (bf16 ? 2 : 4);
    const int bytes = n * (bf16 ? 2 : 4);
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}
#endif
