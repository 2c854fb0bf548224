/* Row-invariant attention for decoding and verification (knapspec).
 *
 * Every query row is computed by the same code in the same order whatever other rows are
 * in the call: its scores over keys 0 .. length-1 (key j in lane j % 16 of a 16-key block,
 * its products summed in dimension order), the maximum, exp by one polynomial, the
 * normaliser summed in 16 fixed lanes then a fixed tree, and the values accumulated in key
 * order. A row's output therefore depends only on its query, its keys/values and its
 * length, never on how many rows ride along: a one-token decode step and a k-token
 * verification give bitwise equal outputs at the same position.
 *
 * Tree mode (knapspec_attend_tree): row r sees keys 0 .. prefix[r]-1 and, of the keys
 * prefix[r] + t (t < 64), those whose bit t is set in visible[r]. It computes bitwise what
 * the contiguous path computes for a row whose keys are exactly those, laid out one after
 * the other (what the cache holds once the accepted path of a token tree is compacted):
 * scores are per key, so the row's scores are packed in place before the softmax, and the
 * visible tree keys' values are accumulated after the prefix's in increasing t, run by run
 * of consecutive visible keys (the same FMA sequence as in key order over the packed
 * layout: splitting an accumulation into calls changes no bit).
 *
 * Plain C with GCC/Clang vector extensions (no torch headers: it compiles in about a
 * second); called through ctypes, which releases the GIL. Threads split rows, never one row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

/* One hardware vector of floats: the lane count is fixed per build, so every row of every
 * call on this machine runs the same arithmetic. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

/* What a call runs on: the vector path (any dtype), the AMX tiles or VDPBF16PS (bf16). */
enum { UNIT_VECTOR = 0, UNIT_AMX = 1, UNIT_DPBF16 = 2 };

/* One row of head_dim elements of either dtype, widened to float. */
static inline void load_row(const void *base, int64_t index, int dtype, int64_t head_dim,
                            float *out) {
    if (dtype == DTYPE_F32) {
        memcpy(out, (const float *)base + index, sizeof(float) * (size_t)head_dim);
    } else {
        const uint16_t *row = (const uint16_t *)base + index;
        for (int64_t d = 0; d < head_dim; d++) out[d] = bf16_to_f32(row[d]);
    }
}

/* mask ? a : b, lane by lane (mask lanes are all ones or all zeros). */
static inline vfloat pick_lanes(vint mask, vfloat a, vfloat b) {
    vint ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    vint picked = (ia & mask) | (ib & ~mask);
    vfloat result;
    memcpy(&result, &picked, sizeof result);
    return result;
}

/* exp(x) for x <= 0 (scores minus their maximum), 16 at a time: Cody-Waite reduction and a
 * degree-6 polynomial in plain vector arithmetic (about 2 ulp); below -87 the result is 0. */
static inline vfloat exp_nonpositive(vfloat x) {
    const vfloat zero = {0};
    vint keep = x >= -87.0f;
    x = pick_lanes(keep, x, zero - 87.0f);
    const vfloat shifter = zero + 12582912.0f; /* 1.5 * 2^23: round to nearest */
    vfloat n = (x * 1.44269504088896341f + shifter) - shifter;
    vfloat r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vfloat p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
    vfloat scale;
    memcpy(&scale, &bits, sizeof scale);
    return pick_lanes(keep, p * scale, zero);
}

#define VALUE_BLOCK 64
#define MAX_VECTORS 32

/* acc[0 .. dim) += sum over keys j (in order) of weights[j] * rows[j][0 .. dim): the
 * accumulator is held in VECTORS registers (dim = VECTORS * LANES). */
static inline __attribute__((always_inline)) void accumulate_fixed(
    float *acc, const float *weights, const float *rows, int64_t keys, int64_t dim,
    const int vectors) {
    vfloat a[MAX_VECTORS];
    for (int t = 0; t < vectors; t++) memcpy(&a[t], acc + t * LANES, sizeof(vfloat));
    for (int64_t j = 0; j < keys; j++) {
        const float weight = weights[j];
        const float *row = rows + j * dim;
        for (int t = 0; t < vectors; t++) {
            vfloat v;
            memcpy(&v, row + t * LANES, sizeof v);
            a[t] += weight * v;
        }
    }
    for (int t = 0; t < vectors; t++) memcpy(acc + t * LANES, &a[t], sizeof(vfloat));
}

static void accumulate_values(float *acc, const float *weights, const float *rows,
                              int64_t keys, int64_t dim) {
    switch (dim / LANES) {
        case 1: accumulate_fixed(acc, weights, rows, keys, dim, 1); break;
        case 2: accumulate_fixed(acc, weights, rows, keys, dim, 2); break;
        case 4: accumulate_fixed(acc, weights, rows, keys, dim, 4); break;
        case 8: accumulate_fixed(acc, weights, rows, keys, dim, 8); break;
        case 16: accumulate_fixed(acc, weights, rows, keys, dim, 16); break;
        default:
            for (int64_t j = 0; j < keys; j++)
                for (int64_t d = 0; d < dim; d++) acc[d] += weights[j] * rows[j * dim + d];
    }
}

/* The keys a tree row spans: its prefix and its tree keys up to the last visible one. */
static inline int64_t tree_span(int64_t prefix, uint64_t visible) {
    return prefix + (visible ? 64 - __builtin_clzll(visible) : 0);
}

/* The visible tree keys below prefix + t (t >= 0). */
static inline int64_t visible_below(uint64_t visible, int64_t t) {
    return t >= 64 ? __builtin_popcountll(visible)
                   : __builtin_popcountll(visible & ((UINT64_C(1) << t) - 1));
}

/* Move a tree row's visible tree scores down to prefix, prefix + 1, ... (in place: a
 * score only moves down) and return the packed length. */
static int64_t pack_tree_scores(float *s, int64_t prefix, uint64_t visible) {
    int64_t packed = prefix;
    for (int64_t t = 0; t < 64; t++)
        if ((visible >> t) & 1u) s[packed++] = s[prefix + t];
    return packed;
}

/* A tree row's values for the keys [block, block_end) it sees, in key order: its prefix
 * keys, then each run of consecutive visible tree keys (weights at their packed
 * positions). value_rows holds the block's keys, widened. */
