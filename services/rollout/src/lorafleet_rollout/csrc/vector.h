/* Vector helpers the kernels share (internal: nothing here is exported).
 *
 * Why written out: the build uses no -ffast-math class flag, so the compiler may not
 * reorder a float sum, and a plain `dot += a[d] * b[d]` loop stays scalar. Here the partial
 * sums are explicit vectors, so the order of additions is the source's (the same on every
 * machine and variant) and still runs at vector width. */
#ifndef LORAFLEET_VECTOR_H
#define LORAFLEET_VECTOR_H

#include <stdint.h>

/* Eight floats: GCC's generic vectors, one 256-bit register on AVX2 (split on narrower
 * machines); `_u` is the same vector at any float alignment. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8_u __attribute__((vector_size(32), aligned(4)));

/* sum over d < n of a[d] * b[d]: two vector partial sums over 16-float blocks (two
 * independent multiply-add chains), then a fixed pairwise reduction, then the tail. */
static inline float dot(const float *a, const float *b, int32_t n) {
    v8 acc0 = {0}, acc1 = {0};
    int32_t d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += *(const v8_u *)(a + d) * *(const v8_u *)(b + d);
        acc1 += *(const v8_u *)(a + d + 8) * *(const v8_u *)(b + d + 8);
    }
    if (d + 8 <= n) {
        acc0 += *(const v8_u *)(a + d) * *(const v8_u *)(b + d);
        d += 8;
    }
    const v8 acc = acc0 + acc1;
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

#endif
