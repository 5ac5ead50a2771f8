//! The control protocol on rdsd's Unix `SOCK_SEQPACKET` socket (slow path only).
//!
//! One request datagram, one reply datagram. Requests are a fixed 32 bytes; replies are 24
//! bytes plus an optional body (hello info, counters). File descriptors travel as SCM_RIGHTS
//! (the regions, a socket's pollable fd, an `Info` document too long for a datagram).
//! Little-endian. Both sides treat everything they receive as untrusted: [`Request::decode`]
//! rejects unknown opcodes and datagrams of the wrong length.
//!
//! **Request ids.** Every request carries a `u64` id chosen by the client and every reply
//! echoes it, so a client can always tell its answer from a stale one. A reply with id 0 is not
//! an answer to any request: rdsd refuses or drops the connection (max_apps reached, per-uid
//! limit, Hello deadline) and says why in its errno.
//!
//! **Versions.** The protocol version is [`crate::layout::LAYOUT_VERSION`] (v2 added the ids).
//! The v1 wire format (24-byte requests, 16-byte reply headers, no ids) is still understood by
//! rdsd for exactly two requests, Hello and Stats, so that a v1 library is told clearly that
//! it is too old (EPROTONOSUPPORT, value = rdsd's version) and a v1 `rdsctl` still works; a v2
//! library that reaches a v1 rdsd sees a 16-byte reply to its Hello and reports the mismatch.

use std::net::Ipv4Addr;

/// Bytes in every request.
pub const REQUEST_LEN: usize = 32;
/// Bytes in a v1 request (no id); only Hello and Stats are still understood in this form.
pub const LEGACY_REQUEST_LEN: usize = 24;
/// Bytes in a reply before its body.
pub const REPLY_HEADER_LEN: usize = 24;
/// Bytes in a v1 reply before its body (no id).
pub const LEGACY_REPLY_HEADER_LEN: usize = 16;
/// Largest datagram either side sends.
pub const MAX_DATAGRAM: usize = 64 * 1024;

/// TEST ONLY. A `SetRcvBuf` with exactly this many bytes makes the poll core sleep for
/// N milliseconds before answering, when rdsd was built with its `fault-injection` feature and
/// started with `--fault stall-poll-ms=N` (never in production: a default build has no such
/// flag and the value is an ordinary buffer size). Used by `tests/tests/hostile.rs` to stall the poll core on demand.
#[doc(hidden)]
pub const TEST_STALL_RCVBUF: u32 = 0x05a1_1ed0;

/// What an app asks rdsd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// First message: the library's layout version, and the poll thread it asks to be
    /// served by (honoured under `placement = "socket"`; `None`: rdsd chooses). Reply
    /// carries the region fds.
    Hello { version: u32, shard: Option<u8> },
    /// Open a socket slot. Reply: slot index, and the socket's pollable fd.
    SocketOpen,
    /// Bind a slot to addr:port (port 0 = pick one). Reply: the bound port.
    Bind {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
    },
    /// Set the receive-buffer limit used for congestion marking.
    SetRcvBuf { slot: u32, bytes: u32 },
    /// Tell rdsd the send-buffer limit (for POLLOUT).
    SetSndBuf { slot: u32, bytes: u32 },
    /// Turn RDS_CONG_MONITOR on or off.
    SetCongMonitor { slot: u32, on: bool },
    /// Drop queued messages to addr:port (`None` = every destination).
    CancelSentTo {
        slot: u32,
        dest: Option<(Ipv4Addr, u16)>,
    },
    /// Start keeping the socket's pollable fd in sync with its rings.
    EnableReadiness { slot: u32 },
    /// Close a slot.
    Close { slot: u32 },
    /// Read the counters (text body, `name value` per line).
    Stats,
    /// Introspection (`rdsctl info`, `rdsctl ping`): a JSON document (UTF-8 body) with the
    /// daemon's identity and the sections asked for in `sections` (`INFO_*` bits; 0 = all).
    /// Served without Hello, like Stats. Sockets, groups, connections and paths are a snapshot
    /// taken by the poll core between two passes; the body's schema is `INFO_SCHEMA`. Lists that
    /// would not fit in one reply datagram are cut and their `truncated` count says how many
    /// entries are missing, unless the client asked for the document whole ([`INFO_WHOLE`]).
    Info { sections: u32 },
    /// Create the multicast group `addr:port` (224.0.0.0/4) with `GROUP_CREATE_*` flags; the
    /// socket does not join it.
    GroupCreate {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
        flags: u32,
    },
    /// Join group `addr:port` with `GROUP_*` flags, or change the flags of a membership
    /// (`update`).
    GroupJoin {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
        flags: u32,
        update: bool,
    },
    /// Leave group `addr:port`.
    GroupLeave {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
    },
    /// One step of replacing a membership's filter (see [`FilterStep`]).
    GroupFilter {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
        step: FilterStep,
    },
    /// The socket's default destination is group `addr:port` (POLLOUT follows the group's
    /// flow control), or is no group any more (`addr` unspecified).
    GroupConnect {
        slot: u32,
        addr: Ipv4Addr,
        port: u16,
    },
}

