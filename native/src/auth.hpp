// Data-plane authentication: the primitives of the shared-secret challenge-response
// that handshake.cpp runs on every link when a secret is set (docs/security.md).
// The cryptography is OpenSSL's libcrypto (HMAC-SHA256, RAND_bytes, CRYPTO_memcmp):
// nothing here computes a hash or compares a digest by hand.
//
// The exchange, for a link from a higher rank (connector) to a lower one (acceptor):
//   connector -> acceptor   hello (kind kConnDataAuth) || nonce_c
//   acceptor  -> connector  hello || nonce_a || HMAC(k, "accept" || hello_c || hello_a || nonce_c || nonce_a)
//   connector -> acceptor   HMAC(k, "connect" || hello_c || hello_a || nonce_c || nonce_a)
// Each side proves the key over a nonce the other just drew, so a recorded exchange
// replayed to either side fails; the labels keep one side's proof from being reflected
// as the other's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "wire.hpp"

namespace pccl {
namespace auth {

constexpr size_t kNonceSize = 32;
constexpr size_t kMacSize = 32;      // HMAC-SHA256
constexpr size_t kMaxSecret = 4096;  // bytes; a longer secret is the caller's mistake

enum Role { kAccept, kConnect };

// Fills out with kNonceSize bytes from OpenSSL's CSPRNG; false if it failed.
bool new_nonce(uint8_t out[kNonceSize]);

// The proof of `role` for one link: HMAC-SHA256 keyed with `key` over the role's
// label, both hellos (connector's first) and both nonces (connector's first).
// False if libcrypto failed.
bool proof(const std::vector<uint8_t> &key, Role role, const uint8_t hello_c[wire::kHelloSize],
           const uint8_t hello_a[wire::kHelloSize], const uint8_t nonce_c[kNonceSize],
           const uint8_t nonce_a[kNonceSize], uint8_t out[kMacSize]);

// Constant-time comparison of two proofs (CRYPTO_memcmp).
bool same_proof(const uint8_t a[kMacSize], const uint8_t b[kMacSize]);

}  // namespace auth
}  // namespace pccl
