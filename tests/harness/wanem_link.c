/* The WAN emulator's link model and its test mode (wanem_link.h says what each does). */
#define _POSIX_C_SOURCE 200809L /* strtok_r */
#include "wanem_link.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void link_seed(struct link *l, uint64_t seed, int src, int dst)
{
    uint64_t s = seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(1 + src * MAX_HOSTS + dst));
    l->rng = splitmix64(&s);
}

int link_configure(struct link *l, double delay_ms, double rate_mbit, double loss,
                   double queue_ms)
{
    if (!(isfinite(delay_ms) && isfinite(rate_mbit) && isfinite(queue_ms) && delay_ms >= 0 &&
          rate_mbit >= 0 && loss >= 0 && loss < 1 && queue_ms >= 0))
        return -1;
    l->delay = delay_ms / 1e3;
    l->rate = rate_mbit * 1e6 / 8;
    l->loss = loss;
    l->queue_bytes = fmax(MIN_QUEUE_BYTES, queue_ms / 1e3 * l->rate);
    return 0;
}

int link_admit(struct link *l, double now, uint32_t size, uint32_t segments, double *release)
{
    struct counters *st = &l->st;
    double r;
    st->pkts_in++;
    st->bytes_in += size;
    if (l->loss > 0 &&
        (splitmix64(&l->rng) >> 11) * 0x1.0p-53 < 1.0 - pow(1.0 - l->loss, segments)) {
        st->drop_loss++;
        return DROP_LOSS;
    }
    if (l->rate > 0) {
        double queued = fmax(0.0, l->busy_until - now) * l->rate;
        if (queued + size > l->queue_bytes) {
            st->drop_queue++;
            return DROP_QUEUE;
        }
        if ((uint64_t)(queued + size) > st->max_queue_bytes)
            st->max_queue_bytes = (uint64_t)(queued + size);
        l->busy_until = fmax(now, l->busy_until) + size / l->rate;
        r = l->busy_until + l->delay;
    } else {
        r = now + l->delay;
    }
    r = fmax(r, l->last_release); /* FIFO per link */
    l->last_release = r;
    st->pkts_out++;
    st->bytes_out += size;
    *release = r;
    return ADMITTED;
}

void wire_size(const unsigned char *f, size_t n, uint32_t *size, uint32_t *segments)
{
    size_t ip_len = n - VNET_HDR_LEN, ihl, hdr, l4;
    const unsigned char *ip = f + VNET_HDR_LEN;
    uint16_t gso_size;
    int proto;
    *size = (uint32_t)ip_len;
    *segments = 1;
    if (f[1] == 0) /* gso_type VIRTIO_NET_HDR_GSO_NONE: one plain packet */
        return;
    memcpy(&gso_size, f + 4, sizeof gso_size); /* the header is in host byte order */
    if (ip[0] >> 4 == 4) {
        ihl = (size_t)(ip[0] & 0x0F) * 4;
        proto = ip[9];
    } else { /* IPv6 without extension headers, as the kernel's TSO6 packets are */
        ihl = 40;
        proto = ip[6];
    }
    l4 = VNET_HDR_LEN + ihl;
    hdr = proto == IPPROTO_TCP && n >= l4 + 13 ? ihl + (size_t)(f[l4 + 12] >> 4) * 4 : ihl + 8;
    if (gso_size && ip_len > hdr) {
        size_t s = (ip_len - hdr + gso_size - 1) / gso_size;
        if (s > 1) {
            *segments = (uint32_t)s;
            *size = (uint32_t)(ip_len + (s - 1) * hdr);
        }
    }
}

void print_link(const struct link *l)
{
    const struct counters *s = &l->st;
    printf("{\"src\": %d, \"dst\": %d, \"in_flight\": %" PRIu64 ", \"pkts_in\": %" PRIu64
           ", \"bytes_in\": %" PRIu64 ", \"pkts_out\": %" PRIu64 ", \"bytes_out\": %" PRIu64
           ", \"drop_loss\": %" PRIu64 ", \"drop_queue\": %" PRIu64
           ", \"max_queue_bytes\": %" PRIu64 "}",
           l->src, l->dst, l->in_flight, s->pkts_in, s->bytes_in, s->pkts_out, s->bytes_out,
           s->drop_loss, s->drop_queue, s->max_queue_bytes);
}


