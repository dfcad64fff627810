// How a quantized KV cache's layer is stored, as the cache describes it
// (QuantizedKVCache.dequant_fields, mirrored by cpu_kernel.py's ctypes structures): read by the
// staging pass (stage_quantized.cpp) and the decode kernel over codes (decode_quantized.cpp).
#pragma once
#include <stdint.h>

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>
#define KVS_HAVE_QUANT_FIELDS 1

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

template <int MK>
inline float meta_load(const void* p, int64_t i) {
    if constexpr (MK == 0) return ((const float*)p)[i];
    else if constexpr (MK == 1) return _cvtsh_ss(((const uint16_t*)p)[i]);
    else if constexpr (MK == 2) return e4m3_to_f32(((const uint8_t*)p)[i]);
    else return ldexpf(1.f, ((const int8_t*)p)[i]);
}

// m's values for every channel of token group tg of block b, head h: row[d], 64-byte aligned.
template <int MK>
void expand_group(const MetaRef& m, int64_t b, int64_t tg, int h, int dh, float* row) {
    const int64_t base = b * m.sb + tg * m.st + (int64_t)h * m.sh;
    if (m.gd % 16 == 0) {  // each group spans whole 16-channel chunks
        for (int g = 0, d0 = 0; d0 < dh; ++g) {
            const __m512 x = _mm512_set1_ps(meta_load<MK>(m.ptr, base + (int64_t)g * m.sd));
            for (int end = d0 + m.gd < dh ? d0 + m.gd : dh; d0 < end; d0 += 16) _mm512_store_ps(row + d0, x);
        }
        return;
    }
    for (int d0 = 0; d0 < dh; d0 += 16) {
        __m512 x;
        if (MK == 0 && m.gd == 1 && m.sd == 1) {
            x = _mm512_loadu_ps((const float*)m.ptr + base + d0);
        } else if (MK == 1 && m.gd == 1 && m.sd == 1) {
            x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)m.ptr + base + d0)));
        } else if (MK == 2 && m.gd == 1 && m.sd == 1) {
            x = e4m3x16(_mm_loadu_si128((const __m128i*)((const uint8_t*)m.ptr + base + d0)));
        } else {  // small groups (2, 4, 8 channels): rare settings
            alignas(64) float lanes[16];
            for (int i = 0; i < 16; ++i) lanes[i] = meta_load<MK>(m.ptr, base + (int64_t)((d0 + i) / m.gd) * m.sd);
            x = _mm512_load_ps(lanes);
        }
        _mm512_store_ps(row + d0, x);
    }
}

inline void expand_group(const MetaRef& m, int64_t b, int64_t tg, int h, int dh, float* row) {
    switch (m.kind) {
        case 0: expand_group<0>(m, b, tg, h, dh, row); break;
        case 1: expand_group<1>(m, b, tg, h, dh, row); break;
        case 2: expand_group<2>(m, b, tg, h, dh, row); break;
        default: expand_group<3>(m, b, tg, h, dh, row); break;
    }
}

// m's values for every channel of every token group of block b, head h: rows[tg * dh + d]. Done
// for the whole block before its tokens are dequantized: per token (the per-token formats) the
// lookups, interleaved with the arithmetic, cost ~2.5x the arithmetic.
inline void expand_rows(const MetaRef& m, int64_t b, int h, int dh, int bs, float* rows) {
    for (int tg = 0; tg < (bs + m.gt - 1) / m.gt; ++tg) expand_group(m, b, tg, h, dh, rows + (int64_t)tg * dh);
}

// A 16x16 transpose of 32-bit elements in registers: 64 shuffles, against 16 gathers of 16 lanes
// (measured slower) or 256 scalar moves.
inline void transpose16_regs(__m512i* r) {
    __m512i t[16];
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

}  // namespace
#endif
