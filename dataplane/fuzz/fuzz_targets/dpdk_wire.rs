//! The DPDK transport's TCP accounting (`transport::dpdk::wire::Flows`) over frames in both
//! directions: any bytes, or TCP segments behind a valid Ethernet/IPv4 header so that the
//! flow logic is reached. Never a panic, and the counters stay consistent and only grow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdsd::transport::dpdk::wire::{Flows, TcpCounters};

fn as_array(c: &TcpCounters) -> [u64; 7] {
    [
        c.retransmits,
        c.fast_retransmits,
        c.rto_retransmits,
        c.rx_out_of_order,
        c.rx_duplicates,
        c.zero_window_rx,
        c.zero_window_tx,
    ]
}

fuzz_target!(|data: &[u8]| {
    let mut flows = Flows::default();
    let mut rest = data;
    let mut frame = Vec::with_capacity(256);
    while let Some((&ctl, tail)) = rest.split_first() {
        let len = usize::from(ctl & 0x3f).min(tail.len());
        let (bytes, tail) = tail.split_at(len);
        rest = tail;
        frame.clear();
        if ctl & 0x40 != 0 {
            // Ethernet (IPv4) + a 20-byte IPv4 header for TCP, two addresses that the first
            // payload byte picks (a few peers, so that flows repeat and collide).
            let peer = bytes.first().map_or(0, |b| b & 3);
            let total = (20 + bytes.len()) as u16;
            frame.extend_from_slice(&[0; 12]);
            frame.extend_from_slice(&0x0800u16.to_be_bytes());
            frame.extend_from_slice(&[0x45, 0]);
            frame.extend_from_slice(&total.to_be_bytes());
            frame.extend_from_slice(&[0, 0, 0x40, 0, 64, 6, 0, 0]);
            frame.extend_from_slice(&[10, 0, 0, 1 + peer]);
            frame.extend_from_slice(&[10, 0, 0, 9]);
        }
        frame.extend_from_slice(bytes);
        let before = as_array(&flows.counters());
        if ctl & 0x80 != 0 {
            flows.sent(&frame);
        } else {
            flows.received(&frame);
        }
        let c = flows.counters();
        assert_eq!(c.retransmits, c.fast_retransmits + c.rto_retransmits);
        let after = as_array(&c);
        assert!(
            before.iter().zip(&after).all(|(b, a)| b <= a),
            "counters only grow"
        );
    }
});
