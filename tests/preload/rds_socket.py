"""CPython's socket module on AF_RDS, run unmodified under rdsd-run (tests/tests/preload.rs).

Sends, receives, peeks, polls (select, poll, epoll, mixed with kernel fds), non-blocking
mode, options, RDS_INFO_COUNTERS with its ENOSPC-and-length protocol, and fork. Prints PYOK.
"""
import ctypes
import errno
import os
import select
import socket
import struct
import time

RDS_INFO_COUNTERS = 10000
COUNTER = struct.Struct("=32sQ")


def rds():
    return socket.socket(socket.AF_RDS, socket.SOCK_SEQPACKET, 0)


def expect_errno(code, fn, *args):
    try:
        fn(*args)
    except OSError as e:
        assert e.errno == code, f"{fn.__name__}: errno {e.errno}, expected {code}"
        return
    raise AssertionError(f"{fn.__name__} succeeded, expected errno {code}")


a, b = rds(), rds()
expect_errno(errno.EINVAL, a.bind, ("0.0.0.0", 7000))
a.bind(("127.0.0.1", 0))
b.bind(("127.0.0.1", 0))
a_addr, b_addr = a.getsockname(), b.getsockname()
assert a_addr[0] == "127.0.0.1" and a_addr[1] != 0, a_addr
expect_errno(errno.EADDRINUSE, rds().bind, a_addr)

# send / receive, with the sender's address
assert a.sendto(b"hello", b_addr) == 5
r, _, _ = select.select([b], [], [], 10)
assert r == [b], "select: b readable"
data, frm = b.recvfrom(100)
assert (data, frm) == (b"hello", a_addr), (data, frm)

# MSG_PEEK leaves it queued; MSG_TRUNC reports the full length
a.sendto(b"x" * 100, b_addr)
assert select.select([b], [], [], 10)[0] == [b]
assert b.recv(10, socket.MSG_PEEK) == b"x" * 10
data, _, flags, _ = b.recvmsg(10)
assert data == b"x" * 10 and flags & socket.MSG_TRUNC, (data, flags)

# non-blocking: EAGAIN on an empty socket; select says not readable
b.setblocking(False)
expect_errno(errno.EAGAIN, b.recv, 100)
assert select.select([b], [], [], 0)[0] == []
b.setblocking(True)

# poll on a mixed set: a pipe that stays quiet, a UDP socket that gets a datagram, b
rp, wp = os.pipe()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
p = select.poll()
for f in (rp, udp, b):
    p.register(f, select.POLLIN)
assert p.poll(0) == []
a.sendto(b"poll", b_addr)
udp.sendto(b"u", udp.getsockname())
# (rdsd delivers asynchronously, and the UDP socket keeps poll returning at once: loop on time)
ready = set()
deadline = time.monotonic() + 10
while ready != {udp.fileno(), b.fileno()} and time.monotonic() < deadline:
    ready |= {fd for fd, ev in p.poll(100) if ev & select.POLLIN}
assert ready == {udp.fileno(), b.fileno()}, ready
assert b.recv(100) == b"poll" and udp.recv(10) == b"u"
assert p.poll(0) == [], "nothing left"

# epoll: POLLOUT (send-buffer room) and POLLIN
ep = select.epoll()
ep.register(a.fileno(), select.EPOLLOUT)
ep.register(b.fileno(), select.EPOLLIN)
assert (a.fileno(), select.EPOLLOUT) in ep.poll(1)
a.sendto(b"ep", b_addr)
got = []
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    got = [fd for fd, ev in ep.poll(0.1) if fd == b.fileno() and ev & select.EPOLLIN]
assert got, "epoll: b readable"
assert b.recv(10) == b"ep"

# options
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * 65536
a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
a.setsockopt(socket.SOL_RDS, 6, 1)  # RDS_CONG_MONITOR
expect_errno(errno.ENOPROTOOPT, a.setsockopt, socket.SOL_RDS, 2, b"\0" * 16)  # RDS_GET_MR
b.settimeout(0.2)  # CPython: non-blocking fd + poll(POLLIN, 200 ms) before each recv
try:
    b.recv(10)
    raise AssertionError("recv on an empty socket with a timeout returned")
except socket.timeout:
    pass
b.settimeout(None)
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
expect_errno(errno.EAGAIN, b.recv, 10)  # SO_RCVTIMEO runs out with EAGAIN, as on Linux
b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))

# RDS_INFO_COUNTERS: ENOSPC with the length needed, then the records
try:
    a.getsockopt(socket.SOL_RDS, RDS_INFO_COUNTERS, 40)
    raise AssertionError("RDS_INFO_COUNTERS fit in 40 bytes")
except OSError as e:
    assert e.errno == errno.ENOSPC, e
# Python caps getsockopt's buffer at 1024 bytes; libc's getsockopt (through ctypes, so
# still the preloaded one) takes the length protocol all the way.
libc = ctypes.CDLL(None, use_errno=True)
n = ctypes.c_uint32(0)
assert libc.getsockopt(a.fileno(), socket.SOL_RDS, RDS_INFO_COUNTERS, None, ctypes.byref(n)) == -1
assert ctypes.get_errno() == errno.ENOSPC and n.value > 0 and n.value % COUNTER.size == 0, n
buf = ctypes.create_string_buffer(n.value)
item = libc.getsockopt(a.fileno(), socket.SOL_RDS, RDS_INFO_COUNTERS, buf, ctypes.byref(n))
assert item == COUNTER.size, item
counters = {
    name.rstrip(b"\0").decode(): value
    for name, value in COUNTER.iter_unpack(buf.raw[: n.value])
}
assert counters["loop_delivered"] >= 4, counters
assert counters["sockets_opened"] >= 3, counters

# RDS_INFO_SOCKETS: struct rds_info_socket records; ours are among them
RDS_INFO_SOCKETS = 10006
SOCK_REC = struct.Struct("=I4s4sHHIQ")
n = ctypes.c_uint32(0)
assert libc.getsockopt(a.fileno(), socket.SOL_RDS, RDS_INFO_SOCKETS, None, ctypes.byref(n)) == -1
assert ctypes.get_errno() == errno.ENOSPC and n.value >= 2 * SOCK_REC.size, n
buf = ctypes.create_string_buffer(n.value)
item = libc.getsockopt(a.fileno(), socket.SOL_RDS, RDS_INFO_SOCKETS, buf, ctypes.byref(n))
assert item == SOCK_REC.size, item
bound = {
    (socket.inet_ntoa(addr), socket.ntohs(port)): (sndbuf, rcvbuf)
    for sndbuf, addr, _, port, _, rcvbuf, _ in SOCK_REC.iter_unpack(buf.raw[: n.value])
}
assert bound[a_addr] == (65536, 106496), bound  # SO_SNDBUF 65536 set above
assert b_addr in bound, bound

# fork: the child's inherited socket fails with EBADFD; a socket it opens itself works
pid = os.fork()
if pid == 0:
    code = 0
    try:
        try:
            a.sendto(b"inherited", b_addr)
            code = 3
        except OSError as e:
            code = 0 if e.errno == errno.EBADFD else 4
        c = rds()
        c.bind(("127.0.0.1", 0))
        c.sendto(b"from child", b_addr)
        c.close()
        a.close()
    except Exception as e:  # noqa: BLE001 - report anything as a failure
        print("child:", e, flush=True)
        code = 5
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
b.settimeout(10)
assert b.recv(100) == b"from child"
assert a.sendto(b"parent still", b_addr) == 12
assert b.recv(100) == b"parent still"

a.close()
b.close()
print("PYOK", flush=True)
