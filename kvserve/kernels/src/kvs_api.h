// The kernels' contract with the rest of kvserve: every exported entry point, enum and argument struct,
// declared here once. kvserve/kernels/api.py mirrors this file in ctypes, and at load compares its mirror
// with what the library reports about itself (kvs_api_manifest, kvs_formats): a library and a mirror
// that disagree are never called.
//
// Conventions: matrices are row-major float32 unless named otherwise; `ld*` / `*_stride` are elements
// between rows; `num_threads` is an upper bound for the kernels' thread team (team.h); 0 is success.
#pragma once
#include <cstddef>
#include <cstdint>

#define KVS_EXPORT extern "C" __attribute__((visibility("default")))

#pragma GCC visibility push(default)  // the library exports exactly these (it is built with hidden visibility)
extern "C" {

// ---------------------------------------------------------------- enums

// Weight formats by their ggml type id (gguf.GGMLQuantizationType); kvs_formats lists the ones this
// library runs, one row each (matmul.cpp's table). 1000 + a format's id: kvserve's own layout of it, its
// rows interleaved in groups of eight (kvs_interleave_rows; the same values, the decode rows' layout).
enum KvsFormat : int {
    KVS_F32 = 0, KVS_F16 = 1, KVS_Q4_0 = 2, KVS_Q4_1 = 3, KVS_Q5_0 = 6, KVS_Q5_1 = 7, KVS_Q8_0 = 8,
    KVS_Q4_K = 12, KVS_Q5_K = 13, KVS_Q6_K = 14, KVS_BF16 = 30,
    KVS_Q4_0_R8 = 1002, KVS_Q4_1_R8 = 1003, KVS_Q5_0_R8 = 1006, KVS_Q5_1_R8 = 1007, KVS_Q8_0_R8 = 1008,
    KVS_Q4_K_R8 = 1012, KVS_Q5_K_R8 = 1013, KVS_Q6_K_R8 = 1014,
};

// How a layer's KV pages are stored (model/kv_quant.py's codecs; fp8's two kinds read through a table)
enum KvsCodec : int {
    KVS_CODEC_FP32 = 0, KVS_CODEC_BF16 = 1, KVS_CODEC_FP16 = 2, KVS_CODEC_FP8 = 3, KVS_CODEC_INT8 = 4,
    KVS_CODEC_INT4 = 5,
};

// How paged attention spreads its work over threads; every schedule gives the same bits
enum KvsSchedule : int { KVS_SCHEDULE_AUTO = 0, KVS_SCHEDULE_TILE = 1, KVS_SCHEDULE_SEGMENT = 2 };

// The gated MLP's activation
enum KvsActivation : int { KVS_ACT_SILU = 0, KVS_ACT_GELU_TANH = 1 };

// kvs_matmul's and kvs_dequantize_rows' failures
enum KvsMatmulStatus : int { KVS_MATMUL_OK = 0, KVS_MATMUL_NO_FORMAT = -1, KVS_MATMUL_BAD_ROW_LENGTH = -2 };

enum : int { KVS_MAX_PARTS = 4 };  // formats stacked by rows in one KvsLinear
// kvs_matmul with up to this many activation rows (decode, a speculative verify) streams the weights
// through registers (the decode rows); more rows run the prefill tiles
enum : int { KVS_DECODE_ROWS = 8 };

// Which cache level a software prefetch fills (_MM_HINT_T0 / T1 / T2), or none
enum KvsPrefetch : int { KVS_PREFETCH_NONE = 0, KVS_PREFETCH_L1 = 1, KVS_PREFETCH_L2 = 2, KVS_PREFETCH_L3 = 3 };

// ---------------------------------------------------------------- argument structs

// One row of the format table: what Python needs to lay out a weight for the kernels
struct KvsFormatInfo {
    int32_t type;        // KvsFormat
    int32_t block;       // elements per block
    int32_t bytes;       // bytes per block
    int32_t is_float;    // 1: float32 activations (F32, F16, BF16); 0: activations rounded to int8 blocks
    char name[8];        // "Q4_K"
    int32_t group_rows;  // 1, or 8: rows interleaved in groups of eight (a matrix of whole groups only)
    int32_t base;        // the file's format of the values (the type itself, or the one interleaved)
};

// The kernels' run-time tuning (kvs_set_tuning): choices that change speed and never bits, picked per host
// by kernels/tuning.py. The built-in defaults (kvs_set_tuning(null)): {L1, 0, L1, 0, 0}.
struct KvsTuning {
    int32_t weight_prefetch;        // KvsPrefetch: where the decode rows ask for the weights ahead of use
    int32_t weight_prefetch_ahead;  // bytes between the end of the group being computed and the ones
                                    //   prefetched (0: one group of eight rows, whatever its size); an
                                    //   interleaved group's spread prefetch: between the step being
                                    //   computed and the bytes prefetched
    int32_t kv_prefetch;            // KvsPrefetch: where attention asks for the KV rows ahead of use
    int32_t weight_prefetch_spread; // 1: a group's prefetch spread over its blocks; 0: in one burst
    int32_t chained_sums;           // bit f (1 << KvsFormat f): the decode rows of f's interleaved twin add
                                    //   their integer sums through VNNI's vpdpwssd (AVX-512 builds; others
                                    //   keep 0: kvs_get_tuning reads back what the rows do)
};

// Paged attention's arguments (kvs_paged_attention):
//   q [num_rows, heads, head_dim] (row stride q_row_stride) -> out [num_rows, heads, head_dim]
//   pages k_data / v_data [num_pages, page_size, kv_heads, head_dim] in `codec` (int4: head_dim / 2 bytes)
//   row r: position positions[r], keys lo..p (lo = max(0, p - window + 1)); logical page i of its block
//   table is tables[table_offsets[r] + i - table_first[r]]
struct KvsAttention {
    const float* q;
    float* out;
    void* k_data;
    void* v_data;
    const float* k_scales;  // [num_pages, kv_heads] (int codecs), else null
    const float* v_scales;
    const float* k_table;  // [256] fp8 byte -> value (per-tensor scale folded in), else null
    const float* v_table;
    const int64_t* positions;
    const int64_t* table_offsets;
    const int64_t* table_first;
    const int64_t* tables;
    const float* k_own;  // [n, page_size, kv_heads, head_dim]: a prefill row's own page in float32, or null
    const float* v_own;
    const int64_t* own_index;  // [num_rows] index into k_own, -1: read the own page from the cache
    const float* k_new;  // fp32 and bf16 codecs: this step's K/V rows [num_rows, kv_heads, head_dim],
    const float* v_new;  //   written to slot_mapping[r] before any row reads; else null
    const int64_t* slot_mapping;
    int64_t q_row_stride;
    int64_t num_rows;
    int64_t k_new_stride;
    int64_t v_new_stride;
    int32_t heads, kv_heads, head_dim, page_size;
    int32_t window;    // 0: none
    int32_t codec;     // KvsCodec
    int32_t schedule;  // KvsSchedule
    int32_t num_threads;
    float scale;  // the scores' factor, 1 / sqrt(head_dim)
    float pad;
};

// A linear layer's weight: parts stacked by rows, each in its own format, filling its columns of one
// output, then the bias if any
struct KvsLinear {
    int64_t num_parts;
    int64_t in_features;
    int64_t out_features;
    int64_t formats[KVS_MAX_PARTS];  // KvsFormat
    const uint8_t* weights[KVS_MAX_PARTS];
    int64_t rows[KVS_MAX_PARTS];
    const float* bias;  // [out_features] or null
};

// Which keys a layer's rows attend and where their K/V rows go: the full-attention layers' set, or a
// sliding window's (its own block tables with the hybrid pool)
struct KvsRows {
    const int64_t* positions;
    const int64_t* table_offsets;
    const int64_t* table_first;
    const int64_t* tables;
    const int64_t* slot_mapping;
    int64_t window;  // 0: none
};

// One decoder layer's weights and KV pages. The optional norms are null where the model has none:
// QK-norm (Qwen3, Gemma 3), the norms of the attention and MLP outputs (Gemma).
struct KvsLayer {
    KvsLinear qkv, o_proj, gate_up, down;
    const float* input_norm;
    const float* post_attention_norm;
    const float* q_norm;
    const float* k_norm;
    const float* attn_out_norm;
    const float* mlp_out_norm;
    void* k_data;
    void* v_data;
    int64_t rows_set;  // index into KvsStep::row_sets
    int64_t rope_set;  // 0: the global RoPE tables, 1: the sliding-window layers' own
};

// What every layer of a step shares: shapes, the rows' RoPE tables and attention rows, and the scratch
// every layer reuses. h and m: the residual stream, h + m the next layer's input.
struct KvsStep {
    int64_t rows;
    int64_t num_layers;
    int64_t hidden, heads, kv_heads, head_dim, inter, page_size;
    int64_t codec;       // KvsCodec (fp32 or bf16: the attention kernel writes the step's K/V)
    int64_t activation;  // KvsActivation
    int64_t num_threads;
    float eps, q_scale, attn_scale, pad;
    KvsRows row_sets[2];
    const float* cos_table[2];  // [positions, head_dim / 2]: model/llama.py's Rotary tables (cos, sin of each angle)
    const float* sin_table[2];
    const float* final_norm;
    float *h, *m, *normed, *qkv, *qk_normed, *qk, *attn, *gate_up, *act_out, *out;
    float *cos, *sin;  // [2, rows, head_dim]: each row's angles from each table
};

// ---------------------------------------------------------------- entry points

// The library itself (kvs_api.cpp)
const char* kvs_isa(void);            // "scalar", "avx2", "avx512" or "amx"
const char* kvs_source_digest(void);  // kvserve.kernels.source_digest() of the sources it was built from
const char* kvs_api_manifest(void);   // one line per entry point, struct and enum value (api.py reads it)
int kvs_max_threads(void);            // OpenMP's
int kvs_simd_width(void);             // float lanes of a vector: attention's head_dim must be a multiple
int kvs_formats(KvsFormatInfo* out, int capacity);  // the format table's rows (up to capacity); its length
void kvs_set_tuning(const KvsTuning* tuning);       // for every later call, from any thread (null: defaults)
void kvs_get_tuning(KvsTuning* out);

// Matmul over a format's own blocks (matmul.cpp): y[t * ldy + n] = sum_k x[t * ldx + k] * W[n, k], W: N
// rows of K / block blocks. KvsMatmulStatus.
int kvs_matmul(int format, const uint8_t* w, int64_t N, int64_t K, const float* x, int64_t ldx, int64_t T, float* y,
               int64_t ldy, int num_threads);
// W (N rows of format `format`, the file's layout) rewritten in place in its interleaved twin's layout
// (format + 1000: every block format); N a multiple of 8. KvsMatmulStatus (NO_FORMAT: no twin; BAD_ROW_LENGTH: K or N).
int kvs_interleave_rows(int format, uint8_t* w, int64_t N, int64_t K);
// out[i, :] = W[rows[i], :] as float32, decoded as the matmul decodes (embedding lookups). KvsMatmulStatus.
int kvs_dequantize_rows(int format, const uint8_t* w, int64_t K, const int64_t* rows, int64_t n, float* out);
// x as the block formats see it: q [T, K] int8, d [T, K / 32], mult [T, K / 2] int16 (tests)
int kvs_quantize_activations(const float* x, int64_t T, int64_t K, int8_t* q, float* d, int16_t* mult);

// Row-wise ops (ops.cpp): each output row from its own input row, whatever the rows or threads.
// out[r] = rms_norm(x[r]) * weight over a [outer, inner, dim] view (x[r] at o * x_stride + i * dim); with
// `residual`, sum[r] = x[r] + residual[r] is written and normalized instead
void kvs_rms_norm(const float* x, int64_t outer, int inner, int dim, int64_t x_stride, const float* residual,
                  float* sum, const float* weight, float eps, float* out, int64_t out_stride, int num_threads);
// RoPE in the rotate-half layout on x [tokens, heads, head_dim], the first scaled_heads heads times scale
void kvs_rope(const float* x, int64_t tokens, int heads, int head_dim, int64_t x_stride, const float* cos,
              const float* sin, int scaled_heads, float scale, float* out, int num_threads);
// out[t] = act(gate[t]) * up[t], [gate | up] the halves of x[t]; act: KvsActivation
void kvs_gated_act(const float* x, int64_t tokens, int inter, int64_t x_stride, int act, float* out,
                   int num_threads);

// Paged attention (attention.cpp): 0, else 1 (a codec or head_dim this build cannot run)
int kvs_paged_attention(const KvsAttention* args);

// A Llama-style model's layers and final norm for a step's rows (ops_layers.cpp): 0, else the failing
// kernel's code (matmul's; attention's + 100)
int kvs_decoder_layers(const KvsLayer* layers, const KvsStep* step);

}  // extern "C"
#pragma GCC visibility pop

