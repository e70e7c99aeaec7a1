// Paged attention over the KV cache pages in place: for each (query row, KV head) a softmax over the
// row's keys, positions lo..p. The keys are cut into SEGMENTs of absolute positions; each segment
// gives a partial state (max m, sum l, unnormalized output o) from one softmax over the row's keys in
// it (every score first, then their max, exp and sum, then p . v), and a row's partials are merged in
// ascending segment order. A tile (up to TILE consecutive rows of one block table) reads each key
// and value of a segment once for all its rows, and each key row once for three query vectors.
//
//   cache [num_pages, page_size, kv_heads, head_dim (int4: head_dim / 2 bytes)]
//   row r: position p, keys lo..p (lo = max(0, p - window + 1)); logical page i of its block table
//          is tables[table_offsets[r] + i - table_first[r]]
//
//   keys 0 .. 255 | 256 .. 511 | 512 .. p     segments (SEGMENT = 256)
//        (m,l,o)0     (m,l,o)1     (m,l,o)2   -> merge(merge(0, 1), 2) -> o / l
//
// Two schedules, the same float operations: with few (tile, KV head) units for the threads (one
// decode row, 3 KV heads, 2 threads) every (tile, head, segment) is a unit of its own, its partial
// kept in a buffer, merged by whichever thread attends a (tile, head)'s last segment; with many, a thread takes a (tile, head) and merges as it goes.
//
// Invariance by construction: a (row, head)'s float operations depend only on p, lo and the values of
// its keys, never on the other rows, the tile, the chunking, the schedule or the thread count (a
// score is one fma chain per lane over head_dim then one fixed lane tree; a segment's sum runs over
// W-lane chunks aligned to the segment in ascending order then one fixed tree; each output element is
// one fma chain over the keys in ascending order; segments are fixed by absolute position and always
// merged in one order).
#include "ops_simd.h"
#include "team.h"
#include <algorithm>
#include <atomic>
#include <climits>
#include <vector>

namespace {

using namespace kvs::simd;

// keys whose scores are reduced together (reduce_keys): four where 16 vectors fit in registers; on AVX2, whose
// vector is two registers, one, so that three query vectors still share each key's load
constexpr int KG = VF_BUDGET >= 16 ? 4 : 1;
// AVX-512's 32 registers (VF_BUDGET counts 16) let four query vectors of a GQA group of four or eight (Llama 3's,
// Gemma 3's) share each key and value load: as three and one, the one reloaded every key for a single query
// vector. ATT_BUDGET: the registers p . v's accumulators are sized to.
#if defined(KVS_ISA_AVX512)
constexpr bool QUERIES_BY_FOUR = true;
constexpr int ATT_BUDGET = 28;
#else
constexpr bool QUERIES_BY_FOUR = false;
constexpr int ATT_BUDGET = VF_BUDGET;
#endif
constexpr int SEGMENT = 256;  // keys per partial softmax state, aligned to absolute positions
constexpr int TILE = 16;  // prefill rows of one table attended together (each key block decoded once)
static_assert(SEGMENT % KG == 0 && SEGMENT % 16 == 0, "score groups and W-lane chunks never straddle segments");

int64_t row_bytes(const KvsAttention& a) {
    int elem = a.codec == KVS_CODEC_FP32 ? 4 : a.codec == KVS_CODEC_BF16 || a.codec == KVS_CODEC_FP16 ? 2 : 1;
    return a.codec == KVS_CODEC_INT4 ? a.head_dim / 2 : static_cast<int64_t>(a.head_dim) * elem;
}

constexpr int AHEAD = 16;  // keys between a row's prefetch and its use (memory latency / time per key)

// `bytes` from a key's row on, ahead of their use: a head's rows are kv_heads rows apart, a stride
// the hardware prefetchers follow poorly, so a pass over head 0 may fetch every head's rows of a key
// (they are contiguous) for the passes over the others.
inline void prefetch_row(const void* row, int bytes, int where) {
    const uint8_t* p = static_cast<const uint8_t*>(row);
    kvs::prefetch_span(p, p + bytes, where);
}

// The W low and W high nibbles of bytes src[0..W) as floats.
inline void load_nibbles(const uint8_t* src, vf& lo, vf& hi) {
#if defined(KVS_ISA_AVX512)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
    hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
#elif defined(KVS_ISA_AVX2)
    const __m256i b0 = u8x8(src), b1 = u8x8(src + 8), m15 = _mm256_set1_epi32(15);
    lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, m15)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, m15))};
    hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
#else
    lo = {static_cast<float>(src[0] & 15)};
    hi = {static_cast<float>(src[0] >> 4)};
#endif
}

