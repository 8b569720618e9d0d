// What the sampler reads of each logits row on CPU, in one pass over the row (row_scan): the largest
// value and the first index that holds it, as torch.max(dim=-1) gives them (a NaN anywhere in a row:
// NaN and the first NaN's index), greedy decoding's whole answer; and where a row asks for them, its n
// largest values and its log-sum-exp at an inverse temperature t, what log-probabilities and a sampled
// row's filters need. Below, a draw from a row by one uniform number.
// torch's max took ~60 us for one bfloat16 row of SmolLM2's 49,152 ids and ~1.3 ms for 32 rows on a
// 2-core Xeon; a log_softmax, a topk and a softmax over a row of Gemma 3's 262,144 ids ~2 ms on one
// core. A 262,144-wide row is 1 MB in float32: a step's rows are read once, all of them in one call,
// whatever each asks. Exact: a maximum is one of the inputs, so the lane order cannot change it; the
// log-sum-exp adds the lanes by one fixed tree.
//
//   logits: float32 or bfloat16 (a 16-bit pattern) rows of `row_stride` elements, `vocab` wide;
//   out_max: [rows] float32; out_index: [rows] int64.

#include <float.h>
#include <math.h>
#include <string.h>

#include "native_common.h"

static inline float element(const float* row, int j) { return row[j]; }
static inline float element(const uint16_t* row, int j) { return bf16_to_f32(row[j]); }  // a bfloat16 widened

// A row's n largest values with their indices, largest first; of equal values the lower index first
// (values are offered in index order). A row holding a NaN gives a NaN log-sum-exp, and its top values
// are then meaningless.
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

// Built with -DLMSERVE_SCAN_ONE_BLOCK (tests only): the scan without its shortcuts (a row at t = 1 skips the
// products by t; the log-sum-exp's loop tests two blocks at a time, NaN found through the sums), which must
// give the same bits.
#ifdef LMSERVE_SCAN_ONE_BLOCK
constexpr bool kShortcuts = false;
#else
constexpr bool kShortcuts = true;
#endif

static inline bool any_greater2(v16f a, v16f b, v16f c) {  // some lane of a or of b above c's
#ifdef __AVX512F__
    return (_mm512_cmp_ps_mask((__m512)a, (__m512)c, _CMP_GT_OQ) | _mm512_cmp_ps_mask((__m512)b, (__m512)c, _CMP_GT_OQ)) != 0;
#else
    return any_greater(a, c) || any_greater(b, c);
#endif
}

// Whether some lane of x is a NaN, gathered over a row: a mask register under AVX-512 (no blend per block).
struct NanSeen {
#ifdef __AVX512F__
    __mmask16 seen = 0;
    void add(v16f x) { seen |= _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q); }
    bool any() const { return seen != 0; }
#else
    v16f seen = v16f{};
    void add(v16f x) { seen = (x != x) ? v16f{} + 1.0f : seen; }
    bool any() const { return lanes_max(seen) != 0.0f; }
#endif
};

// The largest of 16 lanes' maxima and, of the lanes holding it, the lowest index (each lane's index is the
// first in that lane holding its maximum): the first index of the row's maximum.
static inline void lanes_first_max(v16f m, v16i at, float* out_max, int64_t* out_index) {
    float mx = m[0];
    int64_t first = at[0];
    for (int l = 1; l < 16; ++l) {
        if (m[l] > mx || (m[l] == mx && at[l] < first)) {
            mx = m[l];
            first = at[l];
        }
    }
    *out_max = mx;
    *out_index = first;
}

