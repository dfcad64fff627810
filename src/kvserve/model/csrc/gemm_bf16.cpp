// The decoder's bf16 projections, y = x W^T, through AVX512-BF16 dot products (model/linear.py).
//
// Why: oneDNN's packed bf16 linear ran SmolLM2's 30 layers of projections at 57 % of this CPU's
// VDPBF16PS peak at 64 rows (a batch-64 decode step) and 4 % at 1 row (bench/NOTES.md, session
// 8). This plain register-tiled loop, with the weight packed once into the dot product's operand
// layout and the next panel prefetched while one computes, took 20-35 % less time from 1 to 128
// rows and the same at 2,048 (session 10).
//
// Layout: W [N, K] is packed into panels of 16 output columns, each [K/2][16][2]: for pair kp,
// the 16 columns' (W[n, 2kp], W[n, 2kp+1]), one 64-byte vector, which is VDPBF16PS's second
// operand. A tile of MR rows x 4 vectors (64 columns) keeps its 4 * MR float32 accumulators in
// registers over all of K: each step broadcasts one (x[m, 2kp], x[m, 2kp+1]) pair per row. The
// accumulators are rounded to bf16 (nearest even) once at the end.
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <algorithm>

namespace {

constexpr int NR = 4;  // vectors of 16 columns per tile: 64 columns

template <int MR>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, uint16_t* y, int64_t N, int64_t m0,
                 const char* prefetch, int64_t prefetch_lines) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t KP = K / 2;
    const uint16_t* panel = w + (n0 / 16) * KP * 32;
    for (int64_t kp = 0; kp < KP; ++kp) {
        if (kp < prefetch_lines) _mm_prefetch(prefetch + kp * 64, _MM_HINT_T1);
        __m512bh b[NR];
        for (int j = 0; j < NR; ++j) b[j] = (__m512bh)_mm512_loadu_si512(panel + (j * KP + kp) * 32);
        for (int i = 0; i < MR; ++i) {
            int32_t pair;  // (x[m, 2kp], x[m, 2kp + 1]), read without assuming 4-byte alignment
            memcpy(&pair, x + (m0 + i) * K + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j)
            _mm256_storeu_si256((__m256i*)(y + (m0 + i) * N + n0 + j * 16), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

}  // namespace

// W [N, K] bf16 -> the packed panels (N * K bf16). N % 64 == 0, K % 2 == 0.
extern "C" void gemm_bf16_pack(const uint16_t* W, int64_t N, int64_t K, uint16_t* packed) {
    const int64_t KP = K / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; ++nb)
        for (int64_t kp = 0; kp < KP; ++kp)
            for (int c = 0; c < 16; ++c) {
                const int64_t n = nb * 16 + c;
                uint16_t* d = packed + ((nb * KP + kp) * 16 + c) * 2;
                d[0] = W[n * K + 2 * kp];
                d[1] = W[n * K + 2 * kp + 1];
            }
}

// y [M, N] bf16 = x [M, K] bf16 (rows contiguous) times the packed W, transposed.
extern "C" void gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N, uint16_t* y) {
    if (M <= 0) return;
    // Work items: 64-column panels x chunks of up to 128 rows, so a prompt's rows spread over
    // every core even where a layer has few panels (576 columns: 9); a thread takes consecutive
    // items, i.e. the row chunks of one panel in turn, which then stays in its cache. Decode
    // batches up to 128 are one chunk and keep the prefetch below (48-row chunks lost it at 64
    // rows and ran 5-10 % slower on 2 cores).
    const int64_t blocks = N / 64, panel_bytes = NR * (K / 2) * 64, chunk = 128;
    const int64_t chunks = (M + chunk - 1) / chunk;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t m_end = std::min(M, (c + 1) * chunk), rows = m_end - c * chunk;
            const int64_t tiles = rows / 6 + (rows % 6) / 2 + rows % 2;
            const int64_t per_tile = (panel_bytes / 64 + tiles - 1) / tiles;
            // Decode sizes (one chunk): the next panel streams in from DRAM, spread over this
            // panel's tiles, one line per K step, while this one computes (else each panel's first
            // tile waits on DRAM). Prefetching all of it at 1-2 rows (up to 4 lines a step) was
            // no faster than oneDNN at 1 row; one a step, 10-20 % faster (session 10).
            const char* next = chunks == 1 && nb + 1 < blocks ? (const char*)packed + (nb + 1) * panel_bytes : nullptr;
            auto at = [&](int64_t i) { return next ? next + std::min(i * per_tile * 64, panel_bytes) : nullptr; };
            auto lines = [&](int64_t i) {
                return next ? std::max<int64_t>(0, std::min(per_tile, panel_bytes / 64 - i * per_tile)) : 0;
            };
            int64_t m = c * chunk, t = 0;
            for (; m + 6 <= m_end; m += 6, ++t) tile<6>(x, K, packed, nb * 64, y, N, m, at(t), lines(t));
            for (; m + 2 <= m_end; m += 2, ++t) tile<2>(x, K, packed, nb * 64, y, N, m, at(t), lines(t));
            for (; m < m_end; ++m, ++t) tile<1>(x, K, packed, nb * 64, y, N, m, at(t), lines(t));
        }
    }
}

extern "C" int gemm_bf16_available() { return 1; }
#else
extern "C" void gemm_bf16_pack(const uint16_t*, int64_t, int64_t, uint16_t*) {}
extern "C" void gemm_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*) {}
extern "C" int gemm_bf16_available() { return 0; }
#endif