static void accumulate_tree_block(float *acc, const float *s, const float *value_rows,
                                  int64_t prefix, uint64_t visible, int64_t block,
                                  int64_t block_end, int64_t span, int64_t dim) {
    int64_t end = prefix < block_end ? prefix : block_end;
    if (end > block) accumulate_values(acc, s + block, value_rows, end - block, dim);
    int64_t j = block > prefix ? block : prefix;
    int64_t stop = span < block_end ? span : block_end;
    int64_t packed = prefix + visible_below(visible, j - prefix);
    while (j < stop) {
        if (!((visible >> (j - prefix)) & 1u)) {
            j++;
            continue;
        }
        int64_t run = j + 1;
        while (run < stop && ((visible >> (run - prefix)) & 1u)) run++;
        accumulate_values(acc, s + packed, value_rows + (j - block) * dim, run - j, dim);
        packed += run - j;
        j = run;
    }
}

/* Rows [0, count) of one key/value head, in one pass over its keys so that each key and
 * value is loaded (and widened) once for all of them. With tree_prefix non-NULL (tree
 * mode), row r's keys are as described at the top; lengths[r] is then its tree_span, and
 * packed (count) receives the packed lengths. */
static void attend_task(const void *query, const void *keys, const void *values, void *out,
                        int dtype, const int64_t *lengths, const int64_t *tree_prefix,
                        const uint64_t *tree_visible, int64_t *packed, int64_t count,
                        int64_t head_dim,
                        int64_t key_stride, float scale, float *scores, float *acc,
                        float *row, float *qt, float *key_rows, float *value_rows,
                        int64_t padded_length) {
    /* Queries transposed to (head_dim, row_vectors * LANES), rows in lanes, zero-padded:
     * a row's score is one FMA chain over the dimensions in order, in whichever lane. */
    int64_t padded_dim = (head_dim + LANES - 1) / LANES * LANES;
    int64_t row_vectors = (count + LANES - 1) / LANES;
    int64_t longest = 0;
    memset(qt, 0, sizeof(float) * (size_t)(head_dim * row_vectors * LANES));
    for (int64_t r = 0; r < count; r++) {
        load_row(query, r * head_dim, dtype, head_dim, row);
        for (int64_t d = 0; d < head_dim; d++) qt[d * row_vectors * LANES + r] = row[d];
        if (lengths[r] > longest) longest = lengths[r];
    }
    /* Scores, 4 keys at a time (independent FMA chains). */
    for (int64_t j = 0; j < longest; j += 4) {
        int64_t keys_here = longest - j < 4 ? longest - j : 4;
        for (int64_t k = 0; k < 4; k++)
            load_row(keys, (j + (k < keys_here ? k : 0)) * key_stride, dtype, head_dim,
                     key_rows + k * head_dim);
        const float *k0 = key_rows, *k1 = key_rows + head_dim;
        const float *k2 = key_rows + 2 * head_dim, *k3 = key_rows + 3 * head_dim;
        for (int64_t v = 0; v < row_vectors; v++) {
            vfloat a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t d = 0; d < head_dim; d++) {
                vfloat q;
                memcpy(&q, qt + (d * row_vectors + v) * LANES, sizeof q);
                a0 += q * k0[d];
                a1 += q * k1[d];
                a2 += q * k2[d];
                a3 += q * k3[d];
            }
            float lanes[4][LANES];
            memcpy(lanes[0], &a0, sizeof a0);
            memcpy(lanes[1], &a1, sizeof a1);
            memcpy(lanes[2], &a2, sizeof a2);
            memcpy(lanes[3], &a3, sizeof a3);
            for (int64_t l = 0; l < LANES && v * LANES + l < count; l++) {
                float *s = scores + (v * LANES + l) * padded_length + j;
                for (int64_t k = 0; k < keys_here; k++) s[k] = lanes[k][l] * scale;
            }
        }
    }
    /* Tree rows: from here on a row's length is its packed length (the key count of the
     * equivalent contiguous row); contiguous rows keep theirs. */
    const int64_t *row_length = lengths;
    if (tree_prefix) {
        for (int64_t r = 0; r < count; r++)
            packed[r] =
                pack_tree_scores(scores + r * padded_length, tree_prefix[r], tree_visible[r]);
        row_length = packed;
    }
    /* Softmax weights, 16 lanes at a time; lanes past the row's length become 0. */
    for (int64_t r = 0; r < count; r++) {
        float *s = scores + r * padded_length;
        int64_t length = row_length[r];
        int64_t blocks = (length + LANES - 1) / LANES;
        for (int64_t j = length; j < blocks * LANES; j++) s[j] = -INFINITY;
        float best = -INFINITY;
        for (int64_t j = 0; j < length; j++) best = s[j] > best ? s[j] : best;
        for (int64_t b = 0; b < blocks; b++) {
            vfloat v;
            memcpy(&v, s + b * LANES, sizeof v);
            v = exp_nonpositive(v - best);
            memcpy(s + b * LANES, &v, sizeof v);
        }
    }
    /* Values in key order, in blocks of VALUE_BLOCK keys: a row's accumulator stays in
     * registers over a block (same order as one key at a time). */
    for (int64_t r = 0; r < count; r++)
        for (int64_t d = 0; d < padded_dim; d++) acc[r * padded_dim + d] = 0.0f;
    for (int64_t block = 0; block < longest; block += VALUE_BLOCK) {
        int64_t block_end = longest - block < VALUE_BLOCK ? longest : block + VALUE_BLOCK;
        for (int64_t j = block; j < block_end; j++)
            load_row(values, j * key_stride, dtype, head_dim,
                     value_rows + (j - block) * padded_dim);
        for (int64_t r = 0; r < count; r++) {
            if (tree_prefix) {
                accumulate_tree_block(acc + r * padded_dim, scores + r * padded_length,
                                      value_rows, tree_prefix[r], tree_visible[r], block,
                                      block_end, lengths[r], padded_dim);
                continue;
            }
            int64_t end = lengths[r] < block_end ? lengths[r] : block_end;
            if (end <= block) continue;
            accumulate_values(acc + r * padded_dim, scores + r * padded_length + block,
                              value_rows, end - block, padded_dim);
        }
    }
    for (int64_t r = 0; r < count; r++) {
        const float *s = scores + r * padded_length;
        int64_t blocks = (row_length[r] + LANES - 1) / LANES;
        vfloat lanes = {0};
        for (int64_t b = 0; b < blocks; b++) {
            vfloat v;
            memcpy(&v, s + b * LANES, sizeof v);
            lanes += v;
        }
        float part[LANES];
        memcpy(part, &lanes, sizeof part);
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) part[l] += part[l + width];
        float inverse = part[0] > 0.0f ? 1.0f / part[0] : 0.0f;
        for (int64_t d = 0; d < head_dim; d++) {
            float value = acc[r * padded_dim + d] * inverse;
            if (dtype == DTYPE_F32)
                ((float *)out)[r * head_dim + d] = value;
            else
                ((uint16_t *)out)[r * head_dim + d] = f32_to_bf16(value);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * AMX tiles (bfloat16): the same contract on Intel's matrix unit, used for every bf16 call
 * on a CPU whose OS grants the tiles (the caller decides once per process, so a decode
 * step, a verification, a tree and a chunk of a prefill all run this arithmetic).
 *
 * Per row, in this order (whatever other rows share its 16-row tile):
 *   score_j = (q . k_j by TDPBF16PS, dimensions in 32-wide tiles in order) * scale;
 *   best = max over its keys; p_j = bf16(exp(score_j - best)), 0 past its length;
 *   norm = the p_j summed in 16 lanes (key j in lane j % 16) then a fixed tree;
 *   acc = sum of p_j v_j by TDPBF16PS over 32-key blocks in key order; out = acc / norm.
 * TDPBF16PS computes each element of its tile from one row of A and one column of B, so a
 * row's result never depends on the other rows; keys a row cannot see add exact zeros (its
 * weights there are 0). Scores are per key, so a tree row's scores pack exactly as in the
 * vector path; its values are read in the packed layout (its own copy of the last blocks).
 * Keys and values are repacked per call into the tiles' layout (K^T in VNNI pairs of
 * dimensions, V in VNNI pairs of keys); a 16-row tile costs what one row costs, so a
 * 64-query prefill chunk runs at matrix-unit speed and a one-token step stays cheap.
 * ------------------------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KNAPSPEC_BF16_UNITS 1
