// Per-format decoding of one weight row (the file's blocks) and the dot-product tiles that run R
// activation rows x C decoded weight rows in registers. Float formats (F32, F16, BF16) decode to float32
// and take float32 activations; block formats decode to 8-bit codes with per-block float scales and
// take activations rounded once to int8 per block of 32 (matmul_int8.h). Each output
// element is one chain of operations whatever R and C: they only choose which chains run side by
// side (batch- and tile-invariant by construction). Decoding uses the same operations on every ISA,
// so a weight decodes to the same value everywhere; the AVX-512 build runs the AVX2 code.
#pragma once
#include <algorithm>
#include <cmath>
#include "common.h"
#include "ops_simd.h"
#include "quant_formats.h"

#if defined(KVS_ISA_AVX2) || defined(KVS_ISA_AVX512)
#define KVS_SIMD 1
#else
#define KVS_SIMD 0
#endif

namespace kvs {

inline float half_at(const uint8_t* p) {
#if KVS_SIMD
    return _cvtsh_ss(load_u16(p));
#else
    return load_f16(p);
#endif
}

// ---------------------------------------------------------------- scalar (every ISA's reference)

inline int q5_high(uint32_t qh, int e) { return int((qh >> e) & 1) << 4; }

// Q6_K code (0..63) of element e (0..255) of one superblock
inline int q6_code(const uint8_t* blk, int e) {
    const uint8_t* ql = blk + 64 * (e / 128);
    const uint8_t* qh = blk + 128 + 32 * (e / 128);
    int g = (e % 128) / 32, l = e % 32;
    int lo = g & 1 ? ql[l + 32] : ql[l];
    lo = g & 2 ? lo >> 4 : lo & 15;
    return lo | ((qh[l] >> (2 * g)) & 3) << 4;
}

// Q4_K / Q5_K code of element l (0..31) of sub-block j (0..7)
inline int k_code(const uint8_t* qs, const uint8_t* qh, int j, int l) {
    int v = qs[32 * (j / 2) + l];
    v = j & 1 ? v >> 4 : v & 15;
    if (qh != nullptr) v |= ((qh[l] >> j) & 1) << 4;
    return v;
}

// Element k of one weight row of format Q: the reference every decoding path equals, bit for bit
template <int Q>
inline float dequant_one(const uint8_t* row, int64_t k) {
    constexpr Geometry g = geometry(Q);
    const uint8_t* blk = row + k / g.block * g.bytes;
    const int e = int(k % g.block);
    if constexpr (Q == KVS_F32) {
        float f;
        std::memcpy(&f, row + 4 * k, 4);
        return f;
    } else if constexpr (Q == KVS_F16) {
        return f16_to_f32(load_u16(row + 2 * k));
    } else if constexpr (Q == KVS_BF16) {
        return bf16_to_f32(load_u16(row + 2 * k));
    } else if constexpr (Q == KVS_Q8_0) {
        return load_f16(blk) * float(reinterpret_cast<const int8_t*>(blk + 2)[e]);
    } else if constexpr (Q == KVS_Q4_0 || Q == KVS_Q4_1 || Q == KVS_Q5_0 || Q == KVS_Q5_1) {
        constexpr bool has_min = Q == KVS_Q4_1 || Q == KVS_Q5_1, five = Q == KVS_Q5_0 || Q == KVS_Q5_1;
        const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
        int c = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
        if (five) c |= q5_high(load_u32(blk + 2 + (has_min ? 2 : 0)), e);
        const float d = load_f16(blk);
        if (has_min) return d * float(c) + load_f16(blk + 2);
        return d * float(c - (five ? 16 : 8));
    } else if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) {
        constexpr bool five = Q == KVS_Q5_K;
        int sc, m;
        k4_scale_min(e / 32, blk + 4, &sc, &m);
        const int c = k_code(blk + 16 + (five ? 32 : 0), five ? blk + 16 : nullptr, e / 32, e % 32);
        return load_f16(blk) * float(sc) * float(c) - load_f16(blk + 2) * float(m);
    } else {
        static_assert(Q == KVS_Q6_K, "a format without a reference decoding");
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        return load_f16(blk + 208) * float(sc[e / 16]) * float(q6_code(blk, e) - 32);
    }
}

