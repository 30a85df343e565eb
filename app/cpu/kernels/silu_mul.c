/* The gated MLP's activation in one pass: out = silu(gate) * up, from the shared gate/up GEMM's rows
 * [gate | up], exposed as llm_serve::silu_mul (app/cpu/activation.py, used by the gated MLP in linear.py).
 *
 * Why: torch runs it as two ops over a strided slice (silu, then mul), each a dispatch, an output to allocate
 * and a pass through memory; 5% of a prefill step of a 371M Llama on two cores, 2% of a 32-row decode step.
 *
 * The same bits as torch's F.silu(gate) * up on this CPU. torch computes silu as x / (1 + exp(-x)): in
 * vectors of its CPU capability with SLEEF's exp (Sleef_expf16_u10 for AVX-512, Sleef_expf8_u10 for AVX2,
 * both exported by libtorch_cpu, where these calls resolve), two vectors at a time along a row, and the rest
 * of the row (fewer than two vectors) one value at a time with the C library's expf. This kernel calls the
 * same functions at the same places of a row (`lanes`: the vector width torch uses, 1 for scalar code
 * throughout); the product is one rounding either way. Unlike torch's op, a value's bits never depend on how
 * the rows were split between threads (torch may split a row at a thread boundary, sending its values there
 * to the scalar path): a row gives the same bits alone or in any batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

__m512 Sleef_expf16_u10(__m512);
__m256 Sleef_expf8_u10(__m256);

static inline float silu_times(float g, float u) { return g / (1 + expf(-g)) * u; }

/* Vectors over the row's whole pairs of vectors (torch's loop), returning where the scalar rest begins. */
__attribute__((target("avx512f"))) static int64_t vectors_avx512(const float* gate, const float* up, float* out, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  const int64_t end = width - width % 32;
  for (int64_t i = 0; i < end; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign)))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
  }
  return end;
}

__attribute__((target("avx2"))) static int64_t vectors_avx2(const float* gate, const float* up, float* out, int64_t width) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const int64_t end = width - width % 16;
  for (int64_t i = 0; i < end; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_xor_ps(g, sign))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  return end;
}

static void silu_mul_row(const float* gate, const float* up, float* out, int64_t width, int lanes) {
  int64_t i = lanes == 16 ? vectors_avx512(gate, up, out, width) : lanes == 8 ? vectors_avx2(gate, up, out, width) : 0;
  for (; i < width; i++) out[i] = silu_times(gate[i], up[i]);
}

/* gate_up [rows, 2 * width] (gate then up in each row), out [rows, width], both contiguous. */
void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t width, int lanes) {
#pragma omp parallel for schedule(static) if (rows * width >= 32768)  // torch's grain: below it one thread
  for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * width, gate_up + r * 2 * width + width, out + r * width, width, lanes);
}
