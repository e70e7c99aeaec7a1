// The decode path of the block formats: up to a few activation rows (decode, a speculative verify)
// against weight rows decoded in registers as they stream in, with the same chain as the tiles.
#pragma once
#include "interleave.h"
#include "matmul_int8.h"

namespace kvs {

// qdot_direct_rows (below) of one format and row count: (w, row_bytes, lo, hi, prefetch_hi, nb, x, off, y, ldy)
using DirectFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const XRow*, float*, float*,
                         int64_t);

#if KVS_SIMD
constexpr int DIRECT_GROUP = 8;  // weight rows decoded side by side, their totals one 256-bit vector
// The decode rows of interleaved twin `type` for `rows` activation rows with their sums chained by vpdpwssd, or
// null (no such twin; a build that cannot chain). Instantiated in matmul_chained.cpp, a translation unit of its
// own: as many kernels again as a build's decode rows, compiled beside matmul.cpp rather than after it.
DirectFn chained_rows(int type, int64_t rows);

// The group's weight rows as the products see them: one row a 256-bit vector, or on AVX-512 two (row
// 2v in the low half, 2v + 1 in the high one: the products and the lanes' reduction at twice the
// width); the totals and the float chain after them are the same on both, bit for bit.
#if defined(KVS_ISA_AVX512)
using wvec = __m512i;
constexpr int ROWS_PER_VEC = 2;

// f(c) (a 256-bit vector of weight row c) for the rows of vector v
template <class F>
inline wvec rows_of(int v, F f) { return _mm512_inserti64x4(_mm512_castsi256_si512(f(2 * v)), f(2 * v + 1), 1); }
inline wvec both_halves(__m256i x) { return _mm512_broadcast_i64x4(x); }
// the source of vector v of a group's codes (rows: the group's eight): its rows 2v and 2v + 1
inline RowPair rows_source(const uint8_t* const* rows, int v) { return {rows[2 * v], rows[2 * v + 1]}; }
inline wvec abs8(wvec w) { return _mm512_abs_epi8(w); }

// block_lanes (below, the AVX2 build's) for two weight rows at once (AVX-512 has no vpsignb: x
// negated where w < 0 instead)
template <int Q>
inline wvec block_lanes(wvec w, wvec w_abs, wvec x, wvec mult) {
    if constexpr (codes_of(Q) == Codes::Signed) {
        const wvec signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
        return _mm512_madd_epi16(_mm512_maddubs_epi16(w_abs, signed_x), mult);
    } else {
        return _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), mult);
    }
}

// the eight rows' sums in order, quarter k (128 bits) of q03 holding four lanes of row k, of q47 of row 4 + k
inline __m256i row_sums(wvec q03, wvec q47) {
    const wvec t = _mm512_add_epi32(_mm512_unpacklo_epi32(q03, q47), _mm512_unpackhi_epi32(q03, q47));
    const wvec u = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));  // quarter k: rows k, 4 + k
    const wvec order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, u));
}

// half_totals8 (below, the AVX2 build's) of four vectors of two rows each
inline void half_totals8(const wvec* p, __m256i& first, __m256i& second) {
    // quarter k of f03: row k's lanes 0..3, of s03: its lanes 4..7 (f47, s47: row 4 + k's)
    const wvec f03 = _mm512_shuffle_i64x2(p[0], p[1], 0x88), s03 = _mm512_shuffle_i64x2(p[0], p[1], 0xDD);
    const wvec f47 = _mm512_shuffle_i64x2(p[2], p[3], 0x88), s47 = _mm512_shuffle_i64x2(p[2], p[3], 0xDD);
    first = row_sums(f03, f47);
    second = row_sums(s03, s47);
}

// totals8 (below, the AVX2 build's) of four vectors of two rows each
inline __m256i totals8(const wvec* p) {
    const wvec s03 = _mm512_add_epi32(_mm512_shuffle_i64x2(p[0], p[1], 0x88), _mm512_shuffle_i64x2(p[0], p[1], 0xDD));
    const wvec s47 = _mm512_add_epi32(_mm512_shuffle_i64x2(p[2], p[3], 0x88), _mm512_shuffle_i64x2(p[2], p[3], 0xDD));
    return row_sums(s03, s47);
}
#else
using wvec = __m256i;
constexpr int ROWS_PER_VEC = 1;