// One stored row of head_dim values -> float32 dst (every codec's values are exact in float32).
template <int C>
inline void decode_row(const uint8_t* src, int hd, float scale, const float* table, float* dst) {
    if constexpr (C == KVS_CODEC_BF16) {
        for (int d = 0; d < hd; d += W) vstore(dst + d, vload_bf16(reinterpret_cast<const uint16_t*>(src) + d));
    } else if constexpr (C == KVS_CODEC_FP16) {
        for (int d = 0; d < hd; d += W) vstore(dst + d, vload_f16(reinterpret_cast<const uint16_t*>(src) + d));
    } else if constexpr (C == KVS_CODEC_FP8) {
        for (int d = 0; d < hd; d += W) vstore(dst + d, vlookup(table, src + d));
    } else if constexpr (C == KVS_CODEC_INT8) {  // (code + 0.5) * s
        const vf s = vset1(scale), half = vset1(0.5f);
        for (int d = 0; d < hd; d += W)
            vstore(dst + d, vmul(vadd(vload_i8(reinterpret_cast<const int8_t*>(src) + d), half), s));
    } else if constexpr (C == KVS_CODEC_INT4) {
        // byte j: code j in the low nibble, code j + hd/2 in the high one, each + 8
        const int half_dim = hd / 2;
        const vf s = vset1(scale), off = vset1(7.5f);
        for (int d = 0; d < half_dim; d += W) {
            vf lo, hi;
            load_nibbles(src + d, lo, hi);
            vstore(dst + d, vmul(vsub(lo, off), s));
            vstore(dst + half_dim + d, vmul(vsub(hi, off), s));
        }
    }
}

// The rows of one tile and the keys each sees.
struct Tile {
    int64_t row0;
    int rows;
    int64_t lo[TILE], hi[TILE];  // each row's first and last key
    int64_t kmin, kmax;  // over the tile
    int64_t own;  // own-page view index (rows == 1), or -1
    int64_t own_start;  // keys from here on come from the own view
    const int64_t* table;  // logical page i at table[i]
};

Tile make_tile(const KvsAttention& a, int64_t row0, int rows) {
    Tile t;
    t.row0 = row0;
    t.rows = rows;
    t.table = a.tables + a.table_offsets[row0] - a.table_first[row0];
    t.own = a.own_index ? a.own_index[row0] : -1;
    t.kmin = INT64_MAX;
    t.kmax = -1;
    for (int i = 0; i < rows; ++i) {
        t.hi[i] = a.positions[row0 + i];
        t.lo[i] = a.window > 0 && t.hi[i] - a.window + 1 > 0 ? t.hi[i] - a.window + 1 : 0;
        t.kmin = std::min(t.kmin, t.lo[i]);
        t.kmax = std::max(t.kmax, t.hi[i]);
    }
    t.own_start = t.own >= 0 ? t.hi[0] - t.hi[0] % a.page_size : t.kmax + 1;
    return t;
}

// A unit attends the heads h0 .. h0 + nh - 1 of a tile: every KV head of it (the default, so each
// pass over the keys reads every head's rows of a key, which are contiguous) or one.
struct Heads {
    int h0, nh;
};

// Per-unit buffers; a head hh = h - h0 of the unit has its own slice of each.
struct Scratch {
    std::vector<float> k, v;  // [SEGMENT, nh, head_dim] decoded keys / values (codecs other than fp32 / bf16)
    std::vector<float> zero;  // [nh, head_dim] zeros (float32 or bf16): the keys of a score group no row reads
    std::vector<float> q;  // [nh, nq, head_dim] scaled queries
    std::vector<float> s;  // [nh, nq, SEGMENT] scores, then probabilities
    std::vector<float> part;  // [nh] x (m [nq], l [nq], o [nq, head_dim]): one segment's partial state
    std::vector<float> sm, sl, so;  // the merged state [nh, nq] (so: x head_dim)
    const void* kb[SEGMENT];  // each key's row of head h0 (key j at j - segment start)
    const void* vb[SEGMENT];

    void prepare(int nh, int nq, int hd, bool decodes) {  // sizes only grow: one thread's units reuse them
        const size_t n = static_cast<size_t>(nh) * nq, d = static_cast<size_t>(hd);
        for (auto [vec, size] : {std::pair{&q, n * d}, {&s, n * SEGMENT}, {&part, n * (d + 2)}, {&sm, n}, {&sl, n},
                                 {&so, n * d}, {&k, decodes ? SEGMENT * nh * d : 0},
                                 {&v, decodes ? SEGMENT * nh * d : 0}})
            if (vec->size() < size) vec->resize(size);
        if (zero.size() < nh * d) zero.assign(nh * d, 0.0f);
    }
};

