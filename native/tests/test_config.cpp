// The typed config of pccl.h (pcclConfig_t) on real communicators: the
// initializer's defaults, every bound refused with pcclInvalidArgument and the
// field named, a field that opens the links refused after connect with
// pcclInvalidUsage, Get returning what Set stored, and pcclCommSetOption as a
// wrapper with its old rules. Also each collective at world size 1 through the
// shared collective path (results, checks). Built with the whole library under
// AddressSanitizer and UndefinedBehaviorSanitizer by tests/native/test_native.py.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "expect.hpp"
#include "pccl.h"

static bool detail_has(const char *text) { return std::strstr(pcclGetLastError(), text) != nullptr; }

static bool same(const pcclConfig_t &a, const pcclConfig_t &b) {
    return a.size == b.size && a.magic == b.magic && a.streams == b.streams &&
           a.link_timeout_ms == b.link_timeout_ms && a.chunk_bytes == b.chunk_bytes && a.pacing == b.pacing;
}

static pcclComm_t make(int world) {
    pcclComm_t comm = nullptr;
    if (pcclCommCreate(&comm, 0, world, 99, "127.0.0.1") != pcclSuccess) {
        fprintf(stderr, "pcclCommCreate: %s\n", pcclGetLastError());
        return nullptr;
    }
    return comm;
}

static void test_defaults() {
    pcclConfig_t cfg;
    std::memset(&cfg, 0xAB, sizeof(cfg));
    EXPECT(pcclConfigInit(&cfg) == pcclSuccess);
    EXPECT(cfg.size == sizeof(pcclConfig_t) && cfg.magic == PCCL_CONFIG_MAGIC);
    EXPECT(cfg.streams == 1 && cfg.link_timeout_ms == PCCL_DEFAULT_LINK_TIMEOUT_MS);
    EXPECT(cfg.chunk_bytes == PCCL_DEFAULT_CHUNK_BYTES && cfg.pacing == 0);
    EXPECT(pcclConfigInit(nullptr) == pcclInvalidArgument);

    // A new communicator runs with the initializer's values.
    pcclComm_t comm = make(2);
    if (!comm) return ++failures, void();
    pcclConfig_t got;
    EXPECT(pcclCommGetConfig(comm, &got) == pcclSuccess && same(got, cfg));
    EXPECT(pcclCommGetConfig(nullptr, &got) == pcclInvalidArgument);
    EXPECT(pcclCommGetConfig(comm, nullptr) == pcclInvalidArgument);
    pcclCommDestroy(comm);
}

static void test_bounds() {
    pcclComm_t comm = make(2);
    if (!comm) return ++failures, void();
    pcclConfig_t before;
    pcclCommGetConfig(comm, &before);
    struct Case {
        const char *field;
        int64_t bad, good;  // one value just outside the bounds, one on them
        void (*set)(pcclConfig_t *, int64_t);
    };
    const Case cases[] = {
        {"chunk_bytes", PCCL_MIN_CHUNK_BYTES - 1, PCCL_MIN_CHUNK_BYTES, [](pcclConfig_t *c, int64_t v) { c->chunk_bytes = v; }},
        {"chunk_bytes", PCCL_MAX_CHUNK_BYTES + 1, PCCL_MAX_CHUNK_BYTES, [](pcclConfig_t *c, int64_t v) { c->chunk_bytes = v; }},
        {"streams", 0, 1, [](pcclConfig_t *c, int64_t v) { c->streams = int(v); }},
        {"streams", PCCL_MAX_STREAMS + 1, PCCL_MAX_STREAMS, [](pcclConfig_t *c, int64_t v) { c->streams = int(v); }},
        {"link_timeout_ms", PCCL_MIN_LINK_TIMEOUT_MS - 1, PCCL_MIN_LINK_TIMEOUT_MS,
         [](pcclConfig_t *c, int64_t v) { c->link_timeout_ms = int(v); }},
        {"link_timeout_ms", PCCL_MAX_LINK_TIMEOUT_MS + 1, PCCL_MAX_LINK_TIMEOUT_MS,
         [](pcclConfig_t *c, int64_t v) { c->link_timeout_ms = int(v); }},
        {"pacing", -2, -1, [](pcclConfig_t *c, int64_t v) { c->pacing = v; }},
        {"pacing", PCCL_MAX_PACING + 1, PCCL_MAX_PACING, [](pcclConfig_t *c, int64_t v) { c->pacing = v; }},
    };
    for (const Case &k : cases) {
        pcclConfig_t cfg;
        pcclConfigInit(&cfg);
        cfg.chunk_bytes = 65536;  // a valid change beside the bad field: stored only with it
        k.set(&cfg, k.bad);
        EXPECT(pcclCommSetConfig(comm, &cfg) == pcclInvalidArgument);
        EXPECT(detail_has(k.field) && detail_has("must be"));
        std::string typed = pcclGetLastError();
        pcclConfig_t now;
        pcclCommGetConfig(comm, &now);
        EXPECT(same(now, before));  // all or nothing
        // The by-name wrapper refuses the same value with the same message.
        EXPECT(pcclCommSetOption(comm, k.field, k.bad) == pcclInvalidArgument);
        EXPECT(typed == pcclGetLastError());
        k.set(&cfg, k.good);
        EXPECT(pcclCommSetConfig(comm, &cfg) == pcclSuccess);
        EXPECT(pcclCommSetConfig(comm, &before) == pcclSuccess);
    }
    // Values out of an int's range reach the by-name form whole, never truncated.
    EXPECT(pcclCommSetOption(comm, "streams", (int64_t(1) << 32) + 1) == pcclInvalidArgument);
    EXPECT(detail_has("got 4294967297"));
    EXPECT(pcclCommSetOption(comm, "no_such_option", 1) == pcclInvalidArgument);
    EXPECT(detail_has("unknown option 'no_such_option'"));

    // A config the initializer never filled (zeroed, or of another size) is refused.
    pcclConfig_t zero;
    std::memset(&zero, 0, sizeof(zero));
    EXPECT(pcclCommSetConfig(comm, &zero) == pcclInvalidArgument && detail_has("pcclConfigInit"));
    pcclConfig_t other;
    pcclConfigInit(&other);
    other.size -= 1;
    EXPECT(pcclCommSetConfig(comm, &other) == pcclInvalidArgument);
    EXPECT(pcclCommSetConfig(nullptr, &other) == pcclInvalidArgument);
    EXPECT(pcclCommSetConfig(comm, nullptr) == pcclInvalidArgument);
    pcclCommDestroy(comm);
}

