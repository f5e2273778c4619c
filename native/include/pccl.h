/*
 * pccl.h - the public C99 API of torch_pccl's native data plane.
 *
 * Model: nccl.h. An opaque communicator handle, every function returns a
 * pcclResult_t, outputs go through pointers. Detail for a failed call (which
 * peer, which syscall, errno) is read with pcclCommGetLastError().
 *
 * Errors are split into the caller's mistakes (pcclInvalidArgument,
 * pcclInvalidUsage) and the network's (pcclSystemError, pcclPeerLost,
 * pcclTimeout, pcclAborted, pcclProtocolError, pcclMismatch). A network error
 * is sticky: every later call on the communicator returns it again until the
 * communicator is destroyed and rebuilt.
 *
 * Every collective is blocking and bounded by its timeout_ms deadline; a
 * concurrent pcclCommAbort() wakes it promptly. A failed collective never
 * leaves the output buffer partly written: results are staged and copied out
 * only after the whole operation succeeded.
 *
 * Thread safety: collectives on one communicator are serialised by an
 * internal lock, in the order the calls take it. pcclCommAbort() may be called
 * from any thread at any time.
 */
#ifndef PCCL_H
#define PCCL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cffi-cdef-begin: the builder passes the text up to cffi-cdef-end to ffi.cdef() as is. */
#define PCCL_VERSION_MAJOR 0
#define PCCL_VERSION_MINOR 1

/* The longest deadline a call takes: timeout_ms is a C int, so 1 .. INT_MAX milliseconds. */
#define PCCL_MAX_TIMEOUT_MS 2147483647

typedef enum {
    pcclSuccess = 0,
    pcclInvalidArgument = 1, /* caller: a bad pointer, count, dtype, op or rank */
    pcclInvalidUsage = 2,    /* caller: call out of order (e.g. collective before connect) */
    pcclSystemError = 3,     /* network: a syscall failed (message names it and errno) */
    pcclPeerLost = 4,        /* network: a peer closed or reset its connection */
    pcclTimeout = 5,         /* network: the deadline passed before the peers answered */
    pcclAborted = 6,         /* pcclCommAbort() was called */
    pcclProtocolError = 7,   /* network: bad magic, version, or a frame out of bounds */
    pcclMismatch = 8,        /* peers called different collectives, counts, dtypes or ops */
    pcclOutOfMemory = 9,     /* an allocation for staging buffers failed */
    pcclRemoteError = 10,    /* another peer failed this collective and told us */
    pcclAuthError = 11,      /* a peer failed the shared-secret challenge, or only one side has one */
    pcclIntegrityError = 12, /* network: an encrypted record was altered, replayed, reordered or dropped */
    pcclNumResults = 13
} pcclResult_t;

typedef enum {
    pcclFloat32 = 0,
    pcclFloat64 = 1,
    pcclFloat16 = 2,
    pcclBFloat16 = 3,
    pcclInt8 = 4,
    pcclUInt8 = 5,
    pcclInt32 = 6,
    pcclInt64 = 7,
    pcclNumTypes = 8
} pcclDataType_t;

typedef enum {
    pcclSum = 0,
    pcclAvg = 1, /* sum then divide by world size; integers divide truncating toward zero */
    pcclMin = 2,
    pcclMax = 3,
    pcclProd = 4,
    pcclNumOps = 5
} pcclRedOp_t;

/* Codes of pcclAllReduceQuantized: symmetric absmax per block, one float32 scale per block. */
typedef enum {
    pcclQuantInt8 = 0, /* codes in [-127, 127], one byte each */
    pcclQuantInt4 = 1, /* codes in [-7, 7], two per byte */
    pcclNumQuantTypes = 2
} pcclQuantType_t;

/* Opaque communicator: one rank's view of a group of world_size peers. */
typedef struct pcclComm *pcclComm_t;

/* Returns a static, human-readable name for a result code. */
const char *pcclGetErrorString(pcclResult_t result);

/*
 * Returns the detail of the calling thread's last failed pccl call ("" if none):
 * which peer, which syscall, errno. Valid until the thread's next pccl call.
 */
