// mpi_main.h — the main() of the multi-rank tests (tests/mpi): every rank runs every test under
// mpirun (CTest runs each file at 1, 2 and 4 ranks); the job fails if any rank fails. Include it
// once, at the end of a test file.
#pragma once

#include <gtest/gtest.h>

#include "comm/comm.h"

namespace bb::test {

// Every rank of the job over MPI (a world of one when the test runs without mpirun).
inline comm::GroupPtr& world() {
  static comm::GroupPtr w =
      comm::world().mpi ? comm::world_group(comm::Backend::mpi) : comm::self_group("world");
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
