/* fd-level behaviour of AF_RDS sockets under rdsd-run (tests/tests/preload.rs): flags from
 * socket(), fcntl O_NONBLOCK, connect + write/read, writev/readv, FIONREAD, MSG_TRUNC, dup and
 * dup2 and close, SO_RCVTIMEO, a receiver blocked in another thread, epoll on a mixed set
 * (and no stale EPOLLIN right after a receive), epoll on rdsd sockets only (answered from
 * the rings, and not once a dup or a fork may have added a kernel fd),
 * sendmmsg (one batch for rdsd), recvmmsg (Linux's rules), close_range and closefrom (the
 * sockets among the fds forgotten and released), and exec closing FD_CLOEXEC sockets only.
 * Plain socket API; prints "FDOPS OK". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond)                                                                      \
	do {                                                                             \
		if (!(cond)) {                                                           \
			printf("FAIL line %d: %s (errno %d %s)\n", __LINE__, #cond, errno, \
			       strerror(errno));                                          \
			exit(1);                                                         \
		}                                                                        \
	} while (0)

static struct sockaddr_in bound(int fd)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
	socklen_t l = sizeof a;
	CHECK(getsockname(fd, (struct sockaddr *)&a, &l) == 0);
	return a;
}

static int wait_in(int fd)
{
	struct pollfd p = { .fd = fd, .events = POLLIN };
	return poll(&p, 1, 10000) == 1 && (p.revents & POLLIN);
}

static void *blocked_recv(void *arg)
{
	int fd = *(int *)arg;
	char buf[64];
	ssize_t n = recv(fd, buf, sizeof buf, 0);
	return (void *)(long)(n == 6 && memcmp(buf, "thread", 6) == 0);
}

static void *blocked_recv_closed(void *arg)
{
	int fd = *(int *)arg;
	char buf[64];
	ssize_t n = recv(fd, buf, sizeof buf, 0);
	return (void *)(long)(n == 6 && memcmp(buf, "closed", 6) == 0);
}

static int fd_in_exec_child(int fd)
{
	char cmd[128];
	snprintf(cmd, sizeof cmd, "[ -e /proc/$$/fd/%d ]", fd);
	pid_t pid = fork();
	if (pid == 0) {
		execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
		_exit(127);
	}
	int st;
	waitpid(pid, &st, 0);
	return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int main(void)
{
	int a = socket(AF_RDS, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int b = socket(AF_RDS, SOCK_SEQPACKET, 0);
	CHECK(a >= 0 && b >= 0);
	CHECK(fcntl(a, F_GETFL) & O_NONBLOCK);
	CHECK(fcntl(a, F_GETFD) & FD_CLOEXEC);
	CHECK(!(fcntl(b, F_GETFD) & FD_CLOEXEC));
	struct sockaddr_in aa = bound(a), ba = bound(b);
	char buf[256];
	CHECK(recv(a, buf, sizeof buf, 0) == -1 && errno == EAGAIN);
	CHECK(write(a, "x", 1) == -1 && errno == ENOTCONN);

	/* connect + write, FIONREAD, read */
	CHECK(connect(a, (struct sockaddr *)&ba, sizeof ba) == 0);
	CHECK(write(a, "written", 7) == 7);
	CHECK(wait_in(b));
	int avail = -1;
	CHECK(ioctl(b, FIONREAD, &avail) == 0 && avail == 7);
	CHECK(read(b, buf, sizeof buf) == 7 && memcmp(buf, "written", 7) == 0);

	/* writev / readv, MSG_TRUNC */
	struct iovec wv[2] = { { "gath", 4 }, { "ered", 4 } };
	CHECK(writev(a, wv, 2) == 8);
	CHECK(wait_in(b));
	char p1[3], p2[16];
	struct iovec rv[2] = { { p1, 3 }, { p2, sizeof p2 } };
	CHECK(readv(b, rv, 2) == 8 && memcmp(p1, "gat", 3) == 0 && memcmp(p2, "hered", 5) == 0);
	CHECK(sendto(a, "0123456789", 10, 0, (struct sockaddr *)&ba, sizeof ba) == 10);
	CHECK(wait_in(b));
	CHECK(recv(b, buf, 4, MSG_TRUNC) == 10);

	/* sendmmsg: 8 messages (one gathered from two iovecs, one to an explicit address) in
	 * one call, each msg_len set, received in order */
	{
		struct mmsghdr mv[8];
		struct iovec iv[9];
		char pay[8][8];
		memset(mv, 0, sizeof mv);
		for (int k = 0; k < 8; k++) {
			snprintf(pay[k], sizeof pay[k], "mm%d", k);
			iv[k].iov_base = pay[k];
			iv[k].iov_len = strlen(pay[k]);
			mv[k].msg_hdr.msg_iov = &iv[k];
			mv[k].msg_hdr.msg_iovlen = 1;
		}
		iv[8] = (struct iovec){ "+", 1 };
		struct iovec two[2] = { iv[3], iv[8] };
		mv[3].msg_hdr.msg_iov = two;
		mv[3].msg_hdr.msg_iovlen = 2;
		mv[5].msg_hdr.msg_name = &ba;
		mv[5].msg_hdr.msg_namelen = sizeof ba;
		CHECK(sendmmsg(a, mv, 8, 0) == 8);
		for (int k = 0; k < 8; k++) {
			CHECK(mv[k].msg_len == (k == 3 ? 4u : 3u));
			CHECK(wait_in(b));
			ssize_t n = recv(b, buf, sizeof buf, 0);
			CHECK(n == (k == 3 ? 4 : 3));
			CHECK(memcmp(buf, pay[k], 3) == 0);
		}
		CHECK(sendmmsg(a, mv, 0, 0) == 0);
		CHECK(sendmmsg(a, mv, 1, MSG_OOB) == -1 && errno == EOPNOTSUPP);
	}

	/* recvmmsg: without MSG_WAITFORONE a blocking call waits for all of vlen, with it for the
	 * first only; each msg_len, msg_name and msg_flags set; a message gathered into two
	 * iovecs; every entry on one buffer (the last message wins); MSG_TRUNC; MSG_PEEK; EAGAIN;
	 * a zero timeout ends the call after one message (as Linux checks it after each) */
	{
		struct mmsghdr mv[8];
		struct iovec iv[8], two[2];
		struct sockaddr_in from[8];
		char rb[8][16], shared[16], h1[2], h2[16];
#define SETUP()                                                               \
	do {                                                                  \
		memset(mv, 0, sizeof mv);                                     \
		memset(rb, 0, sizeof rb);                                     \
		for (int k = 0; k < 8; k++) {                                 \
			iv[k] = (struct iovec){ rb[k], sizeof rb[k] };        \
			mv[k].msg_hdr.msg_iov = &iv[k];                       \
			mv[k].msg_hdr.msg_iovlen = 1;                         \
			mv[k].msg_hdr.msg_name = &from[k];                    \
			mv[k].msg_hdr.msg_namelen = sizeof from[k];           \
		}                                                             \
	} while (0)
		char pay[16];
		for (int k = 0; k < 6; k++) {
			snprintf(pay, sizeof pay, "rm%d", k);
			CHECK(send(a, pay, 3, 0) == 3);
		}
		SETUP();
		CHECK(recvmmsg(b, mv, 6, 0, NULL) == 6);
		for (int k = 0; k < 6; k++) {
			snprintf(pay, sizeof pay, "rm%d", k);
			CHECK(mv[k].msg_len == 3 && memcmp(rb[k], pay, 3) == 0);
			CHECK(mv[k].msg_hdr.msg_namelen == sizeof from[k]);
			CHECK(from[k].sin_port == aa.sin_port && from[k].sin_addr.s_addr == aa.sin_addr.s_addr);
			CHECK(mv[k].msg_hdr.msg_flags == 0);
		}
		CHECK(recvmmsg(b, mv, 4, MSG_DONTWAIT, NULL) == -1 && errno == EAGAIN);
		CHECK(recvmmsg(b, mv, 0, 0, NULL) == 0);

		/* MSG_WAITFORONE: whatever is queued, at least one, in order */
		for (int k = 0; k < 3; k++) {
			snprintf(pay, sizeof pay, "w%d", k);
			CHECK(send(a, pay, 2, 0) == 2);
		}
		int got = 0;
		while (got < 3) {
			SETUP();
			int n = recvmmsg(b, mv, 8, MSG_WAITFORONE, NULL);
			CHECK(n >= 1 && got + n <= 3);
			for (int k = 0; k < n; k++) {
				snprintf(pay, sizeof pay, "w%d", got + k);
				CHECK(mv[k].msg_len == 2 && memcmp(rb[k], pay, 2) == 0);
			}
			got += n;
		}

		/* two iovecs; a short buffer with MSG_TRUNC; three entries on one buffer */
		CHECK(send(a, "scattered", 9, 0) == 9);
		CHECK(send(a, "0123456789abcdef0123", 20, 0) == 20);
		CHECK(send(a, "one", 3, 0) == 3);
		CHECK(send(a, "two", 3, 0) == 3);
		CHECK(send(a, "six", 3, 0) == 3);
		SETUP();
		two[0] = (struct iovec){ h1, sizeof h1 };
		two[1] = (struct iovec){ h2, sizeof h2 };
		mv[0].msg_hdr.msg_iov = two;
		mv[0].msg_hdr.msg_iovlen = 2;
		iv[1].iov_len = 4;
		for (int k = 2; k < 5; k++)
			iv[k] = (struct iovec){ shared, sizeof shared };
		CHECK(recvmmsg(b, mv, 2, MSG_TRUNC, NULL) == 2);
		CHECK(mv[0].msg_len == 9 && memcmp(h1, "sc", 2) == 0 && memcmp(h2, "attered", 7) == 0);
		CHECK(mv[1].msg_len == 20 && (mv[1].msg_hdr.msg_flags & MSG_TRUNC) && memcmp(rb[1], "0123", 4) == 0);
		CHECK(recvmmsg(b, mv + 2, 3, 0, NULL) == 3);
		CHECK(mv[2].msg_len == 3 && mv[3].msg_len == 3 && mv[4].msg_len == 3);
		CHECK(memcmp(shared, "six", 3) == 0);

		/* MSG_PEEK leaves the message: every entry peeks the same one */
		CHECK(send(a, "peek", 4, 0) == 4);
		SETUP();
		CHECK(recvmmsg(b, mv, 2, MSG_PEEK, NULL) == 2);
		CHECK(mv[0].msg_len == 4 && mv[1].msg_len == 4 && memcmp(rb[1], "peek", 4) == 0);
		CHECK(recv(b, buf, sizeof buf, 0) == 4 && memcmp(buf, "peek", 4) == 0);

		/* a zero timeout: one message, and the timeout left is zero */
		for (int k = 0; k < 3; k++)
			CHECK(send(a, "tmo", 3, 0) == 3);
		SETUP();
		struct timespec zero = { 0, 0 }, bad = { 0, 1000000000 };
		CHECK(recvmmsg(b, mv, 3, MSG_DONTWAIT, &bad) == -1 && errno == EINVAL);
		CHECK(recvmmsg(b, mv, 3, 0, &zero) == 1 && zero.tv_sec == 0 && zero.tv_nsec == 0);
		got = 1;
		while (got < 3) {
			SETUP();
			int n = recvmmsg(b, mv, 3, MSG_WAITFORONE, NULL);
			CHECK(n >= 1);
			got += n;
		}
		CHECK(got == 3);
#undef SETUP
	}

	/* dup, close of the original, dup2 onto another number */
	int c = dup(b);
	CHECK(c >= 0);
	CHECK(close(b) == 0);
	CHECK(send(a, "dup", 3, 0) == 3);
	CHECK(wait_in(c));
	CHECK(recv(c, buf, sizeof buf, 0) == 3);
	int d = dup2(c, 100);
	CHECK(d == 100);
	CHECK(close(c) == 0);
	CHECK(recv(c, buf, sizeof buf, MSG_DONTWAIT) == -1 && errno == EBADF);
	struct sockaddr_in da;
	socklen_t dl = sizeof da;
	CHECK(getsockname(d, (struct sockaddr *)&da, &dl) == 0 && da.sin_port == ba.sin_port);

	/* fcntl O_NONBLOCK on and off; SO_RCVTIMEO runs out with EAGAIN */
	CHECK(fcntl(d, F_SETFL, fcntl(d, F_GETFL) | O_NONBLOCK) == 0);
	CHECK(recv(d, buf, sizeof buf, 0) == -1 && errno == EAGAIN);
	CHECK(fcntl(d, F_SETFL, fcntl(d, F_GETFL) & ~O_NONBLOCK) == 0);
	struct timeval tv = { 0, 50000 };
	CHECK(setsockopt(d, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);
	CHECK(recv(d, buf, sizeof buf, 0) == -1 && errno == EAGAIN);
	tv.tv_usec = 0;
	CHECK(setsockopt(d, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) == 0);

	/* a receiver blocked in another thread */
	pthread_t t;
	CHECK(pthread_create(&t, NULL, blocked_recv, &d) == 0);
	usleep(100000);
	CHECK(send(a, "thread", 6, 0) == 6);
	void *ok;
	CHECK(pthread_join(t, &ok) == 0 && ok);

	/* closing the fd of a receiver blocked in another thread: close returns without waiting
	 * for that receive (the send below comes after it), the receive still gets its message
	 * (as on Linux the socket lives until the call returns), then its port is free */
	{
		int c = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(c >= 0);
		struct sockaddr_in ca = bound(c);
		CHECK(pthread_create(&t, NULL, blocked_recv_closed, &c) == 0);
		usleep(100000);
		CHECK(close(c) == 0);
		CHECK(sendto(a, "closed", 6, 0, (struct sockaddr *)&ca, sizeof ca) == 6);
		CHECK(pthread_join(t, &ok) == 0 && ok);
		int c2 = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(c2 >= 0 && bind(c2, (struct sockaddr *)&ca, sizeof ca) == 0);
		CHECK(close(c2) == 0);
	}

	/* epoll on a mixed set: an eventfd and the rdsd socket */
	int ep = epoll_create1(0), ev = eventfd(0, 0);
	struct epoll_event e = { .events = EPOLLIN, .data.fd = ev };
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, ev, &e) == 0);
	e.data.fd = d;
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, d, &e) == 0);
	uint64_t one = 1;
	CHECK(write(ev, &one, 8) == 8);
	CHECK(send(a, "epoll", 5, 0) == 5);
	int seen_ev = 0, seen_d = 0;
	/* The eventfd keeps epoll_wait returning at once and rdsd delivers asynchronously: loop
	 * on time, not on a count. */
	time_t deadline = time(NULL) + 10;
	while (!(seen_ev && seen_d) && time(NULL) < deadline) {
		struct epoll_event out[4];
		int n = epoll_wait(ep, out, 4, 100);
		for (int k = 0; k < n; k++) {
			seen_ev |= out[k].data.fd == ev;
			seen_d |= out[k].data.fd == d;
		}
	}
	CHECK(seen_ev && seen_d);
	CHECK(recv(d, buf, sizeof buf, 0) == 5);

	/* Right after a receive drained the socket, epoll reports no stale EPOLLIN for it (rdsd
	 * updates the readiness fd on its next pass): level-triggered, through epoll_wait,
	 * epoll_pwait and epoll_pwait2, and one-shot, which the library arms again when it
	 * drops the only event (else the next message would never be reported). */
	{
		struct epoll_event out[4];
		uint64_t v;
		struct timespec ms20 = { 0, 20000000 };
		CHECK(read(ev, &v, 8) == 8); /* the eventfd goes quiet */
		for (int k = 0; k < 30; k++) {
			CHECK(send(a, "again", 5, 0) == 5);
			CHECK(epoll_wait(ep, out, 4, 10000) == 1 && out[0].data.fd == d);
			CHECK(out[0].events & EPOLLIN);
			CHECK(recv(d, buf, sizeof buf, 0) == 5);
			int n = k % 3 == 0   ? epoll_wait(ep, out, 4, 20)
				: k % 3 == 1 ? epoll_pwait(ep, out, 4, 20, NULL)
					     : epoll_pwait2(ep, out, 4, &ms20, NULL);
			CHECK(n == 0);
		}
		e.events = EPOLLIN | EPOLLONESHOT;
		e.data.fd = d;
		for (int k = 0; k < 10; k++) {
			CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, d, &e) == 0);
			CHECK(send(a, "once", 4, 0) == 4);
			CHECK(epoll_wait(ep, out, 4, 10000) == 1 && out[0].data.fd == d);
			CHECK(recv(d, buf, sizeof buf, 0) == 4);
			CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, d, &e) == 0);
			CHECK(epoll_wait(ep, out, 4, 20) == 0);
			CHECK(send(a, "armed", 5, 0) == 5);
			CHECK(epoll_wait(ep, out, 4, 10000) == 1 && out[0].data.fd == d);
			CHECK(recv(d, buf, sizeof buf, 0) == 5);
		}
		CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, d, NULL) == 0);
		CHECK(close(ep) == 0 && close(ev) == 0);
	}

	/* epoll holding rdsd sockets only is answered from the rings (tests/tests/preload.rs
	 * counts the system calls): events carry the caller's data, a drained socket is not
	 * reported, maxevents 1 takes turns, a closed socket's registration is gone, and an
	 * epoll fd that a dup or a fork could have given a kernel fd behind the library's back
	 * goes to the kernel, which reports that fd too */
	{
		int s2 = socket(AF_RDS, SOCK_SEQPACKET, 0), d2 = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(s2 >= 0 && d2 >= 0);
		bound(s2);
		struct sockaddr_in d2a = bound(d2);
		int rp = epoll_create1(0);
		CHECK(rp >= 0);
		struct epoll_event r = { .events = EPOLLIN, .data.u64 = 0x1111 };
		CHECK(epoll_ctl(rp, EPOLL_CTL_ADD, d, &r) == 0);
		r.data.u64 = 0x2222;
		CHECK(epoll_ctl(rp, EPOLL_CTL_ADD, d2, &r) == 0);
		struct epoll_event out[4];
		CHECK(epoll_wait(rp, out, 4, 20) == 0);
		CHECK(sendto(s2, "one", 3, 0, (struct sockaddr *)&ba, sizeof ba) == 3);
		CHECK(sendto(s2, "two", 3, 0, (struct sockaddr *)&d2a, sizeof d2a) == 3);
		CHECK(wait_in(d) && wait_in(d2));
		CHECK(epoll_wait(rp, out, 4, 0) == 2);
		CHECK(out[0].events == EPOLLIN && out[1].events == EPOLLIN);
		CHECK(out[0].data.u64 + out[1].data.u64 == 0x3333);
		CHECK(epoll_wait(rp, out, 1, 0) == 1);
		uint64_t first = out[0].data.u64;
		CHECK(epoll_wait(rp, out, 1, 0) == 1 && out[0].data.u64 != first);
		CHECK(recv(d, buf, sizeof buf, 0) == 3 && recv(d2, buf, sizeof buf, 0) == 3);
		CHECK(epoll_wait(rp, out, 4, 20) == 0);

		/* the number of a closed registered socket, reused by a socket never registered */
		CHECK(close(d2) == 0);
		int d3 = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(d3 >= 0);
		struct sockaddr_in d3a = bound(d3);
		CHECK(sendto(s2, "new", 3, 0, (struct sockaddr *)&d3a, sizeof d3a) == 3);
		CHECK(wait_in(d3));
		CHECK(epoll_wait(rp, out, 4, 20) == 0);
		CHECK(recv(d3, buf, sizeof buf, 0) == 3 && close(d3) == 0);

		/* a kernel fd registered through a dup of the epoll fd, then through a forked
		 * child's copy of it, then registered and closed while a dup keeps its file open
		 * (the kernel keeps the registration): each is reported with the rdsd socket's
		 * message */
		for (int how = 0; how < 3; how++) {
			int ev2 = eventfd(1, 0);
			struct epoll_event k = { .events = EPOLLIN, .data.u64 = 0x5555 };
			int rp2 = -1;
			if (how == 0) {
				rp2 = dup(rp);
				CHECK(rp2 >= 0 && epoll_ctl(rp2, EPOLL_CTL_ADD, ev2, &k) == 0);
			} else {
				CHECK(close(rp) == 0);
				rp = epoll_create1(0);
				r.data.u64 = 0x1111;
				CHECK(rp >= 0 && epoll_ctl(rp, EPOLL_CTL_ADD, d, &r) == 0);
			}
			if (how == 2) {
				CHECK(epoll_ctl(rp, EPOLL_CTL_ADD, ev2, &k) == 0);
				int keep = dup(ev2);
				CHECK(keep >= 0 && close(ev2) == 0);
				ev2 = keep;
			} else if (how == 1) {
				pid_t pid = fork();
				if (pid == 0)
					_exit(epoll_ctl(rp, EPOLL_CTL_ADD, ev2, &k) == 0 ? 0 : 1);
				int st;
				CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
			}
			CHECK(sendto(s2, "kfd", 3, 0, (struct sockaddr *)&ba, sizeof ba) == 3);
			CHECK(wait_in(d));
			int seen_d = 0, seen_k = 0;
			time_t until = time(NULL) + 10;
			while (!(seen_d && seen_k) && time(NULL) < until) {
				int n = epoll_wait(rp, out, 4, 100);
				for (int j = 0; j < n; j++) {
					seen_d |= out[j].data.u64 == 0x1111;
					seen_k |= out[j].data.u64 == 0x5555;
				}
			}
			CHECK(seen_d && seen_k);
			CHECK(recv(d, buf, sizeof buf, 0) == 3);
			/* the dup of how 2 has another number: its registration goes with the file */
			CHECK(how == 2 || epoll_ctl(rp, EPOLL_CTL_DEL, ev2, NULL) == 0);
			CHECK(close(ev2) == 0);
			if (rp2 >= 0)
				CHECK(close(rp2) == 0);
		}
		CHECK(close(rp) == 0 && close(s2) == 0);
	}

	/* exec: the FD_CLOEXEC socket is gone in the new image, the other one stays */
	CHECK(!fd_in_exec_child(a));
	CHECK(fd_in_exec_child(d));

	/* close_range and closefrom close rdsd sockets as close does: the number is no socket
	 * any more (EBADF, not a send on the old socket) and the port is free again;
	 * CLOSE_RANGE_CLOEXEC only marks them */
	{
		int r = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(r >= 0);
		struct sockaddr_in ra = bound(r);
		CHECK(close_range(r, r, CLOSE_RANGE_CLOEXEC) == 0);
		CHECK(fcntl(r, F_GETFD) & FD_CLOEXEC);
		CHECK(sendto(r, "cr", 2, 0, (struct sockaddr *)&ba, sizeof ba) == 2);
		CHECK(wait_in(d));
		CHECK(recv(d, buf, sizeof buf, 0) == 2);
		CHECK(close_range(r, r, 0) == 0);
		CHECK(sendto(r, "cr", 2, 0, (struct sockaddr *)&ba, sizeof ba) == -1 && errno == EBADF);
		int again = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(again >= 0);
		CHECK(bind(again, (struct sockaddr *)&ra, sizeof ra) == 0);
		CHECK(dup2(again, 300) == 300);
		CHECK(close(again) == 0);
		closefrom(300);
		CHECK(sendto(300, "cf", 2, 0, (struct sockaddr *)&ba, sizeof ba) == -1 && errno == EBADF);
		int third = socket(AF_RDS, SOCK_SEQPACKET, 0);
		CHECK(third >= 0);
		CHECK(bind(third, (struct sockaddr *)&ra, sizeof ra) == 0);
		CHECK(close(third) == 0);
	}

	CHECK(shutdown(d, SHUT_RDWR) == -1 && errno == EOPNOTSUPP);
	CHECK(close(a) == 0 && close(d) == 0);
	(void)aa;
	printf("FDOPS OK\n");
	return 0;
}
