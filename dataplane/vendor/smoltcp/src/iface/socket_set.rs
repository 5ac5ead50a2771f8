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

    fn bit(handle: SocketHandle) -> u64 {
        1 << handle.0.min(63)
    }

    /// Adds a socket.
    pub fn insert(&mut self, handle: SocketHandle) {
        self.0 |= Self::bit(handle);
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
    /// rdsd patch (PATCHES.md, item 4): the earliest `Meta::egress_at` of the sockets, as of
    /// the last egress walk, lowered to `EGRESS_NOW` whenever a socket is added or handed out
    /// by `&mut` (the interface keeps its own flag for the sockets its ingress fed).
    egress_at: Instant,
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
            egress_at: EGRESS_NEVER,
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
        self.egress_at = EGRESS_NOW;

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
                self.egress_at = EGRESS_NOW;
                T::downcast_mut(&mut item.socket)
                    .expect("handle refers to a socket of a wrong type")
            }
            None => panic!("handle does not refer to a valid socket"),
        }
    }

    /// Remove a socket from the set, without changing its state.
    ///
    /// # Panics
    /// This function may panic if the handle does not belong to this socket set.
    pub fn remove(&mut self, handle: SocketHandle) -> Socket<'a> {
        net_trace!("[{}]: removing", handle.0);
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
        self.egress_at = EGRESS_NOW;
        self.items_mut().map(|i| {
            i.meta.egress_at = EGRESS_NOW;
            (i.meta.handle, &mut i.socket)
        })
    }

    /// rdsd patch (PATCHES.md, item 4): the earliest time any socket's egress may send, as
    /// the last egress walk left it or lower (see [`crate::iface::Interface::egress_at`]).
    pub(crate) fn egress_at(&self) -> Instant {
        self.egress_at
    }

    /// Sets what [`SocketSet::egress_at`] answers (the egress walk, which saw every socket).
    pub(crate) fn set_egress_at(&mut self, at: Instant) {
        self.egress_at = at;
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
