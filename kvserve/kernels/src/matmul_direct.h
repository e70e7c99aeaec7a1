// The decode path of the block formats: up to a few activation rows (decode, a speculative verify)
// against weight rows decoded in registers as they stream in, with the same chain as the tiles.
#pragma once
#include <type_traits>

#include "matmul_int16.h"

namespace kvs {

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
        } else {  // Q5_0, Q5_1 as walk_blocks32
            const __m256i v = q5_codes<Q>(blk);
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

// Blocks b0 .. b0 + n8 of one weight row (n8 <= 8, blk at block b0): to[r * stride + i] = d_i * dx
// of activation row r, and the offsets into off[b0 + i]. A full group converts its eight fp16 scales
// (and offsets) with one instruction and multiplies them by the activations' scales as one vector.
template <int Q, int R>
inline void group_scales(const uint8_t* blk, int n8, int64_t b0, const XRow* x, float* to, int stride, float* off) {
    constexpr int bytes = geometry(Q).bytes;
    if (n8 == 8) {
        __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
#define KVS_LANE(i)                                                  \
    dh = _mm_insert_epi16(dh, load_u16(blk + (i) * bytes), (i));     \
    if constexpr (has_offset(Q)) mh = _mm_insert_epi16(mh, load_u16(blk + (i) * bytes + 2), (i));
        KVS_LANE(0) KVS_LANE(1) KVS_LANE(2) KVS_LANE(3) KVS_LANE(4) KVS_LANE(5) KVS_LANE(6) KVS_LANE(7)
#undef KVS_LANE
        const __m256 d8 = _mm256_cvtph_ps(dh);
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(to + r * stride, _mm256_mul_ps(d8, _mm256_loadu_ps(x[r].d + b0)));
        if constexpr (has_offset(Q)) _mm256_storeu_ps(off + b0, _mm256_cvtph_ps(mh));
        return;
    }
    for (int i = 0; i < n8; ++i) {
        const float d = half_at(blk + i * bytes);
        for (int r = 0; r < R; ++r) to[r * stride + i] = d * x[r].d[b0 + i];
        off[b0 + i] = has_offset(Q) ? half_at(blk + i * bytes + 2) : 0.0f;
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
        for (int c = 0; c < C; ++c) group_scales<Q, R>(rows[c] + b0 * bytes, n8, b0, x, dwx[c][0], 8, off[c]);
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

// Q4_K and Q6_K rows for few activation rows, C weight rows side by side (independent chains): each
// superblock's codes unpacked in registers, times their sub-scales as int16 (always multiplied:
// times 1 is exact, so this is widen_scaled's value), then qdot_tile's chain per sub-block of 32 (same
// int32 lanes, acc += float(lanes) * (d * dx) in block order, hsum8, Q4_K's offset_dot).
template <int Q, int R, int C>
inline void qdot_directk(const uint8_t* const* rows, int64_t nb, const XRow* x, float* const* off, float* y,
                         int64_t ldy) {
    static_assert(Q == T_Q4_K || Q == T_Q6_K, "Q4_K and Q6_K only");
    constexpr int bytes = geometry(Q).bytes;
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
        const uint8_t* blk[C];
        __m256 d[C];
        int sc[C][16];  // each sub-block's scales: Q4_K one per 32 (twice), Q6_K one per 16
        for (int c = 0; c < C; ++c) {
            blk[c] = rows[c] + sb * bytes;
            if constexpr (Q == T_Q4_K) {
                d[c] = _mm256_set1_ps(half_at(blk[c]));
                const float dmin = half_at(blk[c] + 2);
                for (int j = 0; j < 8; ++j) {
                    int m;
                    k4_scale_min(j, blk[c] + 4, &sc[c][2 * j], &m);
                    sc[c][2 * j + 1] = sc[c][2 * j];
                    off[c][sb * 8 + j] = -(dmin * float(m));
                }
            } else {
                d[c] = _mm256_set1_ps(half_at(blk[c] + 208));
                for (int i = 0; i < 16; ++i) sc[c][i] = reinterpret_cast<const int8_t*>(blk[c] + 192)[i];
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            const int64_t b = sb * 8 + j;
            __m256i w0[C], w1[C];
            for (int c = 0; c < C; ++c) {
                __m256i v;
                if constexpr (Q == T_Q4_K) {
                    const __m256i q = load256(blk[c] + 16 + 32 * (j / 2));
                    v = j & 1 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m15) : _mm256_and_si256(q, m15);
                } else {  // walk_q6k's groups: half n = j / 4, group i = j % 4
                    const int n = j / 4, i = j % 4;
                    const __m256i ql = load256(blk[c] + 64 * n + 32 * (i & 1));
                    const __m256i qh = load256(blk[c] + 128 + 32 * n);
                    const __m256i lo = i < 2 ? _mm256_and_si256(ql, m15) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m15);
                    const __m256i hi = i == 0 ? _mm256_slli_epi16(qh, 4) : i == 1 ? _mm256_slli_epi16(qh, 2)
                                       : i == 2 ? qh : _mm256_srli_epi16(qh, 2);
                    v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hi, m48)), bias);
                }
                w0[c] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                           _mm256_set1_epi16(short(sc[c][2 * j])));
                w1[c] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                           _mm256_set1_epi16(short(sc[c][2 * j + 1])));
            }
            for (int r = 0; r < R; ++r) {
                const __m256i x0 = load256(x[r].q + 32 * b), x1 = load256(x[r].q + 32 * b + 16);
                const __m256 dx = _mm256_broadcast_ss(x[r].d + b);
                for (int c = 0; c < C; ++c) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0[c], x0), _mm256_madd_epi16(w1[c], x1));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d[c], dx), acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            float v = hsum8(acc[r][c]);
            if constexpr (Q == T_Q4_K) v = v + offset_dot(off[c], x[r].s, nb);
            y[r * ldy + c] = v;
        }
    }
}

