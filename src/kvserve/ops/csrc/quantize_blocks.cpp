// Quantizes whole blocks of K/V into a quantized cache's stored format: KIVI int8 / int4
// (kv_cache_int.py) and fp8 e4m3 with per-block scales and centered keys (kv_cache_fp8.py). Two
// callers: a prompt write that fills whole blocks, and the seal of residual blocks that filled up
// (kv_cache_quant.py, QuantizedKVCache._seal), which reads them straight from the residual pool.
//
// The arithmetic is the torch path's (quant.quantize_groups, quant.quantize_fp8), op for op in
// float32 in the same order, so codes and metadata are bit-equal to it (tests/test_kv_quant.py):
// tiers and swap carry blocks between engines that may have either path. Each returns 1, writing
// nothing, on a value the torch path must judge itself (non-finite; beyond float16 metadata),
// so that it raises its error or stores what it stores.
//
// Sources: block i's K is the [bs, hkv, dh] elements at k + (src ? src[i] : i) * stride, its V the
// same offset from v; float32 (is_bf16 = 0) or bf16. It goes to flat block dst[i] of the fields
// ([layer * num_blocks + block] rows, dst_rows of them; one outside declines the call).
#pragma GCC optimize("fp-contract=off")  // a fused multiply-add rounds once where torch rounds twice
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <float.h>
#include <vector>
#include <omp.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

struct Source {
    const void* k;
    const void* v;
    int is_bf16;
    const int64_t* src;
    int64_t stride;
    int64_t at(int64_t i) const { return (src ? src[i] : i) * stride; }
};

inline float load_x(const void* x, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float*)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t*)x)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Destination rows outside the fields: the torch path's indexing raises the IndexError.
bool rows_in_range(const int64_t* dst, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; ++i)
        if (dst[i] < 0 || dst[i] >= rows) return false;
    return true;
}

// False when a value is one the torch path must handle: non-finite, or |x| > limit.
bool all_within(const Source& s, int64_t n, int64_t blk, float limit) {
    int bad = 0;
    #pragma omp parallel for reduction(|:bad) schedule(static) if (n * blk >= (1 << 16))
    for (int64_t i = 0; i < 2 * n; ++i) {
        const void* x = i < n ? s.k : s.v;
        const int64_t base = s.at(i % n);
        for (int64_t j = 0; j < blk; ++j) bad |= !(fabsf(load_x(x, base + j, s.is_bf16)) <= limit);  // NaN too
    }
    return !bad;
}

// ------------------------------------------------------------------------------------------ e4m3

