/* fp32 y = x W^T (+ b) for CPUs with AVX2 and FMA, exposed as llm_serve::linear (app/cpu).
 *
 * Why our own: on a 2-core AVX2 AMD EPYC, oneDNN (and MKL) stream the weights of a
 * 1-4 row product at 10-13 GB/s while the machine reads memory at ~21 GB/s, and a decode step of
 * one sequence is exactly such products. This kernel streams them at memory speed (20-29 GB/s) and
 * runs 1.4-1.6x oneDNN's prepacked GEMM at 1-32 rows, 1.2x at 64, 0.9x at 256 (docs/engine.md).
 *
 * Weights are fp32 or bf16 (``linear_bf16w``): bf16 weights are widened to fp32 in registers (a
 * shift or a mask, see load_row) and everything else is fp32, so a decode step of one sequence
 * streams half the bytes and a CPU without native bf16 still computes in fp32.
 *
 * Layout: the weight [N, K] is packed once into panels of 16 output columns, [N/16][K][16], so a
 * panel is one contiguous stream (bf16: each 32-bit word of a panel row holds column j in its low
 * half and column j + 8 in its high half, so widening needs no shuffle). A tile of up to 6 input rows x 16 columns keeps 12 accumulators
 * in registers (BLIS-style 6x16 micro-kernel). Every output y[m, n] is one accumulator summed over
 * k in order and written by one thread, so a row's result never depends on which other rows share
 * the call, on the tile it falls in, on which thread ran it or on the thread count: batched equals
 * alone, bit for bit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16 /* output columns per panel: two AVX2 registers */
#define MR 6  /* input rows per tile: 12 accumulators + 2 weight registers + 1 broadcast <= 16 */
#define X_BLOCK_BYTES (320 * 1024) /* rows of x per pass, so they stay in L2 (512 KB a core here): 64 rows of a
                                    * 576-wide x in one pass, not two (fp32, 64-256 rows: 1.06-1.07x; 448 KB no better) */

int64_t packed_weight_numel(int64_t n, int64_t k) { return (n + NR - 1) / NR * k * NR; }

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* The weight [N, K] as panels [N/16][K][16], zero-padded past N; once per weight, so a branch per value is fine. */
static void pack_panels(const float* w, void* packed, int64_t n_total, int64_t k_total, const int bf16) {
  int64_t panels = (n_total + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; p++)
    for (int64_t k = 0; k < k_total; k++)
      for (int64_t j = 0; j < NR; j++) {
        int64_t n = p * NR + j, at = (p * k_total + k) * NR + j;
        float value = n < n_total ? w[n * k_total + k] : 0.0f;
        if (bf16) /* col j in the low half of 32-bit word j % 8, col j + 8 in its high half (see load_panel_row) */
          ((uint16_t*)packed)[at - j + (j < 8 ? 2 * j : 2 * (j - 8) + 1)] = to_bf16(value);
        else
          ((float*)packed)[at] = value;
      }
}

void pack_weight(const float* w, float* packed, int64_t n_total, int64_t k_total) {
  pack_panels(w, packed, n_total, k_total, 0);
}

void pack_weight_bf16(const float* w, uint16_t* packed, int64_t n_total, int64_t k_total) {
  pack_panels(w, packed, n_total, k_total, 1);
}

/* The 16 weights of a panel row at `at` as fp32 columns 0-7 (lo) and 8-15 (hi): loaded as they are, or
 * bf16 widened in place: one 32-byte load, a shift for the low halves and a mask for the high ones
 * (it was a zero-extension shuffle and a shift per 8 weights; all projections of SmolLM2-135M, old and
 * new alternated in one process: 1.03x at 1 row, 1.04-1.08x at 2-16, 1.01-1.02x at 32-64, same bits). */
static inline __attribute__((always_inline)) void load_row(const void* panel, int64_t at, const int bf16, __m256* lo, __m256* hi) {
  if (bf16) {
    __m256i v = _mm256_loadu_si256((const __m256i*)((const uint16_t*)panel + at));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
  } else {
    *lo = _mm256_loadu_ps((const float*)panel + at);
    *hi = _mm256_loadu_ps((const float*)panel + at + 8);
  }
}