#define AMX_MAX_DIM 128 /* up to 4 dimension tiles for the scores, 8 value tiles */

/* Sixteen rows of 16 dwords, transposed in registers (out[c] = dword c of every row). */
static inline void transpose16(const __m512i in[16], __m512i out[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j]: in each 128-bit lane L, dword 4L + j */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        __m512i b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        out[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        out[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
        out[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

/* K^T for keys [0, count) in tiles of 16 keys by 32 dimensions, VNNI pairs of dimensions:
 * packed[block][dim_tile][pair][key][2] (1 KiB a tile); missing keys and dimensions 0. */
static void vnni_pack_keys(const uint16_t *keys, int64_t key_stride, int64_t count,
                          int64_t head_dim, int64_t dim_tiles, uint16_t *packed) {
    int64_t blocks = (count + 15) / 16;
    __m512i rows[16], columns[16];
    for (int64_t b = 0; b < blocks; b++) {
        int64_t here = count - b * 16 < 16 ? count - b * 16 : 16;
        const uint16_t *base = keys + b * 16 * key_stride;
        for (int64_t t = 0; t < dim_tiles; t++) {
            int64_t pairs = (head_dim - t * 32) / 2 < 16 ? (head_dim - t * 32) / 2 : 16;
            __mmask16 dims = (__mmask16)((1u << pairs) - 1u);
            for (int64_t n = 0; n < 16; n++)
                rows[n] = n < here ? _mm512_maskz_loadu_epi32(dims, base + n * key_stride + t * 32)
                                   : _mm512_setzero_si512();
            transpose16(rows, columns);
            uint16_t *tile = packed + (b * dim_tiles + t) * 512;
            for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(tile + p * 32, columns[p]);
        }
    }
}

/* V for keys [0, count) in tiles of 32 keys by 16 dimensions, VNNI pairs of keys:
 * packed[block][dim_tile][pair][dim][2]; missing keys and dimensions 0. rows[j] gives
 * key j's row (NULL: key j sits at values + j * key_stride). */
static void vnni_pack_values(const uint16_t *values, int64_t key_stride, const int64_t *rows,
                            int64_t first, int64_t count, int64_t head_dim,
                            int64_t value_tiles, uint16_t *packed) {
    int64_t blocks = (count - first + 31) / 32;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t t = 0; t < value_tiles; t++) {
            int64_t dims = head_dim - t * 16 < 16 ? head_dim - t * 16 : 16;
            __mmask16 valid = (__mmask16)((1u << dims) - 1u);
            uint32_t *tile = (uint32_t *)(packed + (b * value_tiles + t) * 512);
            for (int64_t i = 0; i < 16; i++) {
                int64_t j = first + b * 32 + 2 * i;
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
                if (j < count) {
                    const uint16_t *row = values + (rows ? rows[j] : j) * key_stride + t * 16;
                    even = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, row));
                }
                if (j + 1 < count) {
                    const uint16_t *row =
                        values + (rows ? rows[j + 1] : j + 1) * key_stride + t * 16;
                    odd = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, row));
                }
                _mm512_storeu_si512(tile + i * 16, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
            }
        }
}

/* Scratch per thread for the bf16-unit paths (tiles, VDPBF16PS), sized for max_length keys. */
typedef struct {
    uint16_t *key_tiles, *value_tiles, *tail_tiles, *queries, *p;
    float *scores, *acc, *tail_acc, *inverse;
    int64_t *tail_rows;
} bf16_scratch;

static int bf16_scratch_alloc(bf16_scratch *s, int64_t max_length, int64_t head_dim) {
    int64_t padded = (max_length + 31) / 32 * 32;
    int64_t dim_tiles = (head_dim + 31) / 32, value_tiles = (head_dim + 15) / 16;
    memset(s, 0, sizeof *s);
    s->key_tiles = aligned_alloc(64, (size_t)(padded / 16 * dim_tiles * 1024));
    s->value_tiles = aligned_alloc(64, (size_t)(padded / 32 * value_tiles * 1024));
    s->tail_tiles = aligned_alloc(64, (size_t)(4 * value_tiles * 1024)); /* <= 128 keys */
    s->queries = aligned_alloc(64, (size_t)(16 * dim_tiles * 64));
    s->p = aligned_alloc(64, (size_t)(16 * padded * 2));
    s->scores = aligned_alloc(64, (size_t)(16 * padded * 4));
    s->acc = aligned_alloc(64, (size_t)(16 * value_tiles * 64));
    s->tail_acc = aligned_alloc(64, (size_t)(16 * value_tiles * 64));
    s->inverse = malloc(16 * sizeof(float));
    s->tail_rows = malloc(sizeof(int64_t) * (size_t)(padded + 128));
    return s->key_tiles && s->value_tiles && s->tail_tiles && s->queries && s->p &&
           s->scores && s->acc && s->tail_acc && s->inverse && s->tail_rows;
}

