/* One decode step's attention for the torch engine: one query token per row, read against
 * that row's own keys/values only, every key and value read exactly once.
 *
 * Why C: a decode step's attention is a batch of rows x kv_heads tiny matrix-vector products.
 * torch runs them as a batched matmul (one GEMV call per row and head, ~4 us of overhead
 * each) or through its CPU flash kernel (tuned for long query blocks); both took 2-4x the
 * time it takes to stream the keys and values once (profiled on the bench model). Here one
 * call per layer walks row by row, each row up to its own length (a short row never reads a
 * long row's columns), and all query heads sharing a kv head are scored against each key
 * while it is in cache.
 *
 * Two ways through a (row, head), by the row's length:
 *   - long rows (> STREAM_FROM columns) in one pass: blocks of BLOCK columns are scored, and
 *     their values summed at once with an online softmax (the running peak rescales what was
 *     summed when it rises), so keys and values stream side by side, two DRAM streams
 *     instead of one after the other. On 4 rows x 1,500 columns x 8 heads x 6 layers, out
 *     of cache (AMD Zen 4): 10.9 -> 5.5 ms a step, 13.5 -> 26.6 GB/s, where a plain read of
 *     the same bytes as 4 streams reaches 27 GB/s. Without software prefetch: every
 *     prefetch pattern tried here (ahead in the row, the next head's, hints 0-3) slowed it,
 *     by up to 2x, as the hardware prefetcher already follows both streams.
 *   - short rows in two passes (all scores, softmax, then the values), asking for the next
 *     (row, head)'s keys while these values are read: at 64-100 columns its start-up is what
 *     costs, and this path stayed 8-29 % faster there (128 rows x 64 columns: 15.5 vs 20 ms).
 *
 * Layout (float32):
 *   q       [rows, kv_heads, group, dim], contiguous
 *   keys    row r, head h, column t at keys + r*row_stride + h*head_stride + t*dim
 *   values  same strides as keys
 *   lengths [rows]: columns 0..lengths[r]-1 are row r's (>= 1); the last one is this step's:
 *   new_keys, new_values  row r, head h at new_* + r*new_*_stride + h*dim: this step's keys
 *           and values, written to column lengths[r]-1 first (no separate scatter)
 *   out     [rows, kv_heads, group, dim]: softmax-weighted values, normalised
 *   peak    [rows, kv_heads, group]: the largest scaled score
 *   total   [rows, kv_heads, group]: sum of exp(score - peak)
 *   scratch >= group * max(lengths) floats (BLOCK of them per query head on the one-pass path)
 * peak and total let the caller merge this with attention over a shared prefix exactly.
 */
#include "kernels.h"
#include "vector.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Rows longer than this take the one-pass path (a multiple of BLOCK). */
#define STREAM_FROM 128
/* Columns scored together on the one-pass path, between rescales. */
#define BLOCK 16

/* Prefetching (two-pass path). A head's values are asked for while its keys are scored (they
 * fit in L2) and the next (row, head)'s keys while these values are summed, KEYS_AHEAD
 * columns ahead within the keys: on Intel (Sapphire Rapids) 2.5 -> 1.9 ms a layer for long
 * rows when they took this path; for short rows, the next head's keys are what counts. */
#define LINE_FLOATS 16
#define KEYS_AHEAD 16