// A key / value row as the score and p . v loops read it, `at` bytes past a row pointer (head h's
// row: the unit's head stride times h - h0): float32 (fp32 pages, own-page views and rows decoded
// into scratch) or bf16 pages in place, widened in registers (exact).
template <bool B16>
inline vf load_row(const void* row, int64_t at, int d) {
    const void* r = static_cast<const char*>(row) + at;
    if constexpr (B16) return vload_bf16(static_cast<const uint16_t*>(r) + d);
    else return vload(static_cast<const float*>(r) + d);
}

// out[k] = the sum of acc[k]'s lanes for k < KG, each by one fixed tree whatever the other
// accumulators hold: lanes i and i + 8 first, then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) of those.
inline void reduce_keys(const vf* acc, float* out) {
    static_assert(KG <= 4, "one tree of hadds takes four keys");
#if defined(KVS_ISA_AVX2) || defined(KVS_ISA_AVX512)
    __m256 x[4];
    for (int k = 0; k < KG; ++k) {
#if defined(KVS_ISA_AVX512)
        x[k] = _mm256_add_ps(_mm512_castps512_ps256(acc[k].v), _mm512_extractf32x8_ps(acc[k].v, 1));
#else
        x[k] = _mm256_add_ps(acc[k].lo, acc[k].hi);
#endif
    }
    for (int k = KG; k < 4; ++k) x[k] = x[0];  // (a key's tree never depends on its neighbours)
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));  // [low | high halves]
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    if constexpr (KG == 4) {
        _mm_storeu_ps(out, sums);
    } else {
        alignas(16) float all[4];
        _mm_store_ps(all, sums);
        for (int k = 0; k < KG; ++k) out[k] = all[k];
    }
#else
    for (int k = 0; k < KG; ++k) out[k] = acc[k].v;
#endif
}

// s[i * SEGMENT + k] = q_i . key k for NQ query vectors (hd floats apart) and the KG keys kb[0..KG)
// (`at` bytes on): per lane one fma chain over head_dim, then reduce_keys (a score never depends on its
// neighbours; NQ only decides which chains share a key load).
template <bool B16, int NQ>
inline void scores_kg(const float* q, const void* const* kb, int64_t at, int hd, float* s) {
    vf acc[NQ][KG];
    {
        vf qd[NQ];
        for (int i = 0; i < NQ; ++i) qd[i] = vload(q + i * hd);
        for (int kk = 0; kk < KG; ++kk) {
            const vf k = load_row<B16>(kb[kk], at, 0);
            for (int i = 0; i < NQ; ++i) acc[i][kk] = vmul(qd[i], k);
        }
    }
    for (int d = W; d < hd; d += W) {
        vf qd[NQ];
        for (int i = 0; i < NQ; ++i) qd[i] = vload(q + i * hd + d);
        for (int kk = 0; kk < KG; ++kk) {
            const vf k = load_row<B16>(kb[kk], at, d);
            for (int i = 0; i < NQ; ++i) acc[i][kk] = vfma(qd[i], k, acc[i][kk]);
        }
    }
    for (int i = 0; i < NQ; ++i) reduce_keys(acc[i], s + i * SEGMENT);
}

// Scores of nq query vectors against the keys g .. g + KG - 1, each key row loaded once for up to three.
template <bool B16>
inline void group_scores(const float* q, int nq, const void* const* kb, int64_t at, int hd, float* s) {
    int i = 0;
    if constexpr (QUERIES_BY_FOUR)  // (4 x KG accumulators, four queries and one key: 21 registers)
        if (nq % 4 == 0)
            for (; i < nq; i += 4) scores_kg<B16, 4>(q + i * hd, kb, at, hd, s + i * SEGMENT);
    // (3 x KG accumulators, three queries and one key: within VF_BUDGET)
    for (; i + 3 <= nq; i += 3) scores_kg<B16, 3>(q + i * hd, kb, at, hd, s + i * SEGMENT);
    if (nq - i == 2) scores_kg<B16, 2>(q + i * hd, kb, at, hd, s + i * SEGMENT);
    if (nq - i == 1) scores_kg<B16, 1>(q + i * hd, kb, at, hd, s + i * SEGMENT);
}

// o_i += sum_j p_i[j] v_j for NQ query vectors of one row (p_i at p + i * SEGMENT, o_i at o + i * hd),
// keys j0..j1 ascending, ND vectors of head_dim from d0: each element one fma chain in j, whatever
// NQ, ND and the span of keys per call are (they only decide which chains share a value load).
template <bool B16, int NQ, int ND>
inline void accumulate_span(const float* p, const void* const* vb, int64_t at, int j0, int j1, int d0, int hd,
                            float* o) {
    vf acc[NQ][ND];
    for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < ND; ++c) acc[i][c] = vload(o + i * hd + d0 + c * W);
    for (int j = j0; j <= j1; ++j) {
        vf pj[NQ];
        for (int i = 0; i < NQ; ++i) pj[i] = vset1(p[i * SEGMENT + j]);
        for (int c = 0; c < ND; ++c) {
            const vf vr = load_row<B16>(vb[j], at, d0 + c * W);
            for (int i = 0; i < NQ; ++i) acc[i][c] = vfma(pj[i], vr, acc[i][c]);
        }
    }
    for (int i = 0; i < NQ; ++i)
        for (int c = 0; c < ND; ++c) vstore(o + i * hd + d0 + c * W, acc[i][c]);
}