const char *pcclGetLastError(void);

/* Returns the size in bytes of one element of dtype, or 0 if dtype is invalid. */
size_t pcclTypeSize(pcclDataType_t dtype);

/*
 * Creates a communicator for `rank` of `world_size` and starts listening on
 * listen_host (numeric IPv4/IPv6 address or NULL for all interfaces), port 0.
 * comm_id must be equal on all ranks of the group and fresh for each group,
 * so connections from a stale group are refused.
 * Returns pcclSuccess, pcclInvalidArgument, pcclSystemError, pcclOutOfMemory.
 */
pcclResult_t pcclCommCreate(pcclComm_t *comm, int rank, int world_size, uint64_t comm_id,
                            const char *listen_host);

/*
 * A listening socket that outlives communicators: a peer keeps one data-plane
 * address while the group around it is rebuilt (one communicator per membership
 * epoch). Connections for another communicator id are refused by the handshake.
 */
typedef struct pcclListener *pcclListener_t;

/* Listens on host (numeric address, NULL for all interfaces) at port (0: any free port).
 * Returns pcclSuccess, pcclInvalidArgument, pcclSystemError, pcclOutOfMemory. */
pcclResult_t pcclListenerCreate(pcclListener_t *listener, const char *host, int port);

/* Writes the listener's TCP port. Returns pcclSuccess, pcclInvalidArgument. */
pcclResult_t pcclListenerGetPort(pcclListener_t listener, int *port);

/* Closes the listener; NULL is accepted. Communicators created on it must be destroyed
 * first. Returns pcclSuccess. */
pcclResult_t pcclListenerDestroy(pcclListener_t listener);

/* As pcclCommCreate, but accepts its links on an existing listener, which it borrows
 * (the listener stays open when the communicator is destroyed).
 * Returns pcclSuccess, pcclInvalidArgument, pcclSystemError, pcclOutOfMemory. */
pcclResult_t pcclCommCreateOnListener(pcclComm_t *comm, int rank, int world_size,
                                      uint64_t comm_id, pcclListener_t listener);

/*
 * Replaces comm's id (see pcclCommCreate) before it connects: a rank can listen, and
 * publish its address, before it learns the group's id, so the rendezvous needs one
 * exchange fewer. Returns pcclSuccess, pcclInvalidArgument, pcclInvalidUsage (after
 * connecting).
 */
pcclResult_t pcclCommSetId(pcclComm_t comm, uint64_t comm_id);

/* Writes the TCP port the communicator listens on. Returns pcclSuccess, pcclInvalidArgument. */
pcclResult_t pcclCommGetPort(pcclComm_t comm, int *port);

/*
 * Connects to every other rank; addrs[i] is "host:port" of rank i (numeric host,
 * IPv6 in brackets), the entry for this rank is ignored. Blocks until all links
 * are up or timeout_ms passes.
 * Returns pcclSuccess, pcclInvalidArgument, pcclInvalidUsage, pcclSystemError,
 * pcclPeerLost, pcclTimeout, pcclAborted, pcclProtocolError.
 */
pcclResult_t pcclCommConnect(pcclComm_t comm, const char *const *addrs, int timeout_ms);

/* The most lanes pcclCommConnectLanes opens to each peer. */
#define PCCL_MAX_LANES 64

/*
 * As pcclCommConnect, but opens nlanes (1 .. PCCL_MAX_LANES) lanes to every peer in
 * one connect phase, each of the config's streams count of TCP connections (1 by
 * default; see pcclConfig_t); each hello names its lane and the sender's
 * lane count, so every rank must pass the same nlanes (a differing count is
 * refused like a foreign group). Lane 0's links stay in comm; lane l >= 1 is a
 * new communicator written to lanes_out[l - 1] (room for nlanes - 1 handles;
 * NULL is allowed when nlanes == 1). A lane shares nothing with comm but rank,
 * world size, id and chunk size: its own lock, staging memory, sticky error and
 * abort flag, so collectives on different lanes run at once and fail
 * independently (each lane numbers its own collectives, so ranks must issue
 * the same ops on the same lane). Lanes have no listener; pcclCommGetPort
 * reports comm's port. Abort and destroy each lane with pcclCommAbort and
 * pcclCommDestroy, as comm (which does not touch them). On failure every
 * lanes_out entry is NULL and comm is left as a failed pcclCommConnect leaves it.
 * Returns as pcclCommConnect.
 */