template <class F>
inline wvec rows_of(int v, F f) { return f(v); }
inline wvec both_halves(__m256i x) { return x; }
inline OneRow rows_source(const uint8_t* const* rows, int v) { return {rows[v]}; }
inline wvec abs8(wvec w) { return _mm256_abs_epi8(w); }

// Lanes of one block for one weight row (w: its codes as codes_of(Q) stores them, w_abs: |w| for
// Signed) and one activation row (x, its multipliers per pair of elements: mult), whose sum is the
// block's total before block_totals' per-row terms (Q6_K's: q6_block_totals').
template <int Q>
inline __m256i block_lanes(__m256i w, __m256i w_abs, __m256i x, __m256i mult) {
    if constexpr (codes_of(Q) == Codes::Signed) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)), mult);
    } else {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), mult);
    }
}

// the eight rows' sums of lanes 0..3 (first: elements 0..15 of the block) and of lanes 4..7 (second) of
// p[0..7] (each 8 int32 lanes), in row order
inline void half_totals8(const __m256i* p, __m256i& first, __m256i& second) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i e = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    // a: rows 0..3's sums of lanes 0..3, then of lanes 4..7; e: rows 4..7's
    first = _mm256_permute2x128_si256(a, e, 0x20);
    second = _mm256_permute2x128_si256(a, e, 0x31);
}

// the eight block totals of p[0..7], in order, as one vector
inline __m256i totals8(const __m256i* p) {
    __m256i first, second;
    half_totals8(p, first, second);
    return _mm256_add_epi32(first, second);
}
#endif
constexpr int GROUP_VECS = DIRECT_GROUP / ROWS_PER_VEC;

// Q6_K: eight weight rows' totals of one block against an activation row whose sums of q * m are `half`
// over the first 16 elements and `sum` over all 32. p: block_lanes of the codes as stored, the values
// plus 32, so 32 * (the half's sum) comes off each half's lanes before its sub-scale multiplies them
// (scales: the rows' int8 sub-scales of the two halves, bytes 0..7 and 8..15).
// (q6_scaled: the same from the halves' sums, first and second, one row a lane)
inline __m256i q6_scaled(__m256i first, __m256i second, __m128i scales, int32_t half, int32_t sum) {
    first = _mm256_sub_epi32(first, _mm256_set1_epi32(32 * half));
    second = _mm256_sub_epi32(second, _mm256_set1_epi32(32 * (sum - half)));
    return _mm256_add_epi32(_mm256_mullo_epi32(first, _mm256_cvtepi8_epi32(scales)),
                            _mm256_mullo_epi32(second, _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(scales, scales))));
}
inline __m256i q6_block_totals(const wvec* p, __m128i scales, int32_t half, int32_t sum) {
    __m256i first, second;
    half_totals8(p, first, second);
    return q6_scaled(first, second, scales, half, sum);
}

// Eight weight rows' totals of one block against one activation row (its block sum of q * m: xsum):
// totals8 of their block_lanes, then the terms each row has once a block: Q4_0's and Q5_0's bias
// (bias * xsum), Q4_K's and Q5_K's one sub-scale (scale: the eight rows')
template <int Q>
inline __m256i block_totals(const wvec* p, int32_t xsum, __m256i scale) {
    __m256i t = totals8(p);
    if constexpr (codes_of(Q) == Codes::Biased && Q != KVS_Q6_K) t = _mm256_sub_epi32(t, _mm256_set1_epi32(code_bias(Q) * xsum));
    if constexpr (Q == KVS_Q4_K || Q == KVS_Q5_K) t = _mm256_mullo_epi32(t, scale);
    return t;
}

// y[r * ldy + c] = lane c of acc[r], plus row c's offsets' dot where format Q has offsets (offT: the
// eight rows' offsets transposed, [nb][8])
template <int Q, int R>
inline void store_direct(const __m256 (&acc)[R], const XRow* x, const float* offT, int64_t nb, float* y, int64_t ldy) {
    for (int r = 0; r < R; ++r) {
        __m256 v = acc[r];
        if constexpr (has_offset(Q)) v = _mm256_add_ps(v, offset_dots8(offT, DIRECT_GROUP, nb, x[r].s));
        _mm256_storeu_ps(y + r * ldy, v);
    }
}

// Few activation rows (decode, a speculative verify): each group of eight weight rows is decoded in
// registers as its blocks stream in and dotted with the R rows at once, never stored. The chain is
// qdot_group's to the bit: the same block totals, acc = fma(float(total), dw * dx, acc) in block
// order, then offset_dot's.

