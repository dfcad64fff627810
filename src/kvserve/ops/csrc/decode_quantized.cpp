// Decode attention straight over a quantized KV cache's codes (called from torch_backend.py,
// `_decode_on_codes`, for the decodes of any step): no dequantized copy of the blocks is made.
//
// The staging pass (stage_quantized.cpp) turns every block a step reads into bf16 before the
// varlen kernel reads it: ~0.5 ns of per-element work on 2 cores, ~25-30 ms of a batch-64 int8
// decode step whose bf16 counterpart takes ~60 (bench/NOTES.md, "Decode attention
// over quantized codes in place"). Here the
// dequantization formula x = ((code - offset) * scale + zero) * 2^e is folded into the
// attention's own arithmetic instead, which works for the groupings the caches use:
//   keys   (scale, zero, exponent constant over a block's 16-token span, per channel d: KIVI's
//          per-channel keys, fp8's per-block scale and key means):
//            q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d
//          so the query row is multiplied by the scales once per span, the zero points become one
//          number per row, and the scores are dot products with the raw codes;
//   values (scale, zero, exponent constant over 16-channel chunks, per token t: KIVI's per-token
//          values, fp8's per-block scale):
//            sum_t p_t v_td = sum_t (p_t s_tc) c_td + sum_t p_t z_tc
//          so each probability is multiplied by its token's scale, and the zero points add one
//          sum per chunk.
// The arithmetic is float32 throughout: codes are exact in float32, so this is *closer* to the
// dequantized values than the staged bf16 copy (which rounds every value to 8 significant bits).
// Blocks still open in the residual pool are read from their bf16 rows.
//
// Keys are stored token-major ([bs][hkv][dh] bytes per block): each 16-token span of a head is
// transposed in registers (16x16 of 32-bit words: 4 channels per word, 8 for int4) so that a register
// holds one channel's code for 16 keys and the scores need no horizontal sums.
//
// Work item = (sequence, K/V head, span of blocks); a long context is split into several spans
// whose softmax states (max, sum, unnormalised output) are merged afterwards (flash-decoding),
// so one sequence still keeps both cores busy.
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <algorithm>
#include <vector>
#include <omp.h>

#include "quant_fields.h"

#if defined(KVS_HAVE_QUANT_FIELDS) && defined(__AVX512BF16__)
#include "avx512_exp.h"
#define KVS_HAVE_QDECODE 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512VBMI__)
#include <stdlib.h>
#include "amx.h"
#define KVS_HAVE_QDECODE_AMX 1
#endif

namespace {

constexpr int SPAN = 16;  // keys per softmax step: one register of scores

inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 lanes of m's value at tokens t0..t0+15 of block b, head h, channel group offset `go`
// (= (d0 / gd) * sd for chunk d0; m is constant over each 16-channel chunk: gd % 16 == 0).
template <int MK>
inline __m512 token_lanes(const MetaRef& m, int64_t b, int t0, int h, int64_t go) {
    const int64_t base = b * m.sb + (int64_t)h * m.sh + go;
    if (m.gt % SPAN == 0 || m.st == 0)  // one value for the 16 tokens
        return _mm512_set1_ps(meta_load<MK>(m.ptr, base + (int64_t)(t0 / m.gt) * m.st));
    constexpr int ES = MK == 0 ? 4 : MK == 1 ? 2 : 1;  // bytes per element
    if (m.gt == 1 && MK <= 2 && m.st * ES + ES >= 4) {  // per token (KIVI's values): one gather
        const int64_t first = base + (int64_t)t0 * m.st;
        const __m512i lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32((int)m.st));
        if constexpr (MK == 0) return _mm512_i32gather_ps(lane, (const float*)m.ptr + first, 4);
        // float16 / e4m3: 32-bit loads at each element (its bytes at the bottom), the last lane's
        // moved down so that its element is the top of the word: with elements at least
        // 4 - ES bytes apart beyond the first (the condition above), no load reaches past the
        // element of lane 15, the last one read. Closer ones (1-2 KV heads of e4m3 scales) loop.
        const __m512i last = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4 - ES);
        const __m512i at = _mm512_sub_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(ES)), last);
        __m512i x = _mm512_i32gather_epi32(at, (const uint8_t*)m.ptr + first * ES, 1);
        x = _mm512_srlv_epi32(x, _mm512_slli_epi32(last, 3));
        if constexpr (MK == 1) return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
        else return e4m3x16(_mm512_cvtepi32_epi8(_mm512_and_si512(x, _mm512_set1_epi32(0xff))));
    }
    alignas(64) float lanes[SPAN];
    for (int i = 0; i < SPAN; ++i) lanes[i] = meta_load<MK>(m.ptr, base + (int64_t)((t0 + i) / m.gt) * m.st);
    return _mm512_load_ps(lanes);
}

