// Varlen paged attention for bf16 on AVX512-BF16 CPUs: decode steps and prefill chunks of any
// number of sequences in one call, reading K/V straight out of their blocks.
//
// Why a second kernel: the float32-accumulating decode kernel (paged_decode.cpp) converts every
// bf16 element and reduces every dot product horizontally, ~15 GMAC/s per core here; prefill
// chunks went through one SDPA per sequence over a gathered copy of its context. VDPBF16PS does
// 32 bf16 multiply-adds per instruction into float32, but it pairs elements along the reduction
// axis, so each operand must be laid out pair-major. The cache is stored that way (the "pairs"
// layout of kv_cache.py, written by store_kv_pairs below), so both are read in place:
//   scores: s[t] = sum_d q[d] k_t[d]. K is [blocks][hkv][dh/2][bs][2]: the (d, d+1) pairs of 16
//           consecutive keys fill one register, lane t = key t; each query row needs dh/2
//           instructions with its d-pair broadcast, and no horizontal sums.
//   output: o[d] += sum_t p_t v_t[d]. V is [blocks][hkv][bs/2][dh][2]: keys t, t+1 interleaved
//           per d, so a register holds (v_t[d], v_t+1[d]) for 16 d's; p is rounded to bf16 as
//           flash-attention does on GPUs before its P.V product.
// With the token-major layout the kernel transposed every 16 keys of K (16x16 32-bit transposes,
// ~250 shuffles per 32 keys against ~190 VDPBF16PS for a decode's 3 query rows) and unpacked V:
// reading in place made decode attention 1.4-1.7x faster (bench/NOTES.md).
// Softmax is online (flash-attention style) per 32-key chunk, so a work item's memory is a few
// KB whatever the context length. It runs in base 2 (the scale carries log2 e; the running max
// and the saved states are base-2 too): exp2_512 is half exp512's work, and the softmax took
// about a third of a prefill tile's time (9 % faster there, bench/NOTES.md). Work item = (sequence, K/V head, tile of <= TILE query tokens);
// items of 17..64 query rows (prefill tiles, cascade prefix items) take attend_tile, which puts
// the rows in the lanes (1.2-1.3x faster there), decodes the row-major attend_item. On CPUs
// with AMX (head_dim 64) every item runs on tiles instead, 16 rows at a time (attend_amx.h).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "avx512_exp.h"  // exp512, exp2_512
#define KVS_HAVE_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define KVS_HAVE_AMX 1
#endif

