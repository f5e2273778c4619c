/* The WAN emulator's packet mover: one process, one TUN device per host, one poll loop.
 *
 * tests/harness/wanem.py compiles this file with wanem_link.c (standard C library and Linux
 * headers only) and starts it as
 *
 *     wanem_forwarder [--seed N] --host NETNS_PATH DEV IPV4 ... --link SRC DST DELAY_MS
 *                     RATE_MBIT LOSS QUEUE_MS ...
 *
 * one --host per host (host i is the i-th, 0-based) and one --link per directed pair (SRC and
 * DST are host indices; RATE_MBIT 0 means unlimited; units as in link_configure). For every
 * host it enters the namespace (setns on NETNS_PATH), opens /dev/net/tun there, creates DEV
 * with IFF_TUN | IFF_NO_PI | IFF_VNET_HDR and enables TUNSETOFFLOAD CSUM | TSO4 | TSO6, so the
 * kernel hands it whole GSO packets of up to 64 KiB behind a 10-byte virtio_net_hdr; a packet
 * is written to the destination's TUN exactly as read, header included. The TUN devices are
 * not persistent: they vanish with this process, and a dead forwarder shows as "Network is
 * unreachable", never as a silent black hole.
 *
 * A packet read from host i's TUN goes to the host whose address is its IPv4 destination,
 * through the link (i, j) of wanem_link.h (delay, rate, tail-drop queue, loss seeded by
 * (seed, i, j)). Packets that are not IPv4 or go to no known host are counted as unroutable.
 * Per link, admitted packets wait in a FIFO (release times never decrease along a link);
 * the loop sleeps in ppoll until a packet, a command or the earliest head's release.
 *
 * Protocol with the parent: stdout gets one JSON line {"event": "ready", ...} once every TUN
 * is open, or {"event": "unavailable", "error": ...} (exit status 2) when one cannot be; then
 * one JSON line per command line read on stdin:
 *     stats                                   -> {"event": "stats", "links": [...], ...},
 *                                                after every TUN has been read empty
 *     set SRC DST DELAY_MS RATE_MBIT LOSS QUEUE_MS -> {"event": "set", "src": i, "dst": j}
 * and {"event": "error", "error": TEXT} for a malformed one. End of file on stdin makes it
 * exit: it cannot outlive the process that started it. Fatal errors go to stderr, exit 1.
 *
 *     wanem_forwarder --model
 *
 * is a test mode with no TUN: the link arithmetic alone (link_model_main in wanem_link.h), as
 * tests/core/test_wanem.py drives it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/if_tun.h>
#include <math.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "wanem_link.h"

#define READ_BATCH 64 /* packets from one TUN per wake-up before the others get a turn */
/* A TUN device queues at most 500 packets (its txqueuelen): reading this many empties what it
 * held when stats was asked, and bounds the drain while senders keep adding. */
#define DRAIN_LIMIT 8192
#define N_CLASSES 10  /* slot sizes 128 << c for c < 9, then MAX_FRAME */
#define SLAB_BYTES ((size_t)1 << 20)
/* Rate-limited links hold at most their queue plus rate x delay; this bounds what unlimited
 * links with a long delay may hold. A packet beyond it is dropped as if the queue were full. */
#define MAX_POOL_BYTES ((size_t)512 << 20)

/* ------------------------------------------------------------------ packet slots */

/* One packet waiting in a link's FIFO; slots come from per-size free lists, carved from 1 MiB
 * slabs that are never returned, so the steady state allocates nothing. */
struct pkt {
    struct pkt *next;
    double release; /* CLOCK_MONOTONIC seconds */
    uint32_t len;
    uint32_t cls;
    unsigned char data[];
};

static struct pkt *free_slots[N_CLASSES];
static size_t pool_bytes;

static size_t class_size(int c) { return c == N_CLASSES - 1 ? MAX_FRAME : (size_t)128 << c; }

static int class_of(size_t len)
{
    int c = 0;
    while (c < N_CLASSES - 1 && class_size(c) < len)
        c++;
    return c;
}

static struct pkt *slot_get(int c)
{
    if (!free_slots[c]) {
        size_t slot = (sizeof(struct pkt) + class_size(c) + 15) & ~(size_t)15;
        size_t n = SLAB_BYTES / slot;
        char *slab;
        if (pool_bytes + n * slot > MAX_POOL_BYTES || !(slab = malloc(n * slot)))
            return NULL;
        pool_bytes += n * slot;
        for (size_t i = 0; i < n; i++) {
            struct pkt *p = (struct pkt *)(slab + i * slot);
            p->cls = (uint32_t)c;
            p->next = free_slots[c];
            free_slots[c] = p;
        }
    }
    struct pkt *p = free_slots[c];
    free_slots[c] = p->next;
    return p;
}

