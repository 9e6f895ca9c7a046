// main.cpp — the `bumblebee` command.
//
// Under mpirun or srun every process runs this; an error on one rank ends the whole job (the
// others would otherwise wait in their next collective until the timeout).
#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "comm/comm.h"

int main(int argc, char** argv) {
  bb::comm::init(&argc, &argv);
  int rc = 0;
  try {
    rc = bb::cli::run(argc, argv);
  } catch (const std::exception& e) {
    if (bb::comm::world().size > 1) bb::comm::abort_job(2, std::string("error: ") + e.what());
    std::fprintf(stderr, "bumblebee: error: %s\n", e.what());
    rc = 2;
  }
  bb::comm::finalize();
  return rc;
}
