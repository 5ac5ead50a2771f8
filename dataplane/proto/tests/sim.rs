//! Property tests over the simulated two-host network: exactly-once in-order delivery per
//! (socket, destination) with random chunking, delays, lazy acks and connection resets; and
//! no duplicate / no reordering / at most one gap across a peer restart; and exactly-once
//! across a crash of the receiving daemon when it restores its persisted receive state.
//!
//! Every property also draws how often the simulated I/O layer writes with the vectored
//! `poll_transmit_slices` (random frame count, random partial take) instead of the copying
//! `poll_transmit`: never, always, or a mix.

mod util;

use proptest::prelude::*;
use rds_proto::rng::SplitMix64;
use rds_proto::wire::MAX_PATHS;
use std::time::Duration;
use util::{Faults, Pair, Workload};

struct Scenario {
    seed: u64,
    npaths: u8,
    faults: Faults,
    per_flow: u32,
    /// (host, step at which it restarts)
    restart: Option<(usize, u32)>,
}

fn run(s: &Scenario) -> (Pair, Workload) {
    let mut faults = s.faults.clone();
    if s.restart.is_some() {
        // Across a restart, a message is unconfirmed only if its receiver never consumed it
        // (see the crate docs on the one residual duplicate window).
        faults.lose_acks_on_reset = false;
    }
    let mut pair = Pair::new(s.seed, s.npaths, faults);
    let mut workload = Workload::new(2, 2, s.per_flow);
    let mut restart = s.restart;
    let mut step = 0u32;
    while !workload.done() || restart.is_some() {
        if !workload.done() && pair.rng.below(3) == 0 {
            workload.send_one(&mut pair, 1500);
        }
        if let Some((host, at)) = restart {
            if step >= at {
                workload.note_restart(&pair, host);
                pair.restart(host, 0x7700_0000 + step);
                restart = None;
            }
        }
        pair.step();
        step += 1;
    }
    pair.reopen_after_restarts();
    assert!(pair.drive(400_000), "did not converge (now {:?})", pair.now);
    (pair, workload)
}

fn faults(
    reset_per_10k: u32,
    connect_fail_pct: u32,
    max_chunk: usize,
    max_delay_us: u64,
    ack_pct: u32,
    vectored_pct: u32,
) -> Faults {
    Faults {
        reset_prob: f64::from(reset_per_10k) / 10_000.0,
        connect_fail_prob: f64::from(connect_fail_pct) / 100.0,
        max_delay: Duration::from_micros(max_delay_us),
        max_chunk,
        ack_prob: f64::from(ack_pct) / 100.0,
        lose_acks_on_reset: true,
        vectored_prob: f64::from(vectored_pct) / 100.0,
    }
}

#[test]
fn clean_network_single_path() {
    let (pair, workload) = run(&Scenario {
        seed: 1,
        npaths: 1,
        faults: Faults::default(),
        per_flow: 40,
        restart: None,
    });
    workload.check_exactly_once(&pair);
    assert_eq!(pair.path_mismatches, 0);
}

#[test]
fn clean_network_four_paths() {
    let (pair, workload) = run(&Scenario {
        seed: 2,
        npaths: 4,
        faults: Faults::default(),
        per_flow: 40,
        restart: None,
    });
    workload.check_exactly_once(&pair);
    assert_eq!(pair.link_count(), 4);
    assert_eq!(pair.path_mismatches, 0);
}

#[test]
fn tiny_chunks_byte_by_byte() {
    let (pair, workload) = run(&Scenario {
        seed: 4,
        npaths: 2,
        faults: faults(0, 0, 3, 50, 50, 50),
        per_flow: 3,
        restart: None,
    });
    workload.check_exactly_once(&pair);
}

#[test]
fn heavy_resets_four_paths() {
    let (pair, workload) = run(&Scenario {
        seed: 3,
        npaths: 4,
        faults: faults(300, 10, 3000, 300, 20, 50),
        per_flow: 150,
        restart: None,
    });
    workload.check_exactly_once(&pair);
    assert!(pair.resets > 5, "only {} resets", pair.resets);
    let retransmits: u64 = pair
        .hosts
        .iter()
        .map(|h| h.conn.counters().tx_retransmits)
        .sum();
    assert!(retransmits > 0);
}

#[test]
fn restart_of_each_side() {
    for host in 0..2 {
        for seed in 0..4u64 {
            let (pair, workload) = run(&Scenario {
                seed: 100 + seed,
                npaths: 4,
                faults: faults(0, 0, 1500, 200, 30, 50),
                per_flow: 30,
                restart: Some((host, 150)),
            });
            workload.check_restart_semantics(&pair);
            let survivor = &pair.hosts[1 - host];
            assert_eq!(
                survivor.conn.counters().peer_restarts,
                1,
                "host {host} seed {seed}"
            );
        }
    }
}