/// Membership flag: the member receives the messages its own socket sends to the group.
pub const GROUP_LOOPBACK: u32 = 1;
/// Membership flag: a member with a full receive buffer is skipped (and counted) instead of
/// holding the group back.
pub const GROUP_DROP_WHEN_FULL: u32 = 2;
/// Create flag: sockets of any uid may join (without it: the creator's uid and root only).
pub const GROUP_CREATE_OPEN: u32 = 1;
/// Rules one member filter holds at most (every send runs every member's filter).
pub const GROUP_FILTER_MAX_RULES: usize = 16;

/// How a member filter uses its rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterMode {
    /// No filter: every message.
    All = 0,
    /// Only messages from senders matching a rule.
    Only = 1,
    /// Every message except those from senders matching a rule.
    Except = 2,
}

/// Senders from `addr/prefix_len` bound to a port in `first..=last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterRule {
    /// Address of the prefix.
    pub addr: Ipv4Addr,
    /// Prefix length, 0..=32.
    pub prefix_len: u8,
    /// First port of the range.
    pub first_port: u16,
    /// Last port of the range (included).
    pub last_port: u16,
}

/// A filter travels as one request per rule (a request is 32 bytes): rule `index` of `count`
/// in `mode`. rdsd applies the filter when the last rule arrives, so no message ever meets a
/// half-replaced filter; `FilterMode::All` is a single step with no rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterStep {
    /// How the rules are used.
    pub mode: FilterMode,
    /// This rule's index, `0..count`.
    pub index: u8,
    /// Rules in the filter, `1..=GROUP_FILTER_MAX_RULES` (ignored for `All`).
    pub count: u8,
    /// The rule.
    pub rule: FilterRule,
}

impl FilterStep {
    /// The single step that removes a filter.
    pub fn all() -> FilterStep {
        FilterStep {
            mode: FilterMode::All,
            index: 0,
            count: 1,
            rule: FilterRule {
                addr: Ipv4Addr::UNSPECIFIED,
                prefix_len: 0,
                first_port: 0,
                last_port: 0,
            },
        }
    }

    /// (flag, value) of the request: flag = mode | index << 2 | (count - 1) << 6 |
    /// prefix_len << 10; value = addr | first << 32 | last << 48.
    fn encode(&self) -> (u16, u64) {
        let flag = self.mode as u16
            | u16::from(self.index & 0xf) << 2
            | u16::from(self.count.wrapping_sub(1) & 0xf) << 6
            | u16::from(self.rule.prefix_len & 0x3f) << 10;
        let value = u64::from(u32::from(self.rule.addr))
            | u64::from(self.rule.first_port) << 32
            | u64::from(self.rule.last_port) << 48;
        (flag, value)
    }

    fn decode(flag: u16, value: u64) -> Result<FilterStep, BadRequest> {
        let mode = match flag & 3 {
            0 => FilterMode::All,
            1 => FilterMode::Only,
            2 => FilterMode::Except,
            _ => return Err(BadRequest),
        };
        let (index, count) = (((flag >> 2) & 0xf) as u8, ((flag >> 6) & 0xf) as u8 + 1);
        if index >= count {
            return Err(BadRequest);
        }
        Ok(FilterStep {
            mode,
            index,
            count,
            rule: FilterRule {
                addr: Ipv4Addr::from(value as u32),
                prefix_len: (flag >> 10) as u8,
                first_port: (value >> 32) as u16,
                last_port: (value >> 48) as u16,
            },
        })
    }
}

