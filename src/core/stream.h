// stream.h — the execution context: named streams, events that order them, and the rule that
// keeps buffers alive across them (DESIGN.md sec. 11).
//
// Device work is issued on the calling thread's *current stream*: `compute` unless a
// StreamScope names another one. The side streams exist so that communication, delayed weight
// gradients and copies run beside the compute stream. Communication has one stream per traffic
// class, so that one class never queues behind another (a layer's dispatch all-to-all behind the
// next layer's parameter gather or the previous layer's gradient reduction):
//   compute  every primitive by default
//   comm     collectives outside the four classes below (control values, barriers)
//   wgrad    weight-gradient GEMMs delayed into a communication window
//   copy     host <-> device transfers (offload, prefetch)
//   upload   host -> device transfers of state that lives on the host (the new weights of the
//            optimizer offload), beside the device -> host copies of `copy` (a PCIe link
//            carries both directions at once)
//   ep       expert-parallel dispatch and combine (high priority: the experts wait for them)
//   gather   parameter gathers (FSDP / ZeRO units before their use)
//   reduce   gradient reductions (reduce-scatter, all-reduce of gradients)
//   cp       context-parallel exchanges (ring shifts, head all-to-alls)
// Streams are ordered only through events: Event::record(dev, s) marks the work issued on s so
// far; ev.wait(s2) makes later work on s2 wait for that mark (the host does not wait).
//
// Buffer lifetime (record-stream semantics): memory is allocated on the current stream and, by
// default, handed out again in that stream's order after it is freed. A tensor read or written
// on another stream must say so: t.record_stream(Stream::comm). Its memory is then not reused
// until every stream that used it has passed the point where the tensor was freed, and the
// compute stream never waits for the side stream because of it.
//
// On the CPU all work is synchronous: scopes only change what current_stream() returns,
// events are always complete. Getting the current stream costs a thread-local read.
#pragma once

#include <cstdint>
#include <memory>

#include "core/memory.h"

namespace bb {

enum class Stream : uint8_t { compute = 0, comm, wgrad, copy, ep, gather, reduce, cp, upload };
constexpr int kNumStreams = 9;
const char* stream_name(Stream s);
constexpr uint32_t stream_bit(Stream s) { return 1u << static_cast<uint32_t>(s); }

// The stream this thread issues device work on.
Stream current_stream();

// Device work issued by this thread inside the scope goes to `s`; the previous stream is restored
// at the end of the scope. Scopes nest.
class StreamScope {
 public:
  explicit StreamScope(Stream s);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Stream prev_;
};

// A recorded point in one stream's work on one device. Default-constructed events are
// complete. Copies share the underlying event.
class Event {
 public:
  Event() = default;
  // Marks the work issued on stream `s` of `dev` so far.
  static Event record(Device dev, Stream s = current_stream());
  // Work issued on stream `s` (of the event's device) after this call waits for the mark.
  void wait(Stream s = current_stream()) const;
  // Whether the marked work has finished (never blocks).
  bool done() const;
  // Blocks the host until the marked work has finished (a deliberate host sync, counted).
  void synchronize() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

// Blocks the host until every stream of `dev` has finished its work (counted as one host sync
// on a GPU; nothing on the CPU).
void synchronize_device(Device dev);

}  // namespace bb
