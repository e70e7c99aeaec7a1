// y[T, N] = x[T, K] @ W^T with W in a GGUF format (the file's own bytes, one row of blocks per output),
// x and y float32. Block formats round each activation row to int8 blocks of 32 once; each thread
// takes a contiguous share of the N weight rows (block formats' prefill: panels of them, handed out
// dynamically), decodes them a few at a time (8-bit codes for block formats, float32 for float
// formats; once per call, whatever T), then runs every tile of up to TILE_ROWS activation rows against
// them (matmul_quant.h's and matmul_tile.h's dot tiles; the block formats' offset terms as a pass of
// their own).
// Invariance: y[t, n] is one dot chain over row t of x and the decoded row n of W, in one order; threads
// split N only, and T and N are tiled without changing any element's operations.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "matmul_direct.h"
#include "matmul_tile.h"

namespace kvs {
namespace {

constexpr int TILE_ROWS = 4;              // activation rows sharing each decoded weight row in registers
constexpr int64_t DIRECT_ROWS = 8;        // up to this many rows: weights decoded in registers, no scratch
constexpr int64_t L1_BYTES = 24 * 1024;  // decoded rows for a few activation rows: stay in L1
constexpr int64_t L2_BYTES = 96 * 1024;  // decoded rows reread by every tile of a prefill chunk: in L2
constexpr int64_t PANELS_PER_THREAD = 4;  // prefill: weight panels a thread takes at least (dynamically)

// Float formats: rows decoded to float32 (F32 read in place), float activations
void run_float(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T, float* y,
               int64_t ldy, int nthreads) {
    const int64_t row_bytes = K / geometry(type).block * geometry(type).bytes;
    const bool direct = type == T_F32;
    const int64_t rows_per_block = std::max<int64_t>(8, (T <= TILE_ROWS ? L1_BYTES : L2_BYTES) / (4 * K));
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t per = (N + nth - 1) / nth;
        const int64_t lo = std::min(N, tid * per), hi = std::min(N, lo + per);
        thread_local std::vector<float> scratch;  // OpenMP's threads persist: grown once
        if (!direct && int64_t(scratch.size()) < rows_per_block * K) scratch.resize(rows_per_block * K);
        std::vector<const float*> wrows(rows_per_block);
        for (int64_t n0 = lo; n0 < hi; n0 += rows_per_block) {
            const int64_t nw = std::min(hi, n0 + rows_per_block) - n0;
            for (int64_t j = 0; j < nw; ++j) {
                const uint8_t* row = w + (n0 + j) * row_bytes;
                if (direct) {
                    wrows[j] = reinterpret_cast<const float*>(row);
                } else {
                    decode_row(type, row, K, &scratch[j * K]);
                    wrows[j] = &scratch[j * K];
                }
            }
            for (int64_t t = 0; t < T; t += TILE_ROWS) {
                const float* xr[TILE_ROWS];
                const int nr = int(std::min<int64_t>(TILE_ROWS, T - t));
                for (int r = 0; r < nr; ++r) xr[r] = x + (t + r) * ldx;
                float* yt = y + t * ldy + n0;
                switch (nr) {
                    case 4: dot_panel<4>(xr, wrows.data(), nw, K, yt, ldy); break;
                    case 3: dot_panel<3>(xr, wrows.data(), nw, K, yt, ldy); break;
                    case 2: dot_panel<2>(xr, wrows.data(), nw, K, yt, ldy); break;
                    default: dot_panel<1>(xr, wrows.data(), nw, K, yt, ldy); break;
                }
            }
        }
    }
}

#if KVS_SIMD
// Up to DIRECT_ROWS activation rows: every weight row decoded in registers and dotted as it streams in
// (a decode step is bound by reading the weights once; a scratch copy would be a second pass)
void run_quant_direct(int type, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t nb, const XRow* xrows,
                      int64_t T, float* y, int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t per = (N + nth - 1) / nth;
        const int64_t lo = std::min(N, tid * per), hi = std::min(N, lo + per);
        thread_local std::vector<float> off;  // per-block offsets of the weight rows in flight
        if (int64_t(off.size()) < DIRECT_GROUP * nb) off.resize(DIRECT_GROUP * nb);
        switch (T) {
            case 1: qdot_direct_rows<1>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 2: qdot_direct_rows<2>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 3: qdot_direct_rows<3>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 4: qdot_direct_rows<4>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 5: qdot_direct_rows<5>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 6: qdot_direct_rows<6>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            case 7: qdot_direct_rows<7>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
            default: qdot_direct_rows<8>(type, w, row_bytes, lo, hi, nb, xrows, off.data(), y, ldy); break;
        }
    }
}
#endif

