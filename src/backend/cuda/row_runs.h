// row_runs.h — copying many runs of rows between two device buffers in one kernel (the MoE
// dispatchers' chunk gathers, sorts and placements: thousands of short runs per layer, which as
// one cudaMemcpyAsync each cost more than the layer's GEMMs).
#pragma once

#include <cstdint>

namespace bb::cuda {

// R runs of rows of `row_bytes` bytes (a multiple of 2): run r copies rows
// [src_row[r], src_row[r] + n) of src to rows [dst_row[r], dst_row[r] + n) of dst, n =
// start[r + 1] - start[r]. `table` (device, int32) holds start [R + 1] (prefix sums of the run
// lengths, start[0] = 0), then dst_row [R], then src_row [R]. Runs must not overlap in dst.
void copy_row_runs(void* dst, const void* src, const int32_t* table, int64_t num_runs, int64_t total_rows,
                   int64_t row_bytes);

}  // namespace bb::cuda
