/* Row-invariant linear products for decoding and verification (knapspec).
 *
 * out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for an (M, K) input and an (N, K) weight,
 * the layout of torch.nn.Linear, float32 or bfloat16 with float32 accumulation.
 *
 * Every output element is computed by the same code in the same order whatever M is: its
 * products are accumulated in ACCUMULATORS vectors of LANES lanes (chunk c of LANES
 * consecutive k goes to accumulator c % ACCUMULATORS, lane k % LANES), the accumulators
 * are added in a fixed order, the lanes summed by a fixed tree, then the bias added. Rows
 * never share arithmetic: a row's result is a function of that row and the weight alone,
 * so a one-token decode step and a k-token verification agree bitwise by construction
 * (what BLAS does not promise: it picks its blocking, and so its summation order, from M).
 *
 * Speed: each thread takes a block of outputs and walks it MAX_COLS weight rows at a time;
 * every input row passes over those rows while they sit in L1, so the weight is read from
 * memory once and a product of a few rows costs little more than one row (the weight
 * stream dominates). Each tile prefetches the weight rows PREFETCH_ROWS ahead, so the
 * stream from memory runs alongside the arithmetic instead of between it (measured on a
 * 2-core AMD EPYC Zen 4, bfloat16, SmolLM2's 30 layers of products with weights cold:
 * 24.0 -> 18.2 ms at 16 rows, 18.4 -> 13.8 at 8, 15.7 -> 13.6 at 4, level at 1).
 * Threads split the outputs, never a dot product. Where the compiler targets AVX512-BF16,
 * bfloat16 products run on VDPBF16PS (two products per lane and instruction); elsewhere
 * bfloat16 is widened to float32 and multiplied with FMA. Either way one build runs one
 * code path for every row count.
 *
 * Plain C with GCC/Clang vector extensions and, where available, <immintrin.h>; called
 * through ctypes, which releases the GIL.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#include "bfloat16.h"

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vreg;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(acc, a, b) _mm512_fmadd_ps(a, b, acc)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX__) && defined(__FMA__)
#define LANES 8
typedef __m256 vreg;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(acc, a, b) _mm256_fmadd_ps(a, b, acc)
#define VADD(a, b) _mm256_add_ps(a, b)
#else
/* Portable: GCC vector extensions, built with -ffp-contract=off so a*b+c stays two
 * roundings in every instantiation. */
#define LANES 8
typedef float vreg __attribute__((vector_size(LANES * sizeof(float))));
static inline vreg vzero_(void) { vreg v = {0}; return v; }
static inline vreg vload_(const float *p) { vreg v; memcpy(&v, p, sizeof v); return v; }
#define VZERO() vzero_()
#define VLOAD(p) vload_(p)
#define VFMA(acc, a, b) ((acc) + (a) * (b))
#define VADD(a, b) ((a) + (b))
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* The k a bfloat16 chunk covers: 2*LANES on VDPBF16PS (two products per lane), else LANES. */
#define BF16_CHUNK (HAVE_DPBF16 ? 2 * LANES : LANES)

/* Output tile: up to 4 rows by up to 8 outputs, one accumulator per output element. */
#define MAX_ROWS 4
#define MAX_COLS 8
/* Weight rows ahead that a tile prefetches: the next column group's. */
#define PREFETCH_ROWS MAX_COLS

/* The lanes of v summed by a fixed tree (halves, then quarters, ...). */
static inline float lane_sum(vreg v) {
#if defined(__AVX512F__)
    /* GCC's and Clang's reduction: 256-bit halves, 128-bit halves, then pairs, then the
     * last two: the same tree as the loop below, in shuffles. */
    return _mm512_reduce_add_ps(v);
#endif
    float lanes[LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] = lanes[i] + lanes[i + width];
    return lanes[0];
}

/* LANES bfloat16 values widened to float32 (exactly: bf16 is the top half of a float). */
static inline vreg load_bf16_widened(const uint16_t *p) {
    float wide[LANES];
    for (int i = 0; i < LANES; i++) wide[i] = bf16_to_f32(p[i]);
    return VLOAD(wide);
}

