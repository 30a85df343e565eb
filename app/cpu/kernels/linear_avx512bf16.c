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
//
// A group's first tile of rows reads its weights from memory, the others from the L2. From four tiles of rows on
// (19+ rows: batched decode steps, prefill), those later tiles also prefetch the next group's weights into the
// L2, in turn, one or two lines a k pair until all are asked for, so that group's first tile finds them there
// instead of waiting for memory. With fewer tiles the prefetches crowd too few products and cost more than they
// save (measured in docs/engine.md).
//
// linear_int4_bf16dot takes 4-bit weights (GPTQ's codes, a zero and a scale per group of input features and
// column) in the same tiles: each code becomes bf16 in registers through a table lookup, cheap enough to
// redo for every tile of rows, and a group's exact products are summed before its zero and scale apply.
// Its cost grows with the rows as the bf16 kernel's does, not as a kernel that widens the weights to floats
// for every few rows. The same bits alone or in any batch here too.
#include <stdint.h>

#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 9))
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define PANELS 4
#define GROUP_COLS (16 * PANELS)
#define TILE_ROWS 6
#define PREFETCH_MIN_TILES 4
#define LINE 64

int linear_bf16dot_built(void) { return 1; }

// Cache lines of weights a tile asks the L2 for: `per_pair` at each k pair, `lines` in all from `at`.
typedef struct {
    const char* at;
    int64_t per_pair, lines;
} Prefetch;

// Tile t of group g's share of the next group's lines (none for a first tile, the last group, or few tiles).
static inline Prefetch next_group_share(const uint16_t* packed, int64_t g, int64_t groups, int64_t t, int64_t tiles,
                                        int64_t k2) {
    const Prefetch none = {0, 0, 0};
    if (t == 0 || tiles < PREFETCH_MIN_TILES || g + 1 >= groups || k2 == 0) return none;
    const int64_t group_elems = k2 * (GROUP_COLS * 2), lines = group_elems * 2 / LINE;
    const int64_t per_pair = (lines + (tiles - 1) * k2 - 1) / ((tiles - 1) * k2), first = (t - 1) * k2 * per_pair;
    if (first >= lines) return none;  // the earlier tiles asked for them all
    const Prefetch share = {(const char*)(packed + (g + 1) * group_elems) + first * LINE, per_pair, lines - first};
    return share;
}

static inline TARGET __attribute__((always_inline)) void tile(const uint32_t* x, int64_t k2, const uint16_t* w, const float* bias,
                                                               const float* residual, float* y, int64_t n, int64_t col0,
                                                               const int rows, const Prefetch pf) {
    __m512 acc[TILE_ROWS][PANELS];
    for (int r = 0; r < rows; r++)
        for (int p = 0; p < PANELS; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k2; kk++) {
        const uint16_t* wk = w + kk * (GROUP_COLS * 2);
        __m512bh wv[PANELS];
        for (int p = 0; p < PANELS; p++) wv[p] = (__m512bh)_mm512_loadu_si512((const void*)(wk + p * 32));
        for (int64_t j = kk * pf.per_pair; j < (kk + 1) * pf.per_pair && j < pf.lines; j++)
            _mm_prefetch(pf.at + j * LINE, _MM_HINT_T1);
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
        for (int r = 0; r < rows; r++) {
            const __m512 out = _mm512_add_ps(acc[r][p], b);  // residual + (sum + bias): torch's h + linear(x), bit for bit
            _mm512_mask_storeu_ps(y + r * n + col, mask,
                                  residual ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual + r * n + col), out) : out);
        }
    }
}

static TARGET void tile_rows(const uint32_t* x, int64_t k2, const uint16_t* w, const float* bias, const float* residual,
                             float* y, int64_t n, int64_t col0, int rows, const Prefetch pf) {
    switch (rows) {  // a constant row count per case, so the accumulators stay in registers
        case 1: tile(x, k2, w, bias, residual, y, n, col0, 1, pf); break;
        case 2: tile(x, k2, w, bias, residual, y, n, col0, 2, pf); break;
        case 3: tile(x, k2, w, bias, residual, y, n, col0, 3, pf); break;
        case 4: tile(x, k2, w, bias, residual, y, n, col0, 4, pf); break;
        case 5: tile(x, k2, w, bias, residual, y, n, col0, 5, pf); break;
        default: tile(x, k2, w, bias, residual, y, n, col0, 6, pf); break;
    }
}

