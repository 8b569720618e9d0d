// Every decoder layer of a serving step in one call: bfloat16 activations on CPU, each layer's four
// linears on the native quantized kernel (quant_matmul.cpp), attention on the prompt and decode
// kernels (prompt_attention.cpp, decode_attention.cpp), norms, RoPE and the gated activation fused
// (fused_ops.cpp).
//
// It composes the same entry points the eager layers call one by one from Python, with the same
// arguments and in the same order, so its rows are bitwise the eager step's (and batch-invariant
// for the same reasons); what it removes is the ~60 Python and torch dispatches a layer costs
// between them. Two rewrites, same arithmetic:
//   - a layer's last residual add x + down is done by the next layer's add_rmsnorm (x + y rounded
//     once either way), the last layer's by a plain rounded add;
//   - the prompt tokens of several prompt segments (different sequences, so different slots) are
//     written and attended in one call instead of one per segment: each token's attention reads only
//     its own slot's keys and is computed the same in any grouping (prompt_attention.cpp).
//
// It computes a layer description, not one family's layer: each StepLayer says which norms the layer
// has (the attention and MLP outputs normed before their residual adds: Gemma 3's sandwich; each q and
// k head normed: Qwen3, Gemma 3), its window and which RoPE table it takes; StepShape the model's norm
// style (w or 1 + w) and activation (SiLU or GELU-tanh); StepEnds the embedding scale.
//
// A step's N tokens: P prompt tokens first (continued chunks and new prompts), then N - P decode rows
// (a verified draft's rows among them). Per layer (the [bracketed] steps where the layer has them):
//   h = norm(x)                     (layer 0; later layers: x = x + down, h = norm(x), one pass)
//   qkv = h Wqkv^T; q|k = rope([q/k norm] qkv) by the layer's table
//   prompt tokens: k/v written to the cache, then each attends over its slot's keys 0..pos (a sliding
//     layer: keys pos - window + 1 .. pos, each token as a decode row)
//   decode rows: written and attended by the decode kernel (all written first when rows share a slot)
//   o = attn Wo^T, [o = norm(o)]; x = x + o, h = norm(x)
//   down = act_mul(h Wgu^T) Wdown^T, [down = norm(down)]
// and the last layer's x = x + down is left in x.

#include <stdint.h>
#include <string.h>

#include <chrono>
#include <vector>

#include "gguf_blocks.h"
#include "native_common.h"

extern "C" int lm_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* residual, uint16_t* sum_out,
                                   const uint16_t* weight, uint16_t* out, int rows, int D, float eps, int norm_style,
                                   int threads);
extern "C" int lm_rope_bf16(const uint16_t* qkv, int64_t row_stride, const uint16_t* cos, const uint16_t* sin_signed,
                            const uint16_t* q_norm, const uint16_t* k_norm, int q_heads, float eps, int norm_style,
                            uint16_t* out, int rows, int heads, int d, int threads);
extern "C" int lm_act_mul_bf16(const uint16_t* gate_up, uint16_t* out, int rows, int I, int act, int threads);
extern "C" int lm_qmm(int bits, int precise, const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, void* y, int y_bf16, int threads);
extern "C" int lm_decode_attention(int bf16, const void* q, int64_t q_row, const void* k, int64_t k_row,
                                   const void* v, int64_t v_row, void* k_cache, void* v_cache, float* k_scales,
                                   float* v_scales, const int64_t* slots, const int64_t* pos, void* out, int B, int H,
                                   int Hkv, int d, int64_t num_slots, int64_t max_len, float scale, int64_t window,
                                   int threads);
extern "C" int lm_prompt_attention(int bf16, const void* q, int64_t q_row, const void* k_cache, const void* v_cache,
                                   const float* k_scales, const float* v_scales, const int64_t* slots,
                                   const int64_t* pos, void* out, int T, int H, int Hkv, int d, int64_t num_slots,
                                   int64_t max_len, float scale, int threads);

