/* Multicast groups through rdsd's SOL_RDS options (tests/tests/preload.rs). Built twice from
 * this file: with -DUSE_CAPI against librdsd (rdsd_* calls), and without it as a plain socket
 * API program run under rdsd-run (librdsd-preload.so). Both include <rdsd.h> for the option
 * numbers and structs. Checks create/join/leave/flags/filter and their errno values, a send to
 * the group reaching both members with the sender as source (sendto, sendmsg, connect+send),
 * EAGAIN for a non-blocking send while a member is full, then the blocking send once it has
 * read, and a DROP_WHEN_FULL member skipped meanwhile. Prints "GROUPS OK". */
#define _GNU_SOURCE
#include <rdsd.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#ifdef USE_CAPI
#define SOCKET rdsd_socket
#define BIND rdsd_bind
#define CONNECT rdsd_connect
#define GETSOCKNAME rdsd_getsockname
#define SETSOCKOPT rdsd_setsockopt
#define SEND rdsd_send
#define SENDTO rdsd_sendto
#define SENDMSG rdsd_sendmsg
#define RECVFROM rdsd_recvfrom
#define CLOSE rdsd_close
#else
#define SOCKET socket
#define BIND bind
#define CONNECT connect
#define GETSOCKNAME getsockname
#define SETSOCKOPT setsockopt
#define SEND send
#define SENDTO sendto
#define SENDMSG sendmsg
#define RECVFROM recvfrom
#define CLOSE close
#endif

#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond)) {                                                           \
			printf("FAIL line %d: %s (errno %d %s)\n", __LINE__, #cond, errno, \
			       strerror(errno));                                          \
			exit(1);                                                         \
		}                                                                        \
	} while (0)

_Static_assert(sizeof(struct rdsd_group_req) == 20, "rdsd_group_req layout");
_Static_assert(sizeof(struct rdsd_group_rule) == 12, "rdsd_group_rule layout");
_Static_assert(sizeof(struct rdsd_group_filter) == 24 + 16 * 12, "rdsd_group_filter layout");

static struct sockaddr_in addr(const char *ip, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	inet_pton(AF_INET, ip, &a.sin_addr);
	return a;
}

static int rds_socket(void)
{
	int fd = SOCKET(RDSD_AF_RDS, SOCK_SEQPACKET, 0);
	CHECK(fd >= 0);
	return fd;
}

static struct sockaddr_in bound(int fd)
{
	struct sockaddr_in a = addr("127.0.0.1", 0);
	CHECK(BIND(fd, (struct sockaddr *)&a, sizeof a) == 0);
	socklen_t l = sizeof a;
	CHECK(GETSOCKNAME(fd, (struct sockaddr *)&a, &l) == 0 && a.sin_port != 0);
	return a;
}

static int opt(int fd, int name, const void *v, socklen_t len)
{
	return SETSOCKOPT(fd, RDSD_SOL_RDS, name, v, len);
}

static int join(int fd, struct sockaddr_in g, uint32_t flags)
{
	struct rdsd_group_req r = { .group = g, .flags = flags };
	return opt(fd, RDSD_GROUP_JOIN, &r, sizeof r);
}

/* Blocking receive of one message: its length, payload in buf, sender in *from. */
static ssize_t recv_one(int fd, char *buf, size_t len, struct sockaddr_in *from)
{
	socklen_t fl = sizeof *from;
	ssize_t n = RECVFROM(fd, buf, len, 0, (struct sockaddr *)from, &fl);
	CHECK(n < 0 || fl == sizeof *from);
	return n;
}

/* Waits (up to about 10 s) until POLLOUT on fd is `want`; 1 if it came. */
static int wait_pollout(int fd, int want)
{
	for (int i = 0; i < 10000; i++) {
		struct pollfd p = { .fd = fd, .events = POLLOUT };
		CHECK(poll(&p, 1, 0) >= 0);
		if (!!(p.revents & POLLOUT) == want)
			return 1;
		usleep(1000);
	}
	return 0;
}

static int same(struct sockaddr_in a, struct sockaddr_in b)
{
	return a.sin_addr.s_addr == b.sin_addr.s_addr && a.sin_port == b.sin_port;
}