template <bool B16, int NQ>
void accumulate_rows(const float* p, const void* const* vb, int64_t at, int j0, int j1, int hd, float* o) {
    // NQ x ND accumulators, NQ probabilities and one value within the budget (ND a power of two, at most 8)
    constexpr int fit = (ATT_BUDGET - NQ - 1) / NQ;
    constexpr int ND = fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
    int d = 0;
    for (; d + ND * W <= hd; d += ND * W) accumulate_span<B16, NQ, ND>(p, vb, at, j0, j1, d, hd, o);
    if constexpr (ND > 2)
        for (; d + 2 * W <= hd; d += 2 * W) accumulate_span<B16, NQ, 2>(p, vb, at, j0, j1, d, hd, o);
    for (; d < hd; d += W) accumulate_span<B16, NQ, 1>(p, vb, at, j0, j1, d, hd, o);
}

// p . v for the n query vectors of one row, three at a time (four where QUERIES_BY_FOUR and n is a multiple).
template <bool B16>
void accumulate(const float* p, const void* const* vb, int64_t at, int j0, int j1, int hd, int n, float* o) {
    int i = 0;
    if constexpr (QUERIES_BY_FOUR)
        if (n % 4 == 0)
            for (; i < n; i += 4) accumulate_rows<B16, 4>(p + i * SEGMENT, vb, at, j0, j1, hd, o + i * hd);
    for (; i + 3 <= n; i += 3) accumulate_rows<B16, 3>(p + i * SEGMENT, vb, at, j0, j1, hd, o + i * hd);
    if (n - i == 2) accumulate_rows<B16, 2>(p + i * SEGMENT, vb, at, j0, j1, hd, o + i * hd);
    if (n - i == 1) accumulate_rows<B16, 1>(p + i * SEGMENT, vb, at, j0, j1, hd, o + i * hd);
}

// Bytes from a key's row of head h to its row of head h + 1: in place in the cache (fp32, bf16),
// in an own-page view or decoded into scratch (float32, every other codec).
int64_t head_stride(const KvsAttention& a) { return a.codec == KVS_CODEC_BF16 ? 2 * a.head_dim : 4 * a.head_dim; }

// sc.kb[jj], sc.vb[jj] for the keys j0..j1 of the segment at s0 (jj = j - s0), each key's row of
// head h0 (the unit's other heads follow at head_stride): rows of the cache (fp32 and bf16 in
// place), of the own-page view, or decoded into scratch; z0..z1 (a superset, whole score groups)
// around them point at zeros. Walks the block table page by page.
template <int C>
void load_keys(const KvsAttention& a, const Tile& t, Heads u, int64_t s0, int64_t j0, int64_t j1, int z0, int z1,
               Scratch& sc) {
    const int hd = a.head_dim, ps = a.page_size, kvh = a.kv_heads;
    for (int jj = z0; jj < j0 - s0; ++jj) sc.kb[jj] = sc.vb[jj] = sc.zero.data();
    for (int jj = static_cast<int>(j1 - s0) + 1; jj <= z1; ++jj) sc.kb[jj] = sc.vb[jj] = sc.zero.data();
    const int64_t rb = row_bytes(a);
    const auto* kd = static_cast<const uint8_t*>(a.k_data);
    const auto* vd = static_cast<const uint8_t*>(a.v_data);
    const int64_t cached_end = std::min(j1, t.own_start - 1);
    int64_t j = j0;
    if (j <= cached_end) {
        int64_t li = j / ps;
        int off = static_cast<int>(j % ps);
        int64_t page = t.table[li];
        for (; j <= cached_end; ++j, ++off) {
            if (off == ps) {
                off = 0;
                page = t.table[++li];
            }
            const int jj = static_cast<int>(j - s0);
            const int64_t slot = (page * ps + off) * kvh + u.h0;
            if constexpr (C == KVS_CODEC_FP32 || C == KVS_CODEC_BF16) {
                sc.kb[jj] = kd + slot * rb;
                sc.vb[jj] = vd + slot * rb;
            } else {
                float* kr = sc.k.data() + static_cast<size_t>(jj) * u.nh * hd;
                float* vr = sc.v.data() + static_cast<size_t>(jj) * u.nh * hd;
                for (int hh = 0; hh < u.nh; ++hh) {
                    const float ks = a.k_scales ? a.k_scales[page * kvh + u.h0 + hh] : 0.0f;
                    const float vs = a.v_scales ? a.v_scales[page * kvh + u.h0 + hh] : 0.0f;
                    decode_row<C>(kd + (slot + hh) * rb, hd, ks, a.k_table, kr + hh * hd);
                    decode_row<C>(vd + (slot + hh) * rb, hd, vs, a.v_table, vr + hh * hd);
                }
                sc.kb[jj] = kr;
                sc.vb[jj] = vr;
            }
        }
    }
    for (; j <= j1; ++j) {  // float32 views: only int codecs have them (never bf16)
        const int jj = static_cast<int>(j - s0);
        const int64_t at = ((t.own * ps + (j - t.own_start)) * kvh + u.h0) * hd;
        sc.kb[jj] = a.k_own + at;
        sc.vb[jj] = a.v_own + at;
    }
}

