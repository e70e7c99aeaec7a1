// The decoder's layers for a few rows in one native call: per layer the input norm (after the
// residual add), the fused QKV matmul, RoPE, paged attention with the K/V write, the output
// projection, the add + MLP norm, gate+up, the gated activation and the down projection, then the
// final norm. Each step calls the same entry points, with the same arguments, that the per-op path
// calls from Python (model/llama.py), so the bits are the same; what goes away is the Python and
// ctypes cost between them (a decode step was ~270 wrapper calls).
#include "common.h"
#include <cstring>

extern "C" {
void kvs_rms_norm(const float* x, int64_t outer, int inner, int dim, int64_t x_stride, const float* residual,
                  float* sum, const float* weight, float eps, float* out, int64_t out_stride, int num_threads);
void kvs_rope(const float* x, int64_t tokens, int heads, int head_dim, int64_t x_stride, const float* cos,
              const float* sin, int scaled_heads, float scale, float* out, int num_threads);
void kvs_gated_act(const float* x, int64_t tokens, int inter, int64_t x_stride, int act, float* out,
                   int num_threads);
int kvs_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T, float* y,
               int64_t ldy, int nthreads);
int kvs_paged_attention(
    const float* q, int64_t q_row_stride, float* out, int64_t num_rows, int heads, int kv_heads, int head_dim,
    int page_size, int window, int codec, const void* k_data, const void* v_data, const float* k_scales,
    const float* v_scales, const float* k_table, const float* v_table, const int64_t* positions,
    const int64_t* table_offsets, const int64_t* table_first, const int64_t* tables, const float* k_own,
    const float* v_own, const int64_t* own_index, float scale, const float* k_new, const float* v_new,
    int64_t k_new_stride, int64_t v_new_stride, const int64_t* slot_mapping, int schedule, int num_threads);
}

namespace {

constexpr int kMaxParts = 4;

}  // namespace

// A linear layer's weight: parts stacked by rows, each in its own ggml format, filling its columns
// of one output, then the bias if any (kernels/layers.py's _Linear mirrors this).
struct KvsLinear {
    int64_t num_parts;
    int64_t in_features;
    int64_t out_features;
    int64_t qtypes[kMaxParts];
    const uint8_t* weights[kMaxParts];
    int64_t rows[kMaxParts];
    const float* bias;  // [out_features] or null
};

// Which keys a layer's rows attend and where their K/V rows go: the full-attention layers' set, or
// a sliding window's (its own block tables with the hybrid pool).
struct KvsRows {
    const int64_t* positions;
    const int64_t* table_offsets;
    const int64_t* table_first;
    const int64_t* tables;
    const int64_t* slot_mapping;
    int64_t window;  // 0: none
};

// One layer's weights and KV pages (_Layer). The optional norms are null where the model has none:
// QK-norm (Qwen3, Gemma 3), the norms of the attention and MLP outputs (Gemma).
struct KvsLayer {
    KvsLinear qkv, o_proj, gate_up, down;
    const float* input_norm;
    const float* post_attention_norm;
    const float* q_norm;
    const float* k_norm;
    const float* attn_out_norm;
    const float* mlp_out_norm;
    const void* k_data;
    const void* v_data;
    int64_t rows_set;  // index into KvsStep::row_sets
    int64_t rope_set;  // 0: the global RoPE tables, 1: the sliding-window layers' own
};

// What every layer of the step shares: shapes, the rows' RoPE tables and attention rows, and the
// scratch every layer reuses (_Step). h and m: the residual stream, h + m the next layer's input.
struct KvsStep {
    int64_t rows;
    int64_t num_layers;
    int64_t hidden, heads, kv_heads, head_dim, inter, page_size, codec, act, num_threads;
    float eps, q_scale, attn_scale, pad;
    KvsRows row_sets[2];
    const float* cos_table[2];  // [positions, head_dim]: model/llama.py's Rotary tables
    const float* sin_table[2];
    const float* final_norm;
    float *h, *m, *normed, *qkv, *qk_normed, *qk, *attn, *gate_up, *act_out, *out;
    float *cos, *sin;  // [2, rows, head_dim]: each row's angles from each table
};

namespace {

int linear(const KvsLinear& w, const float* x, int64_t rows, float* y, int num_threads) {
    int64_t col = 0;
    for (int64_t p = 0; p < w.num_parts; ++p) {
        const int rc = kvs_matmul(static_cast<int>(w.qtypes[p]), w.weights[p], w.rows[p], w.in_features, x,
                                  w.in_features, rows, y + col, w.out_features, num_threads);
        if (rc) return rc;
        col += w.rows[p];
    }
    if (w.bias) {  // y + bias, as the per-op path adds it after the matmul
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t n = 0; n < w.out_features; ++n) y[t * w.out_features + n] += w.bias[n];
    }
    return 0;
}

