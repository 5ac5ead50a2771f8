//! The group protocol between rdsd hosts: RDS messages from port [`GROUP_PORT`] to port
//! [`GROUP_PORT`], so they ride the hosts' ordinary RDS connections (reliable, in order,
//! exactly once) next to the apps' messages. In smoltcp's style: [`GroupMsg::parse`] checks
//! untrusted bytes into a typed value, [`GroupMsg::emit`] writes one.
//!
//! A group is ordered by one host, its *owner* (rdsd's `group_owners` map says which for
//! addresses owned elsewhere). A host with members of a group owned elsewhere keeps a *mirror*
//! of it and talks to the owner:
//!
//! | kind | from → to | body |
//! |---|---|---|
//! | `Join` | member host → owner | (none): "this host has members" |
//! | `Leave` | member host → owner | (none): "no more members here" (also the answer to data for a group this host does not mirror) |
//! | `Joined` | owner → member host | errno: 0, or why the owner refused the join |
//! | `Send` | any host → owner | sender's address and port, payload: a local app sent to the group |
//! | `Data` | owner → member host | sequence, sender's address and port, payload: a numbered message |
//!
//! Layout (big-endian): magic `b"RG"`, version 1, kind, group address (4), group port (2), 2
//! reserved zero bytes; then the kind's fields; then the payload (`Send`, `Data`).

use super::GroupAddr;

/// The RDS port of rdsd's group protocol, on every host. Apps may not bind it.
pub const GROUP_PORT: u16 = 65534;

const MAGIC: [u8; 2] = *b"RG";
const VERSION: u8 = 1;
/// Bytes before a kind's fields.
const HEAD: usize = 12;

const KIND_JOIN: u8 = 1;
const KIND_LEAVE: u8 = 2;
const KIND_JOINED: u8 = 3;
const KIND_SEND: u8 = 4;
const KIND_DATA: u8 = 5;

/// The largest header [`GroupMsg::emit`] writes before a payload (a `Data`).
pub const MAX_HEADER: usize = HEAD + 16;

/// One group protocol message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupMsg<'a> {
    /// The sending host has members of `group`.
    Join { group: GroupAddr },
    /// The sending host has no more members of `group`.
    Leave { group: GroupAddr },
    /// The owner's answer to a `Join`: 0, or the errno of its refusal.
    Joined { group: GroupAddr, errno: u32 },
    /// An app of the sending host, bound to `from`, sent `payload` to `group`.
    Send {
        group: GroupAddr,
        from: (u32, u16),
        payload: &'a [u8],
    },
    /// Message `seq` of `group` in the owner's order, sent by `from`.
    Data {
        group: GroupAddr,
        seq: u64,
        from: (u32, u16),
        payload: &'a [u8],
    },
}