static void expect(int fd, const char *msg, struct sockaddr_in src)
{
	char buf[256];
	struct sockaddr_in from;
	ssize_t n = recv_one(fd, buf, sizeof buf, &from);
	CHECK(n == (ssize_t)strlen(msg) && memcmp(buf, msg, n) == 0);
	CHECK(from.sin_family == AF_INET && same(from, src));
}

static void expect_none(int fd)
{
	char buf[256];
	struct sockaddr_in from;
	socklen_t fl = sizeof from;
	CHECK(RECVFROM(fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&from, &fl) == -1 &&
	      errno == EAGAIN);
}

int main(void)
{
	int s = rds_socket(), t = rds_socket(), m1 = rds_socket(), m2 = rds_socket();
	int unbound = rds_socket();
	struct sockaddr_in sa = bound(s), ta = bound(t);
	bound(m1);
	bound(m2);
	struct sockaddr_in g = addr("239.1.2.3", 5000);

	/* create: bad optlen, bad family, not multicast, port 0; then once only */
	CHECK(opt(s, RDSD_GROUP_CREATE, &g, sizeof g - 1) == -1 && errno == EINVAL);
	struct sockaddr_in bad = g;
	bad.sin_family = AF_UNIX;
	CHECK(opt(s, RDSD_GROUP_CREATE, &bad, sizeof bad) == -1 && errno == EINVAL);
	bad = addr("10.1.2.3", 5000);
	CHECK(opt(s, RDSD_GROUP_CREATE, &bad, sizeof bad) == -1 && errno == EINVAL);
	bad = addr("239.1.2.3", 0);
	CHECK(opt(s, RDSD_GROUP_CREATE, &bad, sizeof bad) == -1 && errno == EINVAL);
	CHECK(opt(s, RDSD_GROUP_CREATE, &g, sizeof g) == 0);
	CHECK(opt(t, RDSD_GROUP_CREATE, &g, sizeof g) == -1 && errno == EADDRINUSE);

	/* join: bad optlen, unknown flag, no such group, unbound socket; then twice */
	struct rdsd_group_req req = { .group = g, .flags = 0 };
	CHECK(opt(m1, RDSD_GROUP_JOIN, &req, sizeof req.group) == -1 && errno == EINVAL);
	CHECK(join(m1, g, 4) == -1 && errno == EINVAL);
	CHECK(join(m1, addr("239.9.9.9", 5000), 0) == -1 && errno == ENOENT);
	CHECK(join(unbound, g, 0) == -1 && errno == ENOTCONN);
	CHECK(join(m1, g, 0) == 0);
	CHECK(join(m1, g, 0) == -1 && errno == EADDRINUSE);
	CHECK(join(m2, g, RDSD_GROUP_DROP_WHEN_FULL) == 0);

	/* set flags: unknown flag, not a member */
	req.flags = 8;
	CHECK(opt(m2, RDSD_GROUP_SET_FLAGS, &req, sizeof req) == -1 && errno == EINVAL);
	req.flags = 0;
	CHECK(opt(m2, RDSD_GROUP_SET_FLAGS, &req, sizeof req - 1) == -1 && errno == EINVAL);
	CHECK(opt(s, RDSD_GROUP_SET_FLAGS, &req, sizeof req) == -1 && errno == EADDRNOTAVAIL);
	CHECK(opt(m2, RDSD_GROUP_SET_FLAGS, &req, sizeof req) == 0);

	/* sendto, sendmsg: both members get each message from s, in order; s is no member. The
	 * order between two senders is rdsd's choice, so t sends once s's messages are in (a
	 * message at one member is at all of them). */
	CHECK(SENDTO(s, "one", 3, 0, (struct sockaddr *)&g, sizeof g) == 3);
	struct iovec iov[2] = { { .iov_base = "tw", .iov_len = 2 }, { .iov_base = "o", .iov_len = 1 } };
	struct msghdr mh = { .msg_name = &g, .msg_namelen = sizeof g, .msg_iov = iov, .msg_iovlen = 2 };
	CHECK(SENDMSG(s, &mh, 0) == 3);
	expect(m1, "one", sa);
	expect(m1, "two", sa);
	CHECK(SENDTO(t, "three", 5, 0, (struct sockaddr *)&g, sizeof g) == 5);
	expect(m1, "three", ta);
	expect(m2, "one", sa);
	expect(m2, "two", sa);
	expect(m2, "three", ta);
	expect_none(s);

	/* LOOPBACK: s joins and gets its own message */
	CHECK(join(s, g, RDSD_GROUP_LOOPBACK) == 0);
	CHECK(SENDTO(s, "loop", 4, 0, (struct sockaddr *)&g, sizeof g) == 4);
	expect(s, "loop", sa);
	expect(m1, "loop", sa);
	expect(m2, "loop", sa);

	/* filter: m2 takes nothing from s; short optlen, too many rules, bad mode are EINVAL */
	struct rdsd_group_filter f = { .group = g, .mode = RDSD_GROUP_FILTER_EXCEPT, .nrules = 1 };
	f.rules[0].addr = sa.sin_addr;
	f.rules[0].prefix_len = 32;
	f.rules[0].first_port = ntohs(sa.sin_port);
	f.rules[0].last_port = ntohs(sa.sin_port);
	socklen_t one_rule = offsetof(struct rdsd_group_filter, rules) + sizeof f.rules[0];
	CHECK(opt(m2, RDSD_GROUP_FILTER, &f, one_rule - 1) == -1 && errno == EINVAL);
	f.nrules = 17;
	CHECK(opt(m2, RDSD_GROUP_FILTER, &f, sizeof f) == -1 && errno == EINVAL);
	f.nrules = 1;
	f.mode = 3;
	CHECK(opt(m2, RDSD_GROUP_FILTER, &f, one_rule) == -1 && errno == EINVAL);
	f.mode = RDSD_GROUP_FILTER_EXCEPT;
	CHECK(opt(t, RDSD_GROUP_FILTER, &f, one_rule) == -1 && errno == EADDRNOTAVAIL);
	CHECK(opt(m2, RDSD_GROUP_FILTER, &f, one_rule) == 0);
	CHECK(SENDTO(s, "from s", 6, 0, (struct sockaddr *)&g, sizeof g) == 6);
	expect(m1, "from s", sa);
	CHECK(SENDTO(t, "from t", 6, 0, (struct sockaddr *)&g, sizeof g) == 6);
	expect(m1, "from t", ta);
	expect(m2, "from t", ta); /* "from s" was filtered out, and it came first */
	expect(s, "from s", sa);
	expect(s, "from t", ta);
	f.mode = RDSD_GROUP_FILTER_ALL;
	CHECK(opt(m2, RDSD_GROUP_FILTER, &f, offsetof(struct rdsd_group_filter, rules)) == 0);

	/* leave: then not a member; leaving s's loopback membership too */
	CHECK(opt(m2, RDSD_GROUP_LEAVE, &g, sizeof g - 1) == -1 && errno == EINVAL);
	CHECK(opt(m2, RDSD_GROUP_LEAVE, &g, sizeof g) == 0);
	CHECK(opt(m2, RDSD_GROUP_LEAVE, &g, sizeof g) == -1 && errno == EADDRNOTAVAIL);
	CHECK(opt(s, RDSD_GROUP_LEAVE, &g, sizeof g) == 0);

	/* connect + send to the group */
#ifdef USE_CAPI
	CHECK(rdsd_poll_fd(t) == t);
#endif
	CHECK(CONNECT(t, (struct sockaddr *)&g, sizeof g) == 0);
	CHECK(SEND(t, "connected", 9, 0) == 9);
	expect(m1, "connected", ta);
	expect_none(m2);

	/* flow control: full (tiny SO_RCVBUF, not reading, no DROP_WHEN_FULL) holds the group
	 * back; dropper (the same, with DROP_WHEN_FULL) is skipped instead */
	int full = rds_socket(), u = rds_socket(), dropper = rds_socket();
	bound(full);
	bound(u);
	bound(dropper);
#ifdef USE_CAPI
	CHECK(rdsd_poll_fd(u) == u);
#endif
	CHECK(CONNECT(u, (struct sockaddr *)&g, sizeof g) == 0);
	CHECK(wait_pollout(u, 1));
	int tiny = 1;
	CHECK(SETSOCKOPT(full, SOL_SOCKET, SO_RCVBUF, &tiny, sizeof tiny) == 0);
	CHECK(join(full, g, 0) == 0);
	CHECK(SETSOCKOPT(dropper, SOL_SOCKET, SO_RCVBUF, &tiny, sizeof tiny) == 0);
	CHECK(join(dropper, g, RDSD_GROUP_DROP_WHEN_FULL) == 0);
	char msg[512];
	memset(msg, 'x', sizeof msg);
	int sent = 0;
	for (; sent < 100000; sent++) {
		snprintf(msg, sizeof msg, "%d", sent);
		if (SEND(t, msg, sizeof msg, MSG_DONTWAIT) != (ssize_t)sizeof msg)
			break;
	}
	CHECK(sent < 100000 && errno == EAGAIN);
	CHECK(SEND(t, msg, sizeof msg, MSG_DONTWAIT) == -1 && errno == EAGAIN);
	/* t's EAGAIN may be its own send buffer, filled before rdsd's poll thread caught up.
	 * u, connected to the group, has sent nothing: its fd loses POLLOUT only when rdsd marks
	 * the group full, which it does once it reaches t's message that `full` cannot take
	 * (wait for that, bounded). From then on a send to the group is EAGAIN. */
	CHECK(wait_pollout(u, 0));
	CHECK(SEND(u, "u", 1, MSG_DONTWAIT) == -1 && errno == EAGAIN);
	CHECK(SENDTO(u, "u", 1, MSG_DONTWAIT, (struct sockaddr *)&g, sizeof g) == -1 &&
	      errno == EAGAIN);
	CHECK(wait_pollout(t, 0));
	printf("full after %d messages\n", sent);
	/* every accepted message reaches both members, in order, once `full` reads; u's refused
	 * one reaches nobody */
	char buf[2048];
	struct sockaddr_in from;
	for (int i = 0; i < sent; i++) {
		char want[16];
		snprintf(want, sizeof want, "%d", i);
		CHECK(recv_one(full, buf, sizeof buf, &from) == sizeof msg && strcmp(buf, want) == 0);
		CHECK(recv_one(m1, buf, sizeof buf, &from) == sizeof msg && strcmp(buf, want) == 0);
		CHECK(same(from, ta));
	}
	/* room again (dropper, still full, does not count): a blocking send goes through (it
	 * waits if rdsd has not caught up) */
	CHECK(wait_pollout(t, 1) && wait_pollout(u, 1));
	snprintf(msg, sizeof msg, "last");
	CHECK(SEND(t, msg, sizeof msg, 0) == sizeof msg);
	CHECK(recv_one(full, buf, sizeof buf, &from) == sizeof msg && strcmp(buf, "last") == 0);
	CHECK(recv_one(m1, buf, sizeof buf, &from) == sizeof msg && strcmp(buf, "last") == 0);
	/* dropper got a prefix of the messages, in order, and missed some */
	int got = 0, prev = -1;
	for (;;) {
		socklen_t fl = sizeof from;
		ssize_t n = RECVFROM(dropper, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&from,
				     &fl);
		if (n < 0)
			break;
		CHECK(n == sizeof msg && same(from, ta));
		int k = strcmp(buf, "last") == 0 ? sent : atoi(buf);
		CHECK(k > prev);
		prev = k;
		got++;
	}
	CHECK(errno == EAGAIN && got >= 1 && got < sent + 1);

	CHECK(CLOSE(dropper) == 0);
	CHECK(CLOSE(full) == 0 && CLOSE(u) == 0 && CLOSE(m1) == 0 && CLOSE(m2) == 0 && CLOSE(s) == 0);
	CHECK(CLOSE(t) == 0 && CLOSE(unbound) == 0);
	printf("GROUPS OK\n");
	return 0;
}