inline __m512 token_lanes(const MetaRef& m, int64_t b, int t0, int h, int64_t go) {
    switch (m.kind) {
        case 0: return token_lanes<0>(m, b, t0, h, go);
        case 1: return token_lanes<1>(m, b, t0, h, go);
        case 2: return token_lanes<2>(m, b, t0, h, go);
        default: return token_lanes<3>(m, b, t0, h, go);
    }
}

// ((code - offset) * scale + zero) * 2^e as code * s + z: s = scale * 2^e, z = (zero - offset *
// scale) * 2^e (e: null when the format has no exponent).
inline void effective(__m512 scale, __m512 zero, __m512 offset, const __m512* e, __m512& s, __m512& z) {
    s = scale;
    z = _mm512_fnmadd_ps(offset, scale, zero);
    if (e) {
        s = _mm512_mul_ps(s, *e);
        z = _mm512_mul_ps(z, *e);
    }
}

// The effective scale and zero of a key span, per channel.
template <int DH>
void key_fold(const QField& f, int64_t b, int t0, int h, float* s, float* z, float* tmp) {
    expand_group(f.scale, b, t0 / f.scale.gt, h, DH, s);
    if (f.zero.ptr) expand_group(f.zero, b, t0 / f.zero.gt, h, DH, z);
    else memset(z, 0, sizeof(float) * DH);
    const __m512 off = _mm512_set1_ps(f.code_offset);
    if (f.expo.ptr) expand_group(f.expo, b, t0 / f.expo.gt, h, DH, tmp);
    for (int d = 0; d < DH; d += 16) {
        const __m512 e = f.expo.ptr ? _mm512_load_ps(tmp + d) : _mm512_setzero_ps();
        __m512 sr, zr;
        effective(_mm512_load_ps(s + d), _mm512_load_ps(z + d), off, f.expo.ptr ? &e : nullptr, sr, zr);
        _mm512_store_ps(s + d, sr);
        _mm512_store_ps(z + d, zr);
    }
}

// Where a value field's chunks find their group (computed once per call, not per span).
struct ValueChunks {
    int64_t go[3][16];  // scale, zero, exponent: (16 c / gd) * sd per chunk c (dh <= 256)
    bool repeat[16];    // chunk c reads the same groups as chunk c - 1
};

ValueChunks value_chunks(const QField& f, int dh) {
    ValueChunks vc;
    const MetaRef* ms[3] = {&f.scale, &f.zero, &f.expo};
    for (int c = 0; c < dh / 16; ++c) {
        vc.repeat[c] = c > 0;
        for (int i = 0; i < 3; ++i) {
            if (!ms[i]->ptr) continue;
            vc.go[i][c] = (int64_t)((16 * c) / ms[i]->gd) * ms[i]->sd;
            if (c > 0 && (16 * c) / ms[i]->gd != (16 * c - 16) / ms[i]->gd) vc.repeat[c] = false;
        }
    }
    return vc;
}

// The effective scale and zero of a value span, as token lanes per 16-channel chunk: s[c], z[c].
template <int DH>
void value_fold(const QField& f, const ValueChunks& vc, int64_t b, int t0, int h, __m512* s, __m512* z) {
    const __m512 off = _mm512_set1_ps(f.code_offset);
    for (int c = 0; c < DH / 16; ++c) {
        if (vc.repeat[c]) {
            s[c] = s[c - 1];
            z[c] = z[c - 1];
            continue;
        }
        const __m512 zero = f.zero.ptr ? token_lanes(f.zero, b, t0, h, vc.go[1][c]) : _mm512_setzero_ps();
        const __m512 e = f.expo.ptr ? token_lanes(f.expo, b, t0, h, vc.go[2][c]) : _mm512_setzero_ps();
        effective(token_lanes(f.scale, b, t0, h, vc.go[0][c]), zero, off, f.expo.ptr ? &e : nullptr, s[c], z[c]);
    }
}

