// Dequantizes blocks of a quantized KV cache (fp8, int8, int4: cache/fp8.py,
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

#include "quant_fields.h"

#ifdef KVS_HAVE_STAGE
namespace {

// An optimisation barrier: GCC contracts a vector multiply and a following add into one FMA
// (-ffp-contract=fast), which rounds once where torch rounds twice.
inline __m512 rounded(__m512 x) {
    __asm__("" : "+v"(x));
    return x;
}

// Which row of a field's expanded rows token t reads, advanced token by token (no division).
struct RowCursor {
    const float* row;
    int left, gt, dh;
    RowCursor(const float* rows, int gt_, int dh_) : row(rows), left(gt_), gt(gt_), dh(dh_) {}
    inline void next() {
        if (--left == 0) {
            left = gt;
            row += dh;
        }
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

// Field f of head h, block b -> bf16, as token rows out[bs][dh] (PAIRS false: keys, transposed
// afterwards) or straight into the value pairs layout, out[bs/2][dh] 32-bit (t, t+1) pairs.
// meta: room for the expanded rows of scale, zero and exponent, bs * dh floats each.
// pf: codes to prefetch meanwhile (a later block's share for this head), spread over the token
// loop: issued all at once, a block's ~50 lines overflow the miss queue and most are dropped.
template <int KIND, bool ZERO, bool EXP, bool PAIRS>
void dequant_block(const QField& f, int64_t b, int h, int hkv, int dh, int bs, uint16_t* out, float* meta,
                   const uint8_t* pf) {
    const int64_t room = (int64_t)bs * dh;
    expand_rows(f.scale, b, h, dh, bs, meta);
    if (ZERO) expand_rows(f.zero, b, h, dh, bs, meta + room);
    if (EXP) expand_rows(f.expo, b, h, dh, bs, meta + 2 * room);
    RowCursor sc(meta, f.scale.gt, dh), zr(meta + room, ZERO ? f.zero.gt : 1, dh),
        ex(meta + 2 * room, EXP ? f.expo.gt : 1, dh);
    const int P = KIND == 1 ? dh / 2 : dh;
    // x - (+0) is x for every x, -0 included: no branch for the formats without an offset.
    const __m512 off = _mm512_set1_ps(f.code_offset);
    const uint8_t* codes = f.codes + b * f.code_block + (int64_t)h * P;
    const int64_t row_stride = (int64_t)hkv * P;
    const auto value = [&](int t, int d0, const float* s, const float* z, const float* e) {
        __m512 x = _mm512_sub_ps(codes16<KIND>(codes + t * row_stride, d0), off);
        // Separate multiply and add (no FMA): torch rounds after each, and so must this.
        x = rounded(_mm512_mul_ps(x, _mm512_load_ps(s + d0)));
        if (ZERO) x = _mm512_add_ps(x, _mm512_load_ps(z + d0));
        if (EXP) x = _mm512_mul_ps(x, _mm512_load_ps(e + d0));
        return x;
    };
    if constexpr (!PAIRS) {
        for (int t = 0; t < bs; ++t) {
            if (pf) __builtin_prefetch(pf + t * row_stride);
            for (int d0 = 0; d0 < dh; d0 += 16)
                _mm256_storeu_si256((__m256i*)(out + (int64_t)t * dh + d0),
                                    (__m256i)_mm512_cvtneps_pbh(value(t, d0, sc.row, zr.row, ex.row)));
            sc.next();
            if (ZERO) zr.next();
            if (EXP) ex.next();
        }
    } else {
        // cvtne2ps puts token t's 16 values below token t+1's; this interleaves them.
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                               23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int t = 0; t < bs; t += 2) {
            if (pf) {
                __builtin_prefetch(pf + t * row_stride);
                __builtin_prefetch(pf + (t + 1) * row_stride);
            }
            const float *s0 = sc.row, *z0 = zr.row, *e0 = ex.row;
            sc.next();
            if (ZERO) zr.next();
            if (EXP) ex.next();
            for (int d0 = 0; d0 < dh; d0 += 16) {
                const __m512 x1 = value(t + 1, d0, sc.row, zr.row, ex.row), x0 = value(t, d0, s0, z0, e0);
                _mm512_storeu_si512(out + (int64_t)t * dh + 2 * d0,
                                    _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(x1, x0)));
            }
            sc.next();
            if (ZERO) zr.next();
            if (EXP) ex.next();
        }
    }
}

template <int KIND, bool PAIRS>
void dequant_kind(const QField& f, int64_t b, int h, int hkv, int dh, int bs, uint16_t* out, float* meta,
                  const uint8_t* pf) {
    const bool z = f.zero.ptr, e = f.expo.ptr;
    if (z && e) dequant_block<KIND, true, true, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf);
    else if (z) dequant_block<KIND, true, false, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf);
    else if (e) dequant_block<KIND, false, true, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf);
    else dequant_block<KIND, false, false, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf);
}

// 16x16 32-bit transpose: rows src + i * stride -> rows dst + i * dstride (transpose16_regs).
inline void transpose16(const uint32_t* src, int64_t stride, uint32_t* dst, int64_t dstride) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * stride);
    transpose16_regs(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * dstride, r[i]);
}