// One row in one pass: its maximum and the first index holding it (out_max not null), the n largest
// values (TOP) and the log-sum-exp at t (LSE). The maximum is kept per lane with the first index that
// holds it (a lane moves only on a larger value), then the largest lane and, of the lanes holding it,
// the lowest index; a NaN anywhere gives NaN and the first NaN's index. The log-sum-exp's lanes share
// that running maximum, so a term's exponent t (x - max) is never positive: the clamp from above is left
// out (exp_clamped's bits otherwise). A lane that has seen only -inf holds nothing; once every lane has
// seen a finite value (a lane's maximum only grows) the loop goes on without that mask. UNIT: t is 1, the
// products by t left out (x * 1 is x: the same bits); logprobs rows ask at t = 1. The log-sum-exp's pass is
// compute-bound: per block of 16, the exponential's 11 multiplies and fused multiply-adds and whatever else
// takes a vector port (a product by t, the tests for a new maximum, the top's floor and NaN), so the loop
// past the first blocks does one test for two blocks and leaves NaN to the sums (88 -> 69 us a row of
// 262,144 at t = 1 with a top 5, one Zen 4 core; the same bits).
template <class L, bool TOP, bool LSE, bool UNIT>
static void scan_row(const typename L::T* row, int vocab, float t, int n, float* out_max, int64_t* out_index,
                     float* out_lse, float* out_vals, int64_t* out_idx) {
    auto load = [&](int j) {  // 16 values from j, -inf past the row
        if (j + 16 <= vocab) return L::load(row + j);
        v16f v;
        for (int l = 0; l < 16; ++l) v[l] = j + l < vocab ? element(row, j + l) : -INFINITY;
        return v;
    };
    auto at_t = [&](v16f x) { return UNIT ? x : x * t; };
    TopN top{out_vals, out_idx, n};
    v16f floor = v16f{} - INFINITY;  // top.floor() in every lane: a block with nothing above it offers nothing
    auto offer = [&](v16f v, int j) {
        if (TOP && (top.count < n || any_greater(v, floor))) {
            for (int l = 0; l < 16 && j + l < vocab; ++l) top.offer(v[l], j + l);
            floor = v16f{} + top.floor();
        }
    };
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16i at = lane;
    v16f m = v16f{} - INFINITY, sum = v16f{};
    NanSeen nans;
    const v16f none = v16f{} - INFINITY;
    int j = 0;
    if (!LSE) {
        for (; j < vocab; j += 16) {
            const v16f v = load(j);
            offer(v, j);
            nans.add(v);
            const v16i up = v > m;
            m = up ? v : m;
            at = up ? lane + j : at;
        }
    } else {
        bool empty = true;  // some lane has seen only -inf (it holds nothing)
        for (; j < vocab && empty; j += 16) {
            const v16f v = load(j);
            offer(v, j);
            nans.add(v);
            if (any_greater(v, m)) {  // a lane's maximum moves: rescale its sum
                const v16i up = v > m;
                const v16f moved = up ? v : m;
                const v16f scale = exp_clamped(at_t(m - moved));
                sum = up ? (m == none ? v16f{} : sum * scale) : sum;
                m = moved;
                at = up ? lane + j : at;
                empty = any_greater(v16f{} - FLT_MAX, m);  // some lane still -inf
            }
            const v16f e = exp_clamped<false>(at_t(v - m));  // (v - m) t <= 0, or NaN
            sum = sum + (m == none ? v16f{} : e);
        }
        auto step = [&](v16f v, int j) {  // every lane holds a finite maximum
            if (any_greater(v, m)) {
                const v16i up = v > m;
                const v16f moved = up ? v : m;
                const v16f scale = exp_clamped(at_t(m - moved));
                sum = up ? sum * scale : sum;
                m = moved;
                at = up ? lane + j : at;
            }
            sum = sum + exp_clamped<false>(at_t(v - m));
        };
        // Two blocks at a time, one test for both: a value above thr is a lane's new maximum or one above the
        // top's floor. A NaN there is not looked for block by block: it makes its lane's sum NaN for good
        // (as does +inf - +inf), and a NaN sum sends the row to a scan for one below.
        v16f thr = TOP ? (m < floor ? m : floor) : m;
        const int unwatched = j;
        for (; kShortcuts && j + 32 <= vocab; j += 32) {
            const v16f a = L::load(row + j), b = L::load(row + j + 16);
            if ((TOP && top.count < n) || any_greater2(a, b, thr)) {
                offer(a, j);
                offer(b, j + 16);
                nans.add(a);
                nans.add(b);
                step(a, j);
                step(b, j + 16);
                thr = TOP ? (m < floor ? m : floor) : m;
            } else {
                sum = sum + exp_clamped<false>(at_t(a - m));
                sum = sum + exp_clamped<false>(at_t(b - m));
            }
        }
        if (j > unwatched && lanes_max((sum != sum) ? v16f{} + 1.0f : v16f{}) != 0.0f)
            for (int i = unwatched; i < j; i += 16) nans.add(L::load(row + i));
        for (; j < vocab; j += 16) {
            const v16f v = load(j);
            offer(v, j);
            nans.add(v);
            step(v, j);
        }
    }
    const bool nan = nans.any();
    if (LSE) {
        const float mx = lanes_max(m);
        v16f part = exp_clamped(at_t(m - mx)) * sum;
        part = (m == none) ? v16f{} : part;
        *out_lse = nan ? NAN : (UNIT ? mx : mx * t) + logf(total(part));
    }
    if (!out_max) return;
    float mx;
    int64_t first;
    lanes_first_max(m, at, &mx, &first);
    if (nan) {  // rare: the first NaN's index, by a scan
        for (int j = 0; j < vocab; ++j) {
            const float v = element(row, j);
            if (v != v) {
                first = j;
                break;
            }
        }
    }
    *out_max = nan ? NAN : mx;
    *out_index = first;
}