// Byte c of every 32-bit lane, moved to byte `pos` of the lane and the rest zeroed (vpshufb picks
// within 128-bit lanes).
inline __m512i byte_picker(int c, int pos) {
    const __m512i word = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
    const __m512i src = _mm512_add_epi32(word, _mm512_set1_epi32(c));  // source byte, 0..15
    const __m512i zeroed = _mm512_set1_epi32((int)(0x80808080u & ~(0xffu << (8 * pos))));  // high bit: a zero byte
    return _mm512_or_si512(_mm512_sllv_epi32(src, _mm512_set1_epi32(8 * pos)), zeroed);
}

// Where the byte goes in its lane, per code kind: uint8 low byte; e4m3 top byte (then shifted
// into float32's exponent and mantissa); e5m2 second byte (float16's high byte). int4 words are
// not picked apart by bytes but by nibbles (lane_codes).
constexpr int code_byte_pos(int ck) { return ck == 2 ? 3 : ck == 3 ? 1 : 0; }

// e4m3 bits b at the top of a 32-bit lane -> the float32 with b's value times 2^-120: sign stays
// at bit 31, exponent and mantissa shift into place (an arithmetic shift, the sign's copies
// masked off). Exact for subnormals too, which become float32 denormals; the multiply by 2^120
// brings them back (hence no kernel when denormals are flushed: MXCSR.DAZ, see decode()).
inline __m512 e4m3_top(__m512i x) {
    const __m512 f = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(x, 4), _mm512_set1_epi32((int)0x87f00000)));
    return _mm512_mul_ps(f, _mm512_set1_ps(0x1p120f));
}

// Code i of every 32-bit word of w (16 keys), as float32: a byte picked to code_byte_pos(CK) for
// the 8-bit kinds (i < 4), nibble i for int4 (i < 8, low nibble = lower channel).
template <int CK>
inline __m512 lane_codes(__m512i w, const __m512i* pick, int i) {
    if constexpr (CK == 1) return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(w, _mm_cvtsi32_si128(4 * i)),
                                                                       _mm512_set1_epi32(15)));
    const __m512i x = _mm512_shuffle_epi8(w, pick[i]);
    if constexpr (CK == 0) return _mm512_cvtepi32_ps(x);
    else if constexpr (CK == 2) return e4m3_top(x);
    else return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
}

// Codes of channels d0 .. d0 + 15 of a token row, as float32.
template <int CK>
inline __m512 row_codes(const uint8_t* row, int d0) {
    if constexpr (CK == 1) {  // two per byte, low nibble first
        const __m128i bytes = _mm_loadl_epi64((const __m128i*)(row + d0 / 2));
        const __m128i dup = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup), shift),
                                                   _mm512_set1_epi32(15)));
    }
    const __m128i b = _mm_loadu_si128((const __m128i*)(row + d0));
    if constexpr (CK == 0) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    else if constexpr (CK == 2) return e4m3_top(_mm512_slli_epi32(_mm512_cvtepu8_epi32(b), 24));
    else return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}

// Scores of R query rows against the 16 keys of a sealed span: sum_d qk[r][d] * code_td.
// codes: the span's first token row of head h; row: bytes between token rows.
template <int DH, int R, int CK>
inline void span_scores(const uint8_t* codes, int64_t row, const float* qk, __m512* sc) {
    constexpr int PER_WORD = CK == 1 ? 8 : 4;                  // codes per 32-bit word
    constexpr int WORDS = std::min(16, DH / PER_WORD);          // words per token row and pass
    constexpr int PASS = WORDS * PER_WORD;                      // channels per pass
    constexpr int pos = code_byte_pos(CK);
    const __m512i pick[4] = {byte_picker(0, pos), byte_picker(1, pos), byte_picker(2, pos), byte_picker(3, pos)};
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int j0 = 0; j0 < DH; j0 += PASS) {
        const uint8_t* src = codes + j0 * 4 / PER_WORD;
        __m512i w[16];
        for (int t = 0; t < 16; ++t)
            w[t] = WORDS == 16 ? _mm512_loadu_si512(src + t * row)
                               : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)(src + t * row)));
        transpose16_regs(w);  // w[j]: channels j0 + PER_WORD * j .. of the 16 keys
        for (int j = 0; j < WORDS; ++j)
            for (int i = 0; i < PER_WORD; ++i) {
                const __m512 x = lane_codes<CK>(w[j], pick, i);
                const int d = j0 + PER_WORD * j + i;
                for (int r = 0; r < R; ++r)
                    acc[r][i & 1] = _mm512_fmadd_ps(x, _mm512_set1_ps(qk[r * DH + d]), acc[r][i & 1]);
            }
    }
    for (int r = 0; r < R; ++r) sc[r] = _mm512_add_ps(acc[r][0], acc[r][1]);
}