// Connects a world of one (no peer: every link is up at once).
static pcclComm_t connected_single() {
    pcclComm_t comm = make(1);
    if (!comm) return nullptr;
    int port = 0;
    pcclCommGetPort(comm, &port);
    std::string addr = "127.0.0.1:" + std::to_string(port);
    const char *addrs[1] = {addr.c_str()};
    if (pcclCommConnect(comm, addrs, 5000) != pcclSuccess) {
        fprintf(stderr, "pcclCommConnect: %s\n", pcclGetLastError());
        pcclCommDestroy(comm);
        return nullptr;
    }
    return comm;
}

static void test_set_get_and_connect() {
    pcclComm_t comm = make(1);
    if (!comm) return ++failures, void();
    pcclConfig_t cfg;
    pcclConfigInit(&cfg);
    cfg.streams = 3;
    cfg.link_timeout_ms = 4000;
    cfg.chunk_bytes = 12288;
    cfg.pacing = 125000000;
    EXPECT(pcclCommSetConfig(comm, &cfg) == pcclSuccess);
    pcclConfig_t got;
    EXPECT(pcclCommGetConfig(comm, &got) == pcclSuccess && same(got, cfg));
    EXPECT(pcclCommSetOption(comm, "pacing", -1) == pcclSuccess);
    EXPECT(pcclCommGetConfig(comm, &got) == pcclSuccess && got.pacing == -1 && got.streams == 3);
    pcclCommDestroy(comm);

    comm = connected_single();
    if (!comm) return ++failures, void();
    pcclCommGetConfig(comm, &cfg);
    // Streams and the link timeout opened the links: a change is refused, and nothing
    // else of that config is stored.
    pcclConfig_t change = cfg;
    change.streams = 2;
    change.chunk_bytes = 8192;
    EXPECT(pcclCommSetConfig(comm, &change) == pcclInvalidUsage && detail_has("streams"));
    change = cfg;
    change.link_timeout_ms = 2000;
    change.pacing = 5;
    EXPECT(pcclCommSetConfig(comm, &change) == pcclInvalidUsage && detail_has("link_timeout_ms"));
    EXPECT(pcclCommGetConfig(comm, &got) == pcclSuccess && same(got, cfg));
    // Read, change what may change, set back.
    change = cfg;
    change.chunk_bytes = 8192;
    change.pacing = 5;
    EXPECT(pcclCommSetConfig(comm, &change) == pcclSuccess);
    EXPECT(pcclCommGetConfig(comm, &got) == pcclSuccess && same(got, change));
    // The by-name form refuses them after connect even at their current value.
    EXPECT(pcclCommSetOption(comm, "streams", cfg.streams) == pcclInvalidUsage);
    EXPECT(pcclCommSetOption(comm, "link_timeout_ms", cfg.link_timeout_ms) == pcclInvalidUsage);
    EXPECT(pcclCommSetOption(comm, "chunk_bytes", 4096) == pcclSuccess);
    pcclCommDestroy(comm);
}

