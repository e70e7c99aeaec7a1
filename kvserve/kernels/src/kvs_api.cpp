// The library's account of itself: the instruction set it was built for, the sources it was built from,
// its format table's length, and the manifest of kvs_api.h (each entry point's signature derived from its
// declaration, each struct's size, each enum value) that kvserve/kernels/api.py checks its mirror against.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "common.h"
#include "ops_simd.h"

namespace {

// one letter per C type, as api.py writes its ctypes mirror: v void, i 32-bit int, l 64-bit int, f float,
// s a C string, p any other pointer
template <class T>
constexpr char code_of() {
    if constexpr (std::is_void_v<T>) return 'v';
    else if constexpr (std::is_same_v<T, const char*>) return 's';
    else if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return 'l';
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return 'i';
    else static_assert(sizeof(T) == 0, "a type api.py has no letter for");
}

// "r:abc": the return type's letter, then each argument's
template <class R, class... A>
std::string signature(R (*)(A...)) {
    return std::string{code_of<R>(), ':'} + std::string{code_of<A>()...};
}

std::string build_manifest() {
    std::string m;
#define KVS_ENTRY_LINE(name) m += "entry " #name " " + signature(&name) + "\n";
    KVS_ENTRY_POINTS(KVS_ENTRY_LINE)
#undef KVS_ENTRY_LINE
#define KVS_STRUCT_LINE(name) m += "struct " #name " " + std::to_string(sizeof(name)) + "\n";
    KVS_STRUCTS(KVS_STRUCT_LINE)
#undef KVS_STRUCT_LINE
#define KVS_ENUM_LINE(name) m += "enum " #name " " + std::to_string(static_cast<int>(name)) + "\n";
    KVS_ENUM_VALUES(KVS_ENUM_LINE)
#undef KVS_ENUM_LINE
    return m;
}

// the installed tuning, packed in one word so a call reads all of it at once (the levels 2 bits each, the
// spread flag 1, the bytes ahead 24)
constexpr uint32_t kDefaultTuning = KVS_PREFETCH_L1 | KVS_PREFETCH_L1 << 2;
std::atomic<uint32_t> installed_tuning{kDefaultTuning};
std::atomic<uint32_t> installed_chained_sums{0};  // a word of its own: a call reading it apart from the other
                                                 // word still gets bits that no choice changes

}  // namespace

KvsTuning kvs::current_tuning() {
    const uint32_t word = installed_tuning.load(std::memory_order_relaxed);
    return KvsTuning{int32_t(word & 3), int32_t(word >> 8), int32_t((word >> 2) & 3), int32_t((word >> 4) & 1),
                     int32_t(installed_chained_sums.load(std::memory_order_relaxed))};
}

KVS_EXPORT void kvs_set_tuning(const KvsTuning* t) {
    uint32_t word = kDefaultTuning;
    if (t != nullptr) {
        const uint32_t ahead = uint32_t(std::min<int32_t>(std::max<int32_t>(t->weight_prefetch_ahead, 0), 1 << 23));
        word = uint32_t(t->weight_prefetch & 3) | uint32_t(t->kv_prefetch & 3) << 2 |
               uint32_t(t->weight_prefetch_spread != 0) << 4 | ahead << 8;
    }
    installed_tuning.store(word, std::memory_order_relaxed);
    // (kept only where this build honours it, so kvs_get_tuning tells the caller what the rows do)
    installed_chained_sums.store(t != nullptr && kvs::CAN_CHAIN_SUMS ? uint32_t(t->chained_sums) : 0u,
                                 std::memory_order_relaxed);
}

KVS_EXPORT void kvs_get_tuning(KvsTuning* out) { *out = kvs::current_tuning(); }

KVS_EXPORT const char* kvs_isa() { return KVS_ISA_NAME; }

KVS_EXPORT const char* kvs_source_digest() { return KVS_SOURCE_DIGEST; }

KVS_EXPORT const char* kvs_api_manifest() {
    static const std::string manifest = build_manifest();
    return manifest.c_str();
}

KVS_EXPORT int kvs_max_threads() { return omp_get_max_threads(); }

KVS_EXPORT int kvs_simd_width() { return kvs::simd::W; }