// Scores against an open span's bf16 rows (row: elements between token rows).
template <int DH, int R>
inline void open_span_scores(const uint16_t* k, int64_t row, int n, const float* qf, __m512* sc) {
    alignas(64) float s[R][SPAN];
    for (int t = 0; t < n; ++t) {
        __m512 x[DH / 16];
        for (int c = 0; c < DH / 16; ++c) x[c] = bf16x16(k + t * row + 16 * c);
        for (int r = 0; r < R; ++r) {
            __m512 a = _mm512_mul_ps(x[0], _mm512_load_ps(qf + r * DH));
            for (int c = 1; c < DH / 16; ++c) a = _mm512_fmadd_ps(x[c], _mm512_load_ps(qf + r * DH + 16 * c), a);
            s[r][t] = _mm512_reduce_add_ps(a);
        }
    }
    for (int r = 0; r < R; ++r) sc[r] = _mm512_load_ps(s[r]);  // lanes >= n are masked by the caller
}

struct SpanState {  // one query row's online-softmax state
    float m, l;
};

// One work item: R query rows (heads h * g + r0 ..) of a sequence against the keys of blocks
// [b0, b1) of its table, up to seq_len. Leaves the unnormalised state: m, l, acc [R][DH].
template <int DH, int R, int CK>
void attend_span(const QField& kf, const QField& vf, const ValueChunks& vch, const uint16_t* res, const int64_t* block_res,
                 const uint16_t* q, float scale, const int64_t* table, int64_t b0, int64_t b1, int64_t seq_len,
                 int h, int hkv, int bs, SpanState* st, float* acc_out) {
    constexpr int NC = DH / 16;
    alignas(64) float qf[R * DH], qk[R * DH], ks[DH], kz[DH], tmp[DH];
    alignas(64) float w[R][NC][SPAN];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c)
            _mm512_store_ps(qf + r * DH + 16 * c, _mm512_mul_ps(bf16x16(q + r * DH + 16 * c), _mm512_set1_ps(scale)));
    __m512 acc[R][NC], zacc[R][NC];
    float m[R], l[R], zt[R];
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (int c = 0; c < NC; ++c) acc[r][c] = zacc[r][c] = _mm512_setzero_ps();
    }
    const int64_t row = (int64_t)hkv * DH;  // residual elements between token rows
    constexpr int P = CK == 1 ? DH / 2 : DH;  // code bytes per head and token
    const int64_t crow = (int64_t)hkv * P;     // code bytes between token rows
    const int kgt = std::min({kf.scale.gt, kf.zero.ptr ? kf.zero.gt : bs, kf.expo.ptr ? kf.expo.gt : bs});
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t blk = table[b];
        const int64_t e = block_res ? block_res[blk] : -1;
        const uint8_t* kc = kf.codes + blk * kf.code_block + (int64_t)h * P;
        const uint8_t* vc = vf.codes + blk * vf.code_block + (int64_t)h * P;
        const uint8_t* kn = nullptr;  // the block two ahead: blocks sit anywhere in the pool
        const uint8_t* vn = nullptr;
        if (b + 2 < b1) {
            const int64_t nb = table[b + 2];
            kn = kf.codes + nb * kf.code_block + (int64_t)h * P;
            vn = vf.codes + nb * vf.code_block + (int64_t)h * P;
            prefetch_metas(kf, nb);  // every head's: the block's few lines for all of them
            prefetch_metas(vf, nb);
        }
        for (int t0 = 0; t0 < bs; t0 += SPAN) {
            const int64_t p0 = b * bs + t0;
            if (p0 >= seq_len) break;
            const int n = (int)std::min<int64_t>(SPAN, seq_len - p0);
            __m512 sc[R], vs[DH / 16], vz[DH / 16];
            // The value metadata first: its loads (gathers, likely cache misses) then overlap
            // with the key work instead of stalling the value loop.
            if (e < 0) value_fold<DH>(vf, vch, blk, t0, h, vs, vz);
            const uint16_t* ko = nullptr;
            if (e >= 0) {
                ko = res + ((int64_t)e * 2 * bs + t0) * row + (int64_t)h * DH;
                open_span_scores<DH, R>(ko, row, n, qf, sc);
            } else {
                if (t0 % kgt == 0) {
                    key_fold<DH>(kf, blk, t0, h, ks, kz, tmp);
                    for (int r = 0; r < R; ++r) {
                        __m512 a = _mm512_setzero_ps();
                        for (int c = 0; c < NC; ++c) {
                            const __m512 x = _mm512_load_ps(qf + r * DH + 16 * c);
                            _mm512_store_ps(qk + r * DH + 16 * c, _mm512_mul_ps(x, _mm512_load_ps(ks + 16 * c)));
                            a = _mm512_fmadd_ps(x, _mm512_load_ps(kz + 16 * c), a);
                        }
                        zt[r] = _mm512_reduce_add_ps(a);
                    }
                }
                span_scores<DH, R, CK>(kc + t0 * crow, crow, qk, sc);
                for (int r = 0; r < R; ++r) sc[r] = _mm512_add_ps(sc[r], _mm512_set1_ps(zt[r]));
            }
            const __mmask16 valid = (__mmask16)((1u << n) - 1);
            __m512 p[R];
            for (int r = 0; r < R; ++r) {
                const float mx = _mm512_mask_reduce_max_ps(valid, sc[r]);
                const float mn = std::max(m[r], mx);
                const float alpha = expf(m[r] - mn);  // 0 on the first span (m = -inf)
                p[r] = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc[r], _mm512_set1_ps(mn))));
                l[r] = l[r] * alpha + _mm512_reduce_add_ps(p[r]);
                m[r] = mn;
                if (alpha != 1.f) {
                    const __m512 a = _mm512_set1_ps(alpha);
                    for (int c = 0; c < NC; ++c) {
                        acc[r][c] = _mm512_mul_ps(acc[r][c], a);
                        zacc[r][c] = _mm512_mul_ps(zacc[r][c], a);
                    }
                }
            }
            if (e >= 0) {
                const uint16_t* vo = ko + (int64_t)bs * row;
                alignas(64) float pr[R][SPAN];
                for (int r = 0; r < R; ++r) _mm512_store_ps(pr[r], p[r]);
                for (int t = 0; t < n; ++t)
                    for (int c = 0; c < NC; ++c) {
                        const __m512 x = bf16x16(vo + t * row + 16 * c);
                        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(x, _mm512_set1_ps(pr[r][t]), acc[r][c]);
                    }
                continue;
            }
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < NC; ++c) {
                    _mm512_store_ps(w[r][c], _mm512_mul_ps(p[r], vs[c]));
                    zacc[r][c] = _mm512_fmadd_ps(p[r], vz[c], zacc[r][c]);
                }
            const uint8_t* v0 = vc + t0 * crow;
            for (int t = 0; t < n; ++t) {
                if (kn) {
                    __builtin_prefetch(kn + (t0 + t) * crow);
                    __builtin_prefetch(vn + (t0 + t) * crow);
                }
                for (int c = 0; c < NC; ++c) {
                    const __m512 x = row_codes<CK>(v0 + t * crow, 16 * c);
                    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(x, _mm512_set1_ps(w[r][c][t]), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        st[r].m = m[r];
        st[r].l = l[r];
        for (int c = 0; c < NC; ++c)
            _mm512_storeu_ps(acc_out + r * DH + 16 * c,
                             _mm512_add_ps(acc[r][c], _mm512_set1_ps(_mm512_reduce_add_ps(zacc[r][c]))));
    }
}

template <int DH, int CK>
void attend_rows(int rows, const QField& kf, const QField& vf, const ValueChunks& vch, const uint16_t* res,
                 const int64_t* block_res,
                 const uint16_t* q, float scale, const int64_t* table, int64_t b0, int64_t b1, int64_t seq_len,
                 int h, int hkv, int bs, SpanState* st, float* acc) {
    constexpr int RMAX = DH <= 64 ? 4 : 2;  // accumulators: R * DH / 16 registers
    for (int r = 0; r < rows; r += RMAX) {
        const int n = std::min(RMAX, rows - r);
        const uint16_t* qr = q + (int64_t)r * DH;
#define KVS_ROWS(N) attend_span<DH, N, CK>(kf, vf, vch, res, block_res, qr, scale, table, b0, b1, seq_len, h, hkv, bs, \
                                       st + r, acc + (int64_t)r * DH)
        if (n == 4) { if constexpr (RMAX >= 4) KVS_ROWS(4); }
        else if (n == 3) { if constexpr (RMAX >= 3) KVS_ROWS(3); }
        else if (n == 2) KVS_ROWS(2);
        else KVS_ROWS(1);
#undef KVS_ROWS
    }
}

