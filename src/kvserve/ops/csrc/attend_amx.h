// attend_item on AMX tiles, for work items of up to 16 query rows (decodes: one token's g query
// heads) with head_dim 64. Included by paged_attention_bf16.cpp inside its namespace, after
// stage_chunk and state_row, which it shares.
//
// Why: on Sapphire Rapids VDPBF16PS issues at half the float32 FMA rate, and a decode's 3 rows x
// 32 keys took 384 of them per K/V head, so decode attention was compute-bound there (34 ms of a
// 62 ms batch-64 step). A TDPBF16PS costs the same ~3 ns for 1 to 16 rows, and 8 of them (q.k
// then p.v) cover 16 keys of a head.
//
// The cache's pairs layout is already AMX's B-tile (VNNI) layout: 8 d-pairs of 16 keys are 8 rows
// of 64 bytes at the block's key stride, and 8 key pairs of 16 d's are 8 rows of 64 bytes at a
// stride of head_dim pairs. Tiles: 0 S [rs x 16 float32] (one K/V head's scores of 16 keys),
// 1 A [rs x 16 bf16] (a 16-d slice of q), 2 B [8 x 32 bf16], 3 P [R x 16 bf16] (16 probabilities
// of every row), 4-7 O [R x 16 float32] (output d 16c..16c+15), all resident over the item.
//
// The softmax is online as in attend_item, but O lives in tiles, which cannot be scaled in place:
// O goes through memory only in chunks where some row's running max rises (a few times per row
// over a context; where it does not rise, one compare per 16 scores says so). FlashAttention-4
// raises the max lazily, only past a margin, to rescale even less; with a margin of 2^8 the
// largest probability was no longer exactly 1 before its bf16 rounding and the output's error
// against float64 grew by half on a peaky softmax (max 0.0124 against 0.0077). Without the
// margin the error is the AVX512-BF16 path's to 4 digits, and it measured as fast (0.63 against
// 0.61 ms per layer at batch 64 x 384 keys).
#ifdef KVS_HAVE_AMX

