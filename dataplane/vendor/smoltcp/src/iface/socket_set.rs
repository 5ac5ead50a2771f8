use core::fmt;
use managed::ManagedSlice;

use super::socket_meta::{EGRESS_NEVER, EGRESS_NOW, Meta};
use crate::socket::{AnySocket, Socket};
use crate::time::Instant;

/// Opaque struct with space for storing one socket.
///
/// This is public so you can use it to allocate space for storing
/// sockets when creating an Interface.
#[derive(Debug, Default)]
pub struct SocketStorage<'a> {
    inner: Option<Item<'a>>,
}

impl<'a> SocketStorage<'a> {
    pub const EMPTY: Self = Self { inner: None };
}

/// An item of a socket set.
#[derive(Debug)]
pub(crate) struct Item<'a> {
    pub(crate) meta: Meta,
    pub(crate) socket: Socket<'a>,
}

/// A handle, identifying a socket in an Interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SocketHandle(usize);

impl SocketHandle {
    /// rdsd patch (PATCHES.md, item 6): the socket's slot in its set.
    pub(crate) fn slot(self) -> usize {
        self.0
    }
}

impl fmt::Display for SocketHandle {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// rdsd patch (vendor/smoltcp/PATCHES.md, item 4): a set of sockets by slot, as a bit mask.
/// The socket in slot `i < 63` is bit `i`; bit 63 stands for every slot from 63 on, so a mask
/// may say it contains a socket it does not (one in a high slot), but never misses one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct SocketMask(u64);

impl SocketMask {
    /// No socket.
    pub const EMPTY: SocketMask = SocketMask(0);

    /// rdsd patch (PATCHES.md, item 4): every socket.
    pub const ALL: SocketMask = SocketMask(u64::MAX);

    /// rdsd patch (PATCHES.md, item 4): the sockets from slot 63 on (the shared bit).
    pub(crate) const HIGH: SocketMask = SocketMask(1 << 63);

    fn bit(handle: SocketHandle) -> u64 {
        1 << handle.0.min(63)
    }

    /// Adds a socket.
    pub fn insert(&mut self, handle: SocketHandle) {
        self.0 |= Self::bit(handle);
    }

    /// rdsd patch (PATCHES.md, item 4): takes a socket out, if it has a bit of its own (a
    /// socket from slot 63 on stays covered by the shared bit).
    pub(crate) fn remove_exact(&mut self, handle: SocketHandle) {
        self.0 &= !SocketMask::single(handle).0;
    }

    /// Whether the socket may be in the set (see the type's doc).
    pub fn contains(&self, handle: SocketHandle) -> bool {
        self.0 & Self::bit(handle) != 0
    }

    /// Whether the two sets may share a socket.
    pub fn intersects(&self, other: SocketMask) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }

    /// rdsd patch (PATCHES.md, item 4): whether the set may hold a socket in a slot from 63
    /// on (those share one bit, so [`slots`](Self::slots) cannot name them).
    pub(crate) fn has_high(&self) -> bool {
        self.0 >> 63 != 0
    }

    /// rdsd patch (PATCHES.md, item 4): the slots below 63 in the set, lowest first.
    pub(crate) fn slots(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0 & !(1 << 63);
        core::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let slot = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(slot)
        })
    }

    /// rdsd patch (PATCHES.md, item 4): the set of this socket alone, exactly: empty for a
    /// socket in a high slot (63 on), which has no bit of its own. Sets built only from
    /// these never say they contain a socket they do not.
    pub fn single(handle: SocketHandle) -> SocketMask {
        SocketMask(if handle.0 < 63 { 1 << handle.0 } else { 0 })
    }

    /// rdsd patch (PATCHES.md, item 4): the sockets in either set.
    pub fn union(self, other: SocketMask) -> SocketMask {
        SocketMask(self.0 | other.0)
    }

    /// rdsd patch (PATCHES.md, item 4): the sockets of this set that are not in `other`.
    /// Exact for the slots below 63; the high slots' shared bit goes if `other` has it, so the
    /// result may miss a high-slot socket of this set (it never holds one it should not).
    pub fn difference(self, other: SocketMask) -> SocketMask {
        SocketMask(self.0 & !other.0)
    }
}

