// What one core of this host issues per cycle of the instructions the prefill tile and the decode rows are
// made of, alone and mixed (docs/performance.md, "Round 4 on AMD Zen 5"): the clock from a chain of dependent
// scalar adds (one a cycle on every x86 core this project runs on), then each loop of independent 512-bit
// operations as operations per cycle. A VM exposes no cycle counter to perf, so this is how a session tells
// which instructions share the vector ports. Build: g++ -O2 -mavx512f -mavx512bw -mavx512vnni
// vector_ports.cpp -o vector_ports (an AVX-512 VNNI host only); run: ./vector_ports.
#include <algorithm>
#include <chrono>
#include <cstdio>

namespace {

alignas(64) int memory[64];

double seconds_of(void (*loop)(long), long n) {
    const auto start = std::chrono::steady_clock::now();
    loop(n);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void adds(long n) {
    long x = 0;
    for (long i = 0; i < n; ++i) asm volatile("add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0" : "+r"(x));
}

#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                 "xmm12", "xmm13", "xmm14", "xmm15"
// twelve independent operations (accumulators zmm0-11, operands zmm18-20; zmm12-15 for a second kind)
#define TWELVE(a, b, c, d, e, f, g, h, i, j, k, l) \
    asm volatile(a "\n" b "\n" c "\n" d "\n" e "\n" f "\n" g "\n" h "\n" i "\n" j "\n" k "\n" l ::"r"(memory) : CLOBBERS)
#define DP(r) "vpdpbusd %%zmm20, %%zmm19, %%zmm" #r
#define DPB(r, off) "vpdpbusd " #off "(%0)%{1to16%}, %%zmm19, %%zmm" #r
#define SLLV(r) "vpsllvd %%zmm20, %%zmm19, %%zmm" #r
#define ADD(r) "vpaddd %%zmm20, %%zmm19, %%zmm" #r
#define MULLD(r) "vpmulld %%zmm20, %%zmm19, %%zmm" #r
#define FMA(r) "vfmadd231ps %%zmm20, %%zmm19, %%zmm" #r
#define CVT(r) "vcvtdq2ps %%zmm19, %%zmm" #r

struct Case {
    const char* name;
    void (*loop)(long);
};

const Case kCases[] = {
    {"vpdpbusd", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), DP(2), DP(3), DP(4), DP(5), DP(6), DP(7), DP(8), DP(9), DP(10), DP(11)); }},
    {"vpdpbusd, x broadcast from memory", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DPB(0, 0), DPB(1, 4), DPB(2, 8), DPB(3, 12), DPB(4, 16), DPB(5, 20), DPB(6, 24), DPB(7, 28), DPB(8, 32), DPB(9, 36), DPB(10, 40), DPB(11, 44)); }},
    {"vpdpbusd, one chain (1 / latency)", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0), DP(0)); }},
    {"vpsllvd", [](long n) { for (long i = 0; i < n; ++i) TWELVE(SLLV(0), SLLV(1), SLLV(2), SLLV(3), SLLV(4), SLLV(5), SLLV(6), SLLV(7), SLLV(8), SLLV(9), SLLV(10), SLLV(11)); }},
    {"vpaddd", [](long n) { for (long i = 0; i < n; ++i) TWELVE(ADD(0), ADD(1), ADD(2), ADD(3), ADD(4), ADD(5), ADD(6), ADD(7), ADD(8), ADD(9), ADD(10), ADD(11)); }},
    {"vpmulld", [](long n) { for (long i = 0; i < n; ++i) TWELVE(MULLD(0), MULLD(1), MULLD(2), MULLD(3), MULLD(4), MULLD(5), MULLD(6), MULLD(7), MULLD(8), MULLD(9), MULLD(10), MULLD(11)); }},
    {"vcvtdq2ps", [](long n) { for (long i = 0; i < n; ++i) TWELVE(CVT(0), CVT(1), CVT(2), CVT(3), CVT(4), CVT(5), CVT(6), CVT(7), CVT(8), CVT(9), CVT(10), CVT(11)); }},
    {"8 vpdpbusd + 4 vpsllvd (the tile's mix)", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), SLLV(12), DP(2), DP(3), SLLV(13), DP(4), DP(5), SLLV(14), DP(6), DP(7), SLLV(15)); }},
    {"8 vpdpbusd + 4 vpaddd", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), ADD(12), DP(2), DP(3), ADD(13), DP(4), DP(5), ADD(14), DP(6), DP(7), ADD(15)); }},
    {"8 vpdpbusd + 4 vpmulld", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), MULLD(12), DP(2), DP(3), MULLD(13), DP(4), DP(5), MULLD(14), DP(6), DP(7), MULLD(15)); }},
    {"8 vpdpbusd + 4 vfmadd231ps", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), FMA(12), DP(2), DP(3), FMA(13), DP(4), DP(5), FMA(14), DP(6), DP(7), FMA(15)); }},
    {"8 vpdpbusd + 4 vcvtdq2ps", [](long n) { for (long i = 0; i < n; ++i) TWELVE(DP(0), DP(1), CVT(12), DP(2), DP(3), CVT(13), DP(4), DP(5), CVT(14), DP(6), DP(7), CVT(15)); }},
};

}  // namespace

int main() {
    constexpr long kAdds = 500000000, kLoops = 30000000;
    double best = 1e30;
    for (int round = 0; round < 3; ++round) best = std::min(best, seconds_of(adds, kAdds));
    const double ghz = 4.0 * kAdds / best / 1e9;
    std::printf("clock: %.2f GHz (a chain of dependent adds, best of 3)\n", ghz);
    for (const Case& c : kCases) {
        double s = 1e30;
        for (int round = 0; round < 3; ++round) s = std::min(s, seconds_of(c.loop, kLoops));
        std::printf("%-42s %.2f a cycle\n", c.name, 12.0 * kLoops / s / (ghz * 1e9));
    }
}