/* Rows [0, mr) of x against one panel; mr is a constant after inlining, so unused rows vanish. With
 * `next`, it also prefetches from there, `step` bytes further each k (its share of the next panel). */
static inline __attribute__((always_inline)) void tile(const int mr, const int bf16, const float* x,
                                                       int64_t k_total, const void* panel, float* y,
                                                       int64_t ldy, int ncols, const float* bias, const char* next,
                                                       const int64_t step) {
  __m256 z = _mm256_setzero_ps();
  /* Named accumulators, not an array: gcc spills an array of vectors to the stack every iteration. */
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  /* 4 k's per loop iteration: the loop's own instructions spread over 48 FMAs (1.01-1.07x at 8-32 rows, paired) */
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_total; k++) {
    if (next) _mm_prefetch(next + k * step, _MM_HINT_T0);
    __m256 b0, b1, a;
    load_row(panel, k * NR, bf16, &b0, &b1);
#define ROW(i)                                           \
  if (mr > i) {                                          \
    a = _mm256_broadcast_ss(x + i * k_total + k);        \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);           \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);           \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
  float bias_cols[NR] = {0};
  if (bias)
    for (int j = 0; j < ncols; j++) bias_cols[j] = bias[j];
  __m256 bias0 = _mm256_loadu_ps(bias_cols), bias1 = _mm256_loadu_ps(bias_cols + 8);
  __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < mr; i++) {
    __m256 r0 = _mm256_add_ps(acc[i][0], bias0), r1 = _mm256_add_ps(acc[i][1], bias1);
    if (ncols == NR) {
      _mm256_storeu_ps(y + i * ldy, r0);
      _mm256_storeu_ps(y + i * ldy + 8, r1);
    } else { /* the last panel of an N that is not a multiple of 16 */
      float out[NR];
      _mm256_storeu_ps(out, r0);
      _mm256_storeu_ps(out + 8, r1);
      for (int j = 0; j < ncols; j++) y[i * ldy + j] = out[j];
    }
  }
}

/* One or two rows against several adjacent whole panels at once (a decode step of one or two
 * sequences). Against one panel they give only 2-4 independent sums, so every k waits on the FMA
 * latency and a thread streams its weights below memory speed; one row against 6 panels (12 sums) or
 * two rows against 2 (8 sums) keep several weight streams in flight: over all projections of
 * SmolLM2-135M on a 2-core AVX2 EPYC, one row runs 1.2x faster than against single panels with fp32
 * weights and 1.3x with bf16, two rows 1.2x and 1.15x. Each output is still one sum over k in order: the same bits as the 6x16 tiles
 * give it. */
static inline __attribute__((always_inline)) void row_against_6_panels(const int bf16, const float* x, int64_t k_total,
                                                                       const void* panels, float* y,
                                                                       const float* bias) {
  const int64_t stride = k_total * NR; /* elements from one panel to the next */
  __m256 z = _mm256_setzero_ps();
  __m256 c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, c8 = z, c9 = z, c10 = z, c11 = z;
  for (int64_t k = 0; k < k_total; k++) {
    __m256 a = _mm256_broadcast_ss(x + k), lo, hi;
#define PANEL(i, c_lo, c_hi)                                       \
  load_row(panels, i * stride + k * NR, bf16, &lo, &hi);           \
  c_lo = _mm256_fmadd_ps(a, lo, c_lo);                             \
  c_hi = _mm256_fmadd_ps(a, hi, c_hi);
    PANEL(0, c0, c1) PANEL(1, c2, c3) PANEL(2, c4, c5) PANEL(3, c6, c7) PANEL(4, c8, c9) PANEL(5, c10, c11)
#undef PANEL
  }
  __m256 sums[12] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int i = 0; i < 12; i++) _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(sums[i], bias ? _mm256_loadu_ps(bias + 8 * i) : z));
}

