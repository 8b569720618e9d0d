// Elementwise work between a decoder layer's matrix multiplies, fused per row, for bfloat16
// activations on CPU: each function replaces a chain of small torch ops (and their dispatch and
// temporaries, which dominate at one or a few rows) with one pass. Each keeps the chain's
// bfloat16 rounding points, so results match the torch ops up to float32 summation order, and
// rows are computed independently of each other (batch-invariant by construction).
//
//   add_rmsnorm: s = x + residual (rounded), y = weight * round(s / rms(s))  (HF's RMSNorm order)
//   rope:        rotate-half RoPE of the q|k heads of a fused q|k|v row, into a packed output
//   silu_mul:    silu(gate) * up from a fused gate|up row

#include <math.h>

#include "native_common.h"

// x, residual (may be null), sum_out (written when residual is given), weight, out: rows x D
// bfloat16, rows packed; D a multiple of 16.
extern "C" int lm_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* residual, uint16_t* sum_out,
                                   const uint16_t* weight, uint16_t* out, int rows, int D, float eps, int threads) {
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
        const float inv = 1.0f / sqrtf(total(acc) / (float)D + eps);
        const uint16_t* s = residual ? sum_out + base : x + base;
        for (int i = 0; i < D; i += 16)
            BF16::store(out + base + i, round_bf16(BF16::load(s + i) * inv) * BF16::load(weight + i));
    });
    return 0;
}

// qkv: rows of `row_stride` elements whose first `heads` heads of d (q then k) are rotated;
// cos, sin_signed: rows x d (sin_signed = [-sin | sin]); out: rows x heads x d packed.
// out = round(x * cos) + rotate_half(x) * sin_signed, rounded once more (torch's mul, addcmul).
extern "C" int lm_rope_bf16(const uint16_t* qkv, int64_t row_stride, const uint16_t* cos, const uint16_t* sin_signed,
                            uint16_t* out, int rows, int heads, int d, int threads) {
    if (d % 32 != 0) return 1;
    const int half = d / 2;
    for_rows(rows, (int64_t)heads * d, threads, [=](int r) {
        const uint16_t* c = cos + (size_t)r * d;
        const uint16_t* sn = sin_signed + (size_t)r * d;
        for (int h = 0; h < heads; ++h) {
            const uint16_t* x = qkv + r * row_stride + (size_t)h * d;
            uint16_t* o = out + ((size_t)r * heads + h) * d;
            for (int i = 0; i < d; i += 16) {
                const int partner = i < half ? i + half : i - half;  // rotate_half: [x2 | x1]
                v16f t = round_bf16(BF16::load(x + i) * BF16::load(c + i));
                BF16::store(o + i, t + BF16::load(x + partner) * BF16::load(sn + i));
            }
        }
    });
    return 0;
}

// gate_up: rows x 2I (gate | up); out: rows x I = round(silu(gate)) * up, rounded.
extern "C" int lm_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int rows, int I, int threads) {
    if (I % 16 != 0) return 1;
    for_rows(rows, I, threads, [=](int r) {
        const uint16_t* g = gate_up + (size_t)r * 2 * I;
        const uint16_t* u = g + I;
        uint16_t* o = out + (size_t)r * I;
        for (int i = 0; i < I; i += 16) {
            v16f x = BF16::load(g + i);
            v16f silu = round_bf16(x / (1.0f + exp_clamped(v16f{} - x)));
            BF16::store(o + i, silu * BF16::load(u + i));
        }
    });
    return 0;
}
