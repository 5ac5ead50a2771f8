/* rdsguest: the guest side of the rdsd VM lab. Static, uses the kernel's AF_RDS (rds_tcp).
 *
 * Every line it prints starts with "RDSG <tag> " where <tag> is $RDSG_TAG (set by the guest's
 * /init command loop), so the host can demultiplex concurrent jobs on one serial line.
 *
 * Payload convention (shared with tests/src/vmlab.rs): a message of length >= 8 starts with its
 * sequence number (u64 little endian) and is filled with (seq % 251); shorter messages carry
 * no sequence number and are filled with (seq % 251) too.
 *
 * Commands (addresses are a.b.c.d:port; options are key=value after the fixed arguments):
 *   recv  BIND COUNT TIMEOUT_MS [rcvbuf=N] [delay_us=N] [sizes=a,b,..] [nsock=N]
 *         Receives COUNT messages in total on NSOCK sockets bound to consecutive ports,
 *         waiting in poll (or, with epoll=1, in epoll_wait, every socket registered for EPOLLIN);
 *         checks per-(socket, source) order, and with sizes= the length of each message
 *         (cycling through the list). With hold_ms=N it reads nothing for N ms after
 *         binding (then prints "reading"). With idle_ms=N it stops early, as done, once
 *         no message came for N ms after the first. A source's first message sets the
 *         sequence number expected next ("first="/"last=" of the first source are
 *         printed). Prints "bound" once bound, then
 *         "done got=N sources=S bad=B" (or "timeout got=N ...").
 *   send  BIND DEST COUNT SIZE [sizes=a,b,..] [nonblock=1] [nsock=N] [first=SEQ]
 *         [delay_us=N (after each round)] [linger=S (seconds alive after the last send)]
 *         NSOCK sockets bound to consecutive ports each send COUNT messages to DEST,
 *         round robin. Non-blocking: ENOBUFS/EAGAIN are retried after poll(POLLOUT) and
 *         counted. Prints "sent n=N enobufs=E eagain=A ms=T".
 *   cong  BIND DEST
 *         Non-blocking sends of 1000-byte messages until ENOBUFS (prints "enobufs n=N"), then
 *         with RDS_CONG_MONITOR waits for the congestion update (prints "cong_update"),
 *         then retries until a send succeeds (prints "recovered n=N ms=T").
 *   ping  BIND DEST COUNT
 *         Sends COUNT 0-byte messages to DEST (port 0 = RDS ping) and waits for each 0-byte
 *         answer from port 0; prints "pong i from=ADDR len=L us=T", then "pings ok=N".
 *   counters-all
 *         Every non-zero counter of the kernel's RDS, "counter NAME VALUE" per line.
 *   counters PEER
 *         The kernel's RDS counters for congestion maps and its TCP connections to PEER
 *         (rds-info -c / -n): prints "counters cong_rx=R cong_queued=Q conns=C".
 *   info
 *         The connection, TCP socket and message tables, as rds-info -n / -T / -s / -t / -r
 *         print them: a line "conn laddr=A faddr=F tx_seq=T rx_seq=R transport=N flags=X"
 *         per connection, "tcp local=A:P peer=F:Q hdr_rem=H data_rem=D sent_nxt=N
 *         seen_una=U" per TCP socket and "msg KIND seq=S len=L laddr=A lport=P faddr=F
 *         fport=Q" per message (KIND send, retrans or recv), then
 *         "info conns=C tcp=T send=S retrans=R recv=V".
 *   info6
 *         The same through the IPv6 tables (RDS6_INFO_*), printed the same way (v4-mapped
 *         addresses as IPv4).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/rds.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef AF_RDS
#define AF_RDS 21
#endif
#ifndef SOL_RDS
#define SOL_RDS 276
#endif

#define MAXMSG (1 << 20)
#define MAXSOCK 64

static const char *tag = "?";

static void out(const char *fmt, ...)
{
	char buf[1024];
	int n = snprintf(buf, sizeof buf, "RDSG %s ", tag);
	va_list ap;
	va_start(ap, fmt);
	n += vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof buf - 2)
		n = sizeof buf - 2;
	buf[n++] = '\n';
	/* One write per line: concurrent jobs never interleave within a line. */
	if (write(1, buf, n) < 0)
		_exit(3);
}

static void die(const char *what)
{
	out("FAIL %s: %s", what, strerror(errno));
	exit(2);
}

