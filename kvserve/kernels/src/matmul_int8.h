// Block formats on integers: the chain every path computes (below), the activation rounding to int8
// blocks of 32 and a block's codes and scales decoded in scalar code; the paths themselves are the
// prefill tile (matmul_tile.h) and the decode rows (matmul_direct.h).
#pragma once
#include <vector>

#include "matmul_quant.h"

namespace kvs {

// ---------------------------------------------------------------- block formats: 8-bit products
//
// Block formats run on integers, as llama.cpp's do, with a finer activation rounding: each activation
// row is rounded once to int8 per block of 32 on the block's step D = max|x| / 127, each sub-block of
// 8 on D / 2^s (s <= 3, as fine as its own max allows), so x ~ q * m * dx with m = 2^(3 - s) the
// sub-block's multiplier and dx = D / 8 (perplexity drift vs float32: +0.6% with one step a block,
// under 0.2% with the sub-blocks'). Each weight row is decoded to 8-bit codes with integer sub-scales
// and a float d and offset per block. y[t, n] is one chain: per block the exact integer total of
// c * sc * q * m over its 32 elements (c the signed code, sc its sub-scale, 1 where the format has
// none; |total| < 2^31), then acc = fma(float(total), dw * dx, acc) in block order; then acc plus the
// offsets' dot sum_b off[b] * s[b], s[b] = dx[b] * (the block's sum of q * m) (8 blocks a lane,
// hsum8, then the tail). Only the totals' values enter the floats, so every path computes them its
// own way (u8 x s8 products, a sign trick, a bias taken off, one vector lane per weight row) and gets
// the same bits.

struct XRow {  // an activation row as the block formats see it: x[k] ~ q[k] * m(k) * d[k / 32]
    const int8_t* q;
    const float* d;
    const float* s;       // d[b] * sum[b]
    const int32_t* sum;   // block b's sum of q * m
    const int32_t* half;  // the same over its first 16 elements
    const int16_t* mult;  // [16 per block] m of each pair of elements (a sub-block of 8 is four pairs)
    const int32_t* lg;    // [4 per block] log2 m of each sub-block (AVX-512's tile shifts by it)
};

// the arrays an XRow points into, for T rows of K; `fit` only grows them, so a thread's one
// XBlocks is zeroed once, not on every call (a 1.5k-row prefill's down projection needs 7.6 MB). In
// the engine, model/host_heap.py already keeps freed pages mapped; outside it (a bare kvs_matmul
// caller) each call's vectors were also faulted in afresh.
struct XBlocks {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sum, half;
    std::vector<int16_t> mult;
    std::vector<int32_t> lg;
    XBlocks() = default;
    XBlocks(int64_t T, int64_t K) { fit(T, K); }
    void fit(int64_t T, int64_t K) {
        const size_t n = static_cast<size_t>(T * K);
        if (q.size() >= n) return;
        q.resize(n);
        for (auto* v : {&d, &s}) v->resize(n / 32);
        for (auto* v : {&sum, &half}) v->resize(n / 32);
        mult.resize(n / 2);
        lg.resize(n / 8);
    }
    XRow row(int64_t t, int64_t K) {
        const int64_t b = t * (K / 32);
        return XRow{&q[t * K], &d[b], &s[b], &sum[b], &half[b], &mult[16 * b], &lg[4 * b]};
    }
};

// The scalar walk: block b's signed codes and Block32 fields for block format Q, as the SIMD walkers give them
template <int Q>
inline void scalar_block(const uint8_t* row, int64_t b, int8_t* c, float* d, int* sc0, int* sc1, float* off) {
    constexpr int bytes = geometry(Q).bytes, bias = code_bias(Q);
    *sc0 = *sc1 = 1;
    *off = 0.0f;
    if constexpr (Q == KVS_Q6_K) {
        const uint8_t* blk = row + b / 8 * bytes;
        const int j = int(b % 8);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        *d = load_f16(blk + 208);
        *sc0 = sc[2 * j];
        *sc1 = sc[2 * j + 1];
        for (int l = 0; l < 32; ++l) c[l] = int8_t(q6_code(blk, 32 * j + l) - bias);
    } else if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) {
        const uint8_t* blk = row + b / 8 * bytes;
        const int j = int(b % 8);
        constexpr bool five = Q == KVS_Q5_K;
        int sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        *d = load_f16(blk);
        *sc0 = *sc1 = sc;
        *off = -(load_f16(blk + 2) * float(m));
        for (int l = 0; l < 32; ++l) c[l] = int8_t(k_code(blk + 16 + (five ? 32 : 0), five ? blk + 16 : nullptr, j, l));
    } else if constexpr (Q == KVS_Q8_0) {
        const uint8_t* blk = row + b * bytes;
        *d = load_f16(blk);
        for (int l = 0; l < 32; ++l) c[l] = reinterpret_cast<const int8_t*>(blk + 2)[l];
    } else {
        const uint8_t* blk = row + b * bytes;
        *d = load_f16(blk);
        constexpr bool has_min = Q == KVS_Q4_1 || Q == KVS_Q5_1, five = Q == KVS_Q5_0 || Q == KVS_Q5_1;
        const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
        const uint32_t qh = five ? load_u32(blk + 2 + (has_min ? 2 : 0)) : 0;
        for (int l = 0; l < 32; ++l) {
            int v = l < 16 ? qs[l] & 15 : qs[l - 16] >> 4;
            if (five) v |= q5_high(qh, l);
            c[l] = int8_t(v - bias);
        }
        if (has_min) *off = load_f16(blk + 2);
    }
}

