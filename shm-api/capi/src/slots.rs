//! Fd-indexed slots that a call reads with plain loads and stores: how the C ABI finds a
//! socket by its fd.
//!
//! Why: every call of the C ABI finds its socket by fd. A read lock and an `Arc` clone cost
//! four locked instructions a call, and a locked instruction waits until the thread's earlier
//! stores have reached the cache: after a send, the store that published the tx ring (a line
//! rdsd's poll core reads), so each call waited out a cross-core round trip
//! (`shm_api::bias_lock` says the same of the socket's own lock). One table-wide lock was
//! also a line that every call of every thread wrote.
//!
//! How (read-copy-update with membarrier, in the manner of liburcu's "memb" flavour):
//! - A reader marks itself inside with plain stores to its own record (`nest`), loads the
//!   slot, uses the entry in place, and marks itself outside (`nest` back to 0, `exits` + 1).
//! - A writer (close, dup2) swaps the slot, makes `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)`,
//!   then waits until every reader that was inside has left; only then is the old entry's
//!   table reference dropped. The barrier pairs with the reader's store-then-load as in
//!   `shm_api::bias_lock`: either the reader loads the new slot, or the writer sees it inside.
//! - A reader that is about to sleep (a blocking recv or send: shm-api calls
//!   [`before_block`] first) takes a counted reference and leaves, so a close never waits for
//!   a sleeping call; as on Linux, the socket then lives until that call returns.
//! - Without membarrier, both sides make a SeqCst fence instead (also under Miri).
//!
//! Not async-signal-safe (neither are the calls it serves): a close from a signal handler that
//! interrupted a call of the same thread leaks the old entry rather than free it under that
//! call.

use std::cell::Cell;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One thread's reader record; written by that thread only.
#[repr(align(64))]
struct ReaderRec {
    /// Sections this thread is in (nested calls count), 0 outside.
    nest: AtomicU32,
    /// Outermost sections left so far: a writer that saw the thread inside waits for this to
    /// move (or `nest` to read 0).
    exits: AtomicU64,
    /// `fork_generation` at registration: a record inherited from a parent thread that does not
    /// exist in this process is never waited for. The thread that forked moves its own to
    /// the child's generation (`after_fork_in_child`).
    fork_gen: AtomicU64,
}

/// What the thread's section holds (at most one in-place entry per thread; nested reads take
/// a counted reference).
#[derive(Clone, Copy)]
enum Held {
    Idle,
    /// Inside a section; the entry in place.
    Section(*const (), unsafe fn(*const ())),
    /// The section was left before a sleep with a counted reference to this entry.
    Counted(*const ()),
}

/// Keeps this thread's record in `READERS` until the thread exits.
struct Registration(Arc<ReaderRec>);

impl Drop for Registration {
    fn drop(&mut self) {
        // Later reads in this thread's exit (other thread-locals' destructors) count their
        // references under the writers' lock instead.
        let _ = STATE.try_with(|st| st.rec.set(std::ptr::null()));
        let mut all = READERS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|r| !Arc::ptr_eq(r, &self.0));
    }
}

static READERS: Mutex<Vec<Arc<ReaderRec>>> = Mutex::new(Vec::new());

/// A thread's reading state: one thread-local (in a shared library each access to one is a
/// call to `__tls_get_addr`, so a call makes two: its read and its `Ref`'s drop).
struct ThreadState {
    /// This thread's record (null until its first read, and again once it exits).
    rec: Cell<*const ReaderRec>,
    /// What this thread's section holds.
    held: Cell<Held>,
}

impl ThreadState {
    /// This thread's record, registered on first use; `None` while the thread exits.
    #[inline]
    fn rec(&self) -> Option<&'static ReaderRec> {
        let p = self.rec.get();
        if p.is_null() {
            return register(self);
        }
        // SAFETY: `REGISTRATION` keeps the record alive until this thread's exit, which
        // resets `rec` first; `READERS` may hold it longer, never shorter.
        Some(unsafe { &*p })
    }
}

thread_local! {
    /// Const, without destructor: usable until the thread is gone.
    static STATE: ThreadState = const {
        ThreadState { rec: Cell::new(std::ptr::null()), held: Cell::new(Held::Idle) }
    };
    /// Owns the record; its destructor unregisters it.
    static REGISTRATION: std::cell::OnceCell<Registration> = const { std::cell::OnceCell::new() };
}