// x [rows][k] fp32 into out [rows][out_k] bf16 (out_k - k trailing zeros a row: an odd k's zero partner), rounded to
// nearest even with NaN kept a NaN: torch's own fp32 -> bf16 conversion (c10::BFloat16), value for value, denormals
// included (vcvtneps2bf16 would flush those). One pass, cheaper than torch's copy_ for a decode step's few rows
// (docs/benchmark-log.md).
TARGET void round_rows_to_bf16(const float* x, uint16_t* out, int64_t rows, int64_t k, int64_t out_k) {
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7fc0);
#pragma omp parallel for schedule(static) if (rows * k >= (1 << 20))  // a prefill's rows; a decode step's: one thread
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * k;
        uint16_t* o = out + r * out_k;
        for (int64_t j = 0; j < k; j += 16) {
            const __mmask16 mask = k - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - j)) - 1);
            const __m512 v = _mm512_maskz_loadu_ps(mask, xr + j);
            const __m512i bits = _mm512_castps_si512(v);
            const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(bias, lsb)), 16);
            rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), nan, rounded);
            _mm256_mask_storeu_epi16(o + j, mask, _mm512_cvtepi32_epi16(rounded));
        }
        for (int64_t j = k; j < out_k; j++) o[j] = 0;
    }
}

// x: [m][k2] bf16 pairs; packed: ceil(n / 64) groups of k2 * 128 bf16; y: [m][n]; residual: [m][n] added to
// each output (a decoder layer's h + o_proj(x), h + down(x): one pass less), or NULL.
TARGET void linear_bf16dot(const uint32_t* x, const uint16_t* packed, const float* bias, const float* residual, float* y,
                           int64_t m, int64_t k2, int64_t n) {
    const int64_t groups = (n + GROUP_COLS - 1) / GROUP_COLS, tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    // Tasks are (group, row tile), group-major, handed out in shrinking contiguous ranges (guided, never less
    // than a whole group): a thread runs all the tiles of most of its groups back to back (the group's weights
    // stay in its L2), a weight with few groups (576 outputs: 9) still splits about evenly between the threads,
    // and when another process preempts one thread the other takes the ranges left instead of waiting at the
    // barrier with half the work undone (as the AVX2 kernel's dynamic panels do; measured in docs/benchmark-log.md).
#pragma omp parallel for schedule(guided, tiles)
    for (int64_t task = 0; task < groups * tiles; task++) {
        const int64_t g = task / tiles, r = task % tiles * TILE_ROWS;
        const int rows = (int)(m - r < TILE_ROWS ? m - r : TILE_ROWS);
        const float* tile_residual = residual ? residual + r * n : residual;  // (NULL stays NULL)
        tile_rows(x + r * k2, k2, packed + g * k2 * (GROUP_COLS * 2), bias, tile_residual, y + r * n, n, g * GROUP_COLS,
                  rows, next_group_share(packed, g, groups, task % tiles, tiles, k2));
    }
}


// A tile of 4-bit weights: the codes of a k pair (64 bytes: byte j of half h holds value j of panel 2h in its
// low nibble and of panel 2h + 1 in its high one) become bf16 in registers through a table (vpermw); within a
// quantization group the products x * code are exact and summed in fp32, and each group's sum enters y once:
// y = bias + sum over groups of scale * (sum of x * code - zero * sum of x), the last from xsums.
static inline TARGET __attribute__((always_inline)) void int4_tile(const uint32_t* x, int64_t k2, const uint8_t* codes,
                                                                    const uint16_t* scales, const uint8_t* zeros,
                                                                    const float* xsums, int64_t quant_groups, __m512i table,
                                                                    int64_t pairs_per_group, const float* bias, float* y,
                                                                    int64_t n, int64_t col0, const int rows) {
    __mmask16 mask[PANELS];
    for (int p = 0; p < PANELS; p++) {
        const int64_t left = n - (col0 + 16 * p);
        mask[p] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask[p], bias + col0 + 16 * p) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * n + col0 + 16 * p, mask[p], b);
    }
    const __m512i nibble = _mm512_set1_epi16(0xF);
    for (int64_t start = 0; start < k2; start += pairs_per_group) {
        __m512 acc[TILE_ROWS][PANELS];
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < PANELS; p++) acc[r][p] = _mm512_setzero_ps();
        for (int64_t kk = start; kk < start + pairs_per_group; kk++) {
            const uint8_t* c = codes + kk * (GROUP_COLS);
            const __m512i low = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)c));
            const __m512i high = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + 32)));
            __m512bh wv[PANELS];
            wv[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(low, nibble), table);
            wv[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(low, 4), table);
            wv[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(high, nibble), table);
            wv[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(high, 4), table);
            for (int r = 0; r < rows; r++) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * k2 + kk]);
                for (int p = 0; p < PANELS; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
            }
        }
        const int64_t group = start / pairs_per_group;
        for (int p = 0; p < PANELS; p++) {
            // fp16 scales and 4-bit zero codes, as the checkpoint holds them: exact in fp32
            const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + group * GROUP_COLS + 16 * p)));
            const __m512 zv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i*)(zeros + group * GROUP_COLS + 16 * p))));
            for (int r = 0; r < rows; r++) {
                float* yp = y + r * n + col0 + 16 * p;
                const __m512 sum = _mm512_fnmadd_ps(zv, _mm512_set1_ps(xsums[r * quant_groups + group]), acc[r][p]);
                _mm512_mask_storeu_ps(yp, mask[p], _mm512_fmadd_ps(sum, sv, _mm512_maskz_loadu_ps(mask[p], yp)));
            }
        }
    }
}