pcclResult_t pcclCommConnectLanes(pcclComm_t comm, const char *const *addrs, int nlanes,
                                  pcclComm_t *lanes_out, int timeout_ms);

/*
 * Lanes on demand: connects lanes first .. first+count-1 of a group of nlanes lanes
 * (1 .. PCCL_MAX_LANES), so a group can open the connections of the lanes it does not
 * use yet later. With first == 0, comm must be unconnected: it connects as
 * pcclCommConnectLanes(nlanes = count) but names nlanes in its hellos, and lanes 1 ..
 * count-1 go to lanes_out[0 .. count-2]. With first >= 1, comm (lane 0) must have
 * connected lanes 0 .. first-1 of the same nlanes: the count new lanes go to
 * lanes_out[0 .. count-1]. Such a later range does not wait for lane 0's collectives,
 * which may run meanwhile, and its failure does not fail lane 0 (only its new lanes
 * are destroyed; every lanes_out entry is then NULL). Every rank must connect the same
 * ranges in the same order; a peer's connection for a later range that arrives while
 * this rank accepts an earlier one waits for it (at most as many as the later lanes
 * have). Returns as pcclCommConnect.
 */
pcclResult_t pcclCommConnectLaneRange(pcclComm_t comm, const char *const *addrs, int first,
                                      int count, int nlanes, pcclComm_t *lanes_out,
                                      int timeout_ms);

/*
 * After pcclCommConnect(Lanes) failed: writes to ranks[0 .. *n-1] the ranks (ascending) to or
 * from which some link (any lane or stream) did not come up before the failure, this rank
 * excluded; `ranks` has room for world_size entries. After a successful connect *n is 0; before
 * any connect every other rank is listed. Lets a caller tell which member it could not reach.
 * Returns pcclSuccess, pcclInvalidArgument (NULL argument).
 */
pcclResult_t pcclCommGetUnreachedRanks(pcclComm_t comm, int *ranks, int *n);

/* Sets an abort flag that wakes and fails every blocking call on comm. Safe from any thread. */
pcclResult_t pcclCommAbort(pcclComm_t comm);

/*
 * Like pcclCommAbort, but the call in flight and every later call fail with `code`
 * and `reason` (the communicator's sticky error and last error) instead of
 * pcclAborted: e.g. pcclPeerLost when the control plane learnt that a member was
 * dropped, so a caller blocked on that member's bytes fails at once with the cause.
 * `code` is a network error (pcclPeerLost, pcclTimeout, pcclRemoteError, ...);
 * `reason` (NULL: none) is cut to PCCL_MAX_ABORT_REASON bytes. The first abort or
 * network error wins; later ones change nothing. Safe from any thread. Returns
 * pcclSuccess, pcclInvalidArgument (NULL comm, a code that is not a network error).
 */
#define PCCL_MAX_ABORT_REASON 1024
pcclResult_t pcclCommAbortWithError(pcclComm_t comm, pcclResult_t code, const char *reason);

/* Closes all sockets and frees comm; NULL is accepted. Returns pcclSuccess. */
pcclResult_t pcclCommDestroy(pcclComm_t comm);

/* Writes this communicator's rank and world size. Returns pcclSuccess, pcclInvalidArgument. */
pcclResult_t pcclCommGetInfo(pcclComm_t comm, int *rank, int *world_size);

/* Returns the sticky error of comm (pcclSuccess if none) without clearing it. */
pcclResult_t pcclCommGetError(pcclComm_t comm);

/* Returns the detail of comm's last failure ("" if none): a copy owned by the calling thread,
 * valid until that thread's next pcclCommGetLastError, whatever other threads do with comm. */