// One query vector's softmax over its keys c0..c1 of the segment (scores in sq): m = their max,
// sq = exp(score - m) on c0..c1 and zeros on the rest of their W-lane chunks, l = the sum over the
// chunks in ascending order, then one fixed lane tree (chunks are aligned to the segment start).
inline void segment_softmax(float* sq, int c0, int c1, float& m, float& l) {
    const int v0 = c0 / W * W, v1 = c1 / W * W;
    for (int j = v0; j < c0; ++j) sq[j] = -INFINITY;
    for (int j = c1 + 1; j < v1 + W; ++j) sq[j] = -INFINITY;
    vf mx = vload(sq + v0);
    for (int v = v0 + W; v <= v1; v += W) mx = vmax(mx, vload(sq + v));
    m = hmax(mx);
    const vf mv = vset1(m);
    vstore(sq + v0, vexp(vsub(vload(sq + v0), mv)));
    for (int j = v0; j < c0; ++j) sq[j] = 0.0f;  // vexp gives ~2**-126 for -inf, not 0
    if (v1 == v0)
        for (int j = c1 + 1; j < v1 + W; ++j) sq[j] = 0.0f;
    vf sum = vload(sq + v0);
    for (int v = v0 + W; v <= v1; v += W) {
        vf p = vexp(vsub(vload(sq + v), mv));
        vstore(sq + v, p);
        if (v == v1) {
            for (int j = c1 + 1; j < v1 + W; ++j) sq[j] = 0.0f;
            p = vload(sq + v);
        }
        sum = vadd(sum, p);
    }
    l = hsum(sum);
}

// The tile's queries of the unit's heads, scaled, into sc.q.
void load_queries(const KvsAttention& a, const Tile& t, Heads u, Scratch& sc) {
    const int hd = a.head_dim, group = a.heads / a.kv_heads;
    const vf sv = vset1(a.scale);
    for (int hh = 0; hh < u.nh; ++hh)
        for (int i = 0; i < t.rows; ++i)
            for (int g = 0; g < group; ++g) {
                const int64_t head = static_cast<int64_t>(u.h0 + hh) * group + g;
                const float* qr = a.q + (t.row0 + i) * a.q_row_stride + head * hd;
                float* dst = sc.q.data() + ((hh * t.rows + i) * group + g) * static_cast<size_t>(hd);
                for (int d = 0; d < hd; d += W) vstore(dst + d, vmul(vload(qr + d), sv));
            }
}

constexpr int PV_BLOCK = 16;  // keys per p . v step (every head's values of them stay in L1)