// the fp16 at byte `at` of block b of each of the eight rows, as floats in row order: 16-bit loads
// interleaved by an unpack tree (three deep, not an eight-long chain of word inserts)
template <int Q>
KVS_ALWAYS_INLINE __m256 group_halves(const uint8_t* const* rows, int64_t b, int at) {
    constexpr int bytes = geometry(Q).bytes;
    __m128i h[DIRECT_GROUP];
    for (int c = 0; c < DIRECT_GROUP; ++c) {  // a 32-bit load where the block has the bytes (its high half unused)
        const uint8_t* p = rows[c] + b * bytes + at;
        h[c] = _mm_cvtsi32_si128(at + 4 <= bytes ? static_cast<int>(load_u32(p)) : load_u16(p));
    }
    for (int c = 0; c < DIRECT_GROUP; c += 2) h[c] = _mm_unpacklo_epi16(h[c], h[c + 1]);  // rows c, c + 1
    for (int c = 0; c < DIRECT_GROUP; c += 4) h[c] = _mm_unpacklo_epi32(h[c], h[c + 2]);  // rows c .. c + 3
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(h[0], h[4]));
}

// group_halves at bytes 0 and 2 (a block's d and m) from one 32-bit load a row
template <int Q>
KVS_ALWAYS_INLINE void group_half_pairs(const uint8_t* const* rows, int64_t b, __m256& d, __m256& m) {
    constexpr int bytes = geometry(Q).bytes;
    __m128i h[DIRECT_GROUP];
    for (int c = 0; c < DIRECT_GROUP; ++c) h[c] = _mm_cvtsi32_si128(static_cast<int>(load_u32(rows[c] + b * bytes)));
    for (int c = 0; c < DIRECT_GROUP; c += 2) h[c] = _mm_unpacklo_epi32(h[c], h[c + 1]);
    for (int c = 0; c < DIRECT_GROUP; c += 4) h[c] = _mm_unpacklo_epi64(h[c], h[c + 2]);  // rows c .. c + 3
    // each row's d, then each row's m
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m128i lo = _mm_shuffle_epi8(h[0], split), hi = _mm_shuffle_epi8(h[4], split);
    d = _mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi));
    m = _mm256_cvtph_ps(_mm_unpackhi_epi64(lo, hi));
}

// The weight bytes a group asks for ahead of its own, spread over its steps (blocks, or superblocks):
// step i asks for the lines that start in [from + i * per_step, from + (i + 1) * per_step), so the lines
// of the whole span are asked for once each, a few a step (where: KvsPrefetch; NONE asks for nothing)
struct SpreadPrefetch {
    const uint8_t* from;
    int64_t per_step;
    const uint8_t* end;
    int where;
    void step(int64_t i) const {
        if (where == KVS_PREFETCH_NONE) return;
        const auto line = [this](int64_t at) {
            const uintptr_t p = reinterpret_cast<uintptr_t>(from) + uintptr_t(at);
            return std::min(reinterpret_cast<const uint8_t*>((p + 63) & ~uintptr_t(63)), end);
        };
        prefetch_span(line(i * per_step), line((i + 1) * per_step), where);
    }
};

// the codes of vector v of a group at block b (rows: the group's eight) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// as codes_of(Q) stores them
template <int Q>
inline wvec block32_codes(const uint8_t* const* rows, int v, int64_t b) {
    constexpr int bytes = geometry(Q).bytes;
    if constexpr (Q == KVS_Q8_0) return rows_source(rows, v).bytes32(b * bytes + 2);
    if constexpr (Q == KVS_Q4_0 || Q == KVS_Q4_1) return nibbles32(rows_source(rows, v), b * bytes + (Q == KVS_Q4_1 ? 4 : 2));
    return rows_of(v, [&](int c) { return q5_codes<Q>(rows[c] + b * bytes); });  // Q5_0, Q5_1
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: eight weight rows against R activation rows; per block the eight
// rows' codes, then for each activation row their totals as one vector (totals8) and one fma
template <int Q, int R>
inline void qdot_direct32(const uint8_t* const* rows, int64_t nb, const XRow* x, float* offT, float* y,
                          int64_t ldy, const SpreadPrefetch& prefetch) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        prefetch.step(b);
        wvec w[GROUP_VECS], w_abs[GROUP_VECS];
        for (int v = 0; v < GROUP_VECS; ++v) {
            w[v] = block32_codes<Q>(rows, v, b);
            if constexpr (codes_of(Q) == Codes::Signed) {
                w_abs[v] = abs8(w[v]);
            } else {
                w_abs[v] = w[v];
            }
        }
        __m256 dw;
        if constexpr (has_offset(Q)) {
            __m256 m;
            group_half_pairs<Q>(rows, b, dw, m);
            _mm256_storeu_ps(offT + DIRECT_GROUP * b, m);
        } else {
            dw = group_halves<Q>(rows, b, 0);
        }
        for (int r = 0; r < R; ++r) {
            const wvec xq = both_halves(load256(x[r].q + 32 * b)), mult = both_halves(load256(x[r].mult + 16 * b));
            wvec p[GROUP_VECS];
            for (int v = 0; v < GROUP_VECS; ++v) p[v] = block_lanes<Q>(w[v], w_abs[v], xq, mult);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_totals<Q>(p, x[r].sum[b], _mm256_setzero_si256())),
                                     _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + b)), acc[r]);
        }
    }
    store_direct<Q, R>(acc, x, offT, nb, y, ldy);
}