static void bf16_scratch_free(bf16_scratch *s) {
    free(s->key_tiles);
    free(s->value_tiles);
    free(s->tail_tiles);
    free(s->queries);
    free(s->p);
    free(s->scores);
    free(s->acc);
    free(s->tail_acc);
    free(s->inverse);
    free(s->tail_rows);
}

/* One row's softmax weights, as both bf16-unit paths compute them: the scores sc[0 ..
 * row_length) scaled, their maximum (exact in any order), p_j = bf16(exp(score_j - best)),
 * 0 from row_length up to p_length, and the normaliser summed from the rounded weights (as
 * P V uses them) in 16 lanes (key j in lane j % 16) then a fixed tree. sc must have room
 * for row_length rounded up to 16. Returns 1 / normaliser (0 for an empty row). */
static float bf16_weights(float *sc, int64_t row_length, float scale, uint16_t *p,
                          int64_t p_length) {
    int64_t vectors = (row_length + 15) / 16;
    for (int64_t j = row_length; j < vectors * 16; j++) sc[j] = -INFINITY;
    const __m512 scale_lanes = _mm512_set1_ps(scale);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t b = 0; b < vectors; b++) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc + b * 16), scale_lanes);
        _mm512_storeu_ps(sc + b * 16, v);
        top = _mm512_max_ps(top, v);
    }
    const float best = _mm512_reduce_max_ps(top);
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t b = 0; b < vectors; b++) {
        vfloat v;
        memcpy(&v, sc + b * 16, sizeof v);
        v = exp_nonpositive(v - best);
        __m256bh half = _mm512_cvtneps_pbh((__m512)v);
        _mm256_storeu_si256((__m256i *)(p + b * 16), (__m256i)half);
        lanes = _mm512_add_ps(lanes, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32((__m256i)half), 16)));
    }
    for (int64_t j = vectors * 16; j < p_length; j++) p[j] = 0;
    float part[16];
    _mm512_storeu_ps(part, lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; l++) part[l] += part[l + width];
    return part[0] > 0.0f ? 1.0f / part[0] : 0.0f;
}
/* ---------------------------------------------------------------------------------------
 * VDPBF16PS (AVX512-BF16 without tiles, e.g. AMD Zen 4): the same contract as the tiles,
 * on the vector unit's bf16 dot products. Per row, in this order (whatever other rows
 * share the call):
 *   score_j = VDPBF16PS over the dimension pairs of q and k_j in order (one fp32 lane per
 *             key, from zero), then * scale;
 *   weights and normaliser as bf16_weights computes them;
 *   acc = VDPBF16PS over the row's own key pairs (2i, 2i + 1) in key order, up to its
 *         length rounded up to a pair (the weight past the length is 0), one fp32 lane
 *         per dimension, from zero; out = bf16(acc / norm).
 * Each lane's chain reads only its row's query or weights, so blocking rows together
 * (DP_ROWS rows share each key and value load) changes no bit. Keys and values are packed
 * per call into VNNI pairs (the tiles' layout), once per K/V head and task.
 * ------------------------------------------------------------------------------------- */
#define DP_ROWS 4
#define DP_KEY_BLOCKS 4

static inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

static inline __m512i broadcast_pair(const uint16_t *at) {
    uint32_t pair;
    memcpy(&pair, at, sizeof pair);
    return _mm512_set1_epi32((int)pair);
}

/* The packed K^T vector of 16-key block kb, dimension pair P. */
static inline const uint16_t *key_pair_at(const uint16_t *key_tiles, int64_t dim_tiles,
                                          int64_t kb, int64_t P) {
    return key_tiles + (kb * dim_tiles + P / 16) * 512 + (P % 16) * 32;
}

/* The packed V vector of key pair I, 16-dimension tile t. */
static inline const uint16_t *value_pair_at(const uint16_t *value_tiles_at,
                                            int64_t value_tiles, int64_t I, int64_t t) {
    return value_tiles_at + ((I / 16) * value_tiles + t) * 512 + (I % 16) * 32;
}

/* Scores of rows [r0, r0 + nr) (nr <= DP_ROWS) over key blocks [kb, kb + nk) (nk <=
 * DP_KEY_BLOCKS); q: the rows' queries, q_stride uint16 apart; scores padded apart. */
static inline __attribute__((always_inline)) void dp_scores(
    const uint16_t *q, int64_t q_stride, const uint16_t *key_tiles, int64_t dim_tiles,
    int64_t pairs, int64_t kb, const int nr, const int nk, float *scores, int64_t padded) {
    __m512 a[DP_ROWS][DP_KEY_BLOCKS];
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nk; k++) a[i][k] = _mm512_setzero_ps();
    for (int64_t P = 0; P < pairs; P++) {
        __m512i key[DP_KEY_BLOCKS];
        for (int k = 0; k < nk; k++)
            key[k] = _mm512_loadu_si512(key_pair_at(key_tiles, dim_tiles, kb + k, P));
        for (int i = 0; i < nr; i++) {
            __m512i pair = broadcast_pair(q + i * q_stride + 2 * P);
            for (int k = 0; k < nk; k++) a[i][k] = dpbf16(a[i][k], key[k], pair);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int k = 0; k < nk; k++)
            _mm512_storeu_ps(scores + i * padded + (kb + k) * 16, a[i][k]);
}

/* acc[i] (value_tiles vectors each) += weights' pairs [from, to) x V's pairs, for nr rows
 * whose weights are p_stride apart; V from value_tiles_at (pair I at I - base). */
static inline __attribute__((always_inline)) void dp_values(
    const uint16_t *p, int64_t p_stride, const uint16_t *value_tiles_at, int64_t value_tiles,
    int64_t base, int64_t from, int64_t to, const int nr, const int tiles, __m512 acc[][8]) {
    for (int64_t I = from; I < to; I++) {
        __m512i value[8];
        for (int t = 0; t < tiles; t++)
            value[t] = _mm512_loadu_si512(value_pair_at(value_tiles_at, value_tiles, I - base, t));
        for (int i = 0; i < nr; i++) {
            __m512i pair = broadcast_pair(p + i * p_stride + 2 * I);
            for (int t = 0; t < tiles; t++) acc[i][t] = dpbf16(acc[i][t], value[t], pair);
        }
    }
}

/* dp_values for 2 or 3 rows (a decode step's rows per K/V head), out of line so that the
 * 4-row and 1-row paths compile as before. */
