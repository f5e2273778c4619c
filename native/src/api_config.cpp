// A communicator's tuning (pcclConfig_t, after nccl's ncclConfig_t) and its
// shared secret. pcclCommSetOption, the older by-name form, sets one field
// through the same checks and stores.
#include <cstring>

#include "api.hpp"
#include "auth.hpp"

using namespace pccl;

namespace {

static_assert(PCCL_MAX_PACING == int64_t(1) << 40, "pccl.h's PCCL_MAX_PACING is 2^40");

// The fields of pcclConfig_t, as bits: which ones a call sets.
enum Field : unsigned {
    kChunkBytes = 1u << 0,
    kStreams = 1u << 1,
    kLinkTimeout = 1u << 2,
    kPacing = 1u << 3,
    kAllFields = kChunkBytes | kStreams | kLinkTimeout | kPacing,
    kUnderOpLock = kChunkBytes | kStreams | kLinkTimeout,  // read by operations under op_mutex
};

// Bounds take int64_t: pcclCommSetOption's value is checked before it is narrowed.
pcclResult_t check_field(Field f, int64_t value) {
    switch (f) {
    case kChunkBytes:
        PCCL_REQUIRE(value >= PCCL_MIN_CHUNK_BYTES && value <= PCCL_MAX_CHUNK_BYTES,
                     "chunk_bytes must be in [%llu, %llu], got %lld",
                     (unsigned long long)PCCL_MIN_CHUNK_BYTES, (unsigned long long)PCCL_MAX_CHUNK_BYTES,
                     (long long)value);
        return pcclSuccess;
    case kStreams:
        PCCL_REQUIRE(value >= 1 && value <= PCCL_MAX_STREAMS, "streams must be in [1, %d], got %lld",
                     PCCL_MAX_STREAMS, (long long)value);
        return pcclSuccess;
    case kLinkTimeout:
        PCCL_REQUIRE(value >= PCCL_MIN_LINK_TIMEOUT_MS && value <= PCCL_MAX_LINK_TIMEOUT_MS,
                     "link_timeout_ms must be in [%d, %d], got %lld", PCCL_MIN_LINK_TIMEOUT_MS,
                     PCCL_MAX_LINK_TIMEOUT_MS, (long long)value);
        return pcclSuccess;
    case kPacing:
        PCCL_REQUIRE(value >= -1 && value <= PCCL_MAX_PACING,
                     "pacing must be -1 (measured), 0 (off) or bytes/s up to %lld, got %lld",
                     (long long)PCCL_MAX_PACING, (long long)value);
        return pcclSuccess;
    default:
        break;
    }
    return failf(pcclInvalidArgument, "unknown config field %u", unsigned(f));
}

int64_t field_value(const pcclConfig_t &cfg, Field f) {
    switch (f) {
    case kChunkBytes: return cfg.chunk_bytes;
    case kStreams: return cfg.streams;
    case kLinkTimeout: return cfg.link_timeout_ms;
    default: return cfg.pacing;
    }
}

// Stores the `fields` of cfg (already checked) in comm, or none of them. Streams and
// link_timeout_ms open the links, so once comm is connected they are refused: when
// `named` (pcclCommSetOption names them) whatever their value, as it always was; else
// only a change, so that a config read back can be set again. Takes op_mutex only for
// the fields operations read under it: setting the pacing never waits for an operation.
pcclResult_t store(pcclComm *comm, const pcclConfig_t &cfg, unsigned fields, bool named) {
    if (fields & kUnderOpLock) {
        std::lock_guard<std::mutex> g(comm->op_mutex);
        if (comm->connected && (fields & kStreams) && (named || cfg.streams != comm->streams))
            return fail(pcclInvalidUsage, "streams must be set before the communicator connects");
        if (comm->connected && (fields & kLinkTimeout) &&
            (named || cfg.link_timeout_ms != comm->link_timeout_ms))
            return fail(pcclInvalidUsage, "link_timeout_ms must be set before connecting");
        if (fields & kChunkBytes) comm->chunk_bytes = uint64_t(cfg.chunk_bytes);
        if (fields & kStreams) comm->streams = comm->stripe = cfg.streams;
        if (fields & kLinkTimeout) comm->link_timeout_ms = cfg.link_timeout_ms;
    }
    if (fields & kPacing) {
        std::lock_guard<std::mutex> g(comm->pacing->mutex);
        comm->pacing->mode = cfg.pacing;
    }
    return pcclSuccess;
}

}  // namespace

