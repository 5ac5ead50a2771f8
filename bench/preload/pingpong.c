/* The 64 B local round trip of `rds-bench rtt` (two sockets in one thread, A -> B -> A), written
 * against the plain socket API so that it runs under rdsd-run (librdsd-preload.so), or with
 * -DUSE_CAPI against librdsd's C ABI directly. bench/preload/measure.sh runs both next to
 * rds-bench rtt on the same rdsd.
 *
 *   pingpong MODE COUNT WARMUP SIZE     MODE: spin (MSG_DONTWAIT, yield every 64 misses, as
 *                                        rds-bench) or block (blocking recv)
 * Prints "RESULT pingpong impl=IMPL mode=MODE size=S count=N p50_ns=.. p99_ns=.. mean_ns=..". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#ifdef USE_CAPI
#include <rdsd.h>
#define IMPL "capi"
#define SOCKET rdsd_socket
#define BIND rdsd_bind
#define GETSOCKNAME rdsd_getsockname
#define SENDTO rdsd_sendto
#define RECVFROM rdsd_recvfrom
#else
#define IMPL "preload"
#define SOCKET socket
#define BIND bind
#define GETSOCKNAME getsockname
#define SENDTO sendto
#define RECVFROM recvfrom
#endif

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

static void die(const char *what)
{
	fprintf(stderr, "pingpong: %s: %s\n", what, strerror(errno));
	exit(1);
}

static int bound(struct sockaddr_in *a)
{
	int fd = SOCKET(21, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket(AF_RDS)");
	struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	if (BIND(fd, (struct sockaddr *)&lo, sizeof lo))
		die("bind");
	socklen_t l = sizeof *a;
	if (GETSOCKNAME(fd, (struct sockaddr *)a, &l))
		die("getsockname");
	return fd;
}

static int dontwait;

static void send_one(int fd, const char *buf, size_t n, const struct sockaddr_in *to)
{
	unsigned miss = 0;
	while (SENDTO(fd, buf, n, dontwait, (const struct sockaddr *)to, sizeof *to) < 0) {
		if (errno != EAGAIN && errno != ENOBUFS)
			die("sendto");
		if (++miss % 64 == 0)
			sched_yield();
	}
}

static size_t recv_one(int fd, char *buf, size_t n)
{
	unsigned miss = 0;
	ssize_t r;
	while ((r = RECVFROM(fd, buf, n, dontwait, NULL, NULL)) < 0) {
		if (errno != EAGAIN)
			die("recvfrom");
		if (++miss % 64 == 0)
			sched_yield();
	}
	return (size_t)r;
}

static int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	if (argc < 5) {
		fprintf(stderr, "usage: pingpong spin|block COUNT WARMUP SIZE\n");
		return 2;
	}
	const char *mode = argv[1];
	dontwait = strcmp(mode, "spin") == 0 ? MSG_DONTWAIT : 0;
	long count = atol(argv[2]), warmup = atol(argv[3]);
	size_t size = (size_t)atol(argv[4]);
	struct sockaddr_in aa, ba;
	int a = bound(&aa), b = bound(&ba);
	char *msg = calloc(1, size + 64), *rbuf = calloc(1, size + 64);
	uint64_t *lat = calloc(count, sizeof *lat);
	uint64_t start = 0;
	for (long i = 0; i < warmup + count; i++) {
		memcpy(msg, &i, size < 8 ? size : 8);
		if (i == warmup)
			start = now_ns();
		uint64_t t0 = now_ns();
		send_one(a, msg, size, &ba);
		size_t n = recv_one(b, rbuf, size + 64);
		send_one(b, rbuf, n, &aa);
		n = recv_one(a, rbuf, size + 64);
		uint64_t dt = now_ns() - t0;
		if (n != size || memcmp(rbuf, msg, size) != 0) {
			fprintf(stderr, "pingpong: bad echo at %ld\n", i);
			return 1;
		}
		if (i >= warmup)
			lat[i - warmup] = dt;
	}
	uint64_t total = now_ns() - start;
	qsort(lat, count, sizeof *lat, cmp);
	printf("RESULT pingpong impl=%s mode=%s size=%zu count=%ld p50_ns=%llu p99_ns=%llu mean_ns=%llu\n",
	       IMPL, mode, size, count, (unsigned long long)lat[count / 2],
	       (unsigned long long)lat[count * 99 / 100], (unsigned long long)(total / count));
	return 0;
}