#if defined(KVS_ISA_AVX512)
// ---------------------------------------------------------------- AVX-512: two weight rows a vector
// The direct tiles above with rows c and c + 1 in one vector (lanes 0..7 and 8..15), each lane the
// AVX2 chain's operations exactly (pair_step), so the bits are the AVX2 build's and the tiles'.

// C8[h] = the 16 bytes at lo[h] | the 16 at hi[h]
inline __m256i pair128(const uint8_t* lo, const uint8_t* hi) {
    return _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(hi), reinterpret_cast<const __m128i*>(lo));
}

// block b of the pair (rows[0], rows[1]) as int16 codes: w0 = elements 0..15 of each row, w1 = 16..31
template <int Q>
inline void direct32_pair_codes(const uint8_t* const* rows, int64_t b, __m512i* w0, __m512i* w1) {
    constexpr int bytes = geometry(Q).bytes;
    const uint8_t* lo = rows[0] + b * bytes;
    const uint8_t* hi = rows[1] + b * bytes;
    if constexpr (Q == T_Q8_0) {
        *w0 = _mm512_cvtepi8_epi16(pair128(lo + 2, hi + 2));
        *w1 = _mm512_cvtepi8_epi16(pair128(lo + 18, hi + 18));
    } else if constexpr (Q == T_Q4_0 || Q == T_Q4_1) {
        constexpr int at = Q == T_Q4_1 ? 4 : 2;
        const __m256i v = pair128(lo + at, hi + at), m15 = _mm256_set1_epi8(15);
        *w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(v, m15));
        *w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15));
        if constexpr (Q == T_Q4_0) {
            *w0 = _mm512_sub_epi16(*w0, _mm512_set1_epi16(8));
            *w1 = _mm512_sub_epi16(*w1, _mm512_set1_epi16(8));
        }
    } else {  // Q5_0, Q5_1 as walk_blocks32
        const __m256i a = q5_codes<Q>(lo), c = q5_codes<Q>(hi);
        *w0 = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x20));
        *w1 = _mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x31));
    }
}