#if KVS_SIMD
// ---------------------------------------------------------------- AVX2 decoding (the AVX-512 build too)

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One weight row's bytes as the decoders read them, at byte offsets from `row`: the walkers' and the
// AVX2 decode rows' source (the AVX-512 decode rows read two rows at once into one 512-bit vector:
// RowPair, matmul_direct.h). The codes below are written once on the vector type V the source gives.
struct OneRow {
    const uint8_t* row;
    __m256i bytes32(int64_t at) const { return load256(row + at); }
    // the 16 bytes at `at` in both 128-bit halves (a load, no shuffle)
    __m256i bytes16_twice(int64_t at) const {
        return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at)));
    }
};
inline __m256i vand(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i vor(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i vsrl16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
inline __m256i vsll16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
inline __m256i splat8(__m256i, char c) { return _mm256_set1_epi8(c); }  // (the first argument picks the type)
inline __m256i upper_halves_down4(__m256i a) { return _mm256_srlv_epi32(a, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)); }
#if defined(KVS_ISA_AVX512)
// Two weight rows' bytes in one 512-bit vector, row a's in the low half: the AVX-512 decode rows'
// source. Row b's half comes in by a masked broadcast load, not an insert: on Zen 4 an insert takes a
// slot on the two shuffle pipes that the decode rows' reductions keep busy (hot rows: Q4_K 9%, Q6_K 13% faster).
struct RowPair {
    const uint8_t* a;
    const uint8_t* b;
    __m512i bytes32(int64_t at) const {
        return _mm512_mask_broadcast_i64x4(_mm512_castsi256_si512(OneRow{a}.bytes32(at)), 0xF0, OneRow{b}.bytes32(at));
    }
    __m512i bytes16_twice(int64_t at) const {  // a's 16 bytes twice, then b's twice
        const auto load16 = [at](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)); };
        return _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(load16(a)), 0xFF00, load16(b));
    }
};
inline __m512i vand(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i vor(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i vsrl16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
inline __m512i vsll16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
inline __m512i splat8(__m512i, char c) { return _mm512_set1_epi8(c); }
inline __m512i upper_halves_down4(__m512i a) {
    return _mm512_srlv_epi32(a, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4));
}
#endif

// 16 bytes of nibbles at `at` -> 32 codes: the low nibbles (elements 0..15), then the high ones (16..31)
template <class Src>
inline auto nibbles32(const Src& src, int64_t at) {
    const auto v = src.bytes16_twice(at);  // the upper half of each 256 bits shifted by 4
    return vand(upper_halves_down4(v), splat8(v, 15));
}
inline __m256i nibbles32(const uint8_t* p) { return nibbles32(OneRow{p}, 0); }

// byte i = 0x10 where bit i of `bits` is set (the fifth bit of Q5_0/Q5_1 codes)
inline __m256i fifth_bits(uint32_t bits) {
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                         1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), idx), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

// the codes of sub-block j of a Q4_K, Q5_K or Q6_K superblock (src: at the superblock) as stored (Q4_K
// 0..15, Q5_K 0..31, Q6_K 0..63: the value plus 32), as the walkers and the decode rows unpack them
template <int Q, class Src>
inline auto k_codes(const Src& src, int j) {
    using V = decltype(src.bytes32(0));
    const V m15 = splat8(V{}, 15);
    if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) {
        const V q = src.bytes32((Q == KVS_Q5_K ? 48 : 16) + 32 * (j / 2));
        const V c = j & 1 ? vand(vsrl16(q, 4), m15) : vand(q, m15);
        if constexpr (Q == KVS_Q4_K) return c;
        // Q5_K's fifth bit: bit j of each byte of qh, moved to bit 4 of the same byte
        const V fifth = vsll16(vsrl16(src.bytes32(16), j), 4);
        return vor(c, vand(fifth, splat8(V{}, 0x10)));
    } else {  // walk_q6k's groups: half n = j / 4, group i = j % 4
        const int n = j / 4, i = j % 4;
        const V ql = src.bytes32(64 * n + 32 * (i & 1));
        const V qh = src.bytes32(128 + 32 * n);
        const V lo = i < 2 ? vand(ql, m15) : vand(vsrl16(ql, 4), m15);
        const V hi = i == 0 ? vsll16(qh, 4) : i == 1 ? vsll16(qh, 2) : i == 2 ? qh : vsrl16(qh, 2);
        return vor(lo, vand(hi, splat8(V{}, 0x30)));
    }
}
template <int Q>
inline __m256i k_codes(const uint8_t* blk, int j) { return k_codes<Q>(OneRow{blk}, j); }

