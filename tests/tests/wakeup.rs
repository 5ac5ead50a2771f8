//! Waking a receiver that sleeps in `recv` while its poll thread is parked (issue 18, item 3).
//!
//! The poll thread must run to deliver, so the receiver needs two wake-ups: the poll thread's
//! and its own. The library makes them parallel instead of serial: a sender that finds its
//! poll thread parked rings the doorbell *and* wakes the receivers that sleep on that thread's
//! sleep flag; they then spin for the delivery. This file is its own test binary because it
//! reads the process-wide wake-up counters of shm-api.

use rdsd_tests::{lo, poll_threads, wait_channel, wait_for, Daemon};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// True while every `rdsd-poll-*` thread of `d` sleeps in poll(2), i.e. is parked.
fn all_poll_threads_parked(d: &Daemon) -> bool {
    let pid = d.pid();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("rdsd's tasks");
    let mut parked = 0;
    for t in tasks.filter_map(Result::ok) {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.starts_with("rdsd-poll-") {
            let tid: u32 = t.file_name().to_str().unwrap().parse().unwrap();
            if !wait_channel(pid, tid).contains("poll") {
                return false;
            }
            parked += 1;
        }
    }
    parked == poll_threads()
}

fn gettid() -> u32 {
    // SAFETY: gettid takes no argument and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

#[test]
fn a_sender_wakes_a_sleeping_receiver_alongside_its_parked_poll_thread() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let rx = app.socket().unwrap();
    rx.bind(lo(9301)).unwrap();
    let tx = app.socket().unwrap();
    tx.bind(lo(9302)).unwrap();
    const ROUNDS: u64 = 10;
    let before = shm_api::recv_wakeups();
    let received = AtomicU64::new(0);
    std::thread::scope(|s| {
        let (tid_tx, tid_rx) = mpsc::channel();
        let received = &received;
        let receiver = s.spawn(move || {
            tid_tx.send(gettid()).unwrap();
            let mut buf = [0u8; 64];
            for k in 0..ROUNDS {
                let (n, from) = rx.recv_from(&mut buf).unwrap();
                assert_eq!((&buf[..n], from), (&k.to_le_bytes()[..], lo(9302)));
                received.store(k + 1, Ordering::Release);
            }
        });
        let tid = tid_rx.recv().unwrap();
        let me = std::process::id();
        for k in 0..ROUNDS {
            // Both asleep: the receiver on its futexes, every poll thread in poll(2).
            wait_for(
                || wait_channel(me, tid).contains("futex") && all_poll_threads_parked(&d),
                Duration::from_secs(60),
                "receiver asleep and poll threads parked",
            );
            tx.send_to(&k.to_le_bytes(), lo(9301)).unwrap();
            // The next round starts from a sleeping receiver again.
            wait_for(
                || received.load(Ordering::Acquire) > k,
                Duration::from_secs(60),
                "the message to arrive",
            );
        }
        receiver.join().unwrap();
    });
    let after = shm_api::recv_wakeups();
    let by_sender = after.by_sender - before.by_sender;
    // A round can lose the race to the receiver's 100 ms liveness slice (it rings the
    // doorbell, and a poll thread that is awake is not woken by the sender): allow two.
    assert!(
        by_sender >= ROUNDS - 2,
        "{by_sender} of {ROUNDS} receives were woken by the sender ({after:?})"
    );
}