const char *pcclCommGetLastError(pcclComm_t comm);

/*
 * Sets the ring order of the ring collectives (all-reduce, reduce-scatter, all-gather,
 * broadcast, barrier): position p of the ring holds rank order[p], a permutation of
 * 0 .. n-1 with n the world size; each rank sends to the next position and receives
 * from the previous one, so a ring can avoid slow links. Ranks and every result's
 * layout are unchanged; results stay bit-identical on every rank. Every rank must
 * set the same order at the same point of its op sequence. The identity is rank order.
 * Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommSetRingOrder(pcclComm_t comm, const int *order, int n);

/* Writes the ring order (world size entries; rank order if never set). Returns
 * pcclSuccess, pcclInvalidArgument. */
pcclResult_t pcclCommGetRingOrder(pcclComm_t comm, int *order);

/*
 * Tuning of a communicator, modelled on nccl's ncclConfig_t: fill one with
 * pcclConfigInit (the defaults of a new communicator), change the fields you
 * need, and apply it with pcclCommSetConfig; pcclCommGetConfig reads it back.
 * The lanes of pcclCommConnectLanes start with comm's config; after that a config
 * applies to the communicator it is set on (set each lane), except pacing, which the
 * lanes of a communicator share.
 */
#define PCCL_CONFIG_MAGIC 0x50434346 /* "PCCF": marks a config filled by pcclConfigInit */
#define PCCL_DEFAULT_CHUNK_BYTES 1048576
#define PCCL_MIN_CHUNK_BYTES 4096
#define PCCL_MAX_CHUNK_BYTES 268435456
/* The most TCP streams per peer and lane (the streams field). */
#define PCCL_MAX_STREAMS 64
/* The link_timeout_ms field's default and bounds: 30 s, 1 s .. 1 h without any acknowledgement. */
#define PCCL_DEFAULT_LINK_TIMEOUT_MS 30000
#define PCCL_MIN_LINK_TIMEOUT_MS 1000
#define PCCL_MAX_LINK_TIMEOUT_MS 3600000
/* The largest pinned pacing cap, bytes per second (2^40, ~8.8 Tbit/s: beyond any NIC). */
#define PCCL_MAX_PACING 1099511627776

typedef struct {
    /* Set by pcclConfigInit and pcclCommGetConfig; a config without them is refused. */
    size_t size;        /* sizeof(pcclConfig_t) */
    unsigned int magic; /* PCCL_CONFIG_MAGIC */
    /*
     * TCP connections to each peer on each lane, 1 .. PCCL_MAX_STREAMS (default 1); set
     * before connecting, to the same count on every rank. With S streams the chunks of
     * every operation go over whichever of the S connections to each peer has room, so
     * one operation fills links that one TCP stream cannot (long fat pipes) and a slow
     * stream takes few chunks; results stay bit-identical and losing any one stream
     * fails the op as a lost peer.
     */
    int streams;
    /*
     * How long a link may go without the peer's kernel acknowledging anything while
     * there is data to send or a keepalive probe out (TCP_USER_TIMEOUT, and keepalive
     * probes on idle links), milliseconds, PCCL_MIN_LINK_TIMEOUT_MS ..
     * PCCL_MAX_LINK_TIMEOUT_MS (default PCCL_DEFAULT_LINK_TIMEOUT_MS); set before
     * connecting. A path that silently drops everything, while the peer may still be
     * alive and heartbeating to its master, then fails the op as a lost peer instead of
     * at its deadline. A peer that is slow to read is not caught by it: its kernel keeps
     * acknowledging window probes.
     */
    int link_timeout_ms;
    /* Pipeline chunk size, bytes, PCCL_MIN_CHUNK_BYTES .. PCCL_MAX_CHUNK_BYTES
     * (default PCCL_DEFAULT_CHUNK_BYTES); any time. */
    int64_t chunk_bytes;
    /*
     * Caps what the streams to one peer send together (SO_MAX_PACING_RATE split over the
     * S streams; with one stream nothing is capped), so that they do not overrun the
     * path's queue together: 0 (the default here; torch_pccl sets -1 between hosts) is off;
     * 1 .. PCCL_MAX_PACING pins the cap at that many bytes per second per peer; -1
     * measures each peer's path during operations and caps at 1.05 x that (src/pacing.hpp
     * says how). Any time.
     */
    int64_t pacing;
} pcclConfig_t;