extern "C" {

pcclResult_t pcclConfigInit(pcclConfig_t *config) {
    clear_thread_error();
    PCCL_REQUIRE(config, "config is NULL");
    std::memset(config, 0, sizeof(*config));
    config->size = sizeof(pcclConfig_t);
    config->magic = PCCL_CONFIG_MAGIC;
    config->streams = 1;
    config->link_timeout_ms = PCCL_DEFAULT_LINK_TIMEOUT_MS;
    config->chunk_bytes = PCCL_DEFAULT_CHUNK_BYTES;
    config->pacing = 0;
    return pcclSuccess;
}

pcclResult_t pcclCommSetConfig(pcclComm_t comm, const pcclConfig_t *config) {
    clear_thread_error();
    PCCL_REQUIRE(comm && config, "NULL argument");
    PCCL_REQUIRE(config->size == sizeof(pcclConfig_t) && config->magic == PCCL_CONFIG_MAGIC,
                 "the config was not filled by pcclConfigInit or pcclCommGetConfig (size %zu, magic 0x%x)",
                 config->size, config->magic);
    for (Field f : {kChunkBytes, kStreams, kLinkTimeout, kPacing})
        PCCL_CHECK(check_field(f, field_value(*config, f)));
    return store(comm, *config, kAllFields, false);
}

pcclResult_t pcclCommGetConfig(pcclComm_t comm, pcclConfig_t *config) {
    PCCL_CHECK(pcclConfigInit(config));
    PCCL_REQUIRE(comm, "NULL argument");
    {
        std::lock_guard<std::mutex> g(comm->op_mutex);
        config->chunk_bytes = int64_t(comm->chunk_bytes);
        config->streams = comm->streams;
        config->link_timeout_ms = comm->link_timeout_ms;
    }
    std::lock_guard<std::mutex> g(comm->pacing->mutex);
    config->pacing = comm->pacing->mode;
    return pcclSuccess;
}

pcclResult_t pcclCommSetOption(pcclComm_t comm, const char *name, int64_t value) {
    clear_thread_error();
    PCCL_REQUIRE(comm && name, "NULL argument");
    static const struct {
        const char *name;
        Field field;
    } kNames[] = {{"chunk_bytes", kChunkBytes}, {"streams", kStreams},
                  {"link_timeout_ms", kLinkTimeout}, {"pacing", kPacing}};
    for (const auto &n : kNames) {
        if (std::strcmp(name, n.name) != 0) continue;
        PCCL_CHECK(check_field(n.field, value));
        pcclConfig_t cfg;
        pcclConfigInit(&cfg);
        switch (n.field) {
        case kChunkBytes: cfg.chunk_bytes = value; break;
        case kStreams: cfg.streams = int(value); break;
        case kLinkTimeout: cfg.link_timeout_ms = int(value); break;
        default: cfg.pacing = value; break;
        }
        return store(comm, cfg, n.field, true);
    }
    return failf(pcclInvalidArgument, "unknown option '%s'", name);
}

pcclResult_t pcclCommSetSecret(pcclComm_t comm, const uint8_t *secret, size_t len) {
    clear_thread_error();
    PCCL_REQUIRE(comm && (secret || len == 0), "NULL argument");
    PCCL_REQUIRE(len <= auth::kMaxSecret, "a secret is at most %zu bytes, got %zu",
                 auth::kMaxSecret, len);
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (comm->connected) return fail(pcclInvalidUsage, "the secret must be set before connecting");
    comm->secret.assign(secret, secret + len);
    return pcclSuccess;
}

pcclResult_t pcclCommSetId(pcclComm_t comm, uint64_t comm_id) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "NULL argument");
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (comm->connected)
        return fail(pcclInvalidUsage, "a communicator's id is fixed once it connects");
    comm->comm_id = comm_id;
    return pcclSuccess;
}

pcclResult_t pcclCommSetEncryption(pcclComm_t comm, int enabled) {
    clear_thread_error();
    PCCL_REQUIRE(comm, "NULL argument");
    std::lock_guard<std::mutex> g(comm->op_mutex);
    if (comm->connected)
        return fail(pcclInvalidUsage, "encryption must be chosen before connecting");
    comm->encrypt = enabled != 0;
    return pcclSuccess;
}

}  // extern "C"