static inline __attribute__((always_inline)) void two_rows_against_2_panels(const int bf16, const float* x, int64_t k_total,
                                                                            const void* panels, float* y, int64_t ldy,
                                                                            const float* bias) {
  const int64_t stride = k_total * NR;
  __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z;
  for (int64_t k = 0; k < k_total; k++) {
    __m256 b0, b1, b2, b3;
    load_row(panels, k * NR, bf16, &b0, &b1);
    load_row(panels, stride + k * NR, bf16, &b2, &b3);
    __m256 a = _mm256_broadcast_ss(x + k);
    c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
    c02 = _mm256_fmadd_ps(a, b2, c02), c03 = _mm256_fmadd_ps(a, b3, c03);
    a = _mm256_broadcast_ss(x + k_total + k);
    c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
    c12 = _mm256_fmadd_ps(a, b2, c12), c13 = _mm256_fmadd_ps(a, b3, c13);
  }
  __m256 sums[2][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}};
  for (int r = 0; r < 2; r++)
    for (int i = 0; i < 4; i++)
      _mm256_storeu_ps(y + r * ldy + 8 * i, _mm256_add_ps(sums[r][i], bias ? _mm256_loadu_ps(bias + 8 * i) : z));
}

/* Every row of x against one panel, 6 rows at a time; bf16 is a constant in each caller below. */
static inline __attribute__((always_inline)) void panel_rows(const int bf16, const float* x, int64_t m_total,
                                                             int64_t k_total, const void* panel, float* y,
                                                             int64_t ldy, int ncols, const float* bias) {
  /* The tiles prefetch the next panel, most often this thread's next one (they go out 4 at a time), so
   * it comes from memory while this one computes instead of stalling the next panel's first tile. Each
   * of the T tiles fetches its own 1/T of it, paced over its k loop: when the first tile alone fetched
   * a cache line every k, its requests outran memory and stalled it (fp32 weights, all projections of
   * SmolLM2-135M, 14 pairs alternated in one process: 1.07x at 8 rows, 1.17x at 20, 1.13x at 32,
   * 1.07x at 64, 1.00x at 128; bf16 weights, half the bytes, 0.98-1.03x). Two panels ahead did worse. */
  const int64_t panel_bytes = k_total * NR * (bf16 ? 2 : 4);
  const int64_t tiles = (m_total + MR - 1) / MR, share = panel_bytes / tiles, step = share / k_total;
  const char* next = (const char*)panel + panel_bytes;
  int64_t m = 0, t = 0;
#define NEXT (next + (t < tiles ? t++ : tiles - 1) * share) /* the next tile's share */
  if (m_total >= MR) {
    /* A tail of 1-2 rows is 2-4 independent sums, bound by the FMA latency; with a full tile before it,
     * 7-8 rows go as 4 + 3-4 instead (fp32 weights, 20-32 rows: 1.03-1.05x, paired as above). */
    int64_t full = m_total / MR, tail = m_total % MR;
    if (tail && tail <= 2 && full >= 2) full -= 1;
    for (; m < full * MR; m += MR) tile(MR, bf16, x + m * k_total, k_total, panel, y + m * ldy, ldy, ncols, bias, NEXT, step);
    if (m_total - m > MR) {
      tile(4, bf16, x + m * k_total, k_total, panel, y + m * ldy, ldy, ncols, bias, NEXT, step);
      m += 4;
    }
  }
  const float* xr = x + m * k_total;
  float* yr = y + m * ldy;
  switch (m_total - m) {
    case 1: tile(1, bf16, xr, k_total, panel, yr, ldy, ncols, bias, NEXT, step); break;
    case 2: tile(2, bf16, xr, k_total, panel, yr, ldy, ncols, bias, NEXT, step); break;
    case 3: tile(3, bf16, xr, k_total, panel, yr, ldy, ncols, bias, NEXT, step); break;
    case 4: tile(4, bf16, xr, k_total, panel, yr, ldy, ncols, bias, NEXT, step); break;
    case 5: tile(5, bf16, xr, k_total, panel, yr, ldy, ncols, bias, NEXT, step); break;
    default: break;
  }
#undef NEXT
}

typedef void (*panel_fn)(const float*, int64_t, int64_t, const void*, float*, int64_t, int, const float*);
typedef void (*group_fn)(const float*, int64_t, int64_t, const void*, float*, int64_t, const float*);

static void panel_rows_f32(const float* x, int64_t m, int64_t k, const void* panel, float* y, int64_t ldy, int ncols,
                           const float* bias) {
  panel_rows(0, x, m, k, panel, y, ldy, ncols, bias);
}

