/* An exact pass's decoder layers in one call (knapspec.model.kernels.layer_loop).
 *
 * Per layer it calls the same compiled kernels, with the same arguments, that the Python
 * layer items of knapspec.model.passes.exact_pass call one by one (RMSNorm, the fused q/k/v
 * product, rotary, the two K/V writes, the row-invariant attention, the output product,
 * RMSNorm, the fused gate/up product, the down product), through function pointers to
 * their own libraries, and does the few elementwise steps between them as PyTorch does
 * them: a residual add and the activation-times-up product each in float32 (in bfloat16
 * rounded to nearest even once); in bfloat16 the activation (SiLU, GELU-tanh) is read
 * from a table of PyTorch's own results for all 65,536 inputs, in float32 the caller's
 * callback runs PyTorch's activation and product.
 *
 * Gemma 3's layers add per-head q/k norms (before rotary), a norm of each sublayer's
 * output before its residual add, norms scaled by 1 + w (the norm kernel's unit_offset),
 * a rotary table per layer, and sliding-window layers: where a pass has rows past a
 * layer's window, that layer's plan (windows[layer]) gives the shared call's lengths with
 * those rows cut to one key (or none: a token tree's nodes are all attended alone) and
 * each such row's keys, which it attends alone as the Python pass does (a slice of its
 * cache row, or in a tree its visible keys gathered in slot order).
 *
 * So every output and every K/V entry is bitwise the Python loop's (the tests compare
 * them); what goes is ~15 Python-level calls per layer.
 */
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"

typedef int (*norm_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t, float, int,
                       int, int);
/* The packed kernels (packed-linear, amx-linear: bfloat16) and row-linear (any dtype). */
typedef int (*packed_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int);
typedef int (*row_linear_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int, int);
/* gated (tokens, ff) = act(gate_up[:, :ff]) * gate_up[:, ff:] as PyTorch computes it. */
typedef int (*activate_fn)(const void *, void *, int64_t);
/* out = product `which` (0 q/k/v, 1 output, 2 gate/up, 3 down) of layer `layer` over x, for
 * a kernel C cannot call (the caller runs it in PyTorch). */
typedef int (*product_callback_fn)(int64_t, int64_t, const void *, void *, int64_t);
typedef int (*rotary_fn)(void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                         int);
typedef int (*scatter_fn)(const void *, void *, const int64_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*attend_fn)(const void *, const void *, const void *, void *, const int64_t *,
                         const int64_t *, const uint64_t *, int64_t, int, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int);

/* Per layer, LAYER_SLOTS pointers in this order (a bias may be NULL); each product is its
 * weight, bias, kernel and the kernel's kind (PACKED, ROW_LINEAR or CALLBACK, as an
 * integer; a CALLBACK product's other slots are unused). NORM_POST is the MLP's input
 * norm; the q/k norms and the norms of the sublayers' outputs (Gemma 3) are NULL where the
 * layer has none. */
enum {
    NORM_IN, QKV_W, QKV_B, QKV_FN, QKV_KIND, O_W, O_B, O_FN, O_KIND, NORM_POST, GATE_UP_W,
    GATE_UP_B, GATE_UP_FN, GATE_UP_KIND, DOWN_W, DOWN_B, DOWN_FN, DOWN_KIND, Q_NORM, K_NORM,
    NORM_ATTN_OUT, NORM_MLP_OUT, LAYER_SLOTS
};
/* Per layer, the epsilons of its norms in this order. */
enum { EPS_IN, EPS_POST, EPS_Q, EPS_K, EPS_ATTN_OUT, EPS_MLP_OUT, EPS_COUNT };
/* A layer's window plan: the shared call's lengths (0: no shared call), the entry count,
 * the chunk of one row's call, then per entry its cache row, query step, first and end key
 * slot, and for gathered keys node 0's slot and the tree-slot bit mask (0, 0: a slice). */
