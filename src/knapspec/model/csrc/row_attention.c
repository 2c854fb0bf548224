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

/* One hardware vector of floats: the lane count is fixed per build, so every row of every
 * call on this machine runs the same arithmetic. */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)((bits + rounding) >> 16);
}

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

/* query/out: (kv_heads, rows_per_kv_head, head_dim) contiguous (the query heads of one
 * key/value head folded into its rows); keys/values: per K/V head key_head_stride elements
 * apart, keys key_stride apart; lengths: (kv_heads * rows_per_kv_head) keys each row sees
 * (0 .. length-1, at most max_length). tree_prefix/tree_visible: NULL, or the tree
 * visibility described at the top for tree_period query positions, row r using entry
 * r % tree_period (the folded rows of a K/V head are its query heads' positions in turn);
 * lengths is then unused (NULL is fine). Work is split into tasks of at most chunk rows.
 * Returns 0, 2 when memory could not be had, or 3 when a tree row sees no key or a key
 * past max_length. */
int knapspec_attend_tree(const void *query, const void *keys, const void *values, void *out,
                         const int64_t *lengths, const int64_t *tree_prefix,
                         const uint64_t *tree_visible, int64_t tree_period, int dtype,
                         int64_t kv_heads, int64_t rows_per_kv_head, int64_t head_dim,
                         int64_t key_head_stride, int64_t key_stride, int64_t max_length,
                         int64_t chunk, float scale, int threads) {
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
        if (!acc || !row || !qt || !key_rows || !value_rows || !scores || !packed || !spans ||
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
                                key_stride, max_length, chunk, scale, threads);
}
