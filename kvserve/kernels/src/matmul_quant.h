// Per-format dot products of one weight row (the file's blocks) with NR activation rows, for the
// instruction set this build targets. Activations of the block formats are int8 in blocks of 32 with a
// float scale (ActRow); float formats take float32 rows. Every kernel's per-row arithmetic is the same
// whatever NR is: NR only shares the weight decoding between rows (batch-invariant by construction).
#pragma once
#include <cmath>
#include "common.h"
#include "quant_formats.h"

#if defined(KVS_ISA_AVX2) || defined(KVS_ISA_AVX512)
#define KVS_SIMD 1
#else
#define KVS_SIMD 0
#endif

namespace kvs {

// One level of an activation row quantized to int8 blocks of 32: x[k] ~ q[k] * d[k / 32]. A row is
// two levels (the second quantizes the first's residual), and the kernels take the levels as rows.
struct ActRow {
    const int8_t* q;     // [K]
    const float* d;      // [K / 32] block scales
    const int32_t* s16;  // [K / 16] sums of q over 16 elements
    const float* sd;     // [K / 32] d * (sum of q over the block): the min/offset terms' factor
};

inline float half_at(const uint8_t* p) {
#if KVS_SIMD
    return _cvtsh_ss(load_u16(p));
#else
    return load_f16(p);
#endif
}

// ---------------------------------------------------------------- scalar (every ISA's fallback)

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

inline float scalar_dot(int type, const uint8_t* w, const ActRow& x, int64_t K) {
    const int64_t nb = K / 32;
    float acc = 0.0f;
    switch (type) {
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: {
            const int bytes = geometry(type).bytes;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = w + b * bytes;
                const int8_t* xq = x.q + 32 * b;
                const float d = half_at(blk);
                int s = 0;
                if (type == T_Q8_0) {
                    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
                    for (int j = 0; j < 32; ++j) s += int(q[j]) * xq[j];
                } else {
                    const bool has_min = type == T_Q4_1 || type == T_Q5_1;
                    const bool five = type == T_Q5_0 || type == T_Q5_1;
                    const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
                    const uint32_t qh = five ? load_u32(blk + 2 + (has_min ? 2 : 0)) : 0;
                    const int offset = has_min ? 0 : (five ? 16 : 8);
                    for (int j = 0; j < 16; ++j) {
                        int lo = (qs[j] & 15) | (five ? q5_high(qh, j) : 0);
                        int hi = (qs[j] >> 4) | (five ? q5_high(qh, j + 16) : 0);
                        s += (lo - offset) * xq[j] + (hi - offset) * xq[j + 16];
                    }
                    if (has_min) acc = acc + half_at(blk + 2) * x.sd[b];
                }
                acc = acc + (d * x.d[b]) * float(s);
            }
            return acc;
        }
        case T_Q4_K: case T_Q5_K: {
            const bool five = type == T_Q5_K;
            const int bytes = geometry(type).bytes;
            for (int64_t sb = 0; sb < K / 256; ++sb) {
                const uint8_t* blk = w + sb * bytes;
                const float d = half_at(blk), dmin = half_at(blk + 2);
                const uint8_t* qh = five ? blk + 16 : nullptr;
                const uint8_t* qs = blk + 16 + (five ? 32 : 0);
                for (int j = 0; j < 8; ++j) {
                    int sc, m;
                    k4_scale_min(j, blk + 4, &sc, &m);
                    const int64_t b = sb * 8 + j;
                    const int8_t* xq = x.q + 32 * b;
                    int s = 0;
                    for (int l = 0; l < 32; ++l) s += k_code(qs, qh, j, l) * xq[l];
                    acc = acc + (d * float(sc) * x.d[b]) * float(s);
                    acc = acc - (dmin * float(m)) * x.sd[b];
                }
            }
            return acc;
        }
        case T_Q6_K: {
            for (int64_t sb = 0; sb < K / 256; ++sb) {
                const uint8_t* blk = w + sb * 210;
                const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
                const float d = half_at(blk + 208);
                for (int g = 0; g < 8; ++g) {
                    const int64_t b = sb * 8 + g;
                    const int8_t* xq = x.q + 32 * b;
                    int s = 0;
                    for (int l = 0; l < 32; ++l) s += sc[(32 * g + l) / 16] * (q6_code(blk, 32 * g + l) - 32) * xq[l];
                    acc = acc + (d * x.d[b]) * float(s);
                }
            }
            return acc;
        }
        default:
            return NAN;
    }
}

inline float float_weight(int type, const uint8_t* w, int64_t k) {
    switch (type) {
        case T_F32: { float f; std::memcpy(&f, w + 4 * k, 4); return f; }
        case T_F16: return f16_to_f32(load_u16(w + 2 * k));
        default: return bf16_to_f32(load_u16(w + 2 * k));
    }
}