/// An extensible set of sockets.
///
/// The lifetime `'a` is used when storing a `Socket<'a>`.  If you're using
/// owned buffers for your sockets (passed in as `Vec`s) you can use
/// `SocketSet<'static>`.
#[derive(Debug)]
pub struct SocketSet<'a> {
    sockets: ManagedSlice<'a, SocketStorage<'a>>,
    /// rdsd patch (PATCHES.md, item 4): the sockets due now (`Meta::egress_at` is
    /// `EGRESS_NOW`): added, handed out by `&mut`, or left with more to send by their last
    /// dispatch (the interface keeps its own mask for the sockets its ingress fed).
    due: SocketMask,
    /// rdsd patch (PATCHES.md, item 4): the sockets outside `due` whose `egress_at` is a time
    /// (a timer: retransmission, delayed ACK, keep-alive, idle timeout...), not never.
    timers: SocketMask,
    /// rdsd patch (PATCHES.md, item 4): their times, by slot (below 63), side by side so that
    /// the earliest is found without touching the sockets.
    times: [Instant; 63],
    /// rdsd patch (PATCHES.md, item 4): no socket in `timers` has an earlier time (exact after
    /// an egress found a timer had come; until then a socket's timer that went away or moved
    /// later may leave it early).
    timer_at: Instant,
}

impl<'a> SocketSet<'a> {
    /// Create a socket set using the provided storage.
    pub fn new<SocketsT>(sockets: SocketsT) -> SocketSet<'a>
    where
        SocketsT: Into<ManagedSlice<'a, SocketStorage<'a>>>,
    {
        let sockets = sockets.into();
        SocketSet {
            sockets,
            due: SocketMask::EMPTY,
            timers: SocketMask::EMPTY,
            times: [EGRESS_NEVER; 63],
            timer_at: EGRESS_NEVER,
        }
    }