/// `Info` section: counters.
pub const INFO_COUNTERS: u32 = 1 << 0;
/// `Info` section: sockets.
pub const INFO_SOCKETS: u32 = 1 << 1;
/// `Info` section: connections.
pub const INFO_CONNECTIONS: u32 = 1 << 2;
/// `Info` section: paths of each connection.
pub const INFO_PATHS: u32 = 1 << 3;
/// `Info` section: receive-queue summary.
pub const INFO_RECV_QUEUE: u32 = 1 << 4;
/// `Info` section: send-queue summary.
pub const INFO_SEND_QUEUE: u32 = 1 << 5;
/// `Info` section: retransmit-queue summary.
pub const INFO_RETRANS_QUEUE: u32 = 1 << 6;
/// `Info` section: multicast groups, their members and counters.
pub const INFO_GROUPS: u32 = 1 << 7;
/// `Info` section: every message on the send, retransmit and receive queues (the records
/// of `RDS_INFO_{SEND,RETRANS,RECV}_MESSAGES`). Not in [`INFO_ALL`]: a listing, not a summary.
pub const INFO_MESSAGES: u32 = 1 << 8;
/// `Info` section: the poll threads, each with its CPU, the apps, sockets, connections and
/// groups it serves and its own counters (`rdsctl threads`). An older rdsd ignores the bit.
pub const INFO_THREADS: u32 = 1 << 10;
/// Every summary `Info` section.
pub const INFO_ALL: u32 = 0xff | INFO_THREADS;
/// Not a section: the client takes a document longer than one datagram whole, in a sealed
/// memory file attached to the reply (SCM_RIGHTS; the reply's value is its length in bytes,
/// its body empty), up to [`MAX_INFO_DOCUMENT`]. Without it (or from an older rdsd, which
/// ignores the bit) long lists are cut to fit one datagram. Alone it means every summary
/// section, as 0 does.
pub const INFO_WHOLE: u32 = 1 << 9;
/// Longest `Info` document rdsd sends whole; lists past it are cut, as in a datagram.
pub const MAX_INFO_DOCUMENT: usize = 64 << 20;
/// Version of the `Info` JSON body (its `schema` field). Fields are only ever added (a new
/// section, `groups`, too: an older rdsd ignores the bit and its reply has no such key).
pub const INFO_SCHEMA: u32 = 1;

const OP_HELLO: u32 = 1;
const OP_SOCKET_OPEN: u32 = 2;
const OP_BIND: u32 = 3;
const OP_SET_RCVBUF: u32 = 4;
const OP_SET_SNDBUF: u32 = 5;
const OP_SET_CONG_MONITOR: u32 = 6;
const OP_CANCEL_SENT_TO: u32 = 7;
const OP_ENABLE_READINESS: u32 = 8;
const OP_CLOSE: u32 = 9;
const OP_STATS: u32 = 10;
const OP_INFO: u32 = 11;
const OP_GROUP_CREATE: u32 = 12;
const OP_GROUP_JOIN: u32 = 13;
const OP_GROUP_LEAVE: u32 = 14;
const OP_GROUP_FILTER: u32 = 15;
const OP_GROUP_CONNECT: u32 = 16;

/// A request that could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadRequest;