struct StepLinear {  // one packed weight of quant_matmul.cpp's layout
    const uint8_t* packed;
    int32_t bits;     // 4 or 8
    int32_t precise;  // activations as two int8 codes
};

struct StepLora {  // one fused linear's LoRA adapters (linear/lora.py's LoraSlots); null A: none
    const uint16_t* A;           // [slots, M * R, K]: its modules' A stacked along the rank
    const uint16_t* B[3];        // per module [slots, R, out] (B transposed)
    const uint16_t* scaling[3];  // per module [slots]
    int32_t lo[3], out[3];       // each module's columns [lo, lo + out) of the fused output
    int32_t M, R;                // modules, rank of every slot (zeros past an adapter's own)
};

struct StepLayer {
    StepLinear qkv, o, gate_up, down;
    const uint16_t* input_norm;     // [D] the attention's input
    const uint16_t* attn_out_norm;  // [D] the attention's output, before its residual add; null: none
    const uint16_t* mlp_norm;       // [D] the MLP's input
    const uint16_t* mlp_out_norm;   // [D] the MLP's output, before its residual add; null: none
    const uint16_t* q_norm;         // [d] each query head's, before RoPE; null: none (then k_norm too)
    const uint16_t* k_norm;         // [d] each key head's
    void* k_cache;               // this layer's [slots, Hkv, max_len, d]: bfloat16, or int8 codes
    void* v_cache;
    float* k_scales;             // the int8 cache's scales ([slots, max_len, 2, Hkv]; V = K + Hkv); null for bfloat16
    float* v_scales;
    int64_t window;              // 0, or a sliding layer's window: its prompt tokens take the decode kernel too
    int64_t rope;                // which of the step's RoPE tables: 0 the global one, 1 the sliding layers' own
    StepLora lora[4];            // qkv, o, gate_up, down
};

struct StepShape {
    int32_t layers, D, H, Hkv, d, I;
    float eps, scale;
    int32_t norm_style;  // every norm's (fused_ops.cpp): 0 w * round(n) (Llama), 1 round(n * (1 + w)) (Gemma)
    int32_t act;         // the gated MLP's activation: 0 SiLU, 1 GELU-tanh
    int64_t num_slots, max_len;
};

