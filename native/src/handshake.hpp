// The connection handshake: every link opens with a hello each way (magic,
// protocol version, connection kind, communicator id, rank, world size, lane,
// stream).
// The higher rank connects; the lower rank accepts, checks the hello and
// answers. Connections that send garbage, a stale id or a cut-short hello are
// closed without blocking the others. Encoding and decoding are in wire.hpp;
// this file does the socket side, bounded by a deadline and the abort eventfd.
#pragma once

#include "comm.hpp"

namespace pccl {

// Opens comm->streams links to every rank on every lane (see pcclCommConnectLanes
// and pcclConfig_t's streams): lanes[0]
// is the communicator that owns the listener and the abort eventfd watched while
// connecting; lanes[1 .. nlanes) are unconnected communicators of the same rank,
// world size and id that get a connection of their own to every peer. Marks all
// lanes connected on success; on failure the links opened so far stay in their
// lanes (destroy them).
pcclResult_t connect_all(pcclComm *const *lanes, int nlanes, const char *const *addrs,
                         int timeout_ms);

}  // namespace pccl
