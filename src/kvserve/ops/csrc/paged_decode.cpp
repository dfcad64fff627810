#include <stdint.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <omp.h>

#define MAX_DH 256

static inline float to_f32(float x) { return x; }
static inline float to_f32(uint16_t x) { uint32_t u = (uint32_t)x << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void from_f32(float x, float* out) { *out = x; }
// exp for x <= 0 (softmax after subtracting the max), ~1e-7 relative error, branch-free so the
// loop vectorises (libm's expf does not without -ffast-math).
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}
static inline void from_f32(float x, uint16_t* out) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { *out = 0x7fc0; return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even, as torch's bf16 cast
    *out = (uint16_t)(u >> 16);
}

// Blocks sit anywhere in the pool and span pages, where the hardware prefetcher stops: ask for
// the next block's lines while this one is being used.
template <typename T>
static inline void prefetch_block(const T* p, int64_t elems) {
    const char* c = (const char*)p;
    for (int64_t off = 0; off < elems * (int64_t)sizeof(T); off += 64) __builtin_prefetch(c + off);
}

// q, out: rows q_rows[i] of [*, Hq, D] (row strides q_stride, out_stride elements; heads dense). k_cache, v_cache: one
// layer's [num_blocks, bs, Hkv, D]. block_tables: [N, bt_stride]. seq_lens: [N]; the query sits
// at position seq_lens[i] - 1. window > 0: keys older than window positions are invisible.
// Work item = (sequence, group of K/V heads): all heads of a sequence together when there are
// enough sequences to keep every thread busy (a block's tokens are then read contiguously),
// one K/V head per item otherwise (batch 1 still spreads over the threads).
template <typename T, int DH_FIXED>
static void decode_attention(const T* q, T* out, const int64_t* q_rows, int64_t q_stride, int64_t out_stride,
                             const T* k_cache, const T* v_cache, const int64_t* block_tables,
                             int64_t bt_stride, const int64_t* seq_lens, int n, int hq, int hkv,
                             int bs, float scale, int64_t window, int dh) {
    // DH_FIXED > 0: head size known at compile time (unrolled); 0: any dh <= MAX_DH.
    const int DH = DH_FIXED ? DH_FIXED : dh;
    const int g = hq / hkv;
    const int64_t tok_stride = (int64_t)hkv * DH;
    const int splits = n >= 4 * omp_get_max_threads() ? 1 : hkv;
    const int heads_per_item = hkv / splits;
    const int hq_item = heads_per_item * g;
    #pragma omp parallel
    {
        std::vector<float> scores;
        std::vector<float> qf((size_t)hq_item * DH), acc((size_t)hq_item * DH);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)n * splits; ++item) {
            const int i = (int)(item / splits);
            const int h0 = (int)(item % splits) * heads_per_item;
            const int64_t len = seq_lens[i];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int64_t nkeys = len - first;
            if ((int64_t)scores.size() < (int64_t)hq_item * nkeys) scores.resize((size_t)hq_item * nkeys);
            const T* qrow = q + q_rows[i] * q_stride + (int64_t)h0 * g * DH;
            for (int j = 0; j < hq_item * DH; ++j) qf[j] = to_f32(qrow[j]) * scale;
            const int64_t* table = block_tables + (int64_t)i * bt_stride;
            const int64_t b_first = first / bs, b_end = (len + bs - 1) / bs;
            // Pass 1: scores[j][t] = q_j . k_t for every query head j of the item.
            for (int64_t b = b_first; b < b_end; ++b) {
                const T* kb = k_cache + table[b] * bs * tok_stride + (int64_t)h0 * DH;
                if (b + 1 < b_end) prefetch_block(k_cache + table[b + 1] * bs * tok_stride, bs * tok_stride);
                const int64_t t0 = first > b * bs ? first - b * bs : 0;
                const int64_t t1 = len - b * bs < bs ? len - b * bs : bs;
                for (int64_t t = t0; t < t1; ++t) {
                    const int64_t col = b * bs + t - first;
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        const T* kr = kb + t * tok_stride + hh * DH;
                        float kf[DH_FIXED ? DH_FIXED : MAX_DH];
                        #pragma omp simd
                        for (int d = 0; d < DH; ++d) kf[d] = to_f32(kr[d]);
                        for (int j = hh * g; j < (hh + 1) * g; ++j) {
                            const float* qj = &qf[(size_t)j * DH];
                            float s = 0.f;
                            #pragma omp simd reduction(+:s)
                            for (int d = 0; d < DH; ++d) s += qj[d] * kf[d];
                            scores[(size_t)j * nkeys + col] = s;
                        }
                    }
                }
            }
            // Softmax per query head.
            for (int j = 0; j < hq_item; ++j) {
                float* sj = &scores[(size_t)j * nkeys];
                float m = -INFINITY;
                for (int64_t t = 0; t < nkeys; ++t) m = sj[t] > m ? sj[t] : m;
                float sum = 0.f;
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < nkeys; ++t) { sj[t] = exp_nonpos(sj[t] - m); sum += sj[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < nkeys; ++t) sj[t] *= inv;
            }
            // Pass 2: acc_j = sum_t p_jt v_t
            for (int j = 0; j < hq_item * DH; ++j) acc[j] = 0.f;
            for (int64_t b = b_first; b < b_end; ++b) {
                const T* vb = v_cache + table[b] * bs * tok_stride + (int64_t)h0 * DH;
                if (b + 1 < b_end) prefetch_block(v_cache + table[b + 1] * bs * tok_stride, bs * tok_stride);
                const int64_t t0 = first > b * bs ? first - b * bs : 0;
                const int64_t t1 = len - b * bs < bs ? len - b * bs : bs;
                for (int64_t t = t0; t < t1; ++t) {
                    const int64_t col = b * bs + t - first;
                    for (int hh = 0; hh < heads_per_item; ++hh) {
                        const T* vr = vb + t * tok_stride + hh * DH;
                        float vf[DH_FIXED ? DH_FIXED : MAX_DH];
                        #pragma omp simd
                        for (int d = 0; d < DH; ++d) vf[d] = to_f32(vr[d]);
                        for (int j = hh * g; j < (hh + 1) * g; ++j) {
                            const float w = scores[(size_t)j * nkeys + col];
                            float* aj = &acc[(size_t)j * DH];
                            #pragma omp simd
                            for (int d = 0; d < DH; ++d) aj[d] += w * vf[d];
                        }
                    }
                }
            }
            T* orow = out + q_rows[i] * out_stride + (int64_t)h0 * g * DH;
            for (int j = 0; j < hq_item * DH; ++j) from_f32(acc[j], &orow[j]);
        }
    }
}

#define ENTRY(NAME, T, DH) \
extern "C" void NAME(const void* q, void* out, const int64_t* q_rows, int64_t q_stride, int64_t out_stride, \
                     const void* k, const void* v, const int64_t* bt, int64_t bt_stride, \
                     const int64_t* seq_lens, int n, int hq, int hkv, int bs, float scale, \
                     int64_t window, int dh) { \
    decode_attention<T, DH>((const T*)q, (T*)out, q_rows, q_stride, out_stride, (const T*)k, (const T*)v, bt, \
                            bt_stride, seq_lens, n, hq, hkv, bs, scale, window, dh); \
}
ENTRY(decode_f32_d64, float, 64)
ENTRY(decode_f32_d128, float, 128)
ENTRY(decode_bf16_d64, uint16_t, 64)
ENTRY(decode_bf16_d128, uint16_t, 128)
ENTRY(decode_f32_dany, float, 0)
ENTRY(decode_bf16_dany, uint16_t, 0)