static inline int qmm(const StepLinear& w, const uint16_t* x, int B, int64_t K, int64_t N, uint16_t* y, int threads) {
    return lm_qmm(w.bits, w.precise, x, 1, B, K, w.packed, N, y, 1, threads);
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch stores a bfloat16
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((w >> 16) | 0x40u);
    return (uint16_t)((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
}

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8w __attribute__((vector_size(32)));

static inline v8f bf16x8(const uint16_t* p) {  // 8 bfloat16 widened, exactly
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8w w = __builtin_convertvector(h, v8w) << 16;
    v8f r;
    memcpy(&r, &w, sizeof r);
    return r;
}

static inline v16f joined(v8f lo, v8f hi) {  // lanes 0-7, then 8-15
    v16f r;
    memcpy(&r, &lo, sizeof lo);
    memcpy((char*)&r + sizeof lo, &hi, sizeof hi);
    return r;
}

// y [N, y_n] += each row's adapter product for rows with an adapter slot (lora_rows[t] >= 0), with the
// rounding points of LoraSlots.add's bfloat16 torch ops: t = round(x A^T), d = round(t B^T),
// round(d * scaling), then y = round(y + that). A row's sums run over K and R in one fixed order
// whatever the other rows: batch-invariant by construction. Both products run 16 lanes at a time: A's
// rows four at a time over x (each a fixed tree at the end), B (held transposed) 16 outputs at a time,
// each output's sum over the rank in order, with its roundings, scaling and add to y in the same vector.
static int lora_add(const StepLora& L, const int64_t* lora_rows, const uint16_t* x, int N, int64_t K, uint16_t* y,
                    int64_t y_n, int threads) {
    if (!L.A || !lora_rows) return 0;
    const int MR = L.M * L.R;
    if (MR > 3 * 256 || K % 16) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < N; ++t) {
        const int64_t slot = lora_rows[t];
        if (slot < 0) continue;
        float low[3 * 256];
        const uint16_t* xt = x + (size_t)t * K;
        const uint16_t* A = L.A + (size_t)slot * MR * K;
        int j = 0;
        for (; j + 4 <= MR; j += 4) {  // four of A's rows per pass over x (x loaded once for them), in 8-lane
            const uint16_t* a = A + (size_t)j * K;  // halves that GCC keeps in registers under AVX2
            v8f c[4][2] = {};
            for (int64_t k = 0; k < K; k += 16) {
                const v8f x0 = bf16x8(xt + k), x1 = bf16x8(xt + k + 8);
                for (int i = 0; i < 4; ++i) {
                    c[i][0] += x0 * bf16x8(a + i * K + k);
                    c[i][1] += x1 * bf16x8(a + i * K + k + 8);
                }
            }
            for (int i = 0; i < 4; ++i) low[j + i] = bf16_to_f32(f32_to_bf16(total(joined(c[i][0], c[i][1]))));
        }
        for (; j < MR; ++j) {
            const uint16_t* a = A + (size_t)j * K;
            v8f c0 = {}, c1 = {};
            for (int64_t k = 0; k < K; k += 16) {
                c0 += bf16x8(xt + k) * bf16x8(a + k);
                c1 += bf16x8(xt + k + 8) * bf16x8(a + k + 8);
            }
            low[j] = bf16_to_f32(f32_to_bf16(total(joined(c0, c1))));
        }
        for (int m = 0; m < L.M; ++m) {
            const float* lm = low + m * L.R;
            const int64_t out = L.out[m];
            const uint16_t* B = L.B[m] + (size_t)slot * L.R * out;
            const float scale = bf16_to_f32(L.scaling[m][slot]);
            uint16_t* yt = y + (size_t)t * y_n + L.lo[m];
            int64_t o = 0;
            for (; o + 16 <= out; o += 16) {  // two 8-lane halves: GCC keeps them in registers under AVX2
                v8f lo = {}, hi = {};
                for (int r = 0; r < L.R; ++r) {
                    const uint16_t* b = B + (size_t)r * out + o;
                    lo += lm[r] * bf16x8(b);
                    hi += lm[r] * bf16x8(b + 8);
                }
                const v16f d = round_bf16(round_bf16(joined(lo, hi)) * scale);
                BF16::store(yt + o, BF16::load(yt + o) + d);
            }
            for (; o < out; ++o) {  // a width that is not a multiple of 16: the same sums, one output at a time
                float sum = 0.0f;
                for (int r = 0; r < L.R; ++r) sum += lm[r] * bf16_to_f32(B[(size_t)r * out + o]);
                const float d = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(sum)) * scale));
                yt[o] = f32_to_bf16(bf16_to_f32(yt[o]) + d);
            }
        }
    }
    return 0;
}

static inline int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// token t's new k (rotated) and v into the layer's cache at (slots[t], pos[t])
static inline void write_kv(const StepLayer& L, const StepShape* s, const uint16_t* qk, const uint16_t* qkv, int t,
                            const int64_t* slots, const int64_t* pos) {
    const int H = s->H, Hkv = s->Hkv, d = s->d;
    const int64_t qk_n = (int64_t)(H + Hkv) * d, qkv_n = (int64_t)(H + 2 * Hkv) * d;
    for (int g = 0; g < Hkv; ++g) {
        const size_t at = (((size_t)slots[t] * Hkv + g) * s->max_len + pos[t]) * d;
        const uint16_t* k = qk + t * qk_n + (size_t)(H + g) * d;
        const uint16_t* v = qkv + t * qkv_n + (size_t)(H + Hkv + g) * d;
        if (L.k_scales) {  // scales [slots, max_len, 2, Hkv]
            const size_t sc = ((size_t)slots[t] * s->max_len + pos[t]) * 2 * Hkv + g;
            quantize_kv_row(k, d, (int8_t*)L.k_cache + at, L.k_scales + sc);
            quantize_kv_row(v, d, (int8_t*)L.v_cache + at, L.v_scales + sc);
        } else {
            memcpy((uint16_t*)L.k_cache + at, k, d * sizeof(uint16_t));
            memcpy((uint16_t*)L.v_cache + at, v, d * sizeof(uint16_t));
        }
    }
}

