// mpi_group.h — the MPI implementation of comm::Group (comm.h), for the other implementations
// that bootstrap over MPI (NCCL exchanges its unique id and splits its groups through it).
#pragma once

#include <mpi.h>

#include <vector>

#include "comm/comm.h"

namespace bb::comm {

// A group over `comm` (owned from now on: freed with the group).
GroupPtr make_mpi_group(MPI_Comm comm, const std::string& name);
// A duplicate of the MPI communicator of group `g` (which must be an mpi group); the caller owns
// it.
MPI_Comm dup_mpi_comm(const Group& g);
// The MPI reduction of `op`.
MPI_Op mpi_reduce_op(ReduceOp op);
// `v` as an MPI count; an error naming `op` and `group` above 2^31 - 1.
int mpi_count(int64_t v, const char* op, const std::string& group);
// The world rank of each member of `comm`, in its rank order.
std::vector<int> mpi_world_ranks(MPI_Comm comm);
// The host operations of a group over `comm` (named `group`, `size` ranks), with the deadline;
// `seq` is the group's operation counter (incremented per call).
void mpi_host_all_reduce(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, void* v, int64_t n,
                         MPI_Datatype type, ReduceOp op);
void mpi_host_broadcast(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, std::string& bytes,
                        int root);
// n int64 values from each rank into all [size x n] (rank order).
void mpi_host_all_gather(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, const int64_t* mine,
                         int64_t* all, int64_t n);
// n int64 values to and from each rank (send and recv [size x n], peer order).
void mpi_host_all_to_all(MPI_Comm comm, const std::string& group, int size, uint64_t& seq, const int64_t* send,
                         int64_t* recv, int64_t n);

// Waits for `req` with the job's deadline (timeout()); on expiry the job is aborted with a
// message naming `op`, the group and this rank.
void mpi_timed_wait(MPI_Request* req, const std::string& group, int group_size, const char* op,
                    uint64_t seq);

}  // namespace bb::comm
