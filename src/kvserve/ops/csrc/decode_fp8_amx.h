// Decode attention over an fp8 (e4m3) cache's codes on AMX tiles: decode_quantized.cpp's path for
// the engine's default fp8 layout (a scale per block and K/V head, keys centered by an e4m3 mean
// per block, head and channel), head_dim 64, up to 16 query heads. Included by
// decode_quantized.cpp inside its namespace.
//
// Why: the float32 kernel there spends ~128 FMAs per key and query row, plus the codes'
// conversion; a batch-64 decode step's attention took longer over half the bytes (fp8) than the
// bf16 kernel over all of them (attend_amx.h), which runs at the memory's rate. Here the codes
// become bf16 in L1 and the products run on tiles, as in the bf16 kernel:
//   - an e4m3 code moved to the top byte of a 16-bit lane and shifted right by 4 (the sign's
//     copies masked off) is the bf16 of its value times 2^-120: exact, 3 instructions per 32
//     codes. Subnormal codes become bf16 denormals, which the tiles may read as zero (a value
//     below 2^-6 of the block's scale: under e4m3's own rounding step for everything else).
//   - the query is scaled by 2^100 (exact) so that the products stay far above float32's
//     denormals: scores and outputs come out times 2^-20, undone in float32.
//   - keys: S^T = K q^T with K's token rows as the A tile (the cache is token-major, so no
//     transpose) and q^T as B, one column per query row; every K/V head's products go into the
//     same S^T tile, its q^T tile zero outside the head's columns. The 16x16 result is
//     transposed in registers (64 shuffles per 16 keys for all heads) for a row-wise softmax.
//     Centering: q . (s c_t + mu) = s (q . c_t) + q . mu; q . mu is one number per block and
//     row, computed 16 blocks at a time on the same tiles (the means as A rows).
//   - values: a pair of token rows is interleaved into the tile's VNNI pairs by one vpermt2b
//     per 16 channels; the value scale (per block and head) multiplies the probabilities.
// Blocks still open in the residual pool are read from their bf16 rows (scaled to match).
// The softmax is online in base 2 as in attend_amx.h; a split sequence's spans leave their
// state (natural-log max, sum, unnormalised output) for decode()'s merge.
#ifdef KVS_HAVE_QDECODE_AMX

