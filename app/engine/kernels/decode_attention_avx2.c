/* Paged attention for decode steps (one query per sequence) on CPUs with AVX2 and FMA, built by
 * app/engine/cpu_kernels.py at first use.
 *
 * Why: torch's attention needs each sequence's keys and values as one tensor, so the paged pool was
 * first gathered into a copy and SDPA then read the copy: three passes over the K/V bytes, which on
 * the 2-core AVX2 machine were ~20% of a 32-sequence decode step. This kernel reads every key and
 * value once, where it lies in the pool, through the sequence's slot list. It also writes the step's
 * new keys and values into the pool (two torch index_copy_ calls a layer before, ~0.5-1.5 ms a step).
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

/* Four dot products of q with four keys, sharing each load of q; returns them in out[0..4). */
static inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                        int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
  }
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* [s0 s1 s2 s3 | s0 s1 s2 s3] halves */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, s);
  for (; i < d; i++) {
    out[0] += q[i] * k0[i];
    out[1] += q[i] * k1[i];
    out[2] += q[i] * k2[i];
    out[3] += q[i] * k3[i];
  }
}

/* scores[l] = scale * <q, key l> for the keys of one sequence and KV head. */
static void key_scores(const float* q, const float* k_pool, const int64_t* slots, int64_t keys, int64_t kv_heads,
                       int64_t g, int64_t d, float scale, float* scores) {
#define KEY(j) (k_pool + (slots[l + (j)] * kv_heads + g) * d)
  int64_t l = 0;
  for (; l + 4 <= keys; l += 4) {
    dot4(q, KEY(0), KEY(1), KEY(2), KEY(3), d, scores + l);
    for (int j = 0; j < 4; j++) scores[l + j] *= scale;
  }
  for (; l < keys; l++) scores[l] = dot(q, KEY(0), d) * scale;
#undef KEY
}

/* o[0..d) = inv_sum * sum_l p[l] * value l, with the output chunk held in registers across the keys. */
static void weighted_values(const float* p, const float* v_pool, const int64_t* slots, int64_t keys,
                            int64_t kv_heads, int64_t g, int64_t d, float inv_sum, float* o) {
  int64_t d0 = 0;
  for (; d0 + 32 <= d; d0 += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t l = 0; l < keys; l++) {
      const float* v = v_pool + (slots[l] * kv_heads + g) * d + d0;
      __m256 w = _mm256_set1_ps(p[l]);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
    }
    __m256 scale = _mm256_set1_ps(inv_sum);
    _mm256_storeu_ps(o + d0, _mm256_mul_ps(a0, scale));
    _mm256_storeu_ps(o + d0 + 8, _mm256_mul_ps(a1, scale));
    _mm256_storeu_ps(o + d0 + 16, _mm256_mul_ps(a2, scale));
    _mm256_storeu_ps(o + d0 + 24, _mm256_mul_ps(a3, scale));
  }
  for (; d0 < d; d0++) { /* head_dim not a multiple of 32: the rest one lane at a time */
    float a = 0.0f;
    for (int64_t l = 0; l < keys; l++) a += p[l] * v_pool[(slots[l] * kv_heads + g) * d + d0];
    o[d0] = a * inv_sum;
  }
}

/* Sequence b's new key or value of KV head g (at x + b*seq_stride + g*head_stride) into its pool slot. */
static inline void store_new(const float* x, int64_t seq_stride, int64_t head_stride, float* pool, int64_t slot,
                             int64_t b, int64_t g, int64_t kv_heads, int64_t d) {
  const float* src = x + b * seq_stride + g * head_stride;
  float* dst = pool + (slot * kv_heads + g) * d;
  for (int64_t i = 0; i < d; i++) dst[i] = src[i];
}

/* The `group` query heads sharing KV head g (query head r at q + r * q_head_stride) attend the first
 * `keys` keys of `slots`; their outputs go to o + r * d. The one computation of an attention output in
 * this file: decode and prefill both call it, so a token's output is the same bits whichever step
 * computed it, alone or in any batch. */