inline void store_bf16(uint16_t* dst, const float* src, float inv, int dh) {
    for (int d = 0; d < dh; d += 16)
        _mm256_storeu_si256((__m256i*)(dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), _mm512_set1_ps(inv))));
}

bool supported(const QField& f, bool key, int bs) {
    const MetaRef* ms[3] = {&f.scale, &f.zero, &f.expo};
    if (f.code_kind < 0 || f.code_kind > 3 || !f.scale.ptr) return false;
    for (const MetaRef* m : ms) {
        if (!m->ptr) continue;
        if (m->gt < 1 || m->gd < 1 || m->kind < 0 || m->kind > 3) return false;
        if (key && m->gt % SPAN) return false;       // keys: constant over each 16-token span
        if (!key && m->gd % 16) return false;        // values: constant over 16-channel chunks
    }
    return bs % SPAN == 0;
}

// Merges the spans of split sequence i, K/V head h (nothing when it has one): each rescaled to the
// common max and added. Span j's row r of the head is states / accs [(first_part[i] + h * k + j) *
// g + r] for its k spans. out_row: the sequence's output row; sum: DH floats of scratch.
template <int DH>
void merge_spans(int i, int h, int g, int hkv, const int64_t* first_part, const SpanState* states, const float* accs,
                 uint16_t* out_row, float* sum) {
    const int64_t k = (first_part[i + 1] - first_part[i]) / hkv;
    if (k == 0) return;
    const int64_t p0 = first_part[i] + h * k;
    uint16_t* o = out_row + (int64_t)h * g * DH;
    for (int r = 0; r < g; ++r) {
        float mx = -INFINITY, l = 0.f;
        for (int64_t j = 0; j < k; ++j) mx = std::max(mx, states[(size_t)(p0 + j) * g + r].m);
        memset(sum, 0, sizeof(float) * DH);
        for (int64_t j = 0; j < k; ++j) {
            const SpanState& s = states[(size_t)(p0 + j) * g + r];  // spans hold >= 1 block: l > 0
            const float f = expf(s.m - mx);
            l += s.l * f;
            const float* a = &accs[((size_t)(p0 + j) * g + r) * DH];
            for (int d = 0; d < DH; d += 16)
                _mm512_storeu_ps(sum + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(f), _mm512_loadu_ps(sum + d)));
        }
        store_bf16(o + (int64_t)r * DH, sum, 1.f / l, DH);
    }
}

