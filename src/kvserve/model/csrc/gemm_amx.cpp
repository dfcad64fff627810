// The decoder's bf16 projections on CPUs with AMX (Sapphire Rapids and later): y = x W^T through
// TDPBF16PS tile products, with gemm_bf16.cpp's packed weight and epilogues (model/linear.py).
//
// Why not oneDNN, which also uses AMX: its packed linear ran SmolLM2's projections at 1 row 2.4x
// slower than this CPU's memory allows (12 ms for 30 layers), and it cannot fuse the SiLU * up and
// rotary epilogues; why not gemm_bf16.cpp: VDPBF16PS issues at half the rate of a float32 FMA on
// these cores (0.11 TFLOP/s per core, against AMX's ~1 per core measured by oneDNN).
//
// The packed weight needs no other layout: a 16-column panel is [K/2][16][2], so 16 consecutive
// k-pairs of it (32 k) are one B tile (16 rows of 64 bytes, VNNI order), 1 KB contiguous.
// A work item is up to 32 rows of x by one 64-column group (four panels): per 32-column half,
// C is 2 x 2 tiles (rows 0-15 / 16-31 by panels), A two tiles of x's rows, B two panels' tiles,
// i.e. all 8 tile registers; the float32 C tiles go to a scratch block [32][64] that the shared
// epilogue (gemm_epilogue.h) then rounds, combines and stores row by row.
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <algorithm>
#include <initializer_list>
#include "amx.h"
#include "gemm_epilogue.h"

namespace {

using namespace gemm;

constexpr int MB = 32;  // rows per work item: two tile heights

// Tiles: 0-3 C (rows 0-15 x panel a, rows 0-15 x panel b, rows 16-31 x a, 16-31 x b), 4-5 A
// (rows 0-15, 16-31), 6-7 B (panels a, b). `mr` rows: the second row tiles are unused below 17.
void configure(int mr) {
    amx::TileConfig c;
    const uint8_t r0 = (uint8_t)std::min(mr, 16), r1 = (uint8_t)std::max(mr - 16, 0);
    for (int t : {0, 1, 4}) { c.rows[t] = r0; c.colsb[t] = 64; }
    if (r1)
        for (int t : {2, 3, 5}) { c.rows[t] = r1; c.colsb[t] = 64; }
    for (int t : {6, 7}) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

// Rows [m0, m0 + mr) of x by the 64 columns of group nb (panels 4nb .. 4nb + 3).
void item(const uint16_t* x, int64_t K, const uint16_t* packed, int64_t nb, int64_t m0, int mr,
          uint16_t* y, const Epilogue& e, float* scr /* [MB][64] */) {
    const int64_t KP = K / 2, ldx = K * 2;
    const uint16_t* xa = x + m0 * K;
    const uint16_t* xb = xa + 16 * K;
    for (int half = 0; half < 2; ++half) {
        const uint16_t* pa = packed + (4 * nb + 2 * half) * KP * 32;
        const uint16_t* pb = pa + KP * 32;
        _tile_zero(0);
        _tile_zero(1);
        if (mr > 16) { _tile_zero(2); _tile_zero(3); }
        for (int64_t kb = 0; kb < K / 32; ++kb) {
            _tile_loadd(4, xa + 32 * kb, ldx);
            _tile_loadd(6, pa + kb * 16 * 32, 64);
            _tile_loadd(7, pb + kb * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (mr > 16) {
                _tile_loadd(5, xb + 32 * kb, ldx);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float* s = scr + 32 * half;  // C tile (i, j) at rows 16i, columns 32 half + 16j; 256-byte rows
        _tile_stored(0, s, 256);
        _tile_stored(1, s + 16, 256);
        if (mr > 16) {
            _tile_stored(2, s + 16 * 64, 256);
            _tile_stored(3, s + 16 * 64 + 16, 256);
        }
    }
    for (int r = 0; r < mr; ++r) {
        __m512 acc[NR];
        for (int j = 0; j < NR; ++j) acc[j] = _mm512_load_ps(scr + r * 64 + 16 * j);
        store_row(acc, y, m0 + r, nb * 64, e);
    }
}

}  // namespace

// gemm_bf16's contract (same packed weight, same epilogues), for K % 32 == 0.
extern "C" void gemm_bf16_amx(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                              uint16_t* y, int kind, const uint16_t* cos, const uint16_t* sin_signed,
                              int64_t head_dim, int64_t rope_cols) {
    if (M <= 0) return;
    const Epilogue e = make_epilogue(kind, N, cos, sin_signed, head_dim, rope_cols);
    const int64_t groups = N / 64, chunks = (M + MB - 1) / MB;
    // Items ordered (row super-chunk of 8 items, column group, chunk): a super-chunk's rows of x
    // (256 x K bf16) stay in L2 while every column group passes over them.
    constexpr int64_t SUPER = 8;
    const int64_t supers = (chunks + SUPER - 1) / SUPER;
    #pragma omp parallel
    {
        alignas(64) float scr[MB * 64];
        int configured = -1;
        #pragma omp for collapse(2) schedule(static)
        for (int64_t sc = 0; sc < supers; ++sc)
            for (int64_t nb = 0; nb < groups; ++nb)
                for (int64_t c = sc * SUPER; c < std::min(chunks, (sc + 1) * SUPER); ++c) {
                    const int mr = (int)std::min<int64_t>(MB, M - c * MB);
                    if (mr != configured) { configure(mr); configured = mr; }
                    item(x, K, packed, nb, c * MB, mr, y, e, scr);
                }
        if (configured >= 0) _tile_release();
    }
}

extern "C" int gemm_amx_available() { return amx::permitted() ? 1 : 0; }
#else
extern "C" void gemm_bf16_amx(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*, int,
                              const uint16_t*, const uint16_t*, int64_t, int64_t) {}
extern "C" int gemm_amx_available() { return 0; }
#endif
