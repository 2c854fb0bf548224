/* An exact pass's decoder layers in one call (knapspec.model.layer_loop).
 *
 * Per layer it calls the same compiled kernels, with the same arguments, that the Python
 * layer items of knapspec.model.exact_pass call one by one (RMSNorm, the fused q/k/v
 * product, rotary, the two K/V writes, the row-invariant attention, the output product,
 * RMSNorm, the fused gate/up product, the down product), through function pointers to
 * their own libraries, and does the few elementwise steps between them as PyTorch does
 * them in bfloat16: a residual add and a product each in float32, rounded to nearest even
 * once; SiLU read from a table of PyTorch's own results for all 65,536 bfloat16 inputs.
 * So every output and every K/V entry is bitwise the Python loop's (the tests compare
 * them); what goes is ~15 Python-level calls per layer.
 *
 * bfloat16 only (a float32 SiLU has no table).
 */
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"

typedef int (*norm_fn)(const void *, const void *, void *, int64_t, int64_t, int64_t, float, int,
                       int);
typedef int (*linear_fn)(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int);
typedef int (*rotary_fn)(void *, const void *, const void *, int64_t, int64_t, int64_t, int64_t,
                         int);
typedef int (*scatter_fn)(const void *, void *, const int64_t *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*attend_fn)(const void *, const void *, const void *, void *, const int64_t *,
                         const int64_t *, const uint64_t *, int64_t, int, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int);

/* Per layer, LAYER_SLOTS pointers in this order (a bias may be NULL). */
enum {
    NORM_IN, QKV_W, QKV_B, QKV_FN, O_W, O_B, O_FN, NORM_POST, GATE_UP_W, GATE_UP_B,
    GATE_UP_FN, DOWN_W, DOWN_B, DOWN_FN, LAYER_SLOTS
};
/* The pass's small operations. */
enum { FN_NORM, FN_ROTARY, FN_SCATTER, FN_ATTEND, FN_COUNT };
/* Sizes, in this order. */
enum {
    D_TOKENS, D_MODEL, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_FF, D_ROWS, D_Q, D_SLOTS,
    D_CAPACITY, D_END, D_CHUNK, D_UNIT, D_THREADS, D_SCRATCH, D_COUNT
};
/* Which step failed: the status is step * 1000 + the kernel's own status. */
enum {
    STEP_SIZES = 1, STEP_NORM_IN, STEP_QKV, STEP_ROTARY, STEP_SCATTER, STEP_ATTEND, STEP_O,
    STEP_NORM_POST, STEP_GATE_UP, STEP_DOWN
};

int knapspec_layer_loop_slots(void) { return LAYER_SLOTS * 1000 + D_COUNT; }

/* Elements of scratch a pass needs. */
static int64_t scratch_elements(const int64_t *dims) {
    int64_t n = dims[D_TOKENS], d = dims[D_MODEL], width = dims[D_HEADS] * dims[D_HEAD_DIM];
    int64_t qkv = (dims[D_HEADS] + 2 * dims[D_KV_HEADS]) * dims[D_HEAD_DIM];
    int64_t folded = dims[D_ROWS] * dims[D_HEADS] * dims[D_Q] * dims[D_HEAD_DIM];
    return n * d + n * qkv + 2 * folded + n * width + n * d + n * 2 * dims[D_FF] + n * dims[D_FF];
}

int64_t knapspec_layer_loop_scratch(const int64_t *dims) { return scratch_elements(dims); }

static void add_into(uint16_t *hidden, const uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        hidden[i] = f32_to_bf16(bf16_to_f32(hidden[i]) + bf16_to_f32(x[i]));
}

/* hidden: (tokens, d) bf16, updated in place through every layer. pointers: layers *
 * LAYER_SLOTS; eps: layers * 2 (input, post-attention); kv: layers * 2 (the layer's key and
 * value buffers, (slots, kv_heads, capacity, head_dim) contiguous); functions: FN_COUNT;
 * dims: D_COUNT. cos/sin: (tokens, head_dim); write_rows/write_positions: (tokens,) each
 * token's cache slot and position; token_row/token_step: (tokens,) each token's row and
 * step of the padded (rows, q) layout, or NULL when tokens = rows * q in order; lengths
 * (rows * heads * q) or tree_prefix/tree_visible (q): the attention's rows, as its kernel
 * takes them; silu: 65,536 bf16, silu[x] for each bit pattern x. Returns 0, or the failing
 * step * 1000 + its kernel's status. */