namespace {

constexpr int CHUNK = 32;  // keys per softmax step: two float32 registers (the max / sum
                           // reductions per step cost as much as the dot products at 16);
                           // read as two halves of 16 keys, so blocks must hold 16k keys
constexpr int TILE = 16;   // query tokens per work item (prefill)
constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;  // the base-2 softmax

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// r[i] (16 floats or 32-bit words) <- column i of the 16 x 16 matrix whose rows were r[0..15]:
// attend_tile's rows go into the lanes and back this way (64 shuffles a block, where a scalar
// loop moved every word on its own).
inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        u[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
        u[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

// A prefetch into L2 that the compiler must keep: GCC 12 deleted calls of a lambda whose body
// was only __builtin_prefetch (it deems them free of side effects), so attend_decode's first
// build asked for nothing (bench/NOTES.md, "Software prefetches as asm volatile with the address in
// a register"). The address goes in a register: as a
// memory operand GCC must assume the asm reads memory, and keeps in memory any accumulator whose
// address was taken (in gemm_bf16's tile that cost 2.6x).
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 (%0)" : : "r"(p)); }

// Scores of R rows against 16 keys: sc[r * STRIDE + t] = q_r . k_t times vscale (attend_item:
// unscaled). kt: the keys' d-pairs, pair j at kt + j * kstride (16 uint32 lanes = 16 keys).
// pfk / pfv (unless null): K lines at the same stride and contiguous V lines to ask for, one of
// each per d-pair, spread over the products (attend_decode's keys a few groups ahead).
template <int R, int NP, int STRIDE = CHUNK>
inline void qk_rows(const uint32_t* kt, int64_t kstride, const uint32_t* q, float* sc,
                    __m512 vscale = _mm512_set1_ps(1.f), const uint32_t* pfk = nullptr,
                    const uint32_t* pfv = nullptr) {
    constexpr int A = R >= 4 ? 2 : 4;  // accumulators per row (must divide NP)
    static_assert(NP % A == 0, "d-pairs must split evenly over the accumulators");
    __m512 s[R][A];
    for (int r = 0; r < R; ++r)
        for (int a = 0; a < A; ++a) s[r][a] = _mm512_setzero_ps();
    for (int j = 0; j < NP; j += A)
        for (int a = 0; a < A; ++a) {
            if (pfk) {
                prefetch_l2(pfk + (j + a) * kstride);
                prefetch_l2(pfv + 16 * (j + a));
            }
            const __m512bh k = as_bh(_mm512_loadu_si512(kt + (j + a) * kstride));
            for (int r = 0; r < R; ++r)
                s[r][a] = _mm512_dpbf16_ps(s[r][a], k, as_bh(_mm512_set1_epi32((int)q[r * NP + j + a])));
        }
    for (int r = 0; r < R; ++r) {
        __m512 t = s[r][0];
        for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, s[r][a]);
        _mm512_store_ps(sc + r * STRIDE, _mm512_mul_ps(t, vscale));
    }
}

// acc_r = alpha_r * acc_r + sum_t p_rt v_t for R rows over ngroups groups of 16 keys (p as bf16
// pairs). vg[i]: group i's 8 key pairs, pair u at vg[i] + u * DH (16 d's per register, natural
// order); pb + r * STRIDE: row r's bf16 probabilities (attend_item: a chunk; attend_decode: a
// segment).
template <int R, int NV, int STRIDE = CHUNK>
inline void pv_rows(const uint32_t* const* vg, int ngroups, const uint16_t* pb, const float* alpha, float* acc) {
    constexpr int DH = NV * 16;
    __m512 o[R][NV];
    for (int r = 0; r < R; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < NV; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * DH + 16 * c), va);
    }
    for (int u = 0; u < 8 * ngroups; ++u) {  // key pair u: keys 2u, 2u + 1
        const uint32_t* vu = vg[u / 8] + (u % 8) * DH;
        for (int r = 0; r < R; ++r) {
            uint32_t pair;
            memcpy(&pair, pb + r * STRIDE + 2 * u, 4);
            const __m512bh pu = as_bh(_mm512_set1_epi32((int)pair));
            for (int c = 0; c < NV; ++c)
                o[r][c] = _mm512_dpbf16_ps(o[r][c], as_bh(_mm512_loadu_si512(vu + 16 * c)), pu);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * DH + 16 * c, o[r][c]);
}

template <int N> using Int = std::integral_constant<int, N>;

// Calls f(Int<R>, first_row) over rows in groups of MAXR (<= 4), then the remainder as one group.
template <int MAXR = 4, typename F>
inline void for_row_groups(int rows, F f) {
    static_assert(MAXR >= 1 && MAXR <= 4, "row groups of 1 to 4");
    int r = 0;
    for (; r + MAXR <= rows; r += MAXR) f(Int<MAXR>{}, r);
    switch (rows - r) {
        case 3: if constexpr (MAXR > 3) f(Int<3>{}, r); break;
        case 2: if constexpr (MAXR > 2) f(Int<2>{}, r); break;
        case 1: if constexpr (MAXR > 1) f(Int<1>{}, r); break;
        default: break;
    }
}

// Where 16 keys starting at position p0 (a multiple of 16) of head h live in the cache.
struct KeySpan { const uint32_t* k; const uint32_t* v; };

template <int DH>
inline KeySpan key_span(const uint32_t* k32, const uint32_t* v32, const int64_t* table, int64_t p0,
                        int h, int hkv, int bs) {
    const int64_t blk_head = table[p0 / bs] * hkv + h, o = p0 % bs;
    return {k32 + blk_head * (DH / 2) * bs + o, v32 + blk_head * (bs / 2) * DH + (o / 2) * DH};
}

// Which keys stage_chunk asks the memory for (blocks sit anywhere in the pool, where the hardware
// prefetcher cannot follow from one to the next):
//   AHEAD: the next two chunks' keys, while this one is being used (the dot-product paths). The
//          nearer one was asked for last time too; asking again (or only for the farther one,
//          or into L2) measured slower there: a full miss queue drops prefetches, and the
//          repeat catches them.
//   THIS:  this chunk's keys, just before the tile loads (the AMX paths). A tile load waits for
//          the product that last read its register, so the tiles' own loads of a chunk go out
//          one or two lines' worth at a time; the prefetches put all of its lines in flight at
//          once. Asking for the next chunk too (or only for it, or further ahead) measured
//          16-30 % slower at batch 64: every line asked for twice, lines evicted before use.
//   NONE:  nothing (an earlier pass left the keys in L2).
enum Prefetch { NONE = 0, AHEAD = 1, THIS = 2 };

// The keys [kp0, kp0 + CHUNK) of head h as the dot products read them: whole 16-key halves in
// place, partly visible ones masked into kscr [CHUNK/16][NP][16] / vscr [CHUNK/16][8][DH] (keys
// outside [key_begin, key_end) read as zero: slots past a sequence's end may hold anything).
struct ChunkView { const uint32_t* k[CHUNK / 16]; const uint32_t* v[CHUNK / 16]; int64_t kstride[CHUNK / 16]; };

template <int DH>
__attribute__((always_inline)) inline ChunkView stage_chunk(
        const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t kp0,
        int64_t key_begin, int64_t key_end, int h, int hkv, int bs, uint32_t* kscr, uint32_t* vscr,
        Prefetch prefetch = AHEAD) {
    constexpr int NP = DH / 2, NV = DH / 16;
    const uint32_t* k32 = (const uint32_t*)k_cache;  // bf16 pairs as 32-bit words
    const uint32_t* v32 = (const uint32_t*)v_cache;
    // Only whole 16-key halves that hold a visible key; THIS asks before the masked copies below read.
    const int64_t pf_from = prefetch == THIS ? std::max(kp0, key_begin - key_begin % 16) : kp0 + CHUNK;
    const int64_t pf_to = std::min<int64_t>(prefetch == THIS ? kp0 + CHUNK : kp0 + 3 * CHUNK, key_end);
    for (int64_t p0 = pf_from; prefetch != NONE && p0 < pf_to; p0 += 16) {
        const KeySpan sp = key_span<DH>(k32, v32, table, p0, h, hkv, bs);
        for (int j = 0; j < NP; ++j) __builtin_prefetch(sp.k + j * bs);
        for (int c = 0; c < 8 * DH; c += 16) __builtin_prefetch(sp.v + c);
    }
    ChunkView cv;
    for (int half = 0; half < CHUNK / 16; ++half) {
        const int64_t p0 = kp0 + 16 * half;
        uint32_t* ks = kscr + half * NP * 16;
        uint32_t* vs = vscr + half * 8 * DH;
        if (p0 >= key_begin && p0 + 16 <= key_end) {  // all 16 keys visible: read in place
            const KeySpan sp = key_span<DH>(k32, v32, table, p0, h, hkv, bs);
            cv.k[half] = sp.k; cv.kstride[half] = bs; cv.v[half] = sp.v;
            continue;
        }
        cv.k[half] = ks; cv.kstride[half] = 16; cv.v[half] = vs;
        const int64_t lo = std::max(p0, key_begin), hi = std::min(p0 + 16, key_end);
        if (lo >= hi) {  // none visible (the chunk's edge): zeros, the scores are masked anyway
            memset(ks, 0, sizeof(uint32_t) * NP * 16);
            memset(vs, 0, sizeof(uint32_t) * 8 * DH);
            continue;
        }
        const __mmask16 kmask = (__mmask16)(((1u << (hi - lo)) - 1) << (lo - p0));
        uint32_t vmask_bits[8];
        for (int u = 0; u < 8; ++u)
            vmask_bits[u] = ((kmask >> (2 * u)) & 1 ? 0x55555555u : 0u) | ((kmask >> (2 * u + 1)) & 1 ? 0xaaaaaaaau : 0u);
        const KeySpan sp = key_span<DH>(k32, v32, table, p0, h, hkv, bs);
        for (int j = 0; j < NP; ++j)
            _mm512_storeu_si512(ks + 16 * j, _mm512_maskz_loadu_epi32(kmask, sp.k + j * bs));
        for (int u = 0; u < 8; ++u)
            for (int c = 0; c < NV; ++c)
                _mm512_storeu_si512(vs + u * DH + 16 * c, _mm512_maskz_loadu_epi16((__mmask32)vmask_bits[u], sp.v + u * DH + 16 * c));
    }
    return cv;
}

// The saved softmax state (m in base 2, l, then acc[DH]) of row r = token r / g, query head h * g + r % g.
template <int DH>
inline float* state_row(float* const* state, int r, int g, int h) {
    return state[r / g] + (int64_t)(h * g + r % g) * (DH + 2);
}

// A chunk's key positions (16 per register) and which lie in [key_begin, key_end).
// whole: every row sees every key of the chunk (the bulk of a prefill, all but the last chunk of a
// decode), so row_scores applies no mask and the callers need not mask the probabilities.
struct ChunkKeys { __m512i pos[CHUNK / 16]; __mmask16 in[CHUNK / 16]; bool whole; };

// first_pos: the earliest position among the rows that read the chunk.
inline ChunkKeys chunk_keys(int64_t kp0, int64_t key_begin, int64_t key_end, int64_t first_pos, int64_t window) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i vbegin = _mm512_set1_epi32((int)key_begin), vend = _mm512_set1_epi32((int)key_end);
    ChunkKeys ck;
    for (int i = 0; i < CHUNK / 16; ++i) {
        ck.pos[i] = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(kp0 + 16 * i)));
        ck.in[i] = _mm512_cmpge_epi32_mask(ck.pos[i], vbegin) & _mm512_cmplt_epi32_mask(ck.pos[i], vend);
    }
    ck.whole = window <= 0 && kp0 >= key_begin && kp0 + CHUNK <= key_end && kp0 + CHUNK - 1 <= first_pos;
    return ck;
}

