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

// Opens comm->streams links to every rank on lanes first .. first+count-1 of a group of
// nlanes (see pcclCommConnectLaneRange and pcclConfig_t's streams): lanes is indexed by
// lane; lanes[0] is the communicator that owns the listener and the abort eventfd
// watched while connecting (connected already when first >= 1), and lanes[first ..
// first+count) are unconnected communicators of the same rank, world size and id that
// get a connection of their own to every peer (lanes[0] among them when first == 0).
// Connections that peers open for a later lane wait in lanes[0]->early. The caller
// holds lanes[0]->lanes_mutex. Marks the range's lanes connected on success; on
// failure the links opened so far stay in their lanes (destroy them).
pcclResult_t connect_all(pcclComm *const *lanes, int first, int count, int nlanes,
                         const char *const *addrs, int timeout_ms);

}  // namespace pccl
