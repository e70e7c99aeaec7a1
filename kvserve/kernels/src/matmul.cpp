// y[T, N] = x[T, K] @ W^T with W in a GGUF block format (the file's own bytes, one row of blocks per
// output), x and y float32. Block formats quantize each activation row to int8 blocks of 32 first.
// Invariance: y[t, n] is one dot_* call whose arithmetic depends only on row t of x and row n of W;
// threads split N only, and T is tiled by rows without changing any element's operations.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "matmul_quant.h"

namespace kvs {
namespace {

constexpr int TILE_ROWS = 4;           // activation rows sharing one decoded weight block
constexpr int64_t BLOCK_BYTES = 1 << 15;  // weight rows a thread keeps in cache while T is walked

// One row, two levels per block of 32: q = round(x / d), d = max|x| / 127, then the residual
// q2 = round((x - q d) / d2), d2 = d / 250: x ~ q d + q2 d2 within d / 500 (the same ops on every ISA)
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s16, float* sd, int8_t* q2, float* d2,
                  int32_t* s16_2, float* sd2) {
    for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + 32 * b;
        float amax = 0.0f;
#if KVS_SIMD
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 32; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        amax = _mm_cvtss_f32(m4);
#else
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
        const float db = amax / 127.0f;
        const float id = db > 0.0f ? 1.0f / db : 0.0f;
        int8_t* qb = q + 32 * b;
#if KVS_SIMD
        __m256i v[4];
        for (int i = 0; i < 4; ++i) {
            __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(id));
            s = _mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            s = _mm256_min_ps(_mm256_max_ps(s, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            v[i] = _mm256_cvtps_epi32(s);
        }
        // packs interleave 128-bit lanes; the permute puts the 32 bytes back in element order
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        for (int i = 0; i < 32; ++i) {
            const float s = std::nearbyint(xb[i] * id);
            qb[i] = int8_t(std::min(127.0f, std::max(-127.0f, s)));
        }
#endif
        const float db2 = db / 250.0f;  // |x - q d| <= d / 2 (1 + eps): fits 125 steps, no clamp
        const float id2 = db > 0.0f ? 250.0f / db : 0.0f;
        int8_t* qb2 = q2 + 32 * b;
        for (int i = 0; i < 32; ++i) {
            const float s = std::nearbyint((xb[i] - float(qb[i]) * db) * id2);
            qb2[i] = int8_t(std::min(127.0f, std::max(-127.0f, s)));
        }
        int32_t lo = 0, hi = 0, lo2 = 0, hi2 = 0;
        for (int i = 0; i < 16; ++i) {
            lo += qb[i];
            hi += qb[i + 16];
            lo2 += qb2[i];
            hi2 += qb2[i + 16];
        }
        d[b] = db;
        s16[2 * b] = lo;
        s16[2 * b + 1] = hi;
        sd[b] = db * float(lo + hi);
        d2[b] = db2;
        s16_2[2 * b] = lo2;
        s16_2[2 * b + 1] = hi2;
        sd2[b] = db2 * float(lo2 + hi2);
    }
}

// rows[2 t + l]: level l of activation row t
struct ActBuffer {
    std::vector<int8_t> q;
    std::vector<float> d, sd;
    std::vector<int32_t> s16;
    std::vector<ActRow> rows;

    ActBuffer(const float* x, int64_t ldx, int64_t T, int64_t K, int nthreads)
        : q(2 * T * K), d(2 * T * K / 32), sd(2 * T * K / 32), s16(2 * T * K / 16), rows(2 * T) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 1)
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t l = 0; l < 2; ++l) {
                const int64_t i = 2 * t + l;
                rows[i] = ActRow{&q[i * K], &d[i * K / 32], &s16[i * K / 16], &sd[i * K / 32]};
            }
            const ActRow& a = rows[2 * t];
            const ActRow& b = rows[2 * t + 1];
            quantize_row(x + t * ldx, K, const_cast<int8_t*>(a.q), const_cast<float*>(a.d),
                         const_cast<int32_t*>(a.s16), const_cast<float*>(a.sd), const_cast<int8_t*>(b.q),
                         const_cast<float*>(b.d), const_cast<int32_t*>(b.s16), const_cast<float*>(b.sd));
        }
    }
};

template <int NR>
void tile(int type, const uint8_t* wrow, const ActRow* x, const float* const* xf, int64_t K, float* out) {
    if (is_float_type(type)) {
        dot_float<NR>(type, wrow, xf, K, out);
    } else if (x == nullptr) {
        dot_blocks_float<NR>(type, wrow, xf, K, out);
    } else {  // both levels of each row as rows of their own, then their sum
        float o[2 * NR];
        dot_quant<2 * NR>(type, wrow, x, K, o);
        for (int r = 0; r < NR; ++r) out[r] = o[2 * r] + o[2 * r + 1];
    }
}

