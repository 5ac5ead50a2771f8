//! A global allocator that counts each thread's allocations: rdsd's binary installs it so that
//! each poll thread can publish how many it made (`poll_allocations`; none in steady state),
//! and the tests that prove a path allocates nothing install it in their own binary. This file
//! uses `std` only, so that the tests of `rds-proto` (which cannot depend on rdsd) include it
//! by `#[path]`: one copy. The includer declares the `#[global_allocator]` static.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Forwards to the system allocator, counting the calling thread's allocations.
pub struct CountingAlloc;

thread_local! {
    /// Allocations made by this thread.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

/// Allocations (and reallocations) this thread has made so far; 0 in a binary that does not
/// install [`CountingAlloc`].
pub fn allocations() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator; the counter is a const-initialised thread-local
// without destructor, so touching it never allocates or re-enters the allocator.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}