// a Q5_0 / Q5_1 block's 32 codes in element order as stored: the fifth bits over the nibbles (0..31;
// Q5_0's value is the code minus 16)
template <int Q>
inline __m256i q5_codes(const uint8_t* blk) {
    constexpr int qh_at = Q == KVS_Q5_1 ? 4 : 2;
#if defined(KVS_ISA_AVX512)  // bit i of qh is a mask bit: one masked add (a nibble plus 16 is its or)
    const __m256i nibbles = nibbles32(blk + qh_at + 4);
    return _mm256_mask_add_epi8(nibbles, load_u32(blk + qh_at), nibbles, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(nibbles32(blk + qh_at + 4), fifth_bits(load_u32(blk + qh_at)));
#endif
}

// One block of 32 weights as the walkers below hand it to a sink: w[i] = d * sc[i / 16] * c[i] + off,
// c: 32 int8 codes in element order, sc: two integer sub-scales (1 where the format has none)
struct Block32 {
    __m256i c;
    float d;
    int sc0, sc1;
    float off;  // 0 where the format has no offset
};

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: w = d * c (+ m)
template <int Q, class Sink>
inline void walk_blocks32(const uint8_t* row, int64_t K, Sink& sink) {
    constexpr int bytes = geometry(Q).bytes;
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * bytes;
        __m256i c;
        float off = 0.0f;
        if constexpr (Q == KVS_Q8_0) {
            c = load256(blk + 2);
        } else if constexpr (Q == KVS_Q4_0) {
            c = _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
        } else if constexpr (Q == KVS_Q5_0) {
            c = _mm256_sub_epi8(q5_codes<Q>(blk), _mm256_set1_epi8(16));
        } else if constexpr (Q == KVS_Q4_1) {
            c = nibbles32(blk + 4);
            off = half_at(blk + 2);
        } else {  // Q5_1
            c = q5_codes<Q>(blk);
            off = half_at(blk + 2);
        }
        sink(b, Block32{c, half_at(blk), 1, 1, off});
    }
}

// Q4_K, Q5_K: superblocks of 8 sub-blocks of 32, w = d * sc * c - dmin * m
template <class Sink>
inline void walk_k4(bool five, const uint8_t* row, int64_t K, Sink& sink) {
    const int bytes = five ? 176 : 144;
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * bytes;
        const float d = half_at(blk), dmin = half_at(blk + 2);
        uint64_t scales, mins;
        k4_scales_mins(blk + 4, scales, mins);
        for (int j = 0; j < 8; ++j) {
            const __m256i c = five ? k_codes<KVS_Q5_K>(blk, j) : k_codes<KVS_Q4_K>(blk, j);
            const int sc = int(scales >> (8 * j) & 0xff), m = int(mins >> (8 * j) & 0xff);
            sink(sb * 8 + j, Block32{c, d, sc, sc, -(dmin * float(m))});
        }
    }
}

// Q6_K: 16 sub-blocks of 16 with int8 scales, w = d * sc * (c - 32)
template <class Sink>
inline void walk_q6k(const uint8_t* row, int64_t K, Sink& sink) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = row + sb * 210;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = half_at(blk + 208);
        for (int j = 0; j < 8; ++j)
            sink(sb * 8 + j, Block32{_mm256_sub_epi8(k_codes<KVS_Q6_K>(blk, j), _mm256_set1_epi8(32)), d, sc[2 * j],
                                     sc[2 * j + 1], 0.0f});
    }
}

// every block of one row of block format Q, in order, to `sink`
template <int Q, class Sink>
inline void walk(const uint8_t* row, int64_t K, Sink& sink) {
    if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) {
        walk_k4(Q == KVS_Q5_K, row, K, sink);
    } else if constexpr (Q == KVS_Q6_K) {
        walk_q6k(row, K, sink);
    } else {
        walk_blocks32<Q>(row, K, sink);
    }
}

// out[i] = scale * c[i] (+ off) for the 8 int8 codes in the low half of v, as dequant_one computes it:
// where there is an offset, scale * c is exact in float32 (at most 11 + 6 + 5 bits), so the fma rounds
// once as dequant_one's add does (and x - y is x + (-y) exactly)
inline void emit8(__m128i v, __m256 scale, float off, float* out) {
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    _mm256_storeu_ps(out, off != 0.0f ? _mm256_fmadd_ps(scale, c, _mm256_set1_ps(off)) : _mm256_mul_ps(scale, c));
}

