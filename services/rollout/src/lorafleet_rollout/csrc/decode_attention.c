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
 *   scratch >= group * max(lengths) floats
 * peak and total let the caller merge this with attention over a shared prefix exactly.
 */
#include "kernels.h"
#include "vector.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

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
            for (int32_t t = 0; t < n; t++) {
                const float *kt = k + (int64_t)t * dim;
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
                peak[head * group + g] = top;
                total[head * group + g] = sum;
            }
            memset(oh, 0, sizeof(float) * (size_t)group * (size_t)dim);
            for (int32_t t = 0; t < n; t++) {
                const float *vt = v + (int64_t)t * dim;
                for (int32_t g = 0; g < group; g++) {
                    const float w = scratch[(int64_t)g * n + t];
                    float *o = oh + (int64_t)g * dim;
                    for (int32_t d = 0; d < dim; d++) o[d] += w * vt[d];
                }
            }
            for (int32_t g = 0; g < group; g++) {
                const float inv = 1.0f / total[head * group + g];
                float *o = oh + (int64_t)g * dim;
                for (int32_t d = 0; d < dim; d++) o[d] *= inv;
            }
        }
    }
}
