/*
 * The harness's C load tools (built by benches/ctools.py with the system's gcc into a cache dir).
 *
 * In the capture topology the load generator and the echo server would otherwise be Python
 * processes competing with the proxies for the same two cores; these do the per-message and
 * per-connection work in a few syscalls, so what the figures measure is the proxies.
 *
 *   tools echo HOST PORT                     echo server (epoll); prints "ready" once listening.
 *                                            An EOF is answered by closing once the echo is flushed.
 *   tools rr HOST PORT SECONDS MAX           1-byte ping-pong on one connection; JSON on stdout.
 *   tools connrate HOST PORT SECONDS CONC MAX
 *                                            CONC threads each: connect, 1 byte, read the echo,
 *                                            close; 3 warm-up connections first; JSON on stdout.
 *   tools paced HOST PORT RATE SECONDS CONNS SIZE
 *                                            open-loop load: RATE requests/s in all over CONNS
 *                                            persistent connections, each request SIZE bytes and
 *                                            its echo read back; each request is scheduled at its
 *                                            time and its latency counts from that time (as wrk2
 *                                            does), so a slow answer cannot hide the requests it
 *                                            delayed (requests due in the window that are late
 *                                            still go, up to 1 s after it); JSON on stdout,
 *                                            and "running" on stderr once connected and warmed.
 *
 * IPv4 or IPv6 literals only (getaddrinfo with AI_NUMERICHOST).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static struct sockaddr_storage target;
static socklen_t target_len;

static int resolve(const char *host, const char *port, struct sockaddr_storage *out, socklen_t *len) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc != 0 || res == NULL) {
        fprintf(stderr, "tools: bad address %s:%s: %s\n", host, port, gai_strerror(rc));
        return -1;
    }
    memcpy(out, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* As many descriptors as allowed: root may raise the hard limit too (an echo server holding
 * 10,000 connections needs more than a default 1,024, a few proxies' worth more than 20,000). */
static void raise_nofile(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    struct rlimit want = {1 << 18, 1 << 18};
    if (want.rlim_max > rl.rlim_max && setrlimit(RLIMIT_NOFILE, &want) == 0)
        return;
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
}

static int dial(void) {
    int fd = socket(target.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&target, target_len) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* -- echo server ------------------------------------------------------------------------------ */

struct conn {
    int fd;
    char *pending; /* bytes read but not yet written back */
    size_t len, off;
};

static void conn_close(int ep, struct conn *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->pending);
    free(c);
}

static void conn_watch(int ep, struct conn *c, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Writes what is pending; 1 when all of it went, 0 when the socket is full, -1 on error. */
static int conn_flush(struct conn *c) {
    while (c->off < c->len) {
        ssize_t n = send(c->fd, c->pending + c->off, c->len - c->off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            if (errno == EINTR)
                continue;
            return -1;
        }
        c->off += (size_t)n;
    }
    free(c->pending);
    c->pending = NULL;
    c->len = c->off = 0;
    return 1;
}

static int run_echo(const char *host, const char *port) {
    struct sockaddr_storage addr;
    socklen_t len;
    if (resolve(host, port, &addr, &len) != 0)
        return 2;
    int lfd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, len) != 0 || listen(lfd, 4096) != 0) {
        perror("tools echo: listen");
        return 1;
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &lev);
    printf("ready\n");
    fflush(stdout);
    static char buf[256 * 1024];
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("tools echo: epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            struct conn *c = events[i].data.ptr;
            if (c == NULL) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (fd < 0)
                        break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    struct conn *nc = calloc(1, sizeof *nc);
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
                }
                continue;
            }
            if (c->pending != NULL) { /* writable again */
                int f = conn_flush(c);
                if (f < 0) {
                    conn_close(ep, c);
                    continue;
                }
                if (f == 0)
                    continue;
                conn_watch(ep, c, EPOLLIN);
                continue;
            }
            ssize_t r = recv(c->fd, buf, sizeof buf, 0);
            if (r < 0 && (errno == EAGAIN || errno == EINTR))
                continue;
            if (r <= 0) { /* EOF (everything was echoed already) or error */
                conn_close(ep, c);
                continue;
            }
            ssize_t w = send(c->fd, buf, (size_t)r, MSG_NOSIGNAL);
            if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
                conn_close(ep, c);
                continue;
            }
            if (w < 0)
                w = 0;
            if (w < r) { /* the peer reads slower than it writes: stop reading until flushed */
                c->len = (size_t)(r - w);
                c->pending = malloc(c->len);
                memcpy(c->pending, buf + w, c->len);
                c->off = 0;
                conn_watch(ep, c, EPOLLOUT);
            }
        }
    }
}

