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
