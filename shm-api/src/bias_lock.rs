//! A mutex that the thread using it takes with plain loads and stores: a socket's tx and rx
//! sides (`Socket::send`, `Socket::recv`).
//!
//! Why not `std::sync::Mutex`: its lock is a `lock cmpxchg` and its unlock a `xchg`, and a
//! locked instruction waits until every earlier store of its thread has reached the cache. A
//! send's last store publishes the tx ring's producer position, a line rdsd's poll core reads
//! all the time, so the unlock right after it waited out a cross-core round trip on every
//! message (350–450 ns between two pinned cores of the 16-CPU host, bench/RESULTS.md), and a
//! receive's release of its rx ring did the same. Here the stores drain on their own.
//!
//! How (biased or "reserved" locking, made safe across threads with an asymmetric barrier):
//! - The lock is *biased* to one thread (the first to take it). That thread enters by storing
//!   1 to its epoch's `inside` word and loading the bias word again: if it still names it, the
//!   lock is its own. No other thread ever writes that `inside` word.
//! - Any other thread takes the ordinary mutex (`slow`), and if a bias is set it *revokes* it:
//!   it clears the bias word, makes `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (every
//!   running thread of the process executes a full barrier), then waits until the biased
//!   thread's `inside` word reads 0. The barrier pairs with the owner's store-then-load
//!   (Dekker's pattern with one side's fence moved into the kernel): either the owner's load
//!   comes after the barrier and sees the bias gone (it backs out and queues on the mutex), or
//!   its store came before and the revoker sees it inside (and waits for it to leave). The
//!   owner pays a compiler fence; the revoker pays a system call, once per revocation.
//! - After a revocation everyone uses the mutex. A thread that then takes it
//!   [`REBIAS_AFTER`] times in a row (a socket handed over to a worker thread) gets the bias,
//!   in a new epoch with its own `inside` word, so that a late store of the old owner can
//!   never clear the new owner's. After [`EPOCHS`] biases the lock stays an ordinary mutex:
//!   revocations cost at most that many system calls over the lock's life.
//! - Without membarrier (before Linux 4.14, or forbidden by seccomp) no bias is ever set: the
//!   fast path is one load and a compare, then the ordinary mutex.
//!
//! A revoker waits for an owner that sleeps inside (a `recv` blocked for a message holds the
//! rx side) on the `inside` word's futex; the owner, leaving, wakes it if it finds its bias
//! gone (that load pairs with the revoker's barrier the same way).
//!
//! Under Miri both sides make a SeqCst fence instead (the symmetric Dekker pattern), so Miri
//! checks the protocol's data races without the system call.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// Biases over a lock's life (one `inside` word each); the low bits of the bias word.
pub const EPOCHS: usize = 8;
const EPOCH_MASK: usize = EPOCHS - 1;
/// Takes of the mutex in a row by one thread after which the lock is biased to it again.
pub const REBIAS_AFTER: u32 = 64;

/// How a [`BiasedMutex`] has been taken so far: counts for tests and `rdsctl`-style
/// introspection, kept by whoever holds the lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LockCounts {
    /// Takes by the biased thread with plain loads and stores.
    pub fast: u64,
    /// Takes through the mutex.
    pub slow: u64,
    /// Biases revoked (a membarrier each).
    pub revocations: u64,
}

struct Slow {
    /// Biases given so far (the next one's epoch).
    epochs_used: usize,
    /// The thread that took the mutex last, and how many times in a row.
    last: usize,
    run: u32,
}

/// A mutual-exclusion lock biased to the thread that uses it (module doc).
pub struct BiasedMutex<T> {
    /// The biased thread's token with the epoch in its low bits; 0: no bias.
    bias: AtomicUsize,
    /// Per epoch: 1 while that epoch's owner holds the lock by the fast path. Written by that
    /// owner only; a futex word for a revoker that waits.
    inside: [AtomicU32; EPOCHS],
    slow: Mutex<Slow>,
    data: UnsafeCell<(T, LockCounts)>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time (module doc), as `Mutex<T>`
// does, so it is `Sync` when `T` may move between threads.
unsafe impl<T: Send> Sync for BiasedMutex<T> {}
// SAFETY: owning the lock is owning the `T`.
unsafe impl<T: Send> Send for BiasedMutex<T> {}

/// Held while the lock is taken; gives `&mut T`. Not `Send`: the biased thread itself must
/// clear its `inside` word.
pub struct BiasedGuard<'a, T> {
    lock: &'a BiasedMutex<T>,
    how: How<'a>,
    _not_send: PhantomData<*const ()>,
}

enum How<'a> {
    /// By the bias word's value at entry.
    Fast(usize),
    Slow(#[allow(dead_code)] MutexGuard<'a, Slow>),
}