#[cold]
fn register(st: &ThreadState) -> Option<&'static ReaderRec> {
    REGISTRATION
        .try_with(|slot| {
            let reg = slot.get_or_init(|| {
                let rec = Arc::new(ReaderRec {
                    nest: AtomicU32::new(0),
                    exits: AtomicU64::new(0),
                    fork_gen: AtomicU64::new(crate::fork::fork_generation()),
                });
                READERS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(rec.clone());
                Registration(rec)
            });
            let p = Arc::as_ptr(&reg.0);
            st.rec.set(p);
            // SAFETY: as in `rec`.
            unsafe { &*p }
        })
        .ok()
}

/// In the child of a fork (registered after `fork::watch`'s handler, so the generation has
/// moved): the forking thread is this process's thread now, its record must be waited for.
/// Only this thread's own record is touched (the records' lock may have been held by a
/// parent thread that the child does not have).
extern "C" fn after_fork_in_child() {
    let p = STATE
        .try_with(|st| st.rec.get())
        .unwrap_or(std::ptr::null());
    if !p.is_null() {
        // SAFETY: as in `rec`.
        unsafe { &*p }
            .fork_gen
            .store(crate::fork::fork_generation(), Ordering::Relaxed);
    }
}

/// Before the first entry is put in a slot (so before any read): shm-api's sleeps end
/// sections; forks move the forking thread's record; the barrier kind is chosen.
fn setup() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let ok = !cfg!(miri) && shm_api::sys::membarrier_private_register().is_ok();
        MEMBARRIER.store(ok, Ordering::Relaxed);
        shm_api::set_before_block(before_block);
        crate::fork::watch();
        // SAFETY: registers a handler that touches only this thread's own record.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// Whether the writers' barrier is membarrier (else both sides fence); set by `setup`, before
/// the first entry is put in a slot, so before any reader looks.
static MEMBARRIER: AtomicBool = AtomicBool::new(false);

#[inline(always)]
fn reader_barrier() {
    if MEMBARRIER.load(Ordering::Relaxed) {
        std::sync::atomic::compiler_fence(Ordering::SeqCst);
    } else {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

fn writer_barrier() {
    if !MEMBARRIER.load(Ordering::Relaxed) {
        std::sync::atomic::fence(Ordering::SeqCst);
    } else if shm_api::sys::membarrier_private().is_err() {
        // Registered in `setup`, so this cannot fail; if it did, readers would not be ordered.
        std::process::abort();
    }
}

impl ReaderRec {
    #[inline]
    fn enter(&self) {
        let n = self.nest.load(Ordering::Relaxed);
        self.nest.store(n + 1, Ordering::Relaxed);
        reader_barrier();
    }

    #[inline]
    fn leave(&self) {
        let n = self.nest.load(Ordering::Relaxed);
        if n == 1 {
            let e = self.exits.load(Ordering::Relaxed);
            self.exits.store(e + 1, Ordering::Release);
        }
        // Release: the section's reads of the entry happen before a writer that sees 0.
        self.nest.store(n - 1, Ordering::Release);
    }
}

/// Called by shm-api before a call sleeps: the thread's in-place entry becomes a counted
/// reference and its section ends, so writers do not wait for the sleep.
pub fn before_block() {
    let _ = STATE.try_with(|st| {
        if let Held::Section(p, upgrade) = st.held.get() {
            // SAFETY: `p` is the section's entry, alive until the section ends (below).
            unsafe { upgrade(p) };
            st.held.set(Held::Counted(p));
            if let Some(r) = st.rec() {
                r.leave();
            }
        }
    });
}

/// `Arc::increment_strong_count` for the slot type.
unsafe fn increment<T>(p: *const ()) {
    // SAFETY: the caller's `p` came from `Arc::<T>::into_raw` and is alive.
    unsafe { Arc::increment_strong_count(p as *const T) }
}

/// Fd-indexed slots of `Arc<T>` (module doc).
pub struct Slots<T, const N: usize> {
    slots: [AtomicPtr<T>; N],
    /// Serialises writers; a reader that cannot use its thread's record (the thread is
    /// exiting) takes it to count a reference.
    writers: Mutex<()>,
}

/// An entry found by [`Slots::read`]: in place within the thread's section, or counted.
pub struct Ref<T: 'static> {
    entry: NonNull<T>,
    /// The counted reference (`None` in place, or once taken out by `get`).
    counted: Option<Arc<T>>,
    /// In place: this thread's state (so that the drop needs no second thread-local access);
    /// null for a counted one. Also keeps `Ref` from leaving its thread.
    state: *const ThreadState,
}

impl<T> Deref for Ref<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: alive while this `Ref` is: the thread's section keeps writers from dropping
        // it, and `before_block` turns the section into a count before it ends.
        unsafe { self.entry.as_ref() }
    }
}

