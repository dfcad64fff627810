// Dequantizes blocks of a quantized KV cache (fp8, int8, int4: model/kv_cache_fp8.py,
// kv_cache_int.py) into the bf16 "pairs" layout the varlen kernel reads (attention/staging.py).
//
// Every format is one formula, x = ((code - offset) * scale + zero) * 2^exponent, where each of
// scale, zero and exponent is looked up per group of tokens and channels (a MetaRef below, built
// from the cache's own description of its fields: QuantizedKVCache.dequant_fields). The
// arithmetic is float32 in torch's order with no fused multiply-add, so the result is bit-equal
// to the cache's `gather` (tests/test_kv_staging.py). Blocks still open in the cache's residual
// pool are copied from their bf16 rows instead.
//
// Output per block and head: K as [dh/2][bs] 32-bit (d, d+1) pairs, V as [bs/2][dh] 32-bit
// (t, t+1) pairs, exactly what store_kv_pairs writes for the bf16 cache.
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVS_HAVE_STAGE 1
#endif

extern "C" {

// A per-group number: element (b, t, h, d) reads ptr[b*sb + (t/gt)*st + h*sh + (d/gd)*sd].
struct MetaRef {
    const void* ptr;  // null: absent
    int64_t sb, st, sh, sd;
    int32_t gt, gd;
    int32_t kind;     // 0 float32, 1 float16, 2 fp8 e4m3, 3 int8 power-of-two exponent
};

struct QField {
    const uint8_t* codes;  // [blocks][bs][hkv][P]: P = dh bytes, or dh / 2 for int4
    int64_t code_block;    // bytes per block
    int32_t code_kind;     // 0 uint8 integer, 1 int4 (two per byte, low nibble first), 2 e4m3, 3 e5m2
    float code_offset;
    MetaRef scale, zero, expo;
};

}  // extern "C"

#ifdef KVS_HAVE_STAGE
namespace {

// e4m3 (bias 7) -> the float16 with the same bits moved into place (bias 15), times 2^8: exact for
// normals and subnormals alike. e5m2 is float16's top byte.
inline float e4m3_to_f32(uint8_t b) {
    return _cvtsh_ss((uint16_t)(((b & 0x7f) << 7) | ((b & 0x80) << 8))) * 256.f;
}

inline __m512 e4m3x16(__m128i bytes) {
    const __m256i c = _mm256_cvtepu8_epi16(bytes);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// An optimisation barrier: GCC contracts a vector multiply and a following add into one FMA
// (-ffp-contract=fast), which rounds once where torch rounds twice.
inline __m512 rounded(__m512 x) {
    __asm__("" : "+v"(x));
    return x;
}

inline float meta_at(const MetaRef& m, int64_t i) {
    switch (m.kind) {
        case 0: return ((const float*)m.ptr)[i];
        case 1: return _cvtsh_ss(((const uint16_t*)m.ptr)[i]);
        case 2: return e4m3_to_f32(((const uint8_t*)m.ptr)[i]);
        default: return ldexpf(1.f, ((const int8_t*)m.ptr)[i]);
    }
}

// m's values for every channel of (b, token group tg, h) into row[dh] (64-byte aligned). Called
// once per token group, so the per-lane work here is off the per-element path. No integer
// division on the common paths: at one per token per field they cost more than the arithmetic.
inline void expand_meta(const MetaRef& m, int64_t b, int tg, int h, int dh, float* row) {
    const int64_t base = b * m.sb + (int64_t)tg * m.st + (int64_t)h * m.sh;
    if (m.gd % 16 == 0) {  // each group spans whole 16-channel chunks
        for (int g = 0, d0 = 0; d0 < dh; ++g) {
            const __m512 x = _mm512_set1_ps(meta_at(m, base + (int64_t)g * m.sd));
            for (int end = d0 + m.gd < dh ? d0 + m.gd : dh; d0 < end; d0 += 16) _mm512_store_ps(row + d0, x);
        }
        return;
    }
    for (int d0 = 0; d0 < dh; d0 += 16) {
        __m512 x;
        if (m.gd == 1 && m.sd == 1 && m.kind == 0) {
            x = _mm512_loadu_ps((const float*)m.ptr + base + d0);
        } else if (m.gd == 1 && m.sd == 1 && m.kind == 1) {
            x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)m.ptr + base + d0)));
        } else if (m.gd == 1 && m.sd == 1 && m.kind == 2) {
            x = e4m3x16(_mm_loadu_si128((const __m128i*)((const uint8_t*)m.ptr + base + d0)));
        } else {  // small groups (2, 4, 8 channels): rare settings
            alignas(64) float lanes[16];
            for (int i = 0; i < 16; ++i) lanes[i] = meta_at(m, base + (int64_t)((d0 + i) / m.gd) * m.sd);
            x = _mm512_load_ps(lanes);
        }
        _mm512_store_ps(row + d0, x);
    }
}

