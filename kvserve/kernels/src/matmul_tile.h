// The block formats' prefill tile: a panel's weight rows decoded once a call into groups laid out one
// vector lane per row, and the product of up to four activation rows with a group (matmul_int8.h's chain).
#pragma once
#include "matmul_int8.h"

namespace kvs {

// ---------------------------------------------------------------- the prefill tile
//
// The weight rows of a panel are decoded once a call into groups of TILE_GROUP rows laid out for one
// vector lane per row: block b's elements 4g .. 4g + 3 of every row side by side (k-group g), so one
// activation block meets the group as eight u8 x s8 products against x's four bytes broadcast, the
// int32 lane of row c summing row c's products (no reduction across lanes).

#if defined(KVS_ISA_AVX512)
constexpr int TILE_GROUP = 16;  // a 512-bit vector of int32 lanes
#else
constexpr int TILE_GROUP = 8;
#endif

// the bias a tile's codes are stored with: Q8_0 as c + 128 where vpdpbusd (no saturation) runs it
constexpr int tile_bias(int type) {
#if defined(KVS_ISA_AVX512)
    if (type == KVS_Q8_0) return 128;
#endif
    return code_bias(type);
}

// A group of decoded weight rows: the byte of row c's element l of block b at
// q[((8 b + l / 4) * TILE_GROUP + c) * 4 + l % 4] (code + tile_bias), and per block and row (index
// b * TILE_GROUP + c) the sub-scale (Q4_K, Q5_K; Q6_K's first half's), Q6_K's second half's, d; off
// per row (off[c * nb + b], the offset_dot order)
struct QGroup {
    uint8_t* q;
    int32_t* scale;
    int32_t* scale2;
    float* d;
    float* off;
};

inline int64_t qgroup_bytes(int64_t K) { return TILE_GROUP * (K + 16 * (K / 32)); }

inline QGroup qgroup_at(uint8_t* p, int64_t K) {
    const int64_t n = TILE_GROUP * (K / 32);
    int32_t* scale = reinterpret_cast<int32_t*>(p + TILE_GROUP * K);
    float* d = reinterpret_cast<float*>(scale + 2 * n);
    return QGroup{p, scale, scale + n, d, d + n};
}

// block b of row c: its 32 stored bytes (code + tile_bias, in element order) into the group, a 32-bit word
// per k-group, and its scales
inline void store_block(const QGroup& g, int64_t nb, int64_t b, int c, const uint8_t* bytes, float d, int sc0, int sc1,
                        float off) {
    for (int k = 0; k < 8; ++k) std::memcpy(g.q + ((8 * b + k) * TILE_GROUP + c) * 4, bytes + 4 * k, 4);
    g.scale[b * TILE_GROUP + c] = sc0;
    g.scale2[b * TILE_GROUP + c] = sc1;
    g.d[b * TILE_GROUP + c] = d;
    g.off[c * nb + b] = off;
}

#if KVS_SIMD
template <int Q>
struct GroupSink {  // one weight row into row c of a group
    const QGroup& g;
    int64_t nb;
    int c;
    void operator()(int64_t b, const Block32& k) const {
        alignas(32) uint8_t bytes[32];  // the codes and their bias in one vector add (wrapping, as uint8_t does)
        const __m256i biased = _mm256_add_epi8(k.c, _mm256_set1_epi8(char(tile_bias(Q))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), biased);
        store_block(g, nb, b, c, bytes, k.d, k.sc0, k.sc1, k.off);
    }
};
#endif

// One weight row of block format Q -> row c of a group
template <int Q>
inline void decode_row_q(const uint8_t* row, int64_t K, const QGroup& g, int c) {
    const int64_t nb = K / 32;
#if KVS_SIMD
    GroupSink<Q> sink{g, nb, c};
    walk<Q>(row, K, sink);
#else
    for (int64_t b = 0; b < nb; ++b) {
        int8_t code[32];
        float d, off;
        int sc0, sc1;
        scalar_block<Q>(row, b, code, &d, &sc0, &sc1, &off);
        uint8_t bytes[32];
        for (int i = 0; i < 32; ++i) bytes[i] = uint8_t(code[i] + tile_bias(Q));
        store_block(g, nb, b, c, bytes, d, sc0, sc1, off);
    }
#endif
}

#if KVS_SIMD
// vtot: the tile's int32 totals, one lane per row of a group (TILE_GROUP lanes), and its few operations
#if defined(KVS_ISA_AVX512)
using vtot = __m512i;
inline vtot tot_load(const void* p) { return _mm512_loadu_si512(p); }
inline vtot tot_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline vtot tot_sub(vtot a, vtot b) { return _mm512_sub_epi32(a, b); }
inline vtot tot_mul(vtot a, vtot b) { return _mm512_mullo_epi32(a, b); }
inline vtot tot_add(vtot a, vtot b) { return _mm512_add_epi32(a, b); }
#else
using vtot = __m256i;
inline vtot tot_load(const void* p) { return load256(p); }
inline vtot tot_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline vtot tot_sub(vtot a, vtot b) { return _mm256_sub_epi32(a, b); }
inline vtot tot_mul(vtot a, vtot b) { return _mm256_mullo_epi32(a, b); }
inline vtot tot_add(vtot a, vtot b) { return _mm256_add_epi32(a, b); }
#endif

#if defined(KVS_ISA_AVX512)
// acc + the u8 x s8 products of u8's bytes and the four bytes at s8x4 (vpdpbusd), and x shifted left by the
// count at `count` (vpsllvd), each with its 32-bit operand broadcast by the instruction itself ({1to16}):
// from _mm512_set1_epi32 of a load GCC makes a vpbroadcastd of its own, which on Zen 4 takes a slot of
// the vector ports as a 512-bit operation (the Q4_K and Q6_K tiles ran 8-9% slower with it: 4096 x 1536,
// 512 rows, one thread; the AVX2 build's 256-bit broadcasts are plain loads, measured the same either way)
inline __m512i dpbusd_bcast(__m512i acc, __m512i u8, const int8_t* s8x4) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*reinterpret_cast<const int32_t*>(s8x4)));
    return acc;
}
inline __m512i sllv_bcast(__m512i x, const int32_t* count) {
    asm("vpsllvd %1%{1to16%}, %0, %0" : "+v"(x) : "m"(*count));
    return x;
}
#endif