// Segment `seg`'s partial state of the tile's query vectors for the unit's heads, from the scaled
// queries in sc.q, into part ([nh] x (m [nq], l [nq], o [nq, hd])): every score of the segment
// first, then each row's softmax over its keys of the segment at once, then p . v. Both passes go
// key by key over every head of the unit (rows read in place: prefetched AHEAD keys on). Rows that
// see no key of the segment are left at (-inf, 0, 0).
template <int C>
void attend_segment(const KvsAttention& a, const Tile& t, Heads u, int64_t seg, Scratch& sc, float* part) {
    const int hd = a.head_dim, group = a.heads / a.kv_heads, nq = t.rows * group;
    const int64_t s0 = seg * SEGMENT, s1 = s0 + SEGMENT - 1;
    const int64_t kmin = std::max(t.kmin, s0), kmax = std::min(t.kmax, s1);
    const int64_t per_head = static_cast<int64_t>(nq) * (hd + 2), hs = head_stride(a);
    for (int hh = 0; hh < u.nh; ++hh) {
        float* m = part + hh * per_head;
        std::fill(m, m + nq, -INFINITY);
        std::fill(m + nq, m + per_head, 0.0f);
    }
    constexpr bool B16 = C == KVS_CODEC_BF16;  // rows read in place as bf16; every other codec's rows are float32
    const int g0 = static_cast<int>(kmin - s0) / KG * KG, g1 = static_cast<int>(kmax - s0) / KG * KG;
    const int z1 = g1 + KG - 1;
    load_keys<C>(a, t, u, s0, kmin, kmax, g0, z1, sc);
    // the unit's rows of a key are contiguous: one stretch (decoded rows were read by load_keys)
    const int stretch = C == KVS_CODEC_FP32 || C == KVS_CODEC_BF16 ? static_cast<int>(u.nh * row_bytes(a)) : 0;
    const int where = kvs::current_tuning().kv_prefetch;
    for (int g = g0; g <= g1; g += KG) {
        if (stretch)  // keys AHEAD on, then the first values once the keys run out
            for (int x = g + AHEAD; x < g + AHEAD + KG; ++x)
                prefetch_row(x <= z1 ? sc.kb[x] : sc.vb[std::min(g0 + x - z1 - 1, z1)], stretch, where);
        for (int hh = 0; hh < u.nh; ++hh)
            group_scores<B16>(sc.q.data() + static_cast<size_t>(hh) * nq * hd, nq, sc.kb + g, hh * hs, hd,
                              sc.s.data() + static_cast<size_t>(hh) * nq * SEGMENT + g);
    }
    for (int hh = 0; hh < u.nh; ++hh)
        for (int i = 0; i < t.rows; ++i) {
            const int64_t r0 = std::max(t.lo[i], s0), r1 = std::min(t.hi[i], s1);
            if (r0 > r1) continue;  // this row sees no key of the segment
            for (int g = 0; g < group; ++g) {
                const int qv = i * group + g;
                float* m = part + hh * per_head;
                segment_softmax(sc.s.data() + (static_cast<size_t>(hh) * nq + qv) * SEGMENT, static_cast<int>(r0 - s0),
                                static_cast<int>(r1 - s0), m[qv], m[nq + qv]);
            }
        }
    const int b_first = static_cast<int>(kmin - s0) / PV_BLOCK * PV_BLOCK;
    for (int b = b_first; b <= kmax - s0; b += PV_BLOCK) {
        if (stretch)
            for (int x = b + AHEAD; x < std::min<int64_t>(b + AHEAD + PV_BLOCK, kmax - s0 + 1); ++x)
                prefetch_row(sc.vb[x], stretch, where);
        for (int i = 0; i < t.rows; ++i) {
            const int64_t r0 = std::max({t.lo[i], s0 + b}), r1 = std::min({t.hi[i], s0 + b + PV_BLOCK - 1, s1});
            if (r0 > r1) continue;  // this row sees no key of the block
            for (int hh = 0; hh < u.nh; ++hh) {
                float* o = part + hh * per_head + 2 * nq + static_cast<size_t>(i) * group * hd;
                accumulate<B16>(sc.s.data() + (static_cast<size_t>(hh) * nq + i * group) * SEGMENT, sc.vb, hh * hs,
                                static_cast<int>(r0 - s0), static_cast<int>(r1 - s0), hd, group, o);
            }
        }
    }
}

void attend_segment_any(const KvsAttention& a, const Tile& t, Heads u, int64_t seg, Scratch& sc, float* part) {
    switch (a.codec) {
        case KVS_CODEC_FP32: attend_segment<KVS_CODEC_FP32>(a, t, u, seg, sc, part); break;
        case KVS_CODEC_BF16: attend_segment<KVS_CODEC_BF16>(a, t, u, seg, sc, part); break;
        case KVS_CODEC_FP16: attend_segment<KVS_CODEC_FP16>(a, t, u, seg, sc, part); break;
        case KVS_CODEC_FP8: attend_segment<KVS_CODEC_FP8>(a, t, u, seg, sc, part); break;
        case KVS_CODEC_INT8: attend_segment<KVS_CODEC_INT8>(a, t, u, seg, sc, part); break;
        default: attend_segment<KVS_CODEC_INT4>(a, t, u, seg, sc, part); break;
    }
}

// Segment seg's partial (m, l, o) into the merged state (sm, sl, so) of each row that sees it: the
// row's first segment is taken as it is, each later one combined (rescaled to the larger max).
void merge_segment(const Tile& t, int group, int hd, int64_t seg, const float* m, const float* l, const float* o,
                   float* sm, float* sl, float* so) {
    for (int i = 0; i < t.rows; ++i) {
        const int64_t first = t.lo[i] / SEGMENT, last = t.hi[i] / SEGMENT;
        if (seg < first || seg > last) continue;
        for (int g = 0; g < group; ++g) {
            const int qv = i * group + g;
            const float* oq = o + static_cast<size_t>(qv) * hd;
            float* soq = so + static_cast<size_t>(qv) * hd;
            if (seg == first) {
                sm[qv] = m[qv];
                sl[qv] = l[qv];
                std::memcpy(soq, oq, sizeof(float) * hd);
                continue;
            }
            const float mx = m[qv] > sm[qv] ? m[qv] : sm[qv];
            const float wa = sm[qv] == mx ? 1.0f : vfirst(vexp(vset1(sm[qv] - mx)));  // exp(0) is exactly 1
            const float wb = m[qv] == mx ? 1.0f : vfirst(vexp(vset1(m[qv] - mx)));
            sm[qv] = mx;
            sl[qv] = sl[qv] * wa + l[qv] * wb;
            const vf va = vset1(wa), vb = vset1(wb);
            for (int d = 0; d < hd; d += W) vstore(soq + d, vfma(vload(oq + d), vb, vmul(vload(soq + d), va)));
        }
    }
}

