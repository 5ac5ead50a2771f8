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

/// Spawns a thread in `s` that receives `rounds` messages on `rx` (message `k` is `k`'s bytes,
/// from port `from`), counting them in `received`; returns its thread id.
fn spawn_receiver<'s>(
    s: &'s std::thread::Scope<'s, '_>,
    rx: &'s shm_api::Socket,
    from: u16,
    rounds: u64,
    received: &'s AtomicU64,
) -> u32 {
    let (tid_tx, tid_rx) = mpsc::channel();
    s.spawn(move || {
        tid_tx.send(gettid()).unwrap();
        let mut buf = [0u8; 64];
        for k in 0..rounds {
            let (n, src) = rx.recv_from(&mut buf).unwrap();
            assert_eq!((&buf[..n], src), (&k.to_le_bytes()[..], lo(from)));
            received.store(k + 1, Ordering::Release);
        }
    });
    tid_rx.recv().unwrap()
}

/// Sends message `k` to port `to` and waits until the receiver of [`spawn_receiver`] has it.
fn send_and_wait(tx: &shm_api::Socket, k: u64, to: u16, received: &AtomicU64) {
    tx.send_to(&k.to_le_bytes(), lo(to)).unwrap();
    wait_for(
        || received.load(Ordering::Acquire) > k,
        Duration::from_secs(60),
        "the message to arrive",
    );
}

/// The library's wake-up tuning for this process, set before any thread reads it.
fn tune_library() {
    // Called first in the only test of this binary, before it starts a thread or reads the
    // environment. The parallel wake-up is on by default only with 4 CPUs or more (CI has 2).
    std::env::set_var("RDS_WOKEN_SPIN_US", "200");
    // Receivers sleep at once instead of polling first: every wake-up is counted.
    std::env::set_var("RDS_RECV_SPIN_US", "0");
}

/// One test function, so that `tune_library` runs before any other thread exists.
#[test]
fn blocked_receivers_wake_up_once_and_early() {
    tune_library();
    a_sender_wakes_a_sleeping_receiver_alongside_its_parked_poll_thread();
    a_blocking_request_and_reply_costs_one_wake_up_per_message();
    a_send_with_no_fence_still_wakes_a_parked_poll_thread();
    sends_around_the_park_decision_are_never_missed();
    a_watching_poll_thread_stays_awake_while_a_receiver_sleeps();
}

/// `idle = "watch"`: no poll thread parks while an app thread sleeps in a receive, so a message
/// for it needs one wake-up (the poll thread's futex wake of the receiver), not two. Five
/// rounds of "receiver asleep, every poll thread has withheld its park since (counted), then
/// withholds again in a window where no park is counted; one message sent": no sender found a
/// poll thread parked (`by_sender`, the parallel wake-up, stays 0) and no sleep ran out its
/// slice. Once nobody sleeps in a receive, the poll threads park again.
fn a_watching_poll_thread_stays_awake_while_a_receiver_sleeps() {
    let cfg = rdsd_tests::config_file("idle = \"watch\"\nspin_us = 2\nyield_us = 500\n");
    let d = Daemon::start(&["--config", cfg.to_str().unwrap()]);
    let app = d.attach();
    let rx = app.socket().unwrap();
    rx.bind(lo(9341)).unwrap();
    // A failed round must not leave the receiver asleep for ever (the scope waits for it).
    rx.set_recv_timeout(Some(Duration::from_secs(120))).unwrap();
    let tx = app.socket().unwrap();
    tx.bind(lo(9342)).unwrap();
    const ROUNDS: u64 = 5;
    let threads = poll_threads() as u64;
    let withheld_by = |n: u64, what: &str| {
        let w = d.exact_stat("parks_withheld");
        wait_for(
            || d.exact_stat("parks_withheld") >= w + n,
            Duration::from_secs(60),
            what,
        );
    };
    let before = shm_api::recv_wakeups();
    let received = AtomicU64::new(0);
    let mut parked_while_asleep = 0;
    std::thread::scope(|s| {
        let tid = spawn_receiver(s, &rx, 9342, ROUNDS, &received);
        let me = std::process::id();
        for k in 0..ROUNDS {
            wait_for(
                || wait_channel(me, tid).contains("futex"),
                Duration::from_secs(60),
                "receiver asleep",
            );
            // A poll thread that looked before the receiver slept may have parked; each
            // counter read wakes them all, and from the first withheld park on, none parks.
            withheld_by(2 * threads, "parks withheld for the sleeping receiver");
            let parks = d.exact_stat("poll_parks");
            withheld_by(2 * threads, "parks withheld again");
            parked_while_asleep += d.exact_stat("poll_parks") - parks;
            send_and_wait(&tx, k, 9341, &received);
        }
    });
    let after = shm_api::recv_wakeups();
    assert_eq!(
        parked_while_asleep, 0,
        "a poll thread parked while the receiver slept"
    );
    assert_eq!(
        after.by_sender - before.by_sender,
        0,
        "a sender found a poll thread parked ({after:?})"
    );
    assert_eq!(after.missed - before.missed, 0, "a sleep ran out its slice");
    wait_for(
        || all_poll_threads_parked(&d),
        Duration::from_secs(60),
        "poll threads parked once nobody sleeps in a receive",
    );
}

