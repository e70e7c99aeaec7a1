// Block formats on integers: the activation rounding to int16 blocks of 32, the weight rows decoded to
// int16 codes with per-block float scales, and the integer dot-product tiles (see the chain below).
#pragma once
#include "matmul_quant.h"

namespace kvs {

#if KVS_SIMD
// a block's 32 codes times their sub-scales as int16: elements 0..15 in lo, 16..31 in hi
inline void widen_scaled(const Block32& k, __m256i* lo, __m256i* hi) {
    *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(k.c));
    *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(k.c, 1));
    if (k.sc0 != 1 || k.sc1 != 1) {
        *lo = _mm256_mullo_epi16(*lo, _mm256_set1_epi16(short(k.sc0)));
        *hi = _mm256_mullo_epi16(*hi, _mm256_set1_epi16(short(k.sc1)));
    }
}

// the integer kernel's row: codes times the sub-scale as int16 (|c * sc| <= 128 * 32: no overflow
// below), the block's d and offset as floats
struct Int16Sink {
    int16_t* q;
    float* d;
    float* off;
    void operator()(int64_t b, const Block32& k) const {
        __m256i lo, hi;
        widen_scaled(k, &lo, &hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b + 16), hi);
        d[b] = k.d;
        off[b] = k.off;
    }
};
#endif  // KVS_SIMD

// ---------------------------------------------------------------- block formats: int16 products
//
// Block formats run on integers: each activation row is rounded once to int16 per block of 32
// (x ~ q * dx, dx = max|x| / 32767: within max|x| / 65534 of x), each weight row decoded to int16
// codes (times the integer sub-scale) with a float d and offset per block. y[t, n] is one chain: per
// block, 8 int32 lanes of exact products (lane j: elements 2j, 2j + 1, 16 + 2j, 17 + 2j), converted
// and accumulated as acc += float(lanes) * (dw * dx) in block order; then the fixed-tree sum, then
// the offsets' dot sum_b off[b] * dx[b] * (sum of the block's q) (8 blocks a lane, then the tail).

constexpr bool has_offset(int type) { return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K; }

struct QRow {  // a decoded weight row: w[k] = d[k / 32] * q[k] + off[k / 32]
    const int16_t* q;
    const float* d;
    const float* off;
};

struct XRow {  // an activation row: x[k] ~ q[k] * d[k / 32]; s[b] = d[b] * (sum of block b's q)
    const int16_t* q;
    const float* d;
    const float* s;
};

// bytes of one decoded weight row in the scratch: q [K] int16, d [K / 32], off [K / 32]
inline int64_t qrow_bytes(int64_t K) { return 2 * K + 8 * (K / 32); }

// The scalar walk: block b's int8 codes and Block32 fields, as the SIMD walkers give them
inline void scalar_block(int type, const uint8_t* row, int64_t b, int8_t* c, float* d, int* sc0, int* sc1,
                         float* off) {
    *sc0 = *sc1 = 1;
    *off = 0.0f;
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const uint8_t* blk = row + b / 8 * geometry(type).bytes;
        const int j = int(b % 8);
        if (type == T_Q6_K) {
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            *d = load_f16(blk + 208);
            *sc0 = sc[2 * j];
            *sc1 = sc[2 * j + 1];
            for (int l = 0; l < 32; ++l) c[l] = int8_t(q6_code(blk, 32 * j + l) - 32);
            return;
        }
        const bool five = type == T_Q5_K;
        int sc, m;
        k4_scale_min(j, blk + 4, &sc, &m);
        *d = load_f16(blk);
        *sc0 = *sc1 = sc;
        *off = -(load_f16(blk + 2) * float(m));
        for (int l = 0; l < 32; ++l) c[l] = int8_t(k_code(blk + 16 + (five ? 32 : 0), five ? blk + 16 : nullptr, j, l));
        return;
    }
    const uint8_t* blk = row + b * geometry(type).bytes;
    *d = load_f16(blk);
    if (type == T_Q8_0) {
        for (int l = 0; l < 32; ++l) c[l] = reinterpret_cast<const int8_t*>(blk + 2)[l];
        return;
    }
    const bool has_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    const uint32_t qh = five ? load_u32(blk + 2 + (has_min ? 2 : 0)) : 0;
    const int bias = has_min ? 0 : (five ? 16 : 8);
    for (int l = 0; l < 32; ++l) {
        int v = l < 16 ? qs[l] & 15 : qs[l - 16] >> 4;
        if (five) v |= q5_high(qh, l);
        c[l] = int8_t(v - bias);
    }
    if (has_min) *off = load_f16(blk + 2);
}