// Q6_K: the int8 sub-scales of eight rows' superblocks (at byte `at` of blk[c]) regrouped: out[j] holds
// the rows' scales of sub-blocks 2 j (bytes 0..7, row order) and 2 j + 1 (bytes 8..15), a three-step unpack
KVS_ALWAYS_INLINE void q6_scales_by_subblock(const uint8_t* const* blk, int at, __m128i* out) {
    __m128i r[DIRECT_GROUP], pairs[8], quads[8];
    for (int c = 0; c < DIRECT_GROUP; ++c) r[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[c] + at));
    for (int i = 0; i < 4; ++i) {  // word k of pairs[i]: rows 2 i, 2 i + 1 at sub-block k (pairs[4 + i]: k + 8)
        pairs[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        pairs[4 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    // dword k of quads[h]: rows 0..3 at sub-block k (+ 8 for h >= 4), of quads[h + 1] at k + 4; quads[h + 2]
    // and quads[h + 3]: rows 4..7's
    for (int h = 0; h < 8; h += 4) {
        quads[h] = _mm_unpacklo_epi16(pairs[h], pairs[h + 1]);
        quads[h + 1] = _mm_unpackhi_epi16(pairs[h], pairs[h + 1]);
        quads[h + 2] = _mm_unpacklo_epi16(pairs[h + 2], pairs[h + 3]);
        quads[h + 3] = _mm_unpackhi_epi16(pairs[h + 2], pairs[h + 3]);
    }
    for (int q = 0; q < 4; ++q) {  // sub-blocks 4 q .. 4 q + 3: rows 0..3 in quads[lo], rows 4..7 in quads[lo + 2]
        const int lo = q / 2 * 4 + q % 2;
        out[2 * q] = _mm_unpacklo_epi32(quads[lo], quads[lo + 2]);
        out[2 * q + 1] = _mm_unpackhi_epi32(quads[lo], quads[lo + 2]);
    }
}

// Q4_K, Q5_K: the 6-bit sub-scales and mins of eight rows' superblocks (blk[c]), one row a 32-bit lane,
// in k4_scales_mins' order: byte j of sc[0] the scale of sub-block j, of sc[1] of sub-block 4 + j. (Always
// inlined, as q6_scales_by_subblock: out of line, a call a superblock made the interleaved Q4_K decode rows
// 6-13% slower on AVX-512 and ~15% on AVX2: hot rows, one thread, Zen 4.)
KVS_ALWAYS_INLINE void k4_scales_mins8(const uint8_t* const* blk, __m256i* sc, __m256i* mn) {
    __m128i a[2], b[2], c[2];  // each row's scale bytes 0..3, 4..7, 8..11: rows 0..3, then rows 4..7
    for (int h = 0; h < 2; ++h) {
        __m128i x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * h + i] + 4));
        const __m128i ab01 = _mm_unpacklo_epi32(x[0], x[1]), ab23 = _mm_unpacklo_epi32(x[2], x[3]);
        a[h] = _mm_unpacklo_epi64(ab01, ab23);
        b[h] = _mm_unpackhi_epi64(ab01, ab23);
        c[h] = _mm_unpacklo_epi64(_mm_unpackhi_epi32(x[0], x[1]), _mm_unpackhi_epi32(x[2], x[3]));
    }
    const __m256i va = _mm256_set_m128i(a[1], a[0]), vb = _mm256_set_m128i(b[1], b[0]), vc = _mm256_set_m128i(c[1], c[0]);
    const __m256i low6 = _mm256_set1_epi8(0x3f), low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x03);
    const auto top_bits = [&](__m256i v) { return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 6), top2), 4); };
    sc[0] = _mm256_and_si256(va, low6);
    mn[0] = _mm256_and_si256(vb, low6);
    sc[1] = _mm256_or_si256(_mm256_and_si256(vc, low4), top_bits(va));
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(vc, 4), low4), top_bits(vb));
}

