// exp for 16 floats on AVX-512: exp512 for SiLU (the elementwise pass and the GEMM epilogue) and
// the softmax's rescaling, exp2_512 for the softmax's probabilities (attention kernel).
// exp512: Cephes' range reduction and degree-6 polynomial, ~1e-7 relative error (1-2 float32
// ulps) for inputs in [-87, 88]; below -87 it returns exp(-87), above 88 inf.
#pragma once
#include <immintrin.h>

static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

// 2^x for 16 floats, for softmax probabilities: x - round(x) in [-0.5, 0.5] needs no second
// range-reduction constant, and a degree-5 polynomial (fitted here for relative error) keeps
// ~2e-7, as exp512; 8 operations against exp512's 15. Finite x only: a lane holding -inf or NaN
// gives NaN and must be masked by the caller; below -149 the result flushes to 0.
static inline __m512 exp2_512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.326472731307149e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.671512991189957e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550733581185341e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242426872253e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931470036506653e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