// One weight row of a block format -> the integer kernel's row (q, d, off)
inline void decode_row_q(int type, const uint8_t* row, int64_t K, int16_t* q, float* d, float* off) {
#if KVS_SIMD
    Int16Sink sink{q, d, off};
    walk_blocks(type, row, K, sink);
#else
    for (int64_t b = 0; b < K / 32; ++b) {
        int8_t c[32];
        int sc0, sc1;
        scalar_block(type, row, b, c, &d[b], &sc0, &sc1, &off[b]);
        for (int l = 0; l < 32; ++l) q[32 * b + l] = int16_t(c[l] * (l < 16 ? sc0 : sc1));
    }
#endif
}

// x -> (q, d, s) per block of 32 (the same operations on every ISA)
inline void quantize_row(const float* x, int64_t K, int16_t* q, float* d, float* s) {
    for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + 32 * b;
        float amax = 0.0f;
#if KVS_SIMD
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < 32; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        amax = _mm_cvtss_f32(m4);
#else
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
        const float db = amax / 32767.0f;
        const float id = db > 0.0f ? 1.0f / db : 0.0f;
        int16_t* qb = q + 32 * b;
#if KVS_SIMD
        __m256i v[4];
        for (int i = 0; i < 4; ++i) {
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(id));
            t = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-32767.0f)), _mm256_set1_ps(32767.0f));
            v[i] = _mm256_cvtps_epi32(t);
        }
        // packs interleave 128-bit lanes; the permute puts the 16 values back in element order
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2], v[3]), 0xD8));
#else
        for (int i = 0; i < 32; ++i) qb[i] = int16_t(std::min(32767.0f, std::max(-32767.0f, std::nearbyint(xb[i] * id))));
#endif
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += qb[i];
        d[b] = db;
        s[b] = db * float(sum);
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

// y[r * ldy + c] = x[r] . w[c] for R activation rows and C decoded weight rows of nb blocks
template <int R, int C>
inline void qdot_tile(const XRow* x, const QRow* w, int64_t nb, bool offsets, float* y, int64_t ldy) {
#if KVS_SIMD
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w0[C], w1[C];
        __m256 dw[C];
        for (int c = 0; c < C; ++c) {
            w0[c] = load256(w[c].q + 32 * b);
            w1[c] = load256(w[c].q + 32 * b + 16);
            dw[c] = _mm256_broadcast_ss(w[c].d + b);
        }
        for (int r = 0; r < R; ++r) {
            const __m256i x0 = load256(x[r].q + 32 * b), x1 = load256(x[r].q + 32 * b + 16);
            const __m256 dx = _mm256_broadcast_ss(x[r].d + b);
            for (int c = 0; c < C; ++c) {
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[c], x0), _mm256_madd_epi16(w1[c], x1));
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[c], dx), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            float v = hsum8(acc[r][c]);
            if (offsets) v = v + offset_dot(w[c].off, x[r].s, nb);
            y[r * ldy + c] = v;
        }
    }
#else
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            float v = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int64_t p = 0;  // int64: Q6_K's 32 products can pass 2^31
                for (int l = 0; l < 32; ++l) p += int32_t(w[c].q[32 * b + l]) * x[r].q[32 * b + l];
                v = v + float(p) * (w[c].d[b] * x[r].d[b]);
            }
            if (offsets) v = v + offset_dot(w[c].off, x[r].s, nb);
            y[r * ldy + c] = v;
        }
    }
#endif
}

#if defined(KVS_ISA_AVX512)
// ---------------------------------------------------------------- AVX-512: two weight rows a vector
//
// Row c's chain in lanes 0..7 and row c + 1's in lanes 8..15, each lane running qdot_tile's AVX2
// operations exactly: the same int32 lanes (vpdpwssd adds the second pair of products to the first
// as _mm256_add_epi32 does: exact, no saturation), the same convert, multiply and fma, then hsum8 of
// each half. So every output has the AVX2 build's bits, at about half the instructions.