// Segment seg's partial `part` ([nh] x (m, l, o)) into the merged state of the unit's heads.
void merge_unit(const KvsAttention& a, const Tile& t, Heads u, int64_t seg, const float* part, Scratch& sc) {
    const int hd = a.head_dim, group = a.heads / a.kv_heads, nq = t.rows * group;
    const int64_t per_head = static_cast<int64_t>(nq) * (hd + 2);
    for (int hh = 0; hh < u.nh; ++hh) {
        const float* pm = part + hh * per_head;
        merge_segment(t, group, hd, seg, pm, pm + nq, pm + 2 * nq, sc.sm.data() + hh * nq, sc.sl.data() + hh * nq,
                      sc.so.data() + static_cast<size_t>(hh) * nq * hd);
    }
}

// out = so / sl for the tile's rows and the unit's heads.
void finish(const KvsAttention& a, const Tile& t, Heads u, const Scratch& sc) {
    const int hd = a.head_dim, group = a.heads / a.kv_heads, nq = t.rows * group;
    for (int hh = 0; hh < u.nh; ++hh)
        for (int i = 0; i < t.rows; ++i)
            for (int g = 0; g < group; ++g) {
                const int qv = hh * nq + i * group + g;
                const int64_t head = static_cast<int64_t>(u.h0 + hh) * group + g;
                float* dst = a.out + ((t.row0 + i) * a.heads + head) * static_cast<int64_t>(hd);
                const vf vl = vset1(sc.sl[qv]);
                for (int d = 0; d < hd; d += W) vstore(dst + d, vdiv(vload(sc.so.data() + static_cast<size_t>(qv) * hd + d), vl));
            }
}

// Many units: one thread takes the tile's heads, its segments in order, merging as it goes.
void attend_tile(const KvsAttention& a, const Tile& t, Heads u, Scratch& sc) {
    const bool decoded = a.codec != KVS_CODEC_FP32 && a.codec != KVS_CODEC_BF16;
    sc.prepare(u.nh, t.rows * (a.heads / a.kv_heads), a.head_dim, decoded);
    load_queries(a, t, u, sc);
    for (int64_t seg = t.kmin / SEGMENT; seg <= t.kmax / SEGMENT; ++seg) {
        attend_segment_any(a, t, u, seg, sc, sc.part.data());
        merge_unit(a, t, u, seg, sc.part.data(), sc);
    }
    finish(a, t, u, sc);
}

// The new K/V rows of this step into their slots (fp32 / bf16 codecs; the same bits as the torch
// path's cast: bf16 rounds to nearest even, every NaN becomes 0xffff as torch's CPU cast makes it).
template <int C>
void write_row(const float* src, void* data, int64_t at, int n) {
    if constexpr (C == KVS_CODEC_FP32) {
        std::memcpy(static_cast<float*>(data) + at, src, sizeof(float) * n);
    } else {
        uint16_t* dst = static_cast<uint16_t*>(data) + at;
        for (int d = 0; d < n; ++d) {
            uint32_t x;
            std::memcpy(&x, src + d, 4);
            const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
            dst[d] = (x & 0x7fffffffu) > 0x7f800000u ? 0xffff : static_cast<uint16_t>(rounded);
        }
    }
}

}  // namespace

