// Shared by every kernel source: exported C entry points, the instruction set this build targets.
#pragma once
#include <cstdint>
#include <cstddef>

#define KVS_EXPORT extern "C" __attribute__((visibility("default")))

#if defined(KVS_ISA_AVX512) || defined(KVS_ISA_AVX2)
#include <immintrin.h>
#endif
