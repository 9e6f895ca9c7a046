// mpi_group.h — the MPI implementation of comm::Group (comm.h), for the other implementations
// that bootstrap over MPI (NCCL exchanges its unique id and splits its groups through it).
#pragma once

#include <mpi.h>

#include "comm/comm.h"

namespace bb::comm {

// A group over `comm` (owned from now on: freed with the group).
GroupPtr make_mpi_group(MPI_Comm comm, const std::string& name);
// A duplicate of the MPI communicator of group `g` (which must be an mpi group); the caller owns
// it.
MPI_Comm dup_mpi_comm(const Group& g);
// Waits for `req` with the job's deadline (timeout()); on expiry the job is aborted with a
// message naming `op`, the group and this rank.
void mpi_timed_wait(MPI_Request* req, const std::string& group, int group_size, const char* op,
                    uint64_t seq);

}  // namespace bb::comm
