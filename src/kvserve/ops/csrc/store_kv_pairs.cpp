// Stores T tokens' K/V (rows of hkv * dh 16-bit elements, `k_stride` / `v_stride` elements apart)
// at flat `slots` of one layer of the "pairs" layout paged_attention_bf16.cpp reads in place
// (kv_cache.py): K [blocks][hkv][dh/2][bs][2], V [blocks][hkv][bs/2][dh][2]. Plain scalar code: it
// moves 16-bit elements and needs no AVX512, so it exists in every build.
#include <stdint.h>

extern "C" void store_kv_pairs(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t T,
                               int64_t k_stride, int64_t v_stride, uint16_t* k_cache, uint16_t* v_cache,
                               int hkv, int dh, int bs) {
    const int np = dh / 2;
    // Each token's K touches dh / 2 cache lines per head (the pairs layout), mostly misses: two
    // threads from 32 tokens on (a batch-64 decode's 30 layers: 1.9 -> 1.2 ms).
    #pragma omp parallel for schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t blk = slots[t] / bs, off = slots[t] % bs;
        const uint32_t* ks = (const uint32_t*)(k + t * k_stride);
        const uint16_t* vs = v + t * v_stride;
        for (int h = 0; h < hkv; ++h) {
            uint32_t* kd = (uint32_t*)k_cache + (blk * hkv + h) * np * bs + off;
            for (int j = 0; j < np; ++j) kd[(int64_t)j * bs] = ks[h * np + j];
            uint16_t* vd = v_cache + ((blk * hkv + h) * (bs / 2) + off / 2) * dh * 2 + off % 2;
            for (int d = 0; d < dh; ++d) vd[2 * d] = vs[h * dh + d];
        }
    }
}