// One query row's scores of a chunk (s: CHUNK floats), times vscale, and the keys it sees (in
// range, not after its position `pos`, inside the window); unseen keys read -inf.
inline void row_scores(const float* s, int64_t pos, int64_t window, const ChunkKeys& ck, __m512 vscale,
                       __m512* sv, __mmask16* vis) {
    if (ck.whole) {
        for (int i = 0; i < CHUNK / 16; ++i) {
            vis[i] = 0xFFFF;
            sv[i] = _mm512_mul_ps(_mm512_load_ps(s + 16 * i), vscale);
        }
        return;
    }
    const __m512i qv = _mm512_set1_epi32((int)pos), lo = _mm512_set1_epi32((int)(pos - window));
    for (int i = 0; i < CHUNK / 16; ++i) {
        vis[i] = ck.in[i] & _mm512_cmple_epi32_mask(ck.pos[i], qv);
        if (window > 0) vis[i] &= _mm512_cmpgt_epi32_mask(ck.pos[i], lo);
        sv[i] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), vis[i], _mm512_mul_ps(_mm512_load_ps(s + 16 * i), vscale));
    }
}

// A row's output: acc / l (0 where no key was seen) rounded to bf16.
template <int DH>
inline void store_output_row(const float* acc, float l, uint16_t* dst) {
    const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
    for (int c = 0; c < DH / 16; ++c)
        _mm256_storeu_si256((__m256i*)(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), inv)));
}

// One work item: `ntok` query tokens (rows qrow[], positions qpos[]) of K/V head h against the keys
// at positions [key_begin, key_end) of `table` (further limited by causality and the window).
// mode NORMAL starts from an empty softmax state and writes the normalised output; STORE starts
// empty and saves the raw state (m, l, acc) of every row to state[token]; LOAD resumes from that
// state and writes the output. kscr [CHUNK/16][NP][16] and vscr [CHUNK/16][8][DH] uint32 hold the
// chunk's partly visible 16-key halves, masked (keys outside [key_begin, key_end) read as zero:
// slots past a sequence's end may hold anything); whole halves are read in place.
// acc: [rows][DH] float; pb: [rows][CHUNK] bf16 probabilities.
enum Mode { NORMAL = 0, STORE = 1, LOAD = 2 };