/* Fills config with the defaults of a new communicator, its size and its magic.
 * Returns pcclSuccess, pcclInvalidArgument (NULL config). */
pcclResult_t pcclConfigInit(pcclConfig_t *config);

/*
 * Applies every field of config to comm, or none when one is out of bounds or would
 * change streams or link_timeout_ms after connecting (the same values are accepted, so
 * a config read with pcclCommGetConfig can be changed and set back); waits for an
 * operation in flight on comm. Returns pcclSuccess, pcclInvalidArgument (NULL argument,
 * a config not filled by pcclConfigInit or pcclCommGetConfig, a field out of bounds,
 * named in the last error), pcclInvalidUsage (streams or link_timeout_ms changed after
 * connecting).
 */
pcclResult_t pcclCommSetConfig(pcclComm_t comm, const pcclConfig_t *config);

/* Writes comm's current config (size and magic included); waits for an operation in
 * flight on comm. Returns pcclSuccess, pcclInvalidArgument (NULL argument). */
pcclResult_t pcclCommGetConfig(pcclComm_t comm, pcclConfig_t *config);

/*
 * Kept for compatibility: sets one field of comm's config by name ("chunk_bytes",
 * "streams", "link_timeout_ms" or "pacing"; see pcclConfig_t), with the bounds and
 * messages of pcclCommSetConfig; "streams" and "link_timeout_ms" are refused after
 * connecting even at their current value. Returns pcclSuccess, pcclInvalidArgument
 * (NULL argument, unknown name, value out of bounds), pcclInvalidUsage ("streams" or
 * "link_timeout_ms" after connecting).
 */
pcclResult_t pcclCommSetOption(pcclComm_t comm, const char *name, int64_t value);

/*
 * Sets the shared secret (len bytes, 1 .. 4096; len 0 clears it) that every link of this
 * communicator must prove with an HMAC-SHA256 challenge-response over fresh nonces from
 * both ends before any frame flows (docs/security.md). Set it before connecting, to the
 * same bytes on every rank; a rank with a secret refuses a peer without one and the
 * reverse, both failing with pcclAuthError. Returns pcclSuccess, pcclInvalidArgument,
 * pcclInvalidUsage (after connecting).
 */
pcclResult_t pcclCommSetSecret(pcclComm_t comm, const uint8_t *secret, size_t len);

/*
 * Whether comm's links, when it has a secret, are encrypted and authenticated record by
 * record (enabled != 0, the default) or carry plain frames after the challenge-response
 * (0). Encrypted records are AES-256-GCM under keys that HKDF-SHA256 derives per link from
 * the secret and both ends' nonces (docs/security.md); a record altered, dropped, replayed
 * or reordered fails the receiving rank's op with pcclIntegrityError. Set it before
 * connecting, alike on every rank: a rank refuses a peer that differs (pcclAuthError).
 * Without a secret it has no effect. Returns pcclSuccess, pcclInvalidArgument,
 * pcclInvalidUsage (after connecting).
 */
pcclResult_t pcclCommSetEncryption(pcclComm_t comm, int enabled);