namespace fp8amx {

constexpr int DH = 64, CH = 32, GROUP = 16;  // head dim; keys per chunk; blocks per mean group
constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;
constexpr float Q_UP = 0x1p100f, OUT_UP = 0x1p20f, RES_DOWN = 0x1p-100f;

// A per-(block, head) number of a MetaRef whose groups span whole blocks and all channels.
inline float block_head(const MetaRef& m, int64_t b, int h) {
    const int64_t i = b * m.sb + (int64_t)h * m.sh;
    switch (m.kind) {
        case 0: return meta_load<0>(m.ptr, i);
        case 1: return meta_load<1>(m.ptr, i);
        case 2: return meta_load<2>(m.ptr, i);
        default: return meta_load<3>(m.ptr, i);
    }
}

// The layouts this path reads (anything else takes the float32 kernel).
inline bool readable(const QField& kf, const QField& vf, int hq, int hkv, int bs) {
    auto per_block_head = [&](const MetaRef& m) {
        return m.ptr && (m.gt >= bs || m.st == 0) && (m.gd >= DH || m.sd == 0) && m.kind >= 0 && m.kind <= 3;
    };
    if (kf.code_kind != 2 || vf.code_kind != 2 || kf.code_offset != 0.f || vf.code_offset != 0.f) return false;
    if (!per_block_head(kf.scale) || !per_block_head(vf.scale) || kf.expo.ptr || vf.expo.ptr || vf.zero.ptr) return false;
    if (kf.zero.ptr && !(kf.zero.kind == 2 && kf.zero.gd == 1 && kf.zero.sd == 1 && (kf.zero.gt >= bs || kf.zero.st == 0)))
        return false;
    return hq <= 16 && hq % hkv == 0 && bs % 16 == 0;
}

// Every tile 16 x 64 bytes: 0 S^T (half 0), 1 A (K rows, means), 2 B (q^T, V pairs), 3 S^T (half
// 1), then P, 4-7 O (16 channels each). P and O have 16 rows whatever hq: rows past hq are zero
// (P) or unused (O), and the products cost the same for any row count.
inline void configure() {
    amx::TileConfig c;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

// Codes (one byte each) in the top byte of 16-bit lanes -> bf16 of the e4m3 value times 2^-120.
inline __m512i e4m3_top16(__m512i x) {
    return _mm512_and_si512(_mm512_srai_epi16(x, 4), _mm512_set1_epi16((short)0x87f0));
}

struct Perms {  // vpermb / vpermt2b indices
    __m512i lo, hi;  // a row's codes 0..31 / 32..63 into the top bytes of 32 lanes
    __m512i pair[4];  // channels 16c..16c+15 of two rows (a: byte i, b: 64 + i) as (a, b) pairs
    __m512i bpair[2];  // the same for bf16 rows: 16-bit elements 16c' .. of (a, b), c' = 0, 1
    Perms() {
        alignas(64) uint8_t l[64], h[64], p[4][64];
        alignas(64) uint16_t w[2][32];
        for (int i = 0; i < 32; ++i) { l[2 * i] = l[2 * i + 1] = (uint8_t)i; h[2 * i] = h[2 * i + 1] = (uint8_t)(32 + i); }
        for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 16; ++i) {
                p[c][4 * i] = p[c][4 * i + 1] = (uint8_t)(16 * c + i);
                p[c][4 * i + 2] = p[c][4 * i + 3] = (uint8_t)(64 + 16 * c + i);
            }
        for (int c = 0; c < 2; ++c)
            for (int i = 0; i < 16; ++i) { w[c][2 * i] = (uint16_t)(16 * c + i); w[c][2 * i + 1] = (uint16_t)(32 + 16 * c + i); }
        lo = _mm512_load_si512(l); hi = _mm512_load_si512(h);
        for (int c = 0; c < 4; ++c) pair[c] = _mm512_load_si512(p[c]);
        for (int c = 0; c < 2; ++c) bpair[c] = _mm512_load_si512(w[c]);
    }
};
constexpr __mmask64 TOP = 0xAAAAAAAAAAAAAAAAull;  // the odd bytes: each 16-bit lane's top byte

// One e4m3 row of 64 channels -> 64 bf16 (times 2^-120) at dst.
inline void row_to_bf16(const uint8_t* src, uint16_t* dst, const Perms& pm) {
    const __m512i r = _mm512_loadu_si512(src);
    _mm512_store_si512(dst, e4m3_top16(_mm512_maskz_permutexvar_epi8(TOP, pm.lo, r)));
    _mm512_store_si512(dst + 32, e4m3_top16(_mm512_maskz_permutexvar_epi8(TOP, pm.hi, r)));
}

struct Scratch {
    alignas(64) uint16_t k[2][16][16 * DH];     // [half][head][token * DH + d]: A tiles (bf16)
    alignas(64) uint16_t v[16][CH / 2][DH * 2];  // [head][token pair][d pair]: B tiles
    alignas(64) uint32_t qt[16][2][16 * 16];    // [head][d half][d pair * 16 + column]: B tiles of q^T
    alignas(64) uint16_t mean[GROUP][16 * DH];  // [block][head * DH + d]: A rows of the means
    alignas(64) float cm[GROUP][16];            // q' . mean' per block of the group and row
    alignas(64) float st[2][16 * 16];           // S^T tiles of the two halves
    alignas(64) uint16_t p[16][16 * CH];        // [head][row * CH + key]: P, rows of other heads 0
    alignas(64) float o[16 * DH];               // O when it leaves the tiles
};

struct Item {
    int32_t seq;
    int64_t b0, b1;
    int64_t part;  // first of the span's saved states (see decode): -1 when the sequence has one span
};

// One work item: all hq rows of sequence `seq` (one query token) against blocks [b0, b1).
inline void attend(const QField& kf, const QField& vf, const uint16_t* res, const int64_t* block_res,
                   const uint16_t* q, float scale, const int64_t* table, int64_t b0, int64_t b1, int64_t seq_len,
                   int hq, int hkv, int bs, Scratch& w, const Perms& pm, float* m_out, float* l_out, float* acc_out) {
    const int g = hq / hkv;
    const int64_t crow = (int64_t)hkv * DH;  // bytes (codes) or elements (residual) between token rows
    // q^T per head: column r = query row r (zero outside the head's rows), times 2^100.
    memset(w.qt, 0, sizeof(uint32_t) * hkv * 2 * 256);
    for (int r = 0; r < hq; ++r) {
        const int h = r / g;
        for (int d = 0; d < DH; d += 16) {
            const __m512 x = _mm512_mul_ps(bf16x16(q + r * DH + d), _mm512_set1_ps(Q_UP));
            alignas(32) uint16_t b[16];
            _mm256_store_si256((__m256i*)b, (__m256i)_mm512_cvtneps_pbh(x));
            for (int i = 0; i < 16; i += 2) {
                const int dp = (d + i) / 2;  // d pair
                w.qt[h][dp / 16][(dp % 16) * 16 + r] = (uint32_t)b[i] | ((uint32_t)b[i + 1] << 16);
            }
        }
    }
    for (int h = 0; h < hkv; ++h) memset(w.p[h], 0, sizeof(w.p[h]));
    float m[16], l[16];
    for (int r = 0; r < hq; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    const float sl2 = scale * LOG2E;
    const int64_t key_end = std::min(seq_len, b1 * bs), key_begin = b0 * bs;
    int64_t group = -1;  // first block of the mean group in w.cm
    for (int64_t kp0 = key_begin; kp0 < key_end; kp0 += CH) {
        float mult[2][16], add[2][16], vmul[2][16];  // per half and head: S' -> base-2 logits; p -> p'
        __mmask16 valid[2];  // the keys of each half before key_end (none past it)
        for (int half = 0; half < 2; ++half) {
            const int64_t p0 = kp0 + 16 * half;
            const int n = (int)std::max<int64_t>(0, std::min<int64_t>(16, key_end - p0));
            valid[half] = (__mmask16)((1u << n) - 1);
            if (n == 0) {  // past the end: zero V (0 * garbage could be NaN), scores masked below
                for (int h = 0; h < hkv; ++h) memset(w.v[h][8 * half], 0, sizeof(uint16_t) * 8 * DH * 2);
                continue;
            }
            const int64_t bi = p0 / bs, blk = table[bi], t0 = p0 % bs;
            const int64_t e = block_res ? block_res[blk] : -1;
            if (e >= 0) {  // open block: bf16 rows
                const uint16_t* kr = res + ((int64_t)e * 2 * bs + t0) * crow;
                const uint16_t* vr = kr + (int64_t)bs * crow;
                for (int h = 0; h < hkv; ++h) {
                    for (int t = 0; t < 16; ++t) {
                        const __mmask32 live = t < n ? 0xffffffffu : 0u;
                        const uint16_t* src = kr + t * crow + h * DH;
                        _mm512_store_si512(w.k[half][h] + t * DH, _mm512_maskz_loadu_epi16(live, src));
                        _mm512_store_si512(w.k[half][h] + t * DH + 32, _mm512_maskz_loadu_epi16(live, src + 32));
                    }
                    for (int u = 0; u < 8; ++u) {
                        const int t = 2 * u;
                        const uint16_t* a = vr + t * crow + h * DH;
                        const __mmask32 la = t < n ? 0xffffffffu : 0u, lb = t + 1 < n ? 0xffffffffu : 0u;
                        const __m512i a0 = _mm512_maskz_loadu_epi16(la, a), a1 = _mm512_maskz_loadu_epi16(la, a + 32);
                        const __m512i c0 = _mm512_maskz_loadu_epi16(lb, a + crow), c1 = _mm512_maskz_loadu_epi16(lb, a + crow + 32);
                        uint16_t* dst = w.v[h][8 * half + u];
                        _mm512_store_si512(dst, _mm512_permutex2var_epi16(a0, pm.bpair[0], c0));
                        _mm512_store_si512(dst + 32, _mm512_permutex2var_epi16(a0, pm.bpair[1], c0));
                        _mm512_store_si512(dst + 64, _mm512_permutex2var_epi16(a1, pm.bpair[0], c1));
                        _mm512_store_si512(dst + 96, _mm512_permutex2var_epi16(a1, pm.bpair[1], c1));
                    }
                    mult[half][h] = RES_DOWN * sl2;
                    vmul[half][h] = 1.f / OUT_UP;
                }
                for (int r = 0; r < hq; ++r) add[half][r] = 0.f;
                continue;
            }
            // Sealed block: codes. The next chunk's rows are asked for as these are converted.
            const uint8_t* kc = kf.codes + blk * kf.code_block + t0 * crow;
            const uint8_t* vc = vf.codes + blk * vf.code_block + t0 * crow;
            const int64_t np = p0 + CH;
            const uint8_t* kn = nullptr;
            const uint8_t* vn = nullptr;
            if (np < key_end) {
                const int64_t nb = table[np / bs], nt = np % bs;
                kn = kf.codes + nb * kf.code_block + nt * crow;
                vn = vf.codes + nb * vf.code_block + nt * crow;
            }
            for (int t = 0; t < 16; ++t) {
                if (kn) {
                    for (int64_t o = 0; o < crow; o += 64) {
                        __builtin_prefetch(kn + t * crow + o);
                        __builtin_prefetch(vn + t * crow + o);
                    }
                }
                for (int h = 0; h < hkv; ++h) row_to_bf16(kc + t * crow + h * DH, w.k[half][h] + t * DH, pm);
            }
            for (int h = 0; h < hkv; ++h)
                for (int u = 0; u < 8; ++u) {
                    const __m512i a = _mm512_loadu_si512(vc + (2 * u) * crow + h * DH);
                    const __m512i c = _mm512_loadu_si512(vc + (2 * u + 1) * crow + h * DH);
                    uint16_t* dst = w.v[h][8 * half + u];
                    for (int cc = 0; cc < 4; ++cc)
                        _mm512_store_si512(dst + 32 * cc, e4m3_top16(_mm512_maskz_permutex2var_epi8(TOP, a, pm.pair[cc], c)));
                }
            if (bi + GROUP < b1) {  // the metadata of the block GROUP ahead, for its mean group
                prefetch_metas(kf, table[bi + GROUP]);
                prefetch_metas(vf, table[bi + GROUP]);
            }
            if (kf.zero.ptr && (group < 0 || bi < group || bi >= group + GROUP)) {
                // q' . mean' for blocks [bi, bi + GROUP) (open or past-the-span rows unused).
                group = bi;
                const int64_t gend = std::min<int64_t>(bi + GROUP, b1);
                for (int64_t j = bi; j < gend; ++j) {
                    const int64_t bj = table[j];
                    if (block_res && block_res[bj] >= 0) continue;
                    for (int h = 0; h < hkv; ++h)
                        row_to_bf16((const uint8_t*)kf.zero.ptr + bj * kf.zero.sb + (int64_t)h * kf.zero.sh,
                                    w.mean[j - bi] + h * DH, pm);
                }
                _tile_zero(0);
                for (int h = 0; h < hkv; ++h)
                    for (int dh = 0; dh < 2; ++dh) {
                        _tile_loadd(1, w.mean[0] + h * DH + 32 * dh, sizeof(w.mean[0]));
                        _tile_loadd(2, w.qt[h][dh], 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                _tile_stored(0, w.cm[0], 64);
            }
            for (int h = 0; h < hkv; ++h) {
                mult[half][h] = block_head(kf.scale, blk, h) * OUT_UP * sl2;
                vmul[half][h] = block_head(vf.scale, blk, h) * Q_UP;
            }
            for (int r = 0; r < hq; ++r) add[half][r] = kf.zero.ptr ? w.cm[bi - group][r] * OUT_UP * sl2 : 0.f;
        }
        // S^T per half (16 keys x hq columns), transposed to rows; base-2 logits. The halves
        // accumulate in tiles 0 and 3 in turn, so that neither product chain waits on the
        // other's (measured no faster than one tile for both halves, and no slower).
        _tile_zero(0); _tile_zero(3);
        for (int h = 0; h < hkv; ++h)
            for (int dh = 0; dh < 2; ++dh) {
                _tile_loadd(2, w.qt[h][dh], 64);
                if (valid[0]) { _tile_loadd(1, w.k[0][h] + 32 * dh, DH * 2); _tile_dpbf16ps(0, 1, 2); }
                if (valid[1]) { _tile_loadd(1, w.k[1][h] + 32 * dh, DH * 2); _tile_dpbf16ps(3, 1, 2); }
            }
        _tile_stored(0, w.st[0], 64);
        _tile_stored(3, w.st[1], 64);
        __m512 sv[16][2];
        for (int half = 0; half < 2; ++half) {
            if (valid[half] == 0) {
                for (int r = 0; r < hq; ++r) sv[r][half] = _mm512_set1_ps(-INFINITY);
                continue;
            }
            __m512i tr[16];
            for (int t = 0; t < 16; ++t) tr[t] = _mm512_load_si512(w.st[half] + 16 * t);
            transpose16_regs(tr);
            for (int r = 0; r < hq; ++r) {
                const int h = r / g;
                const __m512 x = _mm512_fmadd_ps(_mm512_castsi512_ps(tr[r]), _mm512_set1_ps(mult[half][h]),
                                                 _mm512_set1_ps(add[half][r]));
                sv[r][half] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[half], x);
            }
        }
        // Online softmax (attend_amx.h's): O leaves the tiles only when some row's max rises.
        float alpha[16];
        bool rescale = false;
        for (int r = 0; r < hq; ++r) {
            const int h = r / g;
            const float cmax = _mm512_reduce_max_ps(_mm512_max_ps(sv[r][0], sv[r][1]));
            alpha[r] = 1.f;
            if (cmax > m[r]) {
                if (m[r] != -INFINITY) { alpha[r] = exp2f(m[r] - cmax); rescale = true; l[r] *= alpha[r]; }
                m[r] = cmax;
            }
            uint16_t* pr = w.p[h] + r * CH;
            if (m[r] == -INFINITY) { memset(pr, 0, CH * 2); continue; }
            const __m512 vm = _mm512_set1_ps(m[r]);
            const __m512 e0 = _mm512_maskz_mov_ps(valid[0], exp2_512(_mm512_sub_ps(sv[r][0], vm)));
            const __m512 e1 = _mm512_maskz_mov_ps(valid[1], exp2_512(_mm512_sub_ps(sv[r][1], vm)));
            l[r] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            _mm512_store_si512((__m512i*)pr, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(e1, _mm512_set1_ps(vmul[1][h])),
                                                                        _mm512_mul_ps(e0, _mm512_set1_ps(vmul[0][h]))));
        }
        if (rescale) {
            _tile_stored(4, w.o, 256); _tile_stored(5, w.o + 16, 256); _tile_stored(6, w.o + 32, 256); _tile_stored(7, w.o + 48, 256);
            for (int r = 0; r < hq; ++r) {
                if (alpha[r] == 1.f) continue;
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int c = 0; c < DH; c += 16) _mm512_store_ps(w.o + r * DH + c, _mm512_mul_ps(_mm512_load_ps(w.o + r * DH + c), a));
            }
            _tile_loadd(4, w.o, 256); _tile_loadd(5, w.o + 16, 256); _tile_loadd(6, w.o + 32, 256); _tile_loadd(7, w.o + 48, 256);
        }
        for (int h = 0; h < hkv; ++h) {  // O += P_h . V_h: 16 key pairs x 16 channels per tile
            _tile_loadd(3, w.p[h], CH * 2);
            _tile_loadd(2, w.v[h][0], DH * 4); _tile_dpbf16ps(4, 3, 2);
            _tile_loadd(2, w.v[h][0] + 32, DH * 4); _tile_dpbf16ps(5, 3, 2);
            _tile_loadd(2, w.v[h][0] + 64, DH * 4); _tile_dpbf16ps(6, 3, 2);
            _tile_loadd(2, w.v[h][0] + 96, DH * 4); _tile_dpbf16ps(7, 3, 2);
        }
    }
    _tile_stored(4, w.o, 256); _tile_stored(5, w.o + 16, 256); _tile_stored(6, w.o + 32, 256); _tile_stored(7, w.o + 48, 256);
    for (int r = 0; r < hq; ++r) {
        m_out[r] = m[r] * LN2;  // decode()'s states are in natural log
        l_out[r] = l[r];
        for (int c = 0; c < DH; c += 16)
            _mm512_storeu_ps(acc_out + r * DH + c, _mm512_mul_ps(_mm512_load_ps(w.o + r * DH + c), _mm512_set1_ps(OUT_UP)));
    }
}

}  // namespace fp8amx

#endif  // KVS_HAVE_QDECODE_AMX