enum { W_LENGTHS, W_COUNT, W_CHUNK, W_ENTRIES };
enum { E_ROW, E_STEP, E_FIRST, E_END, E_BASE, E_MASK, E_SIZE };
enum { PACKED = 0, ROW_LINEAR = 1, CALLBACK = 2 };
/* The pass's small operations. */
enum { FN_NORM, FN_ROTARY, FN_SCATTER, FN_ATTEND, FN_COUNT };
/* Sizes, in this order. */
enum {
    D_TOKENS, D_MODEL, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_FF, D_ROWS, D_Q, D_SLOTS,
    D_CAPACITY, D_END, D_CHUNK, D_UNIT, D_THREADS, D_DTYPE, D_UNIT_OFFSET, D_GATHERED,
    D_SCRATCH, D_COUNT
};
/* Which step failed: the status is step * 1000 + the kernel's own status. */
enum {
    STEP_SIZES = 1, STEP_NORM_IN, STEP_QKV, STEP_ROTARY, STEP_SCATTER, STEP_ATTEND, STEP_O,
    STEP_NORM_POST, STEP_GATE_UP, STEP_ACTIVATE, STEP_DOWN, STEP_QK_NORM, STEP_NORM_ATTN_OUT,
    STEP_NORM_MLP_OUT, STEP_WINDOW
};

int knapspec_layer_loop_slots(void) { return LAYER_SLOTS * 1000 + D_COUNT; }

/* Elements of scratch a pass needs (of the pass's dtype): the buffers between the steps,
 * then for rows attended alone their lengths (int64, first so that they are aligned), query,
 * output and gathered keys and values. */
static int64_t scratch_elements(const int64_t *dims) {
    int64_t n = dims[D_TOKENS], d = dims[D_MODEL], width = dims[D_HEADS] * dims[D_HEAD_DIM];
    int64_t qkv = (dims[D_HEADS] + 2 * dims[D_KV_HEADS]) * dims[D_HEAD_DIM];
    int64_t folded = dims[D_ROWS] * dims[D_HEADS] * dims[D_Q] * dims[D_HEAD_DIM];
    int64_t per_int64 = dims[D_DTYPE] == DTYPE_F32 ? 2 : 4;
    int64_t alone = dims[D_HEADS] * per_int64 + 2 * width +
                    2 * dims[D_KV_HEADS] * dims[D_GATHERED] * dims[D_HEAD_DIM];
    return alone + n * d + n * qkv + 2 * folded + n * width + n * d + n * 2 * dims[D_FF] +
           n * dims[D_FF];
}

int64_t knapspec_layer_loop_scratch(const int64_t *dims) { return scratch_elements(dims); }

static void add_into(void *hidden, const void *x, int64_t n, int dtype) {
    if (dtype == DTYPE_F32) {
        float *h = hidden;
        const float *v = x;
        for (int64_t i = 0; i < n; i++) h[i] = h[i] + v[i];
        return;
    }
    uint16_t *h = hidden;
    const uint16_t *v = x;
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(v[i]));
}

static int product(void *const *p, int slot, const void *x, void *out, int64_t n, int64_t k,
                   int64_t n_out, int dtype, int threads, int64_t layer, void *callback) {
    void *function = p[slot + 2];
    intptr_t kind = (intptr_t)p[slot + 3];
    if (kind == CALLBACK) {
        int64_t which = slot == QKV_W ? 0 : slot == O_W ? 1 : slot == GATE_UP_W ? 2 : 3;
        return callback ? ((product_callback_fn)callback)(layer, which, x, out, n) : 91;
    }
    if (kind == ROW_LINEAR)
        return ((row_linear_fn)function)(x, p[slot], p[slot + 1], out, n, k, n_out, k, n_out,
                                         dtype, threads);
    if (dtype != DTYPE_BF16) return 90;
    return ((packed_fn)function)(x, p[slot], p[slot + 1], out, n, k, n_out, k, n_out, threads);
}

/* Each token's heads normalised in place (rows of hd elements side by side, tokens
 * stride elements apart): a q/k norm as the Python pass runs it. */
static int head_norms(norm_fn norm, char *x, const void *weight, int64_t n, int64_t heads,
                      int64_t hd, int64_t stride, float eps, int dtype, int threads,
                      int unit_offset, size_t es) {
    int status;
    for (int64_t t = 0; t < n; t++)
        if ((status = norm(x + t * stride * es, weight, x + t * stride * es, heads, hd, hd, eps,
                           dtype, threads, unit_offset)))
            return status;
    return 0;
}

/* The rows of a pass past a layer's window, each attended alone (plan: W_* above) over its
 * keys, its output written over the shared call's row in attended_rows. */
