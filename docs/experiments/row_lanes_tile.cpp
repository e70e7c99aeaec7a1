// Standalone AVX2 micro-benchmark (docs/performance.md, "Round 3, int8 activations"; build: g++ -O3
// -march=haswell -mtune=znver3 -ffp-contract=off -std=c++17 row_lanes_tile.cpp -o tile; run:
// ./tile K N). Three ways to run 512 int8 activation rows against N rows of 4-bit codes with
// per-block float scales: per (activation row, weight row) pair an 8-lane vector and a float
// convert / multiply / fma each block ("per-pair"); eight weight rows' lanes reduced with vphaddd to
// one vector of eight block totals ("hadd tile", kvserve's decode path); and eight weight rows laid
// out one int32 lane per row, x's four bytes broadcast, vpmaddubsw pairs summed as int16
// ("transposed", kvserve's prefill tile). The last two compute the same exact block totals, so their
// outputs are bitwise equal (printed as t-vs-h). Random data; timing only.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
static inline __m256i ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x)); x = _mm_add_ss(x, _mm_movehdup_ps(x)); return _mm_cvtss_f32(x);
}
template <int R, int C>
void tile8(const int8_t* const* x, const float* const* dx, const uint8_t* const* w, const float* const* dw, int nb, float* y, int ldy) {
    __m256 acc[R][C];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m256i wv[C]; __m256 d[C];
        for (int c = 0; c < C; ++c) { wv[c] = ld(w[c] + 32 * b); d[c] = _mm256_broadcast_ss(dw[c] + b); }
        for (int r = 0; r < R; ++r) {
            __m256i xv = ld(x[r] + 32 * b); __m256 s = _mm256_broadcast_ss(dx[r] + b);
            for (int c = 0; c < C; ++c) {
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[c], xv), ones);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d[c], s), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]);
}
// R rows x 8 weight rows; w8: the 8 rows' codes interleaved per block ([b][c][32]); dwT: [b][8]
template <int R>
void htile(const int8_t* const* x, const float* const* dx, const uint8_t* w8, const float* dwT, int nb, float* y, int ldy) {
    __m256 acc[R];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = w8 + 256 * b;
        const __m256 d = _mm256_loadu_ps(dwT + 8 * b);
        for (int r = 0; r < R; ++r) {
            const __m256i xv = ld(x[r] + 32 * b);
            __m256i p[8];
            for (int c = 0; c < 8; ++c) p[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(ld(wb + 32 * c), xv), ones);
            const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            const __m256i e = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
            // a: [c0..c3 low halves | c0..c3 high halves]; e likewise for c4..c7
            const __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(a, e, 0x20), _mm256_permute2x128_si256(a, e, 0x31));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
// R rows x 8 weight rows; wt: [b][kg 0..7][c 0..7][4 bytes]
template <int R>
void ttile(const int8_t* const* x, const float* const* dx, const uint8_t* wt, const float* dwT, int nb, float* y, int ldy) {
    __m256 acc[R];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = wt + 256 * b;
        const __m256 d = _mm256_loadu_ps(dwT + 8 * b);
        for (int r = 0; r < R; ++r) {
            const int32_t* xb = (const int32_t*)(x[r] + 32 * b);
            __m256i s16 = _mm256_maddubs_epi16(ld(wb), _mm256_set1_epi32(xb[0]));
            for (int g = 1; g < 8; ++g) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(ld(wb + 32 * g), _mm256_set1_epi32(xb[g])));
            const __m256i t = _mm256_madd_epi16(s16, ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_broadcast_ss(dx[r] + b)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
int main(int argc, char** argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 576, N = argc > 2 ? atoi(argv[2]) : 3456, T = 512, nb = K / 32;
    std::vector<int8_t> x8(T * K); std::vector<uint8_t> w8(N * K), wi(N * K), wt(N * K);
    std::vector<float> dx(T * nb, 0.01f), dw(N * nb, 0.02f), dwT(N * nb, 0.02f), y(T * N), y2(T * N), y3(T * N);
    for (auto& v : x8) v = rand() % 254 - 127; for (auto& v : w8) v = rand() % 16;
    for (int n = 0; n < N; ++n) for (int b = 0; b < nb; ++b) { dw[n * nb + b] = 0.01f + (rand() % 100) * 1e-4f; }
    for (int n0 = 0; n0 < N; n0 += 8) for (int b = 0; b < nb; ++b) for (int c = 0; c < 8; ++c) {
        for (int l = 0; l < 32; ++l) wi[n0 * K + 256 * b + 32 * c + l] = w8[(n0 + c) * K + 32 * b + l];
        dwT[n0 * nb + 8 * b + c] = dw[(n0 + c) * nb + b];
        for (int l = 0; l < 32; ++l) wt[n0 * K + 256 * b + 32 * (l / 4) + 4 * c + l % 4] = w8[(n0 + c) * K + 32 * b + l];
    }
    auto run = [&](int which) {
        auto t0 = std::chrono::steady_clock::now();
        if (which == 0) {
            for (int n = 0; n < N; n += 2) for (int t = 0; t < T; t += 4) {
                const int8_t* xr[4]; const float* dxr[4]; const uint8_t* wr[2]; const float* dwr[2];
                for (int r = 0; r < 4; ++r) { xr[r] = &x8[(t + r) * K]; dxr[r] = &dx[(t + r) * nb]; }
                for (int c = 0; c < 2; ++c) { wr[c] = &w8[(n + c) * K]; dwr[c] = &dw[(n + c) * nb]; }
                tile8<4, 2>(xr, dxr, wr, dwr, nb, &y[t * N + n], N);
            }
        } else if (which == 2) {
            for (int n = 0; n < N; n += 8) for (int t = 0; t < T; t += 4) {
                const int8_t* xr[4]; const float* dxr[4];
                for (int r = 0; r < 4; ++r) { xr[r] = &x8[(t + r) * K]; dxr[r] = &dx[(t + r) * nb]; }
                ttile<4>(xr, dxr, &wt[n * K], &dwT[n * nb], nb, &y3[t * N + n], N);
            }
        } else {
            for (int n = 0; n < N; n += 8) for (int t = 0; t < T; t += 4) {
                const int8_t* xr[4]; const float* dxr[4];
                for (int r = 0; r < 4; ++r) { xr[r] = &x8[(t + r) * K]; dxr[r] = &dx[(t + r) * nb]; }
                htile<4>(xr, dxr, &wi[n * K], &dwT[n * nb], nb, &y2[t * N + n], N);
            }
        }
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 7; ++rep) for (int k = 0; k < 3; ++k) best[k] = std::min(best[k], run(k));
    double maxrel = 0; for (int i = 0; i < T * N; ++i) maxrel = std::max(maxrel, (double)std::abs(y[i] - y2[i]) / (std::abs(y[i]) + 1e-3));
    double m3 = 0; for (int i = 0; i < T * N; ++i) m3 = std::max(m3, (double)std::abs(y3[i] - y2[i]) / (std::abs(y2[i]) + 1e-3));
    printf("K=%d N=%d: per-pair %.2f ms, hadd tile %.2f ms, transposed %.2f ms; maxrel %.2g t-vs-h %.2g\n", K, N, best[0] * 1e3, best[1] * 1e3, best[2]*1e3, maxrel, m3);
}
