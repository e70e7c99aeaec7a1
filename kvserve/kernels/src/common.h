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

// the tuning kvs_set_tuning installed (a copy per call: a kernel reads it once, at its start)
KvsTuning current_tuning();

// bytes [p, end) asked for into the cache level `where` names (KvsPrefetch), a line at a time
inline void prefetch_span(const uint8_t* p, const uint8_t* end, int where) {
    switch (where) {
        case KVS_PREFETCH_L1: for (; p < end; p += 64) __builtin_prefetch(p, 0, 3); break;
        case KVS_PREFETCH_L2: for (; p < end; p += 64) __builtin_prefetch(p, 0, 2); break;
        case KVS_PREFETCH_L3: for (; p < end; p += 64) __builtin_prefetch(p, 0, 1); break;
        default: break;
    }
}

}  // namespace kvs
