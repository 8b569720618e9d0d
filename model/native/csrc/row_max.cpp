// Greedy decoding's max over each logits row, on CPU (and, below, the statistics of a row the sampler
// reads for log-probabilities and draws): the largest value and the first index that
// holds it, as torch.max(dim=-1) gives them (a NaN anywhere in a row: NaN and the first NaN's index).
// torch's reduction took ~60 us for one bfloat16 row of SmolLM2's 49,152 ids and ~1.3 ms for 32
// rows on a 2-core Xeon: one pass here keeps each of 16 lanes' maximum and the first index holding
// it (a row of Gemma 3's 262,144 ids is 1 MB in float32: read once, not once and a half). Exact: a
// maximum is one of the inputs, so the lane order cannot change it.
//
//   logits: float32 or bfloat16 (a 16-bit pattern) rows of `row_stride` elements, `vocab` wide;
//   out_max: [rows] float32; out_index: [rows] int64.

#include <math.h>
#include <string.h>

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
        // one pass: each lane's maximum and the first index holding it (a lane moves only on a larger
        // value), then the largest lane value and, of the lanes holding it, the lowest index
        v16i at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const v16i lane = at;
        v16f m = v16f{} - INFINITY, seen_nan = v16f{};
        for (int j = 0; j < vocab; j += 16) {
            v16f v;
            if (j + 16 <= vocab) {
                v = L::load(row + j);
            } else {
                for (int l = 0; l < 16; ++l) v[l] = j + l < vocab ? element(row, j + l) : -INFINITY;
            }
            const v16i up = v > m;
            m = up ? v : m;
            at = up ? lane + j : at;
            seen_nan = (v != v) ? v16f{} + 1.0f : seen_nan;
        }
        float mx = m[0];
        int64_t first = at[0];
        bool nan = seen_nan[0] != 0.0f;
        for (int l = 1; l < 16; ++l) {
            if (m[l] > mx || (m[l] == mx && at[l] < first)) {
                mx = m[l];
                first = at[l];
            }
            nan = nan || seen_nan[l] != 0.0f;
        }
        if (nan) {  // rare: the first NaN's index, by a scan
            for (int j = 0; j < vocab; ++j) {
                const float v = element(row, j);
                if (v != v) {
                    first = j;
                    break;
                }
            }
        }
        out_max[r] = nan ? NAN : mx;
        out_index[r] = first;
    });
}

// A row's n largest values with their indices (largest first; of equal values the lower index first) and
// (out_lse not null) its log-sum-exp at inverse temperature t, log sum_j e^(t x_j) (per lane from the
// lane's running maximum, then the lanes brought to the row's maximum and added by one fixed tree), in
// one pass over the row: what
// the sampler needs for log-probabilities and for the tokens its filters rank, instead of a log_softmax,
// a topk and a softmax over the whole vocabulary (at Gemma 3's 262,144 ids: ~2 ms a row through torch
// on one core). A row holding a NaN gives a NaN log-sum-exp (its top values are then meaningless).
struct TopN {
    float* vals;
    int64_t* idx;
    int n, count = 0;
    void offer(float v, int64_t j) {  // keeps the n largest seen, in order (the first n taken whatever they are)
        if (count == n && !(v > vals[n - 1])) return;
        int at = count < n ? count++ : n - 1;
        while (at > 0 && v > vals[at - 1]) {
            vals[at] = vals[at - 1];
            idx[at] = idx[at - 1];
            --at;
        }
        vals[at] = v;
        idx[at] = j;
    }
    float floor() const { return count < n ? -INFINITY : vals[n - 1]; }
};

static inline float lanes_max(v16f a) {  // the largest lane (NaN lanes lose every comparison)
    v16f b = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a = a > b ? a : b;
    b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    a = a > b ? a : b;
    b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    a = a > b ? a : b;
    return a[0] > a[1] ? a[0] : a[1];
}

static inline bool any_greater(v16f a, v16f b) {  // some lane of a above b's
#ifdef __AVX512F__
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GT_OQ) != 0;
#else
    return lanes_max((a > b) ? v16f{} + 1.0f : v16f{}) != 0.0f;
#endif
}

