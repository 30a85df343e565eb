/* Rotary position embedding of queries and keys for AVX2 CPUs, exposed as llm_serve::rotary (app/cpu).
 *
 * Why: transformers applies it as ~14 small torch ops a layer (two slices, a negation, a concatenation,
 * four products and two sums for q and k), ~57 us of dispatch for a one-token decode step on a 2-core AVX2
 * EPYC, 1.7 ms of a 30-layer step. This is one call.
 *
 * out = x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x[d/2:], x[:d/2]): the same products
 * and sum, each rounded to fp32 as torch's separate ops round them (no fused multiply-add), so the
 * results are torch's bits exactly (app/cpu/rotary.py checks that before using it).
 */
#pragma STDC FP_CONTRACT OFF /* clang: a*b + c stays two roundings */
#pragma GCC optimize("fp-contract=off") /* gcc: the same */
#include <immintrin.h>
#include <stdint.h>

/* One head of one token: d/2 pairs (x[i], x[i + d/2]). */
static inline void rotate(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
    /* first half: lo * cos - hi * sin (torch: lo * cos + (-hi) * sin, the same bits) */
    _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                            _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
    _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
  }
  for (; i < half; i++) {
    out[i] = x[i] * cos[i] - x[half + i] * sin[i];
    out[half + i] = x[half + i] * cos[half + i] + x[i] * sin[half + i];
  }
}

/* x [batch, heads, tokens, d] with element strides (xs_b, xs_h, xs_t) and a contiguous last dim;
 * cos/sin [batch or 1, tokens, d] with strides (cs_b, cs_t); out [batch, tokens, heads, d] contiguous. */
static void rotate_all(const float* x, int64_t xs_b, int64_t xs_h, int64_t xs_t, int64_t heads, const float* cos,
                       const float* sin, int64_t cs_b, int64_t cs_t, float* out, int64_t batch, int64_t tokens,
                       int64_t d) {
  /* A head is ~50 ns of work: threads only pay off for prefill-sized inputs. */
#pragma omp parallel for collapse(2) schedule(static) if (batch * tokens * heads >= 4096)
  for (int64_t b = 0; b < batch; b++)
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t h = 0; h < heads; h++)
        rotate(x + b * xs_b + h * xs_h + t * xs_t, cos + b * cs_b + t * cs_t, sin + b * cs_b + t * cs_t,
               out + ((b * tokens + t) * heads + h) * d, d);
}

/* Queries and keys in one call (one crossing from Python a layer). */
void rotary(const float* q, int64_t qs_b, int64_t qs_h, int64_t qs_t, int64_t q_heads, const float* k, int64_t ks_b,
            int64_t ks_h, int64_t ks_t, int64_t k_heads, const float* cos, const float* sin, int64_t cs_b,
            int64_t cs_t, float* q_out, float* k_out, int64_t batch, int64_t tokens, int64_t d) {
  rotate_all(q, qs_b, qs_h, qs_t, q_heads, cos, sin, cs_b, cs_t, q_out, batch, tokens, d);
  rotate_all(k, ks_b, ks_h, ks_t, k_heads, cos, sin, cs_b, cs_t, k_out, batch, tokens, d);
}