/*
 * Writes the pacing of the streams to rank peer, bytes per second: *estimate, the rate
 * measured so far (0: none yet), and *cap, what the streams may send together now
 * (0: no cap). Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommGetPacing(pcclComm_t comm, int peer, double *estimate, double *cap);

/*
 * Writes what the rate controller of the path to rank peer (src/rate.hpp) says: *filled,
 * 1 once its start-up found the pipe full (0 before, or with pacing not measured), and
 * *stripe, the streams per peer (1 .. the connected count) it asks for from what each
 * stripe carried (a hill climb): comm's stripe while nothing says otherwise. Ranks agree
 * on a stripe (pcclCommSetStripe) before it takes effect. Waits for an operation in
 * flight on comm. Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommGetPathState(pcclComm_t comm, int peer, int *filled, int *stripe);

/*
 * Writes the rate the streams to rank peer carried in comm's last striped operation, bytes
 * per second: its fastest window of about one round trip in which the streams had bytes
 * waiting (0: none, one stream, or pacing off). Unlike the estimate it is comm's own, not
 * its lanes'; it tells whether comm's connections have grown their windows to the path.
 * Waits for an operation in flight on comm. Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommGetLastRate(pcclComm_t comm, int peer, double *rate);

/*
 * Sets how many of the streams connected to each peer (config field streams) comm's
 * operations deal their frames over from the next operation on: the first `streams` of
 * them, 1 .. the connected count. Every rank must set the same value between the same two
 * operations of comm (its frames are matched to streams by count on both ends), e.g. after
 * an all-reduce that agreed on it; the others stay connected and idle. Waits for an
 * operation in flight on comm. Returns pcclSuccess, pcclInvalidArgument (NULL comm,
 * streams out of range).
 */
pcclResult_t pcclCommSetStripe(pcclComm_t comm, int streams);

/*
 * Writes the smallest round-trip time the kernel has seen on comm's streams to rank peer,
 * seconds (tcpi_min_rtt; 0: none seen, or no TCP_INFO). With a rate from pcclCommGetPacing
 * it gives the path's bandwidth-delay product. Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommGetMinRtt(pcclComm_t comm, int peer, double *seconds);

/*
 * Writes the number of payload and header bytes this communicator has sent
 * and received since it was created. Returns pcclSuccess, pcclInvalidArgument.
 */
pcclResult_t pcclCommGetStats(pcclComm_t comm, uint64_t *bytes_sent, uint64_t *bytes_received);

/*
 * All-reduce of `count` elements: recvbuf = op over ranks of sendbuf
 * (sendbuf == recvbuf is allowed). Pipelined ring reduce-scatter then
 * all-gather; each chunk is finalised by one owner and its bytes forwarded, so
 * every rank ends with identical bytes. float16/bfloat16 reduce in float32 and
 * round once per step.
 * Returns pcclSuccess, pcclInvalidArgument, pcclInvalidUsage, or a network error.
 */
pcclResult_t pcclAllReduce(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, pcclRedOp_t op, uint32_t tag, int timeout_ms);

/* The largest block of pcclAllReduceQuantized (frame headers carry it in 16 bits). */
#define PCCL_MAX_QUANT_BLOCK 65535

/*
 * All-reduce of `count` elements with block-wise quantized traffic:
 * recvbuf ~= op over ranks of sendbuf (sendbuf == recvbuf is allowed). dtype
 * float32, float16 or bfloat16; op pcclSum or pcclAvg; qtype pcclQuantInt8 or
 * pcclQuantInt4; block (1 .. PCCL_MAX_QUANT_BLOCK) elements share one float32
 * scale. Rank r owns a block-aligned slice; every rank quantizes the other
 * owners' slices of its input once and sends them (all-to-all); the owner adds
 * the W-1 decoded contributions and its own exact slice in float32 in rank
 * order, applies AVG, quantizes the result once and all-gathers it; every rank
 * decodes the same bytes, so results are bit-identical on every rank (also at
 * world size 1, where the result is the input quantized once). Per element the
 * error is at most the sum over the other ranks of half their input block's
 * scale (divided by the world size for AVG) plus half the result block's scale.
 * Bytes sent per rank: about 2 (W-1)/W * count * (bits / 8 + 4 / block). Peers
 * that pass another qtype or block fail with pcclMismatch.
 * Returns pcclSuccess, pcclInvalidArgument, pcclInvalidUsage, pcclOutOfMemory,
 * or a network error.
 */
pcclResult_t pcclAllReduceQuantized(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                                    uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                                    pcclQuantType_t qtype, uint32_t block, uint32_t tag,
                                    int timeout_ms);

/*
 * Broadcast of `count` elements of buf from rank root to every rank (pipelined
 * along the ring starting at root). Returns as pcclAllReduce.
 */
