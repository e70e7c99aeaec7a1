// A float vector of 16 lanes (scalar: 1) and the few operations attention, the norms and the float
// matmul need, so each kernel is written once. Every operation is elementwise or has one fixed reduction
// order (hsum's tree), so a result never depends on where data sits in a vector; and the lanes are 16 on
// AVX2 too (two 256-bit halves), so an AVX2 and an AVX-512 build compute every float in the same order
// and give the same bits (tests/kernels/test_isa_identity.py). This is the one place an operation is
// spelled per instruction set. VF_BUDGET: how many vf a kernel may keep live (tile shapes are sized to
// it; a shape never changes a result): 16 registers' worth, a vf being one zmm or two ymm.
#pragma once
#include "common.h"
#include <cmath>
#include <cstring>

namespace kvs::simd {

#if defined(KVS_ISA_AVX512)
constexpr int W = 16;
constexpr int VF_BUDGET = 16;
struct vf { __m512 v; };
inline vf vzero() { return {_mm512_setzero_ps()}; }
inline vf vset1(float x) { return {_mm512_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a.v); }
inline vf vadd(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf vsub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf vmax(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf vmin(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf vfloor(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline vf vpow2i(vf n) {  // 2**n for integral n in [-126, 127]
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
inline float vfirst(vf a) { return _mm512_cvtss_f32(a.v); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a.v); }
inline float hsum(vf a) {  // fixed tree: halves added pairwise down to one lane
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
inline vf vload_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline vf vload_f16(const uint16_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline vf vload_i8(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline vf vload_u8(const uint8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline vf vlookup(const float* table, const uint8_t* p) {  // table[p[i]]
    __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm512_i32gather_ps(idx, table, 4)};
}
#elif defined(KVS_ISA_AVX2)  // the AVX-512 block's 16 lanes as two 256-bit halves, line for line (see the top)
constexpr int W = 16;
constexpr int VF_BUDGET = 8;
struct vf { __m256 lo, hi; };  // lanes 0..7, 8..15
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf vfloor(vf a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
inline __m256 pow2i8(__m256 n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline vf vpow2i(vf n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
inline float vfirst(vf a) { return _mm256_cvtss_f32(a.lo); }
inline float hmax(vf a) {
    const __m256 h = _mm256_max_ps(a.lo, a.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
inline float hsum(vf a) {  // the AVX-512 tree: lanes i and i + 8 first
    const __m256 h = _mm256_add_ps(a.lo, a.hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
inline __m256 bf16x8(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf vload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline __m256 f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload_f16(const uint16_t* p) { return {f16x8(p), f16x8(p + 8)}; }
inline __m256 i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_i8(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vf vload_u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(u8x8(p)), _mm256_cvtepi32_ps(u8x8(p + 8))}; }
inline vf vlookup(const float* table, const uint8_t* p) {
    return {_mm256_i32gather_ps(table, u8x8(p), 4), _mm256_i32gather_ps(table, u8x8(p + 8), 4)};
}
#else
constexpr int W = 1;
constexpr int VF_BUDGET = 16;
struct vf { float v; };
inline vf vzero() { return {0.0f}; }
inline vf vset1(float x) { return {x}; }
inline vf vload(const float* p) { return {*p}; }
inline void vstore(float* p, vf a) { *p = a.v; }
inline vf vadd(vf a, vf b) { return {a.v + b.v}; }
inline vf vsub(vf a, vf b) { return {a.v - b.v}; }
inline vf vmul(vf a, vf b) { return {a.v * b.v}; }
inline vf vdiv(vf a, vf b) { return {a.v / b.v}; }
inline vf vfma(vf a, vf b, vf c) { return {a.v * b.v + c.v}; }  // no FMA unit in x86-64: two roundings
inline vf vmax(vf a, vf b) { return {a.v > b.v ? a.v : b.v}; }
inline vf vmin(vf a, vf b) { return {a.v < b.v ? a.v : b.v}; }
inline vf vfloor(vf a) { return {std::floor(a.v)}; }
inline vf vpow2i(vf n) {
    uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.v) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return {out};
}
inline float vfirst(vf a) { return a.v; }
inline float hmax(vf a) { return a.v; }
inline float hsum(vf a) { return a.v; }
inline float half_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {  // zero or subnormal: man * 2**-24, exact in float32
        float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}
inline vf vload_bf16(const uint16_t* p) {
    uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return {out};
}
inline vf vload_f16(const uint16_t* p) { return {half_to_float(*p)}; }
inline vf vload_i8(const int8_t* p) { return {static_cast<float>(*p)}; }
inline vf vload_u8(const uint8_t* p) { return {static_cast<float>(*p)}; }
inline vf vlookup(const float* table, const uint8_t* p) { return {table[*p]}; }
#endif

// e**x, Cephes' single-precision polynomial (about 1 ulp), for x <= 88; below -87.3 it returns
// ~2**-126 (callers that need an exact 0 mask it). Elementwise, so lane placement never matters.
inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
    vf n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
    vf r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    vf y = vadd(vfma(vmul(p, r), r, r), vset1(1.0f));
    return vmul(y, vpow2i(n));
}

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

}  // namespace kvs::simd