static __attribute__((noinline)) void dp_values_few(
    const uint16_t *p, int64_t p_stride, const uint16_t *value_tiles_at, int64_t value_tiles,
    int64_t base, int64_t from, int64_t to, int nr, __m512 acc[][8]) {
    if (nr == 3)
        dp_values(p, p_stride, value_tiles_at, value_tiles, base, from, to, 3, 4, acc);
    else
        dp_values(p, p_stride, value_tiles_at, value_tiles, base, from, to, 2, 4, acc);
}

/* dp_scores of 2 or 3 rows over every key block, out of line (as dp_values_few). */
static __attribute__((noinline)) void dp_scores_few(
    const uint16_t *q, int64_t q_stride, const uint16_t *key_tiles, int64_t dim_tiles,
    int64_t pairs, int64_t key_blocks, int nr, float *scores, int64_t padded) {
    int64_t kb = 0;
    if (nr == 3) {
        for (; kb + DP_KEY_BLOCKS <= key_blocks; kb += DP_KEY_BLOCKS)
            dp_scores(q, q_stride, key_tiles, dim_tiles, pairs, kb, 3, DP_KEY_BLOCKS, scores, padded);
        for (; kb < key_blocks; kb++)
            dp_scores(q, q_stride, key_tiles, dim_tiles, pairs, kb, 3, 1, scores, padded);
    } else {
        for (; kb + DP_KEY_BLOCKS <= key_blocks; kb += DP_KEY_BLOCKS)
            dp_scores(q, q_stride, key_tiles, dim_tiles, pairs, kb, 2, DP_KEY_BLOCKS, scores, padded);
        for (; kb < key_blocks; kb++)
            dp_scores(q, q_stride, key_tiles, dim_tiles, pairs, kb, 2, 1, scores, padded);
    }
}

static void dp_values_any(const uint16_t *p, int64_t p_stride, const uint16_t *value_tiles_at,
                          int64_t value_tiles, int64_t base, int64_t from, int64_t to, int nr,
                          __m512 acc[][8]) {
    /* Rows blocked together share each value load; every (row, tile) chain runs over
     * the pairs in the same order however many rows share it. */
    if (nr == 4 && value_tiles == 4)
        dp_values(p, p_stride, value_tiles_at, value_tiles, base, from, to, 4, 4, acc);
    else if ((nr == 3 || nr == 2) && value_tiles == 4)
        dp_values_few(p, p_stride, value_tiles_at, value_tiles, base, from, to, nr, acc);
    else if (nr == 1 && value_tiles == 4)
        dp_values(p, p_stride, value_tiles_at, value_tiles, base, from, to, 1, 4, acc);
    else
        for (int i = 0; i < nr; i++)
            for (int64_t I = from; I < to; I++) {
                __m512i pair = broadcast_pair(p + i * p_stride + 2 * I);
                for (int64_t t = 0; t < value_tiles; t++)
                    acc[i][t] = dpbf16(acc[i][t], _mm512_loadu_si512(value_pair_at(
                                                       value_tiles_at, value_tiles, I - base, t)),
                                       pair);
            }
}

/* attend_task's contract on VDPBF16PS (bf16 only; head_dim even, <= AMX_MAX_DIM). */
static void attend_task_dpbf16(const uint16_t *query, const uint16_t *keys,
                               const uint16_t *values, uint16_t *out, const int64_t *lengths,
                               const int64_t *tree_prefix, const uint64_t *tree_visible,
                               int64_t count, int64_t head_dim, int64_t key_stride, float scale,
                               bf16_scratch *s) {
    const int64_t dim_tiles = (head_dim + 31) / 32, value_tiles = (head_dim + 15) / 16;
    const int64_t pairs = head_dim / 2;
    int64_t longest = 0;
    for (int64_t r = 0; r < count; r++)
        if (lengths[r] > longest) longest = lengths[r];
    const int64_t padded = (longest + 31) / 32 * 32;
    vnni_pack_keys(keys, key_stride, longest, head_dim, dim_tiles, s->key_tiles);
    vnni_pack_values(values, key_stride, NULL, 0, longest, head_dim, value_tiles,
                     s->value_tiles);
    int64_t own[16];
    for (int64_t g0 = 0; g0 < count; g0 += 16) {
        int64_t rows = count - g0 < 16 ? count - g0 : 16;
        const int64_t *length = lengths + g0;
        const uint16_t *q = query + g0 * head_dim;
        int64_t group_longest = 0;
        for (int64_t r = 0; r < rows; r++)
            if (length[r] > group_longest) group_longest = length[r];
        int64_t key_blocks = (group_longest + 15) / 16;
        int64_t r0 = 0;
        for (; r0 + DP_ROWS <= rows; r0 += DP_ROWS) {
            int64_t kb = 0;
            for (; kb + DP_KEY_BLOCKS <= key_blocks; kb += DP_KEY_BLOCKS)
                dp_scores(q + r0 * head_dim, head_dim, s->key_tiles, dim_tiles, pairs, kb,
                          DP_ROWS, DP_KEY_BLOCKS, s->scores + r0 * padded, padded);
            for (; kb < key_blocks; kb++)
                dp_scores(q + r0 * head_dim, head_dim, s->key_tiles, dim_tiles, pairs, kb,
                          DP_ROWS, 1, s->scores + r0 * padded, padded);
        }
        if (rows - r0 == 3 || rows - r0 == 2) { /* a decode step: 3 or 2 rows per K/V head */
            dp_scores_few(q + r0 * head_dim, head_dim, s->key_tiles, dim_tiles, pairs, key_blocks,
                          (int)(rows - r0), s->scores + r0 * padded, padded);
            r0 = rows;
        }
        for (; r0 < rows; r0++) {
            int64_t kb = 0;
            for (; kb + DP_KEY_BLOCKS <= key_blocks; kb += DP_KEY_BLOCKS)
                dp_scores(q + r0 * head_dim, head_dim, s->key_tiles, dim_tiles, pairs, kb, 1,
                          DP_KEY_BLOCKS, s->scores + r0 * padded, padded);
            for (; kb < key_blocks; kb++)
                dp_scores(q + r0 * head_dim, head_dim, s->key_tiles, dim_tiles, pairs, kb, 1,
                          1, s->scores + r0 * padded, padded);
        }
        /* Weights per row (a tree row's scores packed first). */
        int64_t p_length = (group_longest + 31) / 32 * 32;
        for (int64_t r = 0; r < rows; r++) {
            float *sc = s->scores + r * padded;
            int64_t row_length = length[r];
            if (tree_prefix)
                row_length = pack_tree_scores(sc, tree_prefix[g0 + r], tree_visible[g0 + r]);
            own[r] = (row_length + 1) / 2;
            s->inverse[r] = bf16_weights(sc, row_length, scale, s->p + r * padded, p_length);
        }
        /* Values: DP_ROWS rows together over the pairs all of them have, then each row
         * alone over the rest of its own (its chain continues in key order). A tree row
         * reads the shared copy below its prefix's last whole pair, then its own packed
         * copy of the keys it sees (one after the other). */
        __m512 acc[DP_ROWS][8];
        for (int64_t g = 0; g < rows; g += DP_ROWS) {
            int nr = rows - g < DP_ROWS ? (int)(rows - g) : DP_ROWS;
            for (int i = 0; i < nr; i++)
                for (int64_t t = 0; t < value_tiles; t++) acc[i][t] = _mm512_setzero_ps();
            const uint16_t *p = s->p + g * padded;
            if (!tree_prefix) {
                int64_t common = own[g];
                for (int i = 1; i < nr; i++)
                    if (own[g + i] < common) common = own[g + i];
                dp_values_any(p, padded, s->value_tiles, value_tiles, 0, 0, common, nr, acc);
                for (int i = 0; i < nr; i++)
                    dp_values_any(p + i * padded, padded, s->value_tiles, value_tiles, 0,
                                  common, own[g + i], 1, acc + i);
            } else {
                for (int i = 0; i < nr; i++) {
                    int64_t prefix = tree_prefix[g0 + g + i];
                    uint64_t visible = tree_visible[g0 + g + i];
                    int64_t first = prefix / 2 * 2, packed_length = first;
                    dp_values_any(p + i * padded, padded, s->value_tiles, value_tiles, 0, 0,
                                  first / 2, 1, acc + i);
                    for (int64_t j = first; j < prefix; j++) s->tail_rows[packed_length++] = j;
                    for (int64_t t = 0; t < 64; t++)
                        if ((visible >> t) & 1u) s->tail_rows[packed_length++] = prefix + t;
                    vnni_pack_values(values, key_stride, s->tail_rows, first, packed_length,
                                     head_dim, value_tiles, s->tail_tiles);
                    dp_values_any(p + i * padded, padded, s->tail_tiles, value_tiles, first / 2,
                                  first / 2, (packed_length + 1) / 2, 1, acc + i);
                }
            }
            for (int i = 0; i < nr; i++) {
                float lanes[8 * 16];
                for (int64_t t = 0; t < value_tiles; t++) _mm512_storeu_ps(lanes + t * 16, acc[i][t]);
                for (int64_t d = 0; d < head_dim; d++)
                    out[(g0 + g + i) * head_dim + d] = f32_to_bf16(lanes[d] * s->inverse[g + i]);
            }
        }
    }
}

