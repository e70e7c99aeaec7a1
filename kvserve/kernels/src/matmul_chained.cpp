// The interleaved twins' decode rows with their sums chained by VNNI's vpdpwssd (matmul_direct.h chained_rows), on
// the builds that can (common.h CAN_CHAIN_SUMS); matmul.cpp's direct_rows takes them where the host's tuning says.
#include <array>
#include <utility>

#include "matmul_direct.h"

namespace kvs {

#if KVS_SIMD
namespace {

template <int Q, size_t... R>
constexpr std::array<DirectFn, sizeof...(R)> chained_row(std::index_sequence<R...>) {
    if constexpr (CAN_CHAIN_SUMS && !is_float_type(Q) && format_row(Q).group_rows > 1)
        return {qdot_direct_rows<Q, int(R) + 1, true>...};
    else
        return {};
}

template <size_t... I>
constexpr auto chained_table(std::index_sequence<I...>) {
    return std::array<std::array<DirectFn, KVS_DECODE_ROWS>, sizeof...(I)>{
        chained_row<kFormatRows[I].type>(std::make_index_sequence<KVS_DECODE_ROWS>{})...};
}

constexpr auto kChainedRows = chained_table(std::make_index_sequence<kNumFormats>{});

}  // namespace

DirectFn chained_rows(int type, int64_t rows) {
    if (rows < 1 || rows > KVS_DECODE_ROWS) return nullptr;
    for (int i = 0; i < kNumFormats; ++i)
        if (kFormatRows[i].type == type) return kChainedRows[i][rows - 1];
    return nullptr;
}
#endif

}  // namespace kvs