static void attend_group(const float* q, int64_t q_head_stride, int64_t group, const float* k_pool,
                         const float* v_pool, const int64_t* slots, int64_t keys, int64_t kv_heads, int64_t g,
                         int64_t d, float scale, float* o) {
  float* scores = malloc(sizeof(float) * (size_t)keys);
  if (!scores) { /* cannot happen in practice (a few KB); leave NaN rather than crash the server */
    for (int64_t i = 0; i < group * d; i++) o[i] = NAN;
    return;
  }
  for (int64_t r = 0; r < group; r++) {
    key_scores(q + r * q_head_stride, k_pool, slots, keys, kv_heads, g, d, scale, scores);
    float inv_sum = 1.0f / exp_shifted(scores, keys);
    weighted_values(scores, v_pool, slots, keys, kv_heads, g, d, inv_sum, o + r * d);
  }
  free(scores);
}

/* q: query head h of sequence b at q + b*q_seq_stride + h*q_head_stride, head_dim contiguous.
 * new_k, new_v: this step's key and value of each sequence, laid out like q (their own strides), written
 * first into the pool at new_slots[b] (one task writes what it then reads: no other thread touches it).
 * k_pool, v_pool: [slots, kv_heads, head_dim] contiguous. key_slots: [seqs, max_keys] pool slot of each
 * key, the new one included; key_counts: [seqs] keys of each sequence (its first key_counts[b] slots are
 * real). out: [seqs, heads, head_dim] contiguous. */
void decode_attention(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* new_k,
                      int64_t k_seq_stride, int64_t k_head_stride, const float* new_v, int64_t v_seq_stride,
                      int64_t v_head_stride, const int64_t* new_slots, float* k_pool, float* v_pool,
                      const int64_t* key_slots, const int64_t* key_counts, float* out, int64_t seqs, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t max_keys, float scale) {
  const int64_t group = heads / kv_heads; /* query heads sharing one KV head */
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < seqs; b++) {
    for (int64_t g = 0; g < kv_heads; g++) {
      store_new(new_k, k_seq_stride, k_head_stride, k_pool, new_slots[b], b, g, kv_heads, head_dim);
      store_new(new_v, v_seq_stride, v_head_stride, v_pool, new_slots[b], b, g, kv_heads, head_dim);
      attend_group(q + b * q_seq_stride + g * group * q_head_stride, q_head_stride, group, k_pool, v_pool,
                   key_slots + b * max_keys, key_counts[b], kv_heads, g, head_dim, scale,
                   out + (b * heads + g * group) * head_dim);
    }
  }
}

/* Any step's queries (prefill chunks and decodes side by side), each attended exactly as a decode step
 * attends its one query: query t (at q + t*q_tok_stride + h*q_head_stride) belongs to the sequence whose
 * key slots are row query_seq[t] of key_slots [rows, max_keys], and sees its first query_keys[t] keys
 * (causal: up to and including itself). The step's keys and values must already be in the pool.
 * out: [tokens, heads, head_dim] contiguous. */
void prefill_attention(const float* q, int64_t q_tok_stride, int64_t q_head_stride, const float* k_pool,
                       const float* v_pool, const int64_t* key_slots, int64_t max_keys, const int64_t* query_seq,
                       const int64_t* query_keys, float* out, int64_t tokens, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale) {
  const int64_t group = heads / kv_heads;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t t = 0; t < tokens; t++)
    for (int64_t g = 0; g < kv_heads; g++)
      attend_group(q + t * q_tok_stride + g * group * q_head_stride, q_head_stride, group, k_pool, v_pool,
                   key_slots + query_seq[t] * max_keys, query_keys[t], kv_heads, g, head_dim, scale,
                   out + (t * heads + g * group) * head_dim);
}