// the float32 weights of each block (d * sc first, as dequant_one)
struct FloatSink {
    float* out;
    void operator()(int64_t b, const Block32& k) const {
        const __m256 s0 = _mm256_set1_ps(k.d * float(k.sc0)), s1 = _mm256_set1_ps(k.d * float(k.sc1));
        const __m128i lo = _mm256_castsi256_si128(k.c), hi = _mm256_extracti128_si256(k.c, 1);
        float* o = out + 32 * b;
        emit8(lo, s0, k.off, o);
        emit8(_mm_srli_si128(lo, 8), s0, k.off, o + 8);
        emit8(hi, s1, k.off, o + 16);
        emit8(_mm_srli_si128(hi, 8), s1, k.off, o + 24);
    }
};

inline float hsum8(__m256 v) {  // one fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif  // KVS_SIMD

// One weight row of format Q (the file's bytes, K elements) -> out[0, K) float32; the same values on
// every ISA (dequant_one's)
template <int Q>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
    int64_t k = 0;
    if constexpr (Q == KVS_F32) {
        std::memcpy(out, row, 4 * K);
        return;
    }
#if KVS_SIMD
    if constexpr (Q == KVS_F16) {
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(out + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
    } else if constexpr (Q == KVS_BF16) {
        for (; k + 8 <= K; k += 8) {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k)));
            _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
    } else if constexpr (!is_float_type(Q)) {
        FloatSink sink{out};
        walk<Q>(row, K, sink);
        return;
    }
#endif
    for (; k < K; ++k) out[k] = dequant_one<Q>(row, k);
}

// ---------------------------------------------------------------- the dot-product tile

// y[r * ldy + c] = x[r] . w[c] for R rows and C float weight rows of K floats: a vector of W lanes
// accumulates w[k] * x[k] (lane k % W) for k in order, then one fixed-tree sum, then the K % W tail
template <int R, int C>
inline void dot_tile(const float* const* x, const float* const* w, int64_t K, float* y, int64_t ldy) {
    using namespace simd;
    vf acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = vzero();
    int64_t k = 0;
    for (; k + W <= K; k += W) {
        vf wv[C];
        for (int c = 0; c < C; ++c) wv[c] = vload(w[c] + k);
        for (int r = 0; r < R; ++r) {
            const vf xv = vload(x[r] + k);
            for (int c = 0; c < C; ++c) acc[r][c] = vfma(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            float s = hsum(acc[r][c]);
            for (int64_t j = k; j < K; ++j) s = s + w[c][j] * x[r][j];
            y[r * ldy + c] = s;
        }
    }
}

// Weight rows side by side for R activation rows: enough independent chains to hide the fma latency,
// few enough that accumulators, weights and one activation vector fit in the registers (simd::VF_BUDGET)
template <int R>
constexpr int tile_cols() {
    if constexpr (simd::VF_BUDGET >= 16) return R == 1 ? 8 : R == 2 ? 4 : 3;
    return R == 1 ? 3 : R == 2 ? 2 : 1;
}

// y[r * ldy + j] = x[r] . w[j] for R rows and nw weight rows
template <int R>
inline void dot_panel(const float* const* x, const float* const* w, int64_t nw, int64_t K, float* y, int64_t ldy) {
    constexpr int C = tile_cols<R>();
    int64_t j = 0;
    for (; j + C <= nw; j += C) dot_tile<R, C>(x, w + j, K, y + j, ldy);
    switch (nw - j) {
        case 7: if constexpr (C > 7) dot_tile<R, 7>(x, w + j, K, y + j, ldy); break;
        case 6: if constexpr (C > 6) dot_tile<R, 6>(x, w + j, K, y + j, ldy); break;
        case 5: if constexpr (C > 5) dot_tile<R, 5>(x, w + j, K, y + j, ldy); break;
        case 4: if constexpr (C > 4) dot_tile<R, 4>(x, w + j, K, y + j, ldy); break;
        case 3: if constexpr (C > 3) dot_tile<R, 3>(x, w + j, K, y + j, ldy); break;
        case 2: if constexpr (C > 2) dot_tile<R, 2>(x, w + j, K, y + j, ldy); break;
        case 1: dot_tile<R, 1>(x, w + j, K, y + j, ldy); break;
        default: break;
    }
}

}  // namespace kvs