/* One tile: rows x cols dot products of length k, each accumulated chunk by chunk in k
 * order into its own accumulator, then lane-summed. Instantiated with constant rows/cols
 * (always inlined), so the accumulators live in registers; every instantiation does the
 * same arithmetic per element, which is what makes the result row-invariant. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_stride,
                                                           const float *w, int64_t k,
                                                           int rows, int cols,
                                                           float sums[MAX_ROWS][MAX_COLS]) {
    vreg acc[MAX_ROWS][MAX_COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = VZERO();
    for (int64_t i = 0; i < k; i += LANES) {
        vreg xv[MAX_ROWS];
        for (int r = 0; r < rows; r++) xv[r] = VLOAD(x + r * x_stride + i);
        for (int c = 0; c < cols; c++) {
            _mm_prefetch((const char *)(w + (c + PREFETCH_ROWS) * k + i), _MM_HINT_T0);
            vreg wv = VLOAD(w + c * k + i);
            for (int r = 0; r < rows; r++) acc[r][c] = VFMA(acc[r][c], xv[r], wv);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) sums[r][c] = lane_sum(acc[r][c]);
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x,
                                                            int64_t x_stride,
                                                            const uint16_t *w, int64_t k,
                                                            int rows, int cols,
                                                            float sums[MAX_ROWS][MAX_COLS]) {
#if HAVE_DPBF16
    __m512 acc[MAX_ROWS][MAX_COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 2 * LANES) {
        __m512bh xv[MAX_ROWS];
        for (int r = 0; r < rows; r++)
            xv[r] = (__m512bh)_mm512_loadu_si512((const void *)(x + r * x_stride + i));
        for (int c = 0; c < cols; c++) {
            _mm_prefetch((const char *)(w + (c + PREFETCH_ROWS) * k + i), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + c * k + i));
            for (int r = 0; r < rows; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) sums[r][c] = lane_sum(acc[r][c]);
#else
    vreg acc[MAX_ROWS][MAX_COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = VZERO();
    for (int64_t i = 0; i < k; i += LANES) {
        vreg xv[MAX_ROWS];
        for (int r = 0; r < rows; r++) xv[r] = load_bf16_widened(x + r * x_stride + i);
        for (int c = 0; c < cols; c++) {
            _mm_prefetch((const char *)(w + (c + PREFETCH_ROWS) * k + i), _MM_HINT_T0);
            vreg wv = load_bf16_widened(w + c * k + i);
            for (int r = 0; r < rows; r++) acc[r][c] = VFMA(acc[r][c], xv[r], wv);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) sums[r][c] = lane_sum(acc[r][c]);
#endif
}

/* The tile shapes used: 4x4 and 2x8 where the rows allow (about 16 accumulators, the
 * weight loads shared by the rows), 1x8 for a single row; narrower at the outputs' end. */
#define CASE(R, C) \
    case (R) * 16 + (C): \
        if (dtype == DTYPE_F32) tile_f32((const float *)x, x_stride, (const float *)w, k, R, C, sums); \
        else tile_bf16((const uint16_t *)x, x_stride, (const uint16_t *)w, k, R, C, sums); \
        break;
#define CASES(R) CASE(R, 1) CASE(R, 2) CASE(R, 3) CASE(R, 4) CASE(R, 5) CASE(R, 6) CASE(R, 7) CASE(R, 8)

static void run_tile(const void *x, int64_t x_stride, const void *w, int64_t k, int rows,
                     int cols, int dtype, float sums[MAX_ROWS][MAX_COLS]) {
    switch (rows * 16 + cols) {
        CASES(1)
        CASES(2)
        CASES(3)
        CASES(4)
        default: break;
    }
}

/* sums (rows x cols) + bias into out at (m, n), rounded to out's dtype. */
static inline void store_tile(void *out, int64_t out_stride, const void *bias, int64_t m,
                              int64_t n, int rows, int cols, int dtype,
                              float sums[MAX_ROWS][MAX_COLS]) {
    for (int r = 0; r < rows; r++) {
        if (dtype == DTYPE_F32) {
            float *target = (float *)out + (m + r) * out_stride + n;
            for (int c = 0; c < cols; c++)
                target[c] = bias ? sums[r][c] + ((const float *)bias)[n + c] : sums[r][c];
        } else {
            uint16_t *target = (uint16_t *)out + (m + r) * out_stride + n;
            for (int c = 0; c < cols; c++) {
                float value = sums[r][c];
                if (bias) value += bf16_to_f32(((const uint16_t *)bias)[n + c]);
                target[c] = f32_to_bf16(value);
            }
        }
    }
}