/// The window the light doorbell leaves to the membarrier: a send published while the poll
/// thread decides to park. rdsd parks after 0.5 ms of idle here; 400 sends come 0 to 1.5 ms
/// apart (a fixed pseudo-random sequence), to a receiver that polls without sleeping. A
/// doorbell missed there would leave the poll thread parked until its 100 ms safety timeout,
/// and the pass after it would find the message: `parks_doorbell_missed` counts exactly that.
fn sends_around_the_park_decision_are_never_missed() {
    let cfg = rdsd_tests::config_file("spin_us = 2\nyield_us = 500\n");
    let d = Daemon::start(&["--config", cfg.to_str().unwrap()]);
    let (_app, rx, tx) = light_doorbell_app(&d, 9331);
    let parks = d.exact_stat("poll_parks");
    let mut buf = [0u8; 64];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for k in 0u64..400 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_micros(x % 1500));
        tx.send_to(&k.to_le_bytes(), lo(9331)).unwrap();
        while rx.recv_msg(&mut buf, POLLING).is_err() {
            std::thread::yield_now();
        }
        assert_eq!(&buf[..8], &k.to_le_bytes());
    }
    let parked = d.exact_stat("poll_parks") - parks;
    let missed = d.exact_stat("parks_doorbell_missed");
    eprintln!("400 sends around the park decision: {parked} parks, {missed} doorbells missed");
    assert!(parked > 0, "the poll thread parked between sends");
    assert_eq!(
        missed, 0,
        "a parked poll thread found a message nobody rang for"
    );
}

/// A receive that never sleeps in the library (and so never rings a doorbell itself).
const POLLING: shm_api::RecvFlags = shm_api::RecvFlags {
    peek: false,
    trunc: false,
    dontwait: true,
};

/// An app of `d` whose sends check the sleep flag with no fence (rdsd in backoff mode, a
/// kernel with membarrier), with a receiver bound to `port` and a sender to `port + 1`.
fn light_doorbell_app(d: &Daemon, port: u16) -> (shm_api::Rdsd, shm_api::Socket, shm_api::Socket) {
    let app = d.attach();
    assert!(
        app.light_doorbell(),
        "rdsd in backoff mode and a kernel with membarrier: sends skip the fence"
    );
    let rx = app.socket().unwrap();
    rx.bind(lo(port)).unwrap();
    let tx = app.socket().unwrap();
    tx.bind(lo(port + 1)).unwrap();
    (app, rx, tx)
}

/// A send checks its poll thread's sleep flag with no fence of its own (the poll thread makes
/// a global membarrier between raising the flag and its last look, `park_barrier`), and a
/// parked poll thread is still woken by every send: 40 rounds of "all poll threads parked,
/// one message sent, received by a receiver that never sleeps in rdsd's library (it polls
/// with MSG_DONTWAIT), so only the sender's doorbell can wake the poll thread". A doorbell the
/// sender failed to ring leaves the poll thread parked with no timeout: the round never ends.
fn a_send_with_no_fence_still_wakes_a_parked_poll_thread() {
    let d = Daemon::start(&[]);
    let (_app, rx, tx) = light_doorbell_app(&d, 9321);
    let mut buf = [0u8; 64];
    for k in 0u64..40 {
        wait_for(
            || all_poll_threads_parked(&d),
            Duration::from_secs(60),
            "poll threads parked",
        );
        tx.send_to(&k.to_le_bytes(), lo(9321)).unwrap();
        wait_for(
            || rx.recv_msg(&mut buf, POLLING).is_ok(),
            Duration::from_secs(20),
            "the message, delivered by a poll thread the send woke",
        );
        assert_eq!(&buf[..8], &k.to_le_bytes());
    }
    assert_eq!(d.exact_stat("park_barrier_failures"), 0);
}

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
        let tid = spawn_receiver(s, &rx, 9302, ROUNDS, &received);
        let me = std::process::id();
        for k in 0..ROUNDS {
            // Both asleep: the receiver on its futexes, every poll thread in poll(2).
            wait_for(
                || wait_channel(me, tid).contains("futex") && all_poll_threads_parked(&d),
                Duration::from_secs(60),
                "receiver asleep and poll threads parked",
            );
            // The next round starts from a sleeping receiver again.
            send_and_wait(&tx, k, 9301, &received);
        }
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

/// A release of send-buffer bytes wakes only threads blocked in a send: a request/reply pair
/// of blocking sockets costs rdsd at most one futex wake-up per message (before the receivers
/// and senders were told apart, each side was also woken when its request was released).
fn a_blocking_request_and_reply_costs_one_wake_up_per_message() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let (a, b) = (app.socket().unwrap(), app.socket().unwrap());
    a.bind(lo(9311)).unwrap();
    b.bind(lo(9312)).unwrap();
    const ROUND_TRIPS: u64 = 1000;
    let before = d.exact_stat("app_wakeups");
    let missed_before = shm_api::recv_wakeups().missed;
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut buf = [0u8; 64];
            for _ in 0..ROUND_TRIPS {
                let (n, from) = b.recv_from(&mut buf).unwrap();
                b.send_to(&buf[..n], from).unwrap();
            }
        });
        let mut buf = [0u8; 64];
        for k in 0..ROUND_TRIPS {
            a.send_to(&k.to_le_bytes(), lo(9312)).unwrap();
            let (n, _) = a.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], &k.to_le_bytes()[..]);
        }
    });
    let wakeups = d.exact_stat("app_wakeups") - before;
    let messages = 2 * ROUND_TRIPS;
    let missed = shm_api::recv_wakeups().missed - missed_before;
    eprintln!("{wakeups} wake-ups for {messages} messages, {missed} missed");
    // rdsd reads `waiters` after one fence per pass, not one per publish: a sleeper is still
    // woken every time, never by its 100 ms slice running out.
    assert_eq!(
        missed, 0,
        "sleeps that ran out their slice with the message there"
    );
    assert!(
        wakeups <= messages,
        "{wakeups} futex wake-ups for {messages} messages: a release woke a receiver"
    );
}
