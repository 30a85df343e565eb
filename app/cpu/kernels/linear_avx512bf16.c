// y = x W^T + b with bf16 products summed in fp32: the AVX-512 BF16 `vdpbf16ps` instruction, two products per
// fp32 lane. x arrives rounded to bf16 (pairs of consecutive features as one 32-bit word); W is packed once
// (app/cpu/linear.py) into groups of 64 output columns: [group][k pair][4 panels][16 columns][2], so a group
// is one contiguous stream and each k pair of it is four 64-byte vectors.
//
// Every output is one accumulator summed over k pairs in order by one thread, whatever the number of rows
// or threads: a row's result has the same bits alone or in any batch. A tile of up to 6 rows keeps 24
// accumulators (6 rows x 4 panels) in registers; one row keeps 4 independent sums, enough to stream the
// weights at memory speed. Compiled for the CPU at hand only through the target attribute: callers check
// that the CPU has avx512_bf16 before calling (linear_bf16dot_built says whether this build has it).
#include <stdint.h>

#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 9))
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define PANELS 4
#define GROUP_COLS (16 * PANELS)
#define TILE_ROWS 6

int linear_bf16dot_built(void) { return 1; }

static inline TARGET __attribute__((always_inline)) void tile(const uint32_t* x, int64_t k2, const uint16_t* w, const float* bias,
                                                               float* y, int64_t n, int64_t col0, const int rows) {
    __m512 acc[TILE_ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < PANELS; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        const uint16_t* wk = w + kk * (GROUP_COLS * 2);
        __m512bh wv[PANELS];
        for (int p = 0; p < PANELS; p++) wv[p] = (__m512bh)_mm512_loadu_si512((const void*)(wk + p * 32));
        for (int r = 0; r < rows; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * k2 + kk]);
            for (int p = 0; p < PANELS; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
        }
    }
    for (int p = 0; p < PANELS; p++) {
        const int64_t col = col0 + 16 * p, left = n - col;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * n + col, mask, _mm512_add_ps(acc[r][p], b));
    }
}

static TARGET void tile_rows(const uint32_t* x, int64_t k2, const uint16_t* w, const float* bias, float* y, int64_t n,
                             int64_t col0, int rows) {
    switch (rows) {  // a constant row count per case, so the accumulators stay in registers
        case 1: tile(x, k2, w, bias, y, n, col0, 1); break;
        case 2: tile(x, k2, w, bias, y, n, col0, 2); break;
        case 3: tile(x, k2, w, bias, y, n, col0, 3); break;
        case 4: tile(x, k2, w, bias, y, n, col0, 4); break;
        case 5: tile(x, k2, w, bias, y, n, col0, 5); break;
        default: tile(x, k2, w, bias, y, n, col0, 6); break;
    }
}

// x: [m][k2] bf16 pairs; packed: ceil(n / 64) groups of k2 * 128 bf16; y: [m][n].
TARGET void linear_bf16dot(const uint32_t* x, const uint16_t* packed, const float* bias, float* y, int64_t m,
                           int64_t k2, int64_t n) {
    const int64_t groups = (n + GROUP_COLS - 1) / GROUP_COLS, tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    // Tasks are (group, row tile), group-major, handed out in contiguous ranges: a thread runs all the tiles
    // of most of its groups back to back (the group's weights stay in its L2), and a weight with few groups
    // (576 outputs: 9) still splits evenly between the threads instead of 5 groups against 4.
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < groups * tiles; task++) {
        const int64_t g = task / tiles, r = task % tiles * TILE_ROWS;
        const int rows = (int)(m - r < TILE_ROWS ? m - r : TILE_ROWS);
        tile_rows(x + r * k2, k2, packed + g * k2 * (GROUP_COLS * 2), bias, y + r * n, n, g * GROUP_COLS, rows);
    }
}

#else
int linear_bf16dot_built(void) { return 0; }
void linear_bf16dot(const uint32_t* x, const uint16_t* packed, const float* bias, float* y, int64_t m, int64_t k2, int64_t n) {
    (void)x; (void)packed; (void)bias; (void)y; (void)m; (void)k2; (void)n;
}
#endif