impl Request {
    /// Encodes into the fixed request layout: op, slot, addr, port, flag, value, id.
    pub fn encode(&self, id: u64) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..LEGACY_REQUEST_LEN].copy_from_slice(&self.encode_v1());
        b[24..32].copy_from_slice(&id.to_le_bytes());
        b
    }

    /// The v1 (24-byte, no id) form, for compatibility tests.
    pub fn encode_v1(&self) -> [u8; LEGACY_REQUEST_LEN] {
        let (op, slot, addr, port, flag, value): (u32, u32, u32, u16, u16, u64) = match *self {
            // flag: the asked-for poll thread + 1 (0, as older libraries send: none).
            Request::Hello { version, shard } => (
                OP_HELLO,
                0,
                0,
                0,
                shard.map_or(0, |k| u16::from(k) + 1),
                version as u64,
            ),
            Request::SocketOpen => (OP_SOCKET_OPEN, 0, 0, 0, 0, 0),
            Request::Bind { slot, addr, port } => (OP_BIND, slot, addr.into(), port, 0, 0),
            Request::SetRcvBuf { slot, bytes } => (OP_SET_RCVBUF, slot, 0, 0, 0, bytes as u64),
            Request::SetSndBuf { slot, bytes } => (OP_SET_SNDBUF, slot, 0, 0, 0, bytes as u64),
            Request::SetCongMonitor { slot, on } => (OP_SET_CONG_MONITOR, slot, 0, 0, 0, on as u64),
            Request::CancelSentTo { slot, dest } => match dest {
                Some((a, p)) => (OP_CANCEL_SENT_TO, slot, a.into(), p, 1, 0),
                None => (OP_CANCEL_SENT_TO, slot, 0, 0, 0, 0),
            },
            Request::EnableReadiness { slot } => (OP_ENABLE_READINESS, slot, 0, 0, 0, 0),
            Request::Close { slot } => (OP_CLOSE, slot, 0, 0, 0, 0),
            Request::Stats => (OP_STATS, 0, 0, 0, 0, 0),
            Request::Info { sections } => (OP_INFO, 0, 0, 0, 0, sections as u64),
            Request::GroupCreate {
                slot,
                addr,
                port,
                flags,
            } => (OP_GROUP_CREATE, slot, addr.into(), port, 0, flags as u64),
            Request::GroupJoin {
                slot,
                addr,
                port,
                flags,
                update,
            } => (
                OP_GROUP_JOIN,
                slot,
                addr.into(),
                port,
                update as u16,
                flags as u64,
            ),
            Request::GroupLeave { slot, addr, port } => {
                (OP_GROUP_LEAVE, slot, addr.into(), port, 0, 0)
            }
            Request::GroupFilter {
                slot,
                addr,
                port,
                step,
            } => {
                let (flag, value) = step.encode();
                (OP_GROUP_FILTER, slot, addr.into(), port, flag, value)
            }
            Request::GroupConnect { slot, addr, port } => {
                (OP_GROUP_CONNECT, slot, addr.into(), port, 0, 0)
            }
        };
        let mut b = [0u8; LEGACY_REQUEST_LEN];
        b[0..4].copy_from_slice(&op.to_le_bytes());
        b[4..8].copy_from_slice(&slot.to_le_bytes());
        b[8..12].copy_from_slice(&addr.to_le_bytes());
        b[12..14].copy_from_slice(&port.to_le_bytes());
        b[14..16].copy_from_slice(&flag.to_le_bytes());
        b[16..24].copy_from_slice(&value.to_le_bytes());
        b
    }

    /// Decodes a request datagram: (id, request).
    pub fn decode(b: &[u8]) -> Result<(u64, Request), BadRequest> {
        if b.len() != REQUEST_LEN {
            return Err(BadRequest);
        }
        Ok((
            frame_id(b),
            Request::decode_fields(&b[..LEGACY_REQUEST_LEN])?,
        ))
    }

    /// Decodes a v1 (24-byte) datagram, accepting only Hello and Stats (see the module docs).
    pub fn decode_legacy(b: &[u8]) -> Result<Request, BadRequest> {
        if b.len() != LEGACY_REQUEST_LEN {
            return Err(BadRequest);
        }
        match Request::decode_fields(b)? {
            r @ (Request::Hello { .. } | Request::Stats) => Ok(r),
            _ => Err(BadRequest),
        }
    }

    fn decode_fields(b: &[u8]) -> Result<Request, BadRequest> {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let op = u32_at(0);
        let slot = u32_at(4);
        let addr = Ipv4Addr::from(u32_at(8));
        let port = u16::from_le_bytes([b[12], b[13]]);
        let flag = u16::from_le_bytes([b[14], b[15]]);
        let value = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let bytes = || u32::try_from(value).map_err(|_| BadRequest);
        Ok(match op {
            OP_HELLO => Request::Hello {
                version: bytes()?,
                shard: match flag {
                    0 => None,
                    f => Some(u8::try_from(f - 1).map_err(|_| BadRequest)?),
                },
            },
            OP_SOCKET_OPEN => Request::SocketOpen,
            OP_BIND => Request::Bind { slot, addr, port },
            OP_SET_RCVBUF => Request::SetRcvBuf {
                slot,
                bytes: bytes()?,
            },
            OP_SET_SNDBUF => Request::SetSndBuf {
                slot,
                bytes: bytes()?,
            },
            OP_SET_CONG_MONITOR => Request::SetCongMonitor {
                slot,
                on: value != 0,
            },
            OP_CANCEL_SENT_TO => Request::CancelSentTo {
                slot,
                dest: if flag != 0 { Some((addr, port)) } else { None },
            },
            OP_ENABLE_READINESS => Request::EnableReadiness { slot },
            OP_CLOSE => Request::Close { slot },
            OP_STATS => Request::Stats,
            OP_INFO => Request::Info { sections: bytes()? },
            OP_GROUP_CREATE => Request::GroupCreate {
                slot,
                addr,
                port,
                flags: bytes()?,
            },
            OP_GROUP_JOIN => Request::GroupJoin {
                slot,
                addr,
                port,
                flags: bytes()?,
                update: flag != 0,
            },
            OP_GROUP_LEAVE => Request::GroupLeave { slot, addr, port },
            OP_GROUP_FILTER => Request::GroupFilter {
                slot,
                addr,
                port,
                step: FilterStep::decode(flag, value)?,
            },
            OP_GROUP_CONNECT => Request::GroupConnect { slot, addr, port },
            _ => return Err(BadRequest),
        })
    }
}