// The entry points kvs_api_manifest reports, each once (its signature is derived from the declaration)
#define KVS_ENTRY_POINTS(X)                                                                                  \
    X(kvs_isa) X(kvs_source_digest) X(kvs_api_manifest) X(kvs_max_threads) X(kvs_simd_width) X(kvs_formats) \
    X(kvs_set_tuning) X(kvs_get_tuning)                                                                  \
    X(kvs_matmul) X(kvs_interleave_rows) X(kvs_dequantize_rows) X(kvs_quantize_activations) X(kvs_rms_norm) \
    X(kvs_rope) X(kvs_gated_act) X(kvs_paged_attention) X(kvs_decoder_layers)

#define KVS_STRUCTS(X) X(KvsFormatInfo) X(KvsTuning) X(KvsAttention) X(KvsLinear) X(KvsRows) X(KvsLayer) X(KvsStep)

#define KVS_ENUM_VALUES(X)                                                                                    \
    X(KVS_F32) X(KVS_F16) X(KVS_Q4_0) X(KVS_Q4_1) X(KVS_Q5_0) X(KVS_Q5_1) X(KVS_Q8_0) X(KVS_Q4_K) X(KVS_Q5_K) \
    X(KVS_Q6_K) X(KVS_BF16) X(KVS_Q4_0_R8) X(KVS_Q4_1_R8) X(KVS_Q5_0_R8) X(KVS_Q5_1_R8) X(KVS_Q8_0_R8)        \
    X(KVS_Q4_K_R8) X(KVS_Q5_K_R8) X(KVS_Q6_K_R8) X(KVS_CODEC_FP32) X(KVS_CODEC_BF16)                          \
    X(KVS_CODEC_FP16) X(KVS_CODEC_FP8) X(KVS_CODEC_INT8) X(KVS_CODEC_INT4) X(KVS_SCHEDULE_AUTO)               \
    X(KVS_SCHEDULE_TILE) X(KVS_SCHEDULE_SEGMENT)                                                              \
    X(KVS_ACT_SILU) X(KVS_ACT_GELU_TANH) X(KVS_MATMUL_OK) X(KVS_MATMUL_NO_FORMAT) X(KVS_MATMUL_BAD_ROW_LENGTH) \
    X(KVS_MAX_PARTS) X(KVS_DECODE_ROWS) X(KVS_PREFETCH_NONE) X(KVS_PREFETCH_L1) X(KVS_PREFETCH_L2) X(KVS_PREFETCH_L3)
