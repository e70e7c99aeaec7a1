// The decoder's small row-wise ops, fused: RMSNorm (optionally after a residual add), RoPE in the
// rotate-half layout, the gated MLP activations. Each output row is computed from its own input row
// by one fixed sequence of float operations, so results never depend on how many rows a call gets or
// on the thread count (threads only split rows).
#include "ops_simd.h"
#include "team.h"

namespace {

using namespace kvs::simd;

// sum of squares of x[0..dim): W-lane partial sums in d order, then hsum's fixed tree, then the tail
float sum_squares(const float* x, int dim) {
    vf acc = vzero();
    int d = 0;
    for (; d + W <= dim; d += W) {
        vf v = vload(x + d);
        acc = vfma(v, v, acc);
    }
    float total = hsum(acc);
    for (; d < dim; ++d) total += x[d] * x[d];
    return total;
}

void norm_row(const float* x, const float* weight, float eps, int dim, float* out) {
    const float r = 1.0f / std::sqrt(sum_squares(x, dim) / static_cast<float>(dim) + eps);
    const vf rv = vset1(r);
    int d = 0;
    for (; d + W <= dim; d += W) vstore(out + d, vmul(vmul(vload(x + d), rv), vload(weight + d)));
    for (; d < dim; ++d) out[d] = x[d] * r * weight[d];
}

// a parallel region costs microseconds: small calls (decode rows) stay on the calling thread
int threads_for(int64_t rows, int64_t dim, int num_threads) {
    return rows < 2 || rows * dim < 32768 || num_threads < 1 ? 1 : num_threads;
}

// 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), written x / (1 + e^(-2y)) (the same function;
// no cancellation where tanh(y) is near -1)
inline vf gelu_tanh(vf x) {
    vf y = vmul(vset1(0.7978845608028654f), vfma(vmul(vset1(0.044715f), vmul(x, x)), x, x));
    return vdiv(x, vadd(vset1(1.0f), vexp(vmul(vset1(-2.0f), y))));
}

inline vf silu(vf x) { return vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x)))); }

}  // namespace

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows r = (o, i) of a [outer, inner, dim] view
// (e.g. the heads of q for QK-norm): x[r] at o * x_stride + i * dim, out[r] at o * out_stride + i * dim.
// With `residual` (x and residual contiguous [rows, dim]): sum[r] = x[r] + residual[r] is written and
// normalized instead.
KVS_EXPORT void kvs_rms_norm(const float* x, int64_t outer, int inner, int dim, int64_t x_stride,
                             const float* residual, float* sum, const float* weight, float eps, float* out,
                             int64_t out_stride, int num_threads) {
    const int64_t rows = outer * inner;
    kvs::parallel_for(threads_for(rows, dim, num_threads), rows, [&](int64_t r) {
        const int64_t o = r / inner, i = r % inner;
        const float* xr = x + o * x_stride + i * dim;
        if (residual) {
            const float* rr = residual + r * dim;
            float* sr = sum + r * dim;
            int d = 0;
            for (; d + W <= dim; d += W) vstore(sr + d, vadd(vload(xr + d), vload(rr + d)));
            for (; d < dim; ++d) sr[d] = xr[d] + rr[d];
            xr = sr;
        }
        norm_row(xr, weight, eps, dim, out + o * out_stride + i * dim);
    });
}

// RoPE, rotate-half layout, on x [tokens, heads, head_dim] (token stride x_stride, heads contiguous):
// out = x * cos + [x2, x1] * sin with sin's first half negated (model/llama.py's tables, [tokens,
// head_dim] each), then times `scale` for the first `scaled_heads` heads (the queries). The same
// multiplies and add as the torch path (no fma), so the bits equal it.
KVS_EXPORT void kvs_rope(const float* x, int64_t tokens, int heads, int head_dim, int64_t x_stride,
                         const float* cos, const float* sin, int scaled_heads, float scale, float* out,
                         int num_threads) {
    const int half = head_dim / 2;
    const int64_t rows = tokens * heads;
    kvs::parallel_for(threads_for(rows, head_dim, num_threads), rows, [&](int64_t r) {
        const int64_t t = r / heads;
        const int h = static_cast<int>(r % heads);
        const float* xr = x + t * x_stride + static_cast<int64_t>(h) * head_dim;
        const float* c = cos + t * head_dim;
        const float* s = sin + t * head_dim;
        float* o = out + r * head_dim;
        const bool scaled = h < scaled_heads && scale != 1.0f;
        const vf sv = vset1(scale);
        int d = 0;
        if (half % W == 0) {
            for (; d < head_dim; d += W) {
                const int partner = d < half ? d + half : d - half;
                vf v = vadd(vmul(vload(xr + d), vload(c + d)), vmul(vload(xr + partner), vload(s + d)));
                vstore(o + d, scaled ? vmul(v, sv) : v);
            }
        }
        for (; d < head_dim; ++d) {
            const int partner = d < half ? d + half : d - half;
            const float v = xr[d] * c[d] + xr[partner] * s[d];
            o[d] = scaled ? v * scale : v;
        }
    });
}

// out[t] = act(gate[t]) * up[t], gate and up the two halves of x[t] ([tokens, 2 * inter], row stride
// x_stride); act 0 = SiLU, 1 = GELU (tanh approximation). out contiguous [tokens, inter].
KVS_EXPORT void kvs_gated_act(const float* x, int64_t tokens, int inter, int64_t x_stride, int act, float* out,
                              int num_threads) {
    kvs::parallel_for(threads_for(tokens, inter, num_threads), tokens, [&](int64_t t) {
        const float* g = x + t * x_stride;
        const float* u = g + inter;
        float* o = out + t * inter;
        int d = 0;
        for (; d + W <= inter; d += W) {
            vf gv = vload(g + d);
            vstore(o + d, vmul(act ? gelu_tanh(gv) : silu(gv), vload(u + d)));
        }
        for (; d < inter; ++d) {  // the tail through the same vector formula, one lane at a time
            float lane[W] = {};
            lane[0] = g[d];
            vf gv = vload(lane);
            vstore(lane, act ? gelu_tanh(gv) : silu(gv));
            o[d] = lane[0] * u[d];
        }
    });
}