// byte j % 4 of each lane of v[j / 4] (a row's value for sub-block j) as int32 lanes
inline __m256i subblock_lanes(const __m256i* v, int j) {
    return _mm256_and_si256(_mm256_srli_epi32(v[j / 4], 8 * (j % 4)), _mm256_set1_epi32(0xff));
}

// Q4_K, Q5_K: eight rows' d (as floats, row order) and sub-scales (k4_scales_mins8's sc) of the superblocks
// at blk[c]; their offsets -(dmin * m) stored, sub-block j's eight at offT[8 j ..]
template <int Q>
KVS_ALWAYS_INLINE void k4_superblock_fields(const uint8_t* const* blk, float* offT, __m256& dw, __m256i* sc) {
    __m256 dmin;
    __m256i mn[2];
    group_half_pairs<Q>(blk, 0, dw, dmin);
    k4_scales_mins8(blk, sc, mn);
    const __m256 neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f));
    for (int j = 0; j < 8; ++j)
        _mm256_storeu_ps(offT + DIRECT_GROUP * j, _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(subblock_lanes(mn, j))));
}

// Q4_K, Q5_K and Q6_K: eight weight rows against R activation rows, each superblock's codes unpacked in
// registers, then qdot_direct32's steps per sub-block of 32
template <int Q, int R>
inline void qdot_directk(const uint8_t* const* rows, int64_t nb, const XRow* x, float* offT, float* y,
                         int64_t ldy, const SpreadPrefetch& prefetch) {
    static_assert(Q == KVS_Q4_K || Q == KVS_Q5_K || Q == KVS_Q6_K, "K formats only");
    constexpr int bytes = geometry(Q).bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
        prefetch.step(sb);
        const uint8_t* blk[DIRECT_GROUP];
        for (int c = 0; c < DIRECT_GROUP; ++c) blk[c] = rows[c] + sb * bytes;
        __m256 dw;
        __m128i q6_scales[8];     // Q6_K: q6_scales_by_subblock's
        __m256i sc[2];            // Q4_K, Q5_K: k4_scales_mins8's
        if constexpr (Q == KVS_Q6_K) {
            dw = group_halves<Q>(rows, sb, 208);
            q6_scales_by_subblock(blk, 192, q6_scales);
        } else {
            k4_superblock_fields<Q>(blk, offT + DIRECT_GROUP * sb * 8, dw, sc);
        }
#pragma GCC unroll 8  // j constant in each copy: k_codes' choices of bytes and shifts made at compile time
        for (int j = 0; j < 8; ++j) {
            const int64_t b = sb * 8 + j;
            wvec w[GROUP_VECS];
            for (int v = 0; v < GROUP_VECS; ++v) w[v] = k_codes<Q>(rows_source(blk, v), j);
            for (int r = 0; r < R; ++r) {
                const wvec xq = both_halves(load256(x[r].q + 32 * b)), mult = both_halves(load256(x[r].mult + 16 * b));
                wvec p[GROUP_VECS];
                for (int v = 0; v < GROUP_VECS; ++v) p[v] = block_lanes<Q>(w[v], w[v], xq, mult);
                __m256i total;
                if constexpr (Q == KVS_Q6_K) {
                    total = q6_block_totals(p, q6_scales[j], x[r].half[b], x[r].sum[b]);
                } else {
                    total = block_totals<Q>(p, x[r].sum[b], subblock_lanes(sc, j));
                }
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + b)), acc[r]);
            }
        }
    }
    store_direct<Q, R>(acc, x, offT, nb, y, ldy);
}

// ---------------------------------------------------------------- the interleaved formats
//
// A group of eight rows in interleave.h's layout: a 256-bit load holds code word w of all eight rows, so
// each row keeps one int32 lane from the products to its block total, and no lanes are reduced. Word w of
// unit u (0..3) carries elements 4w .. 4w + 3 of two sub-blocks, unit_lo(u) and unit_hi(u).
template <int Base>
constexpr int unit_lo(int u) { return Base == KVS_Q6_K ? 4 * (u / 2) + u % 2 : 2 * u; }
template <int Base>
constexpr int unit_hi(int u) { return Base == KVS_Q6_K ? unit_lo<Base>(u) + 2 : 2 * u + 1; }