static uint64_t now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static struct sockaddr_in parse_addr(const char *s)
{
	struct sockaddr_in a;
	char ip[64];
	const char *c = strrchr(s, ':');
	memset(&a, 0, sizeof a);
	a.sin_family = AF_INET;
	if (!c || c - s >= (int)sizeof ip) {
		out("FAIL bad address %s", s);
		exit(2);
	}
	memcpy(ip, s, c - s);
	ip[c - s] = 0;
	if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) {
		out("FAIL bad address %s", s);
		exit(2);
	}
	a.sin_port = htons(atoi(c + 1));
	return a;
}

static const char *fmt_addr(const struct sockaddr_in *a, char *buf)
{
	char ip[32];
	inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
	sprintf(buf, "%s:%u", ip, ntohs(a->sin_port));
	return buf;
}

static long opt(int argc, char **argv, int from, const char *key, long dflt)
{
	size_t k = strlen(key);
	for (int i = from; i < argc; i++)
		if (!strncmp(argv[i], key, k) && argv[i][k] == '=')
			return strtol(argv[i] + k + 1, NULL, 0);
	return dflt;
}

static int opt_sizes(int argc, char **argv, int from, long *sizes, int max)
{
	for (int i = from; i < argc; i++) {
		if (strncmp(argv[i], "sizes=", 6))
			continue;
		int n = 0;
		char *p = argv[i] + 6;
		while (*p && n < max) {
			sizes[n++] = strtol(p, &p, 0);
			if (*p == ',')
				p++;
		}
		return n;
	}
	return 0;
}

static int rds_socket(const struct sockaddr_in *bind_to, int rcvbuf)
{
	int fd = socket(AF_RDS, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket(AF_RDS)");
	/* rds_tcp unless RDSG_TRANSPORT=ib (the RDS/IB transport, rds_rdma). */
	const char *want = getenv("RDSG_TRANSPORT");
	int tr = want && !strcmp(want, "ib") ? RDS_TRANS_IB : RDS_TRANS_TCP;
	if (setsockopt(fd, SOL_RDS, SO_RDS_TRANSPORT, &tr, sizeof tr))
		die("SO_RDS_TRANSPORT");
	/* 1 MiB messages need SO_SNDBUF/2 >= 1 MiB: force past wmem_max (we are root). */
	int sb = 8 << 20;
	if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sb, sizeof sb))
		die("SO_SNDBUFFORCE");
	if (rcvbuf > 0) {
		if (setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf))
			die("SO_RCVBUF");
	} else {
		int rb = 8 << 20;
		if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rb, sizeof rb))
			die("SO_RCVBUFFORCE");
	}
	if (bind(fd, (const struct sockaddr *)bind_to, sizeof *bind_to))
		die("bind");
	return fd;
}

static void fill(unsigned char *buf, uint64_t seq, long len)
{
	memset(buf, (int)(seq % 251), len);
	if (len >= 8)
		memcpy(buf, &seq, 8);
}

struct source {
	uint32_t addr;
	uint16_t port;
	int sock;
	int seen;
	uint64_t first;
	uint64_t next;
};

