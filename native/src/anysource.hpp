// Receive from any source: which peer's next frame is a point-to-point message
// for this rank. Peeks at frame headers without consuming them, so the receive
// that follows runs through the ordinary engine (engine.hpp) and checks the
// frame as any pcclRecv does.
#pragma once

#include <cstdint>

#include "comm.hpp"

namespace pccl {

// Waits until some peer's next message (its frames may come on any of the peer's
// streams, deal.hpp) is a p2p message with `tag` (or an ABORT frame, a closed
// connection or a malformed header, which the receive that follows reports), and
// sets *peer to that rank. A peer whose next message has another tag, or whose
// every stream shows a later op's frame, is not chosen. Returns
// pcclSuccess, pcclTimeout at `deadline_ms`, pcclAborted, or pcclSystemError;
// a failure is made sticky and told to the peers, as the engine's are.
pcclResult_t wait_any_p2p(pcclComm *comm, uint32_t tag, int64_t deadline_ms, int *peer);

}  // namespace pccl