static void slot_put(struct pkt *p)
{
    p->next = free_slots[p->cls];
    free_slots[p->cls] = p;
}

/* ------------------------------------------------------------------ the forwarder */

/* Text from the kernel or the command line, quoted for JSON. */
static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static double monotonic_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static _Noreturn void die(const char *what)
{
    fprintf(stderr, "wanem_forwarder: %s: %s\n", what, strerror(errno));
    exit(1);
}

struct host {
    const char *netns, *dev;
    uint32_t addr; /* network byte order */
    int fd;
};

static struct host hosts[MAX_HOSTS];
static int nhosts;
static struct link links[MAX_HOSTS][MAX_HOSTS];
static struct link *active[MAX_HOSTS * MAX_HOSTS]; /* links with packets in flight */
static int nactive;
static struct pkt *scratch; /* a full-size slot the next read goes into */
static uint64_t unroutable, write_errors;
static double started;

/* Creates TUN device dev inside the namespace at netns; returns its fd, or -1 with err set. */
static int open_tun(const char *netns, const char *dev, char *err, size_t errlen)
{
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC), target = -1, fd = -1;
    const char *step = "open(/proc/self/ns/net)";
    if (home < 0)
        goto fail;
    step = "open(netns)";
    if ((target = open(netns, O_RDONLY | O_CLOEXEC)) < 0)
        goto fail;
    step = "setns(netns)";
    if (setns(target, CLONE_NEWNET))
        goto fail;
    /* The device is created in the namespace the opener is in when TUNSETIFF runs. */
    struct ifreq ifr;
    int hdr = VNET_HDR_LEN;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
    step = "open(/dev/net/tun)";
    if ((fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC)) < 0)
        goto back;
    step = "ioctl(TUNSETIFF)";
    if (ioctl(fd, TUNSETIFF, &ifr))
        goto back;
    step = "ioctl(TUNSETVNETHDRSZ)";
    if (ioctl(fd, TUNSETVNETHDRSZ, &hdr))
        goto back;
    step = "ioctl(TUNSETOFFLOAD)";
    if (ioctl(fd, TUNSETOFFLOAD, (unsigned long)(TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)))
        goto back;
    if (setns(home, CLONE_NEWNET))
        die("setns back to the forwarder's own namespace");
    close(target);
    close(home);
    return fd;
back:
    snprintf(err, errlen, "%s for %s in %s: %s", step, dev, netns, strerror(errno));
    if (setns(home, CLONE_NEWNET))
        die("setns back to the forwarder's own namespace");
    close(fd);
    close(target);
    close(home);
    return -1;
fail:
    snprintf(err, errlen, "%s for %s in %s: %s", step, dev, netns, strerror(errno));
    if (target >= 0)
        close(target);
    if (home >= 0)
        close(home);
    return -1;
}

/* Reads up to batch packets from host src's TUN into the links' FIFOs, fewer once empty. */
static void read_tun(int src, double now, int batch)
{
    for (int b = 0; b < batch; b++) {
        ssize_t got = read(hosts[src].fd, scratch->data, MAX_FRAME);
        if (got <= 0) {
            if (got == 0 || errno == EAGAIN || errno == EINTR)
                return;
            die("read from a TUN device");
        }
        size_t n = (size_t)got;
        const unsigned char *ip = scratch->data + VNET_HDR_LEN;
        int dst = -1;
        if (n >= VNET_HDR_LEN + 20 && ip[0] >> 4 == 4) /* IPv6 is off in the namespaces */
            for (int j = 0; j < nhosts && dst < 0; j++)
                if (!memcmp(ip + 16, &hosts[j].addr, 4))
                    dst = j;
        struct link *l = dst >= 0 ? &links[src][dst] : NULL;
        if (!l || !l->exists) {
            unroutable++;
            continue;
        }
        uint32_t size, segments;
        double release;
        wire_size(scratch->data, n, &size, &segments);
        int c = class_of(n);
        struct pkt *p = slot_get(c), *q; /* for a full-size packet: the next scratch */
        if (!p) {
            l->st.pkts_in++;
            l->st.bytes_in += size;
            l->st.drop_queue++;
            continue;
        }
        if (link_admit(l, now, size, segments, &release) != ADMITTED) {
            slot_put(p);
            continue;
        }
        if (c == N_CLASSES - 1) {
            q = scratch;
            scratch = p;
        } else {
            memcpy(p->data, scratch->data, n);
            q = p;
        }
        q->len = (uint32_t)n;
        q->release = release;
        q->next = NULL;
        if (l->tail)
            l->tail->next = q;
        else
            l->head = q;
        l->tail = q;
        l->in_flight++;
        if (l->active < 0) {
            l->active = nactive;
            active[nactive++] = l;
        }
    }
}

