//! The files rdsd finds on start-up (receive sequence numbers, bound ports) with any content:
//! a file of the wrong magic, version or slot count is reinitialised, a valid one is used, and
//! neither panics; after that, slots and ports behave.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdsd::poll::rebind::BoundPorts;
use rdsd::protocol::RxStateFile;
use std::time::Duration;

/// The receive-state file's header (magic "RDSDRXSQ", version 1, 1024 slots).
fn valid_header() -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(b"RDSDRXSQ");
    h[8..12].copy_from_slice(&1u32.to_le_bytes());
    h[12..16].copy_from_slice(&1024u32.to_le_bytes());
    h
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, body)) = data.split_first() else {
        return;
    };
    let mut file = body.to_vec();
    if ctl & 1 != 0 && file.len() >= 16 {
        file[..16].copy_from_slice(&valid_header());
    }
    let mut rx = RxStateFile::from_bytes(&file).expect("anonymous map");
    let used = rx.used();
    assert!(used <= 1024);
    // Connections from the input's tail: the same pair gets the same slot, every time.
    for (k, w) in body.chunks_exact(8).rev().take(16).enumerate() {
        let laddr = u32::from_le_bytes(w[..4].try_into().expect("4")) % 4;
        let faddr = u32::from_le_bytes(w[4..].try_into().expect("4")) % 8;
        let Some(i) = rx.slot_for(laddr, faddr) else {
            assert_eq!(rx.used(), 1024);
            continue;
        };
        assert!(i < 1024);
        assert_eq!(rx.slot_for(laddr, faddr), Some(i));
        let generation = w[0] as u32;
        let path = k % 8;
        let seq = u64::from_le_bytes(w.try_into().expect("8"));
        rx.delivered(i, path, generation, seq);
        let (g, seqs) = rx.load(i);
        if generation != 0 {
            assert_eq!(g, generation);
            assert_eq!(seqs[path], seq.saturating_add(1));
        }
    }

    let mut ports = BoundPorts::from_bytes(body, Duration::from_secs(3600)).expect("map");
    let expected: usize = body
        .iter()
        .take(8192)
        .map(|b| b.count_ones() as usize)
        .sum();
    assert_eq!(ports.expected(), expected);
    let mut closed = Vec::new();
    for w in body.chunks_exact(2).take(32) {
        let port = u16::from_le_bytes([w[0], w[1]]);
        let byte = body.get(usize::from(port) / 8).copied().unwrap_or(0);
        let was_bound = byte & (1 << (port % 8)) != 0 && !closed.contains(&port);
        assert_eq!(ports.holds(port), was_bound);
        ports.bound(port);
        ports.unbound(port);
        closed.push(port);
        assert!(!ports.holds(port), "closed again after the restart");
    }
});