static TARGET void int4_tile_rows(const uint32_t* x, int64_t k2, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                                  const float* xsums, int64_t quant_groups, __m512i table, int64_t pairs_per_group,
                                  const float* bias, float* y, int64_t n, int64_t col0, int rows) {
    switch (rows) {  // a constant row count per case, so the accumulators stay in registers
        case 1: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 1); break;
        case 2: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 2); break;
        case 3: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 3); break;
        case 4: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 4); break;
        case 5: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 5); break;
        default: int4_tile(x, k2, codes, scales, zeros, xsums, quant_groups, table, pairs_per_group, bias, y, n, col0, 6); break;
    }
}

// sums[r][g]: the sum of row r's bf16 values over quantization group g (group_size a multiple of 16), in a
// fixed order that depends on nothing but the row: sixteen lanes along the group, then the lanes' tree.
TARGET void int4_group_sums(const uint16_t* x, float* sums, int64_t m, int64_t k, int64_t group_size) {
    const int64_t groups = k / group_size;
#pragma omp parallel for schedule(static) if (m * groups >= 1024)  // a decode step's few rows: not worth a fork
    for (int64_t i = 0; i < m * groups; i++) {
        const uint16_t* xi = x + i * group_size;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < group_size; j += 16)  // bf16 -> fp32: the same bits, 16 places up
            acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xi + j))), 16)));
        sums[i] = _mm512_reduce_add_ps(acc);
    }
}

// x: [m][k2] bf16 pairs; codes: ceil(n / 64) groups of k2 * 64 bytes; scales (fp16), zeros (codes): per group,
// k2 / pairs_per_group quantization groups of 64; xsums: [m][quantization group] the
// sums of x's bf16 values over each group, in order; y: [m][n].
TARGET void linear_int4_bf16dot(const uint32_t* x, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                                const float* xsums, const float* bias, float* y, int64_t m, int64_t k2, int64_t n,
                                int64_t pairs_per_group) {
    uint16_t entries[32] = {0};
    for (int code = 0; code < 16; code++) {  // small integers: exact in bf16 (the high half of their fp32 bits)
        const float value = (float)code;
        uint32_t bits;
        __builtin_memcpy(&bits, &value, sizeof bits);
        entries[code] = (uint16_t)(bits >> 16);
    }
    const __m512i table = _mm512_loadu_si512((const void*)entries);
    const int64_t groups = (n + GROUP_COLS - 1) / GROUP_COLS, tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t quant_groups = k2 / pairs_per_group;
#pragma omp parallel for schedule(guided, tiles)
    for (int64_t task = 0; task < groups * tiles; task++) {  // as linear_bf16dot: (group, row tile), group-major
        const int64_t g = task / tiles, r = task % tiles * TILE_ROWS;
        const int rows = (int)(m - r < TILE_ROWS ? m - r : TILE_ROWS);
        const int64_t at = g * quant_groups * GROUP_COLS;
        int4_tile_rows(x + r * k2, k2, codes + g * k2 * GROUP_COLS, scales + at, zeros + at, xsums + r * quant_groups,
                       quant_groups, table, pairs_per_group, bias, y + r * n, n, g * GROUP_COLS, rows);
    }
}

#else
int linear_bf16dot_built(void) { return 0; }
void linear_bf16dot(const uint32_t* x, const uint16_t* packed, const float* bias, const float* residual, float* y, int64_t m,
                    int64_t k2, int64_t n) {
    (void)x; (void)packed; (void)bias; (void)residual; (void)y; (void)m; (void)k2; (void)n;
}
void int4_group_sums(const uint16_t* x, float* sums, int64_t m, int64_t k, int64_t group_size) {
    (void)x; (void)sums; (void)m; (void)k; (void)group_size;
}
void round_rows_to_bf16(const float* x, uint16_t* out, int64_t rows, int64_t k, int64_t out_k) {
    (void)x; (void)out; (void)rows; (void)k; (void)out_k;
}
void linear_int4_bf16dot(const uint32_t* x, const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros,
                         const float* xsums, const float* bias, float* y, int64_t m, int64_t k2, int64_t n,
                         int64_t pairs_per_group) {
    (void)x; (void)codes; (void)scales; (void)zeros; (void)xsums; (void)bias; (void)y; (void)m; (void)k2; (void)n;
    (void)pairs_per_group;
}
#endif