void run(int type, const uint8_t* w, int64_t N, int64_t K, const ActRow* x, const float* const* xf, int64_t T,
         float* y, int64_t ldy, int nthreads) {
    const int64_t row_bytes = K / geometry(type).block * geometry(type).bytes;
    // weight blocks: a multiple of the thread count, each small enough to stay in cache while T is walked
    int64_t nblk = std::max<int64_t>(1, (N * row_bytes + BLOCK_BYTES - 1) / BLOCK_BYTES);
    nblk = std::min(N, (nblk + nthreads - 1) / nthreads * nthreads);
    const int64_t per = (N + nblk - 1) / nblk;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t ib = 0; ib < nblk; ++ib) {
        const int64_t n0 = ib * per, n1 = std::min(N, n0 + per);
        for (int64_t t = 0; t < T; t += TILE_ROWS) {
            const int nr = int(std::min<int64_t>(TILE_ROWS, T - t));
            const ActRow* xt = x != nullptr ? x + 2 * t : nullptr;
            const float* const* xft = xf != nullptr ? xf + t : nullptr;
            for (int64_t n = n0; n < n1; ++n) {
                float o[TILE_ROWS];
                const uint8_t* wrow = w + n * row_bytes;
                switch (nr) {
                    case 4: tile<4>(type, wrow, xt, xft, K, o); break;
                    case 3: tile<3>(type, wrow, xt, xft, K, o); break;
                    case 2: tile<2>(type, wrow, xt, xft, K, o); break;
                    default: tile<1>(type, wrow, xt, xft, K, o); break;
                }
                for (int r = 0; r < nr; ++r) y[(t + r) * ldy + n] = o[r];
            }
        }
    }
}

}  // namespace
}  // namespace kvs

using namespace kvs;

// 1 if the kernels run weights of ggml type `type`
KVS_EXPORT int kvs_matmul_supported(int type) { return geometry(type).block != 0; }

// y[t * ldy + n] = sum_k x[t * ldx + k] * W[n, k]; W: N rows of K / block blocks. float_act: block
// formats take x in float32 too (no int8 rounding: slower, for the lm_head). 0, or -1 for an
// unsupported type, -2 for K not a multiple of the type's block.
KVS_EXPORT int kvs_matmul(int type, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T,
                          float* y, int64_t ldy, int nthreads, int float_act) {
    const Geometry g = geometry(type);
    if (g.block == 0) return -1;
    if (K % g.block != 0 || (!is_float_type(type) && K % 32 != 0)) return -2;
    if (T <= 0 || N <= 0) return 0;
    nthreads = std::max(1, nthreads);
    if (is_float_type(type) || float_act) {
        std::vector<const float*> rows(T);
        for (int64_t t = 0; t < T; ++t) rows[t] = x + t * ldx;
        run(type, w, N, K, nullptr, rows.data(), T, y, ldy, nthreads);
    } else {
        ActBuffer act(x, ldx, T, K, nthreads);
        run(type, w, N, K, act.rows.data(), nullptr, T, y, ldy, nthreads);
    }
    return 0;
}

// out[i, :] = W[rows[i], :] as float32 (token embedding lookups; tests against gguf's reference)
KVS_EXPORT int kvs_dequantize_rows(int type, const uint8_t* w, int64_t K, const int64_t* rows, int64_t n,
                                   float* out) {
    const Geometry g = geometry(type);
    if (g.block == 0) return -1;
    if (K % g.block != 0) return -2;
    const int64_t row_bytes = K / g.block * g.bytes;
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* row = w + rows[i] * row_bytes;
        for (int64_t k = 0; k < K; ++k) out[i * K + k] = dequant_one(type, row, k);
    }
    return 0;
}

// The two int8 levels the block formats see x as: q, q2 [T, K], d, d2 [T, K / 32] (tests bound the error)
KVS_EXPORT int kvs_quantize_activations(const float* x, int64_t T, int64_t K, int8_t* q, float* d, int8_t* q2,
                                        float* d2) {
    if (K % 32 != 0) return -2;
    std::vector<int32_t> s16(K / 16), s16_2(K / 16);
    std::vector<float> sd(K / 32), sd2(K / 32);
    for (int64_t t = 0; t < T; ++t) {
        quantize_row(x + t * K, K, q + t * K, d + t * K / 32, s16.data(), sd.data(), q2 + t * K, d2 + t * K / 32,
                     s16_2.data(), sd2.data());
    }
    return 0;
}