/* -- rr ----------------------------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int run_rr(double seconds, long max) {
    int fd = dial();
    if (fd < 0) {
        printf("{\"error\": \"connect: %s\"}\n", strerror(errno));
        return 1;
    }
    char b = 'x';
    for (int i = 0; i < 50; i++) { /* warm-up: lazy set-up on the path */
        if (send(fd, &b, 1, MSG_NOSIGNAL) != 1 || recv(fd, &b, 1, 0) != 1) {
            printf("{\"error\": \"warm-up round trip failed: %s\"}\n", strerror(errno));
            return 1;
        }
    }
    int64_t *lat = malloc(sizeof(int64_t) * (size_t)max);
    long n = 0;
    int64_t start = now_ns(), deadline = start + (int64_t)(seconds * 1e9), t = start;
    while (n < max && t < deadline) {
        b = 'x';
        if (send(fd, &b, 1, MSG_NOSIGNAL) != 1 || recv(fd, &b, 1, 0) != 1 || b != 'x') {
            printf("{\"error\": \"round trip %ld failed: %s\"}\n", n, strerror(errno));
            return 1;
        }
        int64_t t2 = now_ns();
        lat[n++] = t2 - t;
        t = t2;
    }
    close(fd);
    double elapsed = (t - start) / 1e9;
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += (double)lat[i];
    qsort(lat, (size_t)n, sizeof *lat, cmp_i64);
    long p99 = (n * 99) / 100;
    if (p99 > n - 1)
        p99 = n - 1;
    printf("{\"count\": %ld, \"seconds\": %.6f, \"per_s\": %.3f, \"p50_us\": %.3f, \"p99_us\": %.3f, "
           "\"mean_us\": %.3f}\n",
           n, elapsed, n ? n / elapsed : 0.0, n ? lat[n / 2] / 1000.0 : 0.0, n ? lat[p99] / 1000.0 : 0.0,
           n ? sum / n / 1000.0 : 0.0);
    free(lat);
    return 0;
}

/* -- connrate ------------------------------------------------------------------------------------- */

static double deadline_s;
static long max_count;
static long done_count, error_count;
static int first_errno;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* One connection: connect, 1 byte, read its echo, close. 0 or an errno. */
static int one_connection(void) {
    int fd = dial();
    if (fd < 0)
        return errno ? errno : EIO;
    char b = 'x';
    int rc = 0;
    if (send(fd, &b, 1, MSG_NOSIGNAL) != 1)
        rc = errno ? errno : EIO;
    else {
        ssize_t r = recv(fd, &b, 1, 0);
        if (r != 1 || b != 'x')
            rc = r < 0 ? errno : ECONNRESET;
    }
    close(fd);
    return rc;
}

static void *connrate_worker(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&lock);
        int stop = now_s() >= deadline_s || done_count + error_count >= max_count ||
                   error_count > (done_count / 10 > 10 ? done_count / 10 : 10);
        pthread_mutex_unlock(&lock);
        if (stop)
            return NULL;
        int rc = one_connection();
        pthread_mutex_lock(&lock);
        if (rc == 0)
            done_count++;
        else {
            error_count++;
            if (!first_errno)
                first_errno = rc;
        }
        pthread_mutex_unlock(&lock);
    }
}

static int run_connrate(double seconds, int conc, long max) {
    for (int i = 0; i < 3; i++) { /* warm-up: the pool (or whatever the path keeps) is set up */
        int rc = one_connection();
        if (rc != 0) {
            printf("{\"error\": \"warm-up connection failed: %s\"}\n", strerror(rc));
            return 1;
        }
    }
    max_count = max;
    double t0 = now_s();
    deadline_s = t0 + seconds;
    pthread_t th[256];
    if (conc < 1)
        conc = 1;
    if (conc > 256)
        conc = 256;
    for (int i = 0; i < conc; i++)
        pthread_create(&th[i], NULL, connrate_worker, NULL);
    for (int i = 0; i < conc; i++)
        pthread_join(th[i], NULL);
    double elapsed = now_s() - t0;
    printf("{\"count\": %ld, \"errors\": %ld, \"first_error\": \"%s\", \"seconds\": %.6f, \"per_s\": %.3f}\n",
           done_count, error_count, first_errno ? strerror(first_errno) : "", elapsed, done_count / elapsed);
    return 0;
}