static int cmd_recv(int argc, char **argv)
{
	if (argc < 5)
		return out("FAIL usage"), 2;
	struct sockaddr_in base = parse_addr(argv[2]);
	long count = atol(argv[3]);
	long timeout_ms = atol(argv[4]);
	int rcvbuf = (int)opt(argc, argv, 5, "rcvbuf", 0);
	long delay_us = opt(argc, argv, 5, "delay_us", 0);
	int nsock = (int)opt(argc, argv, 5, "nsock", 1);
	long sizes[64];
	int nsizes = opt_sizes(argc, argv, 5, sizes, 64);
	if (nsock < 1 || nsock > MAXSOCK)
		return out("FAIL nsock"), 2;
	struct pollfd pfd[MAXSOCK];
	for (int i = 0; i < nsock; i++) {
		struct sockaddr_in a = base;
		a.sin_port = htons(ntohs(base.sin_port) + i);
		pfd[i].fd = rds_socket(&a, rcvbuf);
		pfd[i].events = POLLIN;
	}
	int ep = -1;
	if (opt(argc, argv, 5, "epoll", 0)) {
		ep = epoll_create1(0);
		if (ep < 0)
			die("epoll_create1");
		for (int i = 0; i < nsock; i++) {
			struct epoll_event e = { .events = EPOLLIN, .data.u32 = (uint32_t)i };
			if (epoll_ctl(ep, EPOLL_CTL_ADD, pfd[i].fd, &e) < 0)
				die("epoll_ctl");
		}
	}
	out("bound");
	long hold_ms = opt(argc, argv, 5, "hold_ms", 0);
	if (hold_ms) {
		usleep(hold_ms * 1000);
		out("reading");
	}
	unsigned char *buf = malloc(MAXMSG + 16);
	static struct source src[4096];
	int nsrc = 0;
	long got = 0, bad = 0, total_bytes = 0;
	uint64_t start = now_us(), deadline = start + (uint64_t)timeout_ms * 1000;
	long idle_ms = opt(argc, argv, 5, "idle_ms", 0);
	while (got < count) {
		long left = (long)((deadline - now_us()) / 1000);
		int idle = idle_ms && got > 0;
		if (idle && left > idle_ms)
			left = idle_ms;
		int pr = 0;
		if (now_us() < deadline && ep >= 0) {
			struct epoll_event evs[MAXSOCK];
			pr = epoll_wait(ep, evs, nsock, left > 0 ? left : 0);
			for (int i = 0; i < nsock; i++)
				pfd[i].revents = 0;
			for (int k = 0; k < pr; k++)
				pfd[evs[k].data.u32].revents = (short)evs[k].events;
		} else if (now_us() < deadline) {
			pr = poll(pfd, nsock, left > 0 ? left : 0);
		}
		if (pr <= 0 && idle && now_us() < deadline)
			break;
		if (pr <= 0) {
			out("timeout got=%ld sources=%d bad=%ld first=%llu last=%llu", got, nsrc, bad,
			    (unsigned long long)(nsrc ? src[0].first : 0),
			    (unsigned long long)(nsrc ? src[0].next - 1 : 0));
			return 1;
		}
		for (int i = 0; i < nsock && got < count; i++) {
			if (!(pfd[i].revents & POLLIN))
				continue;
			struct sockaddr_in from;
			socklen_t fl = sizeof from;
			ssize_t n = recvfrom(pfd[i].fd, buf, MAXMSG + 16, MSG_DONTWAIT,
					     (struct sockaddr *)&from, &fl);
			if (n < 0) {
				if (errno == EAGAIN)
					continue;
				die("recvfrom");
			}
			int s;
			for (s = 0; s < nsrc; s++)
				if (src[s].addr == from.sin_addr.s_addr && src[s].port == from.sin_port &&
				    src[s].sock == i)
					break;
			if (s == nsrc) {
				if (nsrc == 4096)
					return out("FAIL too many sources"), 2;
				src[nsrc].addr = from.sin_addr.s_addr;
				src[nsrc].port = from.sin_port;
				src[nsrc].sock = i;
				src[nsrc].next = 0;
				nsrc++;
			}
			uint64_t seq = src[s].next;
			if (n >= 8)
				memcpy(&seq, buf, 8);
			/* A source's first message sets its start (a test that needs 0 checks first=). */
			if (src[s].next == 0 && !src[s].seen)
				src[s].next = seq, src[s].first = seq;
			src[s].seen = 1;
			char fa[64];
			if (nsizes && n != sizes[got % nsizes]) {
				bad++;
				out("bad-size got=%ld len=%zd want=%ld from=%s", got, n,
				    sizes[got % nsizes], fmt_addr(&from, fa));
			} else if (seq != src[s].next) {
				bad++;
				out("bad-seq sock=%d from=%s seq=%llu want=%llu", i, fmt_addr(&from, fa),
				    (unsigned long long)seq, (unsigned long long)src[s].next);
			} else {
				for (ssize_t k = 8; k < n; k++)
					if (buf[k] != seq % 251) {
						bad++;
						out("bad-byte seq=%llu at=%zd", (unsigned long long)seq, k);
						break;
					}
			}
			src[s].next = seq + 1;
			got++;
			total_bytes += n;
			if (delay_us)
				usleep(delay_us);
		}
	}
	out("done got=%ld sources=%d bad=%ld bytes=%ld ms=%llu first=%llu last=%llu", got, nsrc, bad,
	    total_bytes, (unsigned long long)((now_us() - start) / 1000),
	    (unsigned long long)(nsrc ? src[0].first : 0),
	    (unsigned long long)(nsrc ? src[0].next - 1 : 0));
	return bad ? 1 : 0;
}

