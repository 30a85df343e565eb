/* RMSNorm of fp32 rows for AVX2 CPUs, exposed as llm_serve::rms_norm (app/cpu).
 *
 * Why: transformers' RMSNorm is seven small torch ops (to, pow, mean, add, rsqrt, mul, mul), each a
 * dispatch and a pass over the row; a 30-layer model runs 61 of them per step, ~2-3 ms of a one-
 * sequence decode step on a 2-core AVX2 EPYC. This is one call and one pass per row.
 *
 * y = w * (x * (1 / sqrt(mean(x^2) + eps))), the Llama formula in the same operation order, so only
 * the sum of squares' order differs from torch's (the last bits). Each row is summed in one fixed
 * order by one thread: a row's result does not depend on the other rows or the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static float sum_of_squares(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
  float sum = 0.0f;
  for (int j = 0; j < 8; j++) sum += lanes[j];
  for (; i < n; i++) sum += x[i] * x[i];
  return sum;
}

static void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  const float scale = 1.0f / sqrtf(sum_of_squares(x, n) / (float)n + eps);
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), s)));
  for (; i < n; i++) y[i] = w[i] * (x[i] * scale);
}

/* x [rows, n], w [n], y [rows, n], all contiguous. */
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  /* A row is ~1 us of work: threads only pay off for prefill-sized inputs. */
#pragma omp parallel for schedule(static) if (rows >= 64)
  for (int64_t r = 0; r < rows; r++) norm_row(x + r * n, w, y + r * n, n, eps);
}