/* -- paced ------------------------------------------------------------------------------------ */

/* Requests due inside the window but late go out up to this long after it (a passing stall is
 * measured, in their latency); a path that cannot keep up leaves the rest unsent. */
#define PACED_GRACE_NS (1000LL * 1000000)

struct paced {
    int fd;
    int index;
    size_t size;
    int64_t first_ns, interval_ns, end_ns; /* the schedule: first + i * interval, before end */
    int64_t *lat;                          /* latency of each answered request, from its intended time */
    long count, errors, scheduled;
    int64_t last_ns; /* when its last request finished */
    int first_errno;
    const char *first_what;
    char *out, *in;
};

static void paced_error(struct paced *c, const char *what, int err) {
    c->errors++;
    if (!c->first_errno) {
        c->first_errno = err ? err : EIO;
        c->first_what = what;
    }
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1; /* the next request reconnects */
}

/* One request on the connection: SIZE bytes out, the same SIZE back. 0 or -1 (error recorded). */
static int paced_exchange(struct paced *c, long seq) {
    memcpy(c->out, &seq, sizeof seq); /* each request's bytes differ: a stale echo cannot pass */
    memcpy(c->out + sizeof seq, &c->index, sizeof c->index);
    size_t off = 0;
    while (off < c->size) {
        ssize_t n = send(c->fd, c->out + off, c->size - off, MSG_NOSIGNAL);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            paced_error(c, "send", n < 0 ? errno : EPIPE);
            return -1;
        }
        off += (size_t)n;
    }
    off = 0;
    while (off < c->size) {
        ssize_t n = recv(c->fd, c->in + off, c->size - off, 0);
        if (n <= 0) {
            if (n < 0 && errno == EINTR)
                continue;
            paced_error(c, n == 0 ? "recv (closed by the peer)" : "recv", n < 0 ? errno : ECONNRESET);
            return -1;
        }
        off += (size_t)n;
    }
    if (memcmp(c->out, c->in, c->size) != 0) {
        paced_error(c, "echo differs from the request", EBADMSG);
        return -1;
    }
    return 0;
}

static int paced_dial(struct paced *c) {
    c->fd = dial();
    if (c->fd < 0)
        return -1;
    struct timeval tv = {2, 0}; /* an answer later than this is an error, not a latency */
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    return 0;
}

static void *paced_worker(void *arg) {
    struct paced *c = arg;
    for (long i = 0;; i++) {
        int64_t intended = c->first_ns + i * c->interval_ns;
        if (intended >= c->end_ns)
            break;
        int64_t now = now_ns();
        if (now >= c->end_ns + PACED_GRACE_NS)
            break; /* still behind the schedule a while after the end: the rest stay `unsent` */
        if (intended > now) {
            struct timespec ts = {intended / 1000000000, intended % 1000000000};
            while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
        }
        c->scheduled++;
        if (c->fd < 0 && paced_dial(c) != 0) {
            paced_error(c, "connect", errno);
            continue;
        }
        if (paced_exchange(c, i) == 0)
            c->lat[c->count++] = now_ns() - intended;
        c->last_ns = now_ns();
    }
    return NULL;
}

