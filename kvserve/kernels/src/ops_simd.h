// A float vector of this build's width (scalar: 1 lane, AVX2: 8, AVX-512: 16) and the few operations
// attention and the fused ops need, so each kernel is written once. Every operation is elementwise or
// has one fixed reduction order (hsum's tree), so a result never depends on where data sits in a vector.
// This is the one place an operation is spelled per instruction set: the AVX2 and AVX-512 blocks below
// are line-for-line twins by design (each line one intrinsic of that width).
#pragma once
#include "common.h"
#include <cmath>
#include <cstring>

namespace kvs::simd {

#if defined(KVS_ISA_AVX512)
constexpr int W = 16;
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
#elif defined(KVS_ISA_AVX2)  // the AVX-512 block's twin at half the width, line for line (see the top)
constexpr int W = 8;
struct vf { __m256 v; };
inline vf vzero() { return {_mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a.v); }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.v, b.v)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.v, b.v)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.v, b.v)}; }
inline vf vfloor(vf a) { return {_mm256_floor_ps(a.v)}; }
inline vf vpow2i(vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
inline float vfirst(vf a) { return _mm256_cvtss_f32(a.v); }
inline float hmax(vf a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
inline float hsum(vf a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
inline vf vload_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline vf vload_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline vf vload_i8(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline vf vload_u8(const uint8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
inline vf vlookup(const float* table, const uint8_t* p) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_i32gather_ps(table, idx, 4)};
}
#else
constexpr int W = 1;
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
