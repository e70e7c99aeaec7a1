// Times kvs_matmul of one built kernel library on random blocks of one GGUF format (docs/performance.md,
// "Round 3, the decode rows"): build: g++ -O2 -std=c++17 matmul_lib_bench.cpp -o mmbench -ldl; run:
// ./mmbench LIB TYPE N K T REPS [THREADS], e.g. ./mmbench kvserve/kernels/_lib/libkvserve_avx2.so 3
// 3456 576 1 2000 (TYPE: the ggml type number, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K,
// 13 Q5_K, 14 Q6_K).
// Prints the best call's time and a checksum of the output: two libraries built from different sources
// that keep the chain print the same checksum. Random codes, fp16 scales set to small normal values;
// timing only. N large enough (e.g. 103680 x 576) reads the weights from DRAM, not the caches.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using MatmulFn = int (*)(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, int);

struct Format {
    int bytes, elems;  // a block's bytes and elements
    int half_at[2];    // bytes of its fp16 scales (-1: none)
};

static Format format_of(int type) {
    switch (type) {
        case 2: return {18, 32, {0, -1}};
        case 3: return {20, 32, {0, 2}};
        case 1: return {2, 1, {0, -1}};  // F16: every element a small normal half
        case 6: return {22, 32, {0, -1}};
        case 7: return {24, 32, {0, 2}};
        case 8: return {34, 32, {0, -1}};
        case 12: return {144, 256, {0, 2}};
        case 13: return {176, 256, {0, 2}};
        case 14: return {210, 256, {208, -1}};
        default: std::fprintf(stderr, "type %d: not one of 1 2 3 6 7 8 12 13 14\n", type); std::exit(2);
    }
}

int main(int argc, char** argv) {
    if (argc < 7) {
        std::fprintf(stderr, "usage: %s LIB TYPE N K T REPS [THREADS]\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        std::fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    const auto matmul = reinterpret_cast<MatmulFn>(dlsym(lib, "kvs_matmul"));
    const int type = std::atoi(argv[2]), reps = std::atoi(argv[6]), threads = argc > 7 ? std::atoi(argv[7]) : 1;
    const int64_t N = std::atol(argv[3]), K = std::atol(argv[4]), T = std::atol(argv[5]);
    const Format f = format_of(type);
    const int64_t blocks = N * (K / f.elems);
    std::vector<uint8_t> w(blocks * f.bytes);
    std::mt19937 gen(1);
    for (auto& byte : w) byte = uint8_t(gen());
    for (int64_t i = 0; i < blocks; ++i)
        for (int at : f.half_at)
            if (at >= 0) {
                const uint16_t half = uint16_t(0x2000 + (gen() & 0x3ff));
                std::memcpy(&w[i * f.bytes + at], &half, 2);
            }
    std::vector<float> x(T * K), y(T * N);
    std::normal_distribution<float> normal;
    for (auto& v : x) v = normal(gen);
    double best = 1e9;
    for (int r = 0; r < reps; ++r) {
        const auto start = std::chrono::steady_clock::now();
        matmul(type, w.data(), N, K, x.data(), K, T, y.data(), N, threads);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    double sum = 0;
    for (float v : y) sum += v;
    std::printf("type %d N %ld K %ld T %ld threads %d: %.2f us, %.3f G weight-row blocks of 32 /s (checksum %.6g)\n",
                type, long(N), long(K), long(T), threads, best * 1e6, double(N) * double(K) / 32 / best / 1e9, sum);
}
