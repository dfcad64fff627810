// Three of the decoder's elementwise steps for bf16 activations, one pass each (model/fused.py):
// the residual add with the RMSNorm after it, the rotary embedding, and SiLU(gate) * up.
//
// Why: at decode sizes (64 rows x 576) each is a few microseconds of arithmetic, but torch runs
// them as chains of small ops (an RMSNorm alone is ~8: upcast, square, mean, add, rsqrt, multiply,
// downcast, weight), each with its own dispatch and pass over memory; with them replaced by no-ops
// a batch-64 decode step ran 4-11 ms (6-12 %) faster (bench/NOTES.md). Roundings are torch's:
// every op torch runs in bf16 is rounded to bf16 here at the same point (nearest even), so the
// results are torch's bit for bit except where the float32 sum of squares is reassociated.
#include <stdint.h>
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "avx512_exp.h"
#include "bf16_vec.h"

// h [T, H] += delta [T, H] (rows `delta_stride` apart; no add when delta is null), rounded as
// torch's bf16 add is; then out [T, H] = w * bf16(h * rsqrt(mean(h^2) + eps)), transformers'
// Llama RMSNorm (normalise in float32, round, multiply by the weight in bf16).
extern "C" void add_rms_norm_bf16(uint16_t* h, const uint16_t* delta, int64_t delta_stride,
                                  const uint16_t* w, uint16_t* out, int64_t T, int64_t H, float eps) {
    // Two threads from ~16K elements: a batch-64 decode's 64 x 576 took 14-16 us on one, 9 on two.
    #pragma omp parallel for schedule(static) if (T * H >= (1 << 14))
    for (int64_t t = 0; t < T; ++t) {
        uint16_t* ht = h + t * H;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 k = tail16(H - i);
            __m512 x = load_bf16(ht + i, k);
            if (delta) {
                x = round_bf16(_mm512_add_ps(x, load_bf16(delta + t * delta_stride + i, k)));
                store_bf16(ht + i, x, k);
            }
            ss = _mm512_fmadd_ps(x, x, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 k = tail16(H - i);
            const __m512 y = round_bf16(_mm512_mul_ps(load_bf16(ht + i, k), inv));
            store_bf16(out + t * H + i, _mm512_mul_ps(load_bf16(w + i, k), y), k);
        }
    }
}

// In place on x [T, nheads, D] (token rows `x_stride` elements apart, heads contiguous): rotate-
// half RoPE with cos, sin_signed [T, D] (sin_signed = (-sin, sin)), as fused.apply_rope computes it
// in bf16: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin_signed)).
extern "C" void rope_bf16(uint16_t* x, int64_t x_stride, int64_t T, int64_t nheads, int64_t D,
                          const uint16_t* cos, const uint16_t* sin_signed) {
    const int64_t n = D / 2;
    #pragma omp parallel for schedule(static) if (T * nheads * D >= (1 << 17))
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* c = cos + t * D;
        const uint16_t* s = sin_signed + t * D;
        for (int64_t hd = 0; hd < nheads; ++hd) {
            uint16_t* xh = x + t * x_stride + hd * D;
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 k = tail16(n - i);
                const __m512 a = load_bf16(xh + i, k), b = load_bf16(xh + n + i, k);
                const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, load_bf16(c + i, k))),
                                                round_bf16(_mm512_mul_ps(b, load_bf16(s + i, k))));
                const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load_bf16(c + n + i, k))),
                                                round_bf16(_mm512_mul_ps(a, load_bf16(s + n + i, k))));
                store_bf16(xh + i, lo, k);
                store_bf16(xh + n + i, hi, k);
            }
        }
    }
}

// out [T, I] = bf16(bf16(silu(gate)) * up) with gate = gu[t, :I], up = gu[t, I:2I] (rows `gu_stride`
// apart): torch's F.silu(gate).mul_(up) in bf16, in one pass instead of two over a 2,048-token
// chunk's 12.6 MB gate/up output. SiLU is x / (1 + exp(-x)) in float32 as torch computes it; exp512
// is within 1-2 float32 ulps of torch's, so the bf16 results agree except where the float32 value
// sits that close to a rounding boundary (tests/test_fused_ops.py bounds how often).
extern "C" void silu_mul_bf16(const uint16_t* gu, int64_t gu_stride, uint16_t* out, int64_t T, int64_t I) {
    const __m512 one = _mm512_set1_ps(1.f);
    #pragma omp parallel for schedule(static) if (T * I >= (1 << 16))
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* g = gu + t * gu_stride;
        const uint16_t* u = g + I;
        uint16_t* o = out + t * I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 k = tail16(I - i);
            const __m512 x = load_bf16(g + i, k);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, e)));
            store_bf16(o + i, _mm512_mul_ps(s, load_bf16(u + i, k)), k);
        }
    }
}

extern "C" int elementwise_bf16_available() { return 1; }
#else
extern "C" void add_rms_norm_bf16(uint16_t*, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t,
                                  int64_t, float) {}
extern "C" void rope_bf16(uint16_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*) {}
extern "C" void silu_mul_bf16(const uint16_t*, int64_t, uint16_t*, int64_t, int64_t) {}
extern "C" int elementwise_bf16_available() { return 0; }
#endif