/// The id of a request frame (0 if the frame is too short to hold one), to echo in the reply
/// even to a request that could not be decoded.
pub fn frame_id(b: &[u8]) -> u64 {
    match b.get(24..32) {
        Some(id) => u64::from_le_bytes(id.try_into().expect("8 bytes")),
        None => 0,
    }
}

/// rdsd's answer: an errno (0 = success), a value, the request's id, and an optional body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// 0, or the errno the operation fails with.
    pub errno: i32,
    /// Operation-specific result (for a refusal by a limit: the limit).
    pub value: u64,
    /// The id of the request this answers; 0 = a refusal of the connection itself.
    pub id: u64,
    /// Operation-specific body.
    pub body: Vec<u8>,
}

impl Reply {
    /// A success carrying `value`.
    pub fn ok(value: u64) -> Reply {
        Reply {
            errno: 0,
            value,
            id: 0,
            body: Vec::new(),
        }
    }

    /// A failure with `errno`.
    pub fn err(errno: i32) -> Reply {
        Reply {
            errno,
            value: 0,
            id: 0,
            body: Vec::new(),
        }
    }

    /// The same reply, answering request `id`.
    pub fn with_id(mut self, id: u64) -> Reply {
        self.id = id;
        self
    }

    /// Wire form: errno, reserved, value, id, body.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(REPLY_HEADER_LEN + self.body.len());
        v.extend_from_slice(&self.errno.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&self.value.to_le_bytes());
        v.extend_from_slice(&self.id.to_le_bytes());
        v.extend_from_slice(&self.body);
        v
    }

    /// The v1 wire form (no id), for answering a v1 client.
    pub fn encode_legacy(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(LEGACY_REPLY_HEADER_LEN + self.body.len());
        v.extend_from_slice(&self.errno.to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&self.value.to_le_bytes());
        v.extend_from_slice(&self.body);
        v
    }

    /// Parses a reply datagram.
    pub fn decode(b: &[u8]) -> Option<Reply> {
        if b.len() < REPLY_HEADER_LEN {
            return None;
        }
        Some(Reply {
            errno: i32::from_le_bytes(b[0..4].try_into().ok()?),
            value: u64::from_le_bytes(b[8..16].try_into().ok()?),
            id: u64::from_le_bytes(b[16..24].try_into().ok()?),
            body: b[REPLY_HEADER_LEN..].to_vec(),
        })
    }

    /// True if a reply of `len` bytes can only come from a v1 rdsd (too short for v2).
    pub fn is_legacy_len(len: usize) -> bool {
        (LEGACY_REPLY_HEADER_LEN..REPLY_HEADER_LEN).contains(&len)
    }
}

