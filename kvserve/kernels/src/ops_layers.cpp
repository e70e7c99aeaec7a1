// The decoder's layers for a few rows in one native call: per layer the input norm (after the
// residual add), the fused QKV matmul, RoPE, paged attention with the K/V write, the output
// projection, the add + MLP norm, gate+up, the gated activation and the down projection, then the
// final norm. Each step calls the same entry points, with the same arguments, that the per-op path
// calls from Python (model/llama.py), so the bits are the same; what goes away is the Python and
// ctypes cost between them (a decode step was ~270 wrapper calls).
#include "common.h"

namespace {

int linear(const KvsLinear& w, const float* x, int64_t rows, float* y, int num_threads) {
    if (const int rc = kvs::matmul_linear(w, x, rows, y, num_threads)) return rc;
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
    KvsAttention attention{};
    attention.q = s.qk;
    attention.q_row_stride = qk_width;
    attention.out = s.attn;
    attention.num_rows = t;
    attention.heads = heads;
    attention.kv_heads = kvh;
    attention.head_dim = hd;
    attention.page_size = static_cast<int32_t>(s.page_size);
    attention.window = static_cast<int32_t>(rows.window);
    attention.codec = static_cast<int32_t>(s.codec);
    attention.k_data = l.k_data;
    attention.v_data = l.v_data;
    attention.positions = rows.positions;
    attention.table_offsets = rows.table_offsets;
    attention.table_first = rows.table_first;
    attention.tables = rows.tables;
    attention.scale = s.attn_scale;
    attention.k_new = s.qk + static_cast<int64_t>(heads) * hd;  // the step's K/V rows, written by the kernel
    attention.v_new = s.qkv + qk_width;
    attention.k_new_stride = qk_width;
    attention.v_new_stride = qkv_width;
    attention.slot_mapping = rows.slot_mapping;
    attention.schedule = KVS_SCHEDULE_AUTO;
    attention.num_threads = nt;
    rc = kvs_paged_attention(&attention);
    if (rc) return 100 + rc;
    rc = linear(l.o_proj, s.attn, t, s.m, nt);  // m: the attention output, added to h by the next norm
    if (rc) return rc;
    // (in place: a row's norm reads the whole row before it writes it)
    if (l.attn_out_norm) kvs_rms_norm(s.m, t, 1, dim, hidden, nullptr, nullptr, l.attn_out_norm, s.eps, s.m, hidden, nt);
    kvs_rms_norm(s.h, t, 1, dim, hidden, s.m, s.h, l.post_attention_norm, s.eps, s.normed, hidden, nt);
    rc = linear(l.gate_up, s.normed, t, s.gate_up, nt);
    if (rc) return rc;
    kvs_gated_act(s.gate_up, t, static_cast<int>(s.inter), 2 * s.inter, static_cast<int>(s.activation), s.act_out, nt);
    rc = linear(l.down, s.act_out, t, s.m, nt);
    if (!rc && l.mlp_out_norm) kvs_rms_norm(s.m, t, 1, dim, hidden, nullptr, nullptr, l.mlp_out_norm, s.eps, s.m, hidden, nt);
    return rc;
}

}  // namespace

// Runs the step's rows through layers[0..num_layers) and the final norm into s->out. 0, else the
// failing kernel's code (matmul's; attention's + 100).
KVS_EXPORT int kvs_decoder_layers(const KvsLayer* layers, const KvsStep* s) {
    const int64_t hd = s->head_dim, half = hd / 2, t_rows = s->rows;
    for (int64_t r = 0; r < 2; ++r) {  // each row's RoPE angles, looked up once for every layer, widened
        if (!s->cos_table[r]) continue;
        for (int64_t t = 0; t < t_rows; ++t) {
            const int64_t at = s->row_sets[0].positions[t] * half;
            const float *cos_at = s->cos_table[r] + at, *sin_at = s->sin_table[r] + at;
            float *cos_row = s->cos + (r * t_rows + t) * hd, *sin_row = s->sin + (r * t_rows + t) * hd;
            for (int64_t i = 0; i < half; ++i) {  // model/llama.py Rotary.forward's rows
                cos_row[i] = cos_row[half + i] = cos_at[i];
                sin_row[i] = -sin_at[i];
                sin_row[half + i] = sin_at[i];
            }
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