static void panel_rows_bf16(const float* x, int64_t m, int64_t k, const void* panel, float* y, int64_t ldy, int ncols,
                            const float* bias) {
  panel_rows(1, x, m, k, panel, y, ldy, ncols, bias);
}

/* m_total (1 or 2) rows against group_panels(m_total) adjacent whole panels. */
static inline int64_t group_panels(int64_t m_total) { return m_total == 1 ? 6 : 2; }

static void group_f32(const float* x, int64_t m, int64_t k, const void* panels, float* y, int64_t ldy, const float* bias) {
  if (m == 1)
    row_against_6_panels(0, x, k, panels, y, bias);
  else
    two_rows_against_2_panels(0, x, k, panels, y, ldy, bias);
}

static void group_bf16(const float* x, int64_t m, int64_t k, const void* panels, float* y, int64_t ldy, const float* bias) {
  if (m == 1)
    row_against_6_panels(1, x, k, panels, y, bias);
  else
    two_rows_against_2_panels(1, x, k, panels, y, ldy, bias);
}

/* One or two rows: groups of whole panels, then the panels left over one at a time. */
static void few_rows(panel_fn rows_of, group_fn group_of, size_t weight_bytes, const float* x, const void* packed,
                     const float* bias, float* y, int64_t m_total, int64_t k_total, int64_t n_total) {
  int64_t panels = (n_total + NR - 1) / NR, per_group = group_panels(m_total);
  int64_t groups = n_total / NR / per_group, grouped = groups * per_group;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t g = 0; g < groups + panels - grouped; g++) {
    int64_t p = g < groups ? g * per_group : grouped + g - groups, n0 = p * NR;
    const char* panel = (const char*)packed + (size_t)(p * k_total * NR) * weight_bytes;
    const float* b = bias ? bias + n0 : 0;
    if (g < groups)
      group_of(x, m_total, k_total, panel, y + n0, n_total, b);
    else
      rows_of(x, m_total, k_total, panel, y + n0, n_total, n_total - n0 < NR ? (int)(n_total - n0) : NR, b);
  }
}

static void linear_panels(panel_fn rows_of, group_fn group_of, size_t weight_bytes, const float* x, const void* packed,
                          const float* bias, float* y, int64_t m_total, int64_t k_total, int64_t n_total) {
  if (m_total <= 2) {
    few_rows(rows_of, group_of, weight_bytes, x, packed, bias, y, m_total, k_total, n_total);
    return;
  }
  int64_t panels = (n_total + NR - 1) / NR;
  int64_t rows_per_pass = X_BLOCK_BYTES / (k_total * 4);
  rows_per_pass = rows_per_pass < MR ? MR : rows_per_pass - rows_per_pass % MR;
  for (int64_t m0 = 0; m0 < m_total; m0 += rows_per_pass) {
    int64_t rows = m_total - m0 < rows_per_pass ? m_total - m0 : rows_per_pass;
    /* Dynamic, 4 panels at a time: when a serving process preempts one of the threads, the other
     * takes over the remaining panels instead of waiting at the barrier with half the work undone
     * (served W1 on the 2-core machine: 150-163 tok/s against 133-135 with a static split). */
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t p = 0; p < panels; p++) {
      int64_t n0 = p * NR;
      int ncols = n_total - n0 < NR ? (int)(n_total - n0) : NR;
      const char* panel = (const char*)packed + (size_t)(p * k_total * NR) * weight_bytes;
      rows_of(x + m0 * k_total, rows, k_total, panel, y + m0 * n_total + n0, n_total, ncols, bias ? bias + n0 : 0);
    }
  }
}

/* x [m_total, k_total], packed from pack_weight, bias [n_total] or NULL, y [m_total, n_total]. */
void linear(const float* x, const float* packed, const float* bias, float* y, int64_t m_total, int64_t k_total,
            int64_t n_total) {
  linear_panels(panel_rows_f32, group_f32, sizeof(float), x, packed, bias, y, m_total, k_total, n_total);
}

/* The same with weights from pack_weight_bf16. */
void linear_bf16w(const float* x, const uint16_t* packed, const float* bias, float* y, int64_t m_total,
                  int64_t k_total, int64_t n_total) {
  linear_panels(panel_rows_bf16, group_bf16, sizeof(uint16_t), x, packed, bias, y, m_total, k_total, n_total);
}
