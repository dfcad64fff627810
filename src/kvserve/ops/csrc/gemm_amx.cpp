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
//
// Why the loop order is what it is (bench/NOTES.md, "AMX GEMM loop order: a column group over a
// super-chunk, half by half, K slab by slab"): with C in 2 x 2 tiles, every four
// 16-cycle products load 2 KB of A and 2 KB of B. From L1 that runs at ~75 % of the tile peak;
// from L2 at ~40 %, which is where an item-by-item order left both operands. So a unit of work is
// one 64-column group (one 32-column half where the epilogue is PLAIN) over a super-chunk of up to
// 16 row chunks (32 rows each), and it runs half by half (32 columns, two panels), K slab by K
// slab (<= 18 k-steps, 36 KB of B), chunk by chunk: the slab of B is reused from L1 by every
// chunk, and A is loaded with TILELOADDT1 (a hint not to keep it in L1) so that A's stream does
// not evict it. A chunk's C tiles go to a float scratch
// between slabs and halves. A lone chunk (decode batches <= 32 rows) has the roles swapped: its
// rows of x are what every group reuses, so there B is the streamed operand.
// The epilogue (rounding, SiLU * up, rotary) of chunk c runs two rows per k-step inside chunk
// c + 1's last pass: vector work the core can overlap with the tile products, where run after
// them it cost 20-40 % of the GEMM.
// gemm_q4_1_amx / gemm_q8_0_amx run the same loops over a weight kept as GGUF codes
// (weight_tiles.h): the first chunk's pass expands each B tile into a per-thread L1 buffer, and
// every chunk reads it from there; the outputs equal gemm_bf16_amx's over the dequantized weight.
#include <stdint.h>
#include <string.h>
#include "gemm_grouped.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdlib.h>
#include <algorithm>
#include <initializer_list>
#include "amx.h"
#include "gemm_epilogue.h"
#include "weight_tiles.h"

