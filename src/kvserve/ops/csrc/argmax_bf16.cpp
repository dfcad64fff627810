// Greedy sampling's argmax over bf16 logits rows, numpy's answer: the first maximum, or the first
// NaN where a row has one (sampler.py's row_argmax).
//
// Why: a greedy batch-64 step copied its [64, 49152] bf16 logits into float32 (12.6 MB written,
// ~1 ms) only for numpy to read them back for the argmax (~1 ms); reading the bf16 rows once takes
// ~0.3 ms (bench/NOTES.md, "Greedy argmax on the bf16 logits").
#include <stdint.h>
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "bf16_vec.h"

extern "C" void argmax_bf16_rows(const uint16_t* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {
    #pragma omp parallel for schedule(static) if (rows * cols >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * stride;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t i = 0; i < cols; i += 16) {
            const __mmask16 k = tail16(cols - i);
            const __m512 v = load_bf16(row + i, k);
            nan |= _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
            vmax = _mm512_mask_max_ps(vmax, k, vmax, v);
        }
        const float m = _mm512_reduce_max_ps(vmax);
        const __m512 target = _mm512_set1_ps(m);
        int64_t found = 0;
        for (int64_t i = 0; i < cols; i += 16) {
            const __mmask16 k = tail16(cols - i);
            const __m512 v = load_bf16(row + i, k);
            const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q)
                                      : _mm512_mask_cmp_ps_mask(k, v, target, _CMP_EQ_OQ);
            if (hit) { found = i + __builtin_ctz(hit); break; }
        }
        out[r] = found;
    }
}

extern "C" int argmax_bf16_available() { return 1; }
#else
extern "C" void argmax_bf16_rows(const uint16_t*, int64_t, int64_t, int64_t, int64_t*) {}
extern "C" int argmax_bf16_available() { return 0; }
#endif