static int attend_alone(attend_fn attend, const int64_t *plan, const char *folded,
                        char *attended_rows, const void *keys, const void *values,
                        const int64_t *dims, float scale, char *alone, size_t es) {
    const int64_t heads = dims[D_HEADS], kv_heads = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM];
    const int64_t q = dims[D_Q], capacity = dims[D_CAPACITY], groups = heads / kv_heads;
    const int dtype = (int)dims[D_DTYPE];
    int64_t *lengths = (int64_t *)alone;
    char *query = alone + heads * sizeof(int64_t), *out = query + heads * hd * es;
    char *gathered_keys = out + heads * hd * es;
    char *gathered_values = gathered_keys + kv_heads * dims[D_GATHERED] * hd * es;
    for (int64_t e = 0; e < plan[W_COUNT]; e++) {
        const int64_t *entry = plan + W_ENTRIES + e * E_SIZE;
        int64_t r = entry[E_ROW], s = entry[E_STEP], first = entry[E_FIRST], end = entry[E_END];
        uint64_t mask = (uint64_t)entry[E_MASK];
        int64_t count = end - first + __builtin_popcountll(mask);
        if (count < 1 || (mask && count > dims[D_GATHERED])) return 1;
        for (int64_t h = 0; h < heads; h++) {
            memcpy(query + h * hd * es, folded + ((r * heads + h) * q + s) * hd * es,
                   (size_t)hd * es);
            lengths[h] = count;
        }
        const char *row_keys = (const char *)keys + (r * kv_heads * capacity + first) * hd * es;
        const char *row_values =
            (const char *)values + (r * kv_heads * capacity + first) * hd * es;
        int64_t head_stride = capacity * hd;
        if (mask) { /* a tree node: its keys gathered in slot order, as the Python pass does */
            for (int64_t g = 0; g < kv_heads; g++) {
                const char *k = (const char *)keys + (r * kv_heads + g) * capacity * hd * es;
                const char *v = (const char *)values + (r * kv_heads + g) * capacity * hd * es;
                char *gk = gathered_keys + g * count * hd * es;
                char *gv = gathered_values + g * count * hd * es;
                int64_t i = 0;
                for (int64_t j = first; j < end; j++, i++) {
                    memcpy(gk + i * hd * es, k + j * hd * es, (size_t)hd * es);
                    memcpy(gv + i * hd * es, v + j * hd * es, (size_t)hd * es);
                }
                for (int t = 0; t < 64; t++) {
                    if (!((mask >> t) & 1u)) continue;
                    int64_t j = entry[E_BASE] + t;
                    memcpy(gk + i * hd * es, k + j * hd * es, (size_t)hd * es);
                    memcpy(gv + i * hd * es, v + j * hd * es, (size_t)hd * es);
                    i++;
                }
            }
            row_keys = gathered_keys;
            row_values = gathered_values;
            head_stride = count * hd;
        }
        int status = attend(query, row_keys, row_values, out, lengths, NULL, NULL, 1, dtype,
                            kv_heads, groups, hd, head_stride, hd, count, plan[W_CHUNK], scale,
                            (int)dims[D_THREADS], (int)dims[D_UNIT]);
        if (status) return status;
        for (int64_t h = 0; h < heads; h++)
            memcpy(attended_rows + ((r * heads + h) * q + s) * hd * es, out + h * hd * es,
                   (size_t)hd * es);
    }
    return 0;
}

/* hidden: (tokens, d) of dims[D_DTYPE], updated in place through every layer. pointers:
 * layers * LAYER_SLOTS; eps: layers * EPS_COUNT; kv: layers * 2 (the layer's key and value
 * buffers, (slots, kv_heads, capacity, head_dim) contiguous); functions: FN_COUNT; dims:
 * D_COUNT. rotary: layers * 2, the layer's cos and sin tables, (tokens, head_dim) each;
 * windows: layers plans (W_* above; NULL: the layer's rows all share the call);
 * write_rows/write_positions: (tokens,) each token's cache slot and position;
 * token_row/token_step: (tokens,) each token's row and step of the padded (rows, q)
 * layout, or NULL when tokens = rows * q in order; lengths (rows * heads * q) or
 * tree_prefix/tree_visible (q): the attention's rows, as its kernel takes them. silu:
 * 65,536 bf16, act[x] for each bit pattern x (bfloat16), or NULL and activate (any dtype);
 * product_callback: runs the CALLBACK products (NULL if none); executed: per layer, whether
 * its attention and its MLP item run (2 bytes a layer; NULL: every item, a full pass).
 * Returns 0, or the failing step * 1000 + its kernel's status. */
