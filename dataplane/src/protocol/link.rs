//! The path I/O trait: what a network transport must provide under the shared protocol layer.
//!
//! A [`Link`] moves frames (`[48-byte RDS header][payload]`) over paths and reports
//! acknowledgements; it knows nothing of connections, sequence numbers, congestion maps or
//! sockets. Two kinds fit:
//!
//! * **Stream links** (kernel TCP, userspace TCP over DPDK): `read` returns any number of
//!   stream bytes, `write` may take part of a frame, and the acknowledged offset is TCP's
//!   (bytes written minus the unacknowledged send queue).
//! * **Message links** (RDMA RC): `read` returns exactly one whole frame per call, `write`
//!   takes a whole frame or nothing (no credit, no send slot: `WouldBlock`), and the
//!   acknowledged offset counts the frames the peer confirmed (with `h_ack`), in the same frame
//!   bytes. The payload type can be a handle into the app's registered memory, kept in place
//!   until the engine releases it after that acknowledgement (zero copy).

use crate::seam::MsgBytes;
use std::io;
use std::net::SocketAddrV4;

/// How a link carries frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// A byte stream: partial reads and writes.
    Stream,
    /// Whole frames only, one per read and per write.
    Message,
}

/// Progress of an outgoing connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectPoll {
    /// Not established yet.
    Pending,
    /// Established.
    Up,
    /// Failed.
    Failed,
}

/// Result of [`Link::read`].
#[derive(Debug)]
pub enum Read<'a> {
    /// Bytes received (for a message link, one whole frame).
    Data(&'a [u8]),
    /// Nothing now.
    WouldBlock,
    /// The path is gone (EOF, reset, error).
    Closed,
}

/// Result of [`Link::write`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// This many bytes were taken (a message link takes all or returns `WouldBlock`).
    Wrote(usize),
    /// No room now.
    WouldBlock,
    /// The path is gone.
    Closed,
}

/// An inbound connection.
#[derive(Debug)]
pub struct Accepted<P> {
    /// Its I/O handle.
    pub path: P,
    /// Our address it arrived on (the RDS address it serves).
    pub laddr: u32,
    /// The peer's address.
    pub faddr: u32,
    /// The peer's source port (for SPORT_IDX path mapping).
    pub peer_port: u16,
}

/// Path I/O for one network transport. Every call is non-blocking.
pub trait Link: Send {
    /// One path's I/O handle (a TCP connection, a QP).
    type Path: Send;
    /// How queued payloads are held until the peer acknowledges them.
    type Payload: AsRef<[u8]> + Send + std::fmt::Debug;
    /// Stream or message framing.
    const FRAMING: Framing;
    /// True when `connect` binds source ports with `port % 8 == path`: the endpoint then
    /// announces SPORT_IDX, and a passive peer maps each connection to its path by source port
    /// instead of by accept order (which mismaps paths when a restarted peer's connections
    /// arrive while the passive side still holds some of the dead incarnation's paths).
    const SPORT_IDX: bool = false;
    /// True when the device reads a frame's bytes after [`Link::write`] returned (RDMA: a
    /// posted SEND, from the app's ring when in place, until it completes). A cancelled message
    /// that was written is then released only once [`Link::read_done`] passes its end
    /// (`rds_proto::Config::hold_cancelled_written`), so the app cannot overwrite bytes the
    /// device is still sending. TCP copies at `write`: false.
    const READS_AFTER_WRITE: bool = false;
    /// True when `read` receives into the buffer it is given (kernel TCP's `recv`), not into
    /// the link's own (userspace TCP reads in place): the endpoint then receives the rest of a
    /// long payload straight into the engine's reassembly buffer, not through its own.
    const READS_INTO_BUFFER: bool = false;

