// Shared by every kernel source: the declared entry points and the instruction set this build targets.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvs_api.h"

#if defined(KVS_ISA_AVX512) || defined(KVS_ISA_AVX2)
#include <immintrin.h>
#endif
