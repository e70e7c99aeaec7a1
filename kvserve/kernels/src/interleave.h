// kvserve's own layout of a K format's weight rows: eight rows interleaved, so the decode rows read one
// 32-bit word of each row in one 256-bit load and keep a lane per row from the products to the block's
// total (matmul_direct.h qdot_interleaved), with no reduction across lanes. The bytes and the values
// are the file's; only their order changes: kvs_interleave_rows rewrites a matrix in place, and
// deinterleave_row gives any row back as the file had it (embeddings, the prefill tiles).
#pragma once
#include <cstring>
#include <vector>

#include "quant_formats.h"

namespace kvs {

constexpr int INTERLEAVED_ROWS = 8;  // one int32 lane of a 256-bit vector per row
static_assert(format_row(KVS_Q4_K_R8).group_rows == INTERLEAVED_ROWS && format_row(KVS_Q5_K_R8).group_rows ==
              INTERLEAVED_ROWS && format_row(KVS_Q6_K_R8).group_rows == INTERLEAVED_ROWS, "the table's groups");

// Where a superblock of a K format keeps its codes (a run of 32-bit words, interleaved) and the rest
// (the header: scales and fp16 fields, kept whole per row)
struct SuperblockSpan {
    int header_at, header_bytes;
    int code_at, code_bytes;
};

constexpr SuperblockSpan superblock_span(int base) {
    if (base == KVS_Q6_K) return {192, 18, 0, 192};    // ql, qh | scales, d
    if (base == KVS_Q5_K) return {0, 16, 16, 160};     // d, dmin, scales | qh, qs
    return {0, 16, 16, 128};                           // Q4_K: d, dmin, scales | qs
}

// Superblock s of a group of eight rows, interleaved: the eight headers one after another, then code word
// i of row r at (8 i + r) * 4; the group's superblocks follow each other, so the group holds the bytes
// its eight rows held (rows 8g .. 8g + 7 of the file's layout).
template <int Base>
inline uint8_t* group_header(uint8_t* sb, int r) { return sb + r * superblock_span(Base).header_bytes; }
template <int Base>
inline const uint8_t* group_header(const uint8_t* sb, int r) { return sb + r * superblock_span(Base).header_bytes; }
template <int Base>
inline const uint8_t* group_codes(const uint8_t* sb) {
    return sb + INTERLEAVED_ROWS * superblock_span(Base).header_bytes;
}

// eight rows in the file's layout (rows, contiguous) -> one interleaved group at out
template <int Base>
inline void interleave_group(const uint8_t* rows, int64_t superblocks, uint8_t* out) {
    constexpr SuperblockSpan span = superblock_span(Base);
    constexpr int bytes = geometry(Base).bytes;
    const int64_t row_bytes = superblocks * bytes;
    for (int64_t s = 0; s < superblocks; ++s) {
        uint8_t* sb = out + s * INTERLEAVED_ROWS * bytes;
        uint8_t* codes = sb + INTERLEAVED_ROWS * span.header_bytes;
        for (int r = 0; r < INTERLEAVED_ROWS; ++r) {
            const uint8_t* src = rows + r * row_bytes + s * bytes;
            std::memcpy(group_header<Base>(sb, r), src + span.header_at, span.header_bytes);
            for (int i = 0; i < span.code_bytes / 4; ++i)
                std::memcpy(codes + (INTERLEAVED_ROWS * i + r) * 4, src + span.code_at + 4 * i, 4);
        }
    }
}

// row r of an interleaved group -> the file's bytes of that row
template <int Base>
inline void deinterleave_row(const uint8_t* group, int64_t superblocks, int r, uint8_t* row) {
    constexpr SuperblockSpan span = superblock_span(Base);
    constexpr int bytes = geometry(Base).bytes;
    for (int64_t s = 0; s < superblocks; ++s) {
        const uint8_t* sb = group + s * INTERLEAVED_ROWS * bytes;
        const uint8_t* codes = group_codes<Base>(sb);
        uint8_t* dst = row + s * bytes;
        std::memcpy(dst + span.header_at, group_header<Base>(sb, r), span.header_bytes);
        for (int i = 0; i < span.code_bytes / 4; ++i)
            std::memcpy(dst + span.code_at + 4 * i, codes + (INTERLEAVED_ROWS * i + r) * 4, 4);
    }
}

// A matrix of N rows (N a multiple of eight) of K format Base rewritten in place, group by group
template <int Base>
inline void interleave_rows(uint8_t* w, int64_t N, int64_t K) {
    const int64_t superblocks = K / 256, group_bytes = INTERLEAVED_ROWS * superblocks * geometry(Base).bytes;
    std::vector<uint8_t> rows(group_bytes);
    for (int64_t g = 0; g < N / INTERLEAVED_ROWS; ++g) {
        uint8_t* group = w + g * group_bytes;
        std::memcpy(rows.data(), group, group_bytes);
        interleave_group<Base>(rows.data(), superblocks, group);
    }
}

// Row n of a matrix of format `type` in the file's layout: the row itself, or for an interleaved format
// its bytes put back in order into `scratch` (row_bytes)
inline const uint8_t* file_row(int type, const uint8_t* w, int64_t row_bytes, int64_t n, uint8_t* scratch) {
    const FormatRow& f = format_row(type);
    if (f.group_rows == 1) return w + n * row_bytes;
    const uint8_t* group = w + n / INTERLEAVED_ROWS * INTERLEAVED_ROWS * row_bytes;
    const int64_t superblocks = row_bytes / f.bytes;
    const int r = int(n % INTERLEAVED_ROWS);
    switch (f.base) {
        case KVS_Q4_K: deinterleave_row<KVS_Q4_K>(group, superblocks, r, scratch); break;
        case KVS_Q5_K: deinterleave_row<KVS_Q5_K>(group, superblocks, r, scratch); break;
        default: deinterleave_row<KVS_Q6_K>(group, superblocks, r, scratch); break;
    }
    return scratch;
}

}  // namespace kvs