int knapspec_layer_loop(void *hidden, int64_t layers, void *const *pointers, const float *eps,
                        void *const *kv, void *const *functions, const int64_t *dims,
                        const void *const *rotary, const int64_t *const *windows,
                        const int64_t *write_rows, const int64_t *write_positions,
                        const int64_t *token_row, const int64_t *token_step,
                        const int64_t *lengths, const int64_t *tree_prefix,
                        const uint64_t *tree_visible, float scale, const uint16_t *silu,
                        void *activate, void *product_callback, const uint8_t *executed,
                        void *scratch) {
    const int64_t n = dims[D_TOKENS], d = dims[D_MODEL], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM], ff = dims[D_FF];
    const int64_t rows = dims[D_ROWS], q = dims[D_Q];
    const int threads = (int)dims[D_THREADS], dtype = (int)dims[D_DTYPE];
    const int offset = (int)dims[D_UNIT_OFFSET];
    const int64_t width = heads * hd, qkv_width = (heads + 2 * kv_heads) * hd;
    const size_t es = dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || dims[D_SCRATCH] < scratch_elements(dims) ||
        kv_heads < 1 || heads % kv_heads || (!token_row && n != rows * q) ||
        (!activate && !(silu && dtype == DTYPE_BF16)))
        return STEP_SIZES * 1000;
    norm_fn norm = (norm_fn)functions[FN_NORM];
    rotary_fn rotary_heads = (rotary_fn)functions[FN_ROTARY];
    scatter_fn scatter = (scatter_fn)functions[FN_SCATTER];
    attend_fn attend = (attend_fn)functions[FN_ATTEND];
    const int64_t folded_size = rows * heads * q * hd;
    const int64_t per_int64 = dtype == DTYPE_F32 ? 2 : 4;
    char *alone = scratch;
    char *normed = alone + (heads * per_int64 + 2 * width +
                            2 * kv_heads * dims[D_GATHERED] * hd) * es;
    char *qkv = normed + n * d * es, *folded = qkv + n * qkv_width * es;
    char *attended_rows = folded + folded_size * es, *attended = attended_rows + folded_size * es;
    char *projected = attended + n * width * es, *gate_up = projected + n * d * es;
    char *gated = gate_up + n * 2 * ff * es;
    int status;
    for (int64_t l = 0; l < layers; l++) {
        void *const *p = pointers + l * LAYER_SLOTS;
        const float *e = eps + l * EPS_COUNT;
        /* Attention item (skipped where the mask skips it: no K/V written). */
        if (!executed || executed[2 * l]) {
            if ((status = norm(hidden, p[NORM_IN], normed, n, d, d, e[EPS_IN], dtype, threads,
                               offset)))
                return STEP_NORM_IN * 1000 + status;
            if ((status = product(p, QKV_W, normed, qkv, n, d, qkv_width, dtype, threads, l,
                                  product_callback)))
                return STEP_QKV * 1000 + status;
            char *key = qkv + width * es, *value = key + kv_heads * hd * es;
            if (p[Q_NORM] &&
                ((status = head_norms(norm, qkv, p[Q_NORM], n, heads, hd, qkv_width, e[EPS_Q],
                                      dtype, threads, offset, es)) ||
                 (status = head_norms(norm, key, p[K_NORM], n, kv_heads, hd, qkv_width,
                                      e[EPS_K], dtype, threads, offset, es))))
                return STEP_QK_NORM * 1000 + status;
            const void *cos = rotary[2 * l], *sin = rotary[2 * l + 1];
            if ((status = rotary_heads(qkv, cos, sin, n, heads, hd, qkv_width, dtype)) ||
                (status = rotary_heads(key, cos, sin, n, kv_heads, hd, qkv_width, dtype)))
                return STEP_ROTARY * 1000 + status;
            if ((status = scatter(key, kv[2 * l], write_rows, write_positions, n, kv_heads, hd,
                                  qkv_width, dims[D_SLOTS], dims[D_CAPACITY], (int64_t)es)) ||
                (status = scatter(value, kv[2 * l + 1], write_rows, write_positions, n, kv_heads,
                                  hd, qkv_width, dims[D_SLOTS], dims[D_CAPACITY], (int64_t)es)))
                return STEP_SCATTER * 1000 + status;
            /* Queries folded to (rows, heads, q, hd); a padding query is zeros (it sees one
             * key). */
            if (token_row) memset(folded, 0, (size_t)folded_size * es);
            for (int64_t t = 0; t < n; t++) {
                int64_t r = token_row ? token_row[t] : t / q, s = token_row ? token_step[t] : t % q;
                for (int64_t h = 0; h < heads; h++)
                    memcpy(folded + ((r * heads + h) * q + s) * hd * es,
                           qkv + (t * qkv_width + h * hd) * es, (size_t)hd * es);
            }
            const int64_t *plan = windows ? windows[l] : NULL;
            const int64_t *shared = plan ? (const int64_t *)(intptr_t)plan[W_LENGTHS] : lengths;
            if ((!plan || shared) &&
                (status = attend(folded, kv[2 * l], kv[2 * l + 1], attended_rows, shared,
                                 plan ? NULL : tree_prefix, plan ? NULL : tree_visible, q, dtype,
                                 rows * kv_heads, heads / kv_heads * q, hd,
                                 dims[D_CAPACITY] * hd, hd, dims[D_END], dims[D_CHUNK], scale,
                                 threads, (int)dims[D_UNIT])))
                return STEP_ATTEND * 1000 + status;
            if (plan && (status = attend_alone(attend, plan, folded, attended_rows, kv[2 * l],
                                               kv[2 * l + 1], dims, scale, alone, es)))
                return STEP_WINDOW * 1000 + status;
            for (int64_t t = 0; t < n; t++) {
                int64_t r = token_row ? token_row[t] : t / q, s = token_row ? token_step[t] : t % q;
                for (int64_t h = 0; h < heads; h++)
                    memcpy(attended + (t * width + h * hd) * es,
                           attended_rows + ((r * heads + h) * q + s) * hd * es, (size_t)hd * es);
            }
            if ((status = product(p, O_W, attended, projected, n, width, d, dtype, threads, l,
                                  product_callback)))
                return STEP_O * 1000 + status;
            if (p[NORM_ATTN_OUT] &&
                (status = norm(projected, p[NORM_ATTN_OUT], projected, n, d, d, e[EPS_ATTN_OUT],
                               dtype, threads, offset)))
                return STEP_NORM_ATTN_OUT * 1000 + status;
            add_into(hidden, projected, n * d, dtype);
        }
        /* MLP item: down(act(gate) * up). */
        if (!executed || executed[2 * l + 1]) {
            if ((status = norm(hidden, p[NORM_POST], normed, n, d, d, e[EPS_POST], dtype,
                               threads, offset)))
                return STEP_NORM_POST * 1000 + status;
            if ((status = product(p, GATE_UP_W, normed, gate_up, n, d, 2 * ff, dtype, threads, l,
                                  product_callback)))
                return STEP_GATE_UP * 1000 + status;
            if (silu && dtype == DTYPE_BF16) {
                for (int64_t t = 0; t < n; t++) {
                    const uint16_t *gate = (const uint16_t *)gate_up + t * 2 * ff, *up = gate + ff;
                    uint16_t *out = (uint16_t *)gated + t * ff;
                    for (int64_t i = 0; i < ff; i++)
                        out[i] = f32_to_bf16(bf16_to_f32(silu[gate[i]]) * bf16_to_f32(up[i]));
                }
            } else if ((status = ((activate_fn)activate)(gate_up, gated, n))) {
                return STEP_ACTIVATE * 1000 + status;
            }
            if ((status = product(p, DOWN_W, gated, projected, n, ff, d, dtype, threads, l,
                                  product_callback)))
                return STEP_DOWN * 1000 + status;
            if (p[NORM_MLP_OUT] &&
                (status = norm(projected, p[NORM_MLP_OUT], projected, n, d, d, e[EPS_MLP_OUT],
                               dtype, threads, offset)))
                return STEP_NORM_MLP_OUT * 1000 + status;
            add_into(hidden, projected, n * d, dtype);
        }
    }
    return 0;
}
