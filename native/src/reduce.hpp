// Reduce kernels: dst[i] = dst[i] (op) src[i] for every dtype and op, and the
// final division of AVG. float16/bfloat16 compute in float32 and round once per
// call; integers wrap on overflow (two's complement), as torch does.
#pragma once

#include <cstddef>

#include "pccl.h"

namespace pccl {

// dst = dst op src over `count` elements; AVG reduces as SUM (see finalize_avg).
void reduce_into(void *dst, const void *src, size_t count, pcclDataType_t dtype, pcclRedOp_t op);

// dst /= world_size for AVG; integers divide truncating toward zero.
void finalize_avg(void *dst, size_t count, pcclDataType_t dtype, int world_size);

}  // namespace pccl