/* Bytes of output weight rows per thread block (the split changes no arithmetic). */
#define BLOCK_BYTES (192 * 1024)

/* The k a row must be padded to (with zeros, which change no sum but a zero's sign). */
int64_t knapspec_row_linear_chunk(int dtype) { return dtype == DTYPE_BF16 ? BF16_CHUNK : LANES; }

/* What this build computes with: LANES * 10 + 1 where bfloat16 runs on VDPBF16PS. */
int knapspec_row_linear_build(void) { return LANES * 10 + HAVE_DPBF16; }

/* out (M x N, row stride out_stride) = x (M x k, row stride x_stride) @ w.T (+ bias), w
 * (N x k) contiguous, k a multiple of knapspec_row_linear_chunk(dtype) (the caller pads
 * both with zeros). dtype: 0 float32, 1 bfloat16 (x, w, bias and out alike). Returns 0, or 1
 * for an unknown dtype or a k that is not a multiple of the chunk. */
int knapspec_row_linear(const void *x, const void *w, const void *bias, void *out,
                        int64_t rows, int64_t k, int64_t n_out, int64_t x_stride,
                        int64_t out_stride, int dtype, int threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    if (k % knapspec_row_linear_chunk(dtype) != 0) return 1;
    size_t element = dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    /* Blocks of outputs sized to stay in cache, their count a multiple of the threads so
     * that none idles (the split changes no element's arithmetic). */
    if (threads < 1) threads = 1;
    int64_t block = BLOCK_BYTES / (k * (int64_t)element);
    if (block < MAX_COLS) block = MAX_COLS;
    int64_t blocks = (n_out + block - 1) / block;
    blocks = (blocks + threads - 1) / threads * threads;
    block = (n_out + blocks - 1) / blocks;
    block = (block + MAX_COLS - 1) / MAX_COLS * MAX_COLS;
    blocks = (n_out + block - 1) / block;
    if (threads > blocks) threads = (int)blocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t first = b * block;
        int64_t last = first + block < n_out ? first + block : n_out;
        /* MAX_COLS weight rows at a time, every input row passing over them while they
         * sit in L1: the weight streams from memory once, alongside the arithmetic
         * (passing all of a block's weight per row tile left the memory idle while the
         * later tiles computed). The tiles and so each element's arithmetic are as ever. */
        for (int64_t n = first; n < last; n += MAX_COLS) {
            for (int64_t m = 0; m < rows;) {
                int tile_rows = rows - m >= 4 ? 4 : (int)(rows - m);
                if (tile_rows == 3) tile_rows = 2; /* 3 rows as 2 + 1: same arithmetic per row */
                int width = tile_rows >= 4 ? 4 : MAX_COLS;
                const unsigned char *x_rows = (const unsigned char *)x + m * x_stride * element;
                int64_t group_end = n + MAX_COLS < last ? n + MAX_COLS : last;
                for (int64_t c0 = n; c0 < group_end; c0 += width) {
                    int cols = (int)(group_end - c0 < width ? group_end - c0 : width);
                    float sums[MAX_ROWS][MAX_COLS];
                    run_tile(x_rows, x_stride, (const unsigned char *)w + c0 * k * element, k,
                             tile_rows, cols, dtype, sums);
                    store_tile(out, out_stride, bias, m, c0, tile_rows, cols, dtype, sums);
                }
                m += tile_rows;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * Packed bfloat16 (AVX512-BF16): the same contract with the weight in VNNI order.
 *
 * The weight is packed once by the caller exactly as for the AMX tiles below:
 * packed[n_tile][pair][n][2], 16 outputs by one pair of consecutive k in one 64-byte vector
 * (the AMX layout [n_tile][k_tile][pair][n][2] flattened, k padded to 32). Each output element
 * has one float32 accumulator lane; VDPBF16PS adds the products of pair 0, 1, 2, ... in
 * increasing order, the input pair broadcast to all 16 lanes. No lane sums, no chunk
 * accumulators: an element's arithmetic is that chain, then the bias, whatever the tile
 * shape or row count, so rows are invariant by construction as above. Against the kernel
 * above it saves the horizontal sums (16 per tile, a third of the work at k = 576) and reads
 * the weight as contiguous vectors; measured on a 2-core AMD EPYC Zen 4, bfloat16, 2 threads:
 * SmolLM2's 1536x576 product 20 -> 16 us at 1 row, 111 -> 78 at 16, 3.3 -> 2.3 ms at 512;
 * its 49152x576 LM head 2.0 -> 1.2 ms at 1 row.
 */
#if HAVE_DPBF16
/* Output tiles of up to 16 rows: 8 groups of 16 outputs at 1-2 rows, 4 at 3-4, 3 at 5-8,
 * 1 at 9-16. A tile of many rows uses each weight vector for all of them as it streams in
 * from memory (the weights of a decode round do not fit the caches), where 4-row tiles had
 * read a block from memory for their first rows, then again from L2 for the others, the
 * memory stream and the arithmetic one after the other. Measured on a 2-core AMD EPYC
 * Zen 4 (bf16, 2 threads, SmolLM2's 30 layers of products plus its LM head with distinct
 * weights, as a round reads them): 16.7 -> 15.2 ms at 16 rows, 11.6 -> 10.4 at 8, level at
 * 1 and 4 (8.7, 9.4); in cache level or faster at every row count up to 1,024. */
#define PACKED_ROWS 16
#define PACKED_COLS 8
/* Pairs ahead that each weight stream prefetches: 8 (512 bytes) in tiles of up to 4 rows,
 * 64 in taller ones, which spend longer on each vector. */
#define PACKED_PREFETCH 8
#define PACKED_PREFETCH_TALL 64
/* Groups of 16 outputs a thread's block holds at most (its weight stays in L2 while
 * every row tile passes over it). */
#define PACKED_BLOCK_TILES 16

static inline int packed_cols_for(int rows) {
    return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 8 ? 3 : 1;
}

/* acc[r * cols + c]: row r, group c. */
static inline __attribute__((always_inline)) void packed_tile(
    const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t pairs, const int rows,
    const int cols, __m512 *acc) {
    for (int i = 0; i < rows * cols; i++) acc[i] = _mm512_setzero_ps();
    const int64_t tile_stride = pairs * 32; /* bf16 per group of 16 outputs */
    const int64_t ahead = (rows > 4 ? PACKED_PREFETCH_TALL : PACKED_PREFETCH) * 32;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[PACKED_COLS];
        for (int c = 0; c < cols; c++) {
            const uint16_t *wp = w + c * tile_stride + p * 32;
            _mm_prefetch((const char *)(wp + ahead), _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_loadu_si512((const void *)wp);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < cols; c++)
                acc[r * cols + c] = _mm512_dpbf16_ps(acc[r * cols + c], xv, wv[c]);
        }
    }
}

#define PCASE(R, C) \
    case (R) * 16 + (C): packed_tile(x, x_stride, w, pairs, R, C, acc); break;
#define PC8(R) PCASE(R, 1) PCASE(R, 2) PCASE(R, 3) PCASE(R, 4) PCASE(R, 5) PCASE(R, 6) PCASE(R, 7) PCASE(R, 8)
#define PC4(R) PCASE(R, 1) PCASE(R, 2) PCASE(R, 3) PCASE(R, 4)
#define PC3(R) PCASE(R, 1) PCASE(R, 2) PCASE(R, 3)

static void run_packed_tile(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                            int64_t pairs, int rows, int cols, __m512 *acc) {
    switch (rows * 16 + cols) {
        PC8(1) PC8(2) PC4(3) PC4(4) PC3(5) PC3(6) PC3(7) PC3(8)
        PCASE(9, 1) PCASE(10, 1) PCASE(11, 1) PCASE(12, 1) PCASE(13, 1) PCASE(14, 1)
        PCASE(15, 1) PCASE(16, 1)
        default: break;
    }
}

int knapspec_packed_available(void) { return 1; }

/* out (M x N, row stride out_stride) = x (M x k, row stride x_stride) @ W.T (+ bias), all
 * bfloat16, W packed as above with ceil(N / 16) groups and k a multiple of 32 (x padded with
 * zeros to it). Returns 0, or 1 for a k that is not a multiple of 32. */
int knapspec_packed_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                           uint16_t *out, int64_t rows, int64_t k, int64_t n_out,
                           int64_t x_stride, int64_t out_stride, int threads) {
    if (k % 32 != 0) return 1;
    int64_t pairs = k / 2;
    int64_t n_tiles = (n_out + 15) / 16;
    if (threads < 1) threads = 1;
    /* Blocks of at most PACKED_BLOCK_TILES groups, their count a multiple of the threads so
     * that none idles (the split changes no element's arithmetic). */
    int64_t blocks = (n_tiles + PACKED_BLOCK_TILES - 1) / PACKED_BLOCK_TILES;
    blocks = (blocks + threads - 1) / threads * threads;
    int64_t per_block = (n_tiles + blocks - 1) / blocks;
    blocks = (n_tiles + per_block - 1) / per_block;
    if (threads > blocks) threads = (int)blocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t first = b * per_block;
        int64_t count = n_tiles - first < per_block ? n_tiles - first : per_block;
        for (int64_t m = 0; m < rows;) {
            int tile_rows = rows - m >= PACKED_ROWS ? PACKED_ROWS : (int)(rows - m);
            int width = packed_cols_for(tile_rows);
            for (int64_t c0 = 0; c0 < count;) {
                int cols = (int)(count - c0 < width ? count - c0 : width);
                __m512 acc[PACKED_ROWS * 3]; /* rows x cols is at most 24 */
                run_packed_tile(x + m * x_stride, x_stride, packed + (first + c0) * pairs * 32,
                                pairs, tile_rows, cols, acc);
                for (int r = 0; r < tile_rows; r++) {
                    for (int c = 0; c < cols; c++) {
                        float sums[16];
                        _mm512_storeu_ps(sums, acc[r * cols + c]);
                        int64_t n0 = (first + c0 + c) * 16;
                        int64_t width_out = n_out - n0 < 16 ? n_out - n0 : 16;
                        uint16_t *target = out + (m + r) * out_stride + n0;
                        for (int64_t j = 0; j < width_out; j++) {
                            float value = sums[j];
                            if (bias) value += bf16_to_f32(bias[n0 + j]);
                            target[j] = f32_to_bf16(value);
                        }
                    }
                }
                c0 += cols;
            }
            m += tile_rows;
        }
    }
    return 0;
}
#else
int knapspec_packed_available(void) { return 0; }
int knapspec_packed_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                           uint16_t *out, int64_t rows, int64_t k, int64_t n_out,
                           int64_t x_stride, int64_t out_stride, int threads) {
    (void)x; (void)packed; (void)bias; (void)out; (void)rows; (void)k; (void)n_out;
    (void)x_stride; (void)out_stride; (void)threads;
    return 2;
}
#endif

