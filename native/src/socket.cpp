#include "socket.hpp"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "error.hpp"

namespace pccl {
namespace net {

int64_t now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

pcclResult_t parse_addr(const std::string &text, Addr *out) {
    std::string host, port;
    if (!text.empty() && text[0] == '[') {
        size_t close = text.find(']');
        if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':')
            return fail(pcclInvalidArgument, "bad address '" + text + "': expected [host]:port");
        host = text.substr(1, close - 1);
        port = text.substr(close + 2);
    } else {
        size_t colon = text.rfind(':');
        if (colon == std::string::npos)
            return fail(pcclInvalidArgument, "bad address '" + text + "': expected host:port");
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo *res = nullptr;
    int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0 || res == nullptr)
        return fail(pcclInvalidArgument, "bad address '" + text + "': " + gai_strerror(rc));
    std::memcpy(&out->ss, res->ai_addr, res->ai_addrlen);
    out->len = res->ai_addrlen;
    freeaddrinfo(res);
    return pcclSuccess;
}

std::string peer_name(int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getpeername(fd, (sockaddr *)&ss, &len) != 0) return "?";
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (ss.ss_family == AF_INET) {
        auto *a = (sockaddr_in *)&ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        port = ntohs(a->sin_port);
        return std::string(host) + ":" + std::to_string(port);
    }
    auto *a = (sockaddr_in6 *)&ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
}

pcclResult_t listen_on(const char *host, int port, int *fd_out, int *port_out) {
    Addr addr;
    if (port < 0 || port > 65535) return failf(pcclInvalidArgument, "port %d out of range", port);
    std::string text = host && *host ? std::string(host) : std::string("0.0.0.0");
    bool v6 = text.find(':') != std::string::npos;
    std::string p = ":" + std::to_string(port);
    pcclResult_t rc = parse_addr(v6 ? "[" + text + "]" + p : text + p, &addr);
    if (rc != pcclSuccess) return rc;
    int fd = socket(addr.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return fail(pcclSystemError, syscall_error("socket()", errno, "for the listener"));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (sockaddr *)&addr.ss, addr.len) != 0) {
        int err = errno;
        close(fd);
        return fail(pcclSystemError, syscall_error("bind()", err, "to " + text));
    }
    // Every lane of every higher rank may be queued here before this rank
    // accepts (the kernel caps the backlog at net.core.somaxconn).
    if (listen(fd, 4096) != 0) {
        int err = errno;
        close(fd);
        return fail(pcclSystemError, syscall_error("listen()", err, "on " + text));
    }
    sockaddr_storage bound{};
    socklen_t blen = sizeof(bound);
    getsockname(fd, (sockaddr *)&bound, &blen);
    *port_out = bound.ss_family == AF_INET ? ntohs(((sockaddr_in *)&bound)->sin_port)
                                           : ntohs(((sockaddr_in6 *)&bound)->sin6_port);
    *fd_out = fd;
    return pcclSuccess;
}

pcclResult_t configure(int fd, const std::string &who) {
    int flags = fcntl(fd, F_GETFL, 0);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
        return fail(pcclSystemError, syscall_error("fcntl(O_NONBLOCK)", errno, who));
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    int one = 1;
    // Small frames (headers, barriers) must not wait for Nagle + delayed ACK:
    // that 40-50 ms floor is what PCCL's master sockets pay.
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0)
        return fail(pcclSystemError, syscall_error("setsockopt(TCP_NODELAY)", errno, who));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    return pcclSuccess;
}

void set_link_timeout(int fd, int timeout_ms) {
    unsigned int user_timeout = unsigned(timeout_ms);
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
    // Idle links (a rank waiting for a peer that sends nothing) are probed, so their
    // silence is bounded too; TCP_USER_TIMEOUT then decides when the probes have failed.
    int idle = std::max(1, timeout_ms / 3000), interval = std::max(1, timeout_ms / 6000);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
}

void set_notsent_lowat(int fd, int bytes) {
    setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &bytes, sizeof(bytes));
}

pcclResult_t wait_fd(int fd, short events, int64_t deadline_ms, int abort_fd,
                     const std::string &who) {
    for (;;) {
        int64_t left = deadline_ms - now_ms();
        if (left <= 0) return fail(pcclTimeout, "Timed out " + who);
        pollfd fds[2] = {{fd, events, 0}, {abort_fd, POLLIN, 0}};
        int n = poll(fds, abort_fd >= 0 ? 2 : 1, int(left > 1000000 ? 1000000 : left));
        if (n < 0) {
            if (errno == EINTR) continue;
            return fail(pcclSystemError, syscall_error("poll()", errno, who));
        }
        if (n == 0) continue;  // re-evaluates the deadline
        if (abort_fd >= 0 && (fds[1].revents & POLLIN))
            return fail(pcclAborted, "aborted " + who);
        if (fds[0].revents) return pcclSuccess;
    }
}

pcclResult_t connect_start(const Addr &addr, const std::string &who, int *fd_out) {
    int fd = socket(addr.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return fail(pcclSystemError, syscall_error("socket()", errno, who));
    pcclResult_t rc = configure(fd, who);
    if (rc != pcclSuccess) {
        close(fd);
        return rc;
    }
    if (connect(fd, (const sockaddr *)&addr.ss, addr.len) != 0 && errno != EINPROGRESS) {
        int err = errno;
        close(fd);
        return fail(err == ECONNREFUSED ? pcclPeerLost : pcclSystemError,
                    syscall_error("connect()", err, who));
    }
    *fd_out = fd;
    return pcclSuccess;
}

pcclResult_t connect_finish(int fd, int64_t deadline_ms, int abort_fd, const std::string &who) {
    pcclResult_t rc = wait_fd(fd, POLLOUT, deadline_ms, abort_fd, "connecting " + who);
    if (rc != pcclSuccess) return rc;
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0)
        return fail(err == ECONNREFUSED ? pcclPeerLost : pcclSystemError,
                    syscall_error("connect()", err, who));
    return pcclSuccess;
}

pcclResult_t read_exact(int fd, void *buf, size_t len, int64_t deadline_ms, int abort_fd,
                        const std::string &who) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = recv(fd, (char *)buf + got, len - got, MSG_DONTWAIT);
        if (n > 0) {
            got += size_t(n);
            continue;
        }
        if (n == 0) return fail(pcclPeerLost, "connection closed by " + who);
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            int err = errno;
            return fail(err == ECONNRESET ? pcclPeerLost : pcclSystemError,
                        syscall_error("recv()", err, "from " + who));
        }
        pcclResult_t rc = wait_fd(fd, POLLIN, deadline_ms, abort_fd, "reading from " + who);
        if (rc != pcclSuccess) return rc;
    }
    return pcclSuccess;
}

pcclResult_t write_exact(int fd, const void *buf, size_t len, int64_t deadline_ms, int abort_fd,
                         const std::string &who) {
    size_t put = 0;
    while (put < len) {
        ssize_t n = send(fd, (const char *)buf + put, len - put, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n >= 0) {
            put += size_t(n);
            continue;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            int err = errno;
            return fail(err == EPIPE || err == ECONNRESET ? pcclPeerLost : pcclSystemError,
                        syscall_error("send()", err, "to " + who));
        }
        pcclResult_t rc = wait_fd(fd, POLLOUT, deadline_ms, abort_fd, "writing to " + who);
        if (rc != pcclSuccess) return rc;
    }
    return pcclSuccess;
}

}  // namespace net
}  // namespace pccl
