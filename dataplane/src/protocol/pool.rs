//! Payload buffers recycled through a per-thread pool, so queuing a copied payload allocates
//! nothing in steady state.

use crate::seam::MsgBytes;
use std::cell::RefCell;

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