template <class L>
static void row_stats(const typename L::T* x, int64_t row_stride, int rows, int vocab, float t, int n, float* out_lse,
                      float* out_vals, int64_t* out_idx, int threads) {
    for_rows(rows, vocab, threads, [=](int r) {
        const typename L::T* row = x + (int64_t)r * row_stride;
        auto load = [&](int j) {  // 16 values from j, -inf past the row
            if (j + 16 <= vocab) return L::load(row + j);
            v16f v;
            for (int l = 0; l < 16; ++l) v[l] = j + l < vocab ? element(row, j + l) : -INFINITY;
            return v;
        };
        // one pass: the n largest (a vector is looked into only when one of its values beats the n-th held;
        // until n are held, every value is taken) and, per lane, the running maximum and the sum of
        // e^(t (x - that maximum)), rescaled when the maximum moves (rare once a few vectors are in)
        TopN top{out_vals + (int64_t)r * n, out_idx + (int64_t)r * n, n};
        const bool sums = out_lse != nullptr;
        v16f m = v16f{} - INFINITY, sum = v16f{}, seen_nan = v16f{};
        const v16f none = v16f{} - INFINITY;
        for (int j = 0; j < vocab; j += 16) {
            const v16f v = load(j);
            if (n > 0 && (top.count < n || any_greater(v, v16f{} + top.floor())))
                for (int l = 0; l < 16 && j + l < vocab; ++l) top.offer(v[l], j + l);
            seen_nan = (v != v) ? v16f{} + 1.0f : seen_nan;
            if (!sums) {
                m = v > m ? v : m;
                continue;
            }
            if (any_greater(v, m)) {  // a lane's maximum moves: rescale its sum
                const v16i up = v > m;
                const v16f moved = up ? v : m;
                const v16f scale = exp_clamped((m - moved) * t);
                sum = up ? (m == none ? v16f{} : sum * scale) : sum;
                m = moved;
            }
            const v16f e = exp_clamped((v - m) * t);
            sum = sum + (m == none ? v16f{} : e);  // a lane that has seen only -inf holds nothing
        }
        if (!sums) return;
        const float mx = lanes_max(m);
        v16f part = exp_clamped((m - mx) * t) * sum;
        part = (m == none) ? v16f{} : part;
        const bool nan = lanes_max(seen_nan) != 0.0f;
        out_lse[r] = nan ? NAN : mx * t + logf(total(part));
    });
}

// The index where the running sum of e^(t x_j - lse) over j = 0, 1, ... first exceeds u (u in [0, 1)):
// a draw from softmax(t x) by one uniform number, in one pass over the row (blocks of 16 summed by the
// lane tree, then the lanes of the block that crosses u). Returns the last index with a positive
// probability when rounding leaves u above the total.
template <class L>
static int64_t row_draw(const typename L::T* row, int vocab, float t, float lse, double u) {
    double run = 0.0;
    int64_t last = 0;
    for (int j = 0; j < vocab; j += 16) {
        v16f v;
        for (int l = 0; l < 16; ++l) v[l] = j + l < vocab ? element(row, j + l) : -INFINITY;
        v16f e = exp_clamped(v * t - lse);
        for (int l = vocab - j; l < 16; ++l) e[l] = 0.0f;
        const double block = total(e);
        if (run + block > u) {
            for (int l = 0; l < 16 && j + l < vocab; ++l) {
                run += e[l];
                if (run > u) return j + l;
            }
        }
        run += block;
        for (int l = 0; l < 16 && j + l < vocab; ++l)
            if (e[l] > 0.0f) last = j + l;
    }
    return last;
}

extern "C" {
int lm_row_stats_f32(const float* logits, int64_t row_stride, int rows, int vocab, float t, int n, float* out_lse,
                     float* out_vals, int64_t* out_idx, int threads) {
    if (rows < 0 || vocab < 1 || n < 0 || n > vocab) return 1;
    row_stats<F32>(logits, row_stride, rows, vocab, t, n, out_lse, out_vals, out_idx, threads);
    return 0;
}

int lm_row_stats_bf16(const uint16_t* logits, int64_t row_stride, int rows, int vocab, float t, int n,
                      float* out_lse, float* out_vals, int64_t* out_idx, int threads) {
    if (rows < 0 || vocab < 1 || n < 0 || n > vocab) return 1;
    row_stats<BF16>(logits, row_stride, rows, vocab, t, n, out_lse, out_vals, out_idx, threads);
    return 0;
}

int64_t lm_row_draw_f32(const float* row, int vocab, float t, float lse, double u) {
    return vocab < 1 ? -1 : row_draw<F32>(row, vocab, t, lse, u);
}

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