int knapspec_layer_loop(uint16_t *hidden, int64_t layers, void *const *pointers, const float *eps,
                        void *const *kv, void *const *functions, const int64_t *dims,
                        const uint16_t *cos, const uint16_t *sin, const int64_t *write_rows,
                        const int64_t *write_positions, const int64_t *token_row,
                        const int64_t *token_step, const int64_t *lengths,
                        const int64_t *tree_prefix, const uint64_t *tree_visible, float scale,
                        const uint16_t *silu, uint16_t *scratch) {
    const int64_t n = dims[D_TOKENS], d = dims[D_MODEL], heads = dims[D_HEADS];
    const int64_t kv_heads = dims[D_KV_HEADS], hd = dims[D_HEAD_DIM], ff = dims[D_FF];
    const int64_t rows = dims[D_ROWS], q = dims[D_Q], threads = dims[D_THREADS];
    const int64_t width = heads * hd, qkv_width = (heads + 2 * kv_heads) * hd;
    if (dims[D_SCRATCH] < scratch_elements(dims) || kv_heads < 1 || heads % kv_heads)
        return STEP_SIZES * 1000;
    if (!token_row && n != rows * q) return STEP_SIZES * 1000;
    norm_fn norm = (norm_fn)functions[FN_NORM];
    rotary_fn rotary = (rotary_fn)functions[FN_ROTARY];
    scatter_fn scatter = (scatter_fn)functions[FN_SCATTER];
    attend_fn attend = (attend_fn)functions[FN_ATTEND];
    const int64_t folded_size = rows * heads * q * hd;
    uint16_t *normed = scratch, *qkv = normed + n * d, *folded = qkv + n * qkv_width;
    uint16_t *attended_rows = folded + folded_size, *attended = attended_rows + folded_size;
    uint16_t *projected = attended + n * width, *gate_up = projected + n * d;
    uint16_t *gated = gate_up + n * 2 * ff;
    int status;
    for (int64_t l = 0; l < layers; l++) {
        void *const *p = pointers + l * LAYER_SLOTS;
        /* Attention item. */
        if ((status = norm(hidden, p[NORM_IN], normed, n, d, d, eps[2 * l], DTYPE_BF16,
                           (int)threads)))
            return STEP_NORM_IN * 1000 + status;
        if ((status = ((linear_fn)p[QKV_FN])(normed, p[QKV_W], p[QKV_B], qkv, n, d, qkv_width, d,
                                             qkv_width, (int)threads)))
            return STEP_QKV * 1000 + status;
        uint16_t *key = qkv + width, *value = key + kv_heads * hd;
        if ((status = rotary(qkv, cos, sin, n, heads, hd, qkv_width, DTYPE_BF16)) ||
            (status = rotary(key, cos, sin, n, kv_heads, hd, qkv_width, DTYPE_BF16)))
            return STEP_ROTARY * 1000 + status;
        if ((status = scatter(key, kv[2 * l], write_rows, write_positions, n, kv_heads, hd,
                              qkv_width, dims[D_SLOTS], dims[D_CAPACITY], 2)) ||
            (status = scatter(value, kv[2 * l + 1], write_rows, write_positions, n, kv_heads, hd,
                              qkv_width, dims[D_SLOTS], dims[D_CAPACITY], 2)))
            return STEP_SCATTER * 1000 + status;
        /* Queries folded to (rows, heads, q, hd); a padding query is zeros (it sees one key). */
        if (token_row) memset(folded, 0, (size_t)folded_size * sizeof *folded);
        for (int64_t t = 0; t < n; t++) {
            int64_t r = token_row ? token_row[t] : t / q, s = token_row ? token_step[t] : t % q;
            for (int64_t h = 0; h < heads; h++)
                memcpy(folded + ((r * heads + h) * q + s) * hd, qkv + t * qkv_width + h * hd,
                       (size_t)hd * sizeof *folded);
        }
        if ((status = attend(folded, kv[2 * l], kv[2 * l + 1], attended_rows, lengths, tree_prefix,
                             tree_visible, q, DTYPE_BF16, rows * kv_heads, heads / kv_heads * q, hd,
                             dims[D_CAPACITY] * hd, hd, dims[D_END], dims[D_CHUNK], scale,
                             (int)threads, (int)dims[D_UNIT])))
            return STEP_ATTEND * 1000 + status;
        for (int64_t t = 0; t < n; t++) {
            int64_t r = token_row ? token_row[t] : t / q, s = token_row ? token_step[t] : t % q;
            for (int64_t h = 0; h < heads; h++)
                memcpy(attended + t * width + h * hd, attended_rows + ((r * heads + h) * q + s) * hd,
                       (size_t)hd * sizeof *attended);
        }
        if ((status = ((linear_fn)p[O_FN])(attended, p[O_W], p[O_B], projected, n, width, d, width,
                                           d, (int)threads)))
            return STEP_O * 1000 + status;
        add_into(hidden, projected, n * d);
        /* MLP item: down(silu(gate) * up). */
        if ((status = norm(hidden, p[NORM_POST], normed, n, d, d, eps[2 * l + 1], DTYPE_BF16,
                           (int)threads)))
            return STEP_NORM_POST * 1000 + status;
        if ((status = ((linear_fn)p[GATE_UP_FN])(normed, p[GATE_UP_W], p[GATE_UP_B], gate_up, n, d,
                                                 2 * ff, d, 2 * ff, (int)threads)))
            return STEP_GATE_UP * 1000 + status;
        for (int64_t t = 0; t < n; t++) {
            const uint16_t *gate = gate_up + t * 2 * ff, *up = gate + ff;
            uint16_t *out = gated + t * ff;
            for (int64_t i = 0; i < ff; i++)
                out[i] = f32_to_bf16(bf16_to_f32(silu[gate[i]]) * bf16_to_f32(up[i]));
        }
        if ((status = ((linear_fn)p[DOWN_FN])(gated, p[DOWN_W], p[DOWN_B], projected, n, ff, d, ff,
                                              d, (int)threads)))
            return STEP_DOWN * 1000 + status;
        add_into(hidden, projected, n * d);
    }
    return 0;
}
