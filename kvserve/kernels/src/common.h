// Shared by every kernel source: the declared entry points and the instruction set this build targets.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvs_api.h"

// for a helper of a hot loop that GCC's heuristics leave out of line in some instantiations (measured:
// group_half_pairs, out of line, made the AVX2 Q4_1 decode rows 1.3x slower)
#define KVS_ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(KVS_ISA_AVX512) || defined(KVS_ISA_AVX2)
#include <immintrin.h>
#endif

namespace kvs {

// Whether this build can add the decode rows' integer sums through VNNI's vpdpwssd (the widening and the add in one
// instruction, the same exact integers): the AVX-512 build. Which formats do is the host's tuning
// (KvsTuning::chained_sums), measured at start-up: on Zen 4 (hot rows, one thread) it made the interleaved Q4_K
// rows 4% faster, Q5_K's 3.5%, Q5_0's and Q6_K's 1%, and Q4_0's 1.5% slower, Q4_1's 3.5%, Q8_0's 6%.
#if defined(KVS_ISA_AVX512)
constexpr bool CAN_CHAIN_SUMS = true;
#else
constexpr bool CAN_CHAIN_SUMS = false;
#endif

// y [T, out_features] = x [T, in_features] @ W^T for a linear layer's parts, each filling its columns
// (matmul.cpp; no bias): kvs_matmul's bits, part by part. KvsMatmulStatus.
int matmul_linear(const KvsLinear& w, const float* x, int64_t T, float* y, int num_threads);

// the tuning kvs_set_tuning installed (a copy per call: a kernel reads it once, at its start)
KvsTuning current_tuning();

// bytes [p, end) asked for into the cache level `where` names (KvsPrefetch), a line at a time. Written as
// volatile asm: GCC 12 deletes a loop that does nothing but __builtin_prefetch (no side effect, finite), and
// with it every prefetch of the library (objdump found none)
inline void prefetch_span(const uint8_t* p, const uint8_t* end, int where) {
    switch (where) {
        case KVS_PREFETCH_L1: for (; p < end; p += 64) asm volatile("prefetcht0 %0" : : "m"(*p)); break;
        case KVS_PREFETCH_L2: for (; p < end; p += 64) asm volatile("prefetcht1 %0" : : "m"(*p)); break;
        case KVS_PREFETCH_L3: for (; p < end; p += 64) asm volatile("prefetcht2 %0" : : "m"(*p)); break;
        default: break;
    }
}

}  // namespace kvs
