// Decode attention on CPU: every decoding row of a step, one call per layer.
//
// Row b has one new token: its k/v go to cache slot slots[b] at position pos[b], then its query
// heads attend to keys 0..pos[b] of that slot. Work is split over (row, kv head) pairs, and each
// pair is computed by the same fixed sequence of operations whatever the batch around it, so a
// row's output is bitwise the same alone or in any batch (batch invariance by construction):
//   - a score is a dot product over the head dimension in 16-lane chunks, summed by one fixed
//     lane tree (16 keys at a time, each key reduced within its own lanes);
//   - the softmax sum runs over blocks of 16 keys from key 0 (the block pattern depends only on
//     the row's own length), then the same lane tree;
//   - the output accumulates p_j * v_j in key order, vectorised over the head dimension.
// Arithmetic is float32 whatever the cache dtype (float32 or bfloat16).
//
// Built by native.py with the machine's own instruction set (-march=native), wrapped by
// decode_attention.py; no torch headers. OpenMP resolves to the runtime torch has already loaded.

#include <algorithm>
#include <vector>

#include "native_common.h"

static const int MAX_CHUNKS = 16;  // head_dim <= 256
static const int MAX_GROUP = 16;   // query heads per kv head

// 16 vectors (one per key) -> one vector of their 16 lane sums, key l in lane l. Every round adds
// lanes of the same key only, so a key's sum does not depend on the keys beside it.
static inline v16f lane_sums(const v16f a[16]) {
    v16f r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; ++i)
        r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

template <class L>
static void attend_pair(const typename L::T* q, const typename L::T* K, const typename L::T* V, int n, int G,
                        int d, float scale, typename L::T* out, std::vector<float>& work) {
    typedef typename L::T T;
    const int C = d / 16;
    const int blocks = (n + 15) / 16;
    work.resize((size_t)G * blocks * 16);
    float* scores = work.data();  // [G, blocks * 16]
    const size_t stride = (size_t)blocks * 16;

    v16f qv[MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) qv[g][c] = L::load(q + (size_t)g * d + 16 * c);

    v16f acc[MAX_GROUP][16];
    v16f kc[MAX_CHUNKS];
    for (int blk = 0; blk < blocks; ++blk) {
        const int j0 = blk * 16, m = std::min(16, n - j0);
        for (int l = 0; l < 16; ++l) {
            if (l >= m) {
                for (int g = 0; g < G; ++g) acc[g][l] = v16f{};
                continue;
            }
            const T* k = K + (size_t)(j0 + l) * d;
            for (int c = 0; c < C; ++c) kc[c] = L::load(k + 16 * c);
            for (int g = 0; g < G; ++g) {
                v16f a = qv[g][0] * kc[0];
                for (int c = 1; c < C; ++c) a = a + qv[g][c] * kc[c];
                acc[g][l] = a;
            }
        }
        for (int g = 0; g < G; ++g) {
            v16f s = lane_sums(acc[g]) * scale;
            memcpy(scores + g * stride + j0, &s, sizeof s);
        }
    }

    float inv[MAX_GROUP];
    for (int g = 0; g < G; ++g) {
        float* s = scores + g * stride;
        float mx = s[0];
        for (int j = 1; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
        v16f sum = v16f{};
        for (int blk = 0; blk < blocks; ++blk) {
            v16f x;
            memcpy(&x, s + blk * 16, sizeof x);
            v16f p = exp_clamped(x - mx);
            const int m = std::min(16, n - blk * 16);
            for (int l = m; l < 16; ++l) p[l] = 0.0f;
            memcpy(s + blk * 16, &p, sizeof p);
            sum = sum + p;
        }
        inv[g] = 1.0f / total(sum);
    }

    v16f o[MAX_GROUP][MAX_CHUNKS];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) o[g][c] = v16f{};
    for (int j = 0; j < n; ++j) {
        const T* v = V + (size_t)j * d;
        for (int c = 0; c < C; ++c) kc[c] = L::load(v + 16 * c);
        for (int g = 0; g < G; ++g) {
            const float p = scores[g * stride + j];
            for (int c = 0; c < C; ++c) o[g][c] = o[g][c] + p * kc[c];
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) L::store(out + (size_t)g * d + 16 * c, o[g][c] * inv[g]);
}

template <class L>
static void decode(const void* q_, int64_t q_row, const void* k_, int64_t k_row, const void* v_, int64_t v_row,
                   void* kc_, void* vc_, const int64_t* slots, const int64_t* pos, void* out_, int B, int H, int Hkv,
                   int d, int64_t max_len, float scale, int threads) {
    typedef typename L::T T;
    const T* q = (const T*)q_;
    const T* k_new = (const T*)k_;
    const T* v_new = (const T*)v_;
    T* k_cache = (T*)kc_;
    T* v_cache = (T*)vc_;
    T* out = (T*)out_;
    const int G = H / Hkv;
    const int tasks = B * Hkv;
    int64_t keys = 0;
    for (int b = 0; b < B; ++b) keys += pos[b] + 1;
    const bool parallel = threads > 1 && tasks > 1 && keys * Hkv * G * d >= (1 << 16);
#pragma omp parallel num_threads(threads) if (parallel)
    {
        std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; ++t) {
            const int b = t / Hkv, h = t % Hkv;
            const size_t base = (((size_t)slots[b] * Hkv + h) * max_len) * d;
            memcpy(k_cache + base + (size_t)pos[b] * d, k_new + b * k_row + (size_t)h * d, d * sizeof(T));
            memcpy(v_cache + base + (size_t)pos[b] * d, v_new + b * v_row + (size_t)h * d, d * sizeof(T));
            attend_pair<L>(q + b * q_row + (size_t)h * G * d, k_cache + base, v_cache + base, (int)pos[b] + 1, G, d,
                           scale, out + ((size_t)b * H + (size_t)h * G) * d, work);
        }
    }
}

// 0: done; 1: a shape the kernel does not take; 2: a row's slot or position outside the cache
// (nothing is written then: a bookkeeping error upstream must not become a stray write).
extern "C" int lm_decode_attention(int bf16, const void* q, int64_t q_row, const void* k, int64_t k_row,
                                   const void* v, int64_t v_row, void* k_cache, void* v_cache, const int64_t* slots,
                                   const int64_t* pos, void* out, int B, int H, int Hkv, int d, int64_t num_slots,
                                   int64_t max_len, float scale, int threads) {
    if (d % 16 != 0 || d / 16 > MAX_CHUNKS || Hkv <= 0 || H % Hkv != 0 || H / Hkv > MAX_GROUP) return 1;
    for (int b = 0; b < B; ++b)
        if (slots[b] < 0 || slots[b] >= num_slots || pos[b] < 0 || pos[b] >= max_len) return 2;
    if (bf16)
        decode<BF16>(q, q_row, k, k_row, v, v_row, k_cache, v_cache, slots, pos, out, B, H, Hkv, d, max_len, scale,
                     threads);
    else
        decode<F32>(q, q_row, k, k_row, v, v_row, k_cache, v_cache, slots, pos, out, B, H, Hkv, d, max_len, scale,
                    threads);
    return 0;
}
