//! Property tests over the simulated two-host network: exactly-once in-order delivery per
//! (socket, destination) with random chunking, delays, lazy acks and connection resets; and
//! no duplicate / no reordering / at most one gap across a peer restart.

mod util;

use proptest::prelude::*;
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
    assert!(pair.drive(400_000), "did not converge (now {:?})", pair.now);
    (pair, workload)
}

fn faults(
    reset_per_10k: u32,
    connect_fail_pct: u32,
    max_chunk: usize,
    max_delay_us: u64,
    ack_pct: u32,
) -> Faults {
    Faults {
        reset_prob: f64::from(reset_per_10k) / 10_000.0,
        connect_fail_prob: f64::from(connect_fail_pct) / 100.0,
        max_delay: Duration::from_micros(max_delay_us),
        max_chunk,
        ack_prob: f64::from(ack_pct) / 100.0,
        lose_acks_on_reset: true,
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
        faults: faults(0, 0, 3, 50, 50),
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
        faults: faults(300, 10, 3000, 300, 20),
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
                faults: faults(0, 0, 1500, 200, 30),
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
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(0, 0, max_chunk, max_delay_us, ack_pct), per_flow: 15, restart: None,
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
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(reset_per_10k, connect_fail_pct, max_chunk, max_delay_us, ack_pct),
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
    ) {
        let (pair, workload) = run(&Scenario {
            seed, npaths, faults: faults(reset_per_10k, 0, max_chunk, max_delay_us, ack_pct),
            per_flow: 15, restart: Some((host, restart_at)),
        });
        workload.check_restart_semantics(&pair);
    }
}