// qdot_direct32 for 2P rows side by side: dwx per pair and activation row holds both rows' eight
// scales (d * dx, as qdot_direct32 computes them), block i's taken out by one permute
template <int Q, int R, int P>
inline void qdot_direct32_pairs(const uint8_t* const* rows, int64_t nb, const XRow* x, float* const* off, float* y,
                                int64_t ldy) {
    constexpr int bytes = geometry(Q).bytes;
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    alignas(64) float dwx[P][R][16];
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int n8 = int(std::min<int64_t>(8, nb - b0));
        for (int c = 0; c < 2 * P; ++c)  // row c's scales in lanes 8 (c % 2) .. of its pair's vectors
            group_scales<Q, R>(rows[c] + b0 * bytes, n8, b0, x, &dwx[c / 2][0][8 * (c % 2)], 16, off[c]);
        auto block = [&](int i) {
            const int64_t b = b0 + i;
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8,
                                                                                           8, 8, 8, 8, 8, 8));
            __m512i w0[P], w1[P];
            for (int p = 0; p < P; ++p) direct32_pair_codes<Q>(rows + 2 * p, b, &w0[p], &w1[p]);
            for (int r = 0; r < R; ++r) {
                const __m512i x0 = both_halves(x[r].q + 32 * b), x1 = both_halves(x[r].q + 32 * b + 16);
                for (int p = 0; p < P; ++p)
                    acc[r][p] = pair_step(acc[r][p], w0[p], w1[p], x0, x1,
                                          _mm512_permutexvar_ps(pick, _mm512_load_ps(dwx[p][r])));
            }
        };
        if (n8 == 8) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; ++i) block(i);
        } else {
            for (int i = 0; i < n8; ++i) block(i);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p)
            store_pair(acc[r][p], off[2 * p], off[2 * p + 1], x[r].s, nb, has_offset(Q), y + r * ldy + 2 * p);
}

// [a x 16 | b x 16] as int16
inline __m512i pair_epi16(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(short(a))), _mm256_set1_epi16(short(b)), 1);
}