/// Body of a successful Hello reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloInfo {
    /// Bytes of the app region (fd 0).
    pub region_len: u64,
    /// Bytes of the daemon region (fd 1).
    pub daemon_region_len: u64,
    /// 1 if the app region is on hugetlbfs pages.
    pub hugetlb: u32,
    /// rdsd's poll threads (1 from an rdsd that does not say).
    pub poll_threads: u32,
    /// How rdsd places sockets on them: [`PLACEMENT_APP`] or [`PLACEMENT_SOCKET`]
    /// ([`PLACEMENT_APP`] from an rdsd that does not say).
    pub placement: u32,
}

/// `HelloInfo::placement`: each attachment on one poll thread, chosen by rdsd.
pub const PLACEMENT_APP: u32 = 0;
/// `HelloInfo::placement`: a process spreads its sockets over the poll threads, one
/// attachment per thread, each asked for in its Hello.
pub const PLACEMENT_SOCKET: u32 = 1;

impl HelloInfo {
    /// Wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(28);
        v.extend_from_slice(&self.region_len.to_le_bytes());
        v.extend_from_slice(&self.daemon_region_len.to_le_bytes());
        v.extend_from_slice(&self.hugetlb.to_le_bytes());
        v.extend_from_slice(&self.poll_threads.to_le_bytes());
        v.extend_from_slice(&self.placement.to_le_bytes());
        v
    }

    /// Parses the body; the fields an older rdsd does not send (20 bytes) get their
    /// defaults.
    pub fn decode(b: &[u8]) -> Option<HelloInfo> {
        if b.len() < 20 {
            return None;
        }
        let u32_at = |o: usize| {
            b.get(o..o + 4)
                .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
        };
        Some(HelloInfo {
            region_len: u64::from_le_bytes(b[0..8].try_into().ok()?),
            daemon_region_len: u64::from_le_bytes(b[8..16].try_into().ok()?),
            hugetlb: u32_at(16)?,
            poll_threads: u32_at(20).unwrap_or(1).max(1),
            placement: u32_at(24).unwrap_or(PLACEMENT_APP),
        })
    }
}

/// The counters in the Prometheus text exposition format (version 0.0.4), as rdsd serves them
/// on `metrics_listen` and `rdsctl stats --prometheus` prints them: every counter `name` of a
/// Stats/Info reply becomes `rdsd_<name>_total` with its description as HELP, followed by the
/// gauges `rdsd_up` and, when `info` is given, `rdsd_build_info{version=..}` and
/// `rdsd_start_time_seconds`.
pub fn prometheus_text(counters: &[(&str, u64, &str)], info: Option<(&str, f64)>) -> String {
    use std::fmt::Write;
    fn help_escape(s: &str) -> String {
        s.replace('\\', "\\\\").replace('\n', "\\n")
    }
    fn label_escape(s: &str) -> String {
        help_escape(s).replace('"', "\\\"")
    }
    fn metric_name(s: &str) -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
    let mut out = String::with_capacity(counters.len() * 128);
    for (name, value, help) in counters {
        let m = format!("rdsd_{}_total", metric_name(name));
        let _ = writeln!(out, "# HELP {m} {}", help_escape(help));
        let _ = writeln!(out, "# TYPE {m} counter");
        let _ = writeln!(out, "{m} {value}");
    }
    out.push_str("# HELP rdsd_up 1 while rdsd serves.\n# TYPE rdsd_up gauge\nrdsd_up 1\n");
    if let Some((version, start)) = info {
        let _ = writeln!(out, "# HELP rdsd_build_info rdsd's version (always 1).");
        let _ = writeln!(out, "# TYPE rdsd_build_info gauge");
        let _ = writeln!(
            out,
            "rdsd_build_info{{version=\"{}\"}} 1",
            label_escape(version)
        );
        let _ = writeln!(
            out,
            "# HELP rdsd_start_time_seconds When rdsd started, seconds since the Unix epoch."
        );
        let _ = writeln!(out, "# TYPE rdsd_start_time_seconds gauge");
        let _ = writeln!(out, "rdsd_start_time_seconds {start:.3}");
    }
    out
}