pcclResult_t pcclBroadcast(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                           int root, uint32_t tag, int timeout_ms);

/*
 * All-gather: recvbuf[r * count .. (r+1) * count) = sendbuf of rank r; recvbuf
 * holds world_size * count elements. Returns as pcclAllReduce.
 */
pcclResult_t pcclAllGather(pcclComm_t comm, const void *sendbuf, void *recvbuf, uint64_t count,
                           pcclDataType_t dtype, uint32_t tag, int timeout_ms);

/*
 * Reduce-scatter: sendbuf holds world_size * count elements; recvbuf (count
 * elements) = op over ranks of sendbuf[rank * count .. (rank+1) * count).
 * Returns as pcclAllReduce.
 */
pcclResult_t pcclReduceScatter(pcclComm_t comm, const void *sendbuf, void *recvbuf,
                               uint64_t count, pcclDataType_t dtype, pcclRedOp_t op,
                               uint32_t tag, int timeout_ms);

/*
 * All-to-all with per-peer counts and displacements, in elements:
 * sendbuf[sdispls[p] .. + scounts[p]) goes to rank p and arrives at that
 * rank's recvbuf[rdispls[me] .. + rcounts[me]). Zero counts are allowed
 * (gather and scatter are all-to-alls with one non-zero side).
 * Returns as pcclAllReduce.
 */
pcclResult_t pcclAllToAllv(pcclComm_t comm, const void *sendbuf, const uint64_t *scounts,
                           const uint64_t *sdispls, void *recvbuf, const uint64_t *rcounts,
                           const uint64_t *rdispls, pcclDataType_t dtype, uint32_t tag,
                           int timeout_ms);

/* Sends count elements to rank peer; matched by a pcclRecv with the same tag. Returns as pcclAllReduce. */
pcclResult_t pcclSend(pcclComm_t comm, const void *buf, uint64_t count, pcclDataType_t dtype,
                      int peer, uint32_t tag, int timeout_ms);

/* Receives count elements from rank peer into buf. Returns as pcclAllReduce. */
pcclResult_t pcclRecv(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                      int peer, uint32_t tag, int timeout_ms);

/*
 * Receives count elements into buf from whichever rank's next message to this
 * rank is a pcclSend with the same tag, and sets *src to that rank; messages
 * from one peer still arrive in the order it sent them. Returns as pcclAllReduce.
 */
pcclResult_t pcclRecvAnySource(pcclComm_t comm, void *buf, uint64_t count, pcclDataType_t dtype,
                               uint32_t tag, int timeout_ms, int *src);

/* One send or receive of a pcclP2PBatch. */
typedef struct {
    int peer;             /* the other rank */
    int is_send;          /* 1: send buf to peer; 0: receive from peer into buf */
    void *buf;
    uint64_t count;       /* elements */
    pcclDataType_t dtype;
    uint32_t tag;
} pcclP2POp_t;

/*
 * Runs nops sends and receives at once, so ranks that send to each other do not
 * wait on each other (what isend/irecv pairs need). Messages to or from one peer
 * are matched in the order they appear in ops and across calls; receive buffers
 * are written only if the whole batch succeeds. Returns as pcclAllReduce.
 */
pcclResult_t pcclP2PBatch(pcclComm_t comm, const pcclP2POp_t *ops, int nops, int timeout_ms);

/*
 * As pcclP2PBatch, but receives land directly in their buffers as bytes arrive,
 * without a staging copy: after a failure a receive buffer holds unspecified
 * bytes. For bulk transfers whose caller stages and verifies what it receives
 * (shared-state sync). Returns as pcclAllReduce.
 */
pcclResult_t pcclTransferBatch(pcclComm_t comm, const pcclP2POp_t *ops, int nops, int timeout_ms);

/* Returns once every rank has entered the barrier. Returns as pcclAllReduce. */
pcclResult_t pcclBarrier(pcclComm_t comm, uint32_t tag, int timeout_ms);
/* cffi-cdef-end */

#ifdef __cplusplus
}
#endif

#endif /* PCCL_H */