int layer(const KvsLayer& l, const KvsStep& s, bool first) {
    const int64_t t = s.rows, hidden = s.hidden;
    const int nt = static_cast<int>(s.num_threads), hd = static_cast<int>(s.head_dim);
    const int heads = static_cast<int>(s.heads), kvh = static_cast<int>(s.kv_heads), dim = static_cast<int>(hidden);
    const int64_t qkv_width = l.qkv.out_features, qk_width = static_cast<int64_t>(heads + kvh) * hd;
    const KvsRows& rows = s.row_sets[l.rows_set];
    // the layer's input h (+ m, the last layer's MLP output), normed
    kvs_rms_norm(s.h, t, 1, dim, hidden, first ? nullptr : s.m, first ? nullptr : s.h, l.input_norm, s.eps,
                 s.normed, hidden, nt);
    int rc = linear(l.qkv, s.normed, t, s.qkv, nt);  // [T, (H + 2 KVH) hd]
    if (rc) return rc;
    const float* rope_in = s.qkv;
    int64_t rope_stride = qkv_width;
    if (l.q_norm) {  // each head's own norm, the normed Q and K heads side by side [T, H + KVH, hd]
        kvs_rms_norm(s.qkv, t, heads, hd, qkv_width, nullptr, nullptr, l.q_norm, s.eps, s.qk_normed, qk_width, nt);
        kvs_rms_norm(s.qkv + static_cast<int64_t>(heads) * hd, t, kvh, hd, qkv_width, nullptr, nullptr, l.k_norm,
                     s.eps, s.qk_normed + static_cast<int64_t>(heads) * hd, qk_width, nt);
        rope_in = s.qk_normed;
        rope_stride = qk_width;
    }
    const int64_t table = l.rope_set * t * hd;
    kvs_rope(rope_in, t, heads + kvh, hd, rope_stride, s.cos + table, s.sin + table, heads, s.q_scale, s.qk,
             nt);  // [T, H + KVH, hd]
    rc = kvs_paged_attention(s.qk, qk_width, s.attn, t, heads, kvh, hd, static_cast<int>(s.page_size),
                             static_cast<int>(rows.window), static_cast<int>(s.codec), l.k_data, l.v_data, nullptr,
                             nullptr, nullptr, nullptr, rows.positions, rows.table_offsets, rows.table_first,
                             rows.tables, nullptr, nullptr, nullptr, s.attn_scale,
                             s.qk + static_cast<int64_t>(heads) * hd, s.qkv + qk_width, qk_width, qkv_width,
                             rows.slot_mapping, 0, nt);
    if (rc) return 100 + rc;
    rc = linear(l.o_proj, s.attn, t, s.m, nt);  // m: the attention output, added to h by the next norm
    if (rc) return rc;
    // (in place: a row's norm reads the whole row before it writes it)
    if (l.attn_out_norm) kvs_rms_norm(s.m, t, 1, dim, hidden, nullptr, nullptr, l.attn_out_norm, s.eps, s.m, hidden, nt);
    kvs_rms_norm(s.h, t, 1, dim, hidden, s.m, s.h, l.post_attention_norm, s.eps, s.normed, hidden, nt);
    rc = linear(l.gate_up, s.normed, t, s.gate_up, nt);
    if (rc) return rc;
    kvs_gated_act(s.gate_up, t, static_cast<int>(s.inter), 2 * s.inter, static_cast<int>(s.act), s.act_out, nt);
    rc = linear(l.down, s.act_out, t, s.m, nt);
    if (!rc && l.mlp_out_norm) kvs_rms_norm(s.m, t, 1, dim, hidden, nullptr, nullptr, l.mlp_out_norm, s.eps, s.m, hidden, nt);
    return rc;
}

}  // namespace

// Runs the step's rows through layers[0..num_layers) and the final norm into s->out. 0, else the
// failing kernel's code (matmul's; attention's + 100).
KVS_EXPORT int kvs_decoder_layers(const KvsLayer* layers, const KvsStep* s) {
    const int64_t hd = s->head_dim, t_rows = s->rows;
    for (int64_t r = 0; r < 2; ++r) {  // each row's RoPE angles, looked up once for every layer
        if (!s->cos_table[r]) continue;
        for (int64_t t = 0; t < t_rows; ++t) {
            const int64_t at = s->row_sets[0].positions[t] * hd;
            std::memcpy(s->cos + (r * t_rows + t) * hd, s->cos_table[r] + at, hd * sizeof(float));
            std::memcpy(s->sin + (r * t_rows + t) * hd, s->sin_table[r] + at, hd * sizeof(float));
        }
    }
    for (int64_t i = 0; i < s->num_layers; ++i) {
        const int rc = layer(layers[i], *s, i == 0);
        if (rc) return rc;
    }
    kvs_rms_norm(s->h, s->rows, 1, static_cast<int>(s->hidden), s->hidden, s->m, s->h, s->final_norm, s->eps,
                 s->out, s->hidden, static_cast<int>(s->num_threads));
    return 0;
}

// sizeof of the argument structs, checked by kernels/ops.py against its ctypes mirrors
KVS_EXPORT int64_t kvs_decoder_layers_struct_sizes() {
    return static_cast<int64_t>(sizeof(KvsLayer)) * 1000 + static_cast<int64_t>(sizeof(KvsStep));
}