// rs: rows of one K/V head's scores (R, or g where a pass covers several K/V heads); R: all rows.
inline void configure_attention_tiles(int rs, int R) {
    amx::TileConfig c;
    c.rows[0] = (uint8_t)rs; c.colsb[0] = 64;
    c.rows[1] = (uint8_t)rs; c.colsb[1] = 32;
    c.rows[2] = 8; c.colsb[2] = 64;
    c.rows[3] = (uint8_t)R; c.colsb[3] = 32;
    for (int t = 4; t < 8; ++t) { c.rows[t] = (uint8_t)R; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

struct AmxScratch {
    int configured;  // the tile configuration this thread holds, rs * 32 + R (0: none yet)
    alignas(64) uint16_t q[16 * 64];  // the item's query rows, bf16
    alignas(64) float s[16 * CHUNK];  // scores of one chunk
    alignas(64) uint16_t p[16 * CHUNK];  // probabilities of one chunk, bf16
    alignas(64) float o[16 * 64];  // O, when it leaves the tiles
    alignas(64) float lv[16 * 16];  // per-row sums of probabilities, 16 lanes each
};

inline void o_to_scratch(float* o) {
    _tile_stored(4, o, 256); _tile_stored(5, o + 16, 256); _tile_stored(6, o + 32, 256); _tile_stored(7, o + 48, 256);
}
inline void o_from_scratch(const float* o) {
    _tile_loadd(4, o, 256); _tile_loadd(5, o + 16, 256); _tile_loadd(6, o + 32, 256); _tile_loadd(7, o + 48, 256);
}

// attend_item's contract, for ntok * g * nh <= 16 rows and DH == 64, except that:
// - row r is query head qh0 + r % (nh * g) (attend_item: h * g + r % g): a prefill tile also runs
//   one query head at a time, 16 tokens in a pass, where g heads per token would leave a short
//   last pass;
// - a decode (ntok == 1) can cover nh consecutive K/V heads h .. h + nh - 1 (query heads qh0 =
//   h * g onwards, g per K/V head). Per chunk each head's keys are scored against its own g rows
//   (S tile of g rows) and its probabilities enter the shared P tile with every other head's rows
//   zero, so one set of O tiles holds all nh * g rows. The tile products are as many as nh
//   passes of one head would take; what changes is the memory: the cache holds a block's heads
//   next to each other, so a chunk now reads each block's K and V as one run of nh * 2 KB
//   instead of 2 KB runs 6 KB apart, which the hardware prefetcher streams. (A non-finite V in
//   one head's visible keys would now reach the other heads' rows too, through 0 * inf; the
//   model's output for that token is lost either way.)
// `prefetch`: ask for each chunk's keys as it is staged (false where an earlier pass over them
// left them in L2).
template <int DH>
void attend_item_amx(const uint16_t* q, uint16_t* out, const int64_t* qrow, const int64_t* qpos, int ntok,
                     int64_t q_stride, int64_t out_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                     const int64_t* table, int64_t key_begin, int64_t key_end, int h, int g, int qh0, int nh,
                     int hkv, int bs, float scale, int64_t window, Mode mode, float* const* state,
                     uint32_t* kscr, uint32_t* vscr, AmxScratch& w, bool prefetch = true) {
    static_assert(DH == 64, "four O tiles of 16 d's");
    const int per_tok = nh * g, rows = ntok * per_tok;
    const int rs = nh == 1 ? rows : g;  // rows of one head's scores: head j has rows [j rs, j rs + rs)
    if (w.configured != rs * 32 + rows) {  // LDTILECFG once per shape, not once per item
        configure_attention_tiles(rs, rows);
        w.configured = rs * 32 + rows;
    }
    for (int tq = 0; tq < ntok; ++tq)
        memcpy(w.q + (size_t)tq * per_tok * DH, q + qrow[tq] * q_stride + (int64_t)qh0 * DH, (size_t)per_tok * DH * 2);
    float m[16], l[16];  // running max (base 2) and the sum carried in from a saved state
    auto head_of = [&](int r) { return qh0 + r % per_tok; };
    auto row_state = [&](int r) { return state[r / per_tok] + (int64_t)head_of(r) * (DH + 2); };  // state_row's
    if (mode == LOAD) {
        for (int r = 0; r < rows; ++r) {
            const float* st = row_state(r);
            m[r] = st[0]; l[r] = st[1];
            memcpy(w.o + r * 64, st + 2, sizeof(float) * DH);
        }
        o_from_scratch(w.o);
    } else {
        for (int r = 0; r < rows; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    }
    memset(w.lv, 0, sizeof(float) * 16 * rows);
    int64_t rpos[16], first_pos = INT64_MAX;  // each row's position; the earliest of them
    for (int r = 0; r < rows; ++r) { rpos[r] = qpos[r / per_tok]; first_pos = std::min(first_pos, rpos[r]); }
    if (nh > 1) memset(w.p, 0, sizeof(uint16_t) * CHUNK * rows);  // other heads' rows of P stay zero
    const __m512 vscale = _mm512_set1_ps(scale * LOG2E);
    constexpr int NR = CHUNK / 16;
    for (int64_t kp0 = key_begin - key_begin % CHUNK; kp0 < key_end; kp0 += CHUNK) {
        const ChunkKeys ck = chunk_keys(kp0, key_begin, key_end, first_pos, window);
        for (int j = 0; j < nh; ++j) {
            const int r0 = j * rs, r1 = r0 + rs;
            const ChunkView cv = stage_chunk<DH>(k_cache, v_cache, table, kp0, key_begin, key_end, h + j, hkv, bs,
                                                 kscr, vscr, prefetch ? THIS : NONE);
            for (int half = 0; half < NR; ++half) {  // S = q . k for 16 keys: 4 slices of 16 d's
                const uint32_t* kh = cv.k[half];
                const int64_t ks = cv.kstride[half];
                _tile_zero(0);
                for (int i = 0; i < DH / 16; ++i) {
                    _tile_loadd(1, w.q + r0 * DH + 16 * i, DH * 2);
                    _tile_loadd(2, kh + 8 * i * ks, ks * 4);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, w.s + r0 * CHUNK + 16 * half, CHUNK * 4);
            }
            float alpha[16];
            bool rescale = false;
            for (int r = r0; r < r1; ++r) {
                __mmask16 vis[NR];
                __m512 sv[NR];
                row_scores(w.s + r * CHUNK, rpos[r], window, ck, vscale, sv, vis);
                __mmask16 over = 0;
                const __m512 limit = _mm512_set1_ps(m[r]);
                for (int i = 0; i < NR; ++i) over |= _mm512_cmp_ps_mask(sv[i], limit, _CMP_GT_OQ);
                alpha[r] = 1.f;
                if (over) {  // raise the running max to this chunk's
                    __m512 vmax = sv[0];
                    for (int i = 1; i < NR; ++i) vmax = _mm512_max_ps(vmax, sv[i]);
                    const float cmax = _mm512_reduce_max_ps(vmax);
                    if (m[r] != -INFINITY) { alpha[r] = exp2f(m[r] - cmax); rescale = true; }
                    m[r] = cmax;
                }
                __m512 sum = _mm512_load_ps(w.lv + 16 * r);
                if (alpha[r] != 1.f) {  // the sums so far were relative to the old max
                    sum = _mm512_mul_ps(sum, _mm512_set1_ps(alpha[r]));
                    l[r] *= alpha[r];
                }
                if (m[r] == -INFINITY) {  // no visible key yet
                    memset(w.p + r * CHUNK, 0, CHUNK * sizeof(uint16_t));
                    continue;
                }
                const __m512 vm = _mm512_set1_ps(m[r]);
                for (int i = 0; i < NR; ++i) {
                    sv[i] = exp2_512(_mm512_sub_ps(sv[i], vm));
                    if (!ck.whole) sv[i] = _mm512_maskz_mov_ps(vis[i], sv[i]);
                    sum = _mm512_add_ps(sum, sv[i]);
                }
                _mm512_store_ps(w.lv + 16 * r, sum);
                for (int i = 0; i < NR; i += 2)
                    _mm512_store_si512((__m512i*)(w.p + r * CHUNK + 16 * i), (__m512i)_mm512_cvtne2ps_pbh(sv[i + 1], sv[i]));
            }
            if (rescale) {  // O so far was relative to the old max
                o_to_scratch(w.o);
                for (int r = r0; r < r1; ++r) {
                    if (alpha[r] == 1.f) continue;
                    const __m512 a = _mm512_set1_ps(alpha[r]);
                    for (int c = 0; c < DH; c += 16) _mm512_store_ps(w.o + r * 64 + c, _mm512_mul_ps(_mm512_load_ps(w.o + r * 64 + c), a));
                }
                o_from_scratch(w.o);
            }
            for (int half = 0; half < NR; ++half) {  // O += p . v for 16 keys: 8 key pairs x 16 d's per tile
                const uint32_t* vh = cv.v[half];
                _tile_loadd(3, w.p + 16 * half, CHUNK * 2);
                _tile_loadd(2, vh, DH * 4); _tile_dpbf16ps(4, 3, 2);
                _tile_loadd(2, vh + 16, DH * 4); _tile_dpbf16ps(5, 3, 2);
                _tile_loadd(2, vh + 32, DH * 4); _tile_dpbf16ps(6, 3, 2);
                _tile_loadd(2, vh + 48, DH * 4); _tile_dpbf16ps(7, 3, 2);
            }
            if (nh > 1) memset(w.p + r0 * CHUNK, 0, sizeof(uint16_t) * CHUNK * rs);  // zero for the next head
        }
    }
    o_to_scratch(w.o);
    for (int r = 0; r < rows; ++r) {
        const float lr = l[r] + _mm512_reduce_add_ps(_mm512_load_ps(w.lv + 16 * r));
        const float* ar = w.o + r * 64;
        if (mode == STORE) {
            float* st = row_state(r);
            st[0] = m[r]; st[1] = lr;
            memcpy(st + 2, ar, sizeof(float) * DH);
            continue;
        }
        store_output_row<DH>(ar, lr, out + qrow[r / per_tok] * out_stride + (int64_t)head_of(r) * DH);
    }
}

#endif  // KVS_HAVE_AMX