// Every collective in a world of one, through the shared path: the result is the
// input, aliasing allowed; a bad argument is refused before the op lock.
static void test_single_rank_collectives() {
    pcclComm_t comm = connected_single();
    if (!comm) return ++failures, void();
    float in[4] = {1, 2, 3, 4}, out[4] = {0, 0, 0, 0};
    EXPECT(pcclAllReduce(comm, in, out, 4, pcclFloat32, pcclSum, 0, 1000) == pcclSuccess);
    EXPECT(std::memcmp(in, out, sizeof(in)) == 0);
    std::memset(out, 0, sizeof(out));
    EXPECT(pcclReduceScatter(comm, in, out, 4, pcclFloat32, pcclMax, 0, 1000) == pcclSuccess);
    EXPECT(std::memcmp(in, out, sizeof(in)) == 0);
    std::memset(out, 0, sizeof(out));
    EXPECT(pcclAllGather(comm, in, out, 4, pcclFloat32, 0, 1000) == pcclSuccess);
    EXPECT(std::memcmp(in, out, sizeof(in)) == 0);
    EXPECT(pcclAllGather(comm, out, out, 4, pcclFloat32, 0, 1000) == pcclSuccess);
    EXPECT(pcclBroadcast(comm, out, 4, pcclFloat32, 0, 0, 1000) == pcclSuccess);
    EXPECT(std::memcmp(in, out, sizeof(in)) == 0);
    EXPECT(pcclBarrier(comm, 0, 1000) == pcclSuccess);
    uint64_t sc[1] = {3}, sd[1] = {1}, rc[1] = {3}, rd[1] = {0};
    std::memset(out, 0, sizeof(out));
    EXPECT(pcclAllToAllv(comm, in, sc, sd, out, rc, rd, pcclFloat32, 0, 1000) == pcclSuccess);
    EXPECT(out[0] == 2 && out[1] == 3 && out[2] == 4 && out[3] == 0);
    // Quantized: alone, the input quantized once (block 4, int8: scale 4 / 127).
    float q[4] = {4, -2, 1, 0.5f};
    EXPECT(pcclAllReduceQuantized(comm, q, out, 4, pcclFloat32, pcclSum, pcclQuantInt8, 4, 0, 1000) ==
           pcclSuccess);
    EXPECT(out[0] > 3.99f && out[0] < 4.01f && out[1] > -2.02f && out[1] < -1.98f);

    // Checks in each collective's order: dtype before op before sizes before buffers.
    EXPECT(pcclAllReduce(comm, in, out, 4, pcclNumTypes, pcclNumOps, 0, 1000) == pcclInvalidArgument);
    EXPECT(detail_has("invalid dtype"));
    EXPECT(pcclReduceScatter(comm, nullptr, out, 4, pcclFloat32, pcclNumOps, 0, 1000) == pcclInvalidArgument);
    EXPECT(detail_has("invalid reduce op"));
    EXPECT(pcclAllGather(comm, nullptr, out, 4, pcclFloat32, 0, 0) == pcclInvalidArgument);
    EXPECT(detail_has("NULL buffer for 4 elements"));
    EXPECT(pcclBroadcast(comm, out, 4, pcclFloat32, 1, 0, 1000) == pcclInvalidArgument);
    EXPECT(detail_has("root 1 out of range for world size 1"));
    EXPECT(pcclBarrier(comm, 0, 0) == pcclInvalidArgument && detail_has("timeout_ms must be > 0"));
    sc[0] = 2;
    EXPECT(pcclAllToAllv(comm, in, sc, sd, out, rc, rd, pcclFloat32, 0, 1000) == pcclInvalidArgument);
    EXPECT(detail_has("sends itself 2 elements but expects 3"));
    EXPECT(pcclAllReduceQuantized(comm, q, out, 4, pcclInt32, pcclSum, pcclQuantInt8, 4, 0, 1000) ==
           pcclInvalidArgument);
    EXPECT(detail_has("float32, float16 or bfloat16"));
    EXPECT(pcclAllReduce(nullptr, in, out, 4, pcclFloat32, pcclSum, 0, 1000) == pcclInvalidArgument);
    EXPECT(detail_has("comm is NULL"));
    pcclCommDestroy(comm);
}

int main() {
    test_defaults();
    test_bounds();
    test_set_get_and_connect();
    test_single_rank_collectives();
    return report("config and single-rank tests");
}
