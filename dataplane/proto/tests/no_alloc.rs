//! The transmit path allocates nothing in steady state: with a payload type that owns no heap
//! memory, sending, vectored polls of many frames, partial writes, acknowledgements and
//! draining the release events reuse the capacity the first rounds grew.

use rds_proto::wire::CongMap;
use rds_proto::{Config, Connection, Event, Instant};
use std::net::Ipv4Addr;

#[path = "../../src/quiet/alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations;

#[global_allocator]
static ALLOC: counting_alloc::CountingAlloc = counting_alloc::CountingAlloc;

static PAYLOAD: [u8; 64] = [0x5a; 64];

/// One round: 40 messages, written with vectored polls of up to 32 frames of which the socket
/// takes an awkward number of bytes each time, then acknowledged. Returns the releases seen.
fn round(conn: &mut Connection<&'static [u8]>, map: &CongMap, token: &mut u64) -> usize {
    let now = Instant::ZERO;
    for _ in 0..40 {
        *token += 1;
        conn.send(now, 7, 10, &PAYLOAD[..], *token).unwrap();
    }
    let mut take = 1000;
    loop {
        let mut slices: [&[u8]; 64] = [&[]; 64];
        let got = conn.poll_transmit_slices(now, 0, map, 32, &mut slices);
        if got.bytes == 0 {
            break;
        }
        let n = take.min(got.bytes);
        conn.advance_transmit(0, n);
        take = take * 7 % 2500 + 1;
    }
    conn.handle_acked(0, conn.stream_offset(0));
    let mut released = 0;
    while let Some(event) = conn.poll_event() {
        if matches!(event, Event::Released { .. }) {
            released += 1;
        }
    }
    released
}

/// Runs the probe exchange with a peer, so that TCP's acknowledgements on path 0 release
/// messages (before the peer's pong they are held).
fn handshake(conn: &mut Connection<&'static [u8]>, map: &CongMap) {
    let now = Instant::ZERO;
    let mut config = Config::new(Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 1), 7, 1);
    // One path, so that every message stays on path 0.
    config.npaths = 1;
    let mut peer: Connection<&'static [u8]> = Connection::new(config).unwrap();
    peer.handle_accepted(now, 40000).unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let n = conn.poll_transmit(now, 0, map, &mut buf);
    peer.handle_stream_data(now, 0, &buf[..n], |_| {});
    let n = peer.poll_transmit(now, 0, map, &mut buf);
    conn.handle_stream_data(now, 0, &buf[..n], |_| {});
    assert_eq!(conn.counters().probe_pongs_received, 1);
}

#[test]
fn steady_state_vectored_transmit_allocates_nothing() {
    let now = Instant::ZERO;
    let config = Config::new(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), 7, 1);
    let mut conn: Connection<&'static [u8]> = Connection::new(config).unwrap();
    conn.open(now);
    while conn.poll_event().is_some() {}
    conn.handle_connected(now, 0).unwrap();
    let map = CongMap::new();
    handshake(&mut conn, &map);
    let mut token = 0;
    for _ in 0..5 {
        round(&mut conn, &map, &mut token);
    }
    let before = allocations();
    let mut released = 0;
    for _ in 0..50 {
        released += round(&mut conn, &map, &mut token);
    }
    let allocated = allocations() - before;
    assert_eq!(released, 50 * 40, "{:?}", conn.counters());
    assert_eq!(allocated, 0, "allocations in steady state");
}