// A constrained row's maximum and its first index as if every id its bitmask does not allow were -inf
// (logit_mask.cpp's rows, then scan_row), without writing the row: only the words holding an allowed id
// are read, 32 ids at a time, the others' lanes -inf. A greedy row's whole answer; a JSON schema allows
// few of Gemma 3's 262,144 ids (its forced keys one), so most of the 1 MB row is never read.
//   bits: `words` uint32, bit t % 32 of word t / 32 allows id t (ids at or past 32 * words never allowed).
template <class L>
static void masked_max_row(const typename L::T* row, const uint32_t* bits, int words, int vocab, float* out_max,
                           int64_t* out_index) {
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f none = v16f{} - INFINITY;
    v16i at = lane;
    v16f m = none;
    NanSeen nans;
    const int whole = words < vocab / 32 ? words : vocab / 32;  // words whose 32 ids are all in the row
    auto take = [&](v16f v, uint32_t half, int j) {  // 16 ids from j, the lanes of half's clear bits -inf
        const v16i keep = ((v16i{} + (int32_t)half) >> lane) & 1;
        v = keep != 0 ? v : none;
        nans.add(v);
        const v16i up = v > m;
        m = up ? v : m;
        at = up ? lane + j : at;
    };
    for (int w = 0; w < whole; ++w) {
        const uint32_t word = bits[w];
        if (!word) continue;
        const int j = 32 * w;
        if (word & 0xffffu) take(L::load(row + j), word & 0xffffu, j);
        if (word >> 16) take(L::load(row + j + 16), word >> 16, j + 16);
    }
    if (whole < words && 32 * whole < vocab) {  // a last word the row ends inside
        const uint32_t word = bits[whole];
        for (int h = 0; h < 2; ++h) {
            const int j = 32 * whole + 16 * h;
            v16f v = none;
            for (int l = 0; l < 16 && j + l < vocab; ++l) v[l] = element(row, j + l);
            take(v, (word >> (16 * h)) & 0xffffu, j);
        }
    }
    float mx;
    int64_t first;
    lanes_first_max(m, at, &mx, &first);
    if (nans.any()) {  // rare: the first allowed NaN's index
        for (int j = 0; j < vocab && j < 32 * words; ++j) {
            const float v = element(row, j);
            if (((bits[j / 32] >> (j % 32)) & 1u) && v != v) {
                first = j;
                break;
            }
        }
    }
    *out_max = nans.any() ? NAN : mx;
    *out_index = first;
}