template <int DH>
void attend_item(const uint16_t* q, uint16_t* out, const int64_t* qrow, const int64_t* qpos, int ntok,
                 int64_t q_stride, int64_t out_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int64_t* table, int64_t key_begin, int64_t key_end, int h, int g, int hkv, int bs,
                 float scale, int64_t window, Mode mode, float* const* state, uint32_t* kscr,
                 uint32_t* vscr, float* acc, float* m, float* l, float* alpha, float* sc, uint16_t* pb) {
    constexpr int NP = DH / 2, NV = DH / 16;
    const int rows = ntok * g;
    // Row r = tile token r / g, query head h * g + r % g. Its d-pairs as uint32 for broadcasting;
    // the softmax scale is applied to the float32 scores (no extra bf16 rounding of q).
    std::vector<uint32_t> qp((size_t)rows * NP);
    for (int tq = 0; tq < ntok; ++tq) {
        const uint16_t* src = q + qrow[tq] * q_stride + (int64_t)h * g * DH;
        memcpy(&qp[(size_t)tq * g * NP], src, (size_t)g * DH * 2);
    }
    auto row_state = [&](int r) { return state_row<DH>(state, r, g, h); };
    if (mode == LOAD) {
        for (int r = 0; r < rows; ++r) {
            const float* st = row_state(r);
            m[r] = st[0]; l[r] = st[1];
            memcpy(acc + (size_t)r * DH, st + 2, sizeof(float) * DH);
        }
    } else {
        for (int r = 0; r < rows; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
        memset(acc, 0, sizeof(float) * rows * DH);
    }
    const int64_t first_pos = *std::min_element(qpos, qpos + ntok);
    for (int64_t kp0 = key_begin - key_begin % CHUNK; kp0 < key_end; kp0 += CHUNK) {
        const ChunkView cv = stage_chunk<DH>(k_cache, v_cache, table, kp0, key_begin, key_end, h, hkv, bs, kscr, vscr);
        const uint32_t* const* kh = cv.k;
        const uint32_t* const* vh = cv.v;
        const int64_t* kstride = cv.kstride;
        // Rows are interleaved in groups: one row alone is a chain of dependent VDPBF16PS
        // (latency ~6 cycles), which left the units mostly idle.
        for (int half = 0; half < CHUNK / 16; ++half)
            for_row_groups(rows, [&](auto R, int r0) {
                qk_rows<decltype(R)::value, NP>(kh[half], kstride[half], &qp[(size_t)r0 * NP], sc + r0 * CHUNK + 16 * half);
            });
        constexpr int NR = CHUNK / 16;  // float32 registers of scores per row
        const ChunkKeys ck = chunk_keys(kp0, key_begin, key_end, first_pos, window);
        const __m512 vscale = _mm512_set1_ps(scale * LOG2E);
        for (int r = 0; r < rows; ++r) {
            __mmask16 vis[NR];
            __m512 sv[NR];
            row_scores(sc + r * CHUNK, qpos[r / g], window, ck, vscale, sv, vis);
            __m512 vmax = sv[0];
            for (int i = 1; i < NR; ++i) vmax = _mm512_max_ps(vmax, sv[i]);
            const float cmax = _mm512_reduce_max_ps(vmax);
            if (cmax == -INFINITY) {  // no visible key in this chunk: leave the row as it is
                alpha[r] = 1.f;
                memset(&pb[r * CHUNK], 0, CHUNK * sizeof(uint16_t));
                continue;
            }
            const float mnew = cmax > m[r] ? cmax : m[r];
            alpha[r] = m[r] == -INFINITY ? 0.f : (mnew == m[r] ? 1.f : exp2f(m[r] - mnew));
            const __m512 vm = _mm512_set1_ps(mnew);
            __m512 vsum = _mm512_setzero_ps();
            for (int i = 0; i < NR; ++i) {
                sv[i] = exp2_512(_mm512_sub_ps(sv[i], vm));
                if (!ck.whole) sv[i] = _mm512_maskz_mov_ps(vis[i], sv[i]);
                vsum = _mm512_add_ps(vsum, sv[i]);
            }
            l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
            m[r] = mnew;
            for (int i = 0; i < NR; i += 2)
                _mm512_storeu_si512((__m512i*)&pb[r * CHUNK + 16 * i], (__m512i)_mm512_cvtne2ps_pbh(sv[i + 1], sv[i]));
        }
        for_row_groups(rows, [&](auto R, int r0) {
            pv_rows<decltype(R)::value, NV>(vh, CHUNK / 16, &pb[r0 * CHUNK], &alpha[r0], acc + (size_t)r0 * DH);
        });
    }
    if (mode == STORE) {
        for (int r = 0; r < rows; ++r) {
            float* st = row_state(r);
            st[0] = m[r]; st[1] = l[r];
            memcpy(st + 2, acc + (size_t)r * DH, sizeof(float) * DH);
        }
        return;
    }
    for (int r = 0; r < rows; ++r)
        store_output_row<DH>(acc + (size_t)r * DH, l[r], out + qrow[r / g] * out_stride + ((int64_t)h * g + r % g) * DH);
}

#include "attend_amx.h"     // attend_item_amx: attend_item on AMX tiles
#include "attend_decode.h"  // attend_decode: decodes over all K/V heads by segments, without AMX

// The same work item with its query rows in the lanes, for items of 17..64 rows (prefill tiles,
// cascade prefix items). attend_item broadcasts each row's q pair against 16 keys, one broadcast
// per VDPBF16PS; here a key's pair is broadcast against 16 rows, so q.k issues a third of the
// loads, and the online softmax runs down the lanes with no horizontal reductions. P.V keeps
// the pair trick: lanes hold (p_t, p_t+1) per row, against a broadcast (v_t[d], v_t+1[d]).
// RV = vectors of 16 rows. Scratch: qT [NP][RV], O [DH][RV] (output, rows in lanes), pp [CHUNK/2][RV].
template <int DH, int RV>
void attend_tile(const uint16_t* q, uint16_t* out, const int64_t* qrow, const int64_t* qpos, int ntok,
                 int64_t q_stride, int64_t out_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int64_t* table, int64_t key_begin, int64_t key_end, int h, int g, int hkv, int bs,
                 float scale, int64_t window, Mode mode, float* const* state, uint32_t* kscr,
                 uint32_t* vscr, __m512i* qT, __m512* O, __m512i* pp) {
    constexpr int NP = DH / 2;
    constexpr int TB = RV <= 3 ? 8 : 4;  // keys per q.k register block (TB x RV accumulators)
    constexpr int DB = RV <= 3 ? 8 : 4;  // d's per P.V register block
    const int rows = ntok * g;
    // Row r (lane r % 16 of vector r / 16) = tile token r / g, query head h * g + r % g.
    float* of = (float*)O;
    auto lane = [](int r, int i) { return (i * RV + r / 16) * 16 + r % 16; };  // element i of row r
    static_assert(NP % 16 == 0, "q's d-pairs go into the lanes 16 at a time");
    alignas(64) int32_t posl[RV * 16];
    alignas(64) float ml[RV * 16], ll[RV * 16];
    for (int r = 0; r < RV * 16; ++r) { posl[r] = -1; ml[r] = -INFINITY; ll[r] = 0.f; }  // pad lanes see nothing
    for (int v = 0; v < RV; ++v) {  // rows 16v .. 16v + 15 into the lanes of qT[j * RV + v]
        const uint32_t* src[16];
        for (int rr = 0; rr < 16; ++rr) {
            const int r = 16 * v + rr;
            src[rr] = r < rows ? (const uint32_t*)(q + qrow[r / g] * q_stride + (int64_t)(h * g + r % g) * DH) : nullptr;
            if (r < rows) posl[r] = (int32_t)qpos[r / g];
        }
        for (int j0 = 0; j0 < NP; j0 += 16) {
            __m512 m[16];
            for (int rr = 0; rr < 16; ++rr)
                m[rr] = src[rr] ? _mm512_loadu_ps((const float*)(src[rr] + j0)) : _mm512_setzero_ps();
            transpose16(m);
            for (int i = 0; i < 16; ++i) qT[(j0 + i) * RV + v] = (__m512i)m[i];
        }
    }
    auto row_state = [&](int r) { return state_row<DH>(state, r, g, h); };
    memset(of, 0, sizeof(__m512) * DH * RV);
    if (mode == LOAD)
        for (int r = 0; r < rows; ++r) {
            const float* st = row_state(r);
            ml[r] = st[0]; ll[r] = st[1];
            for (int d = 0; d < DH; ++d) of[lane(r, d)] = st[2 + d];
        }
    __m512i qposv[RV];
    __m512 m[RV], l[RV];
    for (int v = 0; v < RV; ++v) {
        qposv[v] = _mm512_load_si512(posl + 16 * v);
        m[v] = _mm512_load_ps(ml + 16 * v);
        l[v] = _mm512_load_ps(ll + 16 * v);
    }
    const __m512 vscale = _mm512_set1_ps(scale * LOG2E), ninf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.f);
    // vpermw indices interleaving the two bf16 halves of cvtne2ps: word 2i = i, 2i + 1 = 16 + i.
    alignas(64) uint16_t pidx[32];
    for (int i = 0; i < 16; ++i) { pidx[2 * i] = (uint16_t)i; pidx[2 * i + 1] = (uint16_t)(16 + i); }
    const __m512i perm = _mm512_load_si512(pidx);
    alignas(64) __m512 S[CHUNK][RV];
    for (int64_t kp0 = key_begin - key_begin % CHUNK; kp0 < key_end; kp0 += CHUNK) {
        const ChunkView cv = stage_chunk<DH>(k_cache, v_cache, table, kp0, key_begin, key_end, h, hkv, bs, kscr, vscr);
        for (int t0 = 0; t0 < CHUNK; t0 += TB) {  // S[t][v] = q_rows . k_t
            __m512 acc[TB][RV];
            for (int tt = 0; tt < TB; ++tt)
                for (int v = 0; v < RV; ++v) acc[tt][v] = _mm512_setzero_ps();
            const uint32_t* kb = cv.k[t0 / 16] + t0 % 16;
            const int64_t ks = cv.kstride[t0 / 16];
            for (int j = 0; j < NP; ++j) {
                __m512bh qv[RV];
                for (int v = 0; v < RV; ++v) qv[v] = as_bh(_mm512_load_si512(qT + j * RV + v));
                for (int tt = 0; tt < TB; ++tt) {
                    const __m512bh kv = as_bh(_mm512_set1_epi32((int)kb[j * ks + tt]));
                    for (int v = 0; v < RV; ++v) acc[tt][v] = _mm512_dpbf16_ps(acc[tt][v], qv[v], kv);
                }
            }
            for (int tt = 0; tt < TB; ++tt)
                for (int v = 0; v < RV; ++v) S[t0 + tt][v] = acc[tt][v];
        }
        __m512 mx[RV];
        for (int v = 0; v < RV; ++v) mx[v] = ninf;
        for (int t = 0; t < CHUNK; ++t) {  // scale, mask (key range, causality, window), max
            const int64_t kp = kp0 + t;
            const bool in = kp >= key_begin && kp < key_end;
            const __m512i vkp = _mm512_set1_epi32((int)kp), vkw = _mm512_set1_epi32((int)(kp + window));
            for (int v = 0; v < RV; ++v) {
                __mmask16 vis = in ? _mm512_cmpge_epi32_mask(qposv[v], vkp) : 0;
                if (window > 0) vis &= _mm512_cmplt_epi32_mask(qposv[v], vkw);
                S[t][v] = _mm512_mask_mul_ps(ninf, vis, S[t][v], vscale);
                mx[v] = _mm512_max_ps(mx[v], S[t][v]);
            }
        }
        __m512 alpha[RV];
        for (int v = 0; v < RV; ++v) {
            const __m512 mnew = _mm512_max_ps(m[v], mx[v]);
            const __mmask16 live = _mm512_cmp_ps_mask(mnew, ninf, _CMP_NEQ_OQ);  // some key seen
            // exp512 here, not exp2_512: m is -inf until a row's first visible key.
            alpha[v] = _mm512_mask_blend_ps(live, one, exp512(_mm512_mul_ps(_mm512_sub_ps(m[v], mnew), _mm512_set1_ps(LN2))));
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < CHUNK; ++t) {
                const __mmask16 seen = _mm512_cmp_ps_mask(S[t][v], ninf, _CMP_NEQ_OQ);
                S[t][v] = _mm512_maskz_mov_ps(seen, exp2_512(_mm512_sub_ps(S[t][v], mnew)));
                sum = _mm512_add_ps(sum, S[t][v]);
            }
            l[v] = _mm512_fmadd_ps(l[v], alpha[v], sum);
            m[v] = mnew;
        }
        for (int u = 0; u < CHUNK / 2; ++u)  // bf16 (p_2u, p_2u+1) pairs per row
            for (int v = 0; v < RV; ++v)
                pp[u * RV + v] = _mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(S[2 * u + 1][v], S[2 * u][v]));
        for (int d0 = 0; d0 < DH; d0 += DB) {  // O[d][v] = alpha * O + sum_u p pairs . v pairs
            __m512 o[DB][RV];
            for (int dd = 0; dd < DB; ++dd)
                for (int v = 0; v < RV; ++v) o[dd][v] = _mm512_mul_ps(O[(d0 + dd) * RV + v], alpha[v]);
            for (int u = 0; u < CHUNK / 2; ++u) {
                const uint32_t* vu = cv.v[u / 8] + (u % 8) * DH + d0;
                __m512bh pv[RV];
                for (int v = 0; v < RV; ++v) pv[v] = as_bh(pp[u * RV + v]);
                for (int dd = 0; dd < DB; ++dd) {
                    const __m512bh vv = as_bh(_mm512_set1_epi32((int)vu[dd]));
                    for (int v = 0; v < RV; ++v) o[dd][v] = _mm512_dpbf16_ps(o[dd][v], pv[v], vv);
                }
            }
            for (int dd = 0; dd < DB; ++dd)
                for (int v = 0; v < RV; ++v) O[(d0 + dd) * RV + v] = o[dd][v];
        }
    }
    for (int v = 0; v < RV; ++v) {
        _mm512_store_ps(ml + 16 * v, m[v]);
        _mm512_store_ps(ll + 16 * v, l[v]);
    }
    for (int v = 0; v < RV && 16 * v < rows; ++v)  // O's lanes back into rows, 16 d's at a time
        for (int d0 = 0; d0 < DH; d0 += 16) {
            __m512 m[16];
            for (int i = 0; i < 16; ++i) m[i] = O[(d0 + i) * RV + v];
            transpose16(m);  // m[rr]: d0 .. d0 + 15 of row 16v + rr
            for (int rr = 0; rr < 16 && 16 * v + rr < rows; ++rr) {
                const int r = 16 * v + rr;
                if (mode == STORE) {
                    float* st = row_state(r);
                    if (d0 == 0) { st[0] = ml[r]; st[1] = ll[r]; }
                    _mm512_storeu_ps(st + 2 + d0, m[rr]);
                    continue;
                }
                const __m512 inv = _mm512_set1_ps(ll[r] > 0.f ? 1.f / ll[r] : 0.f);
                uint16_t* dst = out + qrow[r / g] * out_stride + (int64_t)(h * g + r % g) * DH + d0;
                _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(m[rr], inv)));
            }
        }
}

