/* The build's identity, so a library never runs against sources it was not built from (an
 * editable install whose C files changed since, a stale copy): `kernels.load` compares this
 * with the digest of the sources it sees. The build defines LORAFLEET_KERNELS_DIGEST. */
#include "kernels.h"

#ifndef LORAFLEET_KERNELS_DIGEST
#error "LORAFLEET_KERNELS_DIGEST is defined by the package build (services/rollout/setup.py)"
#endif

const char *lorafleet_kernels_digest(void) { return LORAFLEET_KERNELS_DIGEST; }