#if KVS_SIMD
// y[j] += sum_b off[j][b] * s[b] for the nw decoded rows of a panel, eight rows a vector: offT holds
// the panel's offsets transposed ([nb][ldo], rows past nw zero); offset_dots8 keeps offset_dot's
// chain, so adding it to a tile's offset-free result is the tile's own result.
inline void add_offsets(const float* offT, int64_t ldo, int64_t nw, int64_t nb, const float* s, float* y) {
    for (int64_t j = 0; j < nw; j += 8) {
        const __m256 v = offset_dots8(offT + j, ldo, nb, s);
        if (j + 8 <= nw) {
            _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), v));
        } else {
            alignas(32) float tail[8];
            _mm256_store_ps(tail, v);
            for (int64_t c = 0; c < nw - j; ++c) y[j + c] = y[j + c] + tail[c];
        }
    }
}
#endif

// the tiles of format Q for up to TILE_ROWS activation rows against one group of decoded weight rows
using GroupFn = void (*)(const XRow*, const QGroup&, int, int64_t, float*, int64_t);

template <int Q>
constexpr GroupFn group_fns[TILE_ROWS] = {qdot_group<Q, 1>, qdot_group<Q, 2>, qdot_group<Q, 3>, qdot_group<Q, 4>};

inline const GroupFn* group_fns_of(int type) {
    switch (type) {
        case T_Q4_0: return group_fns<T_Q4_0>;
        case T_Q4_1: return group_fns<T_Q4_1>;
        case T_Q5_0: return group_fns<T_Q5_0>;
        case T_Q5_1: return group_fns<T_Q5_1>;
        case T_Q8_0: return group_fns<T_Q8_0>;
        case T_Q4_K: return group_fns<T_Q4_K>;
        case T_Q5_K: return group_fns<T_Q5_K>;
        default: return group_fns<T_Q6_K>;
    }
}

// Block formats: activations rounded to int8 blocks once, rows decoded to 8-bit codes
void run_quant(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T, float* y,
               int64_t ldy, int nthreads) {
    const Geometry g = geometry(type);
    const int64_t row_bytes = K / g.block * g.bytes, nb = K / 32;
    thread_local XBlocks caller_blocks;  // the calling thread's; the workers below write into it
    XBlocks& xb = caller_blocks;
    xb.fit(T, K);
    std::vector<XRow> xrows(T);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; ++t) {
        quantize_row(x + t * ldx, K, xb, t);
        xrows[t] = xb.row(t, K);
    }
    const bool offsets = has_offset(type);
#if KVS_SIMD
    if (T <= DIRECT_ROWS) {
        run_quant_direct(type, w, row_bytes, N, nb, xrows.data(), T, y, ldy, nthreads);
        return;
    }
#endif
    const int64_t gbytes = qgroup_bytes(K);
    // panels of weight rows (whole groups) handed out one at a time, at least PANELS_PER_THREAD a
    // thread: on a shared host a thread that loses its core leaves the rest of its panels to the other
    const int64_t per_thread = (N + PANELS_PER_THREAD * nthreads - 1) / (PANELS_PER_THREAD * nthreads);
    const int64_t rows_per_block =
        (std::max<int64_t>(TILE_GROUP, std::min(TILE_GROUP * (T <= TILE_ROWS ? L1_BYTES : L2_BYTES) / gbytes, per_thread)) +
         TILE_GROUP - 1) / TILE_GROUP * TILE_GROUP;
    const int64_t num_panels = (N + rows_per_block - 1) / rows_per_block;
    const GroupFn* group_fn = group_fns_of(type);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        thread_local std::vector<uint8_t> scratch;  // the panel's decoded groups
        if (int64_t(scratch.size()) < rows_per_block / TILE_GROUP * gbytes) scratch.resize(rows_per_block / TILE_GROUP * gbytes);
        // the offsets' dot runs as its own pass over eight rows a vector (SIMD builds): the tiles skip it
        const bool split_offsets = KVS_SIMD && offsets;
        const int64_t ldo = rows_per_block;
        thread_local std::vector<float> offT;  // [nb][ldo] the panel's offsets, transposed
        if (split_offsets && int64_t(offT.size()) < nb * ldo) offT.resize(nb * ldo);
