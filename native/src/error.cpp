#include "error.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace pccl {

namespace {
thread_local std::string t_last_error;
}

pcclResult_t fail(pcclResult_t rc, const std::string &detail) {
    t_last_error = detail;
    return rc;
}

pcclResult_t failf(pcclResult_t rc, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return fail(rc, buf);
}

std::string syscall_error(const char *syscall, int err, const std::string &where) {
    char buf[512];
    snprintf(buf, sizeof(buf), "%s%s%s: %s (errno %d)", syscall, where.empty() ? "" : " ",
             where.c_str(), strerror(err), err);
    return buf;
}

const char *thread_error() { return t_last_error.c_str(); }

void clear_thread_error() { t_last_error.clear(); }

bool is_network_error(pcclResult_t rc) {
    switch (rc) {
        case pcclSystemError:
        case pcclPeerLost:
        case pcclTimeout:
        case pcclAborted:
        case pcclProtocolError:
        case pcclMismatch:
        case pcclRemoteError:
        case pcclAuthError:
        case pcclIntegrityError:
            return true;
        default:
            return false;
    }
}

}  // namespace pccl

extern "C" const char *pcclGetErrorString(pcclResult_t result) {
    switch (result) {
        case pcclSuccess: return "success";
        case pcclInvalidArgument: return "invalid argument";
        case pcclInvalidUsage: return "invalid usage";
        case pcclSystemError: return "system error";
        case pcclPeerLost: return "peer lost";
        case pcclTimeout: return "timeout";
        case pcclAborted: return "aborted";
        case pcclProtocolError: return "protocol error";
        case pcclMismatch: return "collective mismatch across ranks";
        case pcclOutOfMemory: return "out of memory";
        case pcclRemoteError: return "remote error";
        case pcclAuthError: return "authentication failed";
        case pcclIntegrityError: return "integrity check failed";
        default: return "unknown result code";
    }
}

extern "C" const char *pcclGetLastError(void) { return pccl::thread_error(); }
