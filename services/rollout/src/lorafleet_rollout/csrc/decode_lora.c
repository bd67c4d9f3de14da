/* One decode step's LoRA for the torch engine: every row through its own adapter, in one
 * call per projection (an SGMV, as Punica and S-LoRA call it, for a CPU).
 *
 * Why C: in torch a mixed-adapter step is a gather of the rows, two batched matmuls over
 * equal chunks of rows and an index_add back, each a separate op with its own overhead; at
 * 16 rows over 8 adapters on the bench model LoRA cost ~3.3 ms of a ~18 ms step (this kernel:
 * ~1.9 ms, mostly streaming the stacks), for a few MFLOP of work. Here rows come grouped by slot, a slot's A and B are read once for all
 * its rows (they stay in cache between rows), and the expand only touches the output columns
 * that a rank column can reach (a fused projection's sub-projections own disjoint columns).
 *
 * Layout (float32, `lora.LoraStacks`):
 *   a       [slots, in, nr]: A^T of every slot, contiguous
 *   b       [slots, nr, width]: (scale * B)^T of every slot, contiguous; rank column k's row
 *           holds its output columns [col_lo[k], col_hi[k]) from column 0 (a fused
 *           projection's sub-projections own disjoint columns: no zero blocks stored)
 *   x       row r at x + r * x_stride, `in` floats
 *   out     row r at out + r * out_stride, `out` floats; the LoRA delta is added in place
 *   order   [n]: the rows to add to, grouped by slot (rows of other slots are left alone)
 *   slots   [n]: the slot of each entry of `order`
 *   col_lo, col_hi [nr]: rank column k adds to output columns [col_lo[k], col_hi[k])
 */
#include "kernels.h"
#include "vector.h"

/* Vectors (v8, vector.h) written out because GCC's auto-vectoriser turned the rank-sized
 * loops below into shuffles (~6 GFLOP/s). */

/* h[k] = sum_i x[i] * a[i * nr + k]: rank columns eight at a time, with four independent
 * partial sums over `in` (a rank-8 shrink is one vector wide, and a single FMA chain would
 * wait on each FMA's latency). */
static void shrink(const float *x, const float *a, int32_t in, int32_t nr, float *h) {
    int32_t k0 = 0;
    for (; k0 + 8 <= nr; k0 += 8) {
        v8 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
        int32_t i = 0;
        for (; i + 4 <= in; i += 4) {
            const float *ai = a + (int64_t)i * nr + k0;
            acc0 += x[i] * *(const v8_u *)ai;
            acc1 += x[i + 1] * *(const v8_u *)(ai + nr);
            acc2 += x[i + 2] * *(const v8_u *)(ai + 2 * nr);
            acc3 += x[i + 3] * *(const v8_u *)(ai + 3 * nr);
        }
        for (; i < in; i++) acc0 += x[i] * *(const v8_u *)(a + (int64_t)i * nr + k0);
        *(v8_u *)(h + k0) = (acc0 + acc1) + (acc2 + acc3);
    }
    for (; k0 < nr; k0++) {
        float dot = 0.0f;
        for (int32_t i = 0; i < in; i++) dot += x[i] * a[(int64_t)i * nr + k0];
        h[k0] = dot;
    }
}

/* y[lo..hi) += sum over the m (<= 4) rank columns k of h[k] * b[k * stride + lo..hi): four
 * columns per pass, so y is loaded and stored once per four. */
static void expand(float *y, const float *b, int64_t stride, const float *h, int32_t m,
                   int32_t lo, int32_t hi) {
    const float h0 = h[0], h1 = m > 1 ? h[1] : 0.0f, h2 = m > 2 ? h[2] : 0.0f;
    const float h3 = m > 3 ? h[3] : 0.0f;
    const float *b0 = b, *b1 = m > 1 ? b + stride : b, *b2 = m > 2 ? b + 2 * stride : b;
    const float *b3 = m > 3 ? b + 3 * stride : b;
    int32_t j = lo;
    for (; j + 8 <= hi; j += 8)
        *(v8_u *)(y + j) += (h0 * *(const v8_u *)(b0 + j) + h1 * *(const v8_u *)(b1 + j)) +
                            (h2 * *(const v8_u *)(b2 + j) + h3 * *(const v8_u *)(b3 + j));
    for (; j < hi; j++) y[j] += (h0 * b0[j] + h1 * b1[j]) + (h2 * b2[j] + h3 * b3[j]);
}

void decode_lora(const float *a, const float *b, int32_t in, int32_t nr, int32_t width,
                 const float *x, int64_t x_stride, float *out, int64_t out_stride,
                 const int32_t *order, const int32_t *slots, int32_t n, const int32_t *col_lo,
                 const int32_t *col_hi) {
    float h[nr > 0 ? nr : 1];
    for (int32_t e = 0; e < n; e++) {
        const int64_t slot = slots[e];
        const float *as = a + slot * (int64_t)in * nr;
        const float *bs = b + slot * (int64_t)nr * width;
        const float *xr = x + (int64_t)order[e] * x_stride;
        float *yr = out + (int64_t)order[e] * out_stride;
        shrink(xr, as, in, nr, h);
        for (int32_t k = 0; k < nr;) {
            /* up to four rank columns reaching the same output columns, skipping zero ones
             * (rank columns past this slot's rank) */
            float hs[4];
            int32_t m = 0, lo = col_lo[k], hi = col_hi[k], first = k;
            for (; k < nr && col_lo[k] == lo && col_hi[k] == hi && k - first < 4; k++)
                hs[m++] = h[k];
            if ((hs[0] != 0.0f) | (m > 1 && hs[1] != 0.0f) | (m > 2 && hs[2] != 0.0f) |
                (m > 3 && hs[3] != 0.0f))
                expand(yr + lo, bs + (int64_t)first * width, width, hs, m, 0, hi - lo);
        }
    }
}