/* attend_task_dpbf16 and attend_task_amx: one contract, one signature. */
typedef void (*bf16_task)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *,
                          const int64_t *, const int64_t *, const uint64_t *, int64_t, int64_t,
                          int64_t, float, bf16_scratch *);

int knapspec_attention_dpbf16_available(void) { return 1; }
#else
int knapspec_attention_dpbf16_available(void) { return 0; }
#endif /* bf16 units */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KNAPSPEC_AMX_ATTENTION 1
#include "amx_tiles.h"

#define SCORE_STEP(T, Q)                                                   \
    if (dim_tiles > T) {                                                   \
        _tile_loadd(5, key_tiles + (kb * dim_tiles + T) * 512, 64);        \
        _tile_dpbf16ps(0, Q, 5);                                           \
    }
#define SCORE_PAIR(T, Q)                                                   \
    if (dim_tiles > T) {                                                   \
        _tile_loadd(5, key_tiles + (kb * dim_tiles + T) * 512, 64);        \
        _tile_loadd(7, key_tiles + ((kb + 1) * dim_tiles + T) * 512, 64);  \
        _tile_dpbf16ps(0, Q, 5);                                           \
        _tile_dpbf16ps(6, Q, 7);                                           \
    }
#define VALUE_STEP(T)                                                                  \
    if (n > T) {                                                                       \
        _tile_loadd(5, value_tiles_at + (kb * value_tiles + pass + T) * 512, 64);      \
        _tile_dpbf16ps(T, 4, 5);                                                       \
    }
#define ZERO4 _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
#define LOAD_ACC(T) if (n > T) _tile_loadd(T, acc + (pass + T) * 16, acc_stride * 4);
#define STORE_ACC(T) if (n > T) _tile_stored(T, acc + (pass + T) * 16, acc_stride * 4);

/* acc (16 x acc_stride floats) += P[:, kb*32 ..] V for blocks [from, to) of the packed
 * values, every value tile; tiles 0..3 accumulate, 4 holds P, 5 V. With load, acc's
 * current contents are the starting point, otherwise zero. */
static void amx_values(const uint16_t *p, int64_t p_stride, const uint16_t *value_tiles_at,
                       int64_t value_tiles, int64_t block_base, int64_t from, int64_t to,
                       float *acc, int64_t acc_stride, int load) {
    for (int64_t pass = 0; pass < value_tiles; pass += 4) {
        int64_t n = value_tiles - pass < 4 ? value_tiles - pass : 4;
        if (load) {
            LOAD_ACC(0) LOAD_ACC(1) LOAD_ACC(2) LOAD_ACC(3)
        } else {
            ZERO4
        }
        for (int64_t block = from; block < to; block++) {
            int64_t kb = block - block_base;
            _tile_loadd(4, p + block * 32, p_stride * 2);
            VALUE_STEP(0) VALUE_STEP(1) VALUE_STEP(2) VALUE_STEP(3)
        }
        STORE_ACC(0) STORE_ACC(1) STORE_ACC(2) STORE_ACC(3)
    }
}

