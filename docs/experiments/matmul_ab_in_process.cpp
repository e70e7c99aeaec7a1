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

#include "random_blocks.h"

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
    std::vector<uint8_t> w;
    std::vector<float> x, y(T * N);
    random_problem(type, N, K, T, w, x);
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
