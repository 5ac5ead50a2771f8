/* Calls per second through librdsd's C ABI when several threads of one process each use
 * their own socket: every thread makes COUNT non-blocking rdsd_recvfrom calls on an empty
 * socket (the fd lookup, the socket's receive lock, the ring's emptiness check, EAGAIN and
 * the one `pause` librdsd makes on an empty receive), or with CALL `name` COUNT
 * rdsd_getsockname calls (the fd lookup and one load: what the lookup alone costs), so
 * rdsd's poll core is not involved. What it shows is what one call costs and what the calls of
 * one thread cost the others (a lock or reference count that every call of every thread
 * writes moves its cache line between their cores on each call). `unix` makes the same
 * calls with recv(MSG_DONTWAIT) on an AF_UNIX SOCK_SEQPACKET socketpair per thread: the
 * kernel's cost of the same empty receive (or getsockname), the baseline of
 * bench/preload/calls.sh.
 *
 *   calls rds|unix THREADS COUNT [recv|name]
 * Prints "RESULT calls impl=I call=C threads=T count=N ns_per_call=.. calls_per_s=.." (all
 * threads). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <rdsd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

static long count;
static int unix_mode;
static int name_mode;
static pthread_barrier_t go;

static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

static void *worker(void *arg)
{
	int fd = *(int *)arg;
	char buf[64];
	pthread_barrier_wait(&go);
	struct sockaddr_storage a;
	socklen_t alen;
	for (long i = 0; name_mode && i < count; i++) {
		alen = sizeof a;
		int r = unix_mode ? getsockname(fd, (struct sockaddr *)&a, &alen)
				  : rdsd_getsockname(fd, (struct sockaddr *)&a, &alen);
		if (r) {
			fprintf(stderr, "calls: getsockname: %s\n", strerror(errno));
			exit(1);
		}
	}
	for (long i = 0; !name_mode && i < count; i++) {
		ssize_t r = unix_mode ? recv(fd, buf, sizeof buf, MSG_DONTWAIT)
				      : rdsd_recvfrom(fd, buf, sizeof buf, MSG_DONTWAIT, NULL, NULL);
		if (r >= 0 || errno != EAGAIN) {
			fprintf(stderr, "calls: unexpected recvfrom result: %s\n", strerror(errno));
			exit(1);
		}
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: calls rds|unix THREADS COUNT [recv|name]\n");
		return 2;
	}
	unix_mode = strcmp(argv[1], "unix") == 0;
	int threads = atoi(argv[2]);
	count = atol(argv[3]);
	name_mode = argc > 4 && strcmp(argv[4], "name") == 0;
	int *fds = calloc(threads, sizeof *fds);
	pthread_t *t = calloc(threads, sizeof *t);
	for (int i = 0; i < threads; i++) {
		if (unix_mode) {
			int sv[2];
			if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) {
				perror("socketpair");
				return 1;
			}
			fds[i] = sv[0];
			continue;
		}
		fds[i] = rdsd_socket(21, SOCK_SEQPACKET, 0);
		struct sockaddr_in lo = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
		if (fds[i] < 0 || rdsd_bind(fds[i], (struct sockaddr *)&lo, sizeof lo)) {
			perror("socket/bind");
			return 1;
		}
	}
	pthread_barrier_init(&go, NULL, threads + 1);
	for (int i = 0; i < threads; i++)
		pthread_create(&t[i], NULL, worker, &fds[i]);
	uint64_t t0 = now_ns();
	pthread_barrier_wait(&go);
	for (int i = 0; i < threads; i++)
		pthread_join(t[i], NULL);
	uint64_t dt = now_ns() - t0;
	double total = (double)count * threads;
	printf("RESULT calls impl=%s call=%s threads=%d count=%ld ns_per_call=%.1f calls_per_s=%.0f\n",
	       unix_mode ? "unix" : "rds", name_mode ? "name" : "recv", threads, count,
	       (double)dt / count, total * 1e9 / dt);
	return 0;
}
