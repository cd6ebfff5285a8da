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

static void raise_nofile(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
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
    fprintf(stderr, "usage: tools echo HOST PORT | rr HOST PORT SECONDS MAX | "
                    "connrate HOST PORT SECONDS CONCURRENCY MAX\n");
    return 2;
}