/// The counters exposed per poll thread as well (`rdsd_thread_<name>_total{thread="k"}`):
/// enough to see which thread is loaded and with what, without a series per counter and
/// thread.
pub const THREAD_METRICS: [(&str, &str); 12] = [
    ("poll_passes", "Passes of this poll thread."),
    (
        "poll_busy_passes",
        "Passes of this poll thread that found work.",
    ),
    ("poll_parks", "Times this poll thread parked."),
    (
        "loop_delivered",
        "Messages this poll thread delivered between sockets of this host.",
    ),
    (
        "shard_records_out",
        "Records this poll thread put into other poll threads' pair rings.",
    ),
    (
        "shard_records_in",
        "Records this poll thread took from other poll threads' pair rings.",
    ),
    (
        "tcp_tx_messages",
        "Messages this poll thread wrote on kernel TCP paths.",
    ),
    (
        "tcp_delivered",
        "Messages from kernel TCP paths this poll thread delivered.",
    ),
    (
        "dpdk_tx_messages",
        "Messages this poll thread wrote on userspace-TCP (DPDK) paths.",
    ),
    (
        "dpdk_delivered",
        "Messages from userspace-TCP (DPDK) paths this poll thread delivered.",
    ),
    (
        "rdma_tx_messages",
        "Messages this poll thread wrote on RDMA paths.",
    ),
    (
        "rdma_delivered",
        "Messages from RDMA paths this poll thread delivered.",
    ),
];

