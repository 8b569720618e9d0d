// Constrained decoding's mask applied to logits in place, on CPU: every id a row's bitmask does not
// allow becomes -inf. One pass over each masked row, skipping words whose 32 ids are all allowed;
// the torch path (unpacking the bits to a [rows, vocab] bool tensor, then a masked copy) takes
// several passes and temporaries and cost ~5 ms a step at 32 constrained rows on a 2-core Xeon.
//
//   logits: float32 or bfloat16 (a 16-bit pattern) rows of `row_stride` elements, `vocab` wide;
//   rows: the n logits rows to mask; bits: n x words uint32, bit t % 32 of word t / 32 allows id t
//   (ids at or past 32 * words are never allowed).

#include "native_common.h"

template <class T>
static void mask_rows(T* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits, int n, int words,
                      int vocab, T neg, int threads) {
    for_rows(n, vocab, threads, [=](int i) {
        T* row = logits + rows[i] * row_stride;
        const uint32_t* b = bits + (int64_t)i * words;
        int id = 0;
        for (int w = 0; w < words && id < vocab; ++w, id += 32) {
            const uint32_t word = b[w];
            if (word == 0xffffffffu && id + 32 <= vocab) continue;
            const int end = vocab - id < 32 ? vocab - id : 32;
            for (int j = 0; j < end; ++j)
                if (!((word >> j) & 1u)) row[id + j] = neg;
        }
        for (; id < vocab; ++id) row[id] = neg;
    });
}

extern "C" int lm_mask_logits_f32(float* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits,
                                  int n, int words, int vocab, int threads) {
    mask_rows(logits, row_stride, rows, bits, n, words, vocab, -__builtin_inff(), threads);
    return 0;
}

extern "C" int lm_mask_logits_bf16(uint16_t* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits,
                                   int n, int words, int vocab, int threads) {
    mask_rows(logits, row_stride, rows, bits, n, words, vocab, (uint16_t)0xff80u, threads);  // bfloat16 -inf
    return 0;
}