// float32 -> e4m3fn, round to nearest even: c10's fp8e4m3fn_from_fp32_value, which torch's cast
// uses. The callers clamp to +-448 first, as the torch path does (NaN stays NaN: 0x7f).
inline uint8_t e4m3_of(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t r;
    if (bits >= (1087u << 20)) {
        r = 0x7f;  // NaN: beyond 464, the midpoint above 448
    } else if (bits < (121u << 23)) {  // below 2^-6: a subnormal, rounded by adding 2^14 (ulp 2^-9)
        const uint32_t magic_bits = 141u << 23;
        float magic, g;
        memcpy(&magic, &magic_bits, 4);
        memcpy(&g, &bits, 4);
        g += magic;
        uint32_t gb;
        memcpy(&gb, &g, 4);
        r = (uint8_t)(gb - magic_bits);
    } else {
        const uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffff + odd;
        r = (uint8_t)(bits >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

inline float e4m3_value(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float mag = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return b & 0x80 ? -mag : mag;
}

// quant.fp8_round_outward: the e4m3 nearest t on the side that keeps a group's range inside
// (up: >= t, for scales; down: <= t, for zero points), stepping the bit pattern one code.
inline uint8_t e4m3_outward(float t, bool up) {
    const uint8_t r = e4m3_of(t < -448.f ? -448.f : (t > 448.f ? 448.f : t));
    const float rf = e4m3_value(r);
    if (!(up ? rf < t : rf > t)) return r;
    if ((r & 0x7f) == 0) return up ? 0x01 : 0x81;  // a zero that must move
    const bool away = ((r & 0x80) != 0) != up;  // away from zero: magnitude + 1 ulp
    return away ? r + 1 : r - 1;
}

struct E4m3Meta {
    using T = uint8_t;
    static T outward(float t, bool up) { return e4m3_outward(t, up); }
    static float value(T c) { return e4m3_value(c); }
};

#if defined(__F16C__)
inline uint16_t f16_of(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float f32_of(uint16_t h) { return _cvtsh_ss(h); }

// quant._round_meta for float16. A zero needs no case of its own: only a t of its sign rounds to
// it, so the step is away from zero.
inline uint16_t f16_outward(float t, bool up) {
    const uint16_t r = f16_of(t);
    const float rf = f32_of(r);
    if (!(up ? rf < t : rf > t)) return r;
    return ((r & 0x8000) != 0) == up ? r - 1 : r + 1;  // magnitude down toward zero, else up
}

struct F16Meta {
    using T = uint16_t;
    static T outward(float t, bool up) { return f16_outward(t, up); }
    static float value(T c) { return f32_of(c); }
};
#endif

// ------------------------------------------------------------------------------------ int groups

struct IntLayout {
    int bs, hkv, dh, gt, gd, bits, compact, v_symmetric;
    void *k_codes, *k_scale, *k_zero, *k_exp, *v_codes, *v_scale, *v_zero, *v_exp;
};

inline float block_abs_max(const void* x, int64_t base, int64_t blk, int is_bf16) {
    float row_max = 0.f;
    for (int64_t j = 0; j < blk; ++j) row_max = fmaxf(row_max, fabsf(load_x(x, base + j, is_bf16)));
    return row_max;
}

// quant.quantize_groups' compact exponent from a block's max |x|: e = ceil(log2(max / 448)) in
// [-100, 126], 0 for zeros, taken exactly from frexp (a float log2 can land on the wrong side of a
// power of two). Stored at exp[d]; returns the factor 2^-e the block is scaled by.
inline float compact_factor(float row_max, void* exp, int64_t d) {
    int e = 0;
    if (row_max > 0.f) {
        const float m = frexpf(row_max / 448.f, &e);
        if (m == 0.5f) --e;  // an exact power of two
        e = e < -100 ? -100 : (e > 126 ? 126 : e);
    }
    ((int8_t*)exp)[d] = (int8_t)e;
    return ldexpf(1.f, -e);
}

// One group of g values x[base + j * stride] * factor: codes to q[qb + j * qstride], its metadata
// to scale[m] (and zero[m] when asymmetric).
template <class M>
inline void int_group(const void* x, int64_t base, int64_t stride, int g, int is_bf16, float factor, int bits,
                      bool symmetric, uint8_t* q, int64_t qb, int64_t qstride, typename M::T* scale,
                      typename M::T* zero, int64_t m) {
    float mn = INFINITY, mx = -INFINITY;
    for (int j = 0; j < g; ++j) {
        const float e = load_x(x, base + j * stride, is_bf16) * factor;
        mn = e < mn ? e : mn;
        mx = e > mx ? e : mx;
    }
    mn += 0.f;  // -0 -> +0, as quant._group_range: which zero wins must not depend on order
    mx += 0.f;
    const float qmax = (float)((1 << bits) - 1);
    if (symmetric) {
        const float half = (float)(1 << (bits - 1));
        const typename M::T s = M::outward((mx > -mn ? mx : -mn) / (half - 1.f), true);
        const float sf = M::value(s), inv = sf > 0.f ? 1.0f / sf : 0.f;
        for (int j = 0; j < g; ++j) {
            float c = nearbyintf(load_x(x, base + j * stride, is_bf16) * factor * inv) + half;
            q[qb + j * qstride] = (uint8_t)(c < 1.f ? 1.f : (c > qmax ? qmax : c));
        }
        scale[m] = s;
        return;
    }
    const typename M::T z = M::outward(mn, false);
    const float zf = M::value(z);
    const typename M::T s = M::outward((mx - zf) / qmax, true);
    const float sf = M::value(s), inv = sf > 0.f ? 1.0f / sf : 0.f;
    for (int j = 0; j < g; ++j) {
        float c = nearbyintf((load_x(x, base + j * stride, is_bf16) * factor - zf) * inv);
        q[qb + j * qstride] = (uint8_t)(c < 0.f ? 0.f : (c > qmax ? qmax : c));
    }
    scale[m] = s;
    zero[m] = z;
}

// codes [bs * hkv * dh] -> out: as they are (int8), or two per byte, even channel in the low nibble.
inline void put_codes(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
    if (bits == 8) {
        memcpy(out, codes, (size_t)n);
        return;
    }
    for (int64_t j = 0; j < n / 2; ++j) out[j] = codes[2 * j] | (uint8_t)(codes[2 * j + 1] << 4);
}

// Keys per channel over groups of gt tokens; values per token over groups of gd channels.
template <class M>
void int_block(const Source& s, int64_t i, int64_t d, const IntLayout& L, uint8_t* codes) {
    using T = typename M::T;
    const int64_t tok = (int64_t)L.hkv * L.dh, blk = (int64_t)L.bs * tok, base = s.at(i);
    const int64_t packed = blk * L.bits / 8;
    float factor = L.compact ? compact_factor(block_abs_max(s.k, base, blk, s.is_bf16), L.k_exp, d) : 1.f;
    const int64_t k_meta = (int64_t)(L.bs / L.gt) * tok;
    for (int tg = 0; tg < L.bs / L.gt; ++tg)
        for (int64_t hd = 0; hd < tok; ++hd)
            int_group<M>(s.k, base + (int64_t)tg * L.gt * tok + hd, tok, L.gt, s.is_bf16, factor, L.bits, false,
                         codes, (int64_t)tg * L.gt * tok + hd, tok, (T*)L.k_scale, (T*)L.k_zero,
                         d * k_meta + tg * tok + hd);
    put_codes(codes, blk, L.bits, (uint8_t*)L.k_codes + d * packed);

    factor = L.compact ? compact_factor(block_abs_max(s.v, base, blk, s.is_bf16), L.v_exp, d) : 1.f;
    const int per_head = L.dh / L.gd;
    const int64_t v_meta = (int64_t)L.bs * L.hkv * per_head;
    for (int t = 0; t < L.bs; ++t)
        for (int h = 0; h < L.hkv; ++h)
            for (int c = 0; c < per_head; ++c) {
                const int64_t off = (int64_t)t * tok + (int64_t)h * L.dh + (int64_t)c * L.gd;
                int_group<M>(s.v, base + off, 1, L.gd, s.is_bf16, factor, L.bits, L.v_symmetric, codes, off, 1,
                             (T*)L.v_scale, (T*)L.v_zero, d * v_meta + ((int64_t)t * L.hkv + h) * per_head + c);
            }
    put_codes(codes, blk, L.bits, (uint8_t*)L.v_codes + d * packed);
}

#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KVS_QUANT_VECTOR 1
// The same arithmetic 16 lanes at a time: vdivps, vsubps, vmulps, vaddps and vroundscaleps round
// as the scalar ops do, and each lane's integer steps are the scalar ones.
inline __m512 load16(const void* x, int64_t i, int is_bf16) {
    if (!is_bf16) return _mm512_loadu_ps((const float*)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 clamp448(__m512 x) {
    return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-448.f)), _mm512_set1_ps(448.f));
}

// e4m3_of on 16 lanes (|x| <= 448), one code per 32-bit lane.
inline __m512i e4m3_of16(__m512 x) {
    const __m512i all = _mm512_castps_si512(x);
    const __m512i sign = _mm512_and_si512(all, _mm512_set1_epi32((int)0x80000000u));
    const __m512i bits = _mm512_xor_si512(all, sign);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32((int)((uint32_t)(7 - 127) << 23) + 0x7ffff)), odd), 20);
    const __m512i magic = _mm512_set1_epi32((int)(141u << 23));
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(magic))), magic);
    const __mmask16 is_sub = _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32((int)(121u << 23)));
    const __mmask16 is_nan = _mm512_cmpge_epu32_mask(bits, _mm512_set1_epi32((int)(1087u << 20)));
    __m512i r = _mm512_mask_mov_epi32(normal, is_sub, sub);
    r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7f));
    return _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xff)), _mm512_srli_epi32(sign, 24));
}