// How a step's sequences are cut into spans of blocks: enough work items for every thread even at
// batch 1, none shorter than 8 blocks. `per_span`: work items per span (decode(): one per K/V
// head; decode_tiles(): one for all heads). spans[i] = sequence i's span count k; its saved states
// start at first_part[i] (hkv * k of them when k > 1, none otherwise); first_part[n] is their total.
struct SpanPlan {
    std::vector<int64_t> spans, first_part;
};

SpanPlan plan_spans(const int64_t* seq_lens, int n, int bs, int hkv, int per_span) {
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += (seq_lens[i] + bs - 1) / bs;
    const int64_t t = 8 * omp_get_max_threads();
    const int64_t target = std::max<int64_t>(8, (total * per_span + t - 1) / t);
    SpanPlan sp{std::vector<int64_t>(n), std::vector<int64_t>(n + 1, 0)};
    int64_t parts = 0;
    for (int i = 0; i < n; ++i) {
        const int64_t nb = (seq_lens[i] + bs - 1) / bs;
        sp.spans[i] = std::max<int64_t>(1, (nb + target - 1) / target);
        sp.first_part[i] = parts;
        if (sp.spans[i] > 1) parts += hkv * sp.spans[i];
    }
    sp.first_part[n] = parts;
    return sp;
}

struct Item {
    int32_t seq, head;
    int64_t b0, b1;
    int64_t part;  // index into the saved states (-1: the sequence's only span, written directly)
};

#include "decode_fp8_amx.h"  // fp8amx::attend: e4m3 codes on AMX tiles

