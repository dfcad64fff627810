// Decode attention on AVX512-BF16 without AMX: one query token against the keys of K/V heads
// h0 .. h0 + nh - 1 (paged_attention gives a decode all of its sequence's heads in one item, so
// a block's K, and its V, are one contiguous run across the heads).
//
// Why not attend_item: its online softmax runs per 32-key chunk, and per chunk and row it
// reduces a max and a sum horizontally, rescales the accumulators and stores them back. For a
// decode's 3 rows per K/V head that bookkeeping, not the 192 dot products, was most of its time:
// one layer of `random`'s batch-64 step in L3 ran at ~15 % of the VDPBF16PS rate, and from DRAM
// at ~40 % of the memory's (bench/NOTES.md, "Decode attention without AMX: every K/V head per
// item, softmax per 256-key segment"). Here keys go by segments of DSEG:
//   1. q.k for the whole segment, every head, scaled into sc (rows of DSEG floats); each head's
//      q.k asks for that head's K and V lines DPF groups ahead, one of each per d-pair, so the
//      requests are spread over the products (asked for in bursts, once per group, the same
//      kernel ran 10 % slower, same note);
//   2. per row, one max, one rescale factor and the probabilities rounded to bf16 (pb);
//   3. P.V per head with the rows' accumulators in registers for the whole segment; the
//      segment's V was prefetched during step 1, so it comes from L2.
// Same arithmetic as attend_item (bf16 products into float32, base-2 softmax, p rounded to bf16
// before P.V); only the points where the running max is folded in differ.
// Included by paged_attention_bf16.cpp inside its anonymous namespace (qk_rows, pv_rows,
// for_row_groups, key_span, Mode, exp2_512).
#pragma once

constexpr int DSEG = 256;  // keys per segment: K + V of 3 heads x 256 keys = 192 KB, in L2
constexpr int DPF = 2;     // 16-key groups between the q.k in hand and the keys it asks for

struct DecodeScratch {
    float* sc;      // [hq][DSEG] scores, scaled to base 2
    uint16_t* pb;   // [hq][DSEG] bf16 probabilities
    float* acc;     // [hq][DH] output accumulators between segments
    float* m;       // [hq] running max (base 2)
    float* l;       // [hq] running sum
    float* alpha;   // [hq] this segment's rescale factors
    uint32_t* vstage;  // [hkv][8][DH] a partly visible group's V, hidden keys zeroed
};