// e4m3_value on 16 lanes: normals by moving the bits into place (exponent bias 7 -> 127),
// subnormals as m * 2^-9.
inline __m512 e4m3_value16(__m512i b) {
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20),
                                                               _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
    const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
    return _mm512_or_ps(_mm512_mask_mov_ps(normal, is_sub, sub), _mm512_castsi512_ps(sign));
}

// One step of the bit pattern where rounding went the wrong way (e4m3_outward / f16_outward):
// away from zero (magnitude + 1) when the sign and the direction disagree, else toward it.
inline __m512i step_outward(__m512i r, __mmask16 wrong, __mmask16 neg, bool up) {
    const __mmask16 toward_zero = up ? neg : (__mmask16)~neg;
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i stepped = _mm512_mask_sub_epi32(_mm512_add_epi32(r, one), toward_zero, r, one);
    return _mm512_mask_mov_epi32(r, wrong, stepped);
}

struct E4m3Vec : E4m3Meta {
    static __m512i outward16(__m512 t, bool up) {
        const __m512i r = e4m3_of16(clamp448(t));
        const __mmask16 wrong = _mm512_cmp_ps_mask(e4m3_value16(r), t, up ? _CMP_LT_OQ : _CMP_GT_OQ);
        const __mmask16 zero = _mm512_testn_epi32_mask(r, _mm512_set1_epi32(0x7f));
        const __mmask16 neg = _mm512_test_epi32_mask(r, _mm512_set1_epi32(0x80));
        const __m512i stepped = step_outward(r, wrong & (__mmask16)~zero, neg, up);
        return _mm512_mask_mov_epi32(stepped, wrong & zero, _mm512_set1_epi32(up ? 0x01 : 0x81));
    }
    static __m512 value16(__m512i c) { return e4m3_value16(c); }
    static void store16(T* p, __m512i c) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(c)); }
};

