// Two kernel libraries in one process, kvs_matmul alternated call by call on the same random blocks (the
// order swapped every call), for when separate processes disagree by a few percent: it shows a placement
// effect (the library loaded second is faster, whichever it is) apart from the code (docs/performance.md,
// "Round 4"). build: g++ -O2 -std=c++17 matmul_ab_in_process.cpp -o ab2 -ldl;
// run: ./ab2 OLD.so NEW.so TYPE N K T ITERS (TYPE as matmul_lib_bench.cpp), then swap OLD and NEW.
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
int main(int argc, char** argv) {
    MatmulFn fn[2];
    for (int i = 0; i < 2; ++i) { void* h = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { puts(dlerror()); return 1; } fn[i] = (MatmulFn)dlsym(h, "kvs_matmul"); }
    int type = atoi(argv[3]); int64_t N = atol(argv[4]), K = atol(argv[5]), T = atol(argv[6]); int iters = atoi(argv[7]);
    int bytes, elems, h0, h1;
    switch (type) { case 1: bytes=2; elems=1; h0=0; h1=-1; break; case 2: bytes=18; elems=32; h0=0; h1=-1; break; case 3: bytes=20; elems=32; h0=0; h1=2; break;
      case 6: bytes=22; elems=32; h0=0; h1=-1; break; case 7: bytes=24; elems=32; h0=0; h1=2; break; case 8: bytes=34; elems=32; h0=0; h1=-1; break;
      case 12: bytes=144; elems=256; h0=0; h1=2; break; case 13: bytes=176; elems=256; h0=0; h1=2; break; default: bytes=210; elems=256; h0=208; h1=-1; }
    int64_t blocks = N * (K / elems); std::vector<uint8_t> w(blocks * bytes); std::mt19937 gen(1);
    for (auto& b : w) b = uint8_t(gen());
    for (int64_t i = 0; i < blocks; ++i) for (int at : {h0, h1}) if (at >= 0) { uint16_t hv = uint16_t(0x2000 + (gen() & 0x3ff)); memcpy(&w[i * bytes + at], &hv, 2); }
    std::vector<float> x(T * K), y(T * N); std::normal_distribution<float> nd; for (auto& v : x) v = nd(gen);
    std::vector<double> t[2];
    for (int it = 0; it < iters; ++it) for (int k = 0; k < 2; ++k) { int i = (it + k) % 2;
        auto s = std::chrono::steady_clock::now(); fn[i](type, w.data(), N, K, x.data(), K, T, y.data(), N, 1);
        t[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() * 1e6); }
    for (auto& v : t) std::sort(v.begin(), v.end());
    printf("type %d T %ld: old min %.1f med %.1f | new min %.1f med %.1f | new/old med %.3f min %.3f\n", type, (long)T, t[0][0], t[0][iters/2], t[1][0], t[1][iters/2], t[1][iters/2]/t[0][iters/2], t[1][0]/t[0][0]);
}
