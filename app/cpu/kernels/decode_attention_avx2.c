/* Paged attention on CPUs with AVX2 and FMA, exposed as llm_serve::decode_attention and prefill_attention (app/cpu): decode
 * steps (one query per sequence) and any other step (prefill chunks and decodes side by side).
 *
 * Why: torch's attention needs each sequence's keys and values as one tensor, so the paged pool was
 * first gathered into a copy and SDPA then read the copy: three passes over the K/V bytes, which on
 * the 2-core AVX2 machine were ~20% of a 32-sequence decode step. This kernel reads every key and
 * value once, where it lies in the pool, through the sequence's slot list. It also writes a decode
 * step's new keys and values into the pool (two torch index_copy_ calls a layer before).
 *
 * The pool holds fp32 or bf16 keys and values (queries and outputs are fp32 either way). A bf16 pool
 * halves the bytes a decode step reads, which late in a long batch is most of the attention's time; its
 * values are widened to fp32 exactly as they are loaded (a shift), and everything after is the fp32 code.
 * The element type is a constant argument of the always-inlined helpers below, so each entry point is
 * compiled once per pool type with no test in the inner loops.
 *
 * Every query, prefill or decode, is attended by one computation (attend_group: scores, softmax,
 * weighted sum of values, in a fixed order on one thread, for the query heads sharing a KV head), so a
 * token's output depends only on its query and the keys and values it sees: not on its batch-mates,
 * the thread count, where its prompt's chunks ended, a prefix-cache hit or a recompute after
 * preemption. torch's SDPA gave none of these bit for bit (docs/engine.md). The query heads of a KV head
 * go together, and prefill runs of 4 queries too, through the same operations per row, sharing each load of
 * keys and values.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* Elements i..i+8 of a pool as fp32 (bf16 is the upper half of an fp32: widening is exact). */
INLINE __m256 load8(const void* pool, int64_t i, int bf16) {
  if (bf16) {
    __m128i half = _mm_loadu_si128((const __m128i*)((const uint16_t*)pool + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  return _mm256_loadu_ps((const float*)pool + i);
}

INLINE float load1(const void* pool, int64_t i, int bf16) {
  if (bf16) {
    uint32_t bits = (uint32_t)((const uint16_t*)pool)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  return ((const float*)pool)[i];
}

/* fp32 -> bf16 rounded to nearest even, NaN to a quiet NaN: torch's own conversion, so a key has the same
 * bits in the pool whether this kernel (decode) or torch's index_copy_ (other steps) wrote it. */
INLINE uint16_t to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

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

/* <q, the pool's d elements from `at`> */
INLINE float dot(const float* q, const void* pool, int64_t at, int64_t d, int bf16) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(pool, at + i, bf16), acc);
  float s = hsum(acc);
  for (; i < d; i++) s += q[i] * load1(pool, at + i, bf16);
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

/* Four dot products of q with the keys at k[0..4) of the pool, sharing each load of q; into out[0..4). */
INLINE void dot4(const float* q, const void* pool, const int64_t* k, int64_t d, int bf16, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, load8(pool, k[0] + i, bf16), a0);
    a1 = _mm256_fmadd_ps(qv, load8(pool, k[1] + i, bf16), a1);
    a2 = _mm256_fmadd_ps(qv, load8(pool, k[2] + i, bf16), a2);
    a3 = _mm256_fmadd_ps(qv, load8(pool, k[3] + i, bf16), a3);
  }
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* [s0 s1 s2 s3 | s0 s1 s2 s3] halves */
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, s);
  for (; i < d; i++)
    for (int j = 0; j < 4; j++) out[j] += q[i] * load1(pool, k[j] + i, bf16);
}

/* Pool element offset of key (or value) l of KV head g. */
#define ROW(l) ((slots[(l)] * kv_heads + g) * d)

/* Scores of one query against keys l..l+4 (offsets of a group of 4 keys at rows[0..4)). */
#define ROWS4(l) {ROW(l), ROW((l) + 1), ROW((l) + 2), ROW((l) + 3)}

/* Sequence b's new key or value of KV head g (at x + b*seq_stride + g*head_stride) into its pool slot. */
static void store_new(const float* x, int64_t seq_stride, int64_t head_stride, void* pool, int64_t slot, int64_t b,
                      int64_t g, int64_t kv_heads, int64_t d, int bf16) {
  const float* src = x + b * seq_stride + g * head_stride;
  const int64_t at = (slot * kv_heads + g) * d;
  if (bf16)
    for (int64_t i = 0; i < d; i++) ((uint16_t*)pool)[at + i] = to_bf16(src[i]);
  else
    memcpy((float*)pool + at, src, sizeof(float) * (size_t)d);
}