#ifdef KVS_HAVE_QDECODE_AMX
inline bool tiles_enabled() {
    const char* env = getenv("KVSERVE_AMX_ATTENTION");  // "0": the float32 kernel (tests, comparisons)
    return amx::permitted() && !(env && env[0] == '0');
}

// decode() for the layouts fp8amx::readable accepts: one work item per (sequence, span of
// blocks) with all of its query heads, the spans merged as decode() merges its own.
template <int DH>
int decode_tiles(const QField* kf, const QField* vf, const uint16_t* res, const int64_t* block_res, const uint16_t* q,
                 uint16_t* out, const int64_t* qrow, int64_t q_stride, int64_t out_stride, const int64_t* tables,
                 int64_t bt_stride, const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale) {
    static_assert(DH == fp8amx::DH, "the tiles hold head_dim 64");
    const int g = hq / hkv;
    const SpanPlan plan = plan_spans(seq_lens, n, bs, hkv, 1);
    const std::vector<int64_t>& first_part = plan.first_part;
    const int64_t parts = first_part[n];
    std::vector<fp8amx::Item> items;
    for (int i = 0; i < n; ++i) {
        const int64_t nb = (seq_lens[i] + bs - 1) / bs, k = plan.spans[i];
        for (int64_t j = 0; j < k; ++j) items.push_back({i, nb * j / k, nb * (j + 1) / k, k > 1 ? j : -1});
    }
    std::vector<SpanState> states((size_t)parts * g);
    std::vector<float> accs((size_t)parts * g * DH);
    static const fp8amx::Perms perms;
    #pragma omp parallel
    {
        // ~200 KB per thread, allocated once (an OpenMP thread lives as long as the process).
        static thread_local fp8amx::Scratch* w = (fp8amx::Scratch*)aligned_alloc(64, sizeof(fp8amx::Scratch));
        fp8amx::configure();
        alignas(64) float m[16], l[16], acc[16 * DH];
        #pragma omp for schedule(dynamic, 1)
        for (size_t x = 0; x < items.size(); ++x) {
            const fp8amx::Item it = items[x];
            fp8amx::attend(*kf, *vf, res, block_res, q + qrow[it.seq] * q_stride, scale, tables + it.seq * bt_stride,
                           it.b0, it.b1, seq_lens[it.seq], hq, hkv, bs, *w, perms, m, l, acc);
            if (it.part < 0) {
                for (int r = 0; r < hq; ++r)
                    store_bf16(out + qrow[it.seq] * out_stride + (int64_t)r * DH, acc + r * DH, 1.f / l[r], DH);
                continue;
            }
            const int64_t k = plan.spans[it.seq];
            for (int r = 0; r < hq; ++r) {
                const size_t slot = (size_t)(first_part[it.seq] + (r / g) * k + it.part) * g + r % g;
                states[slot] = {m[r], l[r]};
                memcpy(&accs[slot * DH], acc + r * DH, sizeof(float) * DH);
            }
        }
        #pragma omp for schedule(static)
        for (int64_t x = 0; x < (int64_t)n * hkv; ++x)
            merge_spans<DH>((int)(x / hkv), (int)(x % hkv), g, hkv, first_part.data(), states.data(), accs.data(),
                            out + qrow[x / hkv] * out_stride, acc);
    }
    return 0;
}
#endif

