// Times kvs_matmul of one built kernel library on random blocks of one GGUF format (docs/performance.md,
// "Round 3, the decode rows"): build: g++ -O2 -std=c++17 matmul_lib_bench.cpp -o mmbench -ldl; run:
// ./mmbench LIB TYPE N K T REPS [THREADS], e.g. ./mmbench kvserve/kernels/_lib/libkvserve_avx2.so 3
// 3456 576 1 2000 (TYPE: the ggml type number, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K,
// 13 Q5_K, 14 Q6_K; 1012, 1013, 1014: their interleaved twins, the rows rewritten by kvs_interleave_rows).
// Prints the best call's time and a checksum of the output: two libraries built from different sources
// that keep the chain print the same checksum. Random codes, fp16 scales set to small normal values;
// timing only. N large enough (e.g. 103680 x 576) reads the weights from DRAM, not the caches. With
// KVS_CHAINED_SUMS=MASK in the environment the library's tuning chains the sums of the formats in MASK (bit f: ggml
// type f; src/kvs_api.h KvsTuning::chained_sums), e.g. 4096 for Q4_K.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../../kvserve/kernels/src/kvs_api.h"
#include "random_blocks.h"

int main(int argc, char** argv) {
    if (argc < 7) {
        std::fprintf(stderr, "usage: %s LIB TYPE N K T REPS [THREADS]\n", argv[0]);
        return 2;
    }
    const MatmulFn matmul = load_matmul(argv[1]);
    if (const char* mask = std::getenv("KVS_CHAINED_SUMS")) {
        KvsTuning tuning{};
        void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        const auto get = reinterpret_cast<void (*)(KvsTuning*)>(dlsym(lib, "kvs_get_tuning"));
        const auto set = reinterpret_cast<void (*)(const KvsTuning*)>(dlsym(lib, "kvs_set_tuning"));
        get(&tuning);
        tuning.chained_sums = std::atoi(mask);
        set(&tuning);
        get(&tuning);
        std::fprintf(stderr, "chained sums: mask %d\n", tuning.chained_sums);
    }
    const int type = std::atoi(argv[2]), reps = std::atoi(argv[6]), threads = argc > 7 ? std::atoi(argv[7]) : 1;
    const int64_t N = std::atol(argv[3]), K = std::atol(argv[4]), T = std::atol(argv[5]);
    std::vector<uint8_t> w;
    std::vector<float> x, y(T * N);
    random_problem(type > 1000 ? type - 1000 : type, N, K, T, w, x);
    if (type > 1000) {  // an interleaved twin (1000 + a K format): the same random rows, rewritten in place
        using InterleaveFn = int (*)(int, uint8_t*, int64_t, int64_t);
        void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        const auto interleave = reinterpret_cast<InterleaveFn>(dlsym(lib, "kvs_interleave_rows"));
        if (interleave == nullptr || interleave(type - 1000, w.data(), N, K) != 0) {
            std::fprintf(stderr, "type %d: the library cannot interleave these rows\n", type);
            return 1;
        }
    }
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