namespace {

using namespace gemm;

constexpr int MB = 32;          // rows per chunk: two tile heights
constexpr int64_t SLAB = 18;    // k-steps per K slab: two panels' slab is 36 KB, L1 holds it
constexpr int64_t MAX_SUPER = 16;
// GGUF codes: B tiles expanded this many k-steps ahead of the products that read them. At one, a
// tile load waits on stores that retire only after the previous k-step's products; 2, 4 and 8
// measured alike (bench/NOTES.md, "GGUF weight codes as the only weight on AMX, expanded to bf16
// tiles eight k-steps ahead").
constexpr int64_t AHEAD = 8;
constexpr int64_t SUPER_BYTES = 768 * 1024;  // a super-chunk's rows of x, kept in L2

// Tiles: 0-3 C (rows 0-15 x panel a, rows 0-15 x panel b, rows 16-31 x a, 16-31 x b), 4-5 A
// (rows 0-15, 16-31), 6-7 B (panels a, b). `mr` rows: the second row tiles are unused below 17.
// Must stay inlined: outlined, LDTILECFG read its operand from a red zone and faulted.
inline __attribute__((always_inline)) void configure(int mr) {
    amx::TileConfig c;
    const uint8_t r0 = (uint8_t)std::min(mr, 16), r1 = (uint8_t)std::max(mr - 16, 0);
    for (int t : {0, 1, 4}) { c.rows[t] = r0; c.colsb[t] = 64; }
    if (r1)
        for (int t : {2, 3, 5}) { c.rows[t] = r1; c.colsb[t] = 64; }
    for (int t : {6, 7}) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

struct Gemm {
    const uint16_t* x;
    int64_t M, K, N;
    const void* packed;  // bf16 panels, or GGUF codes in tile order (weight_tiles.h)
    uint16_t* y;
    Epilogue e;
    const LoRAExt* lora;  // null: none
};

// The LoRA k-steps of chunk c (rows c * MB .. + mr) for the two panels from `panel`: for each
// adapter among the rows, s's block of that slot (zeros on the other rows) times its B panels,
// into C tiles 0-3. A panel's B holds `rank` k; the tile reads 32, and where rank is less, the
// next panel's values meet s's zero columns (finite x 0: nothing added).
inline void lora_steps(const Gemm& g, int64_t c, int mr, int64_t panel) {
    const LoRAExt& L = *g.lora;
    const int64_t r0 = c * MB, steps = (L.rank + 31) / 32, koff = L.panel_koff[panel];
    int32_t prev = -1;
    for (int64_t r = r0; r < r0 + mr; ++r) {
        const int32_t j = L.row_slot[r];
        if (j < 0 || j == prev) continue;
        prev = j;
        const uint16_t* sa = L.s + r0 * L.ld_s + j * L.block + koff;
        const uint16_t* pa = L.b + j * L.b_slot_stride + panel * (L.rank / 2) * 32;
        const uint16_t* pb = pa + (L.rank / 2) * 32;
        for (int64_t kb = 0; kb < steps; ++kb) {
            _tile_loadd(4, sa + 32 * kb, L.ld_s * 2);
            _tile_loadd(6, pa + kb * 16 * 32, 64);
            _tile_loadd(7, pb + kb * 16 * 32, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (mr > 16) {
                _tile_loadd(5, sa + 16 * L.ld_s + 32 * kb, L.ld_s * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
}

// Row r's epilogue from the scratch row holding its 64 float32 columns (only half h0's 32 where
// the unit covers one half, which only a PLAIN epilogue allows).
inline void finish_row(const Gemm& g, const float* sr, int64_t r, int64_t nb, int h0, int h1) {
    if (h1 - h0 == 1) {
        const int panels = g.N - nb * 64 - 32 * h0 == 16 ? 1 : 2;  // N % 32 == 16: the last half is one panel
        for (int j = 0; j < panels; ++j)
            store_bf16(g.y + r * g.e.ldy + nb * 64 + 32 * h0 + 16 * j, _mm512_load_ps(sr + 32 * h0 + 16 * j));
        return;
    }
    __m512 acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_load_ps(sr + 16 * j);
    store_row(acc, g.y, r, nb * 64, g.e);
}

// Halves [h0, h1) of column group nb (panels 4nb + 2h .. 4nb + 2h + 1 for half h) over chunks
// [c0, c1); scr holds [c1 - c0][MB][64] floats.
template <int FMT>
void unit(const Gemm& g, int64_t nb, int h0, int h1, int64_t c0, int64_t c1, float* scr, uint16_t* bbuf,
          int& configured) {
    const int64_t K = g.K, KP = K / 2, ldx = K * 2, steps = K / 32;
    const int64_t slabs = (steps + SLAB - 1) / SLAB;
    const bool stream_b = FMT == tiles::BF16 && c1 - c0 == 1;
    const int64_t row0 = c0 * MB;
    int64_t pending = row0, pending_end = row0;  // rows whose epilogue has not run yet
    for (int half = h0; half < h1; ++half) {
        const int64_t panel = 4 * nb + 2 * half;
        for (int64_t s = 0; s < slabs; ++s) {
            const int64_t kb0 = s * steps / slabs, kb1 = (s + 1) * steps / slabs;
            // B tile kb of the half's two panels is at pa / pb + (kb - boff) * 512: in the packed
            // weight, or expanded from the codes into bbuf (slab-relative) AHEAD k-steps ahead of
            // the first chunk's products, for every later chunk to reuse from L1.
            const bool codes = FMT != tiles::BF16;
            const uint16_t* pa = codes ? bbuf : (const uint16_t*)g.packed + panel * KP * 32;
            // A lone last panel (a bf16 PLAIN product with N % 32 == 16) is read twice, its
            // second copy's columns never stored.
            const uint16_t* pb = codes ? bbuf + SLAB * 512 : g.N - panel * 16 == 16 ? pa : pa + KP * 32;
            const int64_t boff = codes ? kb0 : 0;
            // The thread's next half (panels + 2, + 3: this unit's second half, or its next unit's
            // first) is asked into L2 tile by tile as this half's tiles are expanded, so its first
            // pass does not wait on DRAM for every line the L2 streamer has not reached yet.
            const bool ask_next = codes && panel + 3 < g.N / 16;
            auto expand = [&](int64_t kb) {
                if (ask_next) tiles::prefetch<FMT>(g.packed, panel + 2, steps, kb);
                tiles::dequantize<FMT>(g.packed, panel, steps, kb, bbuf + (kb - kb0) * 512);
                tiles::dequantize<FMT>(g.packed, panel + 1, steps, kb, bbuf + (SLAB + kb - kb0) * 512);
            };
            if constexpr (FMT != tiles::BF16)
                for (int64_t kb = kb0; kb < std::min(kb1, kb0 + AHEAD); ++kb) expand(kb);
            const bool last = half == h1 - 1 && s == slabs - 1;
            for (int64_t c = c0; c < c1; ++c) {
                const int mr = (int)std::min<int64_t>(MB, g.M - c * MB);
                if (mr != configured) { configure(mr); configured = mr; }
                float* sc = scr + (c - c0) * MB * 64 + 32 * half;  // tile (i, j) at rows 16i, columns +16j
                if (s == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    if (mr > 16) { _tile_zero(2); _tile_zero(3); }
                } else {
                    _tile_loadd(0, sc, 256);
                    _tile_loadd(1, sc + 16, 256);
                    if (mr > 16) { _tile_loadd(2, sc + 16 * 64, 256); _tile_loadd(3, sc + 16 * 64 + 16, 256); }
                }
                const uint16_t* xa = g.x + c * MB * K;
                const uint16_t* xb = xa + 16 * K;
                for (int64_t kb = kb0; kb < kb1; ++kb) {
                    for (int q = 0; last && q < 2 && pending < pending_end; ++q, ++pending)
                        finish_row(g, scr + (pending - row0) * 64, pending, nb, h0, h1);
                    if constexpr (FMT != tiles::BF16) {
                        if (c == c0 && kb + AHEAD < kb1) expand(kb + AHEAD);
                    }
                    if (stream_b) {
                        _tile_loadd(4, xa + 32 * kb, ldx);
                        _tile_stream_loadd(6, pa + (kb - boff) * 16 * 32, 64);
                        _tile_stream_loadd(7, pb + (kb - boff) * 16 * 32, 64);
                    } else {
                        _tile_stream_loadd(4, xa + 32 * kb, ldx);
                        _tile_loadd(6, pa + (kb - boff) * 16 * 32, 64);
                        _tile_loadd(7, pb + (kb - boff) * 16 * 32, 64);
                    }
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (mr > 16) {
                        if (stream_b) _tile_loadd(5, xb + 32 * kb, ldx);
                        else _tile_stream_loadd(5, xb + 32 * kb, ldx);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                if (g.lora && s == slabs - 1) lora_steps(g, c, mr, panel);
                _tile_stored(0, sc, 256);
                _tile_stored(1, sc + 16, 256);
                if (mr > 16) { _tile_stored(2, sc + 16 * 64, 256); _tile_stored(3, sc + 16 * 64 + 16, 256); }
                if (last) pending_end = c * MB + mr;
            }
        }
    }
    for (; pending < pending_end; ++pending) finish_row(g, scr + (pending - row0) * 64, pending, nb, h0, h1);
}

// Each thread's C scratch and expanded-B buffer, allocated on its first product.
inline float* thread_scratch() {
    static thread_local float* scr = (float*)aligned_alloc(64, MAX_SUPER * MB * 64 * sizeof(float));
    return scr;
}

inline uint16_t* thread_bbuf() {
    static thread_local uint16_t* bbuf = (uint16_t*)aligned_alloc(64, 2 * SLAB * 512 * sizeof(uint16_t));
    return bbuf;
}

// One product's units of work: (super-chunk, column group, part), as run() orders them.
struct Plan {
    Gemm g;
    int64_t chunks, groups, super, supers;
    int parts;
    int64_t units() const { return supers * groups * parts; }
};

inline Plan plan(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, uint16_t* y, int kind,
                 const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim, int64_t rope_cols,
                 const LoRAExt* lora = nullptr, int64_t ldy = 0) {
    Plan p{{x, M, K, N, packed, y, make_epilogue(kind, N, cos, sin_signed, head_dim, rope_cols), lora},
           0, 0, 0, 0, 1};
    if (ldy) p.g.e.ldy = ldy;
    p.chunks = (M + MB - 1) / MB;
    // Super-chunks of equal size: the static schedule hands each thread a contiguous run of units,
    // and a short last super-chunk (17 chunks as 16 + 1) left one thread with most of the work.
    const int64_t super_max = std::max<int64_t>(1, std::min<int64_t>(MAX_SUPER, SUPER_BYTES / (MB * K * 2)));
    p.supers = (p.chunks + super_max - 1) / super_max;
    p.super = (p.chunks + p.supers - 1) / p.supers;
    // A PLAIN epilogue lets a unit be one 32-column half: the same traffic (each half streams A
    // and reads its own panels either way), and units that split evenly where groups are few and
    // odd (a decode's 9 groups of o_proj and down_proj left one thread idle a ninth of the time).
    // It also allows N % 64 == 32 or 16 over bf16 panels (a LoRA shrink to 16 or 32 rank
    // columns): the last group's one half, or one panel.
    p.parts = p.g.e.kind == PLAIN ? 2 : 1;
    p.groups = p.parts == 2 ? (N + 63) / 64 : N / 64;
    return p;
}

// Unit u of the plan (0 <= u < units()); a PLAIN plan's half past N is no work.
inline void run_unit(const Plan& p, int64_t u, float* scr, uint16_t* bbuf, int& configured) {
    const int part = (int)(u % p.parts);
    const int64_t nb = (u / p.parts) % p.groups, sc = u / (p.parts * p.groups);
    if (p.parts == 2 && nb * 64 + 32 * part >= p.g.N) return;
    const int h0 = p.parts == 2 ? part : 0, h1 = p.parts == 2 ? part + 1 : 2;
    unit<tiles::BF16>(p.g, nb, h0, h1, sc * p.super, std::min(p.chunks, (sc + 1) * p.super), scr, bbuf, configured);
}

// gemm_bf16's contract (same packed weight, same epilogues), for K % 32 == 0.
template <int FMT>
void run(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, uint16_t* y, int kind,
         const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim, int64_t rope_cols,
         const LoRAExt* lora = nullptr) {
    if (M <= 0) return;
    const Plan p = plan(x, M, K, packed, N, y, kind, cos, sin_signed, head_dim, rope_cols, lora);
    #pragma omp parallel
    {
        float* scr = thread_scratch();
        uint16_t* bbuf = thread_bbuf();
        int configured = -1;
        #pragma omp for collapse(3) schedule(static)
        for (int64_t sc = 0; sc < p.supers; ++sc)
            for (int64_t nb = 0; nb < p.groups; ++nb)
                for (int part = 0; part < p.parts; ++part) {
                    if (p.parts == 2 && nb * 64 + 32 * part >= N) continue;
                    const int h0 = p.parts == 2 ? part : 0, h1 = p.parts == 2 ? part + 1 : 2;
                    unit<FMT>(p.g, nb, h0, h1, sc * p.super, std::min(p.chunks, (sc + 1) * p.super), scr, bbuf,
                              configured);
                }
        if (configured >= 0) _tile_release();
    }
}

}  // namespace

#define GEMM_AMX_ENTRY(name, FMT)                                                                              \
    extern "C" void name(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, uint16_t* y,  \
                         int kind, const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim,           \
                         int64_t rope_cols) {                                                                   \
        run<FMT>(x, M, K, packed, N, y, kind, cos, sin_signed, head_dim, rope_cols);                           \
    }
GEMM_AMX_ENTRY(gemm_bf16_amx, tiles::BF16)
GEMM_AMX_ENTRY(gemm_q4_1_amx, tiles::Q4_1)
GEMM_AMX_ENTRY(gemm_q8_0_amx, tiles::Q8_0)

// The same products with a LoRA expand in their K loop (gemm_grouped.h's LoRAExt).
#define GEMM_AMX_LORA_ENTRY(name, FMT)                                                                         \
    extern "C" void name(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, uint16_t* y,  \
                         int kind, const uint16_t* cos, const uint16_t* sin_signed, int64_t head_dim,           \
                         int64_t rope_cols, const LoRAExt* lora) {                                              \
        run<FMT>(x, M, K, packed, N, y, kind, cos, sin_signed, head_dim, rope_cols, lora);                     \
    }
GEMM_AMX_LORA_ENTRY(gemm_bf16_amx_lora, tiles::BF16)
GEMM_AMX_LORA_ENTRY(gemm_q4_1_amx_lora, tiles::Q4_1)
GEMM_AMX_LORA_ENTRY(gemm_q8_0_amx_lora, tiles::Q8_0)

// Products over bf16 panels in one parallel region: every product's units in one static
// schedule, so that small products (a LoRA segment's) share the cores instead of each paying a
// region and leaving a core idle.
extern "C" void gemm_bf16_amx_grouped(const GemmProblem* problems, int n) {
    Plan plans[64];
    int64_t start[65];
    for (int first = 0; first < n; first += 64) {
        const int m = std::min(64, n - first);
        start[0] = 0;
        for (int i = 0; i < m; ++i) {
            const GemmProblem& q = problems[first + i];
            plans[i] = plan(q.x, q.M, q.K, q.packed, q.N, q.y, q.kind, q.cos, q.sin_signed, q.head_dim, q.rope_cols,
                            nullptr, q.ldy);
            start[i + 1] = start[i] + (q.M > 0 ? plans[i].units() : 0);
        }
        const int64_t total = start[m];
        #pragma omp parallel
        {
            float* scr = thread_scratch();
            uint16_t* bbuf = thread_bbuf();
            int configured = -1;
            int i = 0;
            #pragma omp for schedule(static)
            for (int64_t u = 0; u < total; ++u) {
                while (u >= start[i + 1]) ++i;  // units ascend within a thread's run
                run_unit(plans[i], u - start[i], scr, bbuf, configured);
            }
            if (configured >= 0) _tile_release();
        }
    }
}

extern "C" int gemm_amx_available() { return amx::permitted() ? 1 : 0; }
#else
#define GEMM_AMX_STUB(name)                                                                                   \
    extern "C" void name(const uint16_t*, int64_t, int64_t, const void*, int64_t, uint16_t*, int,            \
                         const uint16_t*, const uint16_t*, int64_t, int64_t) {}
GEMM_AMX_STUB(gemm_bf16_amx)
GEMM_AMX_STUB(gemm_q4_1_amx)
GEMM_AMX_STUB(gemm_q8_0_amx)
extern "C" void gemm_bf16_amx_grouped(const GemmProblem*, int) {}
#define GEMM_AMX_LORA_STUB(name)                                                                              \
    extern "C" void name(const uint16_t*, int64_t, int64_t, const void*, int64_t, uint16_t*, int,            \
                         const uint16_t*, const uint16_t*, int64_t, int64_t, const LoRAExt*) {}
GEMM_AMX_LORA_STUB(gemm_bf16_amx_lora)
GEMM_AMX_LORA_STUB(gemm_q4_1_amx_lora)
GEMM_AMX_LORA_STUB(gemm_q8_0_amx_lora)
extern "C" int gemm_amx_available() { return 0; }
#endif
