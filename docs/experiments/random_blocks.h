// Random weight rows in a GGUF format and a random activation, for the kvs_matmul experiments
// (matmul_lib_bench.cpp, matmul_ab_in_process.cpp): random codes, every fp16 scale a small normal value.
#pragma once
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using MatmulFn = int (*)(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, int);

// the library at `path` (its handle in *lib if asked) and its kvs_matmul; exits with dlerror's message if it
// does not load
inline MatmulFn load_matmul(const char* path, void** lib = nullptr) {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        std::fprintf(stderr, "%s\n", dlerror());
        std::exit(1);
    }
    if (lib) *lib = handle;
    return reinterpret_cast<MatmulFn>(dlsym(handle, "kvs_matmul"));
}

struct Format {
    int bytes, elems;  // a block's bytes and elements
    int half_at[2];    // bytes of its fp16 scales (-1: none)
};

inline Format format_of(int type) {
    switch (type) {
        case 1: return {2, 1, {0, -1}};  // F16: every element a small normal half
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

// N rows of K weights of ggml type `type` (the file's bytes) and T activation rows of K, from seed 1
inline void random_problem(int type, int64_t N, int64_t K, int64_t T, std::vector<uint8_t>& w, std::vector<float>& x) {
    const Format f = format_of(type);
    const int64_t blocks = N * (K / f.elems);
    w.assign(blocks * f.bytes, 0);
    std::mt19937 gen(1);
    for (auto& byte : w) byte = uint8_t(gen());
    for (int64_t i = 0; i < blocks; ++i)
        for (int at : f.half_at)
            if (at >= 0) {
                const uint16_t half = uint16_t(0x2000 + (gen() & 0x3ff));
                std::memcpy(&w[i * f.bytes + at], &half, 2);
            }
    x.assign(T * K, 0.0f);
    std::normal_distribution<float> normal;
    for (auto& v : x) v = normal(gen);
}