#ifndef KVS_HAVE_AMX
struct AmxScratch {};
#endif

// Runs one work item by the path that suits its row count (see attend_tile) and the CPU.
struct Scratch {
    uint32_t* kscr; uint32_t* vscr; float* acc; float* m; float* l; float* alpha; float* sc; uint16_t* pb;
    __m512i* qT; __m512* O; __m512i* pp;
    AmxScratch* amx;  // null where the CPU has no AMX (or it is turned off)
    DecodeScratch dec;  // dec.sc null: decodes take attend_item
};

template <int DH>
void attend(const uint16_t* q, uint16_t* out, const int64_t* qrow, const int64_t* qpos, int ntok,
            int64_t q_stride, int64_t out_stride, const uint16_t* k_cache, const uint16_t* v_cache,
            const int64_t* table, int64_t key_begin, int64_t key_end, int h, int g, int hkv, int bs,
            float scale, int64_t window, Mode mode, float* const* state, const Scratch& w, int nh = 1) {
#ifdef KVS_HAVE_AMX
    // On AMX a tile's rows go 16 at a time: the staged chunk is read once per 16 rows instead of
    // once per 48, from cache, and the products are ~5x faster than attend_tile's VDPBF16PS
    // (bench/NOTES.md, "Attention items on AMX tiles"). A pass over the keys costs about the same for 1 to 16 rows,
    // so an item takes whichever cuts it into fewer passes: whole tokens (g heads each: 5
    // tokens of 3 heads, so a 16-token prefill tile is 5 + 5 + 5 + 1) or one query head at a
    // time (16 tokens: g passes), 14-17 % faster on prefill. Passes after the first find the
    // keys in L2 when they fit in half of it and skip stage_chunk's prefetching, which there
    // only spends load slots: another 7-15 % (bench/NOTES.md, "Prefill attention on AMX: one
    // query head per pass, prefetch only on the first").
    if constexpr (DH == 64)
        if (w.amx) {
            const bool l2_warm = (key_end - key_begin) * DH * 4 <= (1 << 20);
            // Tokens [t0, t0 + nt), `gq` query heads each from head qh0, over K/V heads h .. h + kh - 1.
            auto pass = [&](int t0, int nt, int gq, int qh0, int kh, bool prefetch) {
                attend_item_amx<DH>(q, out, qrow + t0, qpos + t0, nt, q_stride, out_stride, k_cache, v_cache, table,
                                    key_begin, key_end, h, gq, qh0, kh, hkv, bs, scale, window, mode, state + t0,
                                    w.kscr, w.vscr, *w.amx, prefetch);
            };
            if (nh > 1) {  // a decode over K/V heads h .. h + nh - 1 (paged_attention's decode items)
                pass(0, 1, g, h * g, nh, true);
                return;
            }
            const int per = std::max(1, 16 / g);
            if (g > 1 && g * ((ntok + 15) / 16) < (ntok + per - 1) / per) {
                for (int j = 0; j < g; ++j)
                    for (int t0 = 0; t0 < ntok; t0 += 16)
                        pass(t0, std::min(16, ntok - t0), 1, h * g + j, 1, !(l2_warm && (j || t0)));
                return;
            }
            for (int t0 = 0; t0 < ntok; t0 += per)
                pass(t0, std::min(per, ntok - t0), g, h * g, 1, !(l2_warm && t0));
            return;
        }
#endif
    if (ntok == 1 && w.dec.sc && (mode == NORMAL || window == 0)) {  // NORMAL: key_begin carries the window
        attend_decode<DH>(q + qrow[0] * q_stride, out + qrow[0] * out_stride, k_cache, v_cache, table, key_begin,
                          key_end, h, nh, g, hkv, bs, scale, mode, mode == NORMAL ? nullptr : state[0], w.dec);
        return;
    }
#define KVS_TILE(RV) attend_tile<DH, RV>(q, out, qrow, qpos, ntok, q_stride, out_stride, k_cache, v_cache, \
        table, key_begin, key_end, h, g, hkv, bs, scale, window, mode, state, w.kscr, w.vscr, w.qT, w.O, w.pp)
    switch ((ntok * g + 15) / 16) {
        case 2: KVS_TILE(2); return;
        case 3: KVS_TILE(3); return;
        case 4: KVS_TILE(4); return;
        default:
            attend_item<DH>(q, out, qrow, qpos, ntok, q_stride, out_stride, k_cache, v_cache, table, key_begin,
                            key_end, h, g, hkv, bs, scale, window, mode, state, w.kscr, w.vscr, w.acc, w.m,
                            w.l, w.alpha, w.sc, w.pb);
    }