/// Share of vectored writes: only the copying API, only the vectored one, or a mix.
fn vectored_pct() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), Just(100u32), 1u32..100]
}

/// Only vectored writes, with resets: gathered writes of many frames, cut anywhere, keep the
/// exactly-once property.
#[test]
fn vectored_writes_only_with_resets() {
    for seed in 0..4u64 {
        let (pair, workload) = run(&Scenario {
            seed: 200 + seed,
            npaths: [1u8, 2, 4, 8][seed as usize],
            faults: faults(150, 5, 2500, 300, 30, 100),
            per_flow: 60,
            restart: None,
        });
        workload.check_exactly_once(&pair);
        assert!(pair.partial_vectored_writes > 0, "seed {seed}");
        assert!(
            pair.max_gathered_slices > 8,
            "seed {seed}: at most {} slices gathered",
            pair.max_gathered_slices
        );
        assert!(pair.resets > 0, "seed {seed}");
    }
}

/// Cases per property; `SIM_CASES=2000 cargo test` for a soak.
fn sim_cases() -> u32 {
    std::env::var("SIM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: sim_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn exactly_once_in_order_without_faults(
        seed in any::<u64>(),
        npaths in 1u8..=8,
        max_chunk in 100usize..4000,
        max_delay_us in 0u64..500,
        ack_pct in 5u32..100,
        vectored_pct in vectored_pct(),
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(0, 0, max_chunk, max_delay_us, ack_pct, vectored_pct), per_flow: 15, restart: None,
        });
        workload.check_exactly_once(&pair);
    }

    #[test]
    fn exactly_once_in_order_with_resets(
        seed in any::<u64>(),
        npaths in prop::sample::select(vec![1u8, 2, 4, 8]),
        reset_per_10k in 1u32..150,
        connect_fail_pct in 0u32..30,
        max_chunk in 100usize..4000,
        max_delay_us in 0u64..500,
        ack_pct in 5u32..100,
        vectored_pct in vectored_pct(),
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(reset_per_10k, connect_fail_pct, max_chunk, max_delay_us, ack_pct, vectored_pct),
            per_flow: 15, restart: None,
        });
        workload.check_exactly_once(&pair);
    }

    #[test]
    fn restart_no_duplicate_no_reorder_one_gap(
        seed in any::<u64>(),
        npaths in prop::sample::select(vec![1u8, 2, 4, 8]),
        host in 0usize..2,
        restart_at in 0u32..300,
        reset_per_10k in 0u32..100,
        max_chunk in 100usize..4000,
        max_delay_us in 0u64..500,
        ack_pct in 5u32..100,
        vectored_pct in vectored_pct(),
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(reset_per_10k, 0, max_chunk, max_delay_us, ack_pct, vectored_pct),
            per_flow: 15, restart: Some((host, restart_at)),
        });
        workload.check_restart_semantics(&pair);
    }
}

// ----- RDS_CANCEL_SENT_TO under faults ------------------------------------------------------------

/// Random cancels in a faulty network, with or without `hold_cancelled_written` (a device
/// that reads written frames until they arrive, as RDMA's posted SENDs): per flow no duplicate
/// and no reordering, everything sent after the flow's last cancel delivered, every token
/// released exactly once (a held message by the device's progress, an acknowledgement or its
/// path going down, never twice).
fn run_with_cancels(seed: u64, npaths: u8, hold: bool, faults: Faults) -> (Pair, Workload) {
    let mut a = util::config(util::ADDR_A, util::ADDR_B, npaths, 0x1000_0001, seed ^ 0xa);
    let mut b = util::config(util::ADDR_B, util::ADDR_A, npaths, 0x2000_0002, seed ^ 0xb);
    a.hold_cancelled_written = hold;
    b.hold_cancelled_written = hold;
    let mut pair = Pair::with_configs(seed, a, b, faults);
    let mut workload = Workload::new(2, 2, 20);
    while !workload.done() {
        if pair.rng.below(3) == 0 {
            workload.send_one(&mut pair, 1500);
        }
        if pair.rng.below(25) == 0 {
            workload.cancel_one(&mut pair);
        }
        pair.step();
    }
    assert!(pair.drive(400_000), "did not converge (now {:?})", pair.now);
    (pair, workload)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: sim_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cancels_lose_only_what_they_name_and_release_everything_once(
        seed in any::<u64>(),
        npaths in prop::sample::select(vec![1u8, 2, 4, 8]),
        hold in any::<bool>(),
        reset_per_10k in 0u32..100,
        max_chunk in 100usize..4000,
        max_delay_us in 0u64..500,
        ack_pct in 5u32..100,
        vectored_pct in vectored_pct(),
    ) {
        let (pair, workload) = run_with_cancels(
            seed, npaths, hold, faults(reset_per_10k, 0, max_chunk, max_delay_us, ack_pct, vectored_pct),
        );
        workload.check_exactly_once_but_cancelled(&pair);
    }
}