// Rows [rows] of `row_stride` elements, each scanned once (scan_row): the maxima and first indices into
// out_max / out_index (when not null), and for a row r with n[r] > 0 its n[r] largest values and indices
// into out_vals / out_idx + r * top_stride, and with lse[r] its log-sum-exp at t[r] into out_lse[r]
// (n, t, lse null: nothing but the maxima). What a step's sampler asks of every row, in one call.
template <class L>
static void row_scan(const typename L::T* x, int64_t row_stride, int rows, int vocab, const float* t, const int* n,
                     const uint8_t* lse, int top_stride, float* out_max, int64_t* out_index, float* out_lse,
                     float* out_vals, int64_t* out_idx, int threads) {
    for_rows(rows, vocab, threads, [=](int r) {
        const typename L::T* row = x + (int64_t)r * row_stride;
        const int k = n ? n[r] : 0;
        const bool sums = lse && lse[r];
        float* mx = out_max ? out_max + r : nullptr;
        int64_t* at = out_max ? out_index + r : nullptr;
        float* vals = k ? out_vals + (int64_t)r * top_stride : nullptr;
        int64_t* idx = k ? out_idx + (int64_t)r * top_stride : nullptr;
        const float tr = t ? t[r] : 1.0f;
        const bool unit = kShortcuts && tr == 1.0f;
        if (k && sums && unit) scan_row<L, true, true, true>(row, vocab, tr, k, mx, at, out_lse + r, vals, idx);
        else if (k && sums) scan_row<L, true, true, false>(row, vocab, tr, k, mx, at, out_lse + r, vals, idx);
        else if (k) scan_row<L, true, false, false>(row, vocab, tr, k, mx, at, nullptr, vals, idx);
        else if (sums && unit) scan_row<L, false, true, true>(row, vocab, tr, 0, mx, at, out_lse + r, nullptr, nullptr);
        else if (sums) scan_row<L, false, true, false>(row, vocab, tr, 0, mx, at, out_lse + r, nullptr, nullptr);
        else scan_row<L, false, false, false>(row, vocab, tr, 0, mx, at, nullptr, nullptr, nullptr);
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

// row_scan after checking the arguments: 1 for a negative count, an empty vocabulary or a top-n wider
// than the vocabulary or its output row, else 0.
template <class T>
static int checked_row_scan(const typename T::T* logits, int64_t row_stride, int rows, int vocab, const float* t,
                            const int* n, const uint8_t* lse, int top_stride, float* out_max, int64_t* out_index,
                            float* out_lse, float* out_vals, int64_t* out_idx, int threads) {
    if (rows < 0 || vocab < 1 || top_stride < 0) return 1;
    for (int r = 0; n && r < rows; ++r)
        if (n[r] < 0 || n[r] > vocab || n[r] > top_stride) return 1;
    row_scan<T>(logits, row_stride, rows, vocab, t, n, lse, top_stride, out_max, out_index, out_lse, out_vals,
                out_idx, threads);
    return 0;
}

extern "C" {
int lm_row_scan_f32(const float* logits, int64_t row_stride, int rows, int vocab, const float* t, const int* n,
                    const uint8_t* lse, int top_stride, float* out_max, int64_t* out_index, float* out_lse,
                    float* out_vals, int64_t* out_idx, int threads) {
    return checked_row_scan<F32>(logits, row_stride, rows, vocab, t, n, lse, top_stride, out_max, out_index, out_lse,
                                 out_vals, out_idx, threads);
}

int lm_row_scan_bf16(const uint16_t* logits, int64_t row_stride, int rows, int vocab, const float* t, const int* n,
                     const uint8_t* lse, int top_stride, float* out_max, int64_t* out_index, float* out_lse,
                     float* out_vals, int64_t* out_idx, int threads) {
    return checked_row_scan<BF16>(logits, row_stride, rows, vocab, t, n, lse, top_stride, out_max, out_index, out_lse,
                                  out_vals, out_idx, threads);
}

// masked_max_row for n rows: row rows[i] of logits under bitmask row i (bits + i * words), into out_max[i] /
// out_index[i]; 1 for a negative count or width or an empty vocabulary, else 0.
int lm_masked_row_max_f32(const float* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits, int n,
                          int words, int vocab, float* out_max, int64_t* out_index, int threads) {
    if (n < 0 || words < 0 || vocab < 1) return 1;
    for_rows(n, vocab / 8, threads, [=](int i) {
        masked_max_row<F32>(logits + rows[i] * row_stride, bits + (int64_t)i * words, words, vocab, out_max + i,
                            out_index + i);
    });
    return 0;
}

int lm_masked_row_max_bf16(const uint16_t* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits,
                           int n, int words, int vocab, float* out_max, int64_t* out_index, int threads) {
    if (n < 0 || words < 0 || vocab < 1) return 1;
    for_rows(n, vocab / 8, threads, [=](int i) {
        masked_max_row<BF16>(logits + rows[i] * row_stride, bits + (int64_t)i * words, words, vocab, out_max + i,
                             out_index + i);
    });
    return 0;
}

int64_t lm_row_draw_f32(const float* row, int vocab, float t, float lse, double u) {
    return vocab < 1 ? -1 : row_draw<F32>(row, vocab, t, lse, u);
}
}