/* Keys and values are asked of the L2 this many keys ahead of the scores loop. A decode step finds them in memory
 * (the weights streamed through since the layer last ran), and demand loads from a scattered slot list keep too
 * few misses in flight; prefetched into the L2, which tracks many more misses than the L1, they arrive while the
 * keys before them are scored. Asking for every key at once instead (the first 512) filled the miss queue and
 * left the loop waiting on the first ones; a long context would also push its first rows out of the L2 before they
 * are read. The values of a key come in with it, ready for the weighted sum after the softmax. */
#define PREFETCH_AHEAD 16

/* The key and value rows of keys l..l+count (those below `keys`) of KV head g into the L2. */
INLINE void prefetch_keys(const void* k_pool, const void* v_pool, const int64_t* slots, int64_t l, int64_t count,
                          int64_t keys, int64_t kv_heads, int64_t g, int64_t d, int bf16) {
  const int64_t width = bf16 ? 2 : 4, bytes = d * width;
  for (int64_t m = l; m < l + count && m < keys; m++)
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch((const char*)k_pool + ROW(m) * width + b, _MM_HINT_T1);
      _mm_prefetch((const char*)v_pool + ROW(m) * width + b, _MM_HINT_T1);
    }
}

#define RUN 4 /* rows whose value sums share each value load: a prefill's queries, or a decode's query heads */

/* scores[i][l] = scale * <query i, key l> for n rows of one sequence and KV head (row i's query at qs[i], seeing
 * its first counts[i] keys): each group of 4 keys that every row sees is loaded once for all of them, and each
 * row's scores are the same operations whichever rows go with it (groups of 4 keys from key 0 through dot4,
 * then single keys through dot), so the same bits alone or beside any others. */
INLINE void key_scores_run(const float* const* qs, int n, const void* k_pool, const void* v_pool, const int64_t* slots,
                           const int64_t* counts, int64_t kv_heads, int64_t g, int64_t d, float scale,
                           float* const* scores, int bf16) {
  int64_t shared = counts[0];
  for (int i = 1; i < n; i++) shared = counts[i] < shared ? counts[i] : shared;
  int64_t most = counts[0];
  for (int i = 1; i < n; i++) most = counts[i] > most ? counts[i] : most;
  int64_t l = 0;
  for (; l + 4 <= shared; l += 4) {
    const int64_t rows[4] = ROWS4(l);
    prefetch_keys(k_pool, v_pool, slots, l + PREFETCH_AHEAD, 4, most, kv_heads, g, d, bf16);
    for (int i = 0; i < n; i++) {
      dot4(qs[i], k_pool, rows, d, bf16, scores[i] + l);
      for (int j = 0; j < 4; j++) scores[i][l + j] *= scale;
    }
  }
  for (int i = 0; i < n; i++) {
    int64_t m = l;
    for (; m + 4 <= counts[i]; m += 4) {
      const int64_t rows[4] = ROWS4(m);
      dot4(qs[i], k_pool, rows, d, bf16, scores[i] + m);
      for (int j = 0; j < 4; j++) scores[i][m + j] *= scale;
    }
    for (; m < counts[i]; m++) scores[i][m] = dot(qs[i], k_pool, ROW(m), d, bf16) * scale;
  }
}

/* o[i][0..d) = inv_sum[i] * sum_l p[i][l] * value l for `n` rows (1..RUN, a constant once inlined): 16 lanes of the
 * n outputs at a time, each value row loaded once for all of them over the keys every row sees, then each row's own
 * remaining keys; lanes past the last multiple of 32 one at a time. Every lane is one sum over l in order from
 * zero, whichever rows go with it and however the lanes are grouped: the same bits alone or beside any others. */
