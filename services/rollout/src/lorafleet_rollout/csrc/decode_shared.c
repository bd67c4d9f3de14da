/* One decode step's attention over shared prompt segments, merged into the rows' own.
 *
 * Why C: a segment is a prompt prefix that several rows read (a request's samples, requests
 * whose prompts share a cached prefix). In torch each segment cost ~25 small ops per layer
 * (gather the rows' queries, score, softmax, gather and scatter the merge), so with 8
 * segments x 6 layers a decode step spent more time dispatching ops than computing
 * (profiled on the bench model, workload (d) with adapters). Here one call per layer walks
 * every segment, reads each of its keys and values once for all of its rows, and merges the
 * result into the rows' own attention exactly (log-sum-exp), in place.
 *
 * Two ways through a segment's head. Few queries (rows x group < 4): one dot product per
 * query and key, as the own-attention kernel does. More: blocks of LANES queries held as
 * one vector per head dimension, so a key scores the whole block with broadcast multiply-adds
 * (no horizontal sums), and softmax and values run on the same lanes; measured against
 * torch's batched matmuls on the bench model's shapes (8 kv heads x 64), this is at least as
 * fast from one query up.
 *
 * Layout (float32):
 *   q       [rows, kv_heads, group, dim], contiguous
 *   segment s: keys at keys[s] + h*head_strides[s] + t*dim for head h, column t < lengths[s];
 *           values at values[s] with the same strides
 *   its rows: row_ids[starts[s]] .. row_ids[starts[s+1] - 1] (a row may be in several)
 *   out     [rows, kv_heads, group, dim]: the rows' own attention, normalised; updated
 *   peak    [rows, kv_heads, group]: its largest scaled score; updated
 *   total   [rows, kv_heads, group]: its sum of exp(score - peak); updated
 *   scratch >= max over segments of decode_shared_scratch(its rows * group, lengths[s], dim)
 *           floats
 */
#include "kernels.h"
#include "vector.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp, written so the compiler vectorises it: libm's expf is a scalar call, and this kernel
 * takes one per score (~800,000 a decode step on workload (d): as long as the scores
 * themselves). Cephes' single-precision exp, 2^n times a degree-6 polynomial on
 * [-ln2/2, ln2/2]: 1.24 ulp at most over [-30, 0] (expf: 0.5; measured), branch-free;
 * arguments below -87 give ~1e-38, which a softmax (largest term 1) cannot see. */
static inline float vexp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    /* Cody-Waite: ln2 in two parts, fused so no compiler flag can merge them back (with
     * -fassociative-math that cost 16 ulp: measured) */
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Queries per block in the blocked path (one 16-float vector). */
#define LANES 16
/* Keys (scores) or head dimensions (values) per pass in the blocked path: one accumulator
 * vector each, all in registers. */
#define STEP 8
/* LANES floats as one vector (GCC/Clang vector extension: AVX-512, 2 AVX or 4 SSE registers) */
typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));

/* Queries of a segment's head taken at once: all of them when few, else LANES. */
static int64_t block_of(int64_t queries) { return queries < 4 ? queries : LANES; }

/* Floats of scratch one segment needs: the dot path's scores [block, n] and values
 * [block, dim], or the blocked path's queries [dim, LANES], weights [n, LANES] and values
 * [dim, LANES]; then peaks and totals [LANES] each. */
int64_t decode_shared_scratch(int64_t queries, int32_t n, int32_t dim) {
    const int64_t block = block_of(queries);
    const int64_t dots = block * (n + dim);
    const int64_t blocked = (int64_t)LANES * (dim + n + dim);
    return (block < LANES ? dots : blocked) + 2 * LANES;
}

/* Query vector of lane `lane` (row ids[lane / group], query head lane % group of head h). */
static const float *query(const float *q, const int32_t *ids, int64_t lane, int32_t kv_heads,
                          int32_t h, int32_t group, int32_t dim) {
    return q + (((int64_t)ids[lane / group] * kv_heads + h) * group + lane % group) * dim;
}

/* Few queries: weights [count, n] (exp(score - top)), tops and sums [count], and
 * acc [count, dim] = sum over t of weight * value. */
static void attend_dots(const float *q, const int32_t *ids, int64_t first, int64_t count,
                        int32_t kv_heads, int32_t h, int32_t group, int32_t dim, float scale,
                        const float *k, const float *v, int32_t n, float *weights, float *acc,
                        float *tops, float *sums) {
    for (int32_t t = 0; t < n; t++) {
        const float *kt = k + (int64_t)t * dim;
        for (int64_t i = 0; i < count; i++) {
            const float *qi = query(q, ids, first + i, kv_heads, h, group, dim);
            weights[i * n + t] = dot(qi, kt, dim) * scale;
        }
    }
    for (int64_t i = 0; i < count; i++) {
        float *wi = weights + i * n;
        float top = wi[0];
        for (int32_t t = 1; t < n; t++) top = wi[t] > top ? wi[t] : top;
        float sum = 0.0f;
        for (int32_t t = 0; t < n; t++) {
            wi[t] = vexp(wi[t] - top);
            sum += wi[t];
        }
        tops[i] = top;
        sums[i] = sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)count * (size_t)dim);
    for (int32_t t = 0; t < n; t++) {
        const float *vt = v + (int64_t)t * dim;
        for (int64_t i = 0; i < count; i++) {
            const float w = weights[i * n + t];
            float *a = acc + i * dim;
            for (int32_t d = 0; d < dim; d++) a[d] += w * vt[d];
        }
    }
}