    /// Add a socket to the set, and return its handle.
    ///
    /// # Panics
    /// This function panics if the storage is fixed-size (not a `Vec`) and is full.
    pub fn add<T: AnySocket<'a>>(&mut self, socket: T) -> SocketHandle {
        fn put<'a>(index: usize, slot: &mut SocketStorage<'a>, socket: Socket<'a>) -> SocketHandle {
            net_trace!("[{}]: adding", index);
            let handle = SocketHandle(index);
            let mut meta = Meta::default();
            meta.handle = handle;
            *slot = SocketStorage {
                inner: Some(Item { meta, socket }),
            };
            handle
        }

        let socket = socket.upcast();
        // rdsd patch: a new socket is looked at by the next egress (`Meta::default`).
        let handle = self.put_first_free(socket, put);
        self.due.insert(handle);
        handle
    }

    fn put_first_free(
        &mut self,
        socket: Socket<'a>,
        put: fn(usize, &mut SocketStorage<'a>, Socket<'a>) -> SocketHandle,
    ) -> SocketHandle {
        for (index, slot) in self.sockets.iter_mut().enumerate() {
            if slot.inner.is_none() {
                return put(index, slot, socket);
            }
        }

        match &mut self.sockets {
            ManagedSlice::Borrowed(_) => panic!("adding a socket to a full SocketSet"),
            #[cfg(feature = "alloc")]
            ManagedSlice::Owned(sockets) => {
                sockets.push(SocketStorage { inner: None });
                let index = sockets.len() - 1;
                put(index, &mut sockets[index], socket)
            }
        }
    }

    /// Get a socket from the set by its handle, as mutable.
    ///
    /// # Panics
    /// This function may panic if the handle does not belong to this socket set
    /// or the socket has the wrong type.
    pub fn get<T: AnySocket<'a>>(&self, handle: SocketHandle) -> &T {
        match self.sockets[handle.0].inner.as_ref() {
            Some(item) => {
                T::downcast(&item.socket).expect("handle refers to a socket of a wrong type")
            }
            None => panic!("handle does not refer to a valid socket"),
        }
    }

    /// Get a mutable socket from the set by its handle, as mutable.
    ///
    /// # Panics
    /// This function may panic if the handle does not belong to this socket set
    /// or the socket has the wrong type.
    pub fn get_mut<T: AnySocket<'a>>(&mut self, handle: SocketHandle) -> &mut T {
        match self.sockets[handle.0].inner.as_mut() {
            Some(item) => {
                // rdsd patch (PATCHES.md, item 4): whatever the caller does with the socket
                // (send, recv, connect, close, a setting), the next egress looks at it.
                item.meta.egress_at = EGRESS_NOW;
                self.due.insert(handle);
                T::downcast_mut(&mut item.socket)
                    .expect("handle refers to a socket of a wrong type")
            }
            None => panic!("handle does not refer to a valid socket"),
        }
    }

    /// rdsd patch (PATCHES.md, item 7): `tcp::Socket::recv` on the TCP socket `handle`, which
    /// counts as due for the next egress (as [`get_mut`](Self::get_mut) makes it) only when the
    /// read opened the receive window enough for a window update: otherwise its dispatch
    /// would send nothing (a read changes nothing else it looks at), and a request/reply
    /// exchange paid one dispatch per read.
    ///
    /// # Panics
    /// This function may panic if the handle does not belong to this socket set or is not a
    /// TCP socket.
    #[cfg(feature = "socket-tcp")]
    pub fn tcp_recv<'b, F, R>(
        &'b mut self,
        handle: SocketHandle,
        f: F,
    ) -> Result<R, crate::socket::tcp::RecvError>
    where
        F: FnOnce(&'b mut [u8]) -> (usize, R),
    {
        let Some(item) = self.sockets[handle.0].inner.as_mut() else {
            panic!("handle does not refer to a valid socket");
        };
        #[allow(irrefutable_let_patterns)] // TCP alone among the features
        let Socket::Tcp(socket) = &mut item.socket else {
            panic!("handle refers to a socket of a wrong type");
        };
        let (result, opened) = socket.recv_noting_window(f);
        if opened {
            item.meta.egress_at = EGRESS_NOW;
            self.due.insert(handle);
        }
        result
    }

    /// Remove a socket from the set, without changing its state.
    ///
    /// # Panics
    /// This function may panic if the handle does not belong to this socket set.
    pub fn remove(&mut self, handle: SocketHandle) -> Socket<'a> {
        net_trace!("[{}]: removing", handle.0);
        // rdsd patch (PATCHES.md, item 4): no egress looks at the slot for it any more.
        self.due.remove_exact(handle);
        self.timers.remove_exact(handle);
        match self.sockets[handle.0].inner.take() {
            Some(item) => item.socket,
            None => panic!("handle does not refer to a valid socket"),
        }
    }

    /// Get an iterator to the inner sockets.
    pub fn iter(&self) -> impl Iterator<Item = (SocketHandle, &Socket<'a>)> {
        self.items().map(|i| (i.meta.handle, &i.socket))
    }

    /// Get a mutable iterator to the inner sockets.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (SocketHandle, &mut Socket<'a>)> {
        // rdsd patch (PATCHES.md, item 4): each socket handed out is looked at by the next
        // egress.
        self.due = SocketMask::ALL;
        self.items_mut().map(|i| {
            i.meta.egress_at = EGRESS_NOW;
            (i.meta.handle, &mut i.socket)
        })
    }

    /// rdsd patch (PATCHES.md, item 4): the earliest time any socket's egress may send (see
    /// [`crate::iface::Interface::egress_at`]).
    pub(crate) fn egress_at(&self) -> Instant {
        if self.due.is_empty() {
            self.timer_at
        } else {
            EGRESS_NOW
        }
    }

    /// rdsd patch (PATCHES.md, item 4): the sockets an egress at `now` looks at: every one
    /// when `all`, else those due now, and those whose timer has come (found in `times`,
    /// without touching the sockets) once the earliest timer has come. Those looked at leave
    /// `due` and `timers`, and [`egress_record`](Self::egress_record) puts each back where
    /// the egress left it.
    #[inline]
    pub(crate) fn egress_start(&mut self, now: Instant, all: bool) -> SocketMask {
        let due = core::mem::take(&mut self.due);
        if all {
            self.timers = SocketMask::EMPTY;
            self.timer_at = EGRESS_NEVER;
            return SocketMask::ALL;
        }
        if now < self.timer_at {
            // (A socket both due and with a timer keeps its bit in `timers` until recorded.)
            return due;
        }
        // A timer has come, or `timer_at` is early (a timer that went away or moved on left
        // it there): the sockets whose time has come, and the earliest of the others, exactly.
        let mut expired = SocketMask::EMPTY;
        let mut at = EGRESS_NEVER;
        for slot in self.timers.slots() {
            let t = self.times[slot];
            if t <= now {
                expired.insert(SocketHandle(slot));
            } else {
                at = at.min(t);
            }
        }
        if self.timers.has_high() {
            // No times kept for these: all of them are looked at, and recorded again.
            expired = expired.union(SocketMask::HIGH);
        }
        self.timers = self.timers.difference(expired);
        self.timer_at = at;
        due.union(expired)
    }

    /// rdsd patch (PATCHES.md, item 4): where the egress left a socket it looked at: due now,
    /// a timer, or nothing until a packet or `&mut` access. `None`: the slot is empty.
    #[inline]
    pub(crate) fn egress_record(&mut self, slot: usize, left: Option<(SocketHandle, Instant)>) {
        let Some((handle, at)) = left else {
            self.timers.remove_exact(SocketHandle(slot));
            return;
        };
        match at {
            EGRESS_NOW => {
                self.due.insert(handle);
                self.timers.remove_exact(handle);
            }
            EGRESS_NEVER => self.timers.remove_exact(handle),
            t => {
                self.timers.insert(handle);
                if let Some(time) = self.times.get_mut(slot) {
                    *time = t;
                }
                self.timer_at = self.timer_at.min(t);
            }
        }
    }

    /// rdsd patch (PATCHES.md, item 4): the slots a mask stands for, lowest first: its bits
    /// below 63, and every slot from 63 on when it has the shared bit. (The range is taken
    /// now, so the caller may hand out the sockets by `&mut` as it goes.)
    pub(crate) fn slots_of(&self, mask: SocketMask) -> impl Iterator<Item = usize> + use<> {
        let high = if mask.has_high() {
            63..self.sockets.len().max(63)
        } else {
            0..0
        };
        mask.slots().chain(high)
    }

    /// rdsd patch (PATCHES.md, item 4): the socket in this slot, if any.
    pub(crate) fn item_mut(&mut self, slot: usize) -> Option<&mut Item<'a>> {
        self.sockets.get_mut(slot)?.inner.as_mut()
    }

    /// Iterate every socket in this set.
    pub(crate) fn items(&self) -> impl Iterator<Item = &Item<'a>> + '_ {
        self.sockets.iter().filter_map(|x| x.inner.as_ref())
    }

    /// Iterate every socket in this set.
    pub(crate) fn items_mut(&mut self) -> impl Iterator<Item = &mut Item<'a>> + '_ {
        self.sockets.iter_mut().filter_map(|x| x.inner.as_mut())
    }
}

#[cfg(test)]
mod rdsd_mask_tests {
    use super::*;

    /// rdsd patch (PATCHES.md, item 4): `single` is exact, `difference` removes.
    #[test]
    fn socket_mask_single_union_difference() {
        let (a, b, high) = (SocketHandle(3), SocketHandle(62), SocketHandle(70));
        let m = SocketMask::single(a).union(SocketMask::single(b));
        assert!(m.contains(a) && m.contains(b) && !m.contains(SocketHandle(4)));
        assert_eq!(SocketMask::single(high), SocketMask::EMPTY);
        let mut touched = SocketMask::EMPTY;
        touched.insert(a);
        touched.insert(high);
        let left = m.difference(touched);
        assert!(!left.contains(a) && left.contains(b) && !left.contains(high));
    }
}