// the eight rows' codes of word w of unit u of a superblock as stored (as k_codes unpacks them): lo of
// sub-block unit_lo(u), hi of unit_hi(u)
template <int Base>
KVS_ALWAYS_INLINE void unit_codes(const GroupBlock<Base>& block, int u, int w, __m256i& lo, __m256i& hi) {
    const __m256i m15 = _mm256_set1_epi8(15);
    const auto word = [&block](int i) { return load256(block.word(i, 0)); };
    if constexpr (Base == KVS_Q6_K) {  // half n = u / 2, groups a and a + 2 (a = u % 2): ql's nibbles, qh's bit pairs
        const int n = u / 2, a = u % 2;
        const __m256i ql = word(16 * n + 8 * a + w), qh = word(32 + 8 * n + w), m30 = _mm256_set1_epi8(0x30);
        lo = _mm256_or_si256(_mm256_and_si256(ql, m15),
                             _mm256_and_si256(a ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4), m30));
        hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m15),
                             _mm256_and_si256(a ? _mm256_srli_epi16(qh, 2) : qh, m30));
    } else {  // Q4_K, Q5_K: qs's nibbles of the pair u (Q5_K: after qh's 8 words, whose bit j tops sub-block j)
        const __m256i qs = word((Base == KVS_Q5_K ? 8 : 0) + 8 * u + w);
        lo = _mm256_and_si256(qs, m15);
        hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m15);
        if constexpr (Base == KVS_Q5_K) {
            const __m256i qh = word(w), m10 = _mm256_set1_epi8(0x10);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * u), 4), m10));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * u + 1), 4), m10));
        }
    }
}

// The interleaved twin of K format Base: one group of eight rows against R activation rows. Each
// sub-block's total is the exact integer qdot_directk's reduction gives (Q6_K: its halves'), then the
// same fma chain in block order: qdot_directk's bits (Chained: a sub-block's sums added by add_lanes_of_eight's
// vpdpwssd, the same integers).
static_assert(INTERLEAVED_ROWS == DIRECT_GROUP, "an interleaved group is a group of the decode rows");
template <int Base, int R, bool Chained>
inline void qdot_interleaved(const uint8_t* group, int64_t nb, const XRow* x, float* offT, float* y, int64_t ldy,
                             const SpreadPrefetch& prefetch) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; ++sb) {
        prefetch.step(sb);
        const GroupBlock<Base> block(group, sb);
        __m256 dw;
        __m128i q6_scales[8];
        __m256i sc[2];
        if constexpr (Base == KVS_Q6_K) {  // the header: the 16 scales, then d
            dw = group_halves<Base>(block.header, 0, 16);
            q6_scales_by_subblock(block.header, 0, q6_scales);
        } else {
            k4_superblock_fields<Base>(block.header, offT + DIRECT_GROUP * sb * 8, dw, sc);
        }
        __m256i total[R][8];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
            const int jl = unit_lo<Base>(u), jh = unit_hi<Base>(u);
            const int64_t bl = sb * 8 + jl, bh = sb * 8 + jh;
            // each sub-block's sums (Q6_K: over elements 0..15 and 16..31, each half its own sub-scale)
            constexpr int halves = Base == KVS_Q6_K ? 2 : 1;
            __m256i lo_sum[R][2], hi_sum[R][2];
            for (int s = 0; s < 4; ++s) {  // the sub-blocks of 8: words 2s, 2s + 1
                __m256i lo0, hi0, lo1, hi1;
                unit_codes<Base>(block, u, 2 * s, lo0, hi0);
                unit_codes<Base>(block, u, 2 * s + 1, lo1, hi1);
                const int h = s * halves / 4;
                for (int r = 0; r < R; ++r) {
                    const int8_t* xl = x[r].q + 32 * bl + 8 * s;
                    const int8_t* xh = x[r].q + 32 * bh + 8 * s;
                    const int16_t* ml = x[r].mult + 16 * bl + 4 * s;
                    const int16_t* mh = x[r].mult + 16 * bh + 4 * s;
                    if (s * halves % 4 == 0) {  // a half's first sub-block of 8
                        lo_sum[r][h] = lanes_of_eight(lo0, lo1, xl, ml);
                        hi_sum[r][h] = lanes_of_eight(hi0, hi1, xh, mh);
                    } else {
                        lo_sum[r][h] = add_lanes_of_eight<Chained>(lo_sum[r][h], lo0, lo1, xl, ml);
                        hi_sum[r][h] = add_lanes_of_eight<Chained>(hi_sum[r][h], hi0, hi1, xh, mh);
                    }
                }
            }
            for (int r = 0; r < R; ++r) {
                if constexpr (Base == KVS_Q6_K) {
                    total[r][jl] = q6_scaled(lo_sum[r][0], lo_sum[r][1], q6_scales[jl], x[r].half[bl], x[r].sum[bl]);
                    total[r][jh] = q6_scaled(hi_sum[r][0], hi_sum[r][1], q6_scales[jh], x[r].half[bh], x[r].sum[bh]);
                } else {
                    total[r][jl] = _mm256_mullo_epi32(lo_sum[r][0], subblock_lanes(sc, jl));
                    total[r][jh] = _mm256_mullo_epi32(hi_sum[r][0], subblock_lanes(sc, jh));
                }
            }
        }
        for (int j = 0; j < 8; ++j)
            for (int r = 0; r < R; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][j]),
                                         _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + sb * 8 + j)), acc[r]);
    }
    store_direct<Base, R>(acc, x, offT, nb, y, ldy);
}