static int cmd_send(int argc, char **argv)
{
	if (argc < 6)
		return out("FAIL usage"), 2;
	struct sockaddr_in base = parse_addr(argv[2]);
	struct sockaddr_in dest = parse_addr(argv[3]);
	long count = atol(argv[4]);
	long size = atol(argv[5]);
	int nonblock = (int)opt(argc, argv, 6, "nonblock", 0);
	int nsock = (int)opt(argc, argv, 6, "nsock", 1);
	uint64_t first = (uint64_t)opt(argc, argv, 6, "first", 0);
	long delay_us = opt(argc, argv, 6, "delay_us", 0);
	long sizes[64];
	int nsizes = opt_sizes(argc, argv, 6, sizes, 64);
	if (nsock < 1 || nsock > MAXSOCK)
		return out("FAIL nsock"), 2;
	int fds[MAXSOCK];
	for (int i = 0; i < nsock; i++) {
		struct sockaddr_in a = base;
		a.sin_port = htons(ntohs(base.sin_port) + i);
		fds[i] = rds_socket(&a, 0);
	}
	out("bound");
	unsigned char *buf = malloc(MAXMSG + 16);
	long enobufs = 0, eagain = 0;
	uint64_t start = now_us();
	for (long k = 0; k < count; k++) {
		for (int i = 0; i < nsock; i++) {
			long len = nsizes ? sizes[k % nsizes] : size;
			uint64_t seq = first + k;
			fill(buf, seq, len);
			for (;;) {
				ssize_t r = sendto(fds[i], buf, len, nonblock ? MSG_DONTWAIT : 0,
						   (struct sockaddr *)&dest, sizeof dest);
				if (r == len)
					break;
				if (r >= 0) {
					out("FAIL short send %zd of %ld", r, len);
					return 2;
				}
				int e = errno;
				if (e == ENOBUFS || e == EAGAIN) {
					if (e == ENOBUFS) {
						enobufs++;
						usleep(1000);
					} else {
						eagain++;
						struct pollfd p = { .fd = fds[i], .events = POLLOUT };
						poll(&p, 1, 10);
					}
					continue;
				}
				if (errno == EINTR)
					continue;
				die("sendto");
			}
		}
		if (delay_us)
			usleep(delay_us);
	}
	out("sent n=%ld enobufs=%ld eagain=%ld ms=%llu", count * nsock, enobufs, eagain,
	    (unsigned long long)((now_us() - start) / 1000));
	/* Stay alive a while: closing the socket drops what the kernel has not yet had
	 * acknowledged (rds_release -> rds_send_drop_to). */
	sleep((unsigned)opt(argc, argv, 6, "linger", 5));
	return 0;
}

static int cmd_cong(int argc, char **argv)
{
	if (argc < 4)
		return out("FAIL usage"), 2;
	struct sockaddr_in b = parse_addr(argv[2]);
	struct sockaddr_in dest = parse_addr(argv[3]);
	int fd = rds_socket(&b, 0);
	int on = 1;
	if (setsockopt(fd, SOL_RDS, RDS_CONG_MONITOR, &on, sizeof on))
		die("RDS_CONG_MONITOR");
	out("bound");
	unsigned char buf[1000];
	long n = 0;
	for (;;) {
		fill(buf, n, sizeof buf);
		ssize_t r = sendto(fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&dest,
				   sizeof dest);
		if (r == (ssize_t)sizeof buf) {
			n++;
			if (n > 200000)
				return out("FAIL never congested"), 2;
			continue;
		}
		if (errno == ENOBUFS)
			break;
		if (errno == EAGAIN) {
			usleep(1000);
			continue;
		}
		die("sendto");
	}
	out("enobufs n=%ld", n);
	uint64_t t0 = now_us();
	/* Wait for the congestion update (a cmsg RDS_CMSG_CONG_UPDATE on a 0-byte read). */
	int updated = 0;
	while (!updated && now_us() - t0 < 60000000ull) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (poll(&p, 1, 100) <= 0)
			continue;
		char cbuf[256];
		struct msghdr m;
		memset(&m, 0, sizeof m);
		m.msg_control = cbuf;
		m.msg_controllen = sizeof cbuf;
		ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT);
		if (r < 0)
			continue;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
			if (c->cmsg_level == SOL_RDS && c->cmsg_type == RDS_CMSG_CONG_UPDATE) {
				uint64_t mask;
				memcpy(&mask, CMSG_DATA(c), 8);
				out("cong_update mask=%llu", (unsigned long long)mask);
				updated = 1;
			}
	}
	for (;;) {
		fill(buf, n, sizeof buf);
		ssize_t r = sendto(fd, buf, sizeof buf, MSG_DONTWAIT, (struct sockaddr *)&dest,
				   sizeof dest);
		if (r == (ssize_t)sizeof buf)
			break;
		if (errno != ENOBUFS && errno != EAGAIN)
			die("sendto");
		if (now_us() - t0 > 60000000ull)
			return out("FAIL still congested after 60 s"), 1;
		usleep(2000);
	}
	out("recovered n=%ld ms=%llu", n + 1, (unsigned long long)((now_us() - t0) / 1000));
	sleep(2);
	return 0;
}