struct F16Vec : F16Meta {
    static __m512i outward16(__m512 t, bool up) {
        const __m512i r = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __mmask16 wrong = _mm512_cmp_ps_mask(value16(r), t, up ? _CMP_LT_OQ : _CMP_GT_OQ);
        return step_outward(r, wrong, _mm512_test_epi32_mask(r, _mm512_set1_epi32(0x8000)), up);
    }
    static __m512 value16(__m512i c) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(c)); }
    static void store16(T* p, __m512i c) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(c)); }
};

inline __m512 round_clamp(__m512 q, float lo, float hi) {
    q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}

inline void store_codes16(uint8_t* p, __m512 q) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q))); }

// Two int4 codes per byte, even channel in the low nibble: n bytes of codes (n % 64 == 0) -> n / 2.
inline void pack_int4(const uint8_t* codes, int64_t n, uint8_t* out) {
    for (int64_t j = 0; j < n; j += 64) {
        const __m512i pairs = _mm512_maddubs_epi16(_mm512_loadu_si512(codes + j), _mm512_set1_epi16(0x1001));
        _mm256_storeu_si256((__m256i*)(out + j / 2), _mm512_cvtepi16_epi8(pairs));
    }
}

inline float block_abs_max16(const void* x, int64_t base, int64_t blk, int is_bf16) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t j = 0; j < blk; j += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, base + j, is_bf16)));
    return _mm512_reduce_max_ps(mx);
}