impl<T> Drop for Ref<T> {
    #[inline]
    fn drop(&mut self) {
        if self.state.is_null() {
            return;
        }
        // SAFETY: this thread's own state (a `Ref` never leaves its thread), which lives as
        // long as the thread.
        let st = unsafe { &*self.state };
        match st.held.replace(Held::Idle) {
            Held::Section(..) => {
                // SAFETY: set by the read that made this `Ref`; as in `ThreadState::rec`.
                unsafe { &*st.rec.get() }.leave();
            }
            Held::Counted(p) => {
                // SAFETY: `before_block` counted this reference for us.
                drop(unsafe { Arc::from_raw(p as *const T) });
            }
            Held::Idle => {}
        }
    }
}

impl<T: Send + Sync + 'static, const N: usize> Slots<T, N> {
    pub const fn new() -> Self {
        Slots {
            slots: [const { AtomicPtr::new(std::ptr::null_mut()) }; N],
            writers: Mutex::new(()),
        }
    }

    /// The entry in slot `i`, if any, for as long as the returned [`Ref`] lives.
    #[inline]
    pub fn read(&'static self, i: usize) -> Option<Ref<T>> {
        let slot = self.slots.get(i)?;
        STATE.with(|st| {
            let Some(r) = st.rec() else {
                return self.counted_locked(slot);
            };
            match st.held.get() {
                Held::Idle => {}
                // Nested in a call that holds one: a counted reference.
                Held::Section(..) => return self.counted(slot),
                Held::Counted(..) => {
                    r.enter();
                    let got = self.counted(slot);
                    r.leave();
                    return got;
                }
            }
            r.enter();
            let p = slot.load(Ordering::Acquire);
            let Some(entry) = NonNull::new(p) else {
                r.leave();
                return None;
            };
            st.held.set(Held::Section(p as *const (), increment::<T>));
            Some(Ref {
                entry,
                counted: None,
                state: st,
            })
        })
    }

    /// A counted reference to the entry in slot `i`.
    pub fn get(&'static self, i: usize) -> Option<Arc<T>> {
        let slot = self.slots.get(i)?;
        let got = STATE.with(|st| match st.rec() {
            None => self.counted_locked(slot),
            Some(_) if matches!(st.held.get(), Held::Section(..)) => self.counted(slot),
            Some(r) => {
                r.enter();
                let got = self.counted(slot);
                r.leave();
                got
            }
        });
        got.and_then(|mut r| r.counted.take())
    }

    /// Inside a section: count a reference to what `slot` holds.
    fn counted(&self, slot: &AtomicPtr<T>) -> Option<Ref<T>> {
        // SAFETY: loaded inside the section, so no writer has dropped the table's reference.
        unsafe { count_ref(slot) }
    }

    /// Without the thread's record (it is exiting): count a reference under the writers' lock.
    fn counted_locked(&self, slot: &AtomicPtr<T>) -> Option<Ref<T>> {
        let _w = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: writers drop a table reference only under this lock.
        unsafe { count_ref(slot) }
    }

    /// Puts `new` in slot `i`; returns what it held once no reader still uses it in place.
    /// (If this very thread is inside a section, from a signal handler say, the old entry
    /// cannot be waited for and is leaked instead.)
    pub fn replace(&self, i: usize, new: Option<Arc<T>>) -> Option<Arc<T>> {
        let slot = &self.slots[i];
        setup();
        let _w = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        let newp = new.map_or(std::ptr::null_mut(), |a| Arc::into_raw(a) as *mut T);
        let old = slot.swap(newp, Ordering::AcqRel);
        if old.is_null() {
            return None;
        }
        if !synchronize() {
            return None;
        }
        // SAFETY: `old` came from `Arc::into_raw` (the table's reference), and no reader holds
        // it in place any more.
        Some(unsafe { Arc::from_raw(old) })
    }
}

/// A counted reference to what `slot` holds.
///
/// # Safety
/// The table's reference in `slot` must stay alive meanwhile (a read section, or the writers'
/// lock).
unsafe fn count_ref<T>(slot: &AtomicPtr<T>) -> Option<Ref<T>> {
    let p = slot.load(Ordering::Acquire);
    let entry = NonNull::new(p)?;
    // SAFETY: `p` came from `Arc::into_raw` and is alive (the caller's contract).
    let arc = unsafe {
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    };
    Some(Ref {
        entry,
        counted: Some(arc),
        state: std::ptr::null(),
    })
}