/* ---------------------------------------------------------------------------------------
 * AMX tiles (bfloat16): the same contract on Intel's matrix unit.
 *
 * TDPBF16PS adds to each element of a 16x16 float32 tile the dot product of one row of A
 * (32 bf16) and one column of B, element by element: a row's result never depends on the
 * other rows of the tile. Every product runs as 16-row tiles (rows past M zero-padded), the
 * k tiles in increasing order into one accumulator tile per 16 outputs, so a row's result
 * is the same whatever M is, and a few-row product costs what one row costs (the weight is
 * streamed once per 16 rows). The weight is packed once by the caller into tiles of 32 k
 * by 16 outputs in VNNI order: packed[n_tile][k_tile][pair][n][2] (1 KiB per tile).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdlib.h>

#include "amx_tiles.h"

#define AMX_GROUP 4 /* accumulator tiles per pass: 64 outputs */

/* Tiles 0..count-1 accumulate outputs n_tile .. n_tile+count-1 of one 16-row block. */
#define AMX_STEP(T)                                                                   \
    if (count > T) {                                                                  \
        _tile_loadd(5, packed + ((n_tile + T) * k_tiles + kt) * 512, 64);             \
        _tile_dpbf16ps(T, 4, 5);                                                      \
    }
#define AMX_STORE(T) \
    if (count > T) _tile_stored(T, result + T * 16, AMX_GROUP * 16 * sizeof(float));