/// This thread's token: its thread pointer (the TCB address on x86-64 and aarch64 Linux: one
/// instruction, where a thread-local in a shared library such as librdsd costs a call to
/// `__tls_get_addr`), elsewhere the address of a thread-local. Non-zero, aligned so that the
/// epoch fits below it, unique among live threads; a thread that reuses a dead one's gets its
/// bias, which is harmless: the dead thread holds nothing.
#[inline(always)]
fn token() -> usize {
    #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
    {
        let tp: usize;
        // SAFETY: reads the TCB's self pointer at %fs:0 (the x86-64 TLS ABI); no memory of
        // ours is written.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp,
                options(nostack, readonly, preserves_flags));
        }
        tp
    }
    #[cfg(all(target_arch = "aarch64", target_os = "linux", not(miri)))]
    {
        let tp: usize;
        // SAFETY: reads the thread pointer register; touches no memory.
        unsafe {
            std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp,
                options(nomem, nostack, preserves_flags));
        }
        tp
    }
    #[cfg(not(all(
        any(target_arch = "x86_64", target_arch = "aarch64"),
        target_os = "linux",
        not(miri)
    )))]
    {
        #[repr(align(8))]
        struct Token(#[allow(dead_code)] u8);
        thread_local! {
            static TOKEN: Token = const { Token(0) };
        }
        TOKEN.with(|t| t as *const Token as usize)
    }
}

/// The owner's half of the barrier pair.
#[inline(always)]
fn light_barrier() {
    #[cfg(miri)]
    std::sync::atomic::fence(Ordering::SeqCst);
    #[cfg(not(miri))]
    std::sync::atomic::compiler_fence(Ordering::SeqCst);
}

/// Whether biasing is possible: the revoker's barrier is available (registered once per
/// process).
fn heavy_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cfg!(miri) || crate::sys::membarrier_private_register().is_ok())
}

/// The revoker's half: a full barrier on every running thread of this process.
fn heavy_barrier() {
    #[cfg(miri)]
    std::sync::atomic::fence(Ordering::SeqCst);
    #[cfg(not(miri))]
    if crate::sys::membarrier_private().is_err() {
        // Registered in `heavy_available` before any bias was set, so this cannot fail; if
        // it did, the owner's side would not be ordered and exclusion could break.
        std::process::abort();
    }
}

impl<T> BiasedMutex<T> {
    pub fn new(value: T) -> Self {
        BiasedMutex {
            bias: AtomicUsize::new(0),
            inside: [const { AtomicU32::new(0) }; EPOCHS],
            slow: Mutex::new(Slow {
                epochs_used: 0,
                last: 0,
                run: 0,
            }),
            data: UnsafeCell::new((value, LockCounts::default())),
        }
    }

    /// Takes the lock.
    #[inline]
    pub fn lock(&self) -> BiasedGuard<'_, T> {
        let me = token();
        debug_assert!(me != 0 && me & EPOCH_MASK == 0, "thread pointer {me:#x}");
        let b = self.bias.load(Ordering::Relaxed);
        if b & !EPOCH_MASK == me {
            let inside = &self.inside[b & EPOCH_MASK];
            inside.store(1, Ordering::Relaxed);
            light_barrier();
            // Acquire: nothing of the critical section is read before this check.
            if self.bias.load(Ordering::Acquire) == b {
                let mut g = BiasedGuard {
                    lock: self,
                    how: How::Fast(b),
                    _not_send: PhantomData,
                };
                g.counts().fast += 1;
                return g;
            }
            // Revoked meanwhile: the revoker may be waiting for this word.
            self.leave_fast(b);
        }
        self.lock_slow(me)
    }

    #[cold]
    fn lock_slow(&self, me: usize) -> BiasedGuard<'_, T> {
        let mut slow = self.slow.lock().unwrap_or_else(|p| p.into_inner());
        let b = self.bias.load(Ordering::Relaxed);
        let mut revoked = false;
        if b != 0 && b & !EPOCH_MASK != me {
            self.revoke(b);
            revoked = true;
        }
        // A bias to this very thread (its fast path raced a revocation and a rebias to it):
        // holding the mutex excludes every other taker, and the owner is this thread.
        if std::mem::replace(&mut slow.last, me) == me {
            slow.run = slow.run.saturating_add(1);
        } else {
            slow.run = 1;
        }
        // The first taker gets the bias at once; later ones after a run of takes.
        let wanted = if slow.epochs_used == 0 {
            1
        } else {
            REBIAS_AFTER
        };
        if self.bias.load(Ordering::Relaxed) == 0
            && slow.run >= wanted
            && slow.epochs_used < EPOCHS
            && heavy_available()
        {
            // Its own `inside` word reads 0: no earlier owner ever wrote it.
            self.bias.store(me | slow.epochs_used, Ordering::Release);
            slow.epochs_used += 1;
        }
        let mut g = BiasedGuard {
            lock: self,
            how: How::Slow(slow),
            _not_send: PhantomData,
        };
        let counts = g.counts();
        counts.slow += 1;
        counts.revocations += u64::from(revoked);
        g
    }

    /// Clears bias `b` and waits until its owner is outside. Called with the mutex held.
    fn revoke(&self, b: usize) {
        self.bias.store(0, Ordering::Relaxed);
        heavy_barrier();
        let inside = &self.inside[b & EPOCH_MASK];
        let mut spins = 0u32;
        // Acquire: the owner's critical section happens before ours.
        while inside.load(Ordering::Acquire) != 0 {
            if spins < 100 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                // The owner wakes this word when it leaves and sees the bias gone; the
                // timeout only bounds a wake-up lost to a signal-interrupted wait.
                crate::sys::futex_wait(inside, 1, Some(Duration::from_millis(20)));
            }
        }
    }

    /// Leaves the fast path entered with bias `b`.
    #[inline]
    fn leave_fast(&self, b: usize) {
        let inside = &self.inside[b & EPOCH_MASK];
        inside.store(0, Ordering::Release);
        light_barrier();
        if self.bias.load(Ordering::Relaxed) != b {
            crate::sys::futex_wake(inside);
        }
    }

    /// How the lock has been taken so far (takes it).
    pub fn counts(&self) -> LockCounts {
        *self.lock().counts()
    }
}