/// Waits until every reader that may have loaded a slot before the caller's swap has left
/// its section. False if the calling thread itself is inside one.
fn synchronize() -> bool {
    let me = STATE
        .try_with(|st| st.rec.get())
        .unwrap_or(std::ptr::null());
    // SAFETY: as in `rec`.
    if !me.is_null() && unsafe { &*me }.nest.load(Ordering::Relaxed) != 0 {
        return false;
    }
    writer_barrier();
    let gen = crate::fork::fork_generation();
    let all: Vec<Arc<ReaderRec>> = READERS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|r| r.fork_gen.load(Ordering::Relaxed) == gen && !std::ptr::eq(Arc::as_ptr(r), me))
        .cloned()
        .collect();
    for r in all {
        // Acquire: what the reader did in its section happens before the drop that follows.
        if r.nest.load(Ordering::Acquire) == 0 {
            continue;
        }
        let exits = r.exits.load(Ordering::Acquire);
        let mut spins = 0u32;
        while r.nest.load(Ordering::Acquire) != 0 && r.exits.load(Ordering::Acquire) == exits {
            // Sections are short (no sleep inside): spin, then yield, then nap.
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else if spins < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// An entry that knows whether it was dropped (a use after it fails the test; under Miri
    /// the use itself is the error).
    struct Canary {
        alive: AtomicU64,
        id: u64,
    }
    impl Drop for Canary {
        fn drop(&mut self) {
            self.alive.store(0, Ordering::SeqCst);
        }
    }

    fn canary(id: u64) -> Arc<Canary> {
        Arc::new(Canary {
            alive: AtomicU64::new(0xA11CE),
            id,
        })
    }

    #[test]
    fn a_slot_reads_what_was_put_and_gives_the_old_entry_back() {
        static S: Slots<Canary, 8> = Slots::new();
        assert!(S.read(3).is_none());
        assert!(S.replace(3, Some(canary(1))).is_none());
        assert_eq!(S.read(3).unwrap().id, 1);
        assert_eq!(S.get(3).unwrap().id, 1);
        let old = S.replace(3, Some(canary(2))).unwrap();
        assert_eq!((old.id, Arc::strong_count(&old)), (1, 1));
        assert_eq!(S.read(3).unwrap().id, 2);
        assert!(S.read(99).is_none());
        // Nested reads count; the outer one stays in place.
        let outer = S.read(3).unwrap();
        let inner = S.read(3).unwrap();
        assert!(inner.counted.is_some() && outer.counted.is_none() && !outer.state.is_null());
        drop((inner, outer));
        assert_eq!(S.replace(3, None).unwrap().id, 2);
    }

    /// Readers use entries while writers replace them: no reader ever sees a dropped entry,
    /// and every entry is dropped once its last reader is done.
    #[test]
    fn readers_never_see_an_entry_its_writer_dropped() {
        static S: Slots<Canary, 4> = Slots::new();
        let rounds: u64 = if cfg!(miri) { 30 } else { 20_000 };
        let stop = Arc::new(AtomicBool::new(false));
        for i in 0..4 {
            S.replace(i, Some(canary(0)));
        }
        let readers: Vec<_> = (0..3)
            .map(|t| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let i = (n as usize + t) % 4;
                        if let Some(e) = S.read(i) {
                            assert_eq!(e.alive.load(Ordering::SeqCst), 0xA11CE, "used after drop");
                            if n.is_multiple_of(5) {
                                // As a call that sleeps.
                                before_block();
                                std::thread::yield_now();
                                assert_eq!(e.alive.load(Ordering::SeqCst), 0xA11CE);
                            }
                        }
                        n += 1;
                    }
                })
            })
            .collect();
        for r in 0..rounds {
            let i = (r % 4) as usize;
            let old = S.replace(i, Some(canary(r + 1)));
            if let Some(old) = old {
                assert_eq!(old.alive.load(Ordering::SeqCst), 0xA11CE);
                drop(old);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        for i in 0..4 {
            let last = S.replace(i, None).unwrap();
            assert_eq!(Arc::strong_count(&last), 1);
        }
    }

    /// A reader that sleeps after `before_block` does not hold up a writer, and keeps its entry
    /// alive until it is done.
    #[test]
    fn a_sleeping_reader_holds_up_no_writer() {
        static S: Slots<Canary, 2> = Slots::new();
        S.replace(0, Some(canary(7)));
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            let e = S.read(0).unwrap();
            before_block();
            tx.send(()).unwrap();
            done_rx.recv().unwrap();
            assert_eq!((e.id, e.alive.load(Ordering::SeqCst)), (7, 0xA11CE));
        });
        rx.recv().unwrap();
        // Returns at once: the reader left its section before "sleeping".
        let old = S.replace(0, None).unwrap();
        assert_eq!(Arc::strong_count(&old), 2, "the sleeping reader's count");
        done_tx.send(()).unwrap();
        reader.join().unwrap();
        assert_eq!(Arc::strong_count(&old), 1);
    }
}
