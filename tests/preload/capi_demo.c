/* A C program built against librdsd with `pkg-config --cflags --libs rdsd` (tests/tests/preload.rs).
 * Two sockets on 127.0.0.1 exchange messages through rdsd; checks errno values, poll on the
 * socket fd, MSG_PEEK/MSG_TRUNC and RDS_INFO_COUNTERS. Prints "CAPI OK". */
#include <rdsd.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond)) {                                                           \
			printf("FAIL line %d: %s (errno %d %s)\n", __LINE__, #cond, errno, \
			       strerror(errno));                                          \
			exit(1);                                                         \
		}                                                                        \
	} while (0)

static struct sockaddr_in addr(const char *ip, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	inet_pton(AF_INET, ip, &a.sin_addr);
	return a;
}

int main(void)
{
	int a = rdsd_socket(RDSD_AF_RDS, SOCK_SEQPACKET, 0);
	int b = rdsd_socket(RDSD_AF_RDS, SOCK_SEQPACKET, 0);
	CHECK(a >= 0 && b >= 0);
	CHECK(rdsd_socket(RDSD_AF_RDS, SOCK_DGRAM, 0) == -1 && errno == ESOCKTNOSUPPORT);

	struct sockaddr_in any = addr("0.0.0.0", 7000);
	CHECK(rdsd_bind(a, (struct sockaddr *)&any, sizeof any) == -1 && errno == EINVAL);
	struct sockaddr_in lo = addr("127.0.0.1", 0);
	CHECK(rdsd_sendto(a, "x", 1, 0, (struct sockaddr *)&lo, sizeof lo) == -1 &&
	      errno == ENOTCONN);
	CHECK(rdsd_bind(a, (struct sockaddr *)&lo, sizeof lo) == 0);
	CHECK(rdsd_bind(b, (struct sockaddr *)&lo, sizeof lo) == 0);
	struct sockaddr_in ba;
	socklen_t bl = sizeof ba;
	CHECK(rdsd_getsockname(b, (struct sockaddr *)&ba, &bl) == 0 && bl == sizeof ba);
	CHECK(ba.sin_port != 0);

	/* non-blocking receive on an empty socket */
	CHECK(rdsd_set_nonblocking(b, 1) == 0);
	char buf[256];
	CHECK(rdsd_recv(b, buf, sizeof buf, 0) == -1 && errno == EAGAIN);

	/* send, then wait on the fd with poll(2) itself */
	CHECK(rdsd_poll_fd(b) == b);
	CHECK(rdsd_sendto(a, "hello rdsd", 10, 0, (struct sockaddr *)&ba, sizeof ba) == 10);
	struct pollfd p = { .fd = b, .events = POLLIN };
	CHECK(poll(&p, 1, 10000) == 1 && (p.revents & POLLIN));
	CHECK(rdsd_recv(b, buf, 4, MSG_PEEK | MSG_TRUNC) == 10);
	struct sockaddr_in from;
	socklen_t fl = sizeof from;
	ssize_t n = rdsd_recvfrom(b, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl);
	CHECK(n == 10 && memcmp(buf, "hello rdsd", 10) == 0);
	CHECK(from.sin_addr.s_addr == htonl(INADDR_LOOPBACK));

	/* options */
	int v = 65536;
	CHECK(rdsd_setsockopt(a, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) == 0);
	socklen_t vl = sizeof v;
	CHECK(rdsd_getsockopt(a, SOL_SOCKET, SO_SNDBUF, &v, &vl) == 0 && v == 2 * 65536);

	/* RDS_INFO_COUNTERS: ENOSPC and the size needed, then the records */
	socklen_t need = 0;
	CHECK(rdsd_getsockopt(a, RDSD_SOL_RDS, RDSD_INFO_COUNTERS, NULL, &need) == -1 &&
	      errno == ENOSPC && need > 0);
	char *info = malloc(need);
	socklen_t got = need;
	int item = rdsd_getsockopt(a, RDSD_SOL_RDS, RDSD_INFO_COUNTERS, info, &got);
	CHECK(item == 40 && got == need);
	int found = 0;
	for (socklen_t off = 0; off + item <= got; off += item)
		found |= strncmp(info + off, "loop_delivered", 32) == 0;
	CHECK(found);
	free(info);

	CHECK(rdsd_close(a) == 0 && rdsd_close(b) == 0);
	CHECK(rdsd_close(a) == -1 && errno == EBADF);
	printf("CAPI OK\n");
	return 0;
}
