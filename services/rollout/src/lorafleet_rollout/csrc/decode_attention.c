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

/* Prefetching. A decode step streams every row's keys and values from DRAM once, and one
 * core's hardware prefetcher keeps too few lines in flight to saturate it (9.5 GB/s measured
 * on 4 rows x 1,500 columns x 8 heads, out of cache; a plain torch sum of the same bytes read
 * 13 GB/s). Asking for the keys KEYS_AHEAD columns ahead, for the values while their keys
 * are scored (a head's values fit in L2), and for the next head's keys while these values
 * are summed kept more in flight: 2.5 -> 1.9 ms a layer, the results bit-identical.
 */
#define LINE_FLOATS 16
#define KEYS_AHEAD 16

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
                peak[head * group + g] = top;
                total[head * group + g] = sum;
            }
            memset(oh, 0, sizeof(float) * (size_t)group * (size_t)dim);
            /* The next (row, head)'s keys start streaming while these values are read. */
            const int32_t next_r = h + 1 < kv_heads ? r : r + 1;
            const int32_t next_h = h + 1 < kv_heads ? h + 1 : 0;
            const int32_t next_n = next_r < rows ? lengths[next_r] : 0;
            const float *next_k = next_n ? keys + next_r * row_stride + next_h * head_stride : k;
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
                const float inv = 1.0f / total[head * group + g];
                float *o = oh + (int64_t)g * dim;
                for (int32_t d = 0; d < dim; d++) o[d] *= inv;
            }
        }
    }
}
