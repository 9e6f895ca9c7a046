// sanitizer_defaults.cpp — default ASan / UBSan / LSan settings of the sanitized build
// (BUMBLEBEE_SANITIZE or BUMBLEBEE_FUZZ), compiled into every executable of that build, so
// ctest, mpirun and a binary started by hand all behave alike. Settings in the environment
// (ASAN_OPTIONS, UBSAN_OPTIONS, LSAN_OPTIONS) still override the options below.
#include <cstdlib>

extern "C" {

// The sanitizer runtimes call these (weak symbols on their side). The *_options ones are read
// while the runtime starts, before the environment can be read.
const char* __asan_default_options() {
  return "strict_string_checks=1:check_initialization_order=1:detect_leaks=1";
}
const char* __ubsan_default_options() {
  return "print_stacktrace=1:halt_on_error=1";
}
const char* __lsan_default_options() {
  return "print_suppressions=0";
}

// Read lazily, at the leak check when the process exits, so the environment is available.
//
// Under an MPI launcher (OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK or SLURM_PROCID set: mpirun
// or srun, where bumblebee initializes MPI, as a singleton too) every leak is suppressed.
// OpenMPI keeps per-process state it never frees, allocated inside its mca_* plugins, which are
// built without frame pointers and dlclose'd at MPI_Finalize: LSan reports those leaks with
// two-frame stacks ending in "<unknown module>" that no library-name suppression can match. A
// process outside a launcher (the CPU unit tests, the single-process runs of the CLI tests, the
// fuzzers) keeps full leak detection, and address and undefined-behaviour checks stay on
// everywhere, multi-rank runs included.
//
// OpenBLAS's thread-pool buffers live until exit by design.
const char* __lsan_default_suppressions() {
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") ||
                        std::getenv("PMI_RANK") || std::getenv("SLURM_PROCID");
  return launched ? "leak:*\n" : "leak:libopenblas\n";
}

}  // extern "C"