static void release_due(double now)
{
    for (int i = 0; i < nactive;) {
        struct link *l = active[i];
        while (l->head && l->head->release <= now) {
            struct pkt *p = l->head;
            if (!(l->head = p->next))
                l->tail = NULL;
            l->in_flight--;
            if (write(hosts[l->dst].fd, p->data, p->len) != (ssize_t)p->len)
                write_errors++; /* the destination is going away: a lost packet */
            slot_put(p);
        }
        if (l->head) {
            i++;
        } else {
            active[i] = active[--nactive];
            active[i]->active = i;
            l->active = -1; /* after the line above, which sets it when l was the last */
        }
    }
}

/* Counters of every link plus the forwarder's own, after every TUN was read empty, so they
 * include every packet the hosts had sent before the request. */
static void print_stats(void)
{
    struct timespec cpu;
    const char *sep = "";
    double now = monotonic_s();
    for (int i = 0; i < nhosts; i++)
        read_tun(i, now, DRAIN_LIMIT);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu);
    printf("{\"event\": \"stats\", \"links\": [");
    for (int i = 0; i < nhosts; i++)
        for (int j = 0; j < nhosts; j++)
            if (links[i][j].exists) {
                fputs(sep, stdout);
                print_link(&links[i][j]);
                sep = ", ";
            }
    printf("], \"unroutable\": %" PRIu64 ", \"write_errors\": %" PRIu64
           ", \"cpu_s\": %.6f, \"wall_s\": %.6f}\n",
           unroutable, write_errors, (double)cpu.tv_sec + cpu.tv_nsec * 1e-9,
           monotonic_s() - started);
}

static void command(char *line)
{
    char *tok[MAX_TOKENS];
    int n = split(line, tok, MAX_TOKENS);
    long long src, dst;
    if (n == 0)
        return;
    if (n == 1 && !strcmp(tok[0], "stats")) {
        print_stats();
    } else if (n == 7 && !strcmp(tok[0], "set")) {
        if (integer(tok[1], 0, nhosts - 1, &src) || integer(tok[2], 0, nhosts - 1, &dst) ||
            !links[src][dst].exists || configure_from(&links[src][dst], tok + 3))
            printf("{\"event\": \"error\", \"error\": \"bad link in a set command\"}\n");
        else
            printf("{\"event\": \"set\", \"src\": %lld, \"dst\": %lld}\n", src, dst);
    } else {
        printf("{\"event\": \"error\", \"error\": \"unknown command\"}\n");
    }
    fflush(stdout);
}

/* Handles the parent's command lines; 0 at end of file (time to exit). */
static int control(void)
{
    static char buf[MAX_LINE];
    static size_t len;
    ssize_t got = read(STDIN_FILENO, buf + len, sizeof buf - len);
    if (got < 0 && (errno == EAGAIN || errno == EINTR))
        return 1;
    if (got < 0)
        die("read stdin");
    if (got == 0)
        return 0;
    len += (size_t)got;
    char *start = buf, *nl;
    while ((nl = memchr(start, '\n', len - (size_t)(start - buf)))) {
        *nl = '\0';
        command(start);
        start = nl + 1;
    }
    len -= (size_t)(start - buf);
    memmove(buf, start, len);
    if (len == sizeof buf) {
        fprintf(stderr, "wanem_forwarder: a command longer than %d bytes\n", MAX_LINE - 1);
        exit(1);
    }
    return 1;
}

