// Elementwise work between a decoder layer's matrix multiplies, fused per row, for bfloat16
// activations on CPU: each function replaces a chain of small torch ops (and their dispatch and
// temporaries, which dominate at one or a few rows) with one pass. Each keeps the chain's
// bfloat16 rounding points, so results match the torch ops up to float32 summation order, and
// rows are computed independently of each other (batch-invariant by construction).
//
//   add_rmsnorm: s = x + residual (rounded), then s normed in a family's style (norm_style below)
//   rope:        rotate-half RoPE of the q|k heads of a fused q|k|v row, into a packed output, each
//                head first RMS-normed by its own weights where the family norms q and k (Qwen3, Gemma 3)
//   act_mul:     act(gate) * up from a fused gate|up row, act SiLU or GELU (tanh approximation)

#include <math.h>

#include "native_common.h"

// The norm styles (config.norm_style), as llama.RMSNorm computes them from n = s / rms(s) in float32:
//   0 (Llama): weight * round(n), rounded (HF's Llama order: cast, then scale in bfloat16)
//   1 (Gemma): round(n * (1 + weight)), the scale in float32 (HF's Gemma 3 order)
static inline float inv_rms(v16f sum_squares, int n, float eps) {
    return 1.0f / sqrtf(total(sum_squares) / (float)n + eps);
}

static inline void scale_row(const uint16_t* s, float inv, const uint16_t* weight, int style, uint16_t* out, int n) {
    for (int i = 0; i < n; i += 16) {
        const v16f x = BF16::load(s + i) * inv, w = BF16::load(weight + i);
        BF16::store(out + i, style ? x * (w + 1.0f) : round_bf16(x) * w);
    }
}

// x, residual (may be null), sum_out (written when residual is given), weight, out: rows x D
// bfloat16, rows packed; D a multiple of 16; norm_style 0 or 1 (above). out may be x (in place).
extern "C" int lm_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* residual, uint16_t* sum_out,
                                   const uint16_t* weight, uint16_t* out, int rows, int D, float eps, int norm_style,
                                   int threads) {
    if (D % 16 != 0) return 1;
    for_rows(rows, D, threads, [=](int r) {
        const size_t base = (size_t)r * D;
        v16f acc = v16f{};
        for (int i = 0; i < D; i += 16) {
            v16f v = BF16::load(x + base + i);
            if (residual) {
                v = round_bf16(v + BF16::load(residual + base + i));
                BF16::store(sum_out + base + i, v);
            }
            acc = acc + v * v;
        }
        scale_row(residual ? sum_out + base : x + base, inv_rms(acc, D, eps), weight, norm_style, out + base, D);
    });
    return 0;
}

// qkv: rows of `row_stride` elements whose first `heads` heads of d (q then k) are rotated;
// cos, sin_signed: rows x d (sin_signed = [-sin | sin]); out: rows x heads x d packed.
// out = round(x * cos) + rotate_half(x) * sin_signed, rounded once more (torch's mul, addcmul).
// q_norm, k_norm: null, or [d] weights each head is RMS-normed by first (heads 0 .. q_heads - 1 by
// q_norm, the rest by k_norm) in norm_style, rounded as its own op is, before the rotation reads it
// (d up to MAX_D then: the normed head is held on the stack).
extern "C" int lm_rope_bf16(const uint16_t* qkv, int64_t row_stride, const uint16_t* cos, const uint16_t* sin_signed,
                            const uint16_t* q_norm, const uint16_t* k_norm, int q_heads, float eps, int norm_style,
                            uint16_t* out, int rows, int heads, int d, int threads) {
    const int MAX_D = 512;
    if (d % 32 != 0 || (q_norm && d > MAX_D)) return 1;
    const int half = d / 2;
    for_rows(rows, (int64_t)heads * d, threads, [=](int r) {
        const uint16_t* c = cos + (size_t)r * d;
        const uint16_t* sn = sin_signed + (size_t)r * d;
        uint16_t normed[MAX_D];
        for (int h = 0; h < heads; ++h) {
            const uint16_t* x = qkv + r * row_stride + (size_t)h * d;
            uint16_t* o = out + ((size_t)r * heads + h) * d;
            if (q_norm) {
                v16f acc = v16f{};
                for (int i = 0; i < d; i += 16) {
                    const v16f v = BF16::load(x + i);
                    acc = acc + v * v;
                }
                scale_row(x, inv_rms(acc, d, eps), h < q_heads ? q_norm : k_norm, norm_style, normed, d);
                x = normed;
            }
            for (int i = 0; i < d; i += 16) {
                const int partner = i < half ? i + half : i - half;  // rotate_half: [x2 | x1]
                v16f t = round_bf16(BF16::load(x + i) * BF16::load(c + i));
                BF16::store(o + i, t + BF16::load(x + partner) * BF16::load(sn + i));
            }
        }
    });
    return 0;
}

// The gated MLP's activations (config.hidden_act): 0 SiLU, x / (1 + e^-x); 1 GELU with the tanh
// approximation, x (1 + tanh(y)) / 2 for y = sqrt(2 / pi) (x + 0.044715 x^3), its tanh as
// 1 - 2 / (e^2y + 1) (exactly -1 far below 0, as torch's, so the product there is 0, not a tiny value)
static inline v16f activation(v16f x, int act) {
    if (act == 0) return x / (1.0f + exp_clamped(v16f{} - x));
    const v16f y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const v16f tanh_y = 1.0f - 2.0f / (exp_clamped(y + y) + 1.0f);
    return 0.5f * x * (1.0f + tanh_y);
}

// gate_up: rows x 2I (gate | up); out: rows x I = round(act(gate)) * up, rounded; act 0 or 1 (above).
extern "C" int lm_act_mul_bf16(const uint16_t* gate_up, uint16_t* out, int rows, int I, int act, int threads) {
    if (I % 16 != 0 || act < 0 || act > 1) return 1;
    for_rows(rows, I, threads, [=](int r) {
        const uint16_t* g = gate_up + (size_t)r * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + (size_t)r * I;
        for (int i = 0; i < I; i += 16)
            BF16::store(o + i, round_bf16(activation(BF16::load(g + i), act)) * BF16::load(u + i));
    });
    return 0;
}