/* One (row, head), two passes. k, v: its n columns; qh, oh: its group query heads. */
static void two_pass(const float *qh, const float *k, const float *v, int32_t n, int32_t group,
                     int32_t dim, float scale, const float *next_k, int32_t next_n, float *oh,
                     float *peak, float *total, float *scratch) {
    for (int32_t t = 0; t < n; t++) {
        const float *kt = k + (int64_t)t * dim;
        for (int32_t c = 0; c < dim; c += LINE_FLOATS) {
            if (t + KEYS_AHEAD < n) __builtin_prefetch(kt + KEYS_AHEAD * dim + c, 0, 3);
            __builtin_prefetch(v + (int64_t)t * dim + c, 0, 2);
        }
        for (int32_t g = 0; g < group; g++) {
            const float *qg = qh + (int64_t)g * dim;
            scratch[(int64_t)g * n + t] = dot(qg, kt, dim) * scale;
        }
    }
    for (int32_t g = 0; g < group; g++) {
        float *s = scratch + (int64_t)g * n;
        float top = s[0];
        for (int32_t t = 1; t < n; t++) top = s[t] > top ? s[t] : top;
        float sum = 0.0f;
        for (int32_t t = 0; t < n; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        peak[g] = top;
        total[g] = sum;
    }
    memset(oh, 0, sizeof(float) * (size_t)group * (size_t)dim);
    for (int32_t t = 0; t < n; t++) {
        const float *vt = v + (int64_t)t * dim;
        if (t < next_n) {
            for (int32_t c = 0; c < dim; c += LINE_FLOATS)
                __builtin_prefetch(next_k + (int64_t)t * dim + c, 0, 2);
        }
        for (int32_t g = 0; g < group; g++) {
            const float w = scratch[(int64_t)g * n + t];
            float *o = oh + (int64_t)g * dim;
            for (int32_t d = 0; d < dim; d++) o[d] += w * vt[d];
        }
    }
    for (int32_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        float *o = oh + (int64_t)g * dim;
        for (int32_t d = 0; d < dim; d++) o[d] *= inv;
    }
}

/* One (row, head), one pass: online softmax over blocks of BLOCK columns. */
static void one_pass(const float *qh, const float *k, const float *v, int32_t n, int32_t group,
                     int32_t dim, float scale, float *oh, float *peak, float *total,
                     float *scratch) {
    for (int32_t g = 0; g < group; g++) {
        peak[g] = -INFINITY;
        total[g] = 0.0f;
    }
    memset(oh, 0, sizeof(float) * (size_t)group * (size_t)dim);
    for (int32_t t0 = 0; t0 < n; t0 += BLOCK) {
        const int32_t b = n - t0 < BLOCK ? n - t0 : BLOCK;
        const float *kb = k + (int64_t)t0 * dim, *vb = v + (int64_t)t0 * dim;
        for (int32_t g = 0; g < group; g++) {
            const float *qg = qh + (int64_t)g * dim;
            float *s = scratch + (int64_t)g * BLOCK;
            float *o = oh + (int64_t)g * dim;
            float top = peak[g];
            for (int32_t j = 0; j < b; j++) {
                s[j] = dot(qg, kb + (int64_t)j * dim, dim) * scale;
                top = s[j] > top ? s[j] : top;
            }
            if (top > peak[g]) { /* what was summed against the old peak, rescaled */
                const float c = expf(peak[g] - top); /* 0 on the first block */
                total[g] *= c;
                for (int32_t d = 0; d < dim; d++) o[d] *= c;
                peak[g] = top;
            }
            float sum = total[g];
            for (int32_t j = 0; j < b; j++) {
                const float w = expf(s[j] - top);
                const float *vt = vb + (int64_t)j * dim;
                sum += w;
                for (int32_t d = 0; d < dim; d++) o[d] += w * vt[d];
            }
            total[g] = sum;
        }
    }
    for (int32_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        float *o = oh + (int64_t)g * dim;
        for (int32_t d = 0; d < dim; d++) o[d] *= inv;
    }
}

void decode_attention(const float *q, float *keys, float *values, const float *new_keys,
                      const float *new_values, int64_t new_keys_stride,
                      int64_t new_values_stride, const int32_t *lengths, int32_t rows,
                      int32_t kv_heads, int32_t group,
                      int32_t dim, int64_t row_stride, int64_t head_stride, float scale,
                      float *out, float *peak, float *total, float *scratch) {
    for (int32_t r = 0; r < rows; r++) {
        const int32_t n = lengths[r];
        for (int32_t h = 0; h < kv_heads; h++) {
            float *k = keys + r * row_stride + h * head_stride;
            float *v = values + r * row_stride + h * head_stride;
            const int64_t last = (int64_t)(n - 1) * dim;
            memcpy(k + last, new_keys + r * new_keys_stride + h * dim, sizeof(float) * dim);
            memcpy(v + last, new_values + r * new_values_stride + h * dim, sizeof(float) * dim);
            const int64_t head = (int64_t)r * kv_heads + h;
            const float *qh = q + head * group * dim;
            float *oh = out + head * group * dim;
            if (n > STREAM_FROM) {
                one_pass(qh, k, v, n, group, dim, scale, oh, peak + head * group,
                         total + head * group, scratch);
                continue;
            }
            const int32_t next_r = h + 1 < kv_heads ? r : r + 1;
            const int32_t next_h = h + 1 < kv_heads ? h + 1 : 0;
            const int32_t next_n = next_r < rows ? lengths[next_r] : 0;
            const float *next_k = next_n ? keys + next_r * row_stride + next_h * head_stride : k;
            two_pass(qh, k, v, n, group, dim, scale, next_k, next_n, oh, peak + head * group,
                     total + head * group, scratch);
        }
    }
}