/* Up to LANES queries as lanes (padding lanes zero): weights [n] and acc [dim] as vectors,
 * tops and sums [LANES]. */
static void attend_lanes(const float *q, const int32_t *ids, int64_t first, int64_t count,
                         int32_t kv_heads, int32_t h, int32_t group, int32_t dim, float scale,
                         const float *k, const float *v, int32_t n, lanes *qt, lanes *weights,
                         lanes *acc, float *tops, float *sums) {
    memset(qt, 0, sizeof(lanes) * (size_t)dim);
    for (int64_t i = 0; i < count; i++) {
        const float *qi = query(q, ids, first + i, kv_heads, h, group, dim);
        for (int32_t d = 0; d < dim; d++) qt[d][i] = qi[d] * scale;
    }
    int32_t t = 0;
    for (; t + STEP <= n; t += STEP) {
        lanes a[STEP] = {{0.0f}};
        const float *kt = k + (int64_t)t * dim;
        for (int32_t d = 0; d < dim; d++) {
            const lanes qd = qt[d];
#pragma GCC unroll 8
            for (int32_t j = 0; j < STEP; j++) a[j] += kt[(int64_t)j * dim + d] * qd;
        }
        memcpy(weights + t, a, sizeof a);
    }
    for (; t < n; t++) {
        lanes a = {0.0f};
        const float *kt = k + (int64_t)t * dim;
        for (int32_t d = 0; d < dim; d++) a += kt[d] * qt[d];
        weights[t] = a;
    }
    float *w = (float *)weights; /* [n, LANES] */
    memcpy(tops, w, sizeof(float) * LANES);
    for (t = 1; t < n; t++)
        for (int32_t l = 0; l < LANES; l++)
            tops[l] = w[t * LANES + l] > tops[l] ? w[t * LANES + l] : tops[l];
    memset(sums, 0, sizeof(float) * LANES);
    for (t = 0; t < n; t++) {
        for (int32_t l = 0; l < LANES; l++) {
            w[t * LANES + l] = vexp(w[t * LANES + l] - tops[l]);
            sums[l] += w[t * LANES + l];
        }
    }
    int32_t d = 0;
    for (; d + STEP <= dim; d += STEP) {
        lanes a[STEP] = {{0.0f}};
        for (t = 0; t < n; t++) {
            const float *vt = v + (int64_t)t * dim + d;
            const lanes w = weights[t];
#pragma GCC unroll 8
            for (int32_t j = 0; j < STEP; j++) a[j] += vt[j] * w;
        }
        memcpy(acc + d, a, sizeof a);
    }
    for (; d < dim; d++) {
        lanes a = {0.0f};
        for (t = 0; t < n; t++) a += v[(int64_t)t * dim + d] * weights[t];
        acc[d] = a;
    }
}

void decode_shared(const float *q, int32_t kv_heads, int32_t group, int32_t dim, float scale,
                   int32_t segments, const int64_t *keys, const int64_t *values,
                   const int64_t *head_strides, const int32_t *lengths, const int32_t *starts,
                   const int32_t *row_ids, float *out, float *peak, float *total,
                   float *scratch) {
    for (int32_t s = 0; s < segments; s++) {
        const int32_t n = lengths[s];
        const int32_t *ids = row_ids + starts[s];
        const int64_t queries = (int64_t)(starts[s + 1] - starts[s]) * group;
        const int64_t block = block_of(queries);
        /* the scratch layout of decode_shared_scratch; lanes are 64-byte vectors, so the
         * blocked path's buffers start on whole vectors (torch allocates 64-byte aligned) */
        float *tops = scratch, *sums = scratch + LANES, *rest = scratch + 2 * LANES;
        lanes *qt = (lanes *)rest, *weights = qt + dim, *acc_lanes = weights + n;
        float *weights_dots = rest, *acc_dots = rest + block * n;
        for (int32_t h = 0; h < kv_heads; h++) {
            const float *k = (const float *)(intptr_t)keys[s] + h * head_strides[s];
            const float *v = (const float *)(intptr_t)values[s] + h * head_strides[s];
            for (int64_t first = 0; first < queries; first += block) {
                const int64_t count = queries - first < block ? queries - first : block;
                if (block < LANES)
                    attend_dots(q, ids, first, count, kv_heads, h, group, dim, scale, k, v, n,
                                weights_dots, acc_dots, tops, sums);
                else
                    attend_lanes(q, ids, first, count, kv_heads, h, group, dim, scale, k, v,
                                 n, qt, weights, acc_lanes, tops, sums);
                for (int64_t i = 0; i < count; i++) {
                    const int64_t lane = first + i;
                    const int64_t at =
                        ((int64_t)ids[lane / group] * kv_heads + h) * group + lane % group;
                    const float top = peak[at] > tops[i] ? peak[at] : tops[i];
                    const float mine = total[at] * vexp(peak[at] - top);
                    const float theirs = vexp(tops[i] - top);
                    const float sum = mine + theirs * sums[i];
                    const float inv = 1.0f / sum;
                    float *o = out + at * dim;
                    if (block < LANES) {
                        const float *a = acc_dots + i * dim;
                        for (int32_t d = 0; d < dim; d++)
                            o[d] = (o[d] * mine + theirs * a[d]) * inv;
                    } else {
                        for (int32_t d = 0; d < dim; d++)
                            o[d] = (o[d] * mine + theirs * acc_lanes[d][i]) * inv;
                    }
                    peak[at] = top;
                    total[at] = sum;
                }
            }
        }
    }
}