static void run(void)
{
    struct pollfd pfd[MAX_HOSTS + 1];
    pfd[0].fd = STDIN_FILENO;
    for (int i = 0; i < nhosts; i++)
        pfd[i + 1].fd = hosts[i].fd;
    for (int i = 0; i <= nhosts; i++)
        pfd[i].events = POLLIN;
    for (;;) {
        struct timespec ts, *timeout = NULL;
        if (nactive) {
            double next = active[0]->head->release;
            for (int i = 1; i < nactive; i++)
                next = fmin(next, active[i]->head->release);
            /* Rounded up: waking early would only spin until the release is due. */
            double wait = ceil(fmax(0.0, next - monotonic_s()) * 1e9);
            ts.tv_sec = (time_t)(wait / 1e9);
            ts.tv_nsec = (long)(wait - (double)ts.tv_sec * 1e9);
            timeout = &ts;
        }
        if (ppoll(pfd, (nfds_t)nhosts + 1, timeout, NULL) < 0) {
            if (errno == EINTR)
                continue;
            die("ppoll");
        }
        double now = monotonic_s();
        for (int i = 0; i < nhosts; i++) {
            if (pfd[i + 1].revents & POLLIN)
                read_tun(i, now, READ_BATCH);
            else if (pfd[i + 1].revents & (POLLERR | POLLHUP | POLLNVAL)) {
                fprintf(stderr, "wanem_forwarder: TUN of host %d failed (poll events %#x)\n",
                        i, (unsigned)pfd[i + 1].revents);
                exit(1);
            }
        }
        if (pfd[0].revents && !control())
            return;
        release_due(monotonic_s());
    }
}

static _Noreturn void usage(const char *why)
{
    fprintf(stderr, "wanem_forwarder: %s\nusage: wanem_forwarder [--seed N] --host NETNS_PATH "
            "DEV IPV4 ... --link SRC DST DELAY_MS RATE_MBIT LOSS QUEUE_MS ...\n"
            "       wanem_forwarder --model\n", why);
    exit(1);
}

int main(int argc, char **argv)
{
    long long seed = 0, src, dst;
    char err[512];
    if (argc == 2 && !strcmp(argv[1], "--model"))
        return link_model_main();
    for (int i = 1; i < argc;) {
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            if (integer(argv[i + 1], INT64_MIN, INT64_MAX, &seed))
                usage("bad --seed");
            i += 2;
        } else if (!strcmp(argv[i], "--host") && i + 3 < argc) {
            struct host *h = &hosts[nhosts];
            if (nhosts == MAX_HOSTS)
                usage("too many hosts");
            h->netns = argv[i + 1];
            h->dev = argv[i + 2];
            if (strlen(h->netns) >= 4096 || !*h->dev || strlen(h->dev) >= IFNAMSIZ ||
                strspn(h->dev, "abcdefghijklmnopqrstuvwxyz0123456789_-.") != strlen(h->dev) ||
                inet_pton(AF_INET, argv[i + 3], &h->addr) != 1)
                usage("bad --host");
            nhosts++;
            i += 4;
        } else if (!strcmp(argv[i], "--link") && i + 6 < argc) {
            if (integer(argv[i + 1], 0, nhosts - 1, &src) ||
                integer(argv[i + 2], 0, nhosts - 1, &dst) || src == dst)
                usage("bad --link hosts (every --host comes first)");
            struct link *l = &links[src][dst];
            if (configure_from(l, argv + i + 3))
                usage("bad --link parameters");
            l->exists = 1;
            l->src = (int)src;
            l->dst = (int)dst;
            l->active = -1;
            i += 7;
        } else {
            usage("unknown or incomplete argument");
        }
    }
    if (nhosts < 2)
        usage("need at least two --host");
    for (int i = 0; i < nhosts; i++)
        for (int j = 0; j < nhosts; j++)
            link_seed(&links[i][j], (uint64_t)seed, i, j);
    for (int i = 0; i < nhosts; i++) {
        if ((hosts[i].fd = open_tun(hosts[i].netns, hosts[i].dev, err, sizeof err)) < 0) {
            /* No TUN driver, no permission: the environment, not a bug. */
            printf("{\"event\": \"unavailable\", \"error\": ");
            json_string(err);
            printf("}\n");
            return 2;
        }
    }
    if (!(scratch = slot_get(N_CLASSES - 1)))
        die("allocating packet slots");
    if (fcntl(STDIN_FILENO, F_SETFL, fcntl(STDIN_FILENO, F_GETFL) | O_NONBLOCK))
        die("fcntl(stdin, O_NONBLOCK)");
    started = monotonic_s();
    printf("{\"event\": \"ready\", \"pid\": %ld, \"devs\": [", (long)getpid());
    for (int i = 0; i < nhosts; i++) {
        fputs(i ? ", " : "", stdout);
        json_string(hosts[i].dev);
    }
    printf("]}\n");
    fflush(stdout);
    run();
    return 0;
}