// ----- crash of the receiving daemon, with and without restored receive state ---------------

/// One sender streams to the other host, whose daemon crashes once and comes back with a new
/// generation; optionally the sender's daemon crashes too.
#[derive(Debug, Clone)]
struct CrashCase {
    seed: u64,
    npaths: u8,
    /// The receiving host (0 is the active side).
    receiver: usize,
    /// Step at which the receiver crashes.
    crash_at: u32,
    /// Step at which the sender crashes as well.
    sender_crash_at: Option<u32>,
    faults: Faults,
}

impl CrashCase {
    fn from_seed(seed: u64, sender_crashes: bool) -> Self {
        let mut r = SplitMix64::new(seed ^ 0xc4a5_4000);
        let npaths = [1u8, 2, 4, 8][r.below(4) as usize];
        CrashCase {
            seed,
            npaths,
            receiver: r.below(2) as usize,
            crash_at: r.below(250) as u32,
            sender_crash_at: sender_crashes.then(|| r.below(300) as u32),
            faults: faults(
                r.below(60) as u32,
                r.below(10) as u32,
                100 + r.below(3900) as usize,
                r.below(500),
                5 + r.below(95) as u32,
                [0, 100, r.below(101) as u32][r.below(3) as usize],
            ),
        }
    }
}

/// Receiver generation after its crash, and sender generation after its own.
const RECEIVER_GEN2: u32 = 0x7e57_0001;
const SENDER_GEN2: u32 = 0x7e57_0002;

/// Runs a case; also returns the sender generation the receiver knew when the sender crashed.
fn run_crash(c: &CrashCase, restore: bool) -> (Pair, Workload, u32) {
    let mut pair = Pair::new(c.seed, c.npaths, c.faults.clone());
    let sender = 1 - c.receiver;
    let mut workload = Workload::one_way(sender, 2, 2, 20);
    let mut crash = Some(c.crash_at);
    let mut sender_crash = c.sender_crash_at;
    let mut step = 0u32;
    let mut known_before_sender_crash = 0;
    while !workload.done() || crash.is_some() || sender_crash.is_some() {
        if !workload.done() && pair.rng.below(3) == 0 {
            workload.send_one(&mut pair, 1500);
        }
        if crash.is_some_and(|at| step >= at) {
            pair.crash_restart(c.receiver, RECEIVER_GEN2, restore);
            crash = None;
        }
        if sender_crash.is_some_and(|at| step >= at) {
            known_before_sender_crash = pair.hosts[c.receiver].conn.peer_generation();
            workload.note_restart(&pair, sender);
            pair.crash_restart(sender, SENDER_GEN2, restore);
            sender_crash = None;
        }
        pair.step();
        step += 1;
    }
    pair.reopen_after_restarts();
    assert!(pair.drive(400_000), "{c:?}: did not converge");
    (pair, workload, known_before_sender_crash)
}

/// Runs a check, naming the case if it fails.
fn with_case(c: &CrashCase, check: impl FnOnce()) {
    if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)) {
        eprintln!("failing case: {c:?}");
        std::panic::resume_unwind(e);
    }
}

/// Cases for the crash loops; `SIM_CASES` scales them like the proptests.
fn crash_cases() -> u64 {
    u64::from(sim_cases()) * 5
}

/// The receiver restores what it delivered: the sender's resends of messages it had
/// delivered but whose acknowledgement died with the crash are dropped, everything else is
/// delivered. Exactly once and in order, over a few hundred random cases.
#[test]
fn crash_of_receiver_with_restored_rx_state_delivers_exactly_once() {
    let mut dup_drops = 0;
    for seed in 0..crash_cases() {
        let c = CrashCase::from_seed(seed, false);
        let (pair, workload, _) = run_crash(&c, true);
        with_case(&c, || workload.check_exactly_once(&pair));
        let receiver = &pair.hosts[c.receiver];
        assert_eq!(receiver.restarts, 1);
        dup_drops += receiver.conn.counters().rx_drop_dup_seq;
        // The engine's view matches what the application saw last on every path.
        let (generation, next) = receiver.conn.rx_state();
        assert_eq!(generation, pair.hosts[1 - c.receiver].config.generation);
        assert_eq!(generation, receiver.persisted_rx.peer_generation);
        for (path, &n) in next.iter().enumerate() {
            if let Some(last) = receiver.delivered.iter().rev().find(|d| d.path == path) {
                assert_eq!(n, last.sequence + 1, "{c:?}: path {path}");
            }
        }
    }
    assert!(
        dup_drops > 0,
        "no case exercised the restored duplicate rule"
    );
}

