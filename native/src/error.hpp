// Error detail for the C API: a per-thread "last error" string and helpers that
// format syscall failures (syscall name, errno text, peer) at the point of failure.
#pragma once

#include <string>

#include "pccl.h"

namespace pccl {

// Records `detail` as the calling thread's last error and returns `rc`, so a
// failing path reads `return fail(pcclTimeout, "...")`.
pcclResult_t fail(pcclResult_t rc, const std::string &detail);

// printf-style variant of fail().
pcclResult_t failf(pcclResult_t rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// "connect() to rank 2 (10.0.0.2:4000): Connection refused (errno 111)".
std::string syscall_error(const char *syscall, int err, const std::string &where);

const char *thread_error();
void clear_thread_error();

// True for result codes caused by the network or the peers (sticky on a communicator).
bool is_network_error(pcclResult_t rc);

}  // namespace pccl
