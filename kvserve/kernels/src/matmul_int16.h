// Block formats on integers: the activation rounding to int16 blocks of 32, the weight rows decoded to
// int16 codes with per-block float scales, and the integer dot-product tiles (see the chain below).
#pragma once
#include <type_traits>

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

#if KVS_SIMD
// Few activation rows (decode, a speculative verify): each weight row is decoded in registers as its
// blocks stream in and dotted with the R rows at once, never stored. The chain is qdot_tile's to the
// bit: the same int32 lanes, the same acc += float(lanes) * (dw * dx) per block, hsum8, offset_dot.
template <int R>
struct DotSink {
    const XRow* x;
    float* off;  // the row's per-block offsets, for offset_dot at the end
    __m256 acc[R];
    void operator()(int64_t b, const Block32& k) {
        __m256i w0, w1;
        widen_scaled(k, &w0, &w1);
        const __m256 dw = _mm256_set1_ps(k.d);
        off[b] = k.off;
        for (int r = 0; r < R; ++r) {
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, load256(x[r].q + 32 * b)),
                                               _mm256_madd_epi16(w1, load256(x[r].q + 32 * b + 16)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + b)), acc[r]);
        }
    }
};

// y[r * ldy] = x[r] . W[row] for R activation rows (1, 2 or 4: one compiled walker each, not inlined
// into every caller); `off` holds K / 32 floats
template <int R>
__attribute__((noinline)) void qdot_direct(int type, const uint8_t* row, int64_t nb, const XRow* x, bool offsets,
                                           float* off, float* y, int64_t ldy) {
    DotSink<R> sink{x, off, {}};
    for (int r = 0; r < R; ++r) sink.acc[r] = _mm256_setzero_ps();
    walk_blocks(type, row, 32 * nb, sink);
    for (int r = 0; r < R; ++r) {
        float v = hsum8(sink.acc[r]);
        if (offsets) v = v + offset_dot(off, x[r].s, nb);
        y[r * ldy] = v;
    }
}

// block b of C rows against R activation rows: acc[r][c] += float(lanes) * dwx[c][r][i]
template <int Q, int R, int C>
inline void direct32_block(const uint8_t* const* rows, int64_t b, const XRow* x, const float (&dwx)[C][R][8], int i,
                           __m256 (&acc)[R][C]) {
    constexpr int bytes = geometry(Q).bytes;
    const __m128i m15 = _mm_set1_epi8(15);
    __m256i w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
        const uint8_t* blk = rows[c] + b * bytes;
        if constexpr (Q == T_Q8_0) {
            w0[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
            w1[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
        } else if constexpr (Q == T_Q4_0 || Q == T_Q4_1) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (Q == T_Q4_1 ? 4 : 2)));
            w0[c] = _mm256_cvtepu8_epi16(_mm_and_si128(v, m15));
            w1[c] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m15));
            if constexpr (Q == T_Q4_0) {
                w0[c] = _mm256_sub_epi16(w0[c], _mm256_set1_epi16(8));
                w1[c] = _mm256_sub_epi16(w1[c], _mm256_set1_epi16(8));
            }
        } else {  // Q5_0 (codes - 16), Q5_1: the fifth bits over the nibbles, as walk_blocks32
            constexpr int qh_at = Q == T_Q5_1 ? 4 : 2;
            __m256i v = _mm256_or_si256(nibbles32(blk + qh_at + 4), fifth_bits(load_u32(blk + qh_at)));
            if constexpr (Q == T_Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
            w0[c] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
            w1[c] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
        }
    }
    for (int r = 0; r < R; ++r) {
        const __m256i x0 = load256(x[r].q + 32 * b), x1 = load256(x[r].q + 32 * b + 16);
        for (int c = 0; c < C; ++c) {
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[c], x0), _mm256_madd_epi16(w1[c], x1));
            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&dwx[c][r][i]), acc[r][c]);
        }
    }
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 rows for few activation rows, C weight rows side by side (independent
// chains): eight blocks at a time, whose fp16 scales (and Q4_1/Q5_1's offsets) are converted with one
// instruction and multiplied by the activations' scales as one vector. Each product, sum and
// conversion is the one qdot_tile makes (same int32 lanes, acc += float(lanes) * (dw * dx) in block
// order, offset_dot).
template <int Q, int R, int C>
inline void qdot_direct32(const uint8_t* const* rows, int64_t nb, const XRow* x, float* const* off, float* y,
                          int64_t ldy) {
    constexpr int bytes = geometry(Q).bytes;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    alignas(32) float dwx[C][R][8];
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int n8 = int(std::min<int64_t>(8, nb - b0));
        for (int c = 0; c < C; ++c) {
            const uint8_t* blk = rows[c] + b0 * bytes;
            if (n8 == 8) {
                __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#define KVS_LANE(i)                                                  \
    dh = _mm_insert_epi16(dh, load_u16(blk + (i) * bytes), (i));     \
    if constexpr (has_offset(Q)) mh = _mm_insert_epi16(mh, load_u16(blk + (i) * bytes + 2), (i));
                KVS_LANE(0) KVS_LANE(1) KVS_LANE(2) KVS_LANE(3) KVS_LANE(4) KVS_LANE(5) KVS_LANE(6) KVS_LANE(7)
#undef KVS_LANE
                const __m256 d8 = _mm256_cvtph_ps(dh);
                for (int r = 0; r < R; ++r) _mm256_store_ps(dwx[c][r], _mm256_mul_ps(d8, _mm256_loadu_ps(x[r].d + b0)));
                if constexpr (has_offset(Q)) _mm256_storeu_ps(off[c] + b0, _mm256_cvtph_ps(mh));
            } else {
                for (int i = 0; i < n8; ++i) {
                    const float d = half_at(blk + i * bytes);
                    for (int r = 0; r < R; ++r) dwx[c][r][i] = d * x[r].d[b0 + i];
                    off[c][b0 + i] = has_offset(Q) ? half_at(blk + i * bytes + 2) : 0.0f;
                }
            }
        }
        // a full group unrolled (the accumulators stay in registers), the row's last blocks one by one
        if (n8 == 8) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) direct32_block<Q, R, C>(rows, b0 + i, x, dwx, i, acc);
        } else {
            for (int i = 0; i < n8; ++i) direct32_block<Q, R, C>(rows, b0 + i, x, dwx, i, acc);
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            float v = hsum8(acc[r][c]);
            if constexpr (has_offset(Q)) v = v + offset_dot(off[c], x[r].s, nb);
            y[r * ldy + c] = v;
        }
    }
}