/// The contrast: the same crashes without restoring deliver some message twice, so the test
/// above can fail.
#[test]
fn crash_of_receiver_without_restore_delivers_duplicates() {
    let mut with_duplicates = 0;
    for seed in 0..crash_cases() / 5 {
        let c = CrashCase::from_seed(seed, false);
        let (pair, workload, _) = run_crash(&c, false);
        if workload.has_duplicate(&pair) {
            with_duplicates += 1;
            // The restored run of the very same case has none.
            let (pair, workload, _) = run_crash(&c, true);
            assert!(!workload.has_duplicate(&pair), "{c:?}");
        }
    }
    assert!(with_duplicates > 0, "no duplicate without restore");
}

/// Both daemons crash (in either order); the receiver restores its state. The sender's new
/// generation discards the restored numbers, so every message of the new sender is
/// delivered; nothing is duplicated or reordered, and only what the crashed sender still held
/// may be missing (one gap per flow).
#[test]
fn crash_of_both_sides_discards_restored_numbers_through_the_generation() {
    let mut discarded = 0;
    for seed in 0..crash_cases() / 2 {
        let c = CrashCase::from_seed(seed, true);
        let (pair, workload, known) = run_crash(&c, true);
        with_case(&c, || workload.check_restart_semantics(&pair));
        let delivered = workload.delivered(&pair);
        for (fi, flow) in workload.flows.iter().enumerate() {
            let got = delivered.get(&fi).cloned().unwrap_or_default();
            for &(id, incarnation) in &flow.sent {
                if incarnation == 1 {
                    assert!(
                        got.contains(&id),
                        "{c:?}: flow {fi} id {id} of the new sender"
                    );
                }
            }
        }
        let sender = &pair.hosts[1 - c.receiver];
        let receiver = &pair.hosts[c.receiver];
        assert_eq!(receiver.conn.rx_state().0, SENDER_GEN2, "{c:?}");
        if known == 0 {
            // The receiver never learned the old generation (see the crate's known limits).
            continue;
        }
        // The generation change reached the receiver's current incarnation or its store.
        let restored_then_discarded = c.crash_at < c.sender_crash_at.unwrap_or(0)
            && receiver.conn.counters().peer_restarts == 1;
        discarded += u32::from(restored_then_discarded);
        // The receiver never expects a number the new sender has not used yet.
        for path in 0..MAX_PATHS {
            assert!(
                receiver.conn.next_rx_seq(path) <= sender.conn.next_tx_seq(path),
                "{c:?}: path {path}: rx {} tx {}",
                receiver.conn.next_rx_seq(path),
                sender.conn.next_tx_seq(path)
            );
        }
    }
    assert!(
        discarded > 0,
        "no case restored numbers that a generation change discarded"
    );
}

/// Found by the property above (CI, 2026-11-27): the restart came after the last send, so the
/// restarted side held nothing but its probe and never connected; the harness waited for it
/// forever. The run now opens a restarted host's connection before it waits.
#[test]
fn restart_after_the_last_send_still_converges() {
    let (pair, workload) = run(&Scenario {
        seed: 17_922_685_037_231_316_655,
        npaths: 1,
        faults: faults(1, 0, 1045, 330, 84, 61),
        per_flow: 15,
        restart: Some((0, 293)),
    });
    workload.check_restart_semantics(&pair);
}

/// Found by a soak (`SIM_CASES=3000`): the sender restarts, then the receiver crashes after
/// TCP took the new sender's probe but before its engine read all of it, and restores numbers
/// of the old generation. The new sender's resends on path 0 go ahead of its fresh probe and
/// were judged against those numbers: two of its messages were dropped as duplicates. Resends
/// on path 0 now carry the sender's generation.
#[test]
fn resends_ahead_of_the_probe_announce_the_new_generation() {
    let c = CrashCase::from_seed(1231, true);
    let (pair, workload, _) = run_crash(&c, true);
    with_case(&c, || workload.check_restart_semantics(&pair));
    let receiver = &pair.hosts[c.receiver].conn;
    assert_eq!(receiver.counters().rx_drop_dup_seq, 0);
}
