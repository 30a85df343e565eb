/* Paged attention for decode steps (one query per sequence) on CPUs with AVX2 and FMA, built by
 * app/engine/cpu_kernels.py at first use.
 *
 * Why: torch's attention needs each sequence's keys and values as one tensor, so the paged pool was
 * first gathered into a copy and SDPA then read the copy: three passes over the K/V bytes, which on
 * the 2-core AVX2 machine were ~20% of a 32-sequence decode step. This kernel reads every key and
 * value once, where it lies in the pool, through the sequence's slot list.
 *
 * One task per (sequence, KV head) computes all the query heads that share that KV head (grouped-query
 * attention): scores, softmax, weighted sum of values, in a fixed order on one thread, so a
 * sequence's result does not depend on its batch-mates or on the thread count.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* exp(x) for 8 floats: Cephes' expf (range reduction to [-ln2/2, ln2/2], degree-6 polynomial). */
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f)); /* below: 2^n leaves the normal range */
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; i++) s += a[i] * b[i];
  return s;
}

/* In place: scores[0..n) -> exp(scores - max); returns their sum. */
static float exp_shifted(float* scores, int64_t n) {
  float top = -INFINITY;
  for (int64_t l = 0; l < n; l++) top = scores[l] > top ? scores[l] : top;
  __m256 shift = _mm256_set1_ps(top), total = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + l), shift));
    _mm256_storeu_ps(scores + l, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; l < n; l++) {
    scores[l] = expf(scores[l] - top);
    sum += scores[l];
  }
  return sum;
}

/* q: query head h of sequence b at q + b*q_seq_stride + h*q_head_stride, head_dim contiguous.
 * k_pool, v_pool: [slots, kv_heads, head_dim] contiguous. key_slots: [seqs, max_keys] pool slot of each
 * key; context_lens: [seqs] keys of each sequence (its first context_lens[b] slots are real).
 * out: [seqs, heads, head_dim] contiguous. */
void decode_attention(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* k_pool,
                      const float* v_pool, const int64_t* key_slots, const int64_t* context_lens, float* out,
                      int64_t seqs, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_keys,
                      float scale) {
  const int64_t group = heads / kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < seqs; b++) {
    for (int64_t g = 0; g < kv_heads; g++) {
      const int64_t keys = context_lens[b];
      const int64_t* slots = key_slots + b * max_keys;
      float* scores = malloc(sizeof(float) * (size_t)(group * (keys + head_dim + 1)));
      float* o = out + (b * heads + g * group) * head_dim; /* this task's group of query heads */
      if (!scores) { /* cannot happen in practice (a few KB); leave NaN rather than crash the server */
        for (int64_t i = 0; i < group * head_dim; i++) o[i] = NAN;
        continue;
      }
      float* acc = scores + group * keys;
      float* inv_sum = acc + group * head_dim;
      for (int64_t r = 0; r < group; r++) {
        const float* qh = q + b * q_seq_stride + (g * group + r) * q_head_stride;
        for (int64_t l = 0; l < keys; l++)
          scores[r * keys + l] = dot(qh, k_pool + (slots[l] * kv_heads + g) * head_dim, head_dim) * scale;
      }
      for (int64_t r = 0; r < group; r++) inv_sum[r] = 1.0f / exp_shifted(scores + r * keys, keys);
      for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
      for (int64_t l = 0; l < keys; l++) {
        const float* vl = v_pool + (slots[l] * kv_heads + g) * head_dim;
        for (int64_t r = 0; r < group; r++) {
          const float p = scores[r * keys + l];
          float* a = acc + r * head_dim;
          for (int64_t d = 0; d < head_dim; d++) a[d] += p * vl[d];
        }
      }
      for (int64_t r = 0; r < group; r++)
        for (int64_t d = 0; d < head_dim; d++) o[r * head_dim + d] = acc[r * head_dim + d] * inv_sum[r];
      free(scores);
    }
  }
}
