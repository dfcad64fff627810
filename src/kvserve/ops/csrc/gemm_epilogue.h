// The GEMMs' epilogues (gemm_bf16.cpp, gemm_amx.cpp): what happens to a row's 64 accumulated
// columns before they are stored. See gemm_bf16.cpp for the layouts the epilogues assume.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include "avx512_exp.h"
#include "bf16_vec.h"

namespace gemm {

constexpr int NR = 4;  // vectors of 16 columns per tile: 64 columns

enum EpilogueKind { PLAIN = 0, SILU_MUL = 1, ROPE = 2 };

struct Epilogue {
    int kind;
    int64_t ldy;  // y's row stride in elements (N, or N / 2 for SILU_MUL)
    const uint16_t* cos;  // ROPE: [M, head_dim] rows, and sin_signed = (-sin, sin) alike
    const uint16_t* sin;
    int64_t head_dim;
    int64_t rope_cols;  // ROPE: the first rope_cols columns (q and k heads) are rotated
};

inline Epilogue make_epilogue(int kind, int64_t N, const uint16_t* cos, const uint16_t* sin_signed,
                              int64_t head_dim, int64_t rope_cols) {
    return {kind, kind == SILU_MUL ? N / 2 : N, cos, sin_signed, head_dim, rope_cols};
}

// Row r's 64 accumulated columns of panel n0 (4 vectors) into y, as the epilogue says.
static inline void store_row(const __m512* acc, uint16_t* y, int64_t r, int64_t n0, const Epilogue& e) {
    uint16_t* yr = y + r * e.ldy;
    if (e.kind == SILU_MUL) {  // columns 0-31 gate, 32-63 up, of outputs n0 / 2 + [0, 32)
        for (int j = 0; j < 2; ++j) {
            const __m512 g = round_bf16(acc[j]), u = round_bf16(acc[j + 2]);
            const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                                          exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16(yr + n0 / 2 + 16 * j, _mm512_mul_ps(silu, u));
        }
        return;
    }
    if (e.kind == ROPE && n0 < e.rope_cols) {  // columns 0-31: d = i0 + [0, 32) of a head; 32-63: d + D / 2
        const int64_t D = e.head_dim, per_head = D / 64, head = (n0 / 64) / per_head;
        const int64_t i0 = ((n0 / 64) % per_head) * 32, lo = head * D + i0, hi = lo + D / 2;
        const uint16_t* c = e.cos + r * D;
        const uint16_t* s = e.sin + r * D;
        for (int j = 0; j < 2; ++j) {
            const __m512 a = round_bf16(acc[j]), b = round_bf16(acc[j + 2]);
            const int64_t dl = i0 + 16 * j, dh = D / 2 + i0 + 16 * j;
            store_bf16(yr + lo + 16 * j, _mm512_add_ps(round_bf16(_mm512_mul_ps(a, load_bf16(c + dl))),
                                                      round_bf16(_mm512_mul_ps(b, load_bf16(s + dl)))));
            store_bf16(yr + hi + 16 * j, _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load_bf16(c + dh))),
                                                      round_bf16(_mm512_mul_ps(a, load_bf16(s + dh)))));
        }
        return;
    }
    for (int j = 0; j < NR; ++j) store_bf16(yr + n0 + j * 16, acc[j]);
}

}  // namespace gemm
