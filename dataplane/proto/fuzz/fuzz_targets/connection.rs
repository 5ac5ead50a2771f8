//! Arbitrary peer bytes into an established passive Connection: must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rds_proto::wire::CongMap;
use rds_proto::{Config, Connection, Instant};
use std::net::Ipv4Addr;

fuzz_target!(|data: &[u8]| {
    let config = Config::new(Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 1), 7, 1);
    let mut conn: Connection<Vec<u8>> = Connection::new(config).expect("valid config");
    let now = Instant::ZERO;
    let _ = conn.handle_accepted(now, 40000);
    let map = CongMap::new();
    let mut buf = [0u8; 1024];
    for (i, chunk) in data.chunks(97).enumerate() {
        conn.handle_stream_data(now, i % 2, chunk, |d| assert!(d.payload.len() <= 1 << 20));
        while conn.poll_transmit(now, 0, &map, &mut buf) > 0 {}
        while conn.poll_event().is_some() {}
    }
});