// sum over sub-blocks lo .. hi - 1 (8 elements, two k-groups each) of the group's u8 codes times x's
// bytes times the sub-block's multiplier, per row (int32 lanes). AVX2: lanes_of_eight; AVX-512:
// vpdpbusd to int32, shifted by the multiplier's exponent (vpsllvd with the exponent read from memory:
// on Zen 4 the whole Q4_K tile ran ~6% slower shifting by a count moved from a general register, and
// no faster by a count in a vector's low quadword)
template <int Q>
inline vtot subblock_sums(const uint8_t* wb, const XRow& x, int64_t b, int lo, int hi) {
    const int8_t* xb = x.q + 32 * b;
#if defined(KVS_ISA_AVX512)
    const int32_t* lg = x.lg + 4 * b;
    __m512i t = _mm512_setzero_si512();
    for (int i = lo; i < hi; ++i) {
        __m512i u = dpbusd_bcast(_mm512_setzero_si512(), _mm512_loadu_si512(wb + 128 * i), xb + 8 * i);
        u = dpbusd_bcast(u, _mm512_loadu_si512(wb + 128 * i + 64), xb + 8 * i + 4);
        t = _mm512_add_epi32(t, sllv_bcast(u, lg + i));
    }
    return t;
#else
    const int16_t* m = x.mult + 16 * b;
    __m256i t = _mm256_setzero_si256();
    for (int i = lo; i < hi; ++i)
        t = _mm256_add_epi32(t, lanes_of_eight(load256(wb + 64 * i), load256(wb + 64 * i + 32), xb + 8 * i, m + 4 * i));
    return t;
#endif
}

// the block totals of a group's rows against block b of one activation row
template <int Q>
inline vtot group_totals(const QGroup& g, int64_t b, const XRow& x) {
    const uint8_t* wb = g.q + 8 * 4 * TILE_GROUP * b;
    const int32_t sum = x.sum[b], half = x.half[b];
    if constexpr (Q == KVS_Q6_K) {  // two sub-scales a block: each half's sum less its bias, scaled
        const vtot h0 = tot_sub(subblock_sums<Q>(wb, x, b, 0, 2), tot_set1(32 * half));
        const vtot h1 = tot_sub(subblock_sums<Q>(wb, x, b, 2, 4), tot_set1(32 * (sum - half)));
        return tot_add(tot_mul(tot_load(g.scale + TILE_GROUP * b), h0), tot_mul(tot_load(g.scale2 + TILE_GROUP * b), h1));
    }
    vtot t;
#if !defined(KVS_ISA_AVX512)
    if constexpr (Q == KVS_Q8_0) {  // signed codes: |c| times x with c's sign, widened every k-group
        t = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k)
            t = _mm256_add_epi32(t, signed_lanes_of_four(load256(wb + 32 * k), x.q + 32 * b + 4 * k,
                                                         x.mult + 16 * b + 2 * k));
        return t;
    }