// x -> row t of xb (the same operations on every ISA)
inline void quantize_row(const float* x, int64_t K, XBlocks& xb, int64_t t) {
    int8_t* q = &xb.q[t * K];
    float *d = &xb.d[t * (K / 32)], *s = &xb.s[t * (K / 32)];
    int32_t *sums = &xb.sum[t * (K / 32)], *halves = &xb.half[t * (K / 32)];
    int16_t* mult = &xb.mult[t * K / 2];
    int32_t* lg = &xb.lg[t * K / 8];
    for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + 32 * b;
        float amax8[4];
        for (int i = 0; i < 4; ++i) {
#if KVS_SIMD
            const __m256 v = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + 8 * i));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            amax8[i] = _mm_cvtss_f32(m4);
#else
            amax8[i] = 0.0f;
            for (int l = 0; l < 8; ++l) amax8[i] = std::max(amax8[i], std::fabs(xb[8 * i + l]));
#endif
        }
        const float amax = std::max(std::max(amax8[0], amax8[1]), std::max(amax8[2], amax8[3]));
        const float step = amax / 127.0f;  // the block's step D
        const float id = step > 0.0f ? 1.0f / step : 0.0f;
        int8_t* qb = q + 32 * b;
        int sum = 0, half = 0;
        for (int i = 0; i < 4; ++i) {
            // the largest s <= 3 with amax8 * 2^s <= amax (powers of two: exact), without a branch: the
            // conditions hold for s = 1 .. shift and no further (a loop mispredicted about once a sub-block)
            const int shift = int(amax8[i] * 2.0f <= amax) + int(amax8[i] * 4.0f <= amax) + int(amax8[i] * 8.0f <= amax);
            const float scale = id * float(1 << shift);
#if KVS_SIMD
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(scale));
            t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            const __m256i v = _mm256_cvtps_epi32(t);
            const __m128i v32 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + 8 * i), _mm_packs_epi16(v32, v32));
            __m128i p4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            p4 = _mm_add_epi32(p4, _mm_unpackhi_epi64(p4, p4));
            const int part = _mm_cvtsi128_si32(_mm_add_epi32(p4, _mm_shuffle_epi32(p4, 1)));  // the 8 codes' sum
#else
            int part = 0;
            for (int l = 0; l < 8; ++l) {
                qb[8 * i + l] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[8 * i + l] * scale))));
                part += qb[8 * i + l];
            }
#endif
            const int m = 8 >> shift;
            sum += m * part;
            if (i < 2) half += m * part;
            const uint64_t m4 = uint64_t(uint16_t(m)) * 0x0001000100010001ull;  // m in each of four int16
            std::memcpy(mult + 16 * b + 4 * i, &m4, 8);
            lg[4 * b + i] = 3 - shift;
        }
        d[b] = step * 0.125f;
        s[b] = d[b] * float(sum);
        sums[b] = sum;
        halves[b] = half;
    }
}

// sum_b off[b] * s[b]: the offset terms of one output
inline float offset_dot(const float* off, const float* s, int64_t nb) {
    int64_t b = 0;
    float v = 0.0f;
#if KVS_SIMD
    __m256 a = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(off + b), _mm256_loadu_ps(s + b), a);
    v = hsum8(a);
#endif
    for (; b < nb; ++b) v = v + off[b] * s[b];
    return v;
}

