#include "seal.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>

#include <climits>
#include <cstring>

namespace pccl {
namespace seal {

namespace {
const char kKeysLabel[] = "pccl data-plane v1 record keys";
constexpr size_t kNonce = 32;
}  // namespace

Direction::~Direction() { EVP_CIPHER_CTX_free(ctx_); }  // the free cleanses the key schedule

bool Direction::init(const uint8_t key[kKeySize], const uint8_t iv[kIvSize], bool seal) {
    if (!ctx_) ctx_ = EVP_CIPHER_CTX_new();
    if (!ctx_) return false;
    std::memcpy(iv_, iv, kIvSize);
    next_ = 0;
    seal_ = seal;
    // GCM's default IV length is 12 bytes, the size of the per-record nonce.
    return EVP_CipherInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, key, nullptr, seal ? 1 : 0) == 1;
}

bool Direction::start(uint64_t n) {
    if (!ctx_) return false;
    uint8_t nonce[kIvSize];
    std::memcpy(nonce, iv_, kIvSize);
    for (int i = 0; i < 8; ++i) nonce[kIvSize - 1 - size_t(i)] ^= uint8_t(n >> (8 * i));
    return EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, nonce, -1) == 1;
}

bool Direction::begin() {
    if (!start(next_)) return false;
    ++next_;
    return true;
}

bool Direction::update(const uint8_t *in, uint8_t *out, size_t n) {
    while (n > 0) {
        int piece = n > size_t(INT_MAX / 2) ? INT_MAX / 2 : int(n);
        int len = 0;
        if (EVP_CipherUpdate(ctx_, out, &len, in, piece) != 1 || len != piece) return false;
        in += piece;
        out += piece;
        n -= size_t(piece);
    }
    return true;
}

bool Direction::finish_seal(uint8_t tag[kTagSize]) {
    uint8_t none[16];
    int len = 0;
    return seal_ && EVP_EncryptFinal_ex(ctx_, none, &len) == 1 && len == 0 &&
           EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, int(kTagSize), tag) == 1;
}

bool Direction::finish_open(const uint8_t tag[kTagSize]) {
    uint8_t none[16];
    int len = 0;
    // The ctrl takes a non-const pointer; it only copies the tag.
    return !seal_ &&
           EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, int(kTagSize), (void *)tag) == 1 &&
           EVP_DecryptFinal_ex(ctx_, none, &len) == 1 && len == 0;
}

bool Direction::seal(const uint8_t *in, size_t n, uint8_t *out) {
    return begin() && update(in, out, n) && finish_seal(out + n);
}

bool Direction::open(const uint8_t *in, size_t n, uint8_t *out) {
    return begin() && update(in, out, n) && finish_open(in + n);
}

bool Direction::peek(const uint8_t *in, size_t n, uint8_t *out) {
    return start(next_) && update(in, out, n) && finish_open(in + n);
}

bool derive(const std::vector<uint8_t> &secret, bool connector,
            const uint8_t hello_c[wire::kHelloSize], const uint8_t hello_a[wire::kHelloSize],
            const uint8_t nonce_c[kNonce], const uint8_t nonce_a[kNonce], LinkSeal *out) {
    uint8_t salt[2 * kNonce];
    std::memcpy(salt, nonce_c, kNonce);
    std::memcpy(salt + kNonce, nonce_a, kNonce);
    uint8_t info[sizeof(kKeysLabel) + 2 * wire::kHelloSize];  // the label's NUL included
    std::memcpy(info, kKeysLabel, sizeof(kKeysLabel));
    std::memcpy(info + sizeof(kKeysLabel), hello_c, wire::kHelloSize);
    std::memcpy(info + sizeof(kKeysLabel) + wire::kHelloSize, hello_a, wire::kHelloSize);
    uint8_t okm[2 * (kKeySize + kIvSize)];
    size_t okm_len = sizeof(okm);
    EVP_PKEY_CTX *kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
    bool ok = kdf && !secret.empty() && EVP_PKEY_derive_init(kdf) > 0 &&
              EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) > 0 &&
              EVP_PKEY_CTX_set1_hkdf_salt(kdf, salt, int(sizeof(salt))) > 0 &&
              EVP_PKEY_CTX_set1_hkdf_key(kdf, secret.data(), int(secret.size())) > 0 &&
              EVP_PKEY_CTX_add1_hkdf_info(kdf, info, int(sizeof(info))) > 0 &&
              EVP_PKEY_derive(kdf, okm, &okm_len) > 0 && okm_len == sizeof(okm);
    EVP_PKEY_CTX_free(kdf);
    const uint8_t *c2a = okm, *a2c = okm + kKeySize + kIvSize;
    if (ok) {
        const uint8_t *mine = connector ? c2a : a2c, *theirs = connector ? a2c : c2a;
        ok = out->out.init(mine, mine + kKeySize, true) &&
             out->in.init(theirs, theirs + kKeySize, false);
    }
    OPENSSL_cleanse(okm, sizeof(okm));
    return ok;
}

}  // namespace seal
}  // namespace pccl