INLINE void weighted_values_rows(const int n, float* const* p, const void* v_pool, const int64_t* slots,
                                 const int64_t* counts, int64_t kv_heads, int64_t g, int64_t d, const float* inv_sum,
                                 float* const* o, int bf16) {
  const int64_t vector_lanes = d / 32 * 32;
  int64_t shared = counts[0];
  for (int i = 1; i < n; i++) shared = counts[i] < shared ? counts[i] : shared;
  for (int64_t d0 = 0; d0 < vector_lanes; d0 += 16) {
    __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;
#define ACC(i, v0, v1, l)                                        \
  if (i < n) {                                                   \
    __m256 w = _mm256_set1_ps(p[i][l]);                          \
    a##i##0 = _mm256_fmadd_ps(w, v0, a##i##0);                   \
    a##i##1 = _mm256_fmadd_ps(w, v1, a##i##1);                   \
  }
#define VALUES(l)                                                \
  const int64_t at = ROW(l) + d0;                                \
  __m256 v0 = load8(v_pool, at, bf16), v1 = load8(v_pool, at + 8, bf16);
    for (int64_t l = 0; l < shared; l++) {
      VALUES(l)
      ACC(0, v0, v1, l) ACC(1, v0, v1, l) ACC(2, v0, v1, l) ACC(3, v0, v1, l)
    }
#define TAIL(i)                                                                            \
  if (i < n) {                                                                             \
    for (int64_t l = shared; l < counts[i]; l++) {                                         \
      VALUES(l)                                                                            \
      ACC(i, v0, v1, l)                                                                    \
    }                                                                                      \
    _mm256_storeu_ps(o[i] + d0, _mm256_mul_ps(a##i##0, _mm256_set1_ps(inv_sum[i])));       \
    _mm256_storeu_ps(o[i] + d0 + 8, _mm256_mul_ps(a##i##1, _mm256_set1_ps(inv_sum[i])));   \
  }
    TAIL(0) TAIL(1) TAIL(2) TAIL(3)
#undef TAIL
#undef VALUES
#undef ACC
  }
  for (int64_t d0 = vector_lanes; d0 < d; d0++) /* head_dim not a multiple of 32: the rest one lane at a time */
    for (int i = 0; i < n; i++) {
      float a = 0.0f;
      for (int64_t l = 0; l < counts[i]; l++) a += p[i][l] * load1(v_pool, ROW(l) + d0, bf16);
      o[i][d0] = a * inv_sum[i];
    }
}

/* weighted_values_rows for n rows, n of 1..RUN given at run time (each count its own instance). */
INLINE void weighted_values_run(int n, float* const* p, const void* v_pool, const int64_t* slots,
                                const int64_t* counts, int64_t kv_heads, int64_t g, int64_t d, const float* inv_sum,
                                float* const* o, int bf16) {
  switch (n) {
    case 1: weighted_values_rows(1, p, v_pool, slots, counts, kv_heads, g, d, inv_sum, o, bf16); break;
    case 2: weighted_values_rows(2, p, v_pool, slots, counts, kv_heads, g, d, inv_sum, o, bf16); break;
    case 3: weighted_values_rows(3, p, v_pool, slots, counts, kv_heads, g, d, inv_sum, o, bf16); break;
    default: weighted_values_rows(RUN, p, v_pool, slots, counts, kv_heads, g, d, inv_sum, o, bf16); break;
  }
}

#define MAX_RUN_ROWS 64 /* rows scored together (query heads x RUN in a prefill): 16 heads a KV head at most */

/* The `group` query heads sharing KV head g (query head r at q + r * q_head_stride) attend the first
 * `keys` keys of `slots`; their outputs go to o + r * d. The one computation of an attention output in
 * this file: decode and prefill both call it, so a token's output is the same bits whichever step
 * computed it, alone or in any batch. The heads go through the run helpers together (each key loaded once
 * for all of them, each value once for RUN of them), which give each row the bits it gets alone. */
INLINE void attend_group(const float* q, int64_t q_head_stride, int64_t group, const void* k_pool, const void* v_pool,
                         const int64_t* slots, int64_t keys, int64_t kv_heads, int64_t g, int64_t d, float scale,
                         float* o, int bf16) {
  const int64_t rows = group < MAX_RUN_ROWS ? group : MAX_RUN_ROWS; /* scored together, at most */
  float* buffer = malloc(sizeof(float) * (size_t)(keys * rows));
  if (!buffer) { /* a score per key and head: cannot fail in practice; leave NaN rather than crash the server */
    for (int64_t i = 0; i < group * d; i++) o[i] = NAN;
    return;
  }
  prefetch_keys(k_pool, v_pool, slots, 0, PREFETCH_AHEAD, keys, kv_heads, g, d, bf16); /* the scores loop asks for the rest */
  const float* qs[MAX_RUN_ROWS];
  float* scores[MAX_RUN_ROWS];
  float* outs[MAX_RUN_ROWS];
  int64_t counts[MAX_RUN_ROWS];
  float inv_sum[MAX_RUN_ROWS];
  for (int64_t r0 = 0; r0 < group; r0 += MAX_RUN_ROWS) {
    const int n = (int)(group - r0 < MAX_RUN_ROWS ? group - r0 : MAX_RUN_ROWS);
    for (int r = 0; r < n; r++) {
      qs[r] = q + (r0 + r) * q_head_stride;
      scores[r] = buffer + r * keys;
      outs[r] = o + (r0 + r) * d;
      counts[r] = keys;
    }
    key_scores_run(qs, n, k_pool, v_pool, slots, counts, kv_heads, g, d, scale, scores, bf16);
    for (int r = 0; r < n; r++) inv_sum[r] = 1.0f / exp_shifted(scores[r], keys);
    for (int r = 0; r < n; r += RUN) /* RUN rows at a time, the last run maybe fewer */
      weighted_values_run(n - r < RUN ? n - r : RUN, scores + r, v_pool, slots, counts + r, kv_heads, g, d, inv_sum + r,
                          outs + r, bf16);
  }
  free(buffer);
}

#define ATTEND_GROUP_ARGS                                                                                           \
  const float *q, int64_t q_head_stride, int64_t group, const void *k_pool, const void *v_pool,                   \
      const int64_t *slots, int64_t keys, int64_t kv_heads, int64_t g, int64_t d, float scale, float *o
static void attend_group_f32(ATTEND_GROUP_ARGS) { attend_group(q, q_head_stride, group, k_pool, v_pool, slots, keys, kv_heads, g, d, scale, o, 0); }
static void attend_group_bf16(ATTEND_GROUP_ARGS) { attend_group(q, q_head_stride, group, k_pool, v_pool, slots, keys, kv_heads, g, d, scale, o, 1); }
#define ATTEND_GROUP(bf16, ...) ((bf16) ? attend_group_bf16(__VA_ARGS__) : attend_group_f32(__VA_ARGS__))

/* q: query head h of sequence b at q + b*q_seq_stride + h*q_head_stride, head_dim contiguous.
 * new_k, new_v: this step's key and value of each sequence, laid out like q (their own strides), written
 * first into the pool at new_slots[b] (one task writes what it then reads: no other thread touches it).
 * k_pool, v_pool: [slots, kv_heads, head_dim] contiguous, fp32 or (kv_bf16) bf16. key_slots: [seqs, max_keys]
 * pool slot of each key, the new one included; key_counts: [seqs] keys of each sequence (its first
 * key_counts[b] slots are real). out: [seqs, heads, head_dim] contiguous. */
void decode_attention(const float* q, int64_t q_seq_stride, int64_t q_head_stride, const float* new_k,
                      int64_t k_seq_stride, int64_t k_head_stride, const float* new_v, int64_t v_seq_stride,
                      int64_t v_head_stride, const int64_t* new_slots, void* k_pool, void* v_pool, int kv_bf16,
                      const int64_t* key_slots, const int64_t* key_counts, float* out, int64_t seqs, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t max_keys, float scale) {
  const int64_t group = heads / kv_heads; /* query heads sharing one KV head */
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < seqs; b++) {
    for (int64_t g = 0; g < kv_heads; g++) {
      store_new(new_k, k_seq_stride, k_head_stride, k_pool, new_slots[b], b, g, kv_heads, head_dim, kv_bf16);
      store_new(new_v, v_seq_stride, v_head_stride, v_pool, new_slots[b], b, g, kv_heads, head_dim, kv_bf16);
      ATTEND_GROUP(kv_bf16, q + b * q_seq_stride + g * group * q_head_stride, q_head_stride, group, k_pool, v_pool,
                   key_slots + b * max_keys, key_counts[b], kv_heads, g, head_dim, scale,
                   out + (b * heads + g * group) * head_dim);
    }
  }
}


/* attend_group for RUN consecutive queries t0.. of one sequence (query i's head r at q + i*q_tok_stride +
 * r*q_head_stride, output at o + i*o_tok_stride + r*d): each group of keys is loaded once for all RUN x
 * group rows, each value once per head. */
INLINE void attend_run(const float* q, int64_t q_tok_stride, int64_t q_head_stride, int64_t group, const void* k_pool,
                       const void* v_pool, const int64_t* slots, const int64_t* counts, int64_t kv_heads, int64_t g,
                       int64_t d, float scale, float* o, int64_t o_tok_stride, int bf16) {
  const int rows = (int)(group * RUN);
  int64_t most = 0;
  for (int i = 0; i < RUN; i++) most = counts[i] > most ? counts[i] : most;
  float* buffer = malloc(sizeof(float) * (size_t)(rows * most));
  if (!buffer) {
    for (int i = 0; i < RUN; i++)
      for (int64_t j = 0; j < group * d; j++) o[i * o_tok_stride + j] = NAN;
    return;
  }
  const float* qs[MAX_RUN_ROWS];
  float* scores[MAX_RUN_ROWS];
  float* outs[MAX_RUN_ROWS];
  int64_t row_counts[MAX_RUN_ROWS];
  float inv_sum[MAX_RUN_ROWS];
  for (int64_t r = 0; r < group; r++) /* row r * RUN + i: head r of query i */
    for (int i = 0; i < RUN; i++) {
      const int row = (int)(r * RUN + i);
      qs[row] = q + i * q_tok_stride + r * q_head_stride;
      scores[row] = buffer + row * most;
      outs[row] = o + i * o_tok_stride + r * d;
      row_counts[row] = counts[i];
    }
  key_scores_run(qs, rows, k_pool, v_pool, slots, row_counts, kv_heads, g, d, scale, scores, bf16);
  for (int row = 0; row < rows; row++) inv_sum[row] = 1.0f / exp_shifted(scores[row], row_counts[row]);
  for (int64_t r = 0; r < group; r++)
    weighted_values_run(RUN, scores + r * RUN, v_pool, slots, counts, kv_heads, g, d, inv_sum + r * RUN,
                        outs + r * RUN, bf16);
  free(buffer);
}

#define ATTEND_RUN_ARGS                                                                                             \
  const float *q, int64_t q_tok_stride, int64_t q_head_stride, int64_t group, const void *k_pool,                 \
      const void *v_pool, const int64_t *slots, const int64_t *counts, int64_t kv_heads, int64_t g, int64_t d,     \
      float scale, float *o, int64_t o_tok_stride
static void attend_run_f32(ATTEND_RUN_ARGS) { attend_run(q, q_tok_stride, q_head_stride, group, k_pool, v_pool, slots, counts, kv_heads, g, d, scale, o, o_tok_stride, 0); }
static void attend_run_bf16(ATTEND_RUN_ARGS) { attend_run(q, q_tok_stride, q_head_stride, group, k_pool, v_pool, slots, counts, kv_heads, g, d, scale, o, o_tok_stride, 1); }
#define ATTEND_RUN(bf16, ...) ((bf16) ? attend_run_bf16(__VA_ARGS__) : attend_run_f32(__VA_ARGS__))

/* Any step's queries (prefill chunks and decodes side by side), each attended exactly as a decode step
 * attends its one query: query t (at q + t*q_tok_stride + h*q_head_stride) belongs to the sequence whose
 * key slots are row query_seq[t] of key_slots [rows, max_keys], and sees its first query_keys[t] keys
 * (causal: up to and including itself). The step's keys and values must already be in the pool (fp32, or
 * bf16 where kv_bf16). out: [tokens, heads, head_dim] contiguous. Tasks are (RUN packed queries, KV head);
 * within one, RUN queries of one sequence go together through attend_run, the others one by one through
 * attend_group. */
void prefill_attention(const float* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k_pool,
                       const void* v_pool, int kv_bf16, const int64_t* key_slots, int64_t max_keys,
                       const int64_t* query_seq, const int64_t* query_keys, float* out, int64_t tokens, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, float scale) {
  const int64_t group = heads / kv_heads, blocks = (tokens + RUN - 1) / RUN;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t block = 0; block < blocks; block++)
    for (int64_t g = 0; g < kv_heads; g++) {
      const int64_t t0 = block * RUN, end = t0 + RUN < tokens ? t0 + RUN : tokens;
      const float* q0 = q + t0 * q_tok_stride + g * group * q_head_stride;
      float* o0 = out + (t0 * heads + g * group) * head_dim;
      if (end - t0 == RUN && query_seq[t0] == query_seq[t0 + RUN - 1] && group * RUN <= MAX_RUN_ROWS) {
        ATTEND_RUN(kv_bf16, q0, q_tok_stride, q_head_stride, group, k_pool, v_pool,
                   key_slots + query_seq[t0] * max_keys, query_keys + t0, kv_heads, g, head_dim, scale, o0,
                   heads * head_dim);
        continue;
      }
      for (int64_t t = t0; t < end; t++)
        ATTEND_GROUP(kv_bf16, q + t * q_tok_stride + g * group * q_head_stride, q_head_stride, group, k_pool, v_pool,
                     key_slots + query_seq[t] * max_keys, query_keys[t], kv_heads, g, head_dim, scale,
                     out + (t * heads + g * group) * head_dim);
    }
}