/// The per-thread series of [`THREAD_METRICS`] for `threads` poll threads, `value(k, name)`
/// giving thread `k`'s counter `name`; appended to [`prometheus_text`]'s output.
pub fn prometheus_thread_text(threads: usize, value: impl Fn(usize, &str) -> u64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (name, help) in THREAD_METRICS {
        let m = format!("rdsd_thread_{name}_total");
        let _ = writeln!(out, "# HELP {m} {help}");
        let _ = writeln!(out, "# TYPE {m} counter");
        for k in 0..threads {
            let _ = writeln!(out, "{m}{{thread=\"{k}\"}} {}", value(k, name));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_thread_text_shape() {
        let t =
            prometheus_thread_text(2, |k, n| if n == "poll_passes" { 10 + k as u64 } else { 0 });
        assert!(t.contains("# TYPE rdsd_thread_poll_passes_total counter\n"));
        assert!(t.contains("rdsd_thread_poll_passes_total{thread=\"0\"} 10\n"));
        assert!(t.contains("rdsd_thread_poll_passes_total{thread=\"1\"} 11\n"));
        assert!(t.contains("rdsd_thread_shard_records_in_total{thread=\"1\"} 0\n"));
        assert_eq!(t.lines().count(), THREAD_METRICS.len() * 4);
    }

    #[test]
    fn prometheus_text_shape() {
        let t = prometheus_text(
            &[
                ("apps_attached", 3, "Processes\\ that\nattached."),
                ("tcp_x", 0, "X."),
            ],
            Some(("0.1.0", 12.5)),
        );
        assert!(
            t.starts_with(
                "# HELP rdsd_apps_attached_total Processes\\\\ that\\nattached.\n\
             # TYPE rdsd_apps_attached_total counter\nrdsd_apps_attached_total 3\n"
            ),
            "{t}"
        );
        assert!(t.contains("\nrdsd_tcp_x_total 0\n"));
        assert!(t.contains("\nrdsd_build_info{version=\"0.1.0\"} 1\n"));
        assert!(t.contains("\nrdsd_start_time_seconds 12.500\n"));
        assert!(t.ends_with('\n'));
    }

    #[test]
    fn requests_roundtrip() {
        let a = Ipv4Addr::new(127, 0, 0, 7);
        for r in [
            Request::Hello {
                version: 1,
                shard: None,
            },
            Request::SocketOpen,
            Request::Bind {
                slot: 3,
                addr: a,
                port: 4000,
            },
            Request::SetRcvBuf {
                slot: 1,
                bytes: 5000,
            },
            Request::SetSndBuf {
                slot: 1,
                bytes: 6000,
            },
            Request::SetCongMonitor { slot: 2, on: true },
            Request::CancelSentTo {
                slot: 2,
                dest: Some((a, 9)),
            },
            Request::CancelSentTo {
                slot: 2,
                dest: None,
            },
            Request::EnableReadiness { slot: 5 },
            Request::Close { slot: 5 },
            Request::Stats,
            Request::Info { sections: 0 },
            Request::Info {
                sections: INFO_SOCKETS | INFO_PATHS,
            },
            Request::GroupCreate {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
                flags: GROUP_CREATE_OPEN,
            },
            Request::GroupJoin {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
                flags: GROUP_LOOPBACK | GROUP_DROP_WHEN_FULL,
                update: true,
            },
            Request::GroupLeave {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
            },
            Request::GroupFilter {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
                step: FilterStep {
                    mode: FilterMode::Except,
                    index: 15,
                    count: 16,
                    rule: FilterRule {
                        addr: a,
                        prefix_len: 32,
                        first_port: 7,
                        last_port: 65535,
                    },
                },
            },
            Request::GroupFilter {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
                step: FilterStep::all(),
            },
            Request::GroupConnect {
                slot: 1,
                addr: Ipv4Addr::new(239, 1, 2, 3),
                port: 5000,
            },
        ] {
            assert_eq!(Request::decode(&r.encode(77)), Ok((77, r)));
        }
    }

    #[test]
    fn v1_frames_are_understood_only_for_hello_and_stats() {
        let h = Request::Hello {
            version: 1,
            shard: None,
        };
        assert_eq!(Request::decode_legacy(&h.encode_v1()), Ok(h));
        assert_eq!(
            Request::decode_legacy(&Request::Stats.encode_v1()),
            Ok(Request::Stats)
        );
        assert_eq!(
            Request::decode_legacy(&Request::Close { slot: 1 }.encode_v1()),
            Err(BadRequest)
        );
        assert_eq!(
            Request::decode_legacy(&Request::Info { sections: 0 }.encode_v1()),
            Err(BadRequest)
        );
        // A v1 frame is not a v2 request.
        assert_eq!(Request::decode(&h.encode_v1()), Err(BadRequest));
        assert_eq!(frame_id(&h.encode_v1()), 0);
        assert_eq!(frame_id(&h.encode(9)), 9);
        // A v1 library reads errno and value of a v2 reply at the same offsets.
        let r = Reply::err(libc::EPROTONOSUPPORT).with_id(3);
        let b = r.encode();
        assert_eq!(i32::from_le_bytes(b[0..4].try_into().unwrap()), r.errno);
        assert!(Reply::is_legacy_len(Reply::err(1).encode_legacy().len()));
        assert!(!Reply::is_legacy_len(b.len()));
    }

    #[test]
    fn garbage_requests_are_rejected() {
        assert_eq!(Request::decode(&[0; 3]), Err(BadRequest));
        let mut b = Request::Stats.encode(1);
        b[0] = 200;
        assert_eq!(Request::decode(&b), Err(BadRequest));
        let mut b = Request::SetRcvBuf { slot: 0, bytes: 1 }.encode(1);
        b[20] = 1; // value above u32
        assert_eq!(Request::decode(&b), Err(BadRequest));
    }

    #[test]
    fn replies_roundtrip() {
        let r = Reply {
            errno: 98,
            value: 7,
            id: 1 << 40,
            body: b"x".to_vec(),
        };
        assert_eq!(Reply::decode(&r.encode()), Some(r));
        let h = HelloInfo {
            region_len: 1 << 26,
            daemon_region_len: 4096,
            hugetlb: 1,
            poll_threads: 4,
            placement: PLACEMENT_SOCKET,
        };
        assert_eq!(HelloInfo::decode(&h.encode()), Some(h));
        // An older rdsd's 20-byte body: one poll thread, placement by app.
        let old = HelloInfo::decode(&h.encode()[..20]).unwrap();
        assert_eq!((old.poll_threads, old.placement), (1, PLACEMENT_APP));
        assert_eq!(HelloInfo::decode(&h.encode()[..19]), None);
    }

    #[test]
    fn a_hello_may_ask_for_a_poll_thread() {
        for shard in [None, Some(0), Some(3), Some(30)] {
            let h = Request::Hello { version: 9, shard };
            assert_eq!(Request::decode(&h.encode(4)), Ok((4, h)));
        }
        // An older library's Hello (flag 0) asks for none.
        let mut b = Request::Hello {
            version: 9,
            shard: Some(2),
        }
        .encode(4);
        b[14..16].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(
            Request::decode(&b),
            Ok((
                4,
                Request::Hello {
                    version: 9,
                    shard: None
                }
            ))
        );
        b[14..16].copy_from_slice(&300u16.to_le_bytes());
        assert_eq!(Request::decode(&b), Err(BadRequest));
    }
}
