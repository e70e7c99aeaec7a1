// Two kernel libraries in one process, kvs_matmul alternated call by call on the same random blocks (the
// order swapped every call), for when separate processes disagree by a few percent: it shows a placement
// effect (the library loaded second is faster, whichever it is) apart from the code (docs/performance.md,
// "Round 4"). build: g++ -O2 -std=c++17 matmul_ab_in_process.cpp -o ab2 -ldl;
// run: ./ab2 OLD.so NEW.so TYPE N K T ITERS (TYPE as in matmul_lib_bench.cpp), then swap OLD and NEW.
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
        case 1: return {2, 1, {0, -1}};
        case 2: return {18, 32, {0, -1}};
        case 3: return {20, 32, {0, 2}};
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
    if (argc < 8) {
        std::fprintf(stderr, "usage: %s OLD.so NEW.so TYPE N K T ITERS\n", argv[0]);
        return 2;
    }
    MatmulFn matmul[2];
    for (int i = 0; i < 2; ++i) {
        void* lib = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            std::fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        matmul[i] = reinterpret_cast<MatmulFn>(dlsym(lib, "kvs_matmul"));
    }
    const int type = std::atoi(argv[3]), iters = std::atoi(argv[7]);
    const int64_t N = std::atol(argv[4]), K = std::atol(argv[5]), T = std::atol(argv[6]);
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
    std::vector<double> us[2];
    for (int it = 0; it < iters; ++it)
        for (int k = 0; k < 2; ++k) {
            const int i = (it + k) % 2;  // who goes first alternates
            const auto start = std::chrono::steady_clock::now();
            matmul[i](type, w.data(), N, K, x.data(), K, T, y.data(), N, 1);
            us[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() * 1e6);
        }
    for (auto& v : us) std::sort(v.begin(), v.end());
    const double old_med = us[0][iters / 2], new_med = us[1][iters / 2];
    std::printf("type %d T %ld: first min %.1f med %.1f | second min %.1f med %.1f | second/first med %.3f min %.3f\n",
                type, long(T), us[0][0], old_med, us[1][0], new_med, new_med / old_med, us[1][0] / us[0][0]);
}