template <bool PAIRS>
void dequant(const QField& f, int64_t b, int h, int hkv, int dh, int bs, uint16_t* out, float* meta,
             int64_t next) {
    const uint8_t* pf = nullptr;
    if (next >= 0) {
        pf = f.codes + next * f.code_block + (int64_t)h * (f.code_kind == 1 ? dh / 2 : dh);
        if (h == 0) prefetch_metas(f, next);
    }
    switch (f.code_kind) {
        case 0: dequant_kind<0, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        case 1: dequant_kind<1, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        case 2: dequant_kind<2, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf); break;
        default: dequant_kind<3, PAIRS>(f, b, h, hkv, dh, bs, out, meta, pf); break;
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
        // Token rows [bs][dh] of K, transposed into the output afterwards; a sealed block's V goes
        // straight into the output.
        uint16_t* kt = (uint16_t*)aligned_alloc(64, (size_t)bs * dh * 2);
        float* meta = (float*)aligned_alloc(64, sizeof(float) * 3 * bs * dh);
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < n * hkv; ++w) {
            const int64_t u = w / hkv, b = block_ids[u];
            const int h = (int)(w % hkv);
            const int64_t e = block_res ? block_res[b] : -1;
            const int64_t next = u + 2 < n ? block_ids[u + 2] : -1;  // one block's work is ~1 us
            uint32_t* ko = (uint32_t*)out_k + (u * hkv + h) * np * bs;
            uint32_t* vo = (uint32_t*)out_v + (u * hkv + h) * (bs / 2) * dh;
            const uint16_t* ks = kt;
            int64_t tok = dh;  // elements between token rows
            if (e >= 0) {  // open block: its bf16 rows in the residual pool
                tok = (int64_t)hkv * dh;
                ks = res + (int64_t)e * 2 * bs * tok + (int64_t)h * dh;
                const uint16_t* vs = ks + (int64_t)bs * tok;
                for (int t = 0; t < bs; t += 2) {
                    for (int d0 = 0; d0 < dh; d0 += 16) {
                        const __m512i v0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vs + t * tok + d0)));
                        const __m512i v1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vs + (t + 1) * tok + d0)));
                        _mm512_storeu_si512(vo + (int64_t)(t / 2) * dh + d0, _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16)));
                    }
                }
            } else {
                dequant<false>(*kf, b, h, hkv, dh, bs, kt, meta, next);
                dequant<true>(*vf, b, h, hkv, dh, bs, (uint16_t*)vo, meta, next);
            }
            // K: token rows of (d, d+1) pairs -> per pair, 16 tokens in a row (16x16 transposes).
            for (int t0 = 0; t0 < bs; t0 += 16)
                for (int j0 = 0; j0 < np; j0 += 16)
                    transpose16((const uint32_t*)(ks + t0 * tok) + j0, tok / 2, ko + (int64_t)j0 * bs + t0, bs);
        }
        free(kt);
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

// A decode step's write into a quantized cache's residual pool (kv_cache_quant.py,
// QuantizedKVCache._write_staged, the blocks the write fills only partly): the same work as its
// torch indexing ops per layer, in one pass. Per block: its entry (block_res); a block without one
// takes the lowest free entry (res_owner < 0), as _allocate does; the mask is cleared for a block
// new to its entry or starting fresh; the LRU clock is set. Per token: its K and V rows go to entry
// e's res_kv rows (e * 2 * bs + off) and (e * 2 + 1) * bs + off, and its mask bit is set. Returns
// 1, having written nothing, when the Python path must run: a block to re-open from its quantized
// form (written before, not starting fresh), fewer free entries than blocks without one, or an
// index out of range (the torch path raises the IndexError).
extern "C" int residual_write_rows(int64_t* block_res, int64_t num_blocks, int64_t* res_owner, int64_t nentries,
                                   const int16_t* sealed_fill, bool* res_mask, int64_t* res_clock,
                                   uint8_t* res_kv, const int64_t* blocks, const bool* fresh, int64_t nblocks,
                                   const int64_t* index, const int64_t* offs, const int64_t* rows, int64_t ntok,
                                   const uint8_t* k, const uint8_t* v, int64_t nrows, int64_t k_stride,
                                   int64_t v_stride, int64_t row_bytes, int64_t bs, int64_t clock) {
    for (int64_t p = 0; p < nblocks; ++p)
        if (blocks[p] < 0 || blocks[p] >= num_blocks) return 1;
    for (int64_t t = 0; t < ntok; ++t)
        if (index[t] < 0 || index[t] >= nblocks || offs[t] < 0 || offs[t] >= bs
                || (rows ? rows[t] < 0 || rows[t] >= nrows : t >= nrows)) return 1;
    int64_t need = 0;
    for (int64_t p = 0; p < nblocks; ++p) {
        if (block_res[blocks[p]] >= 0) continue;
        if (!fresh[p] && sealed_fill[blocks[p]] > 0) return 1;
        ++need;
    }
    int64_t e = 0;
    if (need) {
        int64_t free = 0;
        for (int64_t i = 0; i < nentries && free < need; ++i) free += res_owner[i] < 0;
        if (free < need) return 1;
    }
    for (int64_t p = 0; p < nblocks; ++p) {
        const int64_t b = blocks[p];
        if (block_res[b] < 0) {
            while (res_owner[e] >= 0) ++e;
            res_owner[e] = b;
            block_res[b] = e;
            memset(res_mask + e * bs, 0, (size_t)bs);
        } else if (fresh[p]) {
            memset(res_mask + block_res[b] * bs, 0, (size_t)bs);
        }
        res_clock[block_res[b]] = clock;
    }
    for (int64_t t = 0; t < ntok; ++t) {
        const int64_t e = block_res[blocks[index[t]]], off = offs[t], r = rows ? rows[t] : t;
        uint8_t* dst = res_kv + (e * 2 * bs + off) * row_bytes;
        memcpy(dst, k + r * k_stride, (size_t)row_bytes);
        memcpy(dst + bs * row_bytes, v + r * v_stride, (size_t)row_bytes);
        res_mask[e * bs + off] = true;
    }
    return 0;
}