#pragma omp for schedule(dynamic, 1)
        for (int64_t panel = 0; panel < num_panels; ++panel) {
            const int64_t n0 = panel * rows_per_block, nw = std::min(N, n0 + rows_per_block) - n0;
            const int64_t groups = (nw + TILE_GROUP - 1) / TILE_GROUP;
            // a last group short of rows repeats the panel's last row (its outputs are not kept)
            for (int64_t j = 0; j < groups * TILE_GROUP; ++j) {
                const QGroup g = qgroup_at(&scratch[j / TILE_GROUP * gbytes], K);
                decode_row_q(type, w + (n0 + std::min(j, nw - 1)) * row_bytes, K, g, int(j % TILE_GROUP));
                if (split_offsets)
                    for (int64_t b = 0; b < nb; ++b) offT[b * ldo + j] = j < nw ? g.off[(j % TILE_GROUP) * nb + b] : 0.0f;
            }
            for (int64_t t = 0; t < T; t += TILE_ROWS) {
                const XRow* xr = &xrows[t];
                float* yt = y + t * ldy + n0;
                const int64_t nr = std::min<int64_t>(TILE_ROWS, T - t);
                for (int64_t gi = 0; gi < groups; ++gi)
                    group_fn[nr - 1](xr, qgroup_at(&scratch[gi * gbytes], K), int(std::min<int64_t>(TILE_GROUP, nw - TILE_GROUP * gi)),
                                     nb, yt + TILE_GROUP * gi, ldy);
#if KVS_SIMD
                if (split_offsets)
                    for (int64_t r = 0; r < nr; ++r) add_offsets(offT.data(), ldo, nw, nb, xr[r].s, yt + r * ldy);
#endif
            }
        }
    }
}

void run(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T, float* y,
         int64_t ldy, int nthreads) {
    nthreads = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, (N + 7) / 8)));
    if (is_float_type(type)) {
        run_float(type, w, N, K, x, ldx, T, y, ldy, nthreads);
    } else {
        run_quant(type, w, N, K, x, ldx, T, y, ldy, nthreads);
    }
}

}  // namespace
}  // namespace kvs

using namespace kvs;

// 1 if the kernels run weights of ggml type `type`
KVS_EXPORT int kvs_matmul_supported(int type) { return geometry(type).block != 0; }

// y[t * ldy + n] = sum_k x[t * ldx + k] * W[n, k]; W: N rows of K / block blocks (block formats see x
// as int8 blocks of 32, `kvs_quantize_activations`). 0, or -1 for an unsupported type, -2 for K not a multiple of the
// type's block.
KVS_EXPORT int kvs_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
                          float* y, int64_t ldy, int nthreads) {
    const Geometry g = geometry(type);
    if (g.block == 0) return -1;
    if (K % g.block != 0) return -2;
    if (T <= 0 || N <= 0) return 0;
    run(type, w, N, K, x, ldx, T, y, ldy, std::max(1, nthreads));
    return 0;
}

// out[i, :] = W[rows[i], :] as float32, decoded as the matmul decodes (token embedding lookups; tests
// against gguf's reference)
KVS_EXPORT int kvs_dequantize_rows(int type, const uint8_t* w, int64_t K, const int64_t* rows, int64_t n,
                                   float* out) {
    const Geometry g = geometry(type);
    if (g.block == 0) return -1;
    if (K % g.block != 0) return -2;
    const int64_t row_bytes = K / g.block * g.bytes;
    for (int64_t i = 0; i < n; ++i) decode_row(type, w + rows[i] * row_bytes, K, out + i * K);
    return 0;
}

// x as the block formats see it: q [T, K] int8, d [T, K / 32], mult [T, K / 2] int16 (x ~ q * m * d,
// m of each pair of elements; tests bound the error)
KVS_EXPORT int kvs_quantize_activations(const float* x, int64_t T, int64_t K, int8_t* q, float* d, int16_t* mult) {
    if (K % 32 != 0) return -2;
    XBlocks xb(T, K);
    for (int64_t t = 0; t < T; ++t) quantize_row(x + t * K, K, xb, t);
    std::copy_n(xb.q.begin(), T * K, q);
    std::copy_n(xb.d.begin(), T * K / 32, d);
    std::copy_n(xb.mult.begin(), T * K / 2, mult);
    return 0;
}