#undef KVS_TILE
}

struct WorkItem { int seq; int h; int tok0; int ntok; int part = -1; int nh = 1; };  // part: of a split decode; nh: K/V heads h .. h + nh - 1
struct SplitDecode { int seq; int parts; int slot0; };  // parts' states in slots slot0 ..

constexpr int64_t SPLIT_MIN = 256;  // keys per part of a split decode, at least

// Keys [0, keys) cut into `parts` ranges on CHUNK boundaries; range `part`'s start.
inline int64_t split_bound(int64_t keys, int parts, int part) {
    return part == parts ? keys : (keys * part / parts) / CHUNK * CHUNK;
}

// Query head `row`'s output from the states its parts saved (base-2 maxima, sums, accumulators):
// the online softmax's own combination step, once per part.
template <int DH>
inline void merge_split_row(float* const* part_state, int parts, int64_t row, uint16_t* dst) {
    float mmax = -INFINITY;
    for (int p = 0; p < parts; ++p) mmax = std::max(mmax, part_state[p][row * (DH + 2)]);
    alignas(64) float acc[DH] = {};
    float l = 0.f;
    for (int p = 0; p < parts; ++p) {
        const float* st = part_state[p] + row * (DH + 2);
        if (st[0] == -INFINITY) continue;  // a part with no visible key
        const float wgt = exp2f(st[0] - mmax);
        l += st[1] * wgt;
        for (int d = 0; d < DH; ++d) acc[d] += st[2 + d] * wgt;
    }
    store_output_row<DH>(acc, l, dst);
}
struct PrefixItem { int group; int h; int member0; int nmembers; };