template <int R>
constexpr int direct_cols() { return R == 1 ? 4 : R <= 4 ? 2 : 1; }

// y[r * ldy + j] = x[r] . W[lo + j] for R activation rows and the weight rows lo .. hi; `off` holds
// direct_cols<R>() rows of K / 32 floats
template <int R>
inline void qdot_direct_rows(int type, const uint8_t* w, int64_t row_bytes, int64_t lo, int64_t hi, int64_t nb,
                             const XRow* x, bool offsets, float* off, float* y, int64_t ldy) {
    constexpr int C = direct_cols<R>();
    const uint8_t* rows[C];
    float* offs[C];
    for (int c = 0; c < C; ++c) offs[c] = off + c * nb;
    int64_t n = lo;
    auto run32 = [&](auto q) {
        constexpr int Q = decltype(q)::value;
        for (; n + C <= hi; n += C) {
            for (int c = 0; c < C; ++c) rows[c] = w + (n + c) * row_bytes;
            // the weights stream from memory once: ask for the rows three groups ahead while these compute
            const uint8_t* ahead = w + std::min(hi, n + 4 * C) * row_bytes;
            for (const uint8_t* p = w + std::min(hi, n + 3 * C) * row_bytes; p < ahead; p += 64)
                _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
            qdot_direct32<Q, R, C>(rows, nb, x, offs, y + n, ldy);
        }
        if (n < hi) {  // the last rows: a full tile over repeats of the last row, only the real ones kept
            float tail[R * C];
            for (int c = 0; c < C; ++c) rows[c] = w + std::min(n + c, hi - 1) * row_bytes;
            qdot_direct32<Q, R, C>(rows, nb, x, offs, tail, C);
            for (int r = 0; r < R; ++r)
                for (int64_t c = 0; c < hi - n; ++c) y[r * ldy + n + c] = tail[r * C + c];
        }
    };
    switch (type) {
        case T_Q4_0: run32(std::integral_constant<int, T_Q4_0>{}); return;
        case T_Q4_1: run32(std::integral_constant<int, T_Q4_1>{}); return;
        case T_Q5_0: run32(std::integral_constant<int, T_Q5_0>{}); return;
        case T_Q5_1: run32(std::integral_constant<int, T_Q5_1>{}); return;
        case T_Q8_0: run32(std::integral_constant<int, T_Q8_0>{}); return;
        default:
            for (; n < hi; ++n) {
                if (n + 4 < hi) {
                    const uint8_t* next = w + (n + 4) * row_bytes;
                    for (int64_t p = 0; p < row_bytes; p += 64)
                        _mm_prefetch(reinterpret_cast<const char*>(next + p), _MM_HINT_T0);
                }
                // the other formats in pieces of 4, 2 and 1 activation rows: three compiled walkers each
                for (int t = 0; t < R;) {
                    const int64_t at = n + t * ldy;
                    if (R - t >= 4) {
                        qdot_direct<4>(type, w + n * row_bytes, nb, x + t, offsets, off, y + at, ldy);
                        t += 4;
                    } else if (R - t >= 2) {
                        qdot_direct<2>(type, w + n * row_bytes, nb, x + t, offsets, off, y + at, ldy);
                        t += 2;
                    } else {
                        qdot_direct<1>(type, w + n * row_bytes, nb, x + t, offsets, off, y + at, ldy);
                        t += 1;
                    }
                }
            }
    }
}
#endif  // KVS_SIMD

template <int R>
constexpr int qtile_cols() { return R == 1 ? 4 : 2; }

// y[r * ldy + j] = x[r] . w[j] for R activation rows and nw decoded weight rows
template <int R>
inline void qdot_panel(const XRow* x, const QRow* w, int64_t nw, int64_t nb, bool offsets, float* y, int64_t ldy) {
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