impl<T> BiasedGuard<'_, T> {
    fn counts(&mut self) -> &mut LockCounts {
        // SAFETY: the guard holds the lock, so no other reference to the data exists.
        unsafe { &mut (*self.lock.data.get()).1 }
    }
}

impl<T> Deref for BiasedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock (module doc), so no `&mut` to the data exists.
        unsafe { &(*self.lock.data.get()).0 }
    }
}

impl<T> DerefMut for BiasedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock, so this is the only reference to the data.
        unsafe { &mut (*self.lock.data.get()).0 }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        if let How::Fast(b) = self.how {
            self.lock.leave_fast(b);
        }
        // `How::Slow` drops the mutex guard.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn thread_tokens_are_aligned_and_distinct() {
        let here = token();
        let there = std::thread::spawn(token).join().unwrap();
        assert!(here != 0 && here & EPOCH_MASK == 0 && there & EPOCH_MASK == 0);
        assert_ne!(here, there);
        assert_eq!(here, token());
    }

    #[test]
    fn one_thread_takes_it_by_the_fast_path() {
        let m = BiasedMutex::new(0u64);
        for _ in 0..1000 {
            *m.lock() += 1;
        }
        let c = m.counts();
        assert_eq!(*m.lock(), 1000);
        if heavy_available() {
            // The first take set the bias; every later one was fast.
            assert_eq!((c.slow, c.fast, c.revocations), (1, 1000, 0));
        } else {
            assert_eq!(c.fast, 0);
        }
    }

    /// Threads that take turns: every increment survives (a read, a yield, a write inside the
    /// lock loses updates unless the lock excludes), the bias moves at most `EPOCHS` times.
    #[test]
    fn threads_that_share_it_exclude_each_other() {
        let threads = 4;
        let rounds: u64 = if cfg!(miri) { 40 } else { 20_000 };
        let m = Arc::new(BiasedMutex::new(0u64));
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for i in 0..rounds {
                        let mut g = m.lock();
                        let v = *g;
                        if i % 7 == t {
                            std::thread::yield_now();
                        }
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*m.lock(), threads * rounds);
        let c = m.counts();
        assert!(c.revocations <= EPOCHS as u64, "{c:?}");
        assert_eq!(c.fast + c.slow, threads * rounds + 2, "{c:?}");
    }

    /// A socket handed to a worker: the first thread's bias is revoked once, and the worker
    /// gets the bias after a run of takes.
    #[test]
    fn a_lock_handed_to_another_thread_moves_its_bias_there() {
        if !heavy_available() {
            return;
        }
        let m = Arc::new(BiasedMutex::new(0u64));
        *m.lock() += 1;
        let n = u64::from(REBIAS_AFTER) * 4;
        let w = {
            let m = m.clone();
            std::thread::spawn(move || {
                for _ in 0..n {
                    *m.lock() += 1;
                }
                m.counts()
            })
        };
        let c = w.join().unwrap();
        assert_eq!(c.revocations, 1, "{c:?}");
        // The worker's first REBIAS_AFTER takes went through the mutex, the rest were fast.
        assert_eq!(c.slow, 1 + u64::from(REBIAS_AFTER), "{c:?}");
        assert_eq!(c.fast, n - u64::from(REBIAS_AFTER) + 1, "{c:?}");
    }

    /// An owner that sleeps inside (a blocked `recv`) is waited for, not overtaken.
    #[test]
    fn a_revoker_waits_for_an_owner_that_sleeps_inside() {
        if !heavy_available() {
            return;
        }
        let m = Arc::new(BiasedMutex::new(Vec::new()));
        m.lock().push(0);
        let g = m.lock();
        let other = {
            let m = m.clone();
            std::thread::spawn(move || m.lock().push(2))
        };
        std::thread::sleep(Duration::from_millis(if cfg!(miri) { 1 } else { 30 }));
        let mut g = g;
        g.push(1);
        drop(g);
        other.join().unwrap();
        assert_eq!(*m.lock(), vec![0, 1, 2]);
    }
}
