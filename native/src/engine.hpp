// The progress engine: runs one Schedule over the communicator's links from the
// calling thread. Non-blocking sockets and poll(): no busy-waiting. Each poll is
// bounded by the op's deadline and watches the abort eventfd. On any network
// failure the communicator's sticky error is set and the peers are told.
#pragma once

#include <cstdint>

#include "comm.hpp"
#include "schedule.hpp"

namespace pccl {

// Returns pcclSuccess once every item has been sent and received (and reduced),
// or a network error: pcclPeerLost, pcclTimeout, pcclAborted, pcclSystemError,
// pcclProtocolError, pcclMismatch, pcclRemoteError.
pcclResult_t run_schedule(pcclComm *comm, const Schedule &s, int64_t deadline_ms);

}  // namespace pccl