KVS_EXPORT int kvs_paged_attention(const KvsAttention* args) {
    const KvsAttention& a = *args;
    const int64_t num_rows = a.num_rows;
    const int heads = a.heads, kv_heads = a.kv_heads, head_dim = a.head_dim, codec = a.codec;
    const int64_t *table_offsets = a.table_offsets, *table_first = a.table_first, *own_index = a.own_index;
    if (head_dim % W || (codec == KVS_CODEC_INT4 && head_dim % (2 * W)) || kv_heads <= 0 || heads % kv_heads ||
        codec < 0 || codec > KVS_CODEC_INT4 || (a.k_new && codec != KVS_CODEC_FP32 && codec != KVS_CODEC_BF16))
        return 1;
    // tiles: up to TILE consecutive rows with one block table that read every key from the cache
    std::vector<int64_t> tiles;  // first row of each tile, then num_rows
    for (int64_t r = 0; r < num_rows; ++r) {
        const bool joins = !tiles.empty() && r - tiles.back() < TILE && table_offsets[r] == table_offsets[r - 1] &&
                           table_first[r] == table_first[r - 1] && !(own_index && (own_index[r] >= 0 ||
                                                                                    own_index[r - 1] >= 0));
        if (!joins) tiles.push_back(r);
    }
    const int64_t num_tiles = static_cast<int64_t>(tiles.size());
    tiles.push_back(num_rows);
    const int threads = a.num_threads > 0 ? a.num_threads : 1;
    const bool by_segment = a.schedule == KVS_SCHEDULE_SEGMENT ||
                            (a.schedule == KVS_SCHEDULE_AUTO && threads > 1 && num_tiles < 4 * threads);
    // per segment: units (tile, segment), each with its partials at its offset in `partials`
    const int group = heads / kv_heads;
    const Heads all{0, kv_heads};
    std::vector<int64_t> first_unit;  // [num_tiles + 1]: tile t's segments are units first_unit[t]..
    std::vector<int64_t> seg_of, offset_of;
    int64_t total = 0;
    if (by_segment) {
        first_unit.reserve(num_tiles + 1);
        for (int64_t t = 0; t < num_tiles; ++t) {
            const Tile tile = make_tile(a, tiles[t], static_cast<int>(tiles[t + 1] - tiles[t]));
            first_unit.push_back(static_cast<int64_t>(seg_of.size()));
            for (int64_t seg = tile.kmin / SEGMENT; seg <= tile.kmax / SEGMENT; ++seg) {
                seg_of.push_back(seg);
                offset_of.push_back(total);
                total += static_cast<int64_t>(kv_heads) * tile.rows * group * (head_dim + 2);
            }
        }
        first_unit.push_back(static_cast<int64_t>(seg_of.size()));
    }
    std::vector<float> partials(static_cast<size_t>(total));
    const int64_t num_seg_units = static_cast<int64_t>(seg_of.size());
    // per tile: segments not yet attended; the thread that attends the last one merges them
    std::vector<std::atomic<int64_t>> pending(by_segment ? num_tiles : 0);
    for (int64_t t = 0; t < static_cast<int64_t>(pending.size()); ++t)
        pending[t].store(first_unit[t + 1] - first_unit[t], std::memory_order_relaxed);
    if (a.k_new) {  // every new row is written before any row is read
        const int64_t n = static_cast<int64_t>(kv_heads) * head_dim;
        kvs::parallel_for(num_rows * n >= 65536 ? threads : 1, num_rows, [&](int64_t r) {
            const int64_t at = a.slot_mapping[r] * n;
            if (codec == KVS_CODEC_FP32) {
                write_row<KVS_CODEC_FP32>(a.k_new + r * a.k_new_stride, a.k_data, at, static_cast<int>(n));
                write_row<KVS_CODEC_FP32>(a.v_new + r * a.v_new_stride, a.v_data, at, static_cast<int>(n));
            } else {
                write_row<KVS_CODEC_BF16>(a.k_new + r * a.k_new_stride, a.k_data, at, static_cast<int>(n));
                write_row<KVS_CODEC_BF16>(a.v_new + r * a.v_new_stride, a.v_data, at, static_cast<int>(n));
            }
        });
    }
    kvs::DynamicCounter units(by_segment ? num_seg_units : num_tiles);
    kvs::team_run(threads, [&](int, int) {
        Scratch sc;
        if (!by_segment) {
            units.each([&](int64_t t) {
                attend_tile(a, make_tile(a, tiles[t], static_cast<int>(tiles[t + 1] - tiles[t])), all, sc);
            });
        } else {
            units.each([&](int64_t p) {
                const int64_t t = std::upper_bound(first_unit.begin(), first_unit.end(), p) - first_unit.begin() - 1;
                const Tile tile = make_tile(a, tiles[t], static_cast<int>(tiles[t + 1] - tiles[t]));
                sc.prepare(kv_heads, tile.rows * group, head_dim, codec != KVS_CODEC_FP32 && codec != KVS_CODEC_BF16);
                load_queries(a, tile, all, sc);
                attend_segment_any(a, tile, all, seg_of[p], sc, partials.data() + offset_of[p]);
                // acq_rel: the last one sees every other segment's partial
                if (pending[t].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
                for (int64_t i = first_unit[t]; i < first_unit[t + 1]; ++i)  // ascending segments
                    merge_unit(a, tile, all, seg_of[i], partials.data() + offset_of[i], sc);
                finish(a, tile, all, sc);
            });
        }
    });
    return 0;
}