int split(char *s, char **tok, int max)
{
    int n = 0;
    for (char *save = NULL, *t = strtok_r(s, " \t\r", &save); t;
         t = strtok_r(NULL, " \t\r", &save)) {
        if (n == max)
            return -1;
        tok[n++] = t;
    }
    return n;
}

int number(const char *s, double *out)
{
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return *s && !*end && !errno ? 0 : -1;
}

int integer(const char *s, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    *out = strtoll(s, &end, 10);
    return *s && !*end && !errno && *out >= lo && *out <= hi ? 0 : -1;
}

int configure_from(struct link *l, char **tok)
{
    double v[4];
    for (int i = 0; i < 4; i++)
        if (number(tok[i], &v[i]))
            return -1;
    return link_configure(l, v[0], v[1], v[2], v[3]);
}

#define WIRE_HEAD 128 /* vnet header, IPv4 header with options, TCP header */

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int link_model_main(void)
{
    struct link l = {0};
    char line[MAX_LINE], *tok[MAX_TOKENS];
    int have = 0;
    while (fgets(line, sizeof line, stdin)) {
        if (!strchr(line, '\n') && !feof(stdin)) {
            fprintf(stderr, "wanem_forwarder: a line longer than %d bytes\n", MAX_LINE - 1);
            return 1;
        }
        line[strcspn(line, "\n")] = '\0';
        int n = split(line, tok, MAX_TOKENS);
        long long seed, size, segs;
        double now, release;
        if (n <= 0) {
            continue;
        } else if (!strcmp(tok[0], "constants") && n == 1) {
            printf("{\"min_queue_bytes\": %d, \"vnet_hdr_len\": %d, \"max_frame\": %d}\n",
                   MIN_QUEUE_BYTES, VNET_HDR_LEN, MAX_FRAME);
        } else if (!strcmp(tok[0], "link") && n == 6) {
            struct link fresh = {0};
            if (integer(tok[5], INT64_MIN, INT64_MAX, &seed) || configure_from(&fresh, tok + 1)) {
                puts("error bad link");
                continue;
            }
            l = fresh;
            l.dst = 1; /* the model is link 0 -> 1 */
            link_seed(&l, (uint64_t)seed, 0, 1);
            have = 1;
            puts("ok");
        } else if (!strcmp(tok[0], "set") && n == 5 && have) {
            puts(configure_from(&l, tok + 1) ? "error bad link" : "ok");
        } else if (!strcmp(tok[0], "admit") && n == 4 && have && !number(tok[1], &now) &&
                   !integer(tok[2], 0, MAX_FRAME, &size) && !integer(tok[3], 1, 65535, &segs)) {
            int rc = link_admit(&l, now, (uint32_t)size, (uint32_t)segs, &release);
            if (rc == ADMITTED)
                printf("%.17g\n", release);
            else
                puts(rc == DROP_LOSS ? "loss" : "queue");
        } else if (!strcmp(tok[0], "stats") && n == 1 && have) {
            print_link(&l);
            putchar('\n');
        } else if (!strcmp(tok[0], "wire") && n == 3 && strlen(tok[2]) % 2 == 0 &&
                   strlen(tok[2]) <= 2 * WIRE_HEAD &&
                   !integer(tok[1], VNET_HDR_LEN + 20, MAX_FRAME, &size)) {
            /* Only the headers are given: wire_size reads nothing past them. */
            unsigned char f[WIRE_HEAD] = {0};
            uint32_t wsize, wsegs;
            int ok = 1;
            for (size_t i = 0; 2 * i < strlen(tok[2]); i++) {
                int hi = hex_digit(tok[2][2 * i]), lo = hex_digit(tok[2][2 * i + 1]);
                ok &= hi >= 0 && lo >= 0;
                f[i] = (unsigned char)(hi << 4 | lo);
            }
            if (!ok) {
                puts("error bad hex");
                continue;
            }
            wire_size(f, (size_t)size, &wsize, &wsegs);
            printf("%" PRIu32 " %" PRIu32 "\n", wsize, wsegs);
        } else {
            puts("error bad command");
        }
    }
    return 0;
}