// Cascade ("shared prefix") decoding: decodes whose block tables start with the same physical
// blocks form a group; group i's members are group_members[group_start[i] .. group_start[i+1])
// and share group_prefix[i] keys. Phase 1 attends every member's query rows to the shared keys
// together (a staged key chunk serves up to TILE x g rows instead of g), saving each row's
// softmax state; phase 2 resumes each member from that state over its own keys. Same result as
// one pass (online softmax is order independent up to float rounding), far less K/V traffic.
template <int DH>
void paged_attention(const uint16_t* q, uint16_t* out, const int64_t* q_start, const int64_t* q_len,
                     int64_t q_stride, int64_t out_stride, const uint16_t* k_cache,
                     const uint16_t* v_cache, const int64_t* block_tables, int64_t bt_stride,
                     const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale,
                     int64_t window, int ngroups, const int64_t* group_start,
                     const int64_t* group_members, const int64_t* group_prefix) {
    const int g = hq / hkv;
#ifdef KVS_HAVE_AMX
    const char* amx_env = getenv("KVSERVE_AMX_ATTENTION");  // "0": the AVX512-BF16 path (comparisons)
    const bool use_amx = amx::permitted() && !(amx_env && amx_env[0] == '0');
#endif
    // prefix_of[i]: keys of sequence i attended in phase 1 (0: none); slot_of[i]: its state slot.
    std::vector<int64_t> prefix_of(n, 0);
    std::vector<int> slot_of(n, -1);
    std::vector<PrefixItem> pitems;
    int nslots = 0;
    for (int gi = 0; gi < ngroups; ++gi) {
        for (int64_t j = group_start[gi]; j < group_start[gi + 1]; ++j) {
            prefix_of[group_members[j]] = group_prefix[gi];
            slot_of[group_members[j]] = nslots++;
        }
        const int size = (int)(group_start[gi + 1] - group_start[gi]);
        for (int m0 = 0; m0 < size; m0 += TILE)
            for (int h = 0; h < hkv; ++h)
                pitems.push_back({gi, h, m0, std::min(TILE, size - m0)});
    }
    // On AMX a decode's item covers as many K/V heads as fit 16 query rows (attend_item_amx);
    // elsewhere all of them (attend_decode). KVSERVE_DECODE_SEGMENTS=0: attend_item, one item per
    // K/V head (comparisons).
    const char* seg_env = getenv("KVSERVE_DECODE_SEGMENTS");
    const bool segments = !(seg_env && seg_env[0] == '0');
    int decode_heads = segments ? hkv : 1;
    // Keys per part of a split decode, at least. attend_decode's item does every head's work
    // per key, so it splits at SPLIT_MIN key-heads: at batch 1 a 300-key context in 3 parts
    // instead of one item on one thread (0.43 -> 0.37 ms of a step's attention).
    int64_t split_min = SPLIT_MIN;
    if (segments) split_min = std::max<int64_t>(CHUNK, SPLIT_MIN / hkv);
#ifdef KVS_HAVE_AMX
    if (DH == 64 && use_amx && g <= 16) {
        decode_heads = std::min(hkv, 16 / g);
        split_min = SPLIT_MIN;
    }
#endif
    std::vector<WorkItem> items;
    for (int i = 0; i < n; ++i) {
        const int step = q_len[i] == 1 ? decode_heads : 1;
        for (int t0 = 0; t0 < q_len[i]; t0 += TILE)
            for (int h = 0; h < hkv; h += step)
                items.push_back({i, h, t0, (int)std::min<int64_t>(TILE, q_len[i] - t0), -1, std::min(step, hkv - h)});
    }
    // Split decoding: with fewer items than two per thread (a small batch: one item per token,
    // or per K/V head without AMX), a thread would stream a whole context alone while the others
    // idle. The decodes' keys are then cut into parts of at least split_min keys, each part saves
    // its softmax state as a cascade prefix does, and a last pass merges each row's parts.
    const int nthreads = omp_get_max_threads();
    std::vector<SplitDecode> splits;
    if (items.size() < 2 * (size_t)nthreads && window == 0) {
        const int want = (int)((2 * nthreads + items.size() - 1) / std::max<size_t>(items.size(), 1));
        for (int i = 0; i < n; ++i) {
            const int64_t keys = seq_lens[i] - prefix_of[i];
            const int parts = (int)std::min<int64_t>(std::min(want, 64), keys / split_min);
            if (q_len[i] != 1 || slot_of[i] >= 0 || parts < 2) continue;
            splits.push_back({i, parts, nslots});
            nslots += parts;
        }
    }
    std::vector<int> split_of(n, -1);
    for (size_t s = 0; s < splits.size(); ++s) split_of[splits[s].seq] = (int)s;
    if (!splits.empty()) {
        std::vector<WorkItem> kept;
        for (const WorkItem& it : items) {
            const int s = split_of[it.seq];
            if (s < 0) { kept.push_back(it); continue; }
            for (int part = 0; part < splits[s].parts; ++part) {
                WorkItem p = it;
                p.part = part;
                kept.push_back(p);
            }
        }
        items.swap(kept);
    }
    std::vector<float> states((size_t)nslots * hq * (DH + 2));
    // Costliest items first (prefill tiles over long contexts) so the dynamic schedule ends with
    // small ones and threads finish together.
    auto cost = [&](const WorkItem& it) {
        const int64_t keys = seq_lens[it.seq] - q_len[it.seq] + it.tok0 + it.ntok - prefix_of[it.seq];
        return (int64_t)it.ntok * it.nh * (it.part >= 0 ? keys / splits[split_of[it.seq]].parts : keys);
    };
    std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) { return cost(a) > cost(b); });
    #pragma omp parallel
    {
        alignas(64) uint32_t kscr[(CHUNK / 16) * (DH / 2) * 16];
        alignas(64) uint32_t vscr[(CHUNK / 16) * 8 * DH];
        std::vector<float> acc((size_t)TILE * g * DH), m(TILE * g), l(TILE * g), alpha(TILE * g);
        float* sc = (float*)aligned_alloc(64, sizeof(float) * TILE * g * CHUNK);
        std::vector<uint16_t> pb((size_t)TILE * g * CHUNK);
        __m512i* qT = (__m512i*)aligned_alloc(64, sizeof(__m512i) * (DH / 2) * 4);
        __m512* O = (__m512*)aligned_alloc(64, sizeof(__m512) * DH * 4);
        __m512i* pp = (__m512i*)aligned_alloc(64, sizeof(__m512i) * (CHUNK / 2) * 4);
        AmxScratch* amx_scratch = nullptr;
#ifdef KVS_HAVE_AMX
        if (use_amx && g <= 16) {
            amx_scratch = (AmxScratch*)aligned_alloc(64, sizeof(AmxScratch));
            amx_scratch->configured = 0;
        }
#endif
        std::vector<float> dec_f;
        std::vector<uint16_t> dec_pb;
        uint32_t* dec_sc = nullptr;  // scores, then the staged V
        DecodeScratch dec{};
        if (segments && decode_heads == hkv) {
            dec_f.resize((size_t)hq * (DH + 3));
            dec_pb.resize((size_t)hq * DSEG);
            dec_sc = (uint32_t*)aligned_alloc(64, sizeof(float) * hq * DSEG + sizeof(uint32_t) * hkv * 8 * DH);
            dec = {(float*)dec_sc, dec_pb.data(), dec_f.data(), dec_f.data() + (size_t)hq * DH,
                   dec_f.data() + (size_t)hq * (DH + 1), dec_f.data() + (size_t)hq * (DH + 2),
                   dec_sc + (size_t)hq * DSEG};
        }
        const Scratch scratch{kscr, vscr, acc.data(), m.data(), l.data(), alpha.data(), sc, pb.data(), qT, O, pp,
                              amx_scratch, dec};
        int64_t qrow[TILE], qpos[TILE];
        float* state[TILE];
        #pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < pitems.size(); ++w) {  // phase 1: shared prefixes
            const PrefixItem& it = pitems[w];
            const int64_t* members = group_members + group_start[it.group] + it.member0;
            for (int j = 0; j < it.nmembers; ++j) {
                const int64_t i = members[j];
                qrow[j] = q_start[i];
                qpos[j] = seq_lens[i] - 1;
                state[j] = states.data() + (size_t)slot_of[i] * hq * (DH + 2);
            }
            attend<DH>(q, out, qrow, qpos, it.nmembers, q_stride, out_stride, k_cache, v_cache,
                       block_tables + members[0] * bt_stride, 0, group_prefix[it.group], it.h, g, hkv, bs,
                       scale, 0, STORE, state, scratch);
        }  // implicit barrier: every saved state is complete before phase 2 reads it
        #pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < items.size(); ++w) {  // phase 2: everything else
            const WorkItem& it = items[w];
            const int64_t pos0 = seq_lens[it.seq] - q_len[it.seq] + it.tok0;
            for (int j = 0; j < it.ntok; ++j) {
                qrow[j] = q_start[it.seq] + it.tok0 + j;
                qpos[j] = pos0 + j;
            }
            int64_t key_begin = 0, key_end = pos0 + it.ntok;
            Mode mode = NORMAL;
            if (it.part >= 0) {  // a part of a split decode: its keys, state saved for the merge
                const SplitDecode& sd = splits[split_of[it.seq]];
                key_begin = split_bound(key_end, sd.parts, it.part);
                key_end = split_bound(key_end, sd.parts, it.part + 1);
                mode = STORE;
                state[0] = states.data() + (size_t)(sd.slot0 + it.part) * hq * (DH + 2);
            } else if (slot_of[it.seq] >= 0) {  // a decode whose prefix phase 1 covered
                key_begin = prefix_of[it.seq];
                mode = LOAD;
                state[0] = states.data() + (size_t)slot_of[it.seq] * hq * (DH + 2);
            } else if (window > 0) {
                key_begin = std::max<int64_t>(0, pos0 - window + 1);
            }
            attend<DH>(q, out, qrow, qpos, it.ntok, q_stride, out_stride, k_cache, v_cache,
                       block_tables + (int64_t)it.seq * bt_stride, key_begin, key_end, it.h, g, hkv,
                       bs, scale, window, mode, state, scratch, it.nh);
        }
        if (!splits.empty()) {  // implicit barrier above: every part's state is saved
            #pragma omp for schedule(static)
            for (size_t w = 0; w < splits.size() * hq; ++w) {  // phase 3: merge split decodes
                const SplitDecode& sd = splits[w / hq];
                const int head = (int)(w % hq);
                float* part_state[64];
                for (int p = 0; p < sd.parts; ++p)
                    part_state[p] = states.data() + (size_t)(sd.slot0 + p) * hq * (DH + 2);
                merge_split_row<DH>(part_state, sd.parts, head,
                                    out + q_start[sd.seq] * out_stride + (int64_t)head * DH);
            }
        }
        free(sc);
        free(dec_sc);
        free(qT);
        free(O);
        free(pp);
        if (amx_scratch) {
#ifdef KVS_HAVE_AMX
            _tile_release();
#endif
            free(amx_scratch);
        }
    }
}

}  // namespace
#endif