/* attend_task's contract on the tiles (bf16 only; head_dim even, <= AMX_MAX_DIM). */
static void attend_task_amx(const uint16_t *query, const uint16_t *keys,
                            const uint16_t *values, uint16_t *out, const int64_t *lengths,
                            const int64_t *tree_prefix, const uint64_t *tree_visible,
                            int64_t count, int64_t head_dim, int64_t key_stride, float scale,
                            bf16_scratch *s) {
    const int64_t dim_tiles = (head_dim + 31) / 32, value_tiles = (head_dim + 15) / 16;
    const int64_t acc_stride = value_tiles * 16;
    int64_t longest = 0;
    for (int64_t r = 0; r < count; r++)
        if (lengths[r] > longest) longest = lengths[r];
    const int64_t padded = (longest + 31) / 32 * 32; /* P's and the scores' row length */
    amx_configure();
    const uint16_t *key_tiles = s->key_tiles;
    vnni_pack_keys(keys, key_stride, longest, head_dim, dim_tiles, s->key_tiles);
    vnni_pack_values(values, key_stride, NULL, 0, longest, head_dim, value_tiles,
                    s->value_tiles);
    for (int64_t g0 = 0; g0 < count; g0 += 16) {
        int64_t rows = count - g0 < 16 ? count - g0 : 16;
        const int64_t *length = lengths + g0;
        int64_t group_longest = 0, shared = longest;
        for (int64_t r = 0; r < rows; r++) {
            if (length[r] > group_longest) group_longest = length[r];
            if (tree_prefix && tree_prefix[g0 + r] < shared) shared = tree_prefix[g0 + r];
        }
        /* The group's queries, zero-padded to 16 rows and whole dimension tiles. */
        memset(s->queries, 0, (size_t)(16 * dim_tiles * 64));
        for (int64_t r = 0; r < rows; r++)
            memcpy(s->queries + r * dim_tiles * 32, query + (g0 + r) * head_dim,
                   sizeof(uint16_t) * (size_t)head_dim);
        _tile_loadd(1, s->queries, dim_tiles * 64);
        if (dim_tiles > 1) _tile_loadd(2, s->queries + 32, dim_tiles * 64);
        if (dim_tiles > 2) _tile_loadd(3, s->queries + 64, dim_tiles * 64);
        if (dim_tiles > 3) _tile_loadd(4, s->queries + 96, dim_tiles * 64);
        int64_t key_blocks = (group_longest + 15) / 16, kb = 0;
        for (; kb + 1 < key_blocks; kb += 2) { /* two blocks in flight */
            _tile_zero(0);
            _tile_zero(6);
            SCORE_PAIR(0, 1) SCORE_PAIR(1, 2) SCORE_PAIR(2, 3) SCORE_PAIR(3, 4)
            _tile_stored(0, s->scores + kb * 16, padded * 4);
            _tile_stored(6, s->scores + kb * 16 + 16, padded * 4);
        }
        if (kb < key_blocks) {
            _tile_zero(0);
            SCORE_STEP(0, 1) SCORE_STEP(1, 2) SCORE_STEP(2, 3) SCORE_STEP(3, 4)
            _tile_stored(0, s->scores + kb * 16, padded * 4);
        }
        /* Weights: bf16(exp(score - best)), 0 past the row's (packed) length. */
        int64_t group_blocks = (group_longest + 31) / 32;
        for (int64_t r = 0; r < 16; r++) {
            uint16_t *p = s->p + r * padded;
            if (r >= rows) {
                memset(p, 0, sizeof(uint16_t) * (size_t)(group_blocks * 32));
                continue;
            }
            float *sc = s->scores + r * padded;
            int64_t row_length = length[r];
            if (tree_prefix)
                row_length = pack_tree_scores(sc, tree_prefix[g0 + r], tree_visible[g0 + r]);
            s->inverse[r] = bf16_weights(sc, row_length, scale, p, group_blocks * 32);
        }
        /* Values: blocks every row reads from the shared copy; a tree row's later blocks
         * from its own packed copy (the keys it sees, one after the other). */
        int64_t shared_blocks = tree_prefix ? shared / 32 : group_blocks;
        amx_values(s->p, padded, s->value_tiles, value_tiles, 0, 0, shared_blocks, s->acc,
                   acc_stride, 0);
        float *result = s->acc;
        if (tree_prefix) {
            for (int64_t r = 0; r < rows; r++) {
                int64_t prefix = tree_prefix[g0 + r];
                uint64_t visible = tree_visible[g0 + r];
                int64_t first = shared_blocks * 32, packed_length = first;
                for (int64_t j = first; j < prefix; j++) s->tail_rows[packed_length++] = j;
                for (int64_t t = 0; t < 64; t++)
                    if ((visible >> t) & 1u) s->tail_rows[packed_length++] = prefix + t;
                int64_t blocks = (packed_length - first + 31) / 32;
                float *row_out = s->tail_acc + r * acc_stride;
                memcpy(row_out, s->acc + r * acc_stride, sizeof(float) * (size_t)acc_stride);
                for (int64_t b = 0; b < blocks; b += 4) {
                    int64_t here = blocks - b < 4 ? blocks - b : 4;
                    int64_t from = first + b * 32;
                    int64_t to = from + here * 32 < packed_length ? from + here * 32 : packed_length;
                    vnni_pack_values(values, key_stride, s->tail_rows, from, to, head_dim,
                                    value_tiles, s->tail_tiles);
                    /* all 16 rows ride along; only row r's is kept */
                    float tile_rows[16 * AMX_MAX_DIM];
                    memcpy(tile_rows, s->acc, sizeof(float) * (size_t)(16 * acc_stride));
                    memcpy(tile_rows + r * acc_stride, row_out, sizeof(float) * (size_t)acc_stride);
                    amx_values(s->p, padded, s->tail_tiles, value_tiles, shared_blocks + b,
                               shared_blocks + b, shared_blocks + b + here, tile_rows,
                               acc_stride, 1);
                    memcpy(row_out, tile_rows + r * acc_stride, sizeof(float) * (size_t)acc_stride);
                }
            }
            result = s->tail_acc;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t d = 0; d < head_dim; d++)
                out[(g0 + r) * head_dim + d] =
                    f32_to_bf16(result[r * acc_stride + d] * s->inverse[r]);
    }
}

int knapspec_attention_amx_available(void) { return amx_permitted(); }
#else
int knapspec_attention_amx_available(void) { return 0; }
#endif

/* query/out: (kv_heads, rows_per_kv_head, head_dim) contiguous (the query heads of one
 * key/value head folded into its rows); keys/values: per K/V head key_head_stride elements
 * apart, keys key_stride apart; lengths: (kv_heads * rows_per_kv_head) keys each row sees
 * (0 .. length-1, at most max_length). tree_prefix/tree_visible: NULL, or the tree
 * visibility described at the top for tree_period query positions, row r using entry
 * r % tree_period (the folded rows of a K/V head are its query heads' positions in turn);
 * lengths is then unused (NULL is fine). Work is split into tasks of at most chunk rows.
 * unit: UNIT_VECTOR, UNIT_AMX or UNIT_DPBF16 (the caller picks one per process).
 * Returns 0, 2 when memory could not be had, 3 when a tree row sees no key or a key past
 * max_length, or 4 when the unit cannot serve this call here (fp32, an odd head size or
 * one over AMX_MAX_DIM, a build or an OS without it). */