    /// Takes the payload of a message being queued (a copy into a pool, or a handle).
    fn payload(&mut self, bytes: MsgBytes<'_>) -> Self::Payload;
    /// True if the link can send payloads in place from app regions (see
    /// [`Link::payload_in_place`]).
    fn zero_copy(&self) -> bool {
        false
    }
    /// The smallest payload worth sending in place (below it a copy costs less than pinning
    /// the ring space until the peer acknowledges it); only with [`Link::zero_copy`].
    fn zero_copy_min(&self) -> usize {
        0
    }
    /// Zero copy: a handle to the payload where it lies, in app region `region`, whose bytes
    /// stay put until the engine releases the message. `None`: the link copies instead.
    fn payload_in_place(&mut self, _bytes: MsgBytes<'_>, _region: u64) -> Option<Self::Payload> {
        None
    }
    /// An app region was mapped (see `Transport::region_attached`).
    fn region_attached(&mut self, _id: u64, _base: *const u8, _len: usize) {}
    /// An app region is going (see `Transport::region_detached`).
    fn region_detached(&mut self, _id: u64) {}
    /// An inbound connection, if one is waiting.
    fn accept(&mut self) -> Option<Accepted<Self::Path>>;
    /// Starts a connection for `path` from `laddr` to the peer.
    fn connect(&mut self, laddr: u32, faddr: u32, path: usize) -> io::Result<Self::Path>;
    /// Progress of a connection started with `connect`.
    fn poll_connect(&mut self, p: &mut Self::Path) -> ConnectPoll;
    /// Passive side: pokes the peer so that it connects to us (spec §6.2).
    fn doorbell(&mut self, laddr: u32, faddr: u32);
    /// Receives into `buf` (or returns the link's own buffer).
    fn read<'a>(&'a mut self, p: &mut Self::Path, buf: &'a mut [u8]) -> Read<'a>;
    /// Sends bytes of the stream, gathered: the slices of one or more frames in order (for a
    /// message link, exactly one whole frame: its header slice, then its payload slice if it
    /// has one). A stream link may take any prefix.
    fn write(&mut self, p: &mut Self::Path, slices: &[&[u8]]) -> Write;
    /// Bytes of this path's connection the peer has acknowledged, out of `written`. Called
    /// every pass while messages are unacknowledged, unless [`Link::ack_query_is_syscall`]:
    /// then after input on the path, and otherwise with backoff.
    fn acked(&mut self, p: &Self::Path, written: u64) -> Option<u64>;
    /// False when [`Link::acked`] would answer for `p` what it answered last (nothing reached
    /// the path's connection since): the endpoint then does not ask. Memory reads only; links
    /// that cannot tell keep the default.
    fn acks_may_have_moved(&self, _p: &Self::Path) -> bool {
        true
    }
    /// The peer asked for a prompt acknowledgement of what was just read (`RDS_FLAG_ACK_REQUIRED`:
    /// its send buffer is half used): a link that delays its ACKs sends this one now. Kernel
    /// TCP keeps the default (the kernel decides its ACKs).
    fn ack_now(&mut self, _p: &mut Self::Path) {}
    /// With [`Link::READS_AFTER_WRITE`]: the offset of `p`'s stream up to which the device has
    /// finished reading what was written (RDMA: the sends that completed).
    fn read_done(&self, _p: &Self::Path) -> Option<u64> {
        None
    }
    /// The last word on acknowledgement before the path is reported down.
    fn final_acked(&mut self, p: &Self::Path, written: u64) -> Option<u64> {
        self.acked(p, written)
    }
    /// Closes a path (`reset`: abortively, for refused connections).
    fn close(&mut self, p: Self::Path, reset: bool);
    /// The (local, peer) addresses of a path's transport connection, for introspection
    /// (`rdsctl info -p`, `RDS_INFO_TCP_SOCKETS`); `None` where there is none (RDMA).
    fn endpoints(&self, _p: &Self::Path) -> Option<(SocketAddrV4, SocketAddrV4)> {
        None
    }
    /// A path's RDMA queue pair, for introspection (`RDS_INFO_IB_CONNECTIONS`); `None` on
    /// other links.
    fn rdma_info(&self, _p: &Self::Path) -> Option<crate::seam::RdmaPathInfo> {
        None
    }
    /// Start of a pass: learn which paths may have input, once for all of them (kernel TCP:
    /// one `epoll_wait`). Links without a readiness source keep the default: every path is
    /// read every pass.
    fn begin_pass(&mut self) {}
    /// True when `p` may have input (or connect progress) this pass. While it is true the
    /// endpoint keeps reading the path (a link clears it when a read finds the socket
    /// drained); a path that is not ready is not read, though the endpoint still writes on it
    /// whatever the engine has to send.
    fn path_ready(&self, _p: &Self::Path) -> bool {
        true
    }
    /// A count that changes whenever a path `path_ready` answered false for may have become
    /// ready, so that the endpoint need not ask again meanwhile; `None` (the default): the
    /// link keeps none, and every path is asked every pass. Memory reads only.
    fn ready_epoch(&self) -> Option<u64> {
        None
    }
    /// End of a pass (`wrote`: the pass wrote on some path): send what the pass queued on the
    /// link, if it batches, so that it leaves in the pass that took it.
    fn end_pass(&mut self, _wrote: bool) {}
    /// True when a pass of an endpoint with no connections has nothing to do on this link:
    /// nothing to accept, no paths, no housekeeping. Memory reads only; the endpoint then
    /// skips the pass. Links that must be polled anyway (smoltcp's timers) keep the default.
    fn is_quiet(&self) -> bool {
        false
    }
    /// Link-level housekeeping once per pass (e.g. reaping doorbell connections).
    fn poll_aux(&mut self) -> usize {
        0
    }
    /// True when acknowledgements arrive without waking `park_fds` (kernel TCP's send queue
    /// shrinks silently): the poll core then parks for at most 1 ms while messages are
    /// unacknowledged.
    fn acks_need_polling(&self) -> bool {
        false
    }
    /// True when [`Link::acked`] costs a syscall (kernel TCP's `SIOCOUTQ`): the endpoint then
    /// asks after input on the path, every pass while acknowledgements keep coming, and
    /// otherwise with backoff (`ACK_POLL_MIN`..`ACK_POLL_MAX` in the endpoint).
    fn ack_query_is_syscall(&self) -> bool {
        false
    }
    /// Descriptors of the link itself (listener) that must wake a parked poll core.
    fn park_fds(&self, _out: &mut Vec<libc::pollfd>) {}
    /// A path's descriptor for a parked poll core (readable; writable while `connecting`).
    fn park_fd(&self, _p: &Self::Path, _connecting: bool, _out: &mut Vec<libc::pollfd>) {}
}