template <int DH>
int decode(const QField* kf, const QField* vf, const uint16_t* res, const int64_t* block_res, const uint16_t* q,
           uint16_t* out, const int64_t* qrow, int64_t q_stride, int64_t out_stride, const int64_t* tables,
           int64_t bt_stride, const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale) {
#ifdef KVS_HAVE_QDECODE_AMX
    if constexpr (DH == fp8amx::DH)
        if (tiles_enabled() && fp8amx::readable(*kf, *vf, hq, hkv, bs))
            return decode_tiles<DH>(kf, vf, res, block_res, q, out, qrow, q_stride, out_stride, tables, bt_stride,
                                    seq_lens, n, hq, hkv, bs, scale);
#endif
    if (!supported(*kf, true, bs) || !supported(*vf, false, bs) || kf->code_kind != vf->code_kind || hq % hkv)
        return 1;
    if (kf->code_kind == 2) {  // e4m3_top needs denormals read as they are, in every thread (MXCSR is per thread)
        int daz = 0;
        #pragma omp parallel reduction(| : daz)
        daz |= (_mm_getcsr() & 0x40) != 0;
        if (daz) return 2;
    }
    const int g = hq / hkv;
    const ValueChunks vch = value_chunks(*vf, DH);
    const SpanPlan plan = plan_spans(seq_lens, n, bs, hkv, hkv);
    const std::vector<int64_t>& first_part = plan.first_part;
    const int64_t parts = first_part[n];
    std::vector<Item> items;
    for (int i = 0; i < n; ++i) {
        const int64_t nb = (seq_lens[i] + bs - 1) / bs, k = plan.spans[i];
        for (int h = 0; h < hkv; ++h)
            for (int64_t j = 0; j < k; ++j)
                items.push_back({i, h, nb * j / k, nb * (j + 1) / k, k > 1 ? first_part[i] + h * k + j : -1});
    }
    std::vector<SpanState> states((size_t)parts * g);
    std::vector<float> accs((size_t)parts * g * DH);
    #pragma omp parallel
    {
        std::vector<SpanState> st(g);
        std::vector<float> acc((size_t)g * DH);
        #pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < items.size(); ++w) {
            const Item it = items[w];
            const uint16_t* qs = q + qrow[it.seq] * q_stride + (int64_t)it.head * g * DH;
            SpanState* sp = it.part < 0 ? st.data() : &states[(size_t)it.part * g];
            float* ap = it.part < 0 ? acc.data() : &accs[(size_t)it.part * g * DH];
            const int64_t* table = tables + it.seq * bt_stride;
            switch (kf->code_kind) {
#define KVS_KIND(CK) attend_rows<DH, CK>(g, *kf, *vf, vch, res, block_res, qs, scale, table, it.b0, it.b1, \
                                         seq_lens[it.seq], it.head, hkv, bs, sp, ap)
                case 0: KVS_KIND(0); break;
                case 1: KVS_KIND(1); break;
                case 2: KVS_KIND(2); break;
                default: KVS_KIND(3); break;
#undef KVS_KIND
            }
            if (it.part >= 0) continue;
            uint16_t* o = out + qrow[it.seq] * out_stride + (int64_t)it.head * g * DH;
            for (int r = 0; r < g; ++r) store_bf16(o + (int64_t)r * DH, ap + (int64_t)r * DH, 1.f / sp[r].l, DH);
        }
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < (int64_t)n * hkv; ++w)
            merge_spans<DH>((int)(w / hkv), (int)(w % hkv), g, hkv, first_part.data(), states.data(), accs.data(),
                            out + qrow[w / hkv] * out_stride, acc.data());
    }
    return 0;
}

}  // namespace
#endif

// 1 when decode_quantized_d64 reads this CPU's fp8 (e4m3) caches on AMX tiles (decode_fp8_amx.h):
// compiled in, the process may use the tiles, and KVSERVE_AMX_ATTENTION is not "0".
extern "C" int decode_quantized_tiles_enabled() {
#ifdef KVS_HAVE_QDECODE_AMX
    return tiles_enabled() ? 1 : 0;
#else
    return 0;
#endif
}

// Decode attention for n sequences, one query token each (row qrow[i] of q / out, bf16), over a
// quantized cache described by kf / vf (and its bf16 residual pool res / block_res, or nulls).
// Returns 0 when done, 1 when this layout is not one the kernel reads, 2 when it cannot run now
// (e4m3 codes while a thread flushes denormals), -1 when the build has no kernel (no AVX512-BF16);
// nothing is written unless it returns 0, so the caller stages instead.
#define KVS_QDECODE(DH)                                                                                              \
    extern "C" int decode_quantized_d##DH(const QField* kf, const QField* vf, const uint16_t* res,                  \
                                          const int64_t* block_res, const uint16_t* q, uint16_t* out,               \
                                          const int64_t* qrow, int64_t q_stride, int64_t out_stride,                \
                                          const int64_t* tables, int64_t bt_stride, const int64_t* seq_lens, int n, \
                                          int hq, int hkv, int bs, float scale) {                                   \
        KVS_QDECODE_BODY(DH)                                                                                         \
    }
#ifdef KVS_HAVE_QDECODE
#define KVS_QDECODE_BODY(DH) \
    return decode<DH>(kf, vf, res, block_res, q, out, qrow, q_stride, out_stride, tables, bt_stride, seq_lens, n, hq, hkv, bs, scale);
#else
#define KVS_QDECODE_BODY(DH) return -1;
#endif
KVS_QDECODE(64)
KVS_QDECODE(128)