inline float dequant_one(int type, const uint8_t* row, int64_t k) {
    const Geometry g = geometry(type);
    const uint8_t* blk = row + k / g.block * g.bytes;
    const int e = int(k % g.block);
    switch (type) {
        case T_F32: case T_F16: case T_BF16: return float_weight(type, row, k);
        case T_Q8_0: return load_f16(blk) * float(reinterpret_cast<const int8_t*>(blk + 2)[e]);
        case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: {
            const bool has_min = type == T_Q4_1 || type == T_Q5_1;
            const bool five = type == T_Q5_0 || type == T_Q5_1;
            const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
            int c = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
            if (five) c |= q5_high(load_u32(blk + 2 + (has_min ? 2 : 0)), e);
            const float d = load_f16(blk);
            if (has_min) return d * float(c) + load_f16(blk + 2);
            return d * float(c - (five ? 16 : 8));
        }
        case T_Q4_K: case T_Q5_K: {
            const bool five = type == T_Q5_K;
            int sc, m;
            k4_scale_min(e / 32, blk + 4, &sc, &m);
            const int c = k_code(blk + 16 + (five ? 32 : 0), five ? blk + 16 : nullptr, e / 32, e % 32);
            return load_f16(blk) * float(sc) * float(c) - load_f16(blk + 2) * float(m);
        }
        case T_Q6_K: {
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            return load_f16(blk + 208) * float(sc[e / 16]) * float(q6_code(blk, e) - 32);
        }
        default: return NAN;
    }
}

#if KVS_SIMD
// ---------------------------------------------------------------- AVX2 (+FMA, F16C)

inline __m256i mul_sum_u8s8(__m256i u, __m256i s) {  // 8 int32 sums of 4 products each
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum8(__m256 v) {  // one fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 codes: the low nibbles (elements 0..15), then the high ones (16..31)
inline __m256i nibbles32(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// byte i = 0x10 where bit i of `bits` is set (the fifth bit of Q5_0/Q5_1 codes)
inline __m256i fifth_bits(uint32_t bits) {
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                         1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), idx), sel);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, sel), _mm256_set1_epi8(0x10));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_0, Q5_0, Q8_0: signed codes, w = d * c
template <int NR>
inline void dot_signed32(int type, const uint8_t* w, const ActRow* x, int64_t nb, float* out) {
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    const int bytes = geometry(type).bytes;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * bytes;
        const float d = half_at(blk);
        __m256i c;
        if (type == T_Q8_0) {
            c = load256(blk + 2);
        } else if (type == T_Q4_0) {
            c = _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
        } else {  // Q5_0
            c = _mm256_or_si256(nibbles32(blk + 6), fifth_bits(load_u32(blk + 2)));
            c = _mm256_sub_epi8(c, _mm256_set1_epi8(16));
        }
        const __m256i ac = _mm256_sign_epi8(c, c);
        for (int r = 0; r < NR; ++r) {
            const __m256i xv = _mm256_sign_epi8(load256(x[r].q + 32 * b), c);
            const __m256 p = _mm256_cvtepi32_ps(mul_sum_u8s8(ac, xv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), p, acc[r]);
        }
    }
    for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
}

// Q4_1, Q5_1: unsigned codes, w = d * c + m
template <int NR>
inline void dot_min32(int type, const uint8_t* w, const ActRow* x, int64_t nb, float* out) {
    __m256 acc[NR];
    float macc[NR];
    for (int r = 0; r < NR; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
    const int bytes = geometry(type).bytes;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * bytes;
        const float d = half_at(blk), m = half_at(blk + 2);
        __m256i c = type == T_Q4_1 ? nibbles32(blk + 4)
                                   : _mm256_or_si256(nibbles32(blk + 8), fifth_bits(load_u32(blk + 4)));
        for (int r = 0; r < NR; ++r) {
            const __m256 p = _mm256_cvtepi32_ps(mul_sum_u8s8(c, load256(x[r].q + 32 * b)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), p, acc[r]);
            macc[r] = macc[r] + m * x[r].sd[b];
        }
    }
    for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]) + macc[r];
}

// Q4_K, Q5_K: superblocks of 8 sub-blocks of 32, w = d * sc * c - dmin * m
template <int NR>
inline void dot_k4(int type, const uint8_t* w, const ActRow* x, int64_t K, float* out) {
    __m256 acc[NR];
    float macc[NR];
    for (int r = 0; r < NR; ++r) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
    const bool five = type == T_Q5_K;
    const int bytes = geometry(type).bytes;
    const __m256i m15 = _mm256_set1_epi8(15);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = w + sb * bytes;
        const float d = half_at(blk), dmin = half_at(blk + 2);
        const uint8_t* qs = blk + 16 + (five ? 32 : 0);
        const __m256i qh = five ? load256(blk + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            k4_scale_min(j, blk + 4, &sc, &m);
            const __m256i q = load256(qs + 32 * (j / 2));
            __m256i c = j & 1 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m15) : _mm256_and_si256(q, m15);
            if (five) {
                const __m256i bit = _mm256_set1_epi8(char(1 << j));
                const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                c = _mm256_or_si256(c, _mm256_and_si256(on, _mm256_set1_epi8(0x10)));
            }
            const float dsc = d * float(sc), dm = dmin * float(m);
            const int64_t b = sb * 8 + j;
            for (int r = 0; r < NR; ++r) {
                const __m256 p = _mm256_cvtepi32_ps(mul_sum_u8s8(c, load256(x[r].q + 32 * b)));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dsc * x[r].d[b]), p, acc[r]);
                macc[r] = macc[r] - dm * x[r].sd[b];
            }
        }
    }
    for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]) + macc[r];
}

