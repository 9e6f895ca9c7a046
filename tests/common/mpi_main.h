// mpi_main.h — the main() of the multi-rank tests (tests/mpi): every rank runs every test under
// mpirun (CTest runs each file at 1, 2 and 4 ranks on CPU processes); the job fails if any rank
// fails. On a GPU machine the same tests run on GPU tensors:
//   mpirun -np 2 test_comm --device=cuda --backend=mpi    processes sharing a GPU (staged)
//   test_comm --device=cuda --backend=nccl                 the NCCL path (one GPU per process)
// Include it once, in a test file.
#pragma once

#include <gtest/gtest.h>

#include <cstring>

#include "comm/comm.h"
#ifdef BB_WITH_CUDA
#include "backend/cuda/runtime.h"
#endif

namespace bb::test {

struct MpiTestOptions {
  Device device = Device::cpu();
  comm::Backend backend = comm::Backend::mpi;
};
inline MpiTestOptions& mpi_options() {
  static MpiTestOptions o;
  return o;
}
inline Device device() { return mpi_options().device; }

// Every rank of the job over the chosen backend (a world of one without mpirun).
inline comm::GroupPtr& world() {
  static comm::GroupPtr w = mpi_options().backend == comm::Backend::nccl ? comm::world_group(comm::Backend::nccl)
                            : comm::world().mpi                         ? comm::world_group(comm::Backend::mpi)
                                                                        : comm::self_group("world");
  return w;
}

// A directory every rank sees: made by rank 0, its name broadcast.
inline std::string shared_tmpdir(const char* tag) {
  std::string dir;
  if (world()->rank() == 0) {
    std::string tmpl = std::string("/tmp/bb_") + tag + "_XXXXXX";
    char* d = mkdtemp(tmpl.data());
    EXPECT_NE(d, nullptr);
    dir = d ? d : "";
  }
  world()->broadcast_host(dir, 0);
  return dir;
}

}  // namespace bb::test

int main(int argc, char** argv) {
  bb::comm::init(&argc, &argv);
  bb::comm::set_timeout(120);
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--device=cuda") == 0) {
#ifdef BB_WITH_CUDA
      const int n = bb::cuda::device_count();
      if (n == 0) {
        std::fprintf(stderr, "--device=cuda: no GPU visible (%s)\n", bb::cuda::unavailable_reason());
        return 2;
      }
      bb::test::mpi_options().device = bb::Device::cuda(bb::comm::world().local_rank % n);
      bb::cuda::set_device(bb::test::mpi_options().device.index);
#else
      std::fprintf(stderr, "--device=cuda: this build has no CUDA backend\n");
      return 2;
#endif
    } else if (std::strcmp(argv[i], "--backend=nccl") == 0) {
      bb::test::mpi_options().backend = bb::comm::Backend::nccl;
    } else if (std::strcmp(argv[i], "--backend=mpi") == 0) {
      bb::test::mpi_options().backend = bb::comm::Backend::mpi;
    } else {
      std::fprintf(stderr, "unknown option %s (expected --device=cuda, --backend=mpi|nccl)\n", argv[i]);
      return 2;
    }
  }
  if (bb::comm::world().rank != 0) {
    // Other ranks report failures only (rank 0 prints the usual progress).
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    struct FailurePrinter : ::testing::EmptyTestEventListener {
      void OnTestPartResult(const ::testing::TestPartResult& r) override {
        if (r.failed())
          std::fprintf(stderr, "[rank %d] FAILED %s:%d\n%s\n", bb::comm::world().rank,
                       r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
      }
    };
    listeners.Append(new FailurePrinter);
  }
  const int rc = RUN_ALL_TESTS();
  bb::test::world().reset();
  bb::comm::finalize();
  return rc;
}
