// TCP sockets: address parsing, a listener, connecting with a deadline, socket
// options, and blocking-with-deadline exact reads and writes used by the
// handshake. Every failure returns a result code with the syscall, errno and
// remote address recorded (error.hpp). Waits use poll() on the socket and the
// communicator's abort eventfd, never sleeps.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "pccl.h"

namespace pccl {
namespace net {

struct Addr {
    sockaddr_storage ss{};
    socklen_t len = 0;
};

// Monotonic clock in milliseconds.
int64_t now_ms();

// Parses "host:port" or "[v6-host]:port" with a numeric host. pcclInvalidArgument on error.
pcclResult_t parse_addr(const std::string &text, Addr *out);

// "host:port" text of a socket's peer ("?" if unknown).
std::string peer_name(int fd);

// Listens on host (numeric; NULL = all interfaces) at `port` (0: an ephemeral port);
// writes the bound port.
pcclResult_t listen_on(const char *host, int port, int *fd_out, int *port_out);

// Makes fd non-blocking, close-on-exec, TCP_NODELAY, keepalive.
pcclResult_t configure(int fd, const std::string &who);

// Bounds how long the link may go unacknowledged with data or a keepalive probe out
// (TCP_USER_TIMEOUT; keepalive probes from timeout/3 of idleness, every timeout/6), so a
// path that silently drops everything fails the link with ETIMEDOUT. Best effort.
void set_link_timeout(int fd, int timeout_ms);

// Bounds the data the kernel holds for fd that it has not sent yet (TCP_NOTSENT_LOWAT):
// sends stop and poll() reports fd not writable above it. Best effort.
void set_notsent_lowat(int fd, int bytes);

// Waits until fd has `events` (POLLIN/POLLOUT) or the deadline passes or abort_fd
// becomes readable. pcclSuccess, pcclTimeout, pcclAborted or pcclSystemError.
pcclResult_t wait_fd(int fd, short events, int64_t deadline_ms, int abort_fd, const std::string &who);

// A non-blocking connect in two halves, so that many connections can be in their
// TCP handshake at once (one round trip for all of them on a long link):
// connect_start opens a configured non-blocking socket and starts connecting
// (*fd_out is set only on success); connect_finish waits for that connect to
// complete and reports its error; it leaves the fd open either way.
pcclResult_t connect_start(const Addr &addr, const std::string &who, int *fd_out);
pcclResult_t connect_finish(int fd, int64_t deadline_ms, int abort_fd, const std::string &who);

// Reads / writes exactly len bytes on a non-blocking fd, waiting with wait_fd.
// EOF while reading is pcclPeerLost.
pcclResult_t read_exact(int fd, void *buf, size_t len, int64_t deadline_ms, int abort_fd,
                        const std::string &who);
pcclResult_t write_exact(int fd, const void *buf, size_t len, int64_t deadline_ms, int abort_fd,
                         const std::string &who);

}  // namespace net
}  // namespace pccl
