#include "comm.hpp"

#include <openssl/crypto.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "error.hpp"
#include "wire.hpp"

namespace pccl {

uint8_t *staging(pcclComm *comm, size_t bytes) {
    if (bytes <= comm->staging_size && comm->staging) return comm->staging;
    std::free(comm->staging);
    comm->staging_size = 0;
    // malloc, not a zeroing container: the buffer is fully overwritten by every op.
    comm->staging = (uint8_t *)std::malloc(bytes ? bytes : 1);
    if (!comm->staging) {
        failf(pcclOutOfMemory, "cannot allocate %zu bytes of staging memory", bytes);
        return nullptr;
    }
    comm->staging_size = bytes;
    return comm->staging;
}

pcclResult_t fail_comm(pcclComm *comm, pcclResult_t rc, const std::vector<char> *mid_frame) {
    std::string detail = thread_error();
    {
        std::lock_guard<std::mutex> g(comm->error_mutex);
        if (comm->sticky == pcclSuccess) {
            comm->sticky = rc;
            comm->sticky_detail = detail;
        }
        comm->last_error = detail;
    }
    // Tell the peers. A partial write of the ABORT frame itself also shuts the
    // link down, which the peer reads as a lost connection.
    std::string reason = "rank " + std::to_string(comm->rank) + " failed: " +
                         pcclGetErrorString(rc) + ": " + detail;
    if (reason.size() > wire::kMaxAbortPayload) reason.resize(wire::kMaxAbortPayload);
    wire::FrameHeader h;
    h.type = wire::kFrameAbort;
    h.count = uint64_t(rc);  // the origin's result code (see wire::abort_code)
    h.length = reason.size();
    uint8_t hdr[wire::kFrameHeaderSize];
    wire::encode_frame(h, hdr);
    std::vector<uint8_t> sealed;
    for (size_t i = 0; i < comm->links.size(); ++i) {
        auto &link = comm->links[i];
        if (link.fd < 0) continue;
        if (mid_frame && (*mid_frame)[i]) {
            shutdown(link.fd, SHUT_RDWR);
            continue;
        }
        iovec iov[2] = {{hdr, sizeof(hdr)}, {(void *)reason.data(), reason.size()}};
        size_t total = sizeof(hdr) + reason.size();
        if (link.seal) {  // the link's next two records (seal.hpp)
            sealed.resize(seal::kHeaderSize + size_t(seal::payload_size(reason.size())));
            if (!link.seal->out.seal(hdr, sizeof(hdr), sealed.data()) ||
                !link.seal->out.seal((const uint8_t *)reason.data(), reason.size(),
                                     sealed.data() + seal::kHeaderSize)) {
                shutdown(link.fd, SHUT_RDWR);
                continue;
            }
            iov[0] = {sealed.data(), sealed.size()};
            total = sealed.size();
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = link.seal ? 1 : 2;
        ssize_t n = sendmsg(link.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n != ssize_t(total)) shutdown(link.fd, SHUT_RDWR);
    }
    return rc;
}

pcclResult_t check_ready(pcclComm *comm) {
    std::lock_guard<std::mutex> g(comm->error_mutex);
    if (comm->sticky != pcclSuccess)
        return fail(comm->sticky, std::string("communicator failed earlier (sticky until rebuilt): ") +
                                      comm->sticky_detail);
    if (comm->aborted.load()) return fail(comm->abort_code, comm->abort_reason);
    if (!comm->connected) return fail(pcclInvalidUsage, "pcclCommConnect has not succeeded yet");
    return pcclSuccess;
}

pcclResult_t abort_error(pcclComm *comm) {
    pcclResult_t code;
    std::string reason;
    {
        std::lock_guard<std::mutex> g(comm->error_mutex);
        code = comm->abort_code;
        reason = comm->abort_reason;
    }
    return fail(code, reason);
}

void set_rcvlowat(pcclComm::Link &link, int bytes) {
    if (link.rcvlowat == bytes || link.fd < 0) return;
    setsockopt(link.fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof(bytes));
    link.rcvlowat = bytes;
}

void destroy(pcclComm *comm) {
    for (auto &link : comm->links)
        if (link.fd >= 0) close(link.fd);
    for (auto &e : comm->early) close(e.fd);
    if (comm->listen_fd >= 0 && comm->owns_listener) close(comm->listen_fd);
    if (comm->abort_fd >= 0) close(comm->abort_fd);
    std::free(comm->staging);
    if (!comm->secret.empty()) OPENSSL_cleanse(comm->secret.data(), comm->secret.size());
    delete comm;
}

}  // namespace pccl