// int_block, 16 lanes at a time: keys with the lanes on 16 channels, values with a group's
// min / max reduced. False when the shape has none (hkv * dh or gd not a multiple of 16, or int4
// codes of a block not a multiple of 64).
template <class M>
bool int_block_vector(const Source& s, int64_t i, int64_t d, const IntLayout& L, uint8_t* codes) {
    using T = typename M::T;
    const int64_t tok = (int64_t)L.hkv * L.dh, blk = (int64_t)L.bs * tok, base = s.at(i);
    if (tok % 16 || L.gd % 16 || (L.bits == 4 && blk % 64)) return false;
    const float qmax = (float)((1 << L.bits) - 1), half = (float)(1 << (L.bits - 1));
    const int64_t packed = blk * L.bits / 8;
    float factor = L.compact ? compact_factor(block_abs_max16(s.k, base, blk, s.is_bf16), L.k_exp, d) : 1.f;
    __m512 f = _mm512_set1_ps(factor);
    uint8_t* kc = L.bits == 8 ? (uint8_t*)L.k_codes + d * packed : codes;
    const int64_t k_meta = (int64_t)(L.bs / L.gt) * tok;
    for (int tg = 0; tg < L.bs / L.gt; ++tg) {  // keys: channels (h, d) .. +16 over tokens tg*gt ..
        const int64_t t0 = (int64_t)tg * L.gt * tok, m0 = d * k_meta + tg * tok;
        for (int64_t hd = 0; hd < tok; hd += 16) {
            __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < L.gt; ++j) {
                const __m512 e = _mm512_mul_ps(load16(s.k, base + t0 + j * tok + hd, s.is_bf16), f);
                mn = _mm512_min_ps(mn, e);
                mx = _mm512_max_ps(mx, e);
            }
            mn = _mm512_add_ps(mn, _mm512_setzero_ps());  // -0 -> +0 (quant._group_range)
            mx = _mm512_add_ps(mx, _mm512_setzero_ps());
            const __m512i z = M::outward16(mn, false);
            const __m512 zf = M::value16(z);
            const __m512i sc = M::outward16(_mm512_div_ps(_mm512_sub_ps(mx, zf), _mm512_set1_ps(qmax)), true);
            const __m512 sf = M::value16(sc);
            const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sf, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                   _mm512_set1_ps(1.f), sf);
            for (int j = 0; j < L.gt; ++j) {
                const __m512 x = _mm512_mul_ps(load16(s.k, base + t0 + j * tok + hd, s.is_bf16), f);
                store_codes16(kc + t0 + j * tok + hd, round_clamp(_mm512_mul_ps(_mm512_sub_ps(x, zf), inv), 0.f, qmax));
            }
            M::store16((T*)L.k_scale + m0 + hd, sc);
            M::store16((T*)L.k_zero + m0 + hd, z);
        }
    }
    if (L.bits == 4) pack_int4(codes, blk, (uint8_t*)L.k_codes + d * packed);

    factor = L.compact ? compact_factor(block_abs_max16(s.v, base, blk, s.is_bf16), L.v_exp, d) : 1.f;
    f = _mm512_set1_ps(factor);
    uint8_t* vc = L.bits == 8 ? (uint8_t*)L.v_codes + d * packed : codes;
    const int per_head = L.dh / L.gd;
    const int64_t v_meta = (int64_t)L.bs * L.hkv * per_head;
    for (int t = 0; t < L.bs; ++t)  // values: token t, head h, channels c*gd ..
        for (int h = 0; h < L.hkv; ++h)
            for (int c = 0; c < per_head; ++c) {
                const int64_t off = (int64_t)t * tok + (int64_t)h * L.dh + (int64_t)c * L.gd;
                const int64_t m = d * v_meta + ((int64_t)t * L.hkv + h) * per_head + c;
                __m512 mn = _mm512_set1_ps(INFINITY), mx = _mm512_set1_ps(-INFINITY);
                for (int j = 0; j < L.gd; j += 16) {
                    const __m512 e = _mm512_mul_ps(load16(s.v, base + off + j, s.is_bf16), f);
                    mn = _mm512_min_ps(mn, e);
                    mx = _mm512_max_ps(mx, e);
                }
                const float lo = _mm512_reduce_min_ps(mn) + 0.f, hi = _mm512_reduce_max_ps(mx) + 0.f;
                if (L.v_symmetric) {
                    const T sc = M::outward((hi > -lo ? hi : -lo) / (half - 1.f), true);
                    const float sf = M::value(sc);
                    const __m512 inv = _mm512_set1_ps(sf > 0.f ? 1.0f / sf : 0.f);
                    for (int j = 0; j < L.gd; j += 16) {
                        const __m512 x = _mm512_mul_ps(load16(s.v, base + off + j, s.is_bf16), f);
                        __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                        q = _mm512_add_ps(q, _mm512_set1_ps(half));
                        store_codes16(vc + off + j, _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(1.f)), _mm512_set1_ps(qmax)));
                    }
                    ((T*)L.v_scale)[m] = sc;
                    continue;
                }
                const T z = M::outward(lo, false);
                const float zf = M::value(z);
                const T sc = M::outward((hi - zf) / qmax, true);
                const float sf = M::value(sc);
                const __m512 inv = _mm512_set1_ps(sf > 0.f ? 1.0f / sf : 0.f), zv = _mm512_set1_ps(zf);
                for (int j = 0; j < L.gd; j += 16) {
                    const __m512 x = _mm512_mul_ps(load16(s.v, base + off + j, s.is_bf16), f);
                    store_codes16(vc + off + j, round_clamp(_mm512_mul_ps(_mm512_sub_ps(x, zv), inv), 0.f, qmax));
                }
                ((T*)L.v_scale)[m] = sc;
                ((T*)L.v_zero)[m] = z;
            }
    if (L.bits == 4) pack_int4(codes, blk, (uint8_t*)L.v_codes + d * packed);
    return true;
}
#endif

