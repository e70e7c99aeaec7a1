// Standalone AVX2 micro-benchmark (docs/performance.md, "the host heap"; build: g++ -O3 -march=haswell
// -ffp-contract=off -std=c++17 u8s8_tile.cpp -o tile; run: ./tile K N): the int16 prefill tile (kvserve's arithmetic) against a u8 x s8 tile
// (vpmaddubsw + vpmaddwd, llama.cpp's), R=4 activation rows x C=2 weight rows per tile, per-block float
// scales. Random data; timing only (the two compute different roundings of x).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
static inline __m256i ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x)); x = _mm_add_ss(x, _mm_movehdup_ps(x)); return _mm_cvtss_f32(x);
}
template <int R, int C>
void tile16(const int16_t* const* x, const float* const* dx, const int16_t* const* w, const float* const* dw, int nb, float* y, int ldy) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m256i w0[C], w1[C]; __m256 d[C];
        for (int c = 0; c < C; ++c) { w0[c] = ld(w[c] + 32 * b); w1[c] = ld(w[c] + 32 * b + 16); d[c] = _mm256_broadcast_ss(dw[c] + b); }
        for (int r = 0; r < R; ++r) {
            __m256i x0 = ld(x[r] + 32 * b), x1 = ld(x[r] + 32 * b + 16); __m256 s = _mm256_broadcast_ss(dx[r] + b);
            for (int c = 0; c < C; ++c) {
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[c], x0), _mm256_madd_epi16(w1[c], x1));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d[c], s), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) y[r * ldy + c] = hsum8(acc[r][c]);
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
int main(int argc, char** argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 576, N = argc > 2 ? atoi(argv[2]) : 3456, T = 512, nb = K / 32;
    std::vector<int16_t> x16(T * K), w16(N * K); std::vector<int8_t> x8(T * K); std::vector<uint8_t> w8(N * K);
    std::vector<float> dx(T * nb, 0.01f), dw(N * nb, 0.02f), y(T * N);
    for (auto& v : x16) v = rand() % 60000 - 30000; for (auto& v : w16) v = rand() % 16;
    for (auto& v : x8) v = rand() % 254 - 127; for (auto& v : w8) v = rand() % 16;
    auto run = [&](int which) {
        auto t0 = std::chrono::steady_clock::now();
        for (int n = 0; n < N; n += 2)
            for (int t = 0; t < T; t += 4) {
                if (which == 0) {
                    const int16_t* xr[4]; const float* dxr[4]; const int16_t* wr[2]; const float* dwr[2];
                    for (int r = 0; r < 4; ++r) { xr[r] = &x16[(t + r) * K]; dxr[r] = &dx[(t + r) * nb]; }
                    for (int c = 0; c < 2; ++c) { wr[c] = &w16[(n + c) * K]; dwr[c] = &dw[(n + c) * nb]; }
                    tile16<4, 2>(xr, dxr, wr, dwr, nb, &y[t * N + n], N);
                } else {
                    const int8_t* xr[4]; const float* dxr[4]; const uint8_t* wr[2]; const float* dwr[2];
                    for (int r = 0; r < 4; ++r) { xr[r] = &x8[(t + r) * K]; dxr[r] = &dx[(t + r) * nb]; }
                    for (int c = 0; c < 2; ++c) { wr[c] = &w8[(n + c) * K]; dwr[c] = &dw[(n + c) * nb]; }
                    tile8<4, 2>(xr, dxr, wr, dwr, nb, &y[t * N + n], N);
                }
            }
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 7; ++rep) for (int k = 0; k < 2; ++k) best[k] = std::min(best[k], run(k));
    printf("K=%d N=%d T=%d: int16 %.2f ms (%.1f GMAC/s), u8s8 %.2f ms (%.1f GMAC/s), ratio %.2f  [y0 %g]\n", K, N, T,
           best[0] * 1e3, double(K) * N * T / best[0] / 1e9, best[1] * 1e3, double(K) * N * T / best[1] / 1e9, best[0] / best[1], y[0]);
}