extern "C" {

// x: [N, D] bfloat16, the embedded tokens in, the last layer's output out. cos, sin_signed: [tables,
// N, d], each token's row of each RoPE table (the global one; then the sliding layers' own where the
// model has one: StepLayer.rope). slots, pos: [N]. Tokens 0..P-1 are prompt tokens, the rest decode
// rows; write_first: decode rows share a slot, so every row's k/v is written before any row attends.
// phase_ns: null, or 3 counters the call adds its nanoseconds to (linears, attention with its cache
// writes, everything else). Returns 0; 2 when a token's slot or position lies outside the cache
// (checked first: nothing is written then); else the first nonzero code of a kernel (1: a shape it
// does not take), having stopped there.
int lm_step_layers(const StepLayer* layers, const StepShape* s, uint16_t* x, const uint16_t* cos,
                   const uint16_t* sin_signed, const int64_t* slots, const int64_t* pos, int N, int P, int write_first,
                   int threads, int64_t* phase_ns, const int64_t* lora_rows) {
    const int D = s->D, H = s->H, Hkv = s->Hkv, d = s->d, I = s->I, B = N - P, style = s->norm_style;
    const int64_t qkv_n = (int64_t)(H + 2 * Hkv) * d, qk_n = (int64_t)(H + Hkv) * d;
    const float eps = s->eps;
    if (P < 0 || B < 0) return 1;
    for (int t = 0; t < N; ++t)
        if (slots[t] < 0 || slots[t] >= s->num_slots || pos[t] < 0 || pos[t] >= s->max_len) return 2;
    static thread_local std::vector<uint16_t> work;
    const size_t need = (size_t)N * (D + qkv_n + qk_n + H * d + D + 2 * I + I + D);
    if (work.size() < need) work.resize(need);
    uint16_t* h = work.data();               // [N, D] normed input of a linear
    uint16_t* qkv = h + (size_t)N * D;       // [N, qkv_n]
    uint16_t* qk = qkv + (size_t)N * qkv_n;  // [N, qk_n] rotated q | k
    uint16_t* attn = qk + (size_t)N * qk_n;  // [N, H d]
    uint16_t* o = attn + (size_t)N * H * d;  // [N, D]
    uint16_t* gate_up = o + (size_t)N * D;   // [N, 2I]
    uint16_t* act = gate_up + (size_t)N * 2 * I;  // [N, I]
    uint16_t* down = act + (size_t)N * I;    // [N, D]
    int rc = 0;
    int64_t t0 = phase_ns ? now_ns() : 0;
    // the call, then (when timing) its time added to phase p: 0 linears, 1 attention, 2 the rest
#define STEP(p, call)                          \
    do {                                       \
        if ((rc = (call)) != 0) return rc;     \
        if (phase_ns) {                        \
            const int64_t t1 = now_ns();       \
            phase_ns[p] += t1 - t0;            \
            t0 = t1;                           \
        }                                      \
    } while (0)
    for (int l = 0; l < s->layers; ++l) {
        const StepLayer& L = layers[l];
        const size_t table = (size_t)L.rope * N * d;
        if (l == 0)
            STEP(2, lm_add_rmsnorm_bf16(x, nullptr, nullptr, L.input_norm, h, N, D, eps, style, threads));
        else
            STEP(2, lm_add_rmsnorm_bf16(down, x, x, L.input_norm, h, N, D, eps, style, threads));
        STEP(0, qmm(L.qkv, h, N, D, qkv_n, qkv, threads));
        STEP(0, lora_add(L.lora[0], lora_rows, h, N, D, qkv, qkv_n, threads));
        STEP(2, lm_rope_bf16(qkv, qkv_n, cos + table, sin_signed + table, L.q_norm, L.k_norm, H, eps, style, qk, N,
                             H + Hkv, d, threads));
        for (int t = 0; t < P; ++t) write_kv(L, s, qk, qkv, t, slots, pos);
        for (int t = P; write_first && t < N; ++t) write_kv(L, s, qk, qkv, t, slots, pos);
        if (P > 0 && L.window > 0)  // each prompt token over its own window, as a decode row (its k/v rewritten as is)
            STEP(1, lm_decode_attention(1, qk, qk_n, qk + (size_t)H * d, qk_n, qkv + qk_n, qkv_n, L.k_cache, L.v_cache,
                                        L.k_scales, L.v_scales, slots, pos, attn, P, H, Hkv, d, s->num_slots,
                                        s->max_len, s->scale, L.window, threads));
        else if (P > 0)
            STEP(1, lm_prompt_attention(1, qk, qk_n, L.k_cache, L.v_cache, L.k_scales, L.v_scales, slots, pos, attn, P, H,
                                        Hkv, d, s->num_slots, s->max_len, s->scale, threads));
        if (B > 0)
            STEP(1, lm_decode_attention(1, qk + P * qk_n, qk_n, qk + P * qk_n + (size_t)H * d, qk_n,
                                        qkv + P * qkv_n + qk_n, qkv_n, L.k_cache, L.v_cache, L.k_scales, L.v_scales,
                                        slots + P, pos + P,
                                        attn + (size_t)P * H * d, B, H, Hkv, d, s->num_slots, s->max_len, s->scale,
                                        L.window, threads));
        STEP(0, qmm(L.o, attn, N, (int64_t)H * d, D, o, threads));
        STEP(0, lora_add(L.lora[1], lora_rows, attn, N, (int64_t)H * d, o, D, threads));
        if (L.attn_out_norm)  // in place
            STEP(2, lm_add_rmsnorm_bf16(o, nullptr, nullptr, L.attn_out_norm, o, N, D, eps, style, threads));
        STEP(2, lm_add_rmsnorm_bf16(o, x, x, L.mlp_norm, h, N, D, eps, style, threads));
        STEP(0, qmm(L.gate_up, h, N, D, 2 * I, gate_up, threads));
        STEP(0, lora_add(L.lora[2], lora_rows, h, N, D, gate_up, 2 * I, threads));
        STEP(2, lm_act_mul_bf16(gate_up, act, N, I, s->act, threads));
        STEP(0, qmm(L.down, act, N, I, D, down, threads));
        STEP(0, lora_add(L.lora[3], lora_rows, act, N, I, down, D, threads));
        if (L.mlp_out_norm)
            STEP(2, lm_add_rmsnorm_bf16(down, nullptr, nullptr, L.mlp_out_norm, down, N, D, eps, style, threads));
    }
#undef STEP
    for (size_t i = 0; i < (size_t)N * D; i += 16)  // the last residual add, rounded as torch's
        BF16::store(x + i, BF16::load(x + i) + BF16::load(down + i));
    if (phase_ns) phase_ns[2] += now_ns() - t0;
    return 0;
}

struct StepEnds {  // what a whole step needs beyond the layers
    const uint8_t* embed;        // [vocab, D] token embeddings: bfloat16, or rows of a GGML type's blocks
    int64_t vocab;
    int64_t embed_type;          // 0: bfloat16 rows; else the GGML type of the rows (gguf_blocks.h)
    int64_t embed_row_bytes;
    float embed_scale;           // the rows' factor, a bfloat16 value (Gemma: sqrt(D) rounded); 1: none
    int32_t tables;              // RoPE tables: 1, or 2 where the sliding layers have their own base
    const uint16_t* cos[2];      // [table_len, d] each table by position (Rotary.cos, sin_signed; cos_local, ...)
    const uint16_t* sin_signed[2];
    int64_t table_len;
    const uint16_t* final_norm;  // [D]
};

// Token t's embedding row into x [D]: a bfloat16 copy or a GGML row decoded, times the embedding
// scale rounded as torch's bfloat16 multiply (LlamaModel.scale_embeddings). False: a type it cannot decode.
static bool embed_row(const StepEnds* e, int64_t id, int D, uint16_t* x) {
    const uint8_t* row = e->embed + id * e->embed_row_bytes;
    if (e->embed_type == 0)
        memcpy(x, row, D * sizeof(uint16_t));
    else if (!gguf::row_to_bf16((int)e->embed_type, row, D, x))
        return false;
    if (e->embed_scale != 1.0f)
        for (int i = 0; i < D; i += 16) BF16::store(x + i, BF16::load(x + i) * e->embed_scale);
    return true;
}

// A whole step but the LM head: the tokens ids [N] embedded, their RoPE rows looked up at rope_pos
// [N], the layers (lm_step_layers, same slots, pos, P, write_first), then rows out_rows [n_out] of
// the last layer's output RMS-normed into out [n_out, D]. Gathers are copies and the norm is the
// same kernel the model's final norm calls, so `out` is bitwise what the layers' output gives
// through torch's embedding, indexing and that norm; what it removes is their ~0.4 ms of dispatch
// at batch 1. Returns lm_step_layers' codes; 3 when an id, a position or an output row is out of
// range (checked first: nothing is written then).
int lm_step_model(const StepLayer* layers, const StepShape* s, const StepEnds* e, const int64_t* ids,
                  const int64_t* rope_pos, const int64_t* slots, const int64_t* pos, int N, int P, int write_first,
                  const int64_t* out_rows, int n_out, uint16_t* out, int threads, int64_t* phase_ns,
                  const int64_t* lora_rows) {
    const int D = s->D, d = s->d, T = e->tables;
    if (N < 0 || n_out < 0 || T < 1 || T > 2) return 1;
    for (int t = 0; t < N; ++t)
        if (ids[t] < 0 || ids[t] >= e->vocab || rope_pos[t] < 0 || rope_pos[t] >= e->table_len) return 3;
    for (int j = 0; j < n_out; ++j)
        if (out_rows[j] < 0 || out_rows[j] >= N) return 3;
    const int64_t t0 = phase_ns ? now_ns() : 0;
    static thread_local std::vector<uint16_t> buf;
    const size_t need = (size_t)N * (D + 2 * T * d) + (size_t)n_out * D;
    if (buf.size() < need) buf.resize(need);
    uint16_t* x = buf.data();
    uint16_t* cos = x + (size_t)N * D;           // [T, N, d]
    uint16_t* sin = cos + (size_t)T * N * d;     // [T, N, d]
    uint16_t* picked = sin + (size_t)T * N * d;  // [n_out, D]
    for (int t = 0; t < N; ++t) {
        if (!embed_row(e, ids[t], D, x + (size_t)t * D)) return 1;
        for (int k = 0; k < T; ++k) {
            memcpy(cos + ((size_t)k * N + t) * d, e->cos[k] + rope_pos[t] * d, d * sizeof(uint16_t));
            memcpy(sin + ((size_t)k * N + t) * d, e->sin_signed[k] + rope_pos[t] * d, d * sizeof(uint16_t));
        }
    }
    if (phase_ns) phase_ns[2] += now_ns() - t0;
    int rc = lm_step_layers(layers, s, x, cos, sin, slots, pos, N, P, write_first, threads, phase_ns, lora_rows);
    if (rc) return rc;
    const int64_t t1 = phase_ns ? now_ns() : 0;
    for (int j = 0; j < n_out; ++j) memcpy(picked + (size_t)j * D, x + out_rows[j] * D, D * sizeof(uint16_t));
    rc = lm_add_rmsnorm_bf16(picked, nullptr, nullptr, e->final_norm, out, n_out, D, s->eps, s->norm_style, threads);
    if (phase_ns) phase_ns[2] += now_ns() - t1;
    return rc;
}
}