// --------------------------------------------------------------------------------------------- fp8

struct Fp8Layout {
    int bs, hkv, dh, per_head, center;
    uint8_t* k_codes;
    float* k_scale;
    uint8_t* k_mean;
    uint8_t* v_codes;
    float* v_scale;
};

// One of K / V: x (minus the per-channel mean row `mean`, when given) over a scale per head or per
// block mapping its absolute maximum to 448, cast to e4m3 (quant.quantize_fp8).
void fp8_tensor(const void* x, int64_t base, int is_bf16, const Fp8Layout& L, const float* mean, int64_t d,
                uint8_t* codes, float* scales) {
    const int64_t tok = (int64_t)L.hkv * L.dh;
    const int nscale = L.per_head ? L.hkv : 1, span = L.per_head ? L.dh : (int)tok;
    for (int g = 0; g < nscale; ++g) {
        float amax = 0.f;
        for (int t = 0; t < L.bs; ++t)
            for (int c = g * span; c < (g + 1) * span; ++c) {
                const float e = load_x(x, base + t * tok + c, is_bf16) - (mean ? mean[c] : 0.f);
                amax = fmaxf(amax, fabsf(e));
            }
        float sc = amax / 448.f;
        sc = sc > 0.f ? sc : 1.f;  // zeros, or an amax so small the scale underflows
        scales[d * nscale + g] = sc;
        for (int t = 0; t < L.bs; ++t)
            for (int c = g * span; c < (g + 1) * span; ++c) {
                float q = (load_x(x, base + t * tok + c, is_bf16) - (mean ? mean[c] : 0.f)) / sc;
                q = q < -448.f ? -448.f : (q > 448.f ? 448.f : q);
                codes[d * L.bs * tok + t * tok + c] = e4m3_of(q);
            }
    }
}

