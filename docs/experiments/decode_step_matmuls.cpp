// The synthetic Qwen2.5-1.5B Q4_K_M decode step's matmuls alone, in layer order, one activation row (random
// blocks of the real shapes and quant mix: Q6_K V and down on the "more bits" layers, a Q6_K vocabulary
// matrix), each call timed: per kind microseconds a step and GB/s, and the step's total (docs/performance.md,
// "Round 4, the decode rows' own instruction set"). Build: g++ -O2 -std=c++17 decode_step_matmuls.cpp -o dsm
// -ldl; run: ./dsm LIB THREADS STEPS, e.g. ./dsm kvserve/kernels/_lib/libkvserve_avx2.so 2 10.
// TUNE=where,ahead,spread[,chained] sets the tuning (kvs_set_tuning: where 0-3 = none, L1, L2, L3; ahead in
// bytes; spread 0/1; chained: KvsTuning::chained_sums, e.g. 20480 for Q4_K and Q6_K) as the calibration would;
// HUGE=1 puts the weights on transparent huge pages; IL=1 runs the interleaved twins (types 1012, 1014: the
// layout the engine decodes), the random blocks' fp16 fields where the twin keeps them.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../../kvserve/kernels/src/kvs_api.h"
#include "random_blocks.h"

struct Weights {  // an anonymous mapping, on huge pages if HUGE is set
    uint8_t* data = nullptr;
    size_t size = 0;
    void allocate(size_t n) {
        const size_t aligned = (n + (2u << 20) - 1) & ~size_t((2u << 20) - 1);
        data = static_cast<uint8_t*>(mmap(nullptr, aligned, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        if (std::getenv("HUGE")) madvise(data, aligned, MADV_HUGEPAGE);
        size = n;
    }
};

struct Op {
    std::string kind;
    int type;  // ggml: 12 Q4_K, 14 Q6_K
    int64_t N, K;
    Weights w;
};

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s LIB THREADS STEPS\n", argv[0]);
        return 2;
    }
    void* lib = nullptr;
    const MatmulFn matmul = load_matmul(argv[1], &lib);
    if (const char* spec = std::getenv("TUNE")) {
        KvsTuning t{};
        t.kv_prefetch = KVS_PREFETCH_L3;
        std::sscanf(spec, "%d,%d,%d,%d", &t.weight_prefetch, &t.weight_prefetch_ahead, &t.weight_prefetch_spread,
                    &t.chained_sums);
        reinterpret_cast<void (*)(const KvsTuning*)>(dlsym(lib, "kvs_set_tuning"))(&t);
    }
    const int threads = std::atoi(argv[2]), steps = std::atoi(argv[3]);
    const int layers = 28, hidden = 1536, inter = 8960, kv = 256, vocab = 151936;
    std::vector<Op> ops;
    for (int i = 0; i < layers; ++i) {  // llama.cpp's Q4_K_M: more bits on the first and last eighth, every third between
        const bool more = i < layers / 8 || i >= 7 * layers / 8 || (i - layers / 8) % 3 == 2;
        ops.push_back({"q", 12, hidden, hidden, {}});
        ops.push_back({"k", 12, kv, hidden, {}});
        ops.push_back({more ? "v Q6_K" : "v Q4_K", more ? 14 : 12, kv, hidden, {}});
        ops.push_back({"o", 12, hidden, hidden, {}});
        ops.push_back({"gate", 12, inter, hidden, {}});
        ops.push_back({"up", 12, inter, hidden, {}});
        ops.push_back({more ? "down Q6_K" : "down Q4_K", more ? 14 : 12, hidden, inter, {}});
    }
    ops.push_back({"lm_head Q6_K", 14, vocab, hidden, {}});
    std::mt19937_64 gen(1);
    double total_bytes = 0;
    const bool interleaved = std::getenv("IL") != nullptr;
    for (Op& op : ops) {
        const int bytes = op.type == 12 ? 144 : 210, half_at = op.type == 12 ? 0 : 208;
        const int64_t blocks = op.N * (op.K / 256);
        op.w.allocate(blocks * bytes);
        for (size_t i = 0; i + 8 <= op.w.size; i += 8) {
            const uint64_t v = gen();
            std::memcpy(op.w.data + i, &v, 8);
        }
        for (int64_t b = 0; interleaved && b < blocks; ++b) {  // a twin's block: eight rows' headers, then codes
            const uint16_t half = uint16_t(0x2000 + (gen() & 0x3ff));
            uint8_t* header = op.w.data + b / 8 * 8 * bytes + b % 8 * (op.type == 12 ? 16 : 18);
            std::memcpy(header + (op.type == 12 ? 0 : 16), &half, 2);  // Q4_K: d, dmin, scales; Q6_K: scales, d
            if (op.type == 12) std::memcpy(header + 2, &half, 2);
        }
        for (int64_t b = 0; !interleaved && b < blocks; ++b) {  // every fp16 scale a small normal value
            const uint16_t half = uint16_t(0x2000 + (gen() & 0x3ff));
            std::memcpy(op.w.data + b * bytes + half_at, &half, 2);
            if (op.type == 12) std::memcpy(op.w.data + b * bytes + 2, &half, 2);
        }
        total_bytes += double(op.w.size);
    }
    std::vector<float> x(inter), y(vocab);
    std::normal_distribution<float> normal;
    for (float& v : x) v = normal(gen);
    std::map<std::string, std::pair<double, double>> per_kind;  // seconds, bytes (after the first step)
    std::vector<double> step_ms;
    for (int s = 0; s < steps; ++s) {
        const auto step_start = std::chrono::steady_clock::now();
        for (Op& op : ops) {
            const auto start = std::chrono::steady_clock::now();
            matmul(op.type + (interleaved ? 1000 : 0), op.w.data, op.N, op.K, x.data(), op.K, 1, y.data(), op.N, threads);
            const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (s > 0) {
                per_kind[op.kind].first += took;
                per_kind[op.kind].second += double(op.w.size);
            }
        }
        step_ms.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count() * 1e3);
    }
    step_ms.erase(step_ms.begin());  // (the first step faults the pages in)
    std::sort(step_ms.begin(), step_ms.end());
    for (const auto& [kind, v] : per_kind)
        std::printf("%-13s %8.1f us a step %6.1f GB/s\n", kind.c_str(), v.first / (steps - 1) * 1e6, v.second / v.first / 1e9);
    const double median = step_ms[step_ms.size() / 2];
    std::printf("step: %.0f MB, min %.2f median %.2f max %.2f ms: %.1f GB/s at the median\n", total_bytes / 1e6,
                step_ms.front(), median, step_ms.back(), total_bytes / median / 1e6);
}
