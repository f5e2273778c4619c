// pcclCommGetLastError against a thread that keeps failing ops on the same communicator.
// One thread runs collectives that fail (the communicator is not connected), each failure
// replacing comm->last_error under error_mutex; the others read the detail and walk it, as
// an exception message does. Built and run under ThreadSanitizer by tests/native/
// test_native.py: a reader that uses the string after the mutex is released is a data race
// (and, when the string is reallocated, a use after free).
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "pccl.h"

int main() {
    pcclComm_t comm = nullptr;
    if (pcclCommCreate(&comm, 0, 2, 42, "127.0.0.1") != pcclSuccess) {
        fprintf(stderr, "pcclCommCreate failed: %s\n", pcclGetLastError());
        return 2;
    }
    std::atomic<bool> stop{false};
    float buf[4] = {1, 2, 3, 4};
    std::thread writer([&] {
        for (int i = 0; i < 20000; ++i) {
            // Alternate two failures whose details differ in length, so the string is
            // rewritten (and at times reallocated) while readers look at it.
            if (i % 2)
                pcclAllReduce(comm, buf, buf, 4, pcclFloat32, pcclSum, 0, 1000);
            else
                pcclBroadcast(comm, buf, 4, pcclFloat32, 7, 0, 1000);
        }
        stop.store(true);
    });
    std::vector<std::thread> readers;
    std::atomic<size_t> seen{0};
    for (int r = 0; r < 2; ++r)
        readers.emplace_back([&] {
            size_t n = 0;
            while (!stop.load()) {
                const char *detail = pcclCommGetLastError(comm);
                std::string copy(detail, std::strlen(detail));
                n += copy.size();
            }
            seen += n;
        });
    writer.join();
    for (auto &t : readers) t.join();
    std::string last = pcclCommGetLastError(comm);
    pcclCommDestroy(comm);
    if (last.empty()) {
        fprintf(stderr, "no error detail was recorded\n");
        return 1;
    }
    printf("last error: %s\nall passed (%zu bytes read)\n", last.c_str(), size_t(seen));
    return 0;
}