#ifdef KVS_QUANT_VECTOR
// fp8_tensor, 16 channels at a time (dh a multiple of 16).
void fp8_tensor_vector(const void* x, int64_t base, int is_bf16, const Fp8Layout& L, const float* mean, int64_t d,
                       uint8_t* codes, float* scales) {
    const int64_t tok = (int64_t)L.hkv * L.dh;
    const int nscale = L.per_head ? L.hkv : 1, span = L.per_head ? L.dh : (int)tok;
    for (int g = 0; g < nscale; ++g) {
        __m512 amax = _mm512_setzero_ps();
        for (int t = 0; t < L.bs; ++t)
            for (int c = g * span; c < (g + 1) * span; c += 16) {
                __m512 e = load16(x, base + t * tok + c, is_bf16);
                if (mean) e = _mm512_sub_ps(e, _mm512_loadu_ps(mean + c));
                amax = _mm512_max_ps(amax, _mm512_abs_ps(e));
            }
        float sc = _mm512_reduce_max_ps(amax) / 448.f;
        sc = sc > 0.f ? sc : 1.f;
        scales[d * nscale + g] = sc;
        const __m512 scv = _mm512_set1_ps(sc);
        for (int t = 0; t < L.bs; ++t)
            for (int c = g * span; c < (g + 1) * span; c += 16) {
                __m512 e = load16(x, base + t * tok + c, is_bf16);
                if (mean) e = _mm512_sub_ps(e, _mm512_loadu_ps(mean + c));
                _mm_storeu_si128((__m128i*)(codes + d * L.bs * tok + t * tok + c),
                                 _mm512_cvtepi32_epi8(e4m3_of16(clamp448(_mm512_div_ps(e, scv)))));
            }
    }
}

// The key mean per channel in float64, tokens summed in order as the scalar loop does.
void fp8_key_mean_vector(const Source& s, int64_t base, const Fp8Layout& L, int64_t d, float* mean) {
    const int64_t tok = (int64_t)L.hkv * L.dh;
    for (int64_t c = 0; c < tok; c += 16) {
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (int t = 0; t < L.bs; ++t) {
            const __m512 e = load16(s.k, base + t * tok + c, s.is_bf16);
            lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        }
        const __m512d n = _mm512_set1_pd((double)L.bs);
        const __m512 m = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_div_pd(lo, n))),
                                            _mm512_cvtpd_ps(_mm512_div_pd(hi, n)), 1);
        const __m512i b = e4m3_of16(clamp448(m));
        _mm_storeu_si128((__m128i*)(L.k_mean + d * tok + c), _mm512_cvtepi32_epi8(b));
        _mm512_storeu_ps(mean + c, e4m3_value16(b));
    }
}
#endif

void fp8_block(const Source& s, int64_t i, int64_t d, const Fp8Layout& L, float* mean) {
    const int64_t tok = (int64_t)L.hkv * L.dh, base = s.at(i);
#ifdef KVS_QUANT_VECTOR
    if (L.dh % 16 == 0) {
        if (L.center) fp8_key_mean_vector(s, base, L, d, mean);
        fp8_tensor_vector(s.k, base, s.is_bf16, L, L.center ? mean : nullptr, d, L.k_codes, L.k_scale);
        fp8_tensor_vector(s.v, base, s.is_bf16, L, nullptr, d, L.v_codes, L.v_scale);
        return;
    }
#endif
    if (L.center) {  // the key mean per channel, in float64 as quant.quantize_fp8 takes it
        for (int64_t c = 0; c < tok; ++c) {
            double sum = 0.0;
            for (int t = 0; t < L.bs; ++t) sum += (double)load_x(s.k, base + t * tok + c, s.is_bf16);
            float m = (float)(sum / L.bs);
            m = m < -448.f ? -448.f : (m > 448.f ? 448.f : m);
            const uint8_t b = e4m3_of(m);
            L.k_mean[d * tok + c] = b;
            mean[c] = e4m3_value(b);
        }
    }
    fp8_tensor(s.k, base, s.is_bf16, L, L.center ? mean : nullptr, d, L.k_codes, L.k_scale);
    fp8_tensor(s.v, base, s.is_bf16, L, nullptr, d, L.v_codes, L.v_scale);
}

}  // namespace