#if KVS_SIMD
inline int32_t load_i32(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// the multiplier of x's pair at p (XRow::mult) broadcast as int16: read as the two equal multipliers
// of one 32-bit word (a pure load into the vector, where a 16-bit broadcast also takes a shuffle)
inline __m256i mult_pairs(const int16_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// lanes_of_eight (below) before its widening: the two vpmaddubsw's pairs, added as int16
KVS_ALWAYS_INLINE __m256i pair_sums(__m256i c0, __m256i c1, const int8_t* x8) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(load_i32(x8))),
                            _mm256_maddubs_epi16(c1, _mm256_set1_epi32(load_i32(x8 + 4))));
}

// Eight elements of a sub-block of 8 (x8: the activation's int8s; m: its multiplier as XRow::mult
// holds it) against eight weight rows laid out a lane per row: c0 and c1 hold each row's u8 codes of
// elements 0..3 and 4..7; lane c = sum of row c's codes times x times the multiplier. The two
// vpmaddubsw's pairs add as int16 (four products of codes up to 63: below 2^15), vpmaddwd widens them
// with the multiplier. (VNNI's vpdpbusd and a shift instead, in the decode rows of the interleaved
// formats on Zen 4: Q4_K the same, Q5_K 5% and Q6_K 21% slower.)
KVS_ALWAYS_INLINE __m256i lanes_of_eight(__m256i c0, __m256i c1, const int8_t* x8, const int16_t* m) {
    return _mm256_madd_epi16(pair_sums(c0, c1, x8), mult_pairs(m));
}

// acc + lanes_of_eight(c0, c1, x8, m), Chained: the widening and the add in one vpdpwssd (common.h CAN_CHAIN_SUMS)
template <bool Chained>
KVS_ALWAYS_INLINE __m256i add_lanes_of_eight(__m256i acc, __m256i c0, __m256i c1, const int8_t* x8, const int16_t* m) {
#if defined(KVS_ISA_AVX512)
    if constexpr (Chained) return _mm256_dpwssd_epi32(acc, pair_sums(c0, c1, x8), mult_pairs(m));
#endif
    return _mm256_add_epi32(acc, lanes_of_eight(c0, c1, x8, m));
}

// signed_lanes_of_four (below) before its widening: |c| times x with c's sign, in int16 pairs
KVS_ALWAYS_INLINE __m256i signed_pairs(__m256i c, const int8_t* x4) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(_mm256_set1_epi32(load_i32(x4)), c));
}

// Signed int8 codes (Q8_0) against four elements (x4: the activation's int8s, m: their multiplier as
// XRow::mult holds it), a lane per weight row: |c| times x with c's sign, widened by vpmaddwd at once (two
// words' pairs added as int16 could reach 4 * 128 * 127)
KVS_ALWAYS_INLINE __m256i signed_lanes_of_four(__m256i c, const int8_t* x4, const int16_t* m) {
    return _mm256_madd_epi16(signed_pairs(c, x4), mult_pairs(m));
}

// acc + signed_lanes_of_four(c, x4, m), Chained: in one vpdpwssd
template <bool Chained>
KVS_ALWAYS_INLINE __m256i add_signed_lanes_of_four(__m256i acc, __m256i c, const int8_t* x4, const int16_t* m) {
#if defined(KVS_ISA_AVX512)
    if constexpr (Chained) return _mm256_dpwssd_epi32(acc, signed_pairs(c, x4), mult_pairs(m));
#endif
    return _mm256_add_epi32(acc, signed_lanes_of_four(c, x4, m));
}

// offset_dot of eight weight rows at once, bit for bit: offT holds their offsets transposed (block b's
// eight at offT[b * ldo ..]); each lane runs offset_dot's chain (lane l of the 8-block chunks as one
// fma chain, hsum8's tree over them, then the tail's multiply-adds in order)
inline __m256 offset_dots8(const float* offT, int64_t ldo, int64_t nb, const float* s) {
    __m256 a[8];
    for (int l = 0; l < 8; ++l) a[l] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        for (int l = 0; l < 8; ++l)
            a[l] = _mm256_fmadd_ps(_mm256_loadu_ps(offT + (b + l) * ldo), _mm256_broadcast_ss(s + b + l), a[l]);
    __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                             _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])));
    for (; b < nb; ++b) v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_loadu_ps(offT + b * ldo), _mm256_broadcast_ss(s + b)));
    return v;
}
#endif

}  // namespace kvs