static int cmd_ping(int argc, char **argv)
{
	if (argc < 5)
		return out("FAIL usage"), 2;
	struct sockaddr_in b = parse_addr(argv[2]);
	struct sockaddr_in dest = parse_addr(argv[3]);
	long count = atol(argv[4]);
	int fd = rds_socket(&b, 0);
	long ok = 0;
	for (long i = 0; i < count; i++) {
		uint64_t t0 = now_us();
		if (sendto(fd, "", 0, 0, (struct sockaddr *)&dest, sizeof dest) < 0)
			die("sendto ping");
		struct pollfd p = { .fd = fd, .events = POLLIN };
		if (poll(&p, 1, 5000) <= 0) {
			out("no-pong %ld", i);
			continue;
		}
		char buf[64];
		struct sockaddr_in from;
		socklen_t fl = sizeof from;
		ssize_t n = recvfrom(fd, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl);
		if (n < 0)
			die("recvfrom pong");
		char fa[64];
		out("pong %ld from=%s len=%zd us=%llu", i, fmt_addr(&from, fa), n,
		    (unsigned long long)(now_us() - t0));
		if (n == 0 && from.sin_port == 0 && from.sin_addr.s_addr == dest.sin_addr.s_addr)
			ok++;
	}
	out("pings ok=%ld", ok);
	return ok == count ? 0 : 1;
}

/* One RDS_INFO table into a malloc'd buffer (getsockopt says ENOSPC and the size needed
 * until the buffer fits). Returns the item size; *len gets the bytes. */
static int rds_info(int fd, int what, void **buf, socklen_t *len)
{
	*len = 4096;
	for (;;) {
		*buf = realloc(*buf, *len);
		if (!*buf)
			die("realloc");
		socklen_t l = *len;
		int item = getsockopt(fd, SOL_RDS, what, *buf, &l);
		if (item >= 0) {
			*len = l;
			return item;
		}
		if (errno != ENOSPC)
			die("getsockopt RDS_INFO");
		*len = l > *len ? l : *len * 2;
	}
}

static int cmd_counters(int argc, char **argv)
{
	if (argc < 3)
		return out("FAIL usage"), 2;
	struct sockaddr_in peer = parse_addr(argv[2]);
	int fd = socket(AF_RDS, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket");
	void *buf = NULL;
	socklen_t len;
	unsigned long long rx = 0, queued = 0, conns = 0;
	int item = rds_info(fd, RDS_INFO_COUNTERS, &buf, &len);
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_counter c;
		memcpy(&c, (char *)buf + off, sizeof c);
		if (!strncmp((char *)c.name, "cong_update_received", sizeof c.name))
			rx = c.value;
		if (!strncmp((char *)c.name, "cong_update_queued", sizeof c.name))
			queued = c.value;
	}
	item = rds_info(fd, RDS_INFO_CONNECTIONS, &buf, &len);
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_connection c;
		memcpy(&c, (char *)buf + off, sizeof c);
		if (c.faddr == peer.sin_addr.s_addr && !strcmp((char *)c.transport, "tcp"))
			conns++;
	}
	free(buf);
	out("counters cong_rx=%llu cong_queued=%llu conns=%llu", rx, queued, conns);
	return 0;
}

