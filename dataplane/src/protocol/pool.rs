//! What a link queues as a message's payload until the peer acknowledges it: a copy in a
//! buffer recycled through a per-thread pool (queuing allocates nothing in steady state), or
//! the app's bytes where they lie in its tx ring (zero copy, `Link::payload_in_place`).

use crate::seam::MsgBytes;
use std::cell::RefCell;

/// Default smallest payload the TCP links send in place (`tcp_zero_copy_min`): below it a copy
/// costs less than a hold on the ring space (`bench/RESULTS.md`, "Zero copy on TCP").
pub const TCP_ZERO_COPY_MIN: usize = 16 * 1024;
/// Most recycled buffers kept per thread.
const POOL_MAX: usize = 4096;
/// Larger buffers are freed rather than kept (a 1 MiB message is rare).
const KEEP_MAX: usize = 64 * 1024;

thread_local! {
    static POOL: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A payload copy that returns to the thread's pool when dropped.
#[derive(Debug)]
pub struct PoolBuf(Vec<u8>);

impl PoolBuf {
    /// A pooled copy of `src`.
    pub fn copy_of(src: MsgBytes<'_>) -> PoolBuf {
        let mut v = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
        src.copy_into(&mut v);
        PoolBuf(v)
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() <= KEEP_MAX {
            POOL.with(|p| {
                let mut p = p.borrow_mut();
                if p.len() < POOL_MAX {
                    p.push(v);
                }
            });
        }
    }
}

/// Bytes of an app's tx ring, sent in place: the poll core keeps the region mapped and the
/// ring space unused until the message is released (`poll/inplace.rs`).
pub struct InPlaceBytes {
    ptr: *const u8,
    len: usize,
}

impl InPlaceBytes {
    /// The payload where it lies.
    ///
    /// # Safety
    /// The bytes must stay mapped until this value is dropped: the poll core guarantees it for
    /// a payload offered in place (`OutMsg::in_place`), whose hold outlives the message.
    pub unsafe fn new(bytes: MsgBytes<'_>) -> InPlaceBytes {
        InPlaceBytes {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        }
    }
}

// SAFETY: an address range in a shared mapping that the poll core keeps mapped while the message
// is queued; moving the handle between threads changes nothing about that.
unsafe impl Send for InPlaceBytes {}

impl std::fmt::Debug for InPlaceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InPlaceBytes({:p}, {})", self.ptr, self.len)
    }
}

/// A queued payload: a pooled copy, or the app's bytes in place (zero copy).
#[derive(Debug)]
pub enum Payload {
    Copy(PoolBuf),
    InPlace(InPlaceBytes),
}

impl Payload {
    /// True when the bytes are read from the app's tx ring.
    pub fn is_in_place(&self) -> bool {
        matches!(self, Payload::InPlace(_))
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        match self {
            Payload::Copy(b) => b.as_ref(),
            Payload::InPlace(b) if b.len == 0 => &[],
            // SAFETY: the range lies in an app region the poll core keeps mapped, with its ring
            // space not reused, until this message is released (after the peer acknowledged
            // it and its write completed). The slice only carries the address and length to
            // the link's `write`, which hands them to a device or the kernel (RDMA, kernel TCP)
            // or copies them with a raw copy (userspace TCP): no Rust code reads these bytes
            // through it, so an app scribbling on them (its own message) races with that copy
            // alone.
            Payload::InPlace(b) => unsafe { std::slice::from_raw_parts(b.ptr, b.len) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_recycles_buffers() {
        let a = PoolBuf::copy_of(MsgBytes::from_slice(&[1, 2, 3]));
        let first = a.0.as_ptr();
        drop(a);
        let b = PoolBuf::copy_of(MsgBytes::from_slice(&[4, 5]));
        assert_eq!(b.as_ref(), &[4, 5]);
        assert_eq!(b.0.as_ptr(), first, "the dropped buffer was reused");
    }
}
