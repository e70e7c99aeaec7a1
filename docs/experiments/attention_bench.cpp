// Times kvs_paged_attention of one built kernel library on bf16 pages of random values (docs/performance.md,
// "Round 4, attention's bf16 rows in pairs"): a decode row (ROWS 1, at the last position) or a prefill of
// ROWS rows ending at the last key, over LAYERS caches in turn (28: each call's pages come from DRAM, as in a
// step; 1: hot in the caches). Build: g++ -O2 -std=c++17 attention_bench.cpp -o attbench -ldl; run:
// ./attbench LIB HEADS KV_HEADS HEAD_DIM KEYS ROWS LAYERS THREADS REPS, e.g. the 1.5B's decode at 1.5k:
// ./attbench kvserve/kernels/_lib/libkvserve_avx512.so 12 2 128 1547 1 28 2 200.
// KV=0..3 in the environment sets attention's prefetch (KvsPrefetch: none, L1, L2, L3; unset: the built-in L1).
// Prints the min and median microseconds a call and a checksum of the outputs: two libraries that keep
// attention's chains print the same checksum.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../../kvserve/kernels/src/kvs_api.h"

int main(int argc, char** argv) {
    if (argc < 10) {
        std::fprintf(stderr, "usage: %s LIB HEADS KV_HEADS HEAD_DIM KEYS ROWS LAYERS THREADS REPS\n", argv[0]);
        return 2;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        std::fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    auto attend = reinterpret_cast<int (*)(const KvsAttention*)>(dlsym(lib, "kvs_paged_attention"));
    if (const char* where = std::getenv("KV")) {  // attention's prefetch as the calibration would set it
        KvsTuning t{};
        reinterpret_cast<void (*)(KvsTuning*)>(dlsym(lib, "kvs_get_tuning"))(&t);
        t.kv_prefetch = std::atoi(where);
        reinterpret_cast<void (*)(const KvsTuning*)>(dlsym(lib, "kvs_set_tuning"))(&t);
    }
    const int heads = std::atoi(argv[2]), kv_heads = std::atoi(argv[3]), hd = std::atoi(argv[4]);
    const int64_t keys = std::atol(argv[5]), rows = std::atol(argv[6]);
    const int layers = std::atoi(argv[7]), threads = std::atoi(argv[8]), reps = std::atoi(argv[9]);
    const int page_size = 16;
    const int64_t pages = (keys + page_size - 1) / page_size, row_elems = int64_t(kv_heads) * hd;
    std::mt19937 gen(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto bf16 = [](float x) { uint32_t b; std::memcpy(&b, &x, 4); return uint16_t(b >> 16); };
    std::vector<std::vector<uint16_t>> k(layers), v(layers);
    for (int l = 0; l < layers; ++l) {
        k[l].resize(pages * page_size * row_elems);
        v[l].resize(k[l].size());
        for (auto& x : k[l]) x = bf16(normal(gen));
        for (auto& x : v[l]) x = bf16(normal(gen));
    }
    std::vector<float> q(rows * heads * hd), out(q.size());
    for (auto& x : q) x = normal(gen);
    std::vector<int64_t> positions(rows), offsets(rows, 0), first(rows, 0), table(pages);
    for (int64_t r = 0; r < rows; ++r) positions[r] = keys - rows + r;
    for (int64_t p = 0; p < pages; ++p) table[p] = (p * 7) % pages;  // scattered pages, as a pool gives them
    KvsAttention a{};
    a.q = q.data();
    a.out = out.data();
    a.positions = positions.data();
    a.table_offsets = offsets.data();
    a.table_first = first.data();
    a.tables = table.data();
    a.q_row_stride = int64_t(heads) * hd;
    a.num_rows = rows;
    a.heads = heads;
    a.kv_heads = kv_heads;
    a.head_dim = hd;
    a.page_size = page_size;
    a.codec = KVS_CODEC_BF16;
    a.num_threads = threads;
    a.scale = 1.0f / std::sqrt(float(hd));
    std::vector<double> us;
    double checksum = 0.0;
    for (int rep = 0; rep < reps; ++rep) {
        const int l = rep % layers;
        a.k_data = k[l].data();
        a.v_data = v[l].data();
        const auto t0 = std::chrono::steady_clock::now();
        if (attend(&a)) {
            std::fprintf(stderr, "kvs_paged_attention refused the shape\n");
            return 1;
        }
        us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        if (rep < layers)
            for (float x : out) checksum += x;
    }
    std::sort(us.begin(), us.end());
    std::printf("heads %d/%d x %d, %ld keys, %ld rows, %d layers, %d threads: min %.1f median %.1f us "
                "(checksum %.9g)\n", heads, kv_heads, hd, long(keys), long(rows), layers, threads, us[0],
                us[us.size() / 2], checksum);
    return 0;
}