/* counters-all: every non-zero counter of the kernel's RDS (rds-info -c), one per line. */
static int cmd_counters_all(void)
{
	int fd = socket(AF_RDS, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket");
	void *buf = NULL;
	socklen_t len;
	int item = rds_info(fd, RDS_INFO_COUNTERS, &buf, &len);
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_counter c;
		memcpy(&c, (char *)buf + off, sizeof c);
		if (c.value)
			out("counter %.32s %llu", (char *)c.name, (unsigned long long)c.value);
	}
	free(buf);
	return 0;
}

static int info_messages(int fd, int what, const char *kind, void **buf)
{
	socklen_t len;
	int n = 0;
	int item = rds_info(fd, what, buf, &len);
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_message m;
		memcpy(&m, (char *)*buf + off, sizeof m);
		char l[INET_ADDRSTRLEN], f[INET_ADDRSTRLEN];
		inet_ntop(AF_INET, &m.laddr, l, sizeof l);
		inet_ntop(AF_INET, &m.faddr, f, sizeof f);
		out("msg %s seq=%llu len=%u laddr=%s lport=%u faddr=%s fport=%u", kind,
		    (unsigned long long)m.seq, (unsigned)m.len, l, (unsigned)ntohs(m.lport), f,
		    (unsigned)ntohs(m.fport));
		n++;
	}
	return n;
}

static int cmd_info(void)
{
	int fd = socket(AF_RDS, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket");
	void *buf = NULL;
	socklen_t len;
	int conns = 0;
	int item = rds_info(fd, RDS_INFO_CONNECTIONS, &buf, &len);
	if (item != (int)sizeof(struct rds_info_connection) && len > 0)
		return out("FAIL connection record of %d bytes", item), 1;
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_connection c;
		memcpy(&c, (char *)buf + off, sizeof c);
		char l[INET_ADDRSTRLEN], f[INET_ADDRSTRLEN];
		inet_ntop(AF_INET, &c.laddr, l, sizeof l);
		inet_ntop(AF_INET, &c.faddr, f, sizeof f);
		out("conn laddr=%s faddr=%s tx_seq=%llu rx_seq=%llu transport=%.16s flags=%u", l, f,
		    (unsigned long long)c.next_tx_seq, (unsigned long long)c.next_rx_seq,
		    (char *)c.transport, (unsigned)c.flags);
		conns++;
	}
	int tcp = 0;
	item = rds_info(fd, RDS_INFO_TCP_SOCKETS, &buf, &len);
	if (item != (int)sizeof(struct rds_info_tcp_socket) && len > 0)
		return out("FAIL tcp socket record of %d bytes", item), 1;
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds_info_tcp_socket t;
		memcpy(&t, (char *)buf + off, sizeof t);
		char l[INET_ADDRSTRLEN], f[INET_ADDRSTRLEN];
		inet_ntop(AF_INET, &t.local_addr, l, sizeof l);
		inet_ntop(AF_INET, &t.peer_addr, f, sizeof f);
		out("tcp local=%s:%u peer=%s:%u hdr_rem=%llu data_rem=%llu sent_nxt=%u seen_una=%u", l,
		    (unsigned)ntohs(t.local_port), f, (unsigned)ntohs(t.peer_port),
		    (unsigned long long)t.hdr_rem, (unsigned long long)t.data_rem,
		    (unsigned)t.last_sent_nxt, (unsigned)t.last_seen_una);
		tcp++;
	}
	int send = info_messages(fd, RDS_INFO_SEND_MESSAGES, "send", &buf);
	int retrans = info_messages(fd, RDS_INFO_RETRANS_MESSAGES, "retrans", &buf);
	int recv = info_messages(fd, RDS_INFO_RECV_MESSAGES, "recv", &buf);
	free(buf);
	out("info conns=%d tcp=%d send=%d retrans=%d recv=%d", conns, tcp, send, retrans, recv);
	return 0;
}

/* An RDS6_INFO address: dotted IPv4 when it is v4-mapped (so that info6 prints what info
 * prints for IPv4 entries). */
static const char *addr6(struct in6_addr a, char *buf, socklen_t n)
{
	if (IN6_IS_ADDR_V4MAPPED(&a))
		return inet_ntop(AF_INET, &a.s6_addr[12], buf, n);
	return inet_ntop(AF_INET6, &a, buf, n);
}

