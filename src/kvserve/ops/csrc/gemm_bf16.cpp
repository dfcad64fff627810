// The decoder's bf16 projections, y = x W^T, through AVX512-BF16 dot products (model/linear.py).
//
// Why: oneDNN's packed bf16 linear ran SmolLM2's 30 layers of projections at 57 % of this CPU's
// VDPBF16PS peak at 64 rows (a batch-64 decode step) and 4 % at 1 row (bench/NOTES.md, "Without
// AMX: gemm_bf16.cpp, a register-tiled VDPBF16PS loop"). This plain register-tiled loop, with the weight packed once into the dot product's operand
// layout and the next panel prefetched while one computes, took 20-35 % less time from 1 to 128
// rows and the same at 2,048 (same note).
//
// Layout (gemm_bf16_pack_steps): W [N, K] is packed by 64 output columns into [K/2][4][16][2]:
// for pair kp, each 16 columns' (W[n, 2kp], W[n, 2kp+1]) is one 64-byte vector, VDPBF16PS's
// second operand, and a K step's four vectors are adjacent, so a tile reads its weight as one
// forward stream. (gemm_bf16_pack, the AMX kernel's B-tile layout, keeps each 16 columns' K
// steps together instead: four streams 16 * K bytes apart, which at 1 row streamed 10-15 %
// slower here, bench/NOTES.md, "gemm_bf16: the weight as one forward stream, decode units
// balanced over threads".) A tile of MR rows x 4 vectors (64 columns) keeps
// its 4 * MR float32 accumulators in registers over all of K: each step broadcasts one
// (x[m, 2kp], x[m, 2kp+1]) pair per row. The accumulators are rounded to bf16 (nearest even)
// once at the end.
//
// Epilogues: the gate/up projection can leave SiLU(gate) * up instead of both halves, and the
// q/k/v projection can leave q and k rotated (RoPE). A prompt chunk's elementwise passes then
// never re-read a 2,048-row output from memory (model/linear.py). Each packs the weight's output
// rows permuted so that a tile's 64 columns hold what the epilogue combines: 32 gate columns and
// the same 32 up columns; or the 32 + 32 columns a rotation pairs, d and d + head_dim / 2 of one
// head. The arithmetic and roundings are the unfused passes' (elementwise_bf16.cpp), bit for bit.
#include <stdint.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <algorithm>
#include "gemm_epilogue.h"

namespace {

using namespace gemm;

template <int MR>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t n0, uint16_t* y, const Epilogue& e,
                 int64_t m0, const char* prefetch, int64_t prefetch_lines) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t KP = K / 2;
    const uint16_t* block = w + (n0 / 16) * KP * 32;  // the tile's 64 columns: [KP][NR][16][2]
    for (int64_t kp = 0; kp < KP; ++kp) {
        if (kp < prefetch_lines) _mm_prefetch(prefetch + kp * 64, _MM_HINT_T1);
        __m512bh b[NR];
        for (int j = 0; j < NR; ++j) b[j] = (__m512bh)_mm512_loadu_si512(block + (kp * NR + j) * 32);
        for (int i = 0; i < MR; ++i) {
            int32_t pair;  // (x[m, 2kp], x[m, 2kp + 1]), read without assuming 4-byte alignment
            memcpy(&pair, x + (m0 + i) * K + 2 * kp, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < MR; ++i) store_row(acc[i], y, m0 + i, n0, e);
}

}  // namespace

// W [N, K] bf16 -> (W[n, 2kp], W[n, 2kp+1]) pairs by groups of P output columns, [N/P][K/2][P][2].
static void pack_pairs(const uint16_t* W, int64_t N, int64_t K, uint16_t* packed, int64_t P) {
    const int64_t KP = K / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / P; ++nb)
        for (int64_t kp = 0; kp < KP; ++kp)
            for (int64_t c = 0; c < P; ++c) {
                const int64_t n = nb * P + c;
                uint16_t* d = packed + ((nb * KP + kp) * P + c) * 2;
                d[0] = W[n * K + 2 * kp];
                d[1] = W[n * K + 2 * kp + 1];
            }
}

// The AMX kernel's layout (N * K bf16): panels of 16 columns, [K/2][16][2] each (one B tile per 16
// k-pairs). N % 64 == 0, K % 2 == 0.
extern "C" void gemm_bf16_pack(const uint16_t* W, int64_t N, int64_t K, uint16_t* packed) {
    pack_pairs(W, N, K, packed, 16);
}

// gemm_bf16's layout (the file's header says why): per 64 columns [K/2][4][16][2].
extern "C" void gemm_bf16_pack_steps(const uint16_t* W, int64_t N, int64_t K, uint16_t* packed) {
    pack_pairs(W, N, K, packed, 64);
}