// qdot_directk for 2P rows side by side
template <int Q, int R, int P>
inline void qdot_directk_pairs(const uint8_t* const* rows, int64_t nb, const XRow* x, float* const* off, float* y,
                               int64_t ldy) {
    static_assert(Q == T_Q4_K || Q == T_Q6_K, "Q4_K and Q6_K only");
    constexpr int bytes = geometry(Q).bytes;
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
        const uint8_t* blk[2 * P];
        float d[2 * P];
        int sc[2 * P][16];
        for (int c = 0; c < 2 * P; ++c) {
            blk[c] = rows[c] + sb * bytes;
            if constexpr (Q == T_Q4_K) {
                d[c] = half_at(blk[c]);
                const float dmin = half_at(blk[c] + 2);
                for (int j = 0; j < 8; ++j) {
                    int m;
                    k4_scale_min(j, blk[c] + 4, &sc[c][2 * j], &m);
                    sc[c][2 * j + 1] = sc[c][2 * j];
                    off[c][sb * 8 + j] = -(dmin * float(m));
                }
            } else {
                d[c] = half_at(blk[c] + 208);
                for (int i = 0; i < 16; ++i) sc[c][i] = reinterpret_cast<const int8_t*>(blk[c] + 192)[i];
            }
        }
        __m512 dp[P];
        for (int p = 0; p < P; ++p) dp[p] = pair_ps(d[2 * p], d[2 * p + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            const int64_t b = sb * 8 + j;
            __m256i v[2 * P];
            for (int c = 0; c < 2 * P; ++c) {
                if constexpr (Q == T_Q4_K) {
                    const __m256i q = load256(blk[c] + 16 + 32 * (j / 2));
                    v[c] = j & 1 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m15) : _mm256_and_si256(q, m15);
                } else {
                    const int n = j / 4, i = j % 4;
                    const __m256i ql = load256(blk[c] + 64 * n + 32 * (i & 1));
                    const __m256i qh = load256(blk[c] + 128 + 32 * n);
                    const __m256i lo = i < 2 ? _mm256_and_si256(ql, m15) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m15);
                    const __m256i hi = i == 0 ? _mm256_slli_epi16(qh, 4) : i == 1 ? _mm256_slli_epi16(qh, 2)
                                       : i == 2 ? qh : _mm256_srli_epi16(qh, 2);
                    v[c] = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(hi, m48)), bias);
                }
            }
            __m512i w0[P], w1[P];
            for (int p = 0; p < P; ++p) {
                const __m256i a = v[2 * p], c = v[2 * p + 1];
                w0[p] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x20)),
                                           pair_epi16(sc[2 * p][2 * j], sc[2 * p + 1][2 * j]));
                w1[p] = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm256_permute2x128_si256(a, c, 0x31)),
                                           pair_epi16(sc[2 * p][2 * j + 1], sc[2 * p + 1][2 * j + 1]));
            }
            for (int r = 0; r < R; ++r) {
                const __m512i x0 = both_halves(x[r].q + 32 * b), x1 = both_halves(x[r].q + 32 * b + 16);
                const __m512 dx = _mm512_set1_ps(x[r].d[b]);
                for (int p = 0; p < P; ++p) acc[r][p] = pair_step(acc[r][p], w0[p], w1[p], x0, x1, _mm512_mul_ps(dp[p], dx));
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p)
            store_pair(acc[r][p], off[2 * p], off[2 * p + 1], x[r].s, nb, Q == T_Q4_K, y + r * ldy + 2 * p);
}
#endif  // KVS_ISA_AVX512

template <int R>
constexpr int direct_cols() {
#if defined(KVS_ISA_AVX512)
    return R <= 4 ? 4 : 2;  // pairs of rows, 32 vector registers
#else
    return R == 1 ? 4 : R <= 4 ? 2 : 1;
#endif
}

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
    auto dot = [&](auto q, float* out, int64_t ld) {  // the tile of `rows`: out[r * ld + c]
        constexpr int Q = decltype(q)::value;
#if defined(KVS_ISA_AVX512)
        if constexpr (C % 2 == 0) {
            if constexpr (Q == T_Q4_K || Q == T_Q6_K) {
                qdot_directk_pairs<Q, R, C / 2>(rows, nb, x, offs, out, ld);
            } else {
                qdot_direct32_pairs<Q, R, C / 2>(rows, nb, x, offs, out, ld);
            }
            return;
        }
#endif
        if constexpr (Q == T_Q4_K || Q == T_Q6_K) {
            qdot_directk<Q, R, C>(rows, nb, x, offs, out, ld);
        } else {
            qdot_direct32<Q, R, C>(rows, nb, x, offs, out, ld);
        }
    };
    auto run32 = [&](auto q) {
        for (; n + C <= hi; n += C) {
            for (int c = 0; c < C; ++c) rows[c] = w + (n + c) * row_bytes;
            // the weights stream from memory once: ask for the rows three groups ahead while these compute
            const uint8_t* ahead = w + std::min(hi, n + 4 * C) * row_bytes;
            for (const uint8_t* p = w + std::min(hi, n + 3 * C) * row_bytes; p < ahead; p += 64)
                _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
            dot(q, y + n, ldy);
        }
        if (n < hi) {  // the last rows: a full tile over repeats of the last row, only the real ones kept
            float tail[R * C];
            for (int c = 0; c < C; ++c) rows[c] = w + std::min(n + c, hi - 1) * row_bytes;
            dot(q, tail, C);
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
        case T_Q4_K: run32(std::integral_constant<int, T_Q4_K>{}); return;
        case T_Q6_K: run32(std::integral_constant<int, T_Q6_K>{}); return;
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

}  // namespace kvs