/* info6: the same tables through the IPv6 variants (RDS6_INFO_*), printed as info does. */
static int cmd_info6(void)
{
	int fd = socket(AF_RDS, SOCK_SEQPACKET, 0);
	if (fd < 0)
		die("socket");
	void *buf = NULL;
	socklen_t len;
	char l[INET6_ADDRSTRLEN], f[INET6_ADDRSTRLEN];
	int conns = 0, tcp = 0, msgs[3] = {0, 0, 0};
	int item = rds_info(fd, RDS6_INFO_CONNECTIONS, &buf, &len);
	if (item != (int)sizeof(struct rds6_info_connection) && len > 0)
		return out("FAIL v6 connection record of %d bytes", item), 1;
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds6_info_connection c;
		memcpy(&c, (char *)buf + off, sizeof c);
		out("conn laddr=%s faddr=%s tx_seq=%llu rx_seq=%llu transport=%.16s flags=%u",
		    addr6(c.laddr, l, sizeof l), addr6(c.faddr, f, sizeof f),
		    (unsigned long long)c.next_tx_seq, (unsigned long long)c.next_rx_seq,
		    (char *)c.transport, (unsigned)c.flags);
		conns++;
	}
	item = rds_info(fd, RDS6_INFO_TCP_SOCKETS, &buf, &len);
	if (item != (int)sizeof(struct rds6_info_tcp_socket) && len > 0)
		return out("FAIL v6 tcp socket record of %d bytes", item), 1;
	for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
		struct rds6_info_tcp_socket t;
		memcpy(&t, (char *)buf + off, sizeof t);
		out("tcp local=%s:%u peer=%s:%u hdr_rem=%llu data_rem=%llu sent_nxt=%u seen_una=%u",
		    addr6(t.local_addr, l, sizeof l), (unsigned)ntohs(t.local_port),
		    addr6(t.peer_addr, f, sizeof f), (unsigned)ntohs(t.peer_port),
		    (unsigned long long)t.hdr_rem, (unsigned long long)t.data_rem,
		    (unsigned)t.last_sent_nxt, (unsigned)t.last_seen_una);
		tcp++;
	}
	const int ids[3] = {RDS6_INFO_SEND_MESSAGES, RDS6_INFO_RETRANS_MESSAGES,
			    RDS6_INFO_RECV_MESSAGES};
	const char *kinds[3] = {"send", "retrans", "recv"};
	for (int k = 0; k < 3; k++) {
		item = rds_info(fd, ids[k], &buf, &len);
		if (item != (int)sizeof(struct rds6_info_message) && len > 0)
			return out("FAIL v6 message record of %d bytes", item), 1;
		for (socklen_t off = 0; item > 0 && off + item <= len; off += item) {
			struct rds6_info_message m;
			memcpy(&m, (char *)buf + off, sizeof m);
			out("msg %s seq=%llu len=%u laddr=%s lport=%u faddr=%s fport=%u", kinds[k],
			    (unsigned long long)m.seq, (unsigned)m.len, addr6(m.laddr, l, sizeof l),
			    (unsigned)ntohs(m.lport), addr6(m.faddr, f, sizeof f),
			    (unsigned)ntohs(m.fport));
			msgs[k]++;
		}
	}
	free(buf);
	out("info conns=%d tcp=%d send=%d retrans=%d recv=%d", conns, tcp, msgs[0], msgs[1],
	    msgs[2]);
	return 0;
}

int main(int argc, char **argv)
{
	const char *t = getenv("RDSG_TAG");
	if (t)
		tag = t;
	out("pid %d", (int)getpid());
	if (argc < 2)
		return out("FAIL usage"), 2;
	if (!strcmp(argv[1], "recv"))
		return cmd_recv(argc, argv);
	if (!strcmp(argv[1], "send"))
		return cmd_send(argc, argv);
	if (!strcmp(argv[1], "cong"))
		return cmd_cong(argc, argv);
	if (!strcmp(argv[1], "ping"))
		return cmd_ping(argc, argv);
	if (!strcmp(argv[1], "counters"))
		return cmd_counters(argc, argv);
	if (!strcmp(argv[1], "counters-all"))
		return cmd_counters_all();
	if (!strcmp(argv[1], "info"))
		return cmd_info();
	if (!strcmp(argv[1], "info6"))
		return cmd_info6();
	out("FAIL unknown command %s", argv[1]);
	return 2;
}