/// Why bytes are not a group protocol message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Shorter than its kind's header.
    Truncated,
    /// Not `b"RG"` and version 1.
    BadMagic,
    /// A kind this version does not know.
    BadKind,
    /// The group is not a multicast address with a port, or reserved bytes are not zero.
    Malformed,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl<'a> GroupMsg<'a> {
    /// The group the message is about.
    pub fn group(&self) -> GroupAddr {
        match *self {
            GroupMsg::Join { group }
            | GroupMsg::Leave { group }
            | GroupMsg::Joined { group, .. }
            | GroupMsg::Send { group, .. }
            | GroupMsg::Data { group, .. } => group,
        }
    }

    /// Checks `b` (untrusted: from the network) and reads it.
    pub fn parse(b: &'a [u8]) -> Result<GroupMsg<'a>, WireError> {
        if b.len() < HEAD {
            return Err(WireError::Truncated);
        }
        if b[0..2] != MAGIC || b[2] != VERSION {
            return Err(WireError::BadMagic);
        }
        if be16(b, 10) != 0 {
            return Err(WireError::Malformed);
        }
        let group = GroupAddr::new(be32(b, 4), be16(b, 8)).map_err(|_| WireError::Malformed)?;
        let need = |n: usize| {
            if b.len() < HEAD + n {
                Err(WireError::Truncated)
            } else {
                Ok(())
            }
        };
        let from_at = |at: usize| -> Result<(u32, u16), WireError> {
            if be16(b, at + 6) != 0 {
                return Err(WireError::Malformed);
            }
            Ok((be32(b, at), be16(b, at + 4)))
        };
        Ok(match b[3] {
            KIND_JOIN => GroupMsg::Join { group },
            KIND_LEAVE => GroupMsg::Leave { group },
            KIND_JOINED => {
                need(4)?;
                GroupMsg::Joined {
                    group,
                    errno: be32(b, HEAD),
                }
            }
            KIND_SEND => {
                need(8)?;
                GroupMsg::Send {
                    group,
                    from: from_at(HEAD)?,
                    payload: &b[HEAD + 8..],
                }
            }
            KIND_DATA => {
                need(16)?;
                let seq = u64::from_be_bytes(b[HEAD..HEAD + 8].try_into().expect("8 bytes"));
                GroupMsg::Data {
                    group,
                    seq,
                    from: from_at(HEAD + 8)?,
                    payload: &b[HEAD + 16..],
                }
            }
            _ => return Err(WireError::BadKind),
        })
    }

    /// Writes the message's header into `out` (cleared first) and returns the payload that
    /// follows it (empty for the kinds without one): a caller that queues messages appends
    /// the two, so the payload is copied once.
    pub fn emit_header(&self, out: &mut [u8; MAX_HEADER]) -> (usize, &'a [u8]) {
        out.fill(0);
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = VERSION;
        let g = self.group();
        out[4..8].copy_from_slice(&g.addr().to_be_bytes());
        out[8..10].copy_from_slice(&g.port().to_be_bytes());
        let put_from = |out: &mut [u8; MAX_HEADER], at: usize, (a, p): (u32, u16)| {
            out[at..at + 4].copy_from_slice(&a.to_be_bytes());
            out[at + 4..at + 6].copy_from_slice(&p.to_be_bytes());
        };
        match *self {
            GroupMsg::Join { .. } => {
                out[3] = KIND_JOIN;
                (HEAD, &[])
            }
            GroupMsg::Leave { .. } => {
                out[3] = KIND_LEAVE;
                (HEAD, &[])
            }
            GroupMsg::Joined { errno, .. } => {
                out[3] = KIND_JOINED;
                out[HEAD..HEAD + 4].copy_from_slice(&errno.to_be_bytes());
                (HEAD + 4, &[])
            }
            GroupMsg::Send { from, payload, .. } => {
                out[3] = KIND_SEND;
                put_from(out, HEAD, from);
                (HEAD + 8, payload)
            }
            GroupMsg::Data {
                seq, from, payload, ..
            } => {
                out[3] = KIND_DATA;
                out[HEAD..HEAD + 8].copy_from_slice(&seq.to_be_bytes());
                put_from(out, HEAD + 8, from);
                (HEAD + 16, payload)
            }
        }
    }

    /// The whole message as bytes (header and payload), for tests and tools.
    pub fn emit(&self) -> Vec<u8> {
        let mut h = [0u8; MAX_HEADER];
        let (n, payload) = self.emit_header(&mut h);
        let mut v = h[..n].to_vec();
        v.extend_from_slice(payload);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> GroupAddr {
        GroupAddr::new(u32::from(std::net::Ipv4Addr::new(239, 1, 2, 3)), 5000).unwrap()
    }

    #[test]
    fn every_kind_survives_emit_then_parse() {
        let payload = b"hello, group";
        for m in [
            GroupMsg::Join { group: g() },
            GroupMsg::Leave { group: g() },
            GroupMsg::Joined {
                group: g(),
                errno: libc::EACCES as u32,
            },
            GroupMsg::Send {
                group: g(),
                from: (0x0a00_0001, 7000),
                payload,
            },
            GroupMsg::Data {
                group: g(),
                seq: 0x0102_0304_0506_0708,
                from: (0x0a00_0002, 7001),
                payload,
            },
            GroupMsg::Data {
                group: g(),
                seq: 1,
                from: (1, 1),
                payload: &[],
            },
        ] {
            let b = m.emit();
            assert_eq!(GroupMsg::parse(&b), Ok(m));
        }
    }

    #[test]
    fn bad_bytes_are_refused_with_a_reason() {
        let ok = GroupMsg::Data {
            group: g(),
            seq: 9,
            from: (1, 2),
            payload: b"x",
        }
        .emit();
        assert_eq!(GroupMsg::parse(&ok[..5]), Err(WireError::Truncated));
        assert_eq!(GroupMsg::parse(&ok[..HEAD + 15]), Err(WireError::Truncated));
        let mut b = ok.clone();
        b[0] = b'X';
        assert_eq!(GroupMsg::parse(&b), Err(WireError::BadMagic));
        let mut b = ok.clone();
        b[2] = 2;
        assert_eq!(GroupMsg::parse(&b), Err(WireError::BadMagic));
        let mut b = ok.clone();
        b[3] = 99;
        assert_eq!(GroupMsg::parse(&b), Err(WireError::BadKind));
        let mut b = ok.clone();
        b[4] = 10; // 10.x.x.x: not a group
        assert_eq!(GroupMsg::parse(&b), Err(WireError::Malformed));
        let mut b = ok.clone();
        b[8..10].copy_from_slice(&[0, 0]); // port 0
        assert_eq!(GroupMsg::parse(&b), Err(WireError::Malformed));
        let mut b = ok.clone();
        b[11] = 1; // reserved
        assert_eq!(GroupMsg::parse(&b), Err(WireError::Malformed));
        let mut b = ok;
        b[HEAD + 15] = 1; // the sender's reserved bytes
        assert_eq!(GroupMsg::parse(&b), Err(WireError::Malformed));
    }
}