static int run_paced(double rate, double seconds, int conns, long size) {
    if (!(rate > 0) || !(seconds > 0) || conns < 1 || conns > 256 || size < 16 || size > (1 << 20) ||
        rate * seconds > 1e8) {
        fprintf(stderr, "tools paced: RATE and SECONDS > 0 (RATE x SECONDS at most 10^8), "
                        "1 <= CONNS <= 256, 16 <= SIZE <= 1 MiB\n");
        return 2;
    }
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake-ups on time, not up to 50 µs late */
    struct paced *cs = calloc((size_t)conns, sizeof *cs);
    int64_t interval = (int64_t)(conns / rate * 1e9); /* per connection: RATE / CONNS per second */
    long per_conn = (long)(seconds * 1e9 / (double)interval) + 2;
    for (int k = 0; k < conns; k++) {
        struct paced *c = &cs[k];
        c->index = k;
        c->size = (size_t)size;
        c->out = malloc((size_t)size);
        c->in = malloc((size_t)size);
        for (long j = 0; j < size; j++)
            c->out[j] = (char)('a' + (j + k) % 26);
        c->lat = malloc(sizeof(int64_t) * (size_t)per_conn);
        if (paced_dial(c) != 0) {
            printf("{\"error\": \"connect: %s\"}\n", strerror(errno));
            return 1;
        }
        for (long w = 0; w < 10; w++) { /* warm-up: the path's lazy set-up, outside the figure */
            if (paced_exchange(c, -1 - w) != 0) {
                printf("{\"error\": \"warm-up request failed: %s: %s\"}\n", c->first_what,
                       strerror(c->first_errno));
                return 1;
            }
        }
    }
    /* Connected and warmed up: from here a failure is a request's, counted, not the run's. */
    fprintf(stderr, "running\n");
    /* The connections' schedules interleave: together they send one request every 1/RATE s. */
    int64_t start = now_ns() + 20 * 1000000, end = start + (int64_t)(seconds * 1e9);
    pthread_t th[256];
    for (int k = 0; k < conns; k++) {
        cs[k].interval_ns = interval;
        cs[k].first_ns = start + interval * k / conns;
        cs[k].end_ns = end;
        pthread_create(&th[k], NULL, paced_worker, &cs[k]);
    }
    long count = 0, errors = 0, scheduled = 0, planned = 0;
    int64_t last = end;
    int first_errno = 0;
    const char *first_what = "";
    for (int k = 0; k < conns; k++) {
        pthread_join(th[k], NULL);
        struct paced *c = &cs[k];
        count += c->count;
        errors += c->errors;
        scheduled += c->scheduled;
        planned += (end - c->first_ns + interval - 1) / interval;
        if (c->last_ns > last)
            last = c->last_ns;
        if (!first_errno && c->first_errno) {
            first_errno = c->first_errno;
            first_what = c->first_what;
        }
    }
    int64_t *all = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    long n = 0;
    double sum = 0;
    for (int k = 0; k < conns; k++) {
        for (long j = 0; j < cs[k].count; j++) {
            all[n++] = cs[k].lat[j];
            sum += (double)cs[k].lat[j];
        }
        if (cs[k].fd >= 0)
            close(cs[k].fd);
    }
    qsort(all, (size_t)n, sizeof *all, cmp_i64);
#define PCT(p) (n ? all[(n * (p)) / 100 < n ? (n * (p)) / 100 : n - 1] / 1000.0 : 0.0)
    printf("{\"count\": %ld, \"errors\": %ld, \"first_error\": \"%s%s%s\", \"planned\": %ld, "
           "\"unsent\": %ld, \"asked_per_s\": %.3f, \"per_s\": %.3f, \"seconds\": %.6f, "
           "\"connections\": %d, \"size\": %ld, \"start_mono\": %.6f, \"end_mono\": %.6f, "
           "\"last_mono\": %.6f, \"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, "
           "\"max_us\": %.3f, \"mean_us\": %.3f}\n",
           count, errors, first_what, first_errno ? ": " : "", first_errno ? strerror(first_errno) : "",
           planned, planned - scheduled, rate, count / seconds, seconds, conns, size, start / 1e9,
           end / 1e9, last / 1e9, PCT(50), PCT(90), PCT(99), n ? all[n - 1] / 1000.0 : 0.0,
           n ? sum / n / 1000.0 : 0.0);
#undef PCT
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    raise_nofile();
    if (argc == 4 && strcmp(argv[1], "echo") == 0)
        return run_echo(argv[2], argv[3]);
    if (argc >= 4 && resolve(argv[2], argv[3], &target, &target_len) != 0)
        return 2;
    if (argc == 6 && strcmp(argv[1], "rr") == 0)
        return run_rr(atof(argv[4]), atol(argv[5]) > 0 ? atol(argv[5]) : 1);
    if (argc == 7 && strcmp(argv[1], "connrate") == 0)
        return run_connrate(atof(argv[4]), atoi(argv[5]), atol(argv[6]) > 0 ? atol(argv[6]) : 1);
    if (argc == 8 && strcmp(argv[1], "paced") == 0)
        return run_paced(atof(argv[4]), atof(argv[5]), atoi(argv[6]), atol(argv[7]));
    fprintf(stderr, "usage: tools echo HOST PORT | rr HOST PORT SECONDS MAX | "
                    "connrate HOST PORT SECONDS CONCURRENCY MAX | "
                    "paced HOST PORT RATE SECONDS CONNECTIONS SIZE\n");
    return 2;
}
