//! One hostile app against a real poll core: control requests (raw frames through
//! `Request::decode` and well-formed ones) interleaved with writes to any byte of its rings and
//! counters, passes of the poll core and reads of its rx rings; then it detaches. Every request
//! is answered and nothing of the app outlives it (`rdsd::poll::fuzzing`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdsd::poll::fuzzing::AppSession;
use std::cell::RefCell;

thread_local! {
    static SESSION: RefCell<AppSession> = RefCell::new(AppSession::new());
}

fuzz_target!(|data: &[u8]| {
    SESSION.with(|s| s.borrow_mut().run(data));
});
