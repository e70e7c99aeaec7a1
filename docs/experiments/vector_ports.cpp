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
#define DP_MEM(r) "vpdpbusd 4*" #r "(%0)%{1to16%}, %%zmm19, %%zmm" #r  // x's 4 bytes from memory
#define DP_CHAIN(r) DP(0)                                                 // each on the one before
#define SLLV(r) "vpsllvd %%zmm20, %%zmm19, %%zmm" #r
#define ADD(r) "vpaddd %%zmm20, %%zmm19, %%zmm" #r
#define MULLD(r) "vpmulld %%zmm20, %%zmm19, %%zmm" #r
#define FMA(r) "vfmadd231ps %%zmm20, %%zmm19, %%zmm" #r
#define CVT(r) "vcvtdq2ps %%zmm19, %%zmm" #r
// a loop of twelve OPs, and one of eight vpdpbusd with four OPs between them
#define ALONE(OP)                                                                                            \
    [](long n) {                                                                                             \
        for (long i = 0; i < n; ++i)                                                                         \
            TWELVE(OP(0), OP(1), OP(2), OP(3), OP(4), OP(5), OP(6), OP(7), OP(8), OP(9), OP(10), OP(11));     \
    }
#define BESIDE_EIGHT(OP)                                                                                     \
    [](long n) {                                                                                             \
        for (long i = 0; i < n; ++i)                                                                         \
            TWELVE(DP(0), DP(1), OP(12), DP(2), DP(3), OP(13), DP(4), DP(5), OP(14), DP(6), DP(7), OP(15));  \
    }

struct Case {
    const char* name;
    void (*loop)(long);
};

const Case kCases[] = {
    {"vpdpbusd", ALONE(DP)},
    {"vpdpbusd, x broadcast from memory", ALONE(DP_MEM)},
    {"vpdpbusd, one chain (1 / latency)", ALONE(DP_CHAIN)},
    {"vpsllvd", ALONE(SLLV)},
    {"vpaddd", ALONE(ADD)},
    {"vpmulld", ALONE(MULLD)},
    {"vcvtdq2ps", ALONE(CVT)},
    {"8 vpdpbusd + 4 vpsllvd (the tile's mix)", BESIDE_EIGHT(SLLV)},
    {"8 vpdpbusd + 4 vpaddd", BESIDE_EIGHT(ADD)},
    {"8 vpdpbusd + 4 vpmulld", BESIDE_EIGHT(MULLD)},
    {"8 vpdpbusd + 4 vfmadd231ps", BESIDE_EIGHT(FMA)},
    {"8 vpdpbusd + 4 vcvtdq2ps", BESIDE_EIGHT(CVT)},
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