// Keys [key_begin, key_end) of heads h0 .. h0 + nh - 1 for the token whose q row is qtok (all hq
// heads) and whose output row is otok. mode / state as attend_item: state0 holds one (m, l,
// acc[DH]) record per query head of the token.
template <int DH>
void attend_decode(const uint16_t* qtok, uint16_t* otok, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int64_t* table, int64_t key_begin, int64_t key_end, int h0, int nh, int g, int hkv,
                   int bs, float scale, Mode mode, float* state0, const DecodeScratch& w) {
    constexpr int NP = DH / 2, NV = DH / 16;
    constexpr int MAXR = NV <= 4 ? 4 : 2;  // rows per P.V register block: MAXR x NV accumulators
    const int rows = nh * g;               // row r: query head h0 * g + r
    const uint32_t* k32 = (const uint32_t*)k_cache;
    const uint32_t* v32 = (const uint32_t*)v_cache;
    const uint32_t* q32 = (const uint32_t*)(qtok + (int64_t)h0 * g * DH);
    float* const st0 = state0 ? state0 + (int64_t)h0 * g * (DH + 2) : nullptr;
    for (int r = 0; r < rows; ++r) {
        if (mode == LOAD) {
            const float* st = st0 + (int64_t)r * (DH + 2);
            w.m[r] = st[0]; w.l[r] = st[1];
            memcpy(w.acc + (int64_t)r * DH, st + 2, sizeof(float) * DH);
        } else {
            w.m[r] = -INFINITY; w.l[r] = 0.f;
            memset(w.acc + (int64_t)r * DH, 0, sizeof(float) * DH);
        }
    }
    const int64_t first = key_begin - key_begin % 16;
    const __m512 vscale = _mm512_set1_ps(scale * LOG2E);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    float* const alpha = w.alpha;
    const uint32_t* vg[DSEG / 16];
    for (int64_t s0 = first; s0 < key_end; s0 += DSEG) {
        const int ngroups = (int)((std::min<int64_t>(s0 + DSEG, key_end) - s0 + 15) / 16);
        // 1. scores
        for (int i = 0; i < ngroups; ++i) {
            const int64_t p0 = s0 + 16 * i;
            const bool ahead = p0 + DPF * 16 < key_end;
            const KeySpan sp = key_span<DH>(k32, v32, table, p0, h0, hkv, bs);
            const KeySpan pf = ahead ? key_span<DH>(k32, v32, table, p0 + DPF * 16, h0, hkv, bs) : sp;
            for (int h = 0; h < nh; ++h)
                for_row_groups(g, [&](auto R, int r0) {
                    const bool on = ahead && r0 == 0;
                    qk_rows<decltype(R)::value, NP, DSEG>(sp.k + (int64_t)h * NP * bs, bs, q32 + (int64_t)(h * g + r0) * NP,
                                                          w.sc + (int64_t)(h * g + r0) * DSEG + 16 * i, vscale,
                                                          on ? pf.k + (int64_t)h * NP * bs : nullptr,
                                                          pf.v + (int64_t)h * (bs / 2) * DH);
                });
        }
        // The segment's first and last groups may hold keys outside [key_begin, key_end).
        const __m512i vfirst = _mm512_add_epi32(iota, _mm512_set1_epi32((int)s0));
        const __m512i vlast = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(s0 + 16 * (ngroups - 1))));
        const __m512i vb = _mm512_set1_epi32((int)key_begin), ve = _mm512_set1_epi32((int)key_end);
        const __mmask16 in_first = _mm512_cmpge_epi32_mask(vfirst, vb) & _mm512_cmplt_epi32_mask(vfirst, ve);
        const __mmask16 in_last = _mm512_cmpge_epi32_mask(vlast, vb) & _mm512_cmplt_epi32_mask(vlast, ve);
        auto visible = [&](int i) -> __mmask16 {
            __mmask16 v = 0xFFFF;
            if (i == 0) v &= in_first;
            if (i == ngroups - 1) v &= in_last;
            return v;
        };
        // 2. softmax: one max and one rescale per row and segment
        for (int r = 0; r < rows; ++r) {
            float* sr = w.sc + (int64_t)r * DSEG;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int i = 0; i < ngroups; ++i) vmax = _mm512_mask_max_ps(vmax, visible(i), vmax, _mm512_load_ps(sr + 16 * i));
            const float cmax = _mm512_reduce_max_ps(vmax);
            uint16_t* pr = w.pb + (int64_t)r * DSEG;
            if (cmax == -INFINITY) {  // no visible key in this segment
                alpha[r] = 1.f;
                memset(pr, 0, sizeof(uint16_t) * 16 * ngroups);
                continue;
            }
            const float mnew = std::max(cmax, w.m[r]);
            alpha[r] = w.m[r] == -INFINITY ? 0.f : (mnew == w.m[r] ? 1.f : exp2f(w.m[r] - mnew));
            const __m512 vm = _mm512_set1_ps(mnew);
            __m512 vsum = _mm512_setzero_ps();
            for (int i = 0; i < ngroups; ++i) {
                const __m512 p = _mm512_maskz_mov_ps(visible(i), exp2_512(_mm512_sub_ps(_mm512_load_ps(sr + 16 * i), vm)));
                vsum = _mm512_add_ps(vsum, p);
                _mm256_storeu_si256((__m256i*)(pr + 16 * i), (__m256i)_mm512_cvtneps_pbh(p));
            }
            w.l[r] = w.l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
            w.m[r] = mnew;
        }
        // 3. P.V per head; a partly visible group's V is staged with its hidden keys zeroed
        //    (a slot past the sequence's end may hold anything, and 0 x NaN is NaN).
        for (int h = 0; h < nh; ++h) {
            for (int i = 0; i < ngroups; ++i) {
                const int64_t p0 = s0 + 16 * i;
                vg[i] = key_span<DH>(k32, v32, table, p0, h0 + h, hkv, bs).v;
            }
            // Only the item's last group can hold slots past key_end; keys before key_begin
            // are real keys with probability 0.
            uint32_t* stage = w.vstage + (int64_t)h * 8 * DH;
            if (in_last != 0xFFFF) {
                for (int u = 0; u < 8; ++u) {
                    const uint32_t bits = ((in_last >> (2 * u)) & 1 ? 0x55555555u : 0u) |
                                          ((in_last >> (2 * u + 1)) & 1 ? 0xaaaaaaaau : 0u);
                    for (int c = 0; c < NV; ++c)
                        _mm512_storeu_si512(stage + u * DH + 16 * c,
                                            _mm512_maskz_loadu_epi16((__mmask32)bits, vg[ngroups - 1] + u * DH + 16 * c));
                }
                vg[ngroups - 1] = stage;
            }
            for_row_groups<MAXR>(g, [&](auto R, int r0) {
                const int r = h * g + r0;
                pv_rows<decltype(R)::value, NV, DSEG>(vg, ngroups, w.pb + (int64_t)r * DSEG, alpha + r,
                                                      w.acc + (int64_t)r * DH);
            });
        }
    }
    for (int r = 0; r < rows; ++r) {
        if (mode == STORE) {
            float* st = st0 + (int64_t)r * (DH + 2);
            st[0] = w.m[r]; st[1] = w.l[r];
            memcpy(st + 2, w.acc + (int64_t)r * DH, sizeof(float) * DH);
        } else {
            store_output_row<DH>(w.acc + (int64_t)r * DH, w.l[r], otok + ((int64_t)h0 * g + r) * DH);
        }
    }
}
