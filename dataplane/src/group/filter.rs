//! Per-member filters: which of a group's messages a member receives. A filter sees a
//! [`FilterInput`] (the sender's bound address and port, the length) and answers yes or no; it
//! runs on the poll thread for every member at every send, so it must not allocate or block.
//!
//! Today a filter is a list of [`SenderRule`]s (address prefix and port range), kept or
//! excluded. A classic-BPF or eBPF program is meant to become one more [`Filter`] variant
//! (a program run by an interpreter over the same input plus the payload bytes), with no change
//! to [`super::GroupTable`]: it only ever calls [`Filter::accepts`].

use super::GroupError;

/// What a filter decides on, for one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterInput {
    /// The sender's bound address (host order, as the seam's `laddr`).
    pub src_addr: u32,
    /// The sender's bound port.
    pub src_port: u16,
    /// Payload length in bytes.
    pub len: usize,
}

/// Senders from an address prefix and a port range (both ends included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SenderRule {
    addr: u32,
    prefix_len: u8,
    ports: (u16, u16),
}

impl SenderRule {
    /// Senders in `addr/prefix_len` bound to a port in `first..=last`. EINVAL
    /// ([`GroupError::BadFilter`]) for a prefix longer than 32 or `first > last`.
    pub fn new(addr: u32, prefix_len: u8, first: u16, last: u16) -> Result<SenderRule, GroupError> {
        if prefix_len > 32 || first > last {
            return Err(GroupError::BadFilter);
        }
        Ok(SenderRule {
            addr: addr & Self::mask(prefix_len),
            prefix_len,
            ports: (first, last),
        })
    }

    /// Exactly one sender socket.
    pub fn socket(addr: u32, port: u16) -> SenderRule {
        SenderRule {
            addr,
            prefix_len: 32,
            ports: (port, port),
        }
    }

    fn mask(prefix_len: u8) -> u32 {
        u32::MAX
            .checked_shl(32 - u32::from(prefix_len))
            .unwrap_or(0)
    }

    /// Whether the sender of `m` is one of these.
    pub fn matches(&self, m: &FilterInput) -> bool {
        m.src_addr & Self::mask(self.prefix_len) == self.addr
            && (self.ports.0..=self.ports.1).contains(&m.src_port)
    }
}

/// A member's filter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Filter {
    /// Every message (no filter attached).
    #[default]
    All,
    /// Only messages whose sender matches one of the rules.
    Only(Box<[SenderRule]>),
    /// Every message except those whose sender matches one of the rules.
    Except(Box<[SenderRule]>),
}

impl Filter {
    /// Rules one filter may hold: every send runs every member's filter, so an app must not be
    /// able to make that arbitrarily long.
    pub const MAX_RULES: usize = 16;

    /// EINVAL ([`GroupError::BadFilter`]) for more than [`Self::MAX_RULES`] rules.
    pub fn check(&self) -> Result<(), GroupError> {
        match self {
            Filter::All => Ok(()),
            Filter::Only(r) | Filter::Except(r) if r.len() <= Self::MAX_RULES => Ok(()),
            Filter::Only(_) | Filter::Except(_) => Err(GroupError::BadFilter),
        }
    }

    /// Whether a member with this filter receives `m`.
    pub fn accepts(&self, m: &FilterInput) -> bool {
        match self {
            Filter::All => true,
            Filter::Only(rules) => rules.iter().any(|r| r.matches(m)),
            Filter::Except(rules) => !rules.iter().any(|r| r.matches(m)),
        }
    }
}

/// `addr/len:first-last` (`:port` for one port), as `rdsctl info` shows a rule.
impl std::fmt::Display for SenderRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let a = std::net::Ipv4Addr::from(self.addr);
        write!(f, "{a}/{}:", self.prefix_len)?;
        match self.ports {
            (p, q) if p == q => write!(f, "{p}"),
            (p, q) => write!(f, "{p}-{q}"),
        }
    }
}

/// `all`, `only RULE,RULE` or `except RULE,...`, as `rdsctl info` shows a member's filter.
impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (word, rules) = match self {
            Filter::All => return f.write_str("all"),
            Filter::Only(r) => ("only", r),
            Filter::Except(r) => ("except", r),
        };
        f.write_str(word)?;
        for (i, r) in rules.iter().enumerate() {
            write!(f, "{}{r}", if i == 0 { " " } else { "," })?;
        }
        Ok(())
    }
}