inline __m512i pair256(const void* lo, const void* hi) {  // [32 bytes at lo | 32 bytes at hi]
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(lo)), load256(hi), 1);
}

inline __m512 pair_ps(float lo, float hi) {  // lanes 0..7 lo, 8..15 hi
    return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

inline __m512i both_halves(const void* p) { return _mm512_broadcast_i64x4(load256(p)); }

// the chain's block step for one activation row and one pair of weight rows
inline __m512 pair_step(__m512 acc, __m512i w0, __m512i w1, __m512i x0, __m512i x1, __m512 scale) {
    const __m512i p = _mm512_dpwssd_epi32(_mm512_madd_epi16(w0, x0), w1, x1);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc);
}

// y[0], y[1] for a pair's two rows: each half's hsum8, then (offsets) that row's offsets' dot with
// the activation row's block sums s, as qdot_tile adds it
inline void store_pair(__m512 acc, const float* off0, const float* off1, const float* s, int64_t nb, bool offsets,
                       float* y) {
    const __m256 half[2] = {_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)};
    const float* off[2] = {off0, off1};
    for (int h = 0; h < 2; ++h) {
        float v = hsum8(half[h]);
        if (offsets) v = v + offset_dot(off[h], s, nb);
        y[h] = v;
    }
}

// y[r * ldy + c] = x[r] . w[c] for R activation rows and 2P decoded weight rows
template <int R, int P>
inline void qdot_tile_pairs(const XRow* x, const QRow* w, int64_t nb, bool offsets, float* y, int64_t ldy) {
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i w0[P], w1[P];
        __m512 dw[P];
        for (int p = 0; p < P; ++p) {
            w0[p] = pair256(w[2 * p].q + 32 * b, w[2 * p + 1].q + 32 * b);
            w1[p] = pair256(w[2 * p].q + 32 * b + 16, w[2 * p + 1].q + 32 * b + 16);
            dw[p] = pair_ps(w[2 * p].d[b], w[2 * p + 1].d[b]);
        }
        for (int r = 0; r < R; ++r) {
            const __m512i x0 = both_halves(x[r].q + 32 * b), x1 = both_halves(x[r].q + 32 * b + 16);
            const __m512 dx = _mm512_set1_ps(x[r].d[b]);
            for (int p = 0; p < P; ++p) acc[r][p] = pair_step(acc[r][p], w0[p], w1[p], x0, x1, _mm512_mul_ps(dw[p], dx));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p)
            store_pair(acc[r][p], w[2 * p].off, w[2 * p + 1].off, x[r].s, nb, offsets, y + r * ldy + 2 * p);
}

template <int R>
constexpr int qtile_pairs() { return R == 1 ? 4 : 3; }
#endif  // KVS_ISA_AVX512

template <int R>
constexpr int qtile_cols() { return R == 1 ? 4 : 2; }

// y[r * ldy + j] = x[r] . w[j] for R activation rows and nw decoded weight rows
template <int R>
inline void qdot_panel(const XRow* x, const QRow* w, int64_t nw, int64_t nb, bool offsets, float* y, int64_t ldy) {
#if defined(KVS_ISA_AVX512)
    constexpr int P = qtile_pairs<R>();
    int64_t i = 0;
    for (; i + 2 * P <= nw; i += 2 * P) qdot_tile_pairs<R, P>(x, w + i, nb, offsets, y + i, ldy);
    for (; i + 2 <= nw; i += 2) qdot_tile_pairs<R, 1>(x, w + i, nb, offsets, y + i, ldy);
    if (i < nw) qdot_tile<R, 1>(x, w + i, nb, offsets, y + i, ldy);
    return;
#endif
    constexpr int C = qtile_cols<R>();
    int64_t j = 0;
    for (; j + C <= nw; j += C) qdot_tile<R, C>(x, w + j, nb, offsets, y + j, ldy);
    switch (nw - j) {
        case 3: if constexpr (C > 3) qdot_tile<R, 3>(x, w + j, nb, offsets, y + j, ldy); break;
        case 2: if constexpr (C > 2) qdot_tile<R, 2>(x, w + j, nb, offsets, y + j, ldy); break;
        case 1: qdot_tile<R, 1>(x, w + j, nb, offsets, y + j, ldy); break;
        default: break;
    }
}

}  // namespace kvs
