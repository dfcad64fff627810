// bf16 <-> float32 for 16 lanes on AVX-512, shared by the elementwise passes and the GEMM's
// epilogues (their roundings must agree bit for bit: the epilogues replace those passes).
#pragma once
#include <immintrin.h>
#include <stdint.h>

static inline __mmask16 tail16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

static inline __m512 load_bf16(const uint16_t* p, __mmask16 k) {  // k of 16 bf16 -> float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

static inline __m512 load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

static inline void store_bf16(uint16_t* p, __m512 x, __mmask16 k) {  // rounded to nearest even
    _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(x));
}

static inline void store_bf16(uint16_t* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(x)); }

static inline __m512 round_bf16(__m512 x) {  // x rounded to bf16, kept in float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