// Q6_K: 16 sub-blocks of 16 with int8 scales, w = d * sc * (c - 32)
template <int NR>
inline void dot_q6k(const uint8_t* w, const ActRow* x, int64_t K, float* out) {
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t* blk = w + sb * 210;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = half_at(blk + 208);
        for (int n = 0; n < 2; ++n) {
            const __m256i ql0 = load256(blk + 64 * n), ql1 = load256(blk + 64 * n + 32);
            const __m256i qh = load256(blk + 128 + 32 * n);
            __m256i g[4];
            g[0] = _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m48));
            g[1] = _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m48));
            g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m48));
            g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), m48));
            for (int i = 0; i < 4; ++i) {
                const int s0 = sc[8 * n + 2 * i], s1 = sc[8 * n + 2 * i + 1];
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(short(s1)), _mm_set1_epi16(short(s0)));
                const int64_t b = sb * 8 + 4 * n + i;
                for (int r = 0; r < NR; ++r) {
                    __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(g[i], load256(x[r].q + 32 * b)), scv);
                    const int corr = 32 * (s0 * x[r].s16[2 * b] + s1 * x[r].s16[2 * b + 1]);
                    v = _mm256_sub_epi32(v, _mm256_setr_epi32(corr, 0, 0, 0, 0, 0, 0, 0));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), _mm256_cvtepi32_ps(v), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
}

inline __m256 load_float8(int type, const uint8_t* w, int64_t k) {
    switch (type) {
        case T_F32: return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + k);
        case T_F16: return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k)));
        default: {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k)));
            return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        }
    }
}
#endif  // KVS_SIMD

// NR activation rows against one weight row of a block format
template <int NR>
inline void dot_quant(int type, const uint8_t* w, const ActRow* x, int64_t K, float* out) {
#if KVS_SIMD
    switch (type) {
        case T_Q4_0: case T_Q5_0: case T_Q8_0: return dot_signed32<NR>(type, w, x, K / 32, out);
        case T_Q4_1: case T_Q5_1: return dot_min32<NR>(type, w, x, K / 32, out);
        case T_Q4_K: case T_Q5_K: return dot_k4<NR>(type, w, x, K, out);
        case T_Q6_K: return dot_q6k<NR>(w, x, K, out);
        default: break;
    }
#endif
    for (int r = 0; r < NR; ++r) out[r] = scalar_dot(type, w, x[r], K);
}

// NR float32 activation rows against one weight row of a float format
template <int NR>
inline void dot_float(int type, const uint8_t* w, const float* const* x, int64_t K, float* out) {
    int64_t k = 0;
#if KVS_SIMD
    __m256 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = load_float8(type, w, k);
        for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
#else
    for (int r = 0; r < NR; ++r) out[r] = 0.0f;
#endif
    for (; k < K; ++k) {
        const float wk = float_weight(type, w, k);
        for (int r = 0; r < NR; ++r) out[r] = out[r] + wk * x[r][k];
    }
}

// NR float32 activation rows against one weight row of a block format: per block, the sum of
// codes times x, scaled by the block's d (Q8_0 vectorized; other formats decode each element)
template <int NR>
inline void dot_blocks_float(int type, const uint8_t* w, const float* const* x, int64_t K, float* out) {
#if KVS_SIMD
    if (type == T_Q8_0) {
        __m256 acc[NR];
        for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < K / 32; ++b) {
            const uint8_t* blk = w + 34 * b;
            const __m256 d = _mm256_set1_ps(half_at(blk));
            __m256 q[4];
            for (int i = 0; i < 4; ++i) {
                const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
                q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
            }
            for (int r = 0; r < NR; ++r) {
                const float* xb = x[r] + 32 * b;
                const __m256 s01 = _mm256_add_ps(_mm256_mul_ps(q[0], _mm256_loadu_ps(xb)),
                                                 _mm256_mul_ps(q[1], _mm256_loadu_ps(xb + 8)));
                const __m256 s23 = _mm256_add_ps(_mm256_mul_ps(q[2], _mm256_loadu_ps(xb + 16)),
                                                 _mm256_mul_ps(q[3], _mm256_loadu_ps(xb + 24)));
                acc[r] = _mm256_fmadd_ps(d, _mm256_add_ps(s01, s23), acc[r]);
            }
        }
        for (int r = 0; r < NR; ++r) out[r] = hsum8(acc[r]);
        return;
    }
#endif
    for (int r = 0; r < NR; ++r) out[r] = 0.0f;
    float wb[32];
    for (int64_t b = 0; b < K / 32; ++b) {
        for (int j = 0; j < 32; ++j) wb[j] = dequant_one(type, w, 32 * b + j);
        for (int r = 0; r < NR; ++r) {
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) s = s + wb[j] * x[r][32 * b + j];
            out[r] = out[r] + s;
        }
    }
}

}  // namespace kvs
