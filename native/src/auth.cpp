#include "auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

namespace pccl {
namespace auth {

namespace {
// Distinct labels: an acceptor's proof is never a valid connector's proof.
const char kAcceptLabel[] = "pccl data-plane v1 accept";
const char kConnectLabel[] = "pccl data-plane v1 connect";
}  // namespace

bool new_nonce(uint8_t out[kNonceSize]) { return RAND_bytes(out, int(kNonceSize)) == 1; }

bool proof(const std::vector<uint8_t> &key, Role role, const uint8_t hello_c[wire::kHelloSize],
           const uint8_t hello_a[wire::kHelloSize], const uint8_t nonce_c[kNonceSize],
           const uint8_t nonce_a[kNonceSize], uint8_t out[kMacSize]) {
    const char *label = role == kAccept ? kAcceptLabel : kConnectLabel;
    // Fixed-size fields after a NUL-terminated label: the message parses one way only.
    uint8_t msg[sizeof(kConnectLabel) + 2 * wire::kHelloSize + 2 * kNonceSize];
    size_t n = std::strlen(label) + 1;
    std::memcpy(msg, label, n);
    std::memcpy(msg + n, hello_c, wire::kHelloSize);
    n += wire::kHelloSize;
    std::memcpy(msg + n, hello_a, wire::kHelloSize);
    n += wire::kHelloSize;
    std::memcpy(msg + n, nonce_c, kNonceSize);
    n += kNonceSize;
    std::memcpy(msg + n, nonce_a, kNonceSize);
    n += kNonceSize;
    unsigned int len = 0;
    const uint8_t *k = key.empty() ? msg : key.data();  // HMAC wants a non-NULL key
    return HMAC(EVP_sha256(), k, int(key.size()), msg, n, out, &len) != nullptr &&
           len == kMacSize;
}

bool same_proof(const uint8_t a[kMacSize], const uint8_t b[kMacSize]) {
    return CRYPTO_memcmp(a, b, kMacSize) == 0;
}

}  // namespace auth
}  // namespace pccl
