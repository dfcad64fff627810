// h2o's scores: the attention mass each block of one sequence's table receives from its query
// rows at one layer, summed over query heads and rows, read from the "pairs" KV layout in place.
//
// Why a kernel of its own: the layer loop (decoder_bf16.cpp) calls it right after a layer's
// attention, on the rows of the sequences that ask for h2o only, so that a step holding such a
// sequence stays one compiled call. Recomputing the scores in torch meant leaving that call for
// the Python loop, which doubled the step time of every request in the batch. The attention
// kernel itself is left as it is: its online softmax never holds a block's final probability.
//
// Query row j of n sits at table position seq_len - n + j and sees keys 0 .. that position
// (no sliding window: compression is refused on windowed models). Logits are bf16 x bf16 dot
// products accumulated in float32, softmax in float32, as torch computes them from the same
// operands up to summation order.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "avx512_exp.h"
#define KVS_SCORE_AVX512 1
#endif

namespace {

inline float bf16_to_float(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// lg[t] = c * (q . k_t) for the keys of blocks 0 .. ceil(m / bs) - 1 of kv head h (entries past
// m are written and never read). K block layout: [hkv][dh/2][bs][2].
void row_logits(const uint16_t* q, const uint16_t* k_cache, const int64_t* bt, int64_t m, int hkv, int h, int dh,
                int bs, float c, float* lg) {
    const int np = dh / 2;
    const int64_t nb = (m + bs - 1) / bs;
    for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* kb = k_cache + (bt[b] * hkv + h) * (int64_t)np * bs * 2;
        float* o = lg + b * bs;
#ifdef KVS_SCORE_AVX512
        if (bs % 16 == 0 && np % 4 == 0) {
            for (int t0 = 0; t0 < bs; t0 += 16) {
                // Four independent chains: one would wait on each dot product's latency.
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int p = 0; p < np; p += 4) {
                    for (int u = 0; u < 4; ++u) {
                        int32_t pair;
                        memcpy(&pair, q + 2 * (p + u), 4);
                        const __m512i kk = _mm512_loadu_si512(kb + ((int64_t)(p + u) * bs + t0) * 2);
                        acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)kk, (__m512bh)_mm512_set1_epi32(pair));
                    }
                }
                const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                _mm512_storeu_ps(o + t0, _mm512_mul_ps(sum, _mm512_set1_ps(c)));
            }
            continue;
        }
#endif
        for (int t = 0; t < bs; ++t) {
            float acc = 0.f;
            for (int p = 0; p < np; ++p) {
                const uint16_t* kp = kb + ((int64_t)p * bs + t) * 2;
                acc += bf16_to_float(q[2 * p]) * bf16_to_float(kp[0]) + bf16_to_float(q[2 * p + 1]) * bf16_to_float(kp[1]);
            }
            o[t] = acc * c;
        }
    }
}

// part[b] += softmax(lg[0 .. m))'s mass on block b; lg holds logits in base 2 (scaled by log2 e).
void row_mass(float* lg, int64_t m, int bs, float* part) {
    const int64_t nb = (m + bs - 1) / bs;
#ifdef KVS_SCORE_AVX512
    if (bs % 16 == 0) {  // lanes past m (stale slots of the last block) are masked, never read
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < m; t += 16) {
            const __mmask16 k = m - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (m - t)) - 1);
            vmx = _mm512_mask_max_ps(vmx, k, vmx, _mm512_maskz_loadu_ps(k, lg + t));
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t t = 0; t < nb * bs; t += 16) {
            const int64_t left = m - t;
            const __mmask16 k = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            const __m512 e = _mm512_maskz_mov_ps(k, exp2_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, lg + t), mx)));
            _mm512_storeu_ps(lg + t, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(vsum);
        for (int64_t b = 0; b < nb; ++b) {
            __m512 v = _mm512_loadu_ps(lg + b * bs);
            for (int u = 16; u < bs; u += 16) v = _mm512_add_ps(v, _mm512_loadu_ps(lg + b * bs + u));
            part[b] += _mm512_reduce_add_ps(v) * inv;
        }
        return;
    }
#endif
    float mx = -INFINITY;
    for (int64_t t = 0; t < m; ++t) mx = lg[t] > mx ? lg[t] : mx;
    float total = 0.f;
    for (int64_t t = 0; t < m; ++t) {
        lg[t] = exp2f(lg[t] - mx);
        total += lg[t];
    }
    const float inv = 1.f / total;
    for (int64_t b = 0; b < nb; ++b) {
        const int64_t end = (b + 1) * bs < m ? (b + 1) * bs : m;
        float s = 0.f;
        for (int64_t u = b * bs; u < end; ++u) s += lg[u];
        part[b] += s * inv;
    }
}

}  // namespace

// out[b] += the mass block b (of ceil(seq_len / bs)) receives over every query head from the
// chunk's query rows n - 1, n - 1 - stride, ... down to row n - last (of n rows; q: row j at
// q + j * q_stride, heads of dh bf16 side by side), each counted `stride` times: every row for
// stride 1, an even sample of a long prompt chunk's rows otherwise.
extern "C" void score_blocks_bf16(const uint16_t* q, int64_t q_stride, int64_t n, int64_t last, int64_t stride,
                                  const uint16_t* k_cache, const int64_t* bt, int64_t seq_len, int hq, int hkv,
                                  int dh, int bs, float scale, float* out) {
    const int group = hq / hkv;
    const int64_t nb = (seq_len + bs - 1) / bs, picked = (last + stride - 1) / stride, rows = picked * hq;
    const float c = scale * 1.44269504088896341f;
    // A decode row is a few microseconds a layer: threads only for prompt chunks.
    const int threads = rows * seq_len >= (1 << 16) ? omp_get_max_threads() : 1;
    std::vector<float> parts((size_t)threads * nb, 0.f);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> lg(nb * bs);
        float* part = parts.data() + (size_t)omp_get_thread_num() * nb;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t j = n - 1 - (r / hq) * stride;
            const int head = (int)(r % hq);
            const int64_t m = seq_len - n + j + 1;
            row_logits(q + j * q_stride + (int64_t)head * dh, k_cache, bt, m, hkv, head / group, dh, bs, c, lg.data());
            row_mass(lg.data(), m, bs, part);
        }
    }
    // Summed in thread order: the same scores every run, so the same blocks are released.
    for (int th = 0; th < threads; ++th)
        for (int64_t b = 0; b < nb; ++b) out[b] += (float)stride * parts[(size_t)th * nb + b];
}
