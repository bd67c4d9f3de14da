/* The native decode kernels' exported functions: the one declaration of each signature.
 *
 * Every kernel source includes this header, so the compiler checks each definition against
 * it; the package build checks it against the Python side's ctypes declarations
 * (`kernel_abi.SIGNATURES`) and fails on any difference, so a changed signature is a build
 * error rather than memory corruption at run time. Only what is declared here is exported
 * (the build hides every other symbol). Layouts and meanings are documented beside each
 * definition. */
#ifndef LORAFLEET_KERNELS_H
#define LORAFLEET_KERNELS_H

#include <stdint.h>

#define LORAFLEET_EXPORT __attribute__((visibility("default")))

/* decode_attention.c: one decode step's attention over each row's own columns. */
LORAFLEET_EXPORT void decode_attention(const float *q, float *keys, float *values,
                                       const float *new_keys, const float *new_values,
                                       int64_t new_keys_stride, int64_t new_values_stride,
                                       const int32_t *lengths, int32_t rows, int32_t kv_heads,
                                       int32_t group, int32_t dim, int64_t row_stride,
                                       int64_t head_stride, float scale, float *out,
                                       float *peak, float *total, float *scratch);

/* decode_shared.c: attention over shared prompt segments, merged into the rows' own. */
LORAFLEET_EXPORT void decode_shared(const float *q, int32_t kv_heads, int32_t group, int32_t dim,
                                    float scale, int32_t segments, const int64_t *keys,
                                    const int64_t *values, const int64_t *head_strides,
                                    const int32_t *lengths, const int32_t *starts,
                                    const int32_t *row_ids, float *out, float *peak,
                                    float *total, float *scratch);

/* decode_shared.c: floats of scratch one segment of `queries` query heads needs. */
LORAFLEET_EXPORT int64_t decode_shared_scratch(int64_t queries, int32_t n, int32_t dim);

/* decode_lora.c: one decode step's LoRA, each row through its own slot's weights. */
LORAFLEET_EXPORT void decode_lora(const float *a, const float *b, int32_t in, int32_t nr,
                                  int32_t width, const float *x, int64_t x_stride,
                                  float *out, int64_t out_stride, const int32_t *order,
                                  const int32_t *slots, int32_t n, const int32_t *col_lo,
                                  const int32_t *col_hi);

/* abi.c: the digest of the sources, header, flags and variant this library was built from
 * (`kernel_abi.sources_digest`); the loader refuses a library built from other sources. */
LORAFLEET_EXPORT const char *lorafleet_kernels_digest(void);

#endif