int knapspec_attend_tree(const void *query, const void *keys, const void *values, void *out,
                         const int64_t *lengths, const int64_t *tree_prefix,
                         const uint64_t *tree_visible, int64_t tree_period, int dtype,
                         int64_t kv_heads, int64_t rows_per_kv_head, int64_t head_dim,
                         int64_t key_head_stride, int64_t key_stride, int64_t max_length,
                         int64_t chunk, float scale, int threads, int unit) {
    if (unit < UNIT_VECTOR || unit > UNIT_DPBF16) return 4;
#ifdef KNAPSPEC_BF16_UNITS
    if (unit != UNIT_VECTOR && (dtype != DTYPE_BF16 || head_dim % 2 || head_dim > AMX_MAX_DIM))
        return 4;
#else
    if (unit != UNIT_VECTOR) return 4;
#endif
#ifdef KNAPSPEC_AMX_ATTENTION
    if (unit == UNIT_AMX && !amx_permitted()) return 4;
#else
    if (unit == UNIT_AMX) return 4;
#endif
    if (chunk < 1) chunk = 1;
    if (chunk > rows_per_kv_head) chunk = rows_per_kv_head;
    int64_t chunks_per_head = (rows_per_kv_head + chunk - 1) / chunk;
    int64_t tasks = kv_heads * chunks_per_head;
    int64_t padded_length = ((max_length > 0 ? max_length : 1) + LANES - 1) / LANES * LANES;
    int64_t padded_dim = (head_dim + LANES - 1) / LANES * LANES;
    size_t element = dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    int failed = 0;
    if (tree_prefix)
        for (int64_t r = 0; r < tree_period; r++)
            if (tree_prefix[r] < 0 || tree_span(tree_prefix[r], tree_visible[r]) > max_length ||
                tree_prefix[r] + __builtin_popcountll(tree_visible[r]) == 0)
                return 3;
    if (threads > tasks) threads = (int)tasks;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        float *acc = malloc(sizeof(float) * (size_t)(chunk * padded_dim));
        float *row = calloc((size_t)padded_dim, sizeof(float));
        float *qt = malloc(sizeof(float) * (size_t)(head_dim * (chunk + LANES)));
        float *key_rows = malloc(sizeof(float) * (size_t)(4 * head_dim));
        float *value_rows = calloc((size_t)(VALUE_BLOCK * padded_dim), sizeof(float));
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(chunk * padded_length));
        int64_t *packed = malloc(sizeof(int64_t) * (size_t)chunk);
        /* A task's tree rows: spans, prefixes, masks. */
        int64_t *spans = malloc(sizeof(int64_t) * (size_t)(2 * chunk));
        uint64_t *masks = malloc(sizeof(uint64_t) * (size_t)chunk);
        int64_t *prefixes = spans ? spans + chunk : NULL;
#ifdef KNAPSPEC_BF16_UNITS
        bf16_scratch units;
        int units_ready =
            unit != UNIT_VECTOR ? bf16_scratch_alloc(&units, max_length, head_dim) : 1;
#else
        int units_ready = 1;
#endif
        if (!units_ready || !acc || !row || !qt || !key_rows || !value_rows || !scores || !packed || !spans ||
            !masks) {
#pragma omp atomic write
            failed = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) {
                int64_t kv = task / chunks_per_head;
                int64_t first = (task % chunks_per_head) * chunk;
                int64_t count =
                    rows_per_kv_head - first < chunk ? rows_per_kv_head - first : chunk;
                int64_t first_row = kv * rows_per_kv_head + first;
                int64_t offset = first_row * head_dim;
                if (tree_prefix)
                    for (int64_t r = 0; r < count; r++) {
                        int64_t entry = (first_row + r) % tree_period;
                        prefixes[r] = tree_prefix[entry];
                        masks[r] = tree_visible[entry];
                        spans[r] = tree_span(prefixes[r], masks[r]);
                    }
#ifdef KNAPSPEC_BF16_UNITS
                if (unit != UNIT_VECTOR) {
                    bf16_task task = attend_task_dpbf16;
#ifdef KNAPSPEC_AMX_ATTENTION
                    if (unit == UNIT_AMX) task = attend_task_amx;
#endif
                    task((const uint16_t *)query + offset,
                         (const uint16_t *)keys + kv * key_head_stride,
                         (const uint16_t *)values + kv * key_head_stride, (uint16_t *)out + offset,
                         tree_prefix ? spans : lengths + first_row, tree_prefix ? prefixes : NULL,
                         tree_prefix ? masks : NULL, count, head_dim, key_stride, scale, &units);
                    continue;
                }
#endif
                attend_task((const char *)query + offset * element,
                            (const char *)keys + kv * key_head_stride * element,
                            (const char *)values + kv * key_head_stride * element,
                            (char *)out + offset * element, dtype,
                            tree_prefix ? spans : lengths + first_row,
                            tree_prefix ? prefixes : NULL, tree_prefix ? masks : NULL, packed,
                            count, head_dim, key_stride, scale, scores, acc, row, qt, key_rows,
                            value_rows, padded_length);
            }
        }
#ifdef KNAPSPEC_BF16_UNITS
        if (unit != UNIT_VECTOR) bf16_scratch_free(&units);
#endif
        free(acc);
        free(row);
        free(qt);
        free(key_rows);
        free(value_rows);
        free(scores);
        free(packed);
        free(spans);
        free(masks);
    }
    return failed;
}

/* The contiguous kernel: every row sees keys 0 .. lengths[r]-1 (arguments as above). */
int knapspec_attend(const void *query, const void *keys, const void *values, void *out,
                    const int64_t *lengths, int dtype, int64_t kv_heads,
                    int64_t rows_per_kv_head, int64_t head_dim, int64_t key_head_stride,
                    int64_t key_stride, int64_t max_length, int64_t chunk, float scale,
                    int threads) {
    return knapspec_attend_tree(query, keys, values, out, lengths, NULL, NULL, 0, dtype,
                                kv_heads, rows_per_kv_head, head_dim, key_head_stride,
                                key_stride, max_length, chunk, scale, threads, 0);
}
