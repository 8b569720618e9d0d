// GGUF blocks -> float32 or bfloat16 rows, for the loaders' float reads of a quantized file (the quality
// probe's float32 reference, a float mode's weights, an embedding): gguf_blocks.h's decoders over rows.
#include "gguf_blocks.h"
#include "native_common.h"

using namespace gguf;


extern "C" {

// Whether lm_gguf_dequantize takes this GGML type.
int lm_gguf_dequantizes(int ggml_type) {
    Format f;
    return format_for(ggml_type, f) ? 1 : 0;
}

// rows [n_rows, K / values * bytes] of one GGML type -> out [n_rows, K] float32 (out_bf16 0) or bfloat16
// (1). Returns 0, or 1 for a type or row length it does not take. Rows are independent: split over threads.
int lm_gguf_dequantize(const uint8_t* raw, int64_t n_rows, int64_t K, int ggml_type, void* out, int out_bf16,
                       int threads) {
    Format f;
    if (!format_for(ggml_type, f) || K % f.values) return 1;
    const int64_t blocks = K / f.values, row_bytes = blocks * f.bytes;
    for_rows((int)n_rows, K, threads, [&](int r) {
        const uint8_t* src = raw + r * row_bytes;
        float buf[QK_K];
        for (int64_t i = 0; i < blocks; i++) {
            const int64_t at = r * K + i * f.values;
            if (out_bf16) {
                f.block(src + i * f.bytes, buf);
                uint16_t* y = (uint16_t*)out + at;
                for (int l = 0; l < f.values; l++) y[l] = to_bf16(buf[l]);
            } else {
                f.block(src + i * f.bytes, (float*)out + at);
            }
        }
    });
    return 0;
}
}

extern "C" {

// The rows ids [n] of a table stored as `ggml_type` (raw [rows, row_bytes]) -> out [n, K] bfloat16: an
// embedding lookup from a file's own blocks. Returns 0, or 1 for a type or row length it does not take.
// The caller checks the ids.
int lm_gguf_rows_bf16(const uint8_t* raw, int64_t row_bytes, const int64_t* ids, int64_t n, int64_t K,
                      int ggml_type, uint16_t* out, int threads) {
    Format f;
    if (!format_for(ggml_type, f) || K % f.values || K / f.values * f.bytes != row_bytes) return 1;
    for_rows((int)n, K, threads, [&](int i) { row_to_bf16(ggml_type, raw + ids[i] * row_bytes, K, out + i * K); });
    return 0;
}
}
