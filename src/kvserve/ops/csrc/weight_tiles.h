// GGUF-quantized weights in the AMX GEMM's B-tile order, dequantized one tile at a time to the
// exact bf16 values the loader makes of them (model/weight_codes.py packs them).
//
// Why: a decode step reads every weight once, at the memory's rate. SmolLM2's GGUF stores its
// projections as Q4_1 (5 bits a weight) and its embedding as Q8_0 (8.5): streaming those codes
// and expanding them in L1 reads 3.2x / 1.9x fewer bytes than the bf16 weights, with the same
// products. The values are the loader's, bit for bit: gguf dequantizes in float32 as (d * q) + m
// and the loader rounds that to bf16 (nearest even), which is what the vectors below do, so a
// GEMM over the codes equals one over the bf16 weights.
//
// A tile is 32 k (one GGUF block of each column) x 16 columns, as the bf16 B tile's 16 rows of
// 32 lanes: row r holds k = 2r, 2r + 1 of each column n at lanes 2n, 2n + 1. In the codes, row r
// is 16 bytes (Q4_1: lane j in byte j's low nibble, lane 16 + j in its high one) or 32 (Q8_0:
// lane j in byte j), followed by the tile's 16 float16 scales d (and Q4_1's 16 minima m).
// A panel (16 columns) is its K / 32 tiles in k order.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace tiles {

enum Format { BF16 = 0, Q4_1 = 1, Q8_0 = 2 };

template <int FMT>
constexpr int64_t tile_bytes() { return FMT == Q4_1 ? 16 * 16 + 64 : 16 * 32 + 32; }

// Lanes 2n, 2n + 1 <- column n (lo: columns 0-7, hi: 8-15) of 16 per-column floats.
inline __m512 spread_lo(__m512 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
}
inline __m512 spread_hi(__m512 v) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

// Tile kb of panels p and p + 1 of `codes` into L2 (every line a tile touches: Q8_0's 544-byte
// tiles straddle line boundaries).
template <int FMT>
inline void prefetch(const void* codes, int64_t p, int64_t steps, int64_t kb) {
    constexpr int64_t TB = tile_bytes<FMT>();
    for (int64_t q = p; q < p + 2; ++q) {
        const uintptr_t t = (uintptr_t)codes + (uintptr_t)((q * steps + kb) * TB);
        for (uintptr_t line = t & ~(uintptr_t)63; line < t + TB; line += 64)
            _mm_prefetch((const char*)line, _MM_HINT_T1);
    }
}

// Tile kb of panel p of `codes` (a weight of `steps` = K / 32 tiles a panel) -> 16 x 32 bf16 at dst.
// d * q is exact in float32 (11 bits of d times at most 8 of q), so one fused multiply-add rounds
// d * q + m exactly as gguf's product-then-sum does.
template <int FMT>
inline void dequantize(const void* codes, int64_t p, int64_t steps, int64_t kb, uint16_t* dst) {
    const uint8_t* t = (const uint8_t*)codes + (p * steps + kb) * tile_bytes<FMT>();
    if constexpr (FMT == Q4_1) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 288)));
        const __m512 d0 = spread_lo(d), d1 = spread_hi(d), m0 = spread_lo(m), m1 = spread_hi(m);
        // q as float: VPERMPS reads only an index's low 4 bits, so the byte needs no mask
        const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int r = 0; r < 16; ++r) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(t + 16 * r)));
            const __m512 q0 = _mm512_permutexvar_ps(b, values);
            const __m512 q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
            const __m512 w0 = _mm512_fmadd_ps(q0, d0, m0), w1 = _mm512_fmadd_ps(q1, d1, m1);
            _mm512_store_si512((__m512i*)(dst + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
    } else {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(t + 512)));
        const __m512 d0 = spread_lo(d), d1 = spread_hi(d);
        for (int r = 0; r < 16; ++r) {
            const __m128i* row = (const __m128i*)(t + 32 * r);
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
            _mm512_store_si512((__m512i*)(dst + 32 * r),
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(q1, d1), _mm512_mul_ps(q0, d0)));
        }
    }
}

}  // namespace tiles