// KIVI int8 / int4 (bits), metadata float16 or, compact, e4m3 with a power-of-two exponent per
// block of K and of V; values symmetric (no zero point) when v_symmetric. Keys are grouped per
// channel over gt tokens, values per token over gd channels.
extern "C" int quantize_int_blocks(const void* k, const void* v, int is_bf16, int64_t n, const int64_t* src,
                                   int64_t src_stride, const int64_t* dst, int64_t dst_rows, int bs, int hkv, int dh, int gt, int gd,
                                   int bits, int compact, int v_symmetric, void* k_codes, void* k_scale,
                                   void* k_zero, void* k_exp, void* v_codes, void* v_scale, void* v_zero,
                                   void* v_exp) {
    const Source s{k, v, is_bf16, src, src_stride};
    const IntLayout L{bs, hkv, dh, gt, gd, bits, compact, v_symmetric,
                      k_codes, k_scale, k_zero, k_exp, v_codes, v_scale, v_zero, v_exp};
    const int64_t blk = (int64_t)bs * hkv * dh;
#if !defined(__F16C__)
    if (!compact) return 1;  // float16 metadata without F16C: the torch path quantizes
#endif
    if ((bits == 4 && dh % 2) || !rows_in_range(dst, n, dst_rows)) return 1;
    // Compact metadata is exponent-shifted, so any range fits whose max - min is finite.
    if (!all_within(s, n, blk, compact ? 1e38f : 6.0e4f)) return 1;
    #pragma omp parallel if (n * blk >= (1 << 16))
    {
        std::vector<uint8_t> codes((size_t)blk);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) {
#ifdef KVS_QUANT_VECTOR
            if (compact ? int_block_vector<E4m3Vec>(s, i, dst[i], L, codes.data())
                        : int_block_vector<F16Vec>(s, i, dst[i], L, codes.data())) continue;
#endif
#if defined(__F16C__)
            if (!compact) {
                int_block<F16Meta>(s, i, dst[i], L, codes.data());
                continue;
            }
#endif
            int_block<E4m3Meta>(s, i, dst[i], L, codes.data());
        }
    }
    return 0;
}

// fp8 e4m3 with dynamic float32 scales per block and KV head (per_head) or per block, keys
// centered on their e4m3 per-channel mean over the block's tokens (center).
extern "C" int quantize_fp8_blocks(const void* k, const void* v, int is_bf16, int64_t n, const int64_t* src,
                                   int64_t src_stride, const int64_t* dst, int64_t dst_rows, int bs, int hkv, int dh, int per_head,
                                   int center, uint8_t* k_codes, float* k_scale, uint8_t* k_mean, uint8_t* v_codes,
                                   float* v_scale) {
    const Source s{k, v, is_bf16, src, src_stride};
    const Fp8Layout L{bs, hkv, dh, per_head, center, k_codes, k_scale, k_mean, v_codes, v_scale};
    const int64_t tok = (int64_t)hkv * dh;
    if (!rows_in_range(dst, n, dst_rows) || !all_within(s, n, bs * tok, FLT_MAX)) return 1;
    #pragma omp parallel if (n * bs * tok >= (1 << 16))
    {
        std::vector<float> mean((size_t)tok);
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; ++i) fp8_block(s, i, dst[i], L, mean.data());
    }
    return 0;
}