namespace {

constexpr int64_t CHUNK_ROWS = 128;

// Rows [c * CHUNK_ROWS, ...) of x against panel nb (64 columns), tile by tile: the chunk's tiles
// [t0, t1) of 6 rows (the last one 1-5), all of them by default. `next`: the next panel,
// prefetched over the tiles while this one computes (decode sizes, see gemm_bf16).
void panel_chunk(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t nb, int64_t c,
                 uint16_t* y, const Epilogue& e, const char* next, int64_t t0 = 0, int64_t t1 = INT64_MAX) {
    const int64_t panel_bytes = NR * (K / 2) * 64;
    const int64_t m_end = std::min(M, (c + 1) * CHUNK_ROWS), rows = m_end - c * CHUNK_ROWS;
    t1 = std::min(t1, (rows + 5) / 6);
    const int64_t tiles = t1 - t0;
    if (tiles <= 0) return;
    const int64_t per_tile = (panel_bytes / 64 + tiles - 1) / tiles;
    auto at = [&](int64_t i) { return next ? next + std::min(i * per_tile * 64, panel_bytes) : nullptr; };
    auto lines = [&](int64_t i) {
        return next ? std::max<int64_t>(0, std::min(per_tile, panel_bytes / 64 - i * per_tile)) : 0;
    };
    const int64_t m_stop = std::min(m_end, c * CHUNK_ROWS + 6 * t1);
    int64_t m = c * CHUNK_ROWS + 6 * t0, t = 0;
    for (; m + 6 <= m_stop; m += 6, ++t) tile<6>(x, K, packed, nb * 64, y, e, m, at(t), lines(t));
    // The last 1-5 rows as one tile: two tiles of 2 rows (8 accumulators, bound by VDPBF16PS's
    // latency) took as long as one of 4 (16 accumulators, bound by its throughput).
    switch (m_stop - m) {
        case 5: tile<5>(x, K, packed, nb * 64, y, e, m, at(t), lines(t)); break;
        case 4: tile<4>(x, K, packed, nb * 64, y, e, m, at(t), lines(t)); break;
        case 3: tile<3>(x, K, packed, nb * 64, y, e, m, at(t), lines(t)); break;
        case 2: tile<2>(x, K, packed, nb * 64, y, e, m, at(t), lines(t)); break;
        case 1: tile<1>(x, K, packed, nb * 64, y, e, m, at(t), lines(t)); break;
        default: break;
    }
}

}  // namespace

// y [M, N] bf16 = x [M, K] bf16 (rows contiguous) times the packed W, transposed; then the
// epilogue `kind` (y [M, N / 2] for SILU_MUL). cos / sin_signed / head_dim / rope_cols: ROPE only.
extern "C" void gemm_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                          uint16_t* y, int kind, const uint16_t* cos, const uint16_t* sin_signed,
                          int64_t head_dim, int64_t rope_cols) {
    if (M <= 0) return;
    const Epilogue e = make_epilogue(kind, N, cos, sin_signed, head_dim, rope_cols);
    // Decode batches up to 128 rows are one chunk and keep the next panel's prefetch (48-row
    // chunks lost it at 64 rows and ran 5-10 % slower on 2 cores).
    const int64_t blocks = N / 64, panel_bytes = NR * (K / 2) * 64;
    const int64_t chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
    if (chunks == 1) {
        // Decode sizes: each thread takes a contiguous run of (panel, 6-row tile) units, so a
        // layer whose panels do not divide evenly (576 columns: 9 panels) still splits evenly:
        // by whole panels, one of 2 threads had 5 of 9 (bench/NOTES.md, "gemm_bf16: the
        // weight as one forward stream, decode units balanced over threads"). The next
        // panel of the run streams in from DRAM, spread over this panel's tiles, one line per
        // K step, while this one computes (else each panel's first tile waits on DRAM).
        // Prefetching all of it at 1-2 rows (up to 4 lines a step) was no faster than oneDNN at
        // 1 row; one a step, 10-20 % faster.
        const int64_t tiles = (M + 5) / 6, units = blocks * tiles;
        #pragma omp parallel
        {
            const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int64_t u0 = units * id / nt, u1 = units * (id + 1) / nt;
            for (int64_t nb = u0 / tiles; nb * tiles < u1; ++nb) {
                const int64_t t0 = std::max<int64_t>(u0 - nb * tiles, 0), t1 = std::min<int64_t>(u1 - nb * tiles, tiles);
                const char* next = (nb + 1) * tiles < u1 ? (const char*)packed + (nb + 1) * panel_bytes : nullptr;
                panel_chunk(x, M, K, packed, nb, 0, y, e, next, t0, t1);
            }
        }
        return;
    }
    // Prompt sizes: 64-column panels x chunks of up to 128 rows, so a prompt's rows spread over
    // every core even where a layer has few panels; a thread takes consecutive items, i.e. the
    // row chunks of one panel in turn, which then stays in its cache.
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb)
        for (int64_t c = 0; c < chunks; ++c) panel_chunk(x, M, K, packed, nb, c, y, e, nullptr);
}

extern "C" int gemm_bf16_available() { return 1; }
#else
extern "C" void gemm_bf16_pack(const uint16_t*, int64_t, int64_t, uint16_t*) {}
extern "C" void gemm_bf16_pack_steps(const uint16_t*, int64_t, int64_t, uint16_t*) {}
extern "C" void gemm_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*, int,
                          const uint16_t*, const uint16_t*, int64_t, int64_t) {}
extern "C" int gemm_bf16_available() { return 0; }
#endif
