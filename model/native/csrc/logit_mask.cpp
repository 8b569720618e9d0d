// Constrained decoding's mask applied to logits in place, on CPU: every id a row's bitmask does not
// allow becomes -inf. One pass over each masked row, skipping words whose 32 ids are all allowed;
// the torch path (unpacking the bits to a [rows, vocab] bool tensor, then a masked copy) takes
// several passes and temporaries and cost ~5 ms a step at 32 constrained rows on a 2-core Xeon.
//
//   logits: float32 or bfloat16 (a 16-bit pattern) rows of `row_stride` elements, `vocab` wide;
//   rows: the n logits rows to mask; bits: n x words uint32, bit t % 32 of word t / 32 allows id t
//   (ids at or past 32 * words are never allowed).

#include "native_common.h"

// The 32 ids of one word whose bits are clear become neg: two masked 16-lane stores under AVX-512 (a grammar
// allows few of a large vocabulary's ids: at Gemma 3's 262,144, id by id cost ~0.3 ms a row), else id by id.
static inline void clear_word(float* at, uint32_t word, float neg) {
#ifdef __AVX512F__
    const __m512 v = _mm512_set1_ps(neg);
    _mm512_mask_storeu_ps(at, (__mmask16)~word, v);
    _mm512_mask_storeu_ps(at + 16, (__mmask16)(~word >> 16), v);
#else
    for (int j = 0; j < 32; ++j)
        if (!((word >> j) & 1u)) at[j] = neg;
#endif
}

static inline void clear_word(uint16_t* at, uint32_t word, uint16_t neg) {
#ifdef __AVX512BW__
    _mm512_mask_storeu_epi16(at, (__mmask32)~word, _mm512_set1_epi16((short)neg));
#else
    for (int j = 0; j < 32; ++j)
        if (!((word >> j) & 1u)) at[j] = neg;
#endif
}

template <class T>
static void mask_rows(T* logits, int64_t row_stride, const int64_t* rows, const uint32_t* bits, int n, int words,
                      int vocab, T neg, int threads) {
    for_rows(n, vocab, threads, [=](int i) {
        T* row = logits + rows[i] * row_stride;
        const uint32_t* b = bits + (int64_t)i * words;
        int id = 0;
        for (int w = 0; w < words && id + 32 <= vocab; ++w, id += 32) {
            const uint32_t word = b[w];
            if (word != 0xffffffffu) clear_word(row + id, word, neg);
        }
        if (id < vocab && id / 32 < words) {  // a last, partial word
            const uint32_t word = b[id / 32];
            for (int j = 0; id + j < vocab; ++j)
                if (!((word >> j) & 1u)) row[id + j] = neg;
            id = vocab;
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
