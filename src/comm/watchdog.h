// watchdog.h — the deadline of collectives whose wait is a stream wait (NCCL, emulated on a
// GPU). Their Work::wait() never blocks the host, so a hung peer would otherwise show up only
// where the host next reads the GPU (a loss, router counts, a checkpoint), which may have no
// deadline at all. One thread per process watches every such collective from its issue until
// its event completes, and polls the registered health checks (NCCL's asynchronous error
// state). When a collective is older than the job's timeout (parallel.timeout_s), or a check
// reports an error, it runs the registered abort hooks (ncclCommAbort frees the stuck kernels)
// and ends the job with a message that names the operation and its group.
//
// The thread starts with the first watch and polls every few milliseconds; a collective costs
// one lock and one vector entry until it completes. CPU collectives (MPI) need none of this:
// their wait() polls with the deadline itself.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/stream.h"

namespace bb::comm {

// Watches the collective described by `what` (e.g. "all_to_all_v on group 'ep' (operation #12)")
// until `done` says it completed. `done` is called from the watchdog thread.
void watch(std::function<bool()> done, std::string what);
// The same for a collective whose completion is `e`, recorded right after it on a stream of
// CUDA device `cuda_device` (the watchdog thread makes that device current before it queries
// the event: a thread's first CUDA call would otherwise open a context on device 0, which
// belongs to another rank on a multi-GPU node).
void watch(const Event& e, int cuda_device, std::string what);

// A check polled with every pass: returns "" while healthy, else the error (it then ends the
// job). `abort` (may be empty) runs before the job ends (e.g. ncclCommAbort). Returns an id for
// remove_health_check (an NCCL group removes its own when it is destroyed).
int64_t add_health_check(std::function<std::string()> check, std::function<void()> abort);
void remove_health_check(int64_t id);

// Collectives watched now (tests).
int64_t watched_count();

// Tests: what the watchdog does instead of ending the process, after the abort hooks ran
// (receives the message); an empty function restores the default (the message on stderr, then
// _exit(3): a launcher ends the other ranks when one exits with an error).
void set_watchdog_action_for_tests(std::function<void(const std::string&)> action);

}  // namespace bb::comm