#endif
    t = subblock_sums<Q>(wb, x, b, 0, 4);
    if constexpr (tile_bias(Q) != 0) t = tot_sub(t, tot_set1(tile_bias(Q) * sum));
    if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) t = tot_mul(t, tot_load(g.scale + TILE_GROUP * b));
    return t;
}
#endif  // KVS_SIMD

// Whether the tile's loop over activation rows is unrolled: GCC keeps the accumulators in registers
// only then, but unrolled the lighter formats' bodies run out of registers instead (measured on Zen
// 5, 1 thread: either way is up to 1.3x slower for some formats). AVX-512 unrolls every format since
// its shifts take the exponent from memory: Q6_K's rolled loop then kept its accumulators on the stack
// (Zen 4, 1 thread, 4096 x 1536, 512 rows: rolled 12% slower than before, unrolled 6% faster).
template <int Q>
constexpr bool unroll_rows() {
#if defined(KVS_ISA_AVX512)
    return true;
#else
    return Q == KVS_Q6_K || Q == KVS_Q8_0;
#endif
}

// y[r * ldy + c] = x[r] . (row c of the group) for R activation rows and the group's first nw rows,
// without the offsets (add_offsets; offset_dot in the scalar build). The AVX-512 and AVX2 bodies are twins
// on purpose: written once over simd::vf (ops_simd.h) the tile ran 1.20-1.34x slower on AVX2 for seven of
// nine formats and 1.02-1.07x on AVX-512 (docs/experiments/matmul_lib_bench.cpp, 1024 x 2048, 512 rows, one
// thread, Zen 4, same bits): GCC unrolls and spills the rows' loop differently around the wrappers.
template <int Q, int R>
inline void qdot_group(const XRow* x, const QGroup& g, int nw, int64_t nb, float* y, int64_t ldy) {
#if defined(KVS_ISA_AVX512)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 dw = _mm512_loadu_ps(g.d + TILE_GROUP * b);
        auto row = [&](int r) {
            const __m512i t = group_totals<Q>(g, b, x[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, _mm512_set1_ps(x[r].d[b])), acc[r]);
        };
        if constexpr (unroll_rows<Q>()) {
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) row(r);
        } else {
            for (int r = 0; r < R; ++r) row(r);
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(64) float v[TILE_GROUP];
        _mm512_store_ps(v, acc[r]);
        for (int c = 0; c < nw; ++c) y[r * ldy + c] = v[c];
    }
#elif KVS_SIMD
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m256 dw = _mm256_loadu_ps(g.d + TILE_GROUP * b);
        auto row = [&](int r) {
            const __m256i t = group_totals<Q>(g, b, x[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + b)), acc[r]);
        };
        if constexpr (unroll_rows<Q>()) {
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) row(r);
        } else {
            for (int r = 0; r < R; ++r) row(r);
        }
    }
    for (int r = 0; r < R; ++r) {
        alignas(32) float v[TILE_GROUP];
        _mm256_store_ps(v, acc[r]);
        for (int c = 0; c < nw; ++c) y[r * ldy + c] = v[c];
    }
#else
    constexpr bool kSigned = codes_of(Q) == Codes::Signed;
    constexpr int kBias = tile_bias(Q);
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < nw; ++c) {
            float v = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const int64_t at = b * TILE_GROUP + c;
                int32_t total = 0;
                for (int l = 0; l < 32; ++l) {
                    const uint8_t u = g.q[((8 * b + l / 4) * TILE_GROUP + c) * 4 + l % 4];
                    const int code = kSigned ? int(int8_t(u)) : int(u) - kBias;
                    const int sc = !has_subscales(Q) ? 1 : (l < 16 ? g.scale[at] : g.scale2[at]);
                    total += code * sc * x[r].q[32 * b + l] * x[r].mult[16 * b + l / 2];
                }
                v = std::fma(float(total), g.d[at] * x[r].d[b], v);
            }
            if (has_offset(Q)) v = v + offset_dot(g.off + c * nb, x[r].s, nb);
            y[r * ldy + c] = v;
        }
    }
#endif
}

}  // namespace kvs