// The interleaved twin of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0: one group of eight rows against R activation rows, a
// block of 32 at a time. Q4's and Q5's code word w holds elements 4w .. 4w + 3 (low nibbles) and 16 + 4w ..
// (high), Q5's fifth bits in the word before them (transposed: interleave.h twin_bit); Q8_0's code word w
// elements 4w .. 4w + 3. The totals are qdot_direct32's (Q4_0, Q5_0: less the bias * the block's sum of q * m),
// then its chain: its bits (Chained: the block's sums added by vpdpwssd, the same integers).
template <int Base, int R, bool Chained>
inline void qdot_interleaved32(const uint8_t* group, int64_t nb, const XRow* x, float* offT, float* y, int64_t ldy,
                               const SpreadPrefetch& prefetch) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        prefetch.step(b);
        const GroupBlock<Base> block(group, b);
        __m256 dw;
        if constexpr (has_offset(Base)) {
            __m256 m;
            group_half_pairs<Base>(block.header, 0, dw, m);
            _mm256_storeu_ps(offT + DIRECT_GROUP * b, m);
        } else {
            dw = group_halves<Base>(block.header, 0, 0);
        }
        __m256i c[8];  // code words: c[w] holds elements 4w .. 4w + 3 (sub-block w / 2 of 8)
        if constexpr (Base == KVS_Q8_0) {
            for (int w = 0; w < 8; ++w) c[w] = load256(block.word(w, 0));
        } else {
            constexpr bool five = transposes_fifth_bits(Base);  // word 0: the fifth bits, as interleave.h laid them
            const __m256i m15 = _mm256_set1_epi8(15), m10 = _mm256_set1_epi8(0x10);
            const __m256i qh = five ? load256(block.word(0, 0)) : _mm256_setzero_si256();
            for (int w = 0; w < 4; ++w) {
                const __m256i q = load256(block.word(five + w, 0));
                c[w] = _mm256_and_si256(q, m15);
                c[4 + w] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                if constexpr (five) {  // bit w of each byte of the transposed qh tops c[w], bit 4 + w c[4 + w]
                    c[w] = _mm256_or_si256(c[w], _mm256_and_si256(_mm256_slli_epi32(qh, 4 - w), m10));
                    c[4 + w] = _mm256_or_si256(c[4 + w], _mm256_and_si256(_mm256_srli_epi32(qh, w), m10));
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* xq = x[r].q + 32 * b;
            const int16_t* m = x[r].mult + 16 * b;
            __m256i t = _mm256_setzero_si256();
            if constexpr (Base == KVS_Q8_0) {
                for (int w = 0; w < 8; ++w) t = add_signed_lanes_of_four<Chained>(t, c[w], xq + 4 * w, m + 2 * w);
            } else {
                for (int s = 0; s < 4; ++s)
                    t = add_lanes_of_eight<Chained>(t, c[2 * s], c[2 * s + 1], xq + 8 * s, m + 4 * s);
            }
            if constexpr (code_bias(Base) != 0)
                t = _mm256_sub_epi32(t, _mm256_set1_epi32(code_bias(Base) * x[r].sum[b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dw, _mm256_broadcast_ss(x[r].d + b)), acc[r]);
        }
    }
    store_direct<Base, R>(acc, x, offT, nb, y, ldy);
}

// The decode rows of block format Q: y[r * ldy + j] = x[r] . W[lo + j] for R activation rows and the weight
// rows lo .. hi, eight weight rows at a time; `off` holds DIRECT_GROUP * K / 32 floats (a group's offsets
// transposed, [nb][8]). Rows up to prefetch_hi (>= hi) are the caller's next: prefetching may run into them.
// Chained: an interleaved twin's sums added by vpdpwssd (CAN_CHAIN_SUMS builds).
template <int Q, int R, bool Chained = false>
inline void qdot_direct_rows(const uint8_t* w, int64_t row_bytes, int64_t lo, int64_t hi, int64_t prefetch_hi,
                             int64_t nb, const XRow* x, float* off, float* y, int64_t ldy) {
    constexpr int C = DIRECT_GROUP;
    const uint8_t* rows[C];
    // the weights stream from memory once: ask for the bytes `ahead` of the group being computed into
    // the cache level the host's tuning names, in one burst a group or spread over its blocks (built in:
    // the group after next into L1, a burst; Zen 4 wants them spread)
    const KvsTuning tuning = current_tuning();
    const int64_t group_bytes = C * row_bytes;
    // The distance is counted past the group's end where its eight rows are eight streams read side by side:
    // with long rows, a group larger than the distance, a prefetch any nearer would land in rows the group is
    // still reading. An interleaved group is one stream read in order: spread over its steps, the distance
    // runs from the step being computed (a window sliding with the reads; past the group's end it came a
    // whole group, 7-65 KB at the 1.5B's and the 8B's shapes, ahead, and no prefetch at all beat it on the Intel Xeon)
    const bool one_stream = format_row(Q).group_rows > 1 && tuning.weight_prefetch_spread;
    const int64_t distance = tuning.weight_prefetch_ahead > 0 ? tuning.weight_prefetch_ahead : group_bytes;
    const int64_t ahead = (one_stream ? 0 : group_bytes) + distance;
    const uint8_t* const end = w + prefetch_hi * row_bytes;
    constexpr int64_t blocks_per_step = has_subscales(Q) ? 8 : 1;  // the K formats step a superblock at a time
    const int64_t steps = nb / blocks_per_step;
    SpreadPrefetch spread{nullptr, (group_bytes + steps - 1) / steps, end,
                          tuning.weight_prefetch_spread ? tuning.weight_prefetch : KVS_PREFETCH_NONE};
    auto dot = [&](float* out, int64_t ld) {  // the eight rows of `rows`: out[r * ld + c]
        if constexpr (format_row(Q).group_rows > 1 && has_subscales(Q)) {  // rows[0]: the group's start
            qdot_interleaved<format_row(Q).base, R, Chained>(rows[0], nb, x, off, out, ld, spread);
        } else if constexpr (format_row(Q).group_rows > 1) {
            qdot_interleaved32<format_row(Q).base, R, Chained>(rows[0], nb, x, off, out, ld, spread);
        } else if constexpr (has_subscales(Q)) {
            qdot_directk<Q, R>(rows, nb, x, off, out, ld, spread);
        } else {
            qdot_direct32<Q, R>(rows, nb, x, off, out, ld, spread);
        }
    };
    int64_t n = lo;
    for (; n + C <= hi; n += C) {
        for (int c = 0; c < C; ++c) rows[c] = w + (n + c) * row_bytes;
        const uint8_t* from = w + n * row_bytes + ahead;
        if (tuning.weight_prefetch_spread)
            spread.from = from;
        else
            prefetch_span(std::min(from, end), std::min(from + group_bytes, end), tuning.weight_prefetch);
        dot(y + n, ldy);
    }
    spread.where = KVS_PREFETCH_NONE;  // the tail's rows were asked for with the last group
    // the last rows: a full group over repeats of the last row, only the real ones kept (an interleaved
    // matrix is whole groups)
    if (format_row(Q).group_rows == 1 && n < hi) {
        float tail[R * C];
        for (int c = 0; c < C; ++c) rows[c] = w + std::min(n + c, hi - 1) * row_bytes;
        dot(tail, C);
        for (int r = 0; r < R; ++r)
            for (int64_t c = 0; c < hi - n; ++c) y[r * ldy + n + c] = tail[r * C + c];
    }
}
#endif  // KVS_SIMD

}  // namespace kvs
