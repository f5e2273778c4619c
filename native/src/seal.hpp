// Record protection of an encrypted data link (docs/security.md): the keys of one link
// and the sealing and opening of its records. No socket is touched here.
//
// The construction is TLS 1.3's record protection over keys from HKDF, both done by
// OpenSSL's libcrypto (EVP): nothing here is a cipher, a MAC or a key schedule of its own.
//   keys     HKDF-SHA256 (RFC 5869): IKM = the shared secret, salt = nonce_c || nonce_a
//            (the two fresh 32-byte nonces of the link's handshake, auth.hpp), info =
//            "pccl data-plane v1 record keys" NUL hello_c hello_a; 88 bytes out: the
//            connector-to-acceptor key (32) and IV (12), then acceptor-to-connector's.
//   records  AES-256-GCM; record n of a direction (n = 0, 1, ... counted by both ends)
//            is sealed under the nonce IV XOR n (n big-endian, left-padded to 12 bytes:
//            RFC 8446 section 5.3), no additional data, a 16-byte tag after it.
// A frame (wire.hpp) travels as two records: its 40-byte header (sealed: 56 bytes), then,
// when it has a payload, the payload (sealed: its length + 16). The payload's length is
// read from the authenticated header, so no length travels outside a record. Because the
// record number is implicit, a record that was altered, dropped, replayed or moved fails
// its tag at the receiver, which then fails the op with pcclIntegrityError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "wire.hpp"

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace pccl {
namespace seal {

constexpr size_t kKeySize = 32;  // AES-256
constexpr size_t kIvSize = 12;
constexpr size_t kTagSize = 16;
constexpr size_t kHeaderSize = wire::kFrameHeaderSize + kTagSize;  // a sealed frame header

// A payload record's size on the wire: the payload and its tag (nothing for an empty one).
inline uint64_t payload_size(uint64_t len) { return len ? len + kTagSize : 0; }

// One direction of one link: the AES-256-GCM state and the number of the next record.
// A record is either sealed/opened whole (header records) or streamed: begin, then update
// over its bytes in order (in place allowed), then finish. Every call returns false if
// libcrypto failed or, for finish_open/open/peek, the tag did not verify.
class Direction {
public:
    Direction() = default;
    ~Direction();
    Direction(const Direction &) = delete;
    Direction &operator=(const Direction &) = delete;

    // Keys this direction; `seal`: this side encrypts (else decrypts). Record numbers
    // start at 0.
    bool init(const uint8_t key[kKeySize], const uint8_t iv[kIvSize], bool seal);

    // Starts the next record (number next()).
    bool begin();
    bool update(const uint8_t *in, uint8_t *out, size_t n);
    bool finish_seal(uint8_t tag[kTagSize]);
    bool finish_open(const uint8_t tag[kTagSize]);

    // A whole record: `n` bytes of `in` sealed into out[n + kTagSize] / opened from
    // in[n + kTagSize] into out[n].
    bool seal(const uint8_t *in, size_t n, uint8_t *out);
    bool open(const uint8_t *in, size_t n, uint8_t *out);
    // Opens the next record like open() without consuming its number (a peeked header).
    bool peek(const uint8_t *in, size_t n, uint8_t *out);

    // The number of the next record; rewind(n) puts it back to n <= next() after a
    // record was begun but none of its bytes left this host.
    uint64_t next() const { return next_; }
    void rewind(uint64_t n) { next_ = n; }

private:
    bool start(uint64_t n);

    EVP_CIPHER_CTX *ctx_ = nullptr;
    uint8_t iv_[kIvSize] = {};
    uint64_t next_ = 0;
    bool seal_ = false;
};

// Both directions of one link, and the sealed bytes of its outgoing frame that have not
// been sent yet (the engine fills and drains it; it lives as long as the link so that ops
// do not allocate it again).
struct LinkSeal {
    Direction out;  // what this rank sends
    Direction in;   // what this rank receives
    std::vector<uint8_t> buf;
};

// Keys a link (the construction above). `connector`: this rank opened the link (its
// hello and nonce are hello_c and nonce_c). False if libcrypto failed.
bool derive(const std::vector<uint8_t> &secret, bool connector,
            const uint8_t hello_c[wire::kHelloSize], const uint8_t hello_a[wire::kHelloSize],
            const uint8_t nonce_c[32], const uint8_t nonce_a[32], LinkSeal *out);

}  // namespace seal
}  // namespace pccl