// Token-group bookkeeping without a division per token: expands m when token t enters a new group.
struct GroupCursor {
    int next = 0, index = -1;
    inline bool enter(int t, int gt) {
        if (t < next) return false;
        next += gt;
        ++index;
        return true;
    }
};

// 16 codes of a row as float32 (before the offset).
template <int KIND>
inline __m512 codes16(const uint8_t* row, int d0) {
    if constexpr (KIND == 0) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + d0))));
    } else if constexpr (KIND == 1) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i*)(row + d0 / 2));
        const __m128i dup = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(dup), shift),
                                                   _mm512_set1_epi32(15)));
    } else if constexpr (KIND == 2) {
        return e4m3x16(_mm_loadu_si128((const __m128i*)(row + d0)));
    } else {
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(row + d0))), 8));
    }
}

// Field f of head h, block b -> bf16 token rows out[bs][dh].
// pf: codes to prefetch meanwhile (a later block's share for this head), spread over the token
// loop: issued all at once, a block's ~50 lines overflow the miss queue and most are dropped.
template <int KIND>
void dequant_block(const QField& f, int64_t b, int h, int hkv, int dh, int bs, uint16_t* out, float* meta,
                   const uint8_t* pf) {
    float* sc = meta;
    float* zr = meta + dh;
    float* ex = meta + 2 * dh;
    const int P = KIND == 1 ? dh / 2 : dh;
    const __m512 off = _mm512_set1_ps(f.code_offset);
    // Locals, not f's fields: the row stores may alias anything, so fields would be reloaded.
    const bool has_off = f.code_offset != 0.f, has_zero = f.zero.ptr, has_exp = f.expo.ptr;
    const uint8_t* codes = f.codes + b * f.code_block + (int64_t)h * P;
    const int64_t row_stride = (int64_t)hkv * P;
    GroupCursor sg, zg, eg;  // the token group whose values the rows hold
    for (int t = 0; t < bs; ++t) {
        if (sg.enter(t, f.scale.gt)) expand_meta(f.scale, b, sg.index, h, dh, sc);
        if (has_zero && zg.enter(t, f.zero.gt)) expand_meta(f.zero, b, zg.index, h, dh, zr);
        if (has_exp && eg.enter(t, f.expo.gt)) expand_meta(f.expo, b, eg.index, h, dh, ex);
        const uint8_t* row = codes + t * row_stride;
        if (pf) __builtin_prefetch(pf + t * row_stride);
        for (int d0 = 0; d0 < dh; d0 += 16) {
            __m512 x = codes16<KIND>(row, d0);
            if (has_off) x = _mm512_sub_ps(x, off);
            // Separate multiply and add (no FMA): torch rounds after each, and so must this.
            x = rounded(_mm512_mul_ps(x, _mm512_load_ps(sc + d0)));
            if (has_zero) x = _mm512_add_ps(x, _mm512_load_ps(zr + d0));
            if (has_exp) x = _mm512_mul_ps(x, _mm512_load_ps(ex + d0));
            _mm256_storeu_si256((__m256i*)(out + (int64_t)t * dh + d0), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

// 16x16 32-bit transpose: rows src + i * stride -> rows dst + i * dstride. In registers: 64
// shuffles, against 16 gathers of 16 lanes (measured slower) or 256 scalar moves.
inline void transpose16(const uint32_t* src, int64_t stride, uint32_t* dst, int64_t dstride) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * dstride, r[i]);
}

inline void prefetch_meta(const MetaRef& m, int64_t b) {
    static const int size[4] = {4, 2, 1, 1};
    if (!m.ptr || m.sb == 0) return;
    const char* p = (const char*)m.ptr + b * m.sb * size[m.kind];
    for (int64_t i = 0; i < m.sb * size[m.kind]; i += 64) __builtin_prefetch(p + i);
}

inline void prefetch_metas(const QField& f, int64_t b) {
    prefetch_meta(f.scale, b);
    prefetch_meta(f.zero, b);
    prefetch_meta(f.expo, b);
}

inline void dequant(const QField& f, int64_t b, int h, int hkv, int dh, int bs, uint16_t* out, float* meta,
                    int64_t next) {
    const uint8_t* pf = nullptr;
    if (next >= 0) {
        pf = f.codes + next * f.code_block + (int64_t)h * (f.code_kind == 1 ? dh / 2 : dh);
        if (h == 0) prefetch_metas(f, next);
    }
    switch (f.code_kind) {
        case 0: dequant_block<0>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        case 1: dequant_block<1>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        case 2: dequant_block<2>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        default: dequant_block<3>(f, b, h, hkv, dh, bs, out, meta, pf); break;
    }
}

}  // namespace
#endif

// Dequantizes blocks block_ids[0..n) into pairs-layout blocks 0..n-1 of out_k / out_v. res: the
// layer's residual pool [entries][2][bs][hkv][dh] bf16 and block_res its entry per block (-1:
// sealed), both null for caches without one.
extern "C" void stage_quantized_pairs(const QField* kf, const QField* vf, const uint16_t* res,
                                      const int64_t* block_res, const int64_t* block_ids, int64_t n,
                                      uint16_t* out_k, uint16_t* out_v, int hkv, int dh, int bs) {
#ifdef KVS_HAVE_STAGE
    const int np = dh / 2;
    #pragma omp parallel
    {
        // Token rows [bs][dh] of K and V, then the pair shuffles into the output.
        uint16_t* kt = (uint16_t*)aligned_alloc(64, (size_t)bs * dh * 2);
        uint16_t* vt = (uint16_t*)aligned_alloc(64, (size_t)bs * dh * 2);
        float* meta = (float*)aligned_alloc(64, sizeof(float) * 3 * dh);
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < n * hkv; ++w) {
            const int64_t u = w / hkv, b = block_ids[u];
            const int h = (int)(w % hkv);
            const int64_t e = block_res ? block_res[b] : -1;
            const int64_t next = u + 2 < n ? block_ids[u + 2] : -1;  // one block's work is ~1 us
            const uint16_t *ks = kt, *vs = vt;
            int64_t tok = dh;  // elements between token rows
            if (e >= 0) {  // open block: its bf16 rows in the residual pool
                tok = (int64_t)hkv * dh;
                ks = res + (int64_t)e * 2 * bs * tok + (int64_t)h * dh;
                vs = ks + (int64_t)bs * tok;
            } else {
                dequant(*kf, b, h, hkv, dh, bs, kt, meta, next);
                dequant(*vf, b, h, hkv, dh, bs, vt, meta, next);
            }
            uint32_t* ko = (uint32_t*)out_k + (u * hkv + h) * np * bs;
            uint32_t* vo = (uint32_t*)out_v + (u * hkv + h) * (bs / 2) * dh;
            for (int t = 0; t < bs; t += 2) {
                for (int d0 = 0; d0 < dh; d0 += 16) {
                    const __m512i v0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vs + t * tok + d0)));
                    const __m512i v1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vs + (t + 1) * tok + d0)));
                    _mm512_storeu_si512(vo + (int64_t)(t / 2) * dh + d0, _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16)));
                }
            }
            // K: token rows of (d, d+1) pairs -> per pair, 16 tokens in a row (16x16 transposes).
            for (int t0 = 0; t0 < bs; t0 += 16)
                for (int j0 = 0; j0 < np; j0 += 16)
                    transpose16((const uint32_t*)(ks + t0 * tok) + j0, tok / 2, ko + (int64_t)j0 * bs + t0, bs);
        }
        free(kt);
        free(vt);
        free(meta);
    }
#endif
}

extern "C" int stage_quantized_available() {
#ifdef KVS_HAVE_STAGE
    return 1;
#else
    return 0;
#endif
}
