/* The WAN emulator's link model: pure arithmetic on times and sizes, no I/O (wanem_link.c).
 *
 * One direction of one host pair: a packet occupies the link for size / rate after the
 * previous one finished (busy_until), then travels delay; so release = max(arrival,
 * busy_until) + size / rate + delay, the release of the one before plus size / rate once a
 * queue has formed. Bytes still waiting for the link ((busy_until - arrival) x rate) are the
 * queue: a packet that would take it above queue_ms worth of bytes at the rate (at least
 * MIN_QUEUE_BYTES) is dropped at the tail. Random loss drops a packet of n MSS segments with
 * probability 1 - (1 - loss)^n, the chance that any one of its segments would have been lost
 * on a real path (a GSO packet is dropped whole: the emulator does not split packets).
 */
#ifndef WANEM_LINK_H
#define WANEM_LINK_H

#include <stddef.h>
#include <stdint.h>

#define VNET_HDR_LEN 10             /* sizeof(struct virtio_net_hdr), set explicitly on TUN */
#define MAX_FRAME (65536 + 64)      /* the vnet header and an IPv4 packet (<= 65535 bytes) */
#define MIN_QUEUE_BYTES (2 * 65536) /* the queue always holds two GSO packets */
#define MAX_HOSTS 32
#define MAX_LINE 512 /* one command line, newline included */
#define MAX_TOKENS 8

enum { ADMITTED = 0, DROP_LOSS = 1, DROP_QUEUE = 2 };

struct counters {
    uint64_t pkts_in, bytes_in, pkts_out, bytes_out, drop_loss, drop_queue, max_queue_bytes;
};

struct pkt; /* the forwarder's packet slot */

/* One direction of one host pair. Times in seconds, sizes in bytes. */
struct link {
    int exists, src, dst, active; /* active: index in the forwarder's active list, or -1 */
    double delay, rate, loss, queue_bytes; /* s, bytes/s (0: unlimited), [0, 1), bytes */
    double busy_until;   /* when the link finishes sending what it already holds */
    double last_release; /* releases never go backwards, even after a change of delay */
    uint64_t rng;
    struct counters st;
    struct pkt *head, *tail; /* the FIFO of packets in flight, release times ascending */
    uint64_t in_flight;
};

/* Seeds the link's loss generator from (seed, src, dst): one generator per direction, so a
 * link's loss pattern does not depend on the others' traffic. */
void link_seed(struct link *l, uint64_t seed, int src, int dst);

/* Sets delay_ms (ms, >= 0), rate_mbit (10^6 bit/s of IP bytes, 0: unlimited), loss (per MSS
 * segment, in [0, 1)) and queue_ms (ms of transmission at the rate, >= 0); packets in flight
 * keep theirs. Returns -1, changing nothing, when one is out of range or not finite. */
int link_configure(struct link *l, double delay_ms, double rate_mbit, double loss,
                   double queue_ms);

/* Admits a packet of size wire bytes and segments MSS segments arriving at now (s): returns
 * ADMITTED with *release (s) set, or DROP_LOSS / DROP_QUEUE; counts it either way. */
int link_admit(struct link *l, double now, uint32_t size, uint32_t segments, double *release);

/* The wire bytes and MSS segments of an n-byte TUN frame f (virtio_net_hdr first, n >=
 * VNET_HDR_LEN + 20): a GSO packet stands for that many IP packets that each carry the IP and
 * TCP/UDP headers, so the rate counts the IP bytes a real link would carry. */
void wire_size(const unsigned char *f, size_t n, uint32_t *size, uint32_t *segments);

/* Prints the link's counters as one JSON object on stdout (no newline). */
void print_link(const struct link *l);

/* Splits s in place at blanks into at most max tokens; returns the count, -1 beyond max. */
int split(char *s, char **tok, int max);

/* A whole-string decimal number into *out; 0, or -1 when s is not one. */
int number(const char *s, double *out);

/* A whole-string integer in [lo, hi] into *out; 0, or -1 when s is not one. */
int integer(const char *s, long long lo, long long hi, long long *out);

/* link_configure from the four tokens DELAY_MS RATE_MBIT LOSS QUEUE_MS; -1 when malformed. */
int configure_from(struct link *l, char **tok);

/* The test mode (--model): one link driven by stdin lines, answers on stdout:
 *     link DELAY_MS RATE_MBIT LOSS QUEUE_MS SEED  -> ok | error ...  (a fresh link 0 -> 1)
 *     set DELAY_MS RATE_MBIT LOSS QUEUE_MS        -> ok | error ...
 *     admit NOW_S SIZE SEGMENTS                   -> RELEASE_S | loss | queue
 *     stats                                       -> the counters (JSON)
 *     wire LEN HEX                                -> SIZE SEGMENTS of a LEN-byte frame whose
 *                                                    headers are HEX (nothing after is read)
 *     constants                                   -> {"min_queue_bytes": ..., ...}
 * Returns the exit status (1 on a line longer than MAX_LINE). */
int link_model_main(void);

#endif