extern "C" int paged_attention_bf16_available() {
#ifdef KVS_HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

// Returns 0 on success, -1 when this build, head size or block size has no kernel.
#define PA_ENTRY(NAME, DH) \
extern "C" int NAME(const void* q, void* out, const int64_t* q_start, const int64_t* q_len, \
                    int64_t q_stride, int64_t out_stride, const void* k, const void* v, \
                    const int64_t* bt, int64_t bt_stride, const int64_t* seq_lens, int n, int hq, \
                    int hkv, int bs, float scale, int64_t window, int ngroups, \
                    const int64_t* group_start, const int64_t* group_members, const int64_t* group_prefix)
#ifdef KVS_HAVE_BF16
PA_ENTRY(paged_attention_bf16_d64, 64) {
    if (bs % 16) return -1;
    paged_attention<64>((const uint16_t*)q, (uint16_t*)out, q_start, q_len, q_stride, out_stride,
                        (const uint16_t*)k, (const uint16_t*)v, bt, bt_stride, seq_lens, n, hq, hkv,
                        bs, scale, window, ngroups, group_start, group_members, group_prefix);
    return 0;
}
PA_ENTRY(paged_attention_bf16_d128, 128) {
    if (bs % 16) return -1;
    paged_attention<128>((const uint16_t*)q, (uint16_t*)out, q_start, q_len, q_stride, out_stride,
                         (const uint16_t*)k, (const uint16_t*)v, bt, bt_stride, seq_lens, n, hq, hkv,
                         bs, scale, window, ngroups, group_start, group_members, group_prefix);
    return 0;
}
#else
PA_ENTRY(paged_attention_bf16_d64, 64) { return -1; }
PA_ENTRY(paged_attention_bf16_d128, 128) { return -1; }
#endif
