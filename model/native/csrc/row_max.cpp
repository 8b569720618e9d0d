// Greedy decoding's max over each logits row, on CPU: the largest value and the first index that
// holds it, as torch.max(dim=-1) gives them (a NaN anywhere in a row: NaN and the first NaN's index).
// torch's reduction took ~60 us for one bfloat16 row of SmolLM2's 49,152 ids and ~1.3 ms for 32
// rows on a 2-core Xeon: two passes here (the maximum by 16 lanes, then the first index equal to
// it) read the row from cache in a few microseconds. Exact: a maximum is one of the inputs, so the
// lane order cannot change it.
//
//   logits: float32 or bfloat16 (a 16-bit pattern) rows of `row_stride` elements, `vocab` wide;
//   out_max: [rows] float32; out_index: [rows] int64.

#include <math.h>

#include "native_common.h"

static inline float element(const float* row, int j) { return row[j]; }
static inline float element(const uint16_t* row, int j) {  // a bfloat16 widened
    const uint32_t w = (uint32_t)row[j] << 16;
    float v;
    memcpy(&v, &w, 4);
    return v;
}

template <class L>
static void row_max(const typename L::T* x, int64_t row_stride, int rows, int vocab, float* out_max,
                    int64_t* out_index, int threads) {
    for_rows(rows, vocab, threads, [=](int r) {
        const typename L::T* row = x + (int64_t)r * row_stride;
        const int body = vocab / 16 * 16;
        float mx = -INFINITY;
        bool nan = false;
        if (body) {
            v16f m = L::load(row), seen_nan = v16f{};
            for (int j = 16; j < body; j += 16) {
                v16f v = L::load(row + j);
                m = v > m ? v : m;
                seen_nan = (v != v) ? v16f{} + 1.0f : seen_nan;
            }
            seen_nan = (m != m) ? v16f{} + 1.0f : seen_nan;  // the first vector's NaNs
            for (int l = 0; l < 16; ++l) {
                mx = m[l] > mx ? m[l] : mx;
                nan = nan || seen_nan[l] != 0.0f;
            }
        }
        for (int j = body; j < vocab; ++j) {  // the tail, one by one
            const float v = element(row, j);
            nan = nan || v != v;
            mx = v > mx ? v : mx;
        }
        int64_t at = 0;
        for (int j = 0; j < vocab; ++j) {  // the first index holding it (or the first NaN)
            const float v = element(row, j);
            if (nan ? v != v : v == mx) {
                at = j;
                break;
            }
        }
        out_max[r] = nan ? NAN : mx;
        out_index[r] = at;
    });
}

extern "C" {
int lm_row_max_f32(const float* logits, int64_t row_stride, int rows, int vocab, float* out_max,
                   int64_t* out_index, int threads) {
    if (rows < 0 || vocab < 1) return 1;
    row_max<F32>(logits, row_stride, rows, vocab, out_max, out_index, threads);
    return 0;
}

int lm_row_max_bf16(const uint16_t* logits, int64_t row_stride, int rows, int vocab, float* out_max,
                    int64_t* out_index, int threads) {
    if (rows < 0 || vocab < 1) return 1;
    row_max<BF16>(logits, row_stride, rows, vocab, out_max, out_index, threads);
    return 0;
}
}