static void amx_block(const uint16_t *a_rows, int64_t k_tiles, const uint16_t *packed,
                      int64_t n_tile, int count, float *result) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        _tile_loadd(4, a_rows + kt * 32, k_tiles * 32 * sizeof(uint16_t));
        AMX_STEP(0)
        AMX_STEP(1)
        AMX_STEP(2)
        AMX_STEP(3)
    }
    AMX_STORE(0)
    AMX_STORE(1)
    AMX_STORE(2)
    AMX_STORE(3)
}

int knapspec_amx_available(void) { return amx_permitted(); }

/* out (M x N, row stride out_stride) = x (M x k, row stride x_stride) @ W.T (+ bias), all
 * bfloat16, W given packed (see above) with n_tiles = ceil(N / 16) and k a multiple of 32.
 * Returns 0; 2 where the OS refuses the tiles; 4 when memory runs out. */
int knapspec_amx_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *out, int64_t rows, int64_t k, int64_t n_out,
                        int64_t x_stride, int64_t out_stride, int threads) {
    if (!amx_permitted()) return 2;
    if (k % 32 != 0) return 1;
    int64_t k_tiles = k / 32;
    int64_t n_tiles = (n_out + 15) / 16;
    int64_t row_blocks = (rows + 15) / 16;
    /* The rows, zero-padded to whole 16-row blocks, contiguous (the A tiles' source). */
    uint16_t *a = (uint16_t *)calloc((size_t)(row_blocks * 16 * k), sizeof(uint16_t));
    if (a == NULL) return 4;
    for (int64_t m = 0; m < rows; m++) memcpy(a + m * k, x + m * x_stride, k * sizeof(uint16_t));
    int64_t groups = (n_tiles + AMX_GROUP - 1) / AMX_GROUP;
    int64_t tasks = groups * row_blocks;
    if (threads > tasks) threads = (int)tasks;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
        float result[16 * AMX_GROUP * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t group = task / row_blocks, block = task % row_blocks;
            int64_t n_tile = group * AMX_GROUP;
            int count = (int)(n_tiles - n_tile < AMX_GROUP ? n_tiles - n_tile : AMX_GROUP);
            amx_block(a + block * 16 * k, k_tiles, packed, n_tile, count, result);
            int64_t first_row = block * 16;
            int64_t last_row = first_row + 16 < rows ? first_row + 16 : rows;
            int64_t first = n_tile * 16;
            int64_t last = first + count * 16 < n_out ? first + count * 16 : n_out;
            for (int64_t m = first_row; m < last_row; m++) {
                float *sums = result + (m - first_row) * AMX_GROUP * 16;
                uint16_t *target = out + m * out_stride + first;
                int64_t width = last - first;
                if (bias)
                    for (int64_t j = 0; j < width; j++) sums[j] += bf16_to_f32(bias[first + j]);
                /* Round to nearest even, NaN kept quiet: plain integer code the compiler
                 * vectorises (the same arithmetic for every element). */
                for (int64_t j = 0; j < width; j++) {
                    uint32_t bits;
                    memcpy(&bits, &sums[j], sizeof bits);
                    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
                    uint32_t quiet = (bits >> 16) | 0x40u;
                    target[j] = (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
                }
            }
        }
        _tile_release();
    }
    free(a);
    return 0;
}
#else
int knapspec_amx_available(void) { return 0; }
int knapspec_amx_linear(const uint16_t *x, const uint16_t *packed, const uint16_t *bias,
                        uint16_t *out, int64_t rows, int64_t k, int64_t n_out,
                        int64_t x_stride, int64_t out_stride, int threads) {
    (void)x; (void)packed; (void)bias; (void)out; (void)rows; (void)k; (void)n_out;
    (void)x_stride; (void)out_stride; (void)threads;
    return 2;
}
#endif
