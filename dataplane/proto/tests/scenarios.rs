//! Targeted behaviours of the general layer: handshake, ping/pong, congestion maps, malformed
//! input, cancel, duplicate rule, retransmission, partial writes, backoff, doorbell, restored
//! receive state, and the vectored transmit API (gathered frames, partial writes, cancel and
//! path down with several frames started).

mod util;

use rds_proto::wire::{
    flags, CongMap, Deframer, ExtHeader, ExtHeaders, HeaderPacket, HeaderRepr, CONG_MAP_BYTES,
    HEADER_LEN, MAX_MSG_SIZE, MAX_PATHS,
};
use rds_proto::{
    AcceptError, Config, ConfigError, Connection, Event, Instant, PathChoice, PathState, SendError,
    SendFlags,
};
use std::time::Duration;
use util::{check_work_mask, Faults, Pair, Workload, ADDR_A, ADDR_B};

const GEN_A: u32 = 0xaaaa_0001;
const GEN_B: u32 = 0xbbbb_0002;

fn conn(
    local: std::net::Ipv4Addr,
    peer: std::net::Ipv4Addr,
    generation: u32,
) -> Connection<Vec<u8>> {
    Connection::new(Config::new(local, peer, generation, 42)).unwrap()
}

fn events(c: &mut Connection<Vec<u8>>) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

/// Everything the engine has to send on `path`, as bytes.
fn drain(c: &mut Connection<Vec<u8>>, now: Instant, path: usize, map: &CongMap) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = c.poll_transmit(now, path, map, &mut buf);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&buf[..n]);
    }
}

fn frames(stream: &[u8]) -> Vec<(HeaderRepr, Vec<u8>)> {
    let mut d = Deframer::new();
    let mut out = Vec::new();
    d.feed(stream, |f| out.push((f.header, f.payload.to_vec())))
        .unwrap();
    assert!(d.is_idle(), "stream ends mid-message");
    out
}

fn message(seq: u64, sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let h = HeaderRepr {
        sequence: seq,
        len: payload.len() as u32,
        sport,
        dport,
        flags,
        ..Default::default()
    };
    let mut v = h.to_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

/// Active side A with path 0 up.
fn active_up(now: Instant) -> Connection<Vec<u8>> {
    let mut a = conn(ADDR_A, ADDR_B, GEN_A);
    a.open(now);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    a.handle_connected(now, 0).unwrap();
    a
}

/// Active side A with path 0 up and the peer's probe pong received on it, so that TCP's
/// acknowledgements on path 0 release messages (before the pong they are held).
fn active_attached(now: Instant) -> Connection<Vec<u8>> {
    let mut a = active_up(now);
    attach(&mut a);
    let _ = events(&mut a);
    a
}

/// Feeds a probe pong (no NPATHS: one path) on path 0.
fn attach(a: &mut Connection<Vec<u8>>) {
    let pongs = a.counters().probe_pongs_received;
    a.handle_stream_data(Instant::ZERO, 0, &message(0, 0, 1, 0, &[]), |_| {
        panic!("a probe pong is not delivered")
    });
    assert_eq!(a.counters().probe_pongs_received, pongs + 1);
}

/// Passive side B with path 0 up (accepted).
fn passive_up(now: Instant) -> Connection<Vec<u8>> {
    let mut b = conn(ADDR_B, ADDR_A, GEN_B);
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    b
}

fn established(faults: Faults, npaths: u8) -> Pair {
    let mut pair = Pair::new(9, npaths, faults);
    let now = pair.now;
    pair.conn(0).open(now);
    assert!(pair.drive(10_000));
    pair
}

#[test]
fn config_and_send_errors() {
    let mut c = Config::new(ADDR_A, ADDR_B, 1, 0);
    c.npaths = 9;
    assert_eq!(
        Connection::<Vec<u8>>::new(c).err(),
        Some(ConfigError::BadPathCount(9))
    );
    assert_eq!(
        Connection::<Vec<u8>>::new(Config::new(ADDR_A, ADDR_A, 1, 0)).err(),
        Some(ConfigError::SameAddress)
    );
    assert_eq!(
        Connection::<Vec<u8>>::new(Config::new(ADDR_A, ADDR_B, 0, 0)).err(),
        Some(ConfigError::ZeroGeneration)
    );
    let mut c = Config::new(ADDR_B, ADDR_A, 1, 0);
    assert_eq!(c.doorbell_min, Duration::from_millis(10));
    c.doorbell_min = Duration::ZERO;
    assert_eq!(c.validate(), Err(ConfigError::BadDoorbell));
    c.doorbell_min = c.reconnect_max + Duration::from_nanos(1);
    assert_eq!(c.validate(), Err(ConfigError::BadDoorbell));
    c.doorbell_min = c.reconnect_max;
    assert_eq!(c.validate(), Ok(()));
    let mut a = conn(ADDR_A, ADDR_B, GEN_A);
    let now = Instant::ZERO;
    let big = vec![0u8; MAX_MSG_SIZE as usize + 1];
    assert_eq!(
        a.send(now, 5, 6, big, 1),
        Err(SendError::TooLarge {
            len: MAX_MSG_SIZE as usize + 1
        })
    );
    assert_eq!(a.send(now, 1, 6, vec![], 1), Err(SendError::ReservedPort));
    assert_eq!(a.send(now, 0, 6, vec![], 1), Err(SendError::ReservedPort));
    assert_eq!(
        a.send(now, 5, 6, vec![0u8; MAX_MSG_SIZE as usize], 1),
        Ok(0)
    );
}

#[test]
fn new_path_starts_with_congestion_map_then_probe() {
    let now = Instant::ZERO;
    let mut a = active_up(now);
    let mut map = CongMap::new();
    map.set(77);
    let out = frames(&drain(&mut a, now, 0, &map));
    assert_eq!(out.len(), 2);
    let (h, payload) = &out[0];
    assert_eq!(h.flags, flags::CONG_BITMAP);
    assert_eq!(
        (h.sequence, h.len, h.sport, h.dport),
        (0, CONG_MAP_BYTES as u32, 0, 0)
    );
    assert_eq!(payload.as_slice(), &map.as_bytes()[..]);
    let (probe, _) = &out[1];
    assert_eq!(
        (
            probe.sequence,
            probe.sport,
            probe.dport,
            probe.len,
            probe.flags
        ),
        (1, 1, 0, 0, 0)
    );
    let ext: Vec<_> = probe.exthdr.iter().collect();
    assert_eq!(ext, vec![ExtHeader::NPaths(8), ExtHeader::GenNum(GEN_A)]);
    assert!(!a.has_pending_transmit(0));
}

#[test]
fn probe_handshake_negotiates_min_npaths_and_generations() {
    let mut a = util::config(ADDR_A, ADDR_B, 4, GEN_A, 1);
    a.sport_idx = true;
    let b = util::config(ADDR_B, ADDR_A, 2, GEN_B, 2);
    let mut pair = Pair::with_configs(3, a, b, Faults::default());
    let now = pair.now;
    pair.conn(0).open(now);
    assert!(pair.drive(10_000));
    for host in 0..2 {
        let c = &pair.hosts[host].conn;
        assert_eq!(c.npaths(), Some(2), "host {host}");
        // The active side probes once more when path 1 comes up (its data waits for the pong).
        let (pings, pongs) = if host == 0 { (1, 2) } else { (2, 1) };
        assert_eq!(c.counters().probe_pings_received, pings, "host {host}");
        assert_eq!(c.counters().probe_pongs_received, pongs, "host {host}");
        assert!(pair.hosts[host]
            .events
            .contains(&Event::PathsNegotiated { npaths: 2 }));
    }
    assert_eq!(pair.hosts[0].conn.peer_generation(), GEN_B);
    assert_eq!(pair.hosts[1].conn.peer_generation(), GEN_A);
    assert_eq!(pair.link_count(), 2);
    assert_eq!(pair.hosts[0].conn.path_state(1), PathState::Up);
    assert_eq!(pair.hosts[0].conn.path_state(2), PathState::Down);
    assert_eq!(pair.path_mismatches, 0);
}

#[test]
fn probe_from_peer_is_answered_with_pong_carrying_npaths_and_gen() {
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    let mut ext = rds_proto::wire::ExtHeaders::new();
    ext.push(ExtHeader::NPaths(8)).unwrap();
    ext.push(ExtHeader::GenNum(0x1234)).unwrap();
    let ping = HeaderRepr {
        sequence: 1,
        sport: 1,
        dport: 0,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &ping.to_bytes(), |_| panic!("probe delivered"));
    assert_eq!(b.peer_generation(), 0x1234);
    assert_eq!(b.npaths(), Some(8));
    let out = frames(&drain(&mut b, now, 0, &CongMap::new()));
    // cong map, our probe ping, then the pong.
    let pong = &out.last().unwrap().0;
    assert_eq!((pong.sport, pong.dport, pong.len), (0, 1, 0));
    assert_eq!(pong.exthdr.find(5), Some(ExtHeader::NPaths(8)));
    assert_eq!(pong.exthdr.find(6), Some(ExtHeader::GenNum(GEN_B)));
    // A legacy peer without NPATHS means one path.
    let mut c = passive_up(now);
    let ping = HeaderRepr {
        sequence: 1,
        sport: 1,
        dport: 0,
        ..Default::default()
    };
    c.handle_stream_data(now, 0, &ping.to_bytes(), |_| {});
    assert_eq!(c.npaths(), Some(1));
}

#[test]
fn ping_is_answered_with_pong_and_pong_is_delivered() {
    let mut pair = established(Faults::default(), 1);
    pair.send(0, 5000, 0, vec![], 1);
    assert!(pair.drive(10_000));
    assert_eq!(pair.hosts[1].conn.counters().pings_received, 1);
    assert!(
        pair.hosts[1].delivered.is_empty(),
        "pings are not delivered"
    );
    let got = &pair.hosts[0].delivered;
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].sport, got[0].dport, got[0].payload.len()),
        (0, 5000, 0)
    );
    assert_eq!(pair.hosts[0].conn.counters().pongs_received, 1);
    // A ping from port 0 is ignored.
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    b.handle_stream_data(now, 0, &message(3, 0, 0, 0, b""), |_| panic!());
    assert_eq!(b.counters().rx_drop_unknown, 1);
}

#[test]
fn congestion_map_applied_then_cleared() {
    let mut pair = established(Faults::default(), 2);
    let sent_before = pair.hosts[1].conn.counters().cong_map_sent;
    pair.hosts[1].local_map.set(3000);
    pair.conn(1).local_congestion_changed();
    assert!(pair.drive(10_000));
    assert!(pair.hosts[0].conn.peer_port_congested(3000));
    assert!(!pair.hosts[0].conn.peer_port_congested(3001));
    // One map per connection, on one of the two up paths.
    assert_eq!(pair.hosts[1].conn.counters().cong_map_sent, sent_before + 1);
    assert!(!pair.hosts[0]
        .events
        .iter()
        .any(|e| matches!(e, Event::CongestionChanged { .. })));

    pair.hosts[1].local_map.clear(3000);
    pair.conn(1).local_congestion_changed();
    assert!(pair.drive(10_000));
    assert!(!pair.hosts[0].conn.peer_port_congested(3000));
    assert!(pair.hosts[0].events.contains(&Event::CongestionChanged {
        uncongested_mask: 1 << (3000 % 64)
    }));

    // Wrong length: consumed and ignored, stream stays up.
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    let mut bogus = message(0, 0, 0, flags::CONG_BITMAP, &[0xff; 100]);
    bogus.extend(message(9, 5, 6, 0, b"after"));
    let mut got = Vec::new();
    b.handle_stream_data(now, 0, &bogus, |d| got.push(d.payload.to_vec()));
    assert_eq!(got, vec![b"after".to_vec()]);
    assert_eq!(b.counters().rx_drop_bad_header, 1);
    assert!(!b.peer_port_congested(0));
}

/// Kernel wire economy (spec §8): one pending map per connection, not one per path.
#[test]
fn congestion_map_goes_out_once_per_connection_not_per_path() {
    let mut pair = established(Faults::default(), 8);
    assert_eq!(pair.link_count(), 8);
    for host in 0..2 {
        for path in 0..MAX_PATHS {
            assert_eq!(pair.hosts[host].conn.path_state(path), PathState::Up);
        }
    }
    // N changes, each followed by quiescence: at most N maps, and the peer tracks each one.
    const N: u64 = 6;
    let before = pair.hosts[1].conn.counters().cong_map_sent;
    for i in 0..N {
        let port = 3000 + i as u16;
        if i % 3 == 2 {
            pair.hosts[1].local_map.clear(port - 1);
        } else {
            pair.hosts[1].local_map.set(port);
        }
        pair.conn(1).local_congestion_changed();
        assert!(pair.drive(10_000));
        assert!(
            pair.hosts[0].conn.peer_congestion_map() == &pair.hosts[1].local_map,
            "peer map after change {i}"
        );
    }
    let sent = pair.hosts[1].conn.counters().cong_map_sent - before;
    assert!(
        sent > 0 && sent <= N,
        "{sent} maps for {N} changes on 8 paths"
    );
    assert_eq!(
        pair.hosts[0].conn.counters().cong_map_received,
        pair.hosts[1].conn.counters().cong_map_sent
    );

    // Several changes before any transmit pass: exactly one map, the latest.
    let before = pair.hosts[1].conn.counters().cong_map_sent;
    for port in [4000u16, 4001, 4002, 4003] {
        pair.hosts[1].local_map.set(port);
        pair.conn(1).local_congestion_changed();
    }
    for path in 0..MAX_PATHS {
        assert!(
            pair.hosts[1].conn.has_pending_transmit(path),
            "the connection's pending map shows on up path {path}"
        );
    }
    assert!(pair.drive(10_000));
    assert_eq!(pair.hosts[1].conn.counters().cong_map_sent, before + 1);
    assert!(pair.hosts[0].conn.peer_port_congested(4003));
    assert!(pair.hosts[0].conn.peer_congestion_map() == &pair.hosts[1].local_map);
}

/// Passive side with paths 0 and 1 up (the peer's pong negotiated 2 paths with SPORT_IDX).
fn passive_two_paths(now: Instant) -> Connection<Vec<u8>> {
    let mut b = passive_up(now);
    let mut ext = ExtHeaders::new();
    ext.push(ExtHeader::NPaths(2)).unwrap();
    ext.push(ExtHeader::GenNum(GEN_A)).unwrap();
    ext.push(ExtHeader::SportIdx(0)).unwrap();
    let pong = HeaderRepr {
        sequence: 1,
        sport: 0,
        dport: 1,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &pong.to_bytes(), |_| panic!("pong delivered"));
    assert_eq!(b.handle_accepted(now, 40001), Ok(1));
    let _ = events(&mut b);
    b
}

/// The peer's probe pong on path 0, answering the latest probe ping we wrote there.
fn answer_probe(b: &mut Connection<Vec<u8>>, now: Instant) {
    b.handle_stream_data(now, 0, &probe_pong(2, 2, GEN_A), |_| {
        panic!("pong delivered")
    });
}

#[test]
fn paths_with_work_follows_queues_frames_acks_and_paths() {
    let now = Instant::ZERO;
    let mut b = passive_two_paths(now);
    let map = CongMap::new();
    assert_eq!(
        check_work_mask(&b),
        u8::MAX,
        "a pending map may go on any path"
    );
    drain(&mut b, now, 0, &map);
    drain(&mut b, now, 1, &map);
    assert_eq!(
        check_work_mask(&b),
        0b01,
        "path 0's probe is unacknowledged"
    );
    b.handle_acked(0, b.stream_offset(0));
    answer_probe(&mut b, now);
    assert_eq!(check_work_mask(&b), 0);

    // Queued on two paths, then one frame partly written on path 1 (started, unacknowledged).
    let s0 = (2000..).find(|&p| b.route(p, 3000) == 0).unwrap();
    let s1 = (2000..).find(|&p| b.route(p, 3000) == 1).unwrap();
    b.send(now, s0, 7, vec![1; 100], 1).unwrap();
    b.send(now, s1, 7, vec![2; 100], 2).unwrap();
    assert_eq!(check_work_mask(&b), 0b11);
    let chunk = b.poll_transmit_chunk(now, 1, &map).unwrap().len();
    b.advance_transmit(1, chunk - 10);
    assert_eq!(check_work_mask(&b), 0b11);
    b.advance_transmit(1, 10);
    b.handle_acked(1, b.stream_offset(1));
    assert_eq!(check_work_mask(&b), 0b01, "path 1 done");

    // A cancel empties path 0's queue.
    assert_eq!(b.cancel_socket(s0), 1);
    assert_eq!(check_work_mask(&b), 0);

    // Unacknowledged messages of a path that goes down are queued again: the bit stays; a
    // path that goes down with nothing leaves none, and one coming up sends a map (all).
    b.send(now, s1, 7, vec![3; 100], 3).unwrap();
    drain(&mut b, now, 1, &map);
    assert_eq!(b.unacked_messages(1), 1);
    b.handle_path_down(now, 1).unwrap();
    assert_eq!(b.queued_messages(1), 1);
    assert_eq!(check_work_mask(&b), 0b10);
    b.handle_path_down(now, 0).unwrap();
    assert_eq!(check_work_mask(&b) & 1, 0, "path 0 went down idle");
    assert_eq!(b.handle_accepted(now, 40008), Ok(0));
    assert_eq!(check_work_mask(&b), u8::MAX);
}

#[test]
fn congestion_map_cut_mid_frame_goes_out_on_another_path() {
    let now = Instant::ZERO;
    let mut b = passive_two_paths(now);
    let mut map = CongMap::new();
    assert!(b.has_pending_transmit(0) && b.has_pending_transmit(1));
    // Both paths came up, but the first transmit pass (path 0) sends the only map.
    let out = frames(&drain(&mut b, now, 0, &map));
    assert_eq!(out[0].0.flags, flags::CONG_BITMAP);
    assert_eq!(out.iter().filter(|(h, _)| h.is_cong_bitmap()).count(), 1);
    assert!(!b.has_pending_transmit(1));
    assert!(
        drain(&mut b, now, 1, &map).is_empty(),
        "no second map on path 1"
    );
    assert_eq!(b.counters().cong_map_sent, 1);

    map.set(4242);
    b.local_congestion_changed();
    assert!(b.has_pending_transmit(0) && b.has_pending_transmit(1));
    // Path 1 runs first and starts the map; path 0 has nothing left to send.
    let chunk = b.poll_transmit_chunk(now, 1, &map).unwrap();
    assert_eq!(chunk.len(), HEADER_LEN + CONG_MAP_BYTES);
    b.advance_transmit(1, 100);
    assert!(!b.has_pending_transmit(0));
    assert!(drain(&mut b, now, 0, &map).is_empty());
    assert_eq!(b.counters().cong_map_sent, 2);

    // Path 1 dies mid-map: the map is pending again and path 0 sends it.
    b.handle_path_down(now, 1).unwrap();
    assert!(b.has_pending_transmit(0));
    assert!(!b.has_pending_transmit(1), "a down path sends nothing");
    let out = frames(&drain(&mut b, now, 0, &map));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0.flags, flags::CONG_BITMAP);
    assert_eq!(out[0].1.as_slice(), &map.as_bytes()[..]);
    assert_eq!(b.counters().cong_map_sent, 3);

    // A path that finished its map before dying does not re-arm it (a path coming up does).
    map.clear(4242);
    b.local_congestion_changed();
    assert_eq!(frames(&drain(&mut b, now, 0, &map)).len(), 1);
    b.handle_path_down(now, 0).unwrap();
    assert!(!b.has_pending_transmit(0));
    assert_eq!(b.handle_accepted(now, 40008), Ok(0));
    assert!(b.has_pending_transmit(0));
}

#[test]
fn oversize_length_drops_the_path_and_it_recovers() {
    let mut pair = established(Faults::default(), 1);
    let header = HeaderRepr {
        sequence: 5,
        len: MAX_MSG_SIZE + 1,
        sport: 9,
        dport: 9,
        ..Default::default()
    };
    pair.inject(0, 0, &header.to_bytes()[..30]);
    pair.inject(0, 0, &header.to_bytes()[30..]);
    let c = pair.hosts[0].conn.counters();
    assert_eq!((c.rx_drop_oversize, c.path_errors), (1, 1));
    assert!(pair.hosts[0].events.contains(&Event::Close { path: 0 }));
    // The link was torn down and A reconnected at once.
    assert_eq!(pair.hosts[0].conn.counters().reconnects, 1);
    pair.send(1, 20, 30, b"still works".to_vec(), 7);
    assert!(pair.drive(10_000));
    assert_eq!(
        pair.hosts[0].delivered.last().unwrap().payload,
        b"still works"
    );
}

#[test]
fn garbage_never_panics_and_bytes_on_down_path_are_dropped() {
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    let mut x = 0x9e37_79b9_u32;
    let junk: Vec<u8> = (0..20_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    b.handle_stream_data(now, 0, &junk, |_| {});
    b.handle_stream_data(now, 7, &junk, |_| {});
    b.handle_stream_data(now, 99, &junk, |_| {});
    assert!(b.counters().rx_drop_unknown >= 2);
    let _ = events(&mut b);
}

#[test]
fn cancel_sent_to_releases_and_skips() {
    let mut pair = Pair::new(5, 1, Faults::default());
    for i in 0..3 {
        pair.send(0, 7, 10, vec![i; 10], 100 + u64::from(i));
    }
    pair.send(0, 7, 11, b"keep-1".to_vec(), 200);
    pair.send(0, 8, 10, b"keep-2".to_vec(), 300);
    assert_eq!(pair.conn(0).cancel_sent_to(7, 10), 3);
    assert_eq!(pair.conn(0).counters().cancelled, 3);
    pair.process_events();
    assert_eq!(pair.hosts[0].released, vec![100, 101, 102]);
    let now = pair.now;
    pair.conn(0).open(now);
    assert!(pair.drive(10_000));
    let got: Vec<_> = pair.hosts[1]
        .delivered
        .iter()
        .map(|d| d.payload.clone())
        .collect();
    assert_eq!(got, vec![b"keep-1".to_vec(), b"keep-2".to_vec()]);
    assert_eq!(pair.conn(0).cancel_socket(7), 0);
}

/// `message_info` (rds-info's send and retransmit listings): data messages only, oldest
/// first, moving from the send queue to the retransmit queue as they are written, and gone
/// once cancelled.
#[test]
fn message_info_lists_queued_then_unacknowledged_data_messages() {
    use rds_proto::MessageInfo;
    let now = Instant::ZERO;
    let mut a = active_attached(now);
    let map = CongMap::new();
    drain(&mut a, now, 0, &map); // map + probe: control, never listed
    assert_eq!(a.message_info(0, false).count(), 0);
    assert_eq!(a.message_info(0, true).count(), 0);
    a.send(now, 7, 10, vec![1u8; 100], 1).unwrap();
    a.send(now, 7, 11, vec![2u8; 200], 2).unwrap();
    let queued: Vec<MessageInfo> = a.message_info(0, false).collect();
    assert_eq!(
        queued
            .iter()
            .map(|m| (m.len, m.sport, m.dport))
            .collect::<Vec<_>>(),
        [(100, 7, 10), (200, 7, 11)]
    );
    assert!(queued[0].seq < queued[1].seq);
    drain(&mut a, now, 0, &map);
    assert_eq!(a.message_info(0, false).count(), 0);
    assert_eq!(a.message_info(0, true).collect::<Vec<_>>(), queued);
    a.cancel_sent_to(7, 10);
    assert_eq!(a.message_info(0, true).collect::<Vec<_>>(), queued[1..]);
    assert_eq!(a.message_info(5, true).count(), 0, "a path never used");
    assert_eq!(a.message_info(99, true).count(), 0, "no such path");
}

#[test]
fn cancel_of_a_message_being_written_completes_its_frame() {
    let now = Instant::ZERO;
    let mut a = active_attached(now);
    let map = CongMap::new();
    drain(&mut a, now, 0, &map); // map + probe
    a.send(now, 7, 10, vec![1u8; 1000], 1).unwrap();
    let chunk = a.poll_transmit_chunk(now, 0, &map).unwrap();
    assert_eq!(chunk.len(), 48 + 1000);
    a.advance_transmit(0, 100);
    assert_eq!(a.cancel_sent_to(7, 10), 1);
    assert!(!events(&mut a)
        .iter()
        .any(|e| matches!(e, Event::Released { .. })));
    let rest = drain(&mut a, now, 0, &map);
    assert_eq!(
        rest.len(),
        948,
        "the frame is finished so the stream stays framed"
    );
    assert_eq!(
        events(&mut a),
        vec![Event::Released {
            token: 1,
            len: 1000
        }]
    );
    assert_eq!(a.unacked_messages(0), 1, "only the probe is left");
}

/// `hold_cancelled_written` (RDMA, whose posted SENDs read the payload, in place from the
/// app's ring, until they complete): a message cancelled once written is not released at
/// once, since the app would then overwrite bytes the device may still be sending, but once
/// `release_cancelled_read` says the device read past its end; one being written, once its
/// frame is complete and read; one still queued, at once (the device never saw it).
#[test]
fn a_cancelled_message_the_device_may_still_read_waits_until_it_has() {
    let now = Instant::ZERO;
    let mut cfg = Config::new(ADDR_A, ADDR_B, GEN_A, 42);
    cfg.hold_cancelled_written = true;
    let mut a = Connection::new(cfg).unwrap();
    a.open(now);
    let _ = events(&mut a);
    a.handle_connected(now, 0).unwrap();
    attach(&mut a);
    let _ = events(&mut a);
    let map = CongMap::new();
    let start = drain(&mut a, now, 0, &map).len() as u64; // map + probe
    a.send(now, 7, 10, vec![1u8; 1000], 1).unwrap();
    a.send(now, 7, 10, vec![2u8; 1000], 2).unwrap();
    a.send(now, 7, 10, vec![3u8; 1000], 3).unwrap();
    let first = drain_one_frame(&mut a, now, &map);
    assert_eq!(first, 48 + 1000);
    // The second is being written: 100 of its bytes.
    let chunk = a.poll_transmit_chunk(now, 0, &map).unwrap();
    assert_eq!(chunk.len(), 48 + 1000);
    a.advance_transmit(0, 100);
    assert!(!a.holds_cancelled(0));
    assert_eq!(a.cancel_sent_to(7, 10), 3);
    assert!(a.holds_cancelled(0));
    assert_eq!(
        events(&mut a),
        vec![Event::Released {
            token: 3,
            len: 1000
        }],
        "only the queued one: the device never saw it"
    );
    let end_1 = start + 48 + 1000;
    assert_eq!(a.release_cancelled_read(0, end_1 - 1), 0, "still read");
    assert!(events(&mut a).is_empty());
    assert_eq!(a.release_cancelled_read(0, end_1), 1);
    assert_eq!(
        events(&mut a),
        vec![Event::Released {
            token: 1,
            len: 1000
        }]
    );
    // The second's frame is finished (the stream stays framed), then read.
    assert_eq!(drain(&mut a, now, 0, &map).len(), 948);
    assert!(events(&mut a).is_empty(), "written is not read");
    let end_2 = end_1 + 48 + 1000;
    assert_eq!(a.release_cancelled_read(0, end_2), 1);
    assert_eq!(
        events(&mut a),
        vec![Event::Released {
            token: 2,
            len: 1000
        }]
    );
    assert_eq!(a.release_cancelled_read(0, end_2), 0);
    assert!(
        !a.holds_cancelled(0),
        "a look that finds none clears the mark"
    );
    assert_eq!(a.unacked_messages(0), 1, "only the probe is left");
}

/// Writes one whole frame of path 0 (its bytes), as a transport that takes exactly one.
fn drain_one_frame(c: &mut Connection<Vec<u8>>, now: Instant, map: &CongMap) -> usize {
    let n = c.poll_transmit_chunk(now, 0, map).map_or(0, |ch| ch.len());
    c.advance_transmit(0, n);
    n
}

#[test]
fn duplicate_rule_follows_the_kernel() {
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    let r = flags::RETRANSMITTED;
    let mut stream = Vec::new();
    stream.extend(message(5, 9, 10, 0, b"a")); // delivered, next = 6
    stream.extend(message(5, 9, 10, r, b"dup")); // dropped
    stream.extend(message(3, 9, 10, 0, b"b")); // not flagged: delivered, next moves back to 4
    stream.extend(message(4, 9, 10, r, b"c")); // 4 >= 4: delivered
    stream.extend(message(2, 9, 10, r, b"old")); // dropped
    let mut got = Vec::new();
    b.handle_stream_data(now, 0, &stream, |d| {
        got.push((d.sequence, d.retransmitted, d.payload.to_vec()))
    });
    assert_eq!(
        got,
        vec![
            (5, false, b"a".to_vec()),
            (3, false, b"b".to_vec()),
            (4, true, b"c".to_vec())
        ]
    );
    assert_eq!(b.counters().rx_drop_dup_seq, 2);
    assert_eq!(b.next_rx_seq(0), 5);
}

/// `send_with(ack_required)` puts `RDS_FLAG_ACK_REQUIRED` on that message only (never on the
/// congestion map or the probe), a resend keeps it beside `RETRANSMITTED`, and the receiver
/// reports it in `Delivery::ack_required`.
#[test]
fn ack_required_goes_on_the_flagged_message_only() {
    let mut now = Instant::ZERO;
    let mut a = active_attached(now);
    let map = CongMap::new();
    let ask = SendFlags { ack_required: true };
    a.send(now, 7, 10, b"plain".to_vec(), 1).unwrap();
    a.send_with(now, 7, 10, b"asks".to_vec(), 2, ask).unwrap();
    let out = frames(&drain(&mut a, now, 0, &map));
    let got: Vec<(u8, Vec<u8>)> = out.iter().map(|(h, p)| (h.flags, p.clone())).collect();
    assert_eq!(
        got[0].0,
        flags::CONG_BITMAP,
        "a map's flags stay exactly 0x01"
    );
    assert_eq!(got[1].0, 0, "the probe");
    assert_eq!(got[2], (0, b"plain".to_vec()));
    assert_eq!(got[3], (flags::ACK_REQUIRED, b"asks".to_vec()));

    now += Duration::from_millis(1);
    a.handle_path_down(now, 0).unwrap();
    let _ = events(&mut a);
    a.handle_connected(now, 0).unwrap();
    let again = frames(&drain(&mut a, now, 0, &map));
    let asks = again.iter().find(|(_, p)| p == b"asks").expect("resent");
    assert_eq!(asks.0.flags, flags::RETRANSMITTED | flags::ACK_REQUIRED);

    let mut b = passive_up(now);
    let mut stream = Vec::new();
    stream.extend(message(5, 9, 10, 0, b"a"));
    stream.extend(message(6, 9, 10, flags::ACK_REQUIRED, b"b"));
    let mut seen = Vec::new();
    b.handle_stream_data(now, 0, &stream, |d| {
        seen.push((d.ack_required, d.payload.to_vec()))
    });
    assert_eq!(seen, vec![(false, b"a".to_vec()), (true, b"b".to_vec())]);
}

#[test]
fn unacked_messages_are_resent_with_original_seq_and_flag() {
    let mut now = Instant::ZERO;
    let mut a = active_attached(now);
    let map = CongMap::new();
    a.send(now, 7, 10, b"one".to_vec(), 1).unwrap();
    a.send(now, 7, 10, b"two".to_vec(), 2).unwrap();
    let stream = drain(&mut a, now, 0, &map);
    let out = frames(&stream);
    let seqs: Vec<u64> = out.iter().map(|(h, _)| h.sequence).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3]); // map, probe, one, two
                                        // TCP acknowledged everything up to the end of "one".
    let end_of_one = (48 + 8192 + 48 + 48 + 3) as u64;
    a.handle_acked(0, end_of_one - 1);
    assert!(events(&mut a).is_empty(), "one byte short of message one");
    a.handle_acked(0, end_of_one);
    assert_eq!(events(&mut a), vec![Event::Released { token: 1, len: 3 }]);

    now += Duration::from_millis(1);
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(
        events(&mut a),
        vec![Event::Connect { path: 0 }],
        "first reconnect is immediate"
    );
    a.handle_connected(now, 0).unwrap();
    let out = frames(&drain(&mut a, now, 0, &map));
    let summary: Vec<(u64, u8, Vec<u8>)> = out
        .iter()
        .map(|(h, p)| (h.sequence, h.flags, p.clone()))
        .collect();
    assert_eq!(summary[0].1, flags::CONG_BITMAP);
    assert_eq!(summary[1], (3, flags::RETRANSMITTED, b"two".to_vec()));
    assert_eq!(
        out[1].0.exthdr.iter().collect::<Vec<_>>(),
        vec![ExtHeader::GenNum(GEN_A)],
        "a resend on path 0 goes ahead of the new probe and announces our generation"
    );
    assert_eq!(out[2].0.sport, 1, "a new probe follows");
    assert_eq!(out[2].0.sequence, 4);
    assert_eq!(a.counters().tx_retransmits, 1);
    assert_eq!(a.counters().reconnects, 1);
}

/// A data message carrying `GEN_NUM` (as rdsd's resends on path 0 do).
fn message_with_gen(seq: u64, flags: u8, generation: u32, payload: &[u8]) -> Vec<u8> {
    let mut exthdr = ExtHeaders::new();
    exthdr.push(ExtHeader::GenNum(generation)).unwrap();
    let h = HeaderRepr {
        sequence: seq,
        len: payload.len() as u32,
        sport: 9,
        dport: 10,
        flags,
        exthdr,
        ..Default::default()
    };
    let mut v = h.to_bytes().to_vec();
    v.extend_from_slice(payload);
    v
}

/// A receiver that restored numbers of the peer's old generation (it crashed after TCP took
/// the new peer's probe, before reading it) judges the new peer's resends on path 0 only after
/// the generation they carry reset them; elsewhere the record changes nothing.
#[test]
fn a_resend_announcing_a_new_generation_resets_restored_numbers_before_it_is_judged() {
    const GEN_A2: u32 = 0xaaaa_0002;
    let now = Instant::ZERO;
    let r = flags::RETRANSMITTED;
    let deliver = |b: &mut Connection<Vec<u8>>, path: usize, bytes: &[u8]| {
        let mut got = Vec::new();
        b.handle_stream_data(now, path, bytes, |d| got.push(d.payload.to_vec()));
        got
    };

    // The same generation: the restored numbers hold, the resend is a duplicate.
    let mut b = passive_up(now);
    b.restore_rx_state(GEN_A, [6, 6, 0, 0, 0, 0, 0, 0]);
    assert!(deliver(&mut b, 0, &message_with_gen(2, r, GEN_A, b"x")).is_empty());
    assert_eq!(b.counters().rx_drop_dup_seq, 1);

    // A new generation on a resend of path 0: a restart, numbers reset, delivered.
    let mut b = passive_up(now);
    b.restore_rx_state(GEN_A, [6, 6, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        deliver(&mut b, 0, &message_with_gen(2, r, GEN_A2, b"x")),
        vec![b"x".to_vec()]
    );
    assert_eq!(
        events(&mut b),
        vec![Event::PeerRestarted {
            old_generation: GEN_A,
            new_generation: GEN_A2
        }]
    );
    assert_eq!(b.peer_generation(), GEN_A2);
    assert_eq!(b.next_rx_seq(0), 3);
    assert_eq!(b.counters().rx_drop_dup_seq, 0);
    // Its probe, arriving after the resends, changes nothing more.
    b.handle_stream_data(now, 0, &probe_pong(4, 1, GEN_A2), |_| {
        panic!("pong delivered")
    });
    assert!(!events(&mut b)
        .iter()
        .any(|e| matches!(e, Event::PeerRestarted { .. })));

    // Ignored on a first-time message (only resends go ahead of a probe) and on a path > 0
    // (only path 0 carries a peer's announcements).
    let mut b = passive_two_paths(now);
    b.restore_rx_state(GEN_A, [6, 6, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        deliver(&mut b, 0, &message_with_gen(7, 0, GEN_A2, b"y")),
        vec![b"y".to_vec()]
    );
    assert!(deliver(&mut b, 1, &message_with_gen(2, r, GEN_A2, b"z")).is_empty());
    assert_eq!(b.peer_generation(), GEN_A);
    assert!(!events(&mut b)
        .iter()
        .any(|e| matches!(e, Event::PeerRestarted { .. })));
}

#[test]
fn partial_writes_keep_the_stream_exact() {
    let now = Instant::ZERO;
    let mut a = active_attached(now);
    let map = CongMap::new();
    for i in 0..5u8 {
        a.send(now, 7, 10, vec![i; 100 * usize::from(i)], u64::from(i))
            .unwrap();
    }
    let mut stream = Vec::new();
    let mut step = 1;
    while let Some(chunk) = a.poll_transmit_chunk(now, 0, &map) {
        // The socket takes an awkward number of bytes each time.
        let all: Vec<u8> = chunk.header.iter().chain(chunk.payload).copied().collect();
        let n = step.min(all.len());
        stream.extend_from_slice(&all[..n]);
        a.advance_transmit(0, n);
        step = step * 7 % 191 + 1;
    }
    assert_eq!(a.stream_offset(0), stream.len() as u64);
    let out = frames(&stream);
    assert_eq!(out.len(), 7);
    for (i, (h, p)) in out[2..].iter().enumerate() {
        assert_eq!(p, &vec![i as u8; 100 * i]);
        assert_eq!(h.len as usize, 100 * i);
    }
    a.handle_acked(0, stream.len() as u64 + 1000); // clamped to what was written
    let released = events(&mut a)
        .into_iter()
        .filter(|e| matches!(e, Event::Released { .. }))
        .count();
    assert_eq!(released, 5);
}

#[test]
fn reconnect_backoff_doubles_to_one_second_and_resets_once_the_peer_speaks() {
    let mut now = Instant::ZERO;
    let mut a = active_attached(now);
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    let mut bound = Duration::from_millis(1);
    for _ in 0..14 {
        a.handle_path_down(now, 0).unwrap(); // connect failed
        assert!(events(&mut a).is_empty());
        let at = a.poll_timeout().expect("reconnect timer");
        let delay = at.saturating_duration_since(now);
        assert!(delay < bound, "delay {delay:?} bound {bound:?}");
        a.handle_timeout(Instant::from_nanos(at.as_nanos() - 1).max(now));
        if delay > Duration::ZERO {
            assert!(events(&mut a).is_empty(), "not before the timer");
        }
        now = at;
        a.handle_timeout(now);
        assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
        bound = (bound * 2).min(Duration::from_secs(1));
    }
    assert_eq!(bound, Duration::from_secs(1));
    // Up, then refused (reset) before the peer sent anything: still backing off.
    a.handle_connected(now, 0).unwrap();
    a.handle_path_down(now, 0).unwrap();
    assert!(
        events(&mut a).is_empty(),
        "no storm against a refusing peer"
    );
    let at = a.poll_timeout().expect("reconnect timer");
    assert!(at.saturating_duration_since(now) < Duration::from_secs(1));
    now = at;
    a.handle_timeout(now);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    // A connection the peer spoke on resets the backoff: the next reconnect is immediate.
    a.handle_connected(now, 0).unwrap();
    attach(&mut a);
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(
        events(&mut a),
        vec![Event::Connect { path: 0 }],
        "immediate again after a connection that carried a frame"
    );
    // So does one that lived a second, even silent.
    a.handle_path_down(now, 0).unwrap(); // connect failed: backing off again
    let at = a.poll_timeout().unwrap();
    a.handle_timeout(at);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    a.handle_connected(at, 0).unwrap();
    a.handle_path_down(at + Duration::from_secs(1), 0).unwrap();
    assert_eq!(
        events(&mut a),
        vec![Event::Connect { path: 0 }],
        "immediate after a connection that lived"
    );
}

#[test]
fn passive_side_never_reconnects_but_rings_the_doorbell() {
    let mut now = Instant::ZERO;
    let mut b = passive_up(now);
    b.handle_path_down(now, 0).unwrap();
    assert!(events(&mut b).is_empty());
    assert!(
        b.poll_timeout().is_none(),
        "nothing to send, nothing scheduled"
    );
    b.send(now, 9, 10, b"x".to_vec(), 1).unwrap();
    assert_eq!(events(&mut b), vec![Event::Doorbell]);
    assert_eq!(b.path_state(0), PathState::Down);
    // Keeps poking the peer at backoff pace while it has something to send.
    let at = b.poll_timeout().unwrap();
    now = at;
    b.handle_timeout(now);
    assert_eq!(events(&mut b), vec![Event::Doorbell]);
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    assert_eq!(
        b.poll_timeout(),
        Some(now + Duration::from_secs(1)),
        "no doorbell timer; only the deadline of the path-0 data gate"
    );
}

/// Passive side with path 0 down and data queued: doorbells at most once per backoff interval
/// (10 ms, doubling to 1 s), however often the timer is polled or the application sends.
#[test]
fn doorbell_rings_at_most_once_per_backoff_interval() {
    let start = Instant::from_nanos(5_000_000);
    let mut b = passive_up(start);
    b.handle_path_down(start, 0).unwrap();
    assert!(events(&mut b).is_empty(), "nothing queued: no doorbell");
    b.send(start, 9, 10, b"x".to_vec(), 1).unwrap();

    // Drive virtual time in small ticks (and exactly to each timer), sending now and then.
    let tick = Duration::from_micros(250);
    let drive = |b: &mut Connection<Vec<u8>>, from: Instant, until: Instant| {
        let mut rings = Vec::new();
        let mut now = from;
        let mut token = 100;
        while now <= until {
            b.handle_timeout(now);
            if now.as_nanos() % 1_000_000 < tick.as_nanos() as u64 {
                token += 1;
                b.send(now, 9, 10, b"more".to_vec(), token).unwrap();
            }
            for e in events(b) {
                assert_eq!(e, Event::Doorbell);
                rings.push(now);
            }
            now = match b.poll_timeout() {
                Some(t) if t > now => t.min(now + tick),
                _ => now + tick,
            };
        }
        rings
    };
    let mut rings = vec![start];
    assert_eq!(
        events(&mut b),
        vec![Event::Doorbell],
        "the first one rings at once"
    );
    rings.extend(drive(&mut b, start, start + Duration::from_millis(35)));
    assert!(
        (2..=3).contains(&rings.len()),
        "doorbells in 35 ms: {rings:?}"
    );
    assert_eq!(b.counters().doorbells, rings.len() as u64);

    // Over a longer span, consecutive doorbells are at least the (doubling) bound apart and
    // at most 1.5 times it (capped at reconnect_max): paced, but never stalled.
    let end = start + Duration::from_secs(4);
    rings.extend(drive(&mut b, start + Duration::from_millis(35) + tick, end));
    assert_eq!(b.counters().doorbells, rings.len() as u64);
    let max = Duration::from_secs(1);
    let mut bound = Duration::from_millis(10);
    for (k, w) in rings.windows(2).enumerate() {
        let gap = w[1].saturating_duration_since(w[0]);
        assert!(gap >= bound, "gap {k}: {gap:?} below the bound {bound:?}");
        let upper = (bound + bound / 2).min(max) + tick;
        assert!(gap <= upper, "gap {k}: {gap:?} above {upper:?}");
        bound = (bound * 2).min(max);
    }
    assert!(rings.len() >= 8, "{} doorbells in 4 s", rings.len());

    // Path 0 up resets the pacing: the next loss of path 0 rings at once, then 10 ms later.
    let now = end;
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    assert_eq!(
        b.poll_timeout(),
        Some(now + Duration::from_secs(1)),
        "no doorbell timer; only the deadline of the path-0 data gate"
    );
    b.handle_path_down(now, 0).unwrap();
    assert_eq!(events(&mut b), vec![Event::Doorbell]);
    let next = b.poll_timeout().unwrap();
    let gap = next.saturating_duration_since(now);
    assert!(
        gap >= Duration::from_millis(10) && gap < Duration::from_millis(15),
        "{gap:?}"
    );
}

#[test]
fn active_side_resets_inbound_and_connects_back() {
    let now = Instant::ZERO;
    let mut a = conn(ADDR_A, ADDR_B, GEN_A);
    assert_eq!(a.handle_accepted(now, 40000), Err(AcceptError::WeConnect));
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    assert_eq!(a.path_state(0), PathState::Connecting);
    assert_eq!(a.handle_accepted(now, 40001), Err(AcceptError::WeConnect));
    assert!(events(&mut a).is_empty(), "already connecting");
}

#[test]
fn accept_maps_paths_by_sport_idx_or_first_free() {
    let now = Instant::ZERO;
    let mut b = passive_up(now);
    assert_eq!(
        b.handle_accepted(now, 40001),
        Err(AcceptError::CheckingPaths),
        "one path before the handshake, so ours must be stale: checked"
    );
    let mut ext = rds_proto::wire::ExtHeaders::new();
    ext.push(ExtHeader::NPaths(4)).unwrap();
    ext.push(ExtHeader::SportIdx(0)).unwrap();
    let pong = HeaderRepr {
        sequence: 1,
        sport: 0,
        dport: 1,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &pong.to_bytes(), |_| {});
    assert_eq!(b.npaths(), Some(4));
    assert_eq!(b.handle_accepted(now, 40003), Ok(3));
    assert_eq!(b.handle_accepted(now, 40011), Err(AcceptError::PathBusy(3)));
    assert_eq!(
        b.handle_accepted(now, 40006),
        Err(AcceptError::NoFreePath),
        "6 >= npaths"
    );
    // Path 0 was accepted from port 40000 (40000 % 8 == 0): kept.
    assert!(!events(&mut b)
        .iter()
        .any(|e| matches!(e, Event::Close { .. })));

    // Without SPORT_IDX: first free path.
    let mut c = passive_up(now);
    let mut ext = rds_proto::wire::ExtHeaders::new();
    ext.push(ExtHeader::NPaths(3)).unwrap();
    let ping = HeaderRepr {
        sequence: 1,
        sport: 1,
        dport: 0,
        exthdr: ext,
        ..Default::default()
    };
    c.handle_stream_data(now, 0, &ping.to_bytes(), |_| {});
    assert_eq!(c.handle_accepted(now, 50007), Ok(1));
    assert_eq!(c.handle_accepted(now, 50007), Ok(2));
    assert_eq!(
        c.handle_accepted(now, 50007),
        Err(AcceptError::CheckingPaths)
    );
}

#[test]
fn mismapped_path_zero_is_closed_once_sport_idx_is_known() {
    let now = Instant::ZERO;
    let mut b = conn(ADDR_B, ADDR_A, GEN_B);
    // A path-3 connection of a SPORT_IDX peer arrives before any handshake.
    assert_eq!(b.handle_accepted(now, 40003), Ok(0));
    let mut ext = rds_proto::wire::ExtHeaders::new();
    ext.push(ExtHeader::NPaths(8)).unwrap();
    ext.push(ExtHeader::SportIdx(0)).unwrap();
    let pong = HeaderRepr {
        sequence: 1,
        sport: 0,
        dport: 1,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &pong.to_bytes(), |_| {});
    assert!(events(&mut b).contains(&Event::Close { path: 0 }));
    assert_eq!(b.counters().path_mismaps, 1);
}

/// Segments split at up to 2000 bytes, a fifth of the ACKs lost.
fn chunked_lossy_acks() -> Faults {
    Faults {
        max_chunk: 2000,
        ack_prob: 0.2,
        ..Faults::default()
    }
}

/// Runs `workload` over `pair` to the end and checks every flow exactly once, in order;
/// returns the paths the flows used.
fn run_workload(pair: &mut Pair, workload: &mut Workload) -> std::collections::BTreeSet<usize> {
    while !workload.done() {
        workload.send_one(pair, 3000);
        pair.step();
    }
    assert!(pair.drive(100_000));
    workload.check_exactly_once(pair);
    workload
        .flows
        .iter()
        .map(|f| pair.hosts[f.host].conn.route(f.sport, f.dport))
        .collect()
}

#[test]
fn four_paths_keep_per_socket_order() {
    let mut pair = Pair::new(11, 4, chunked_lossy_acks());
    let mut workload = Workload::new(8, 2, 25);
    let used = run_workload(&mut pair, &mut workload);
    assert_eq!(pair.link_count(), 4);
    assert!(used.len() >= 3, "sockets spread over paths: {used:?}");
    let max_seq: Vec<u64> = (0..4).map(|p| pair.hosts[0].conn.next_tx_seq(p)).collect();
    assert!(
        max_seq.iter().all(|&s| s > 1),
        "every path carried messages: {max_seq:?}"
    );
}

/// Paths chosen by the pair of ports: each flow (socket, destination port) keeps one path, so
/// every flow is in order and exactly once; a reply's path is its request's.
#[test]
fn port_pair_paths_keep_per_destination_order_and_replies_share_the_path() {
    let mut a = util::config(ADDR_A, ADDR_B, 4, 0x1000_0001, 13 ^ 0xa);
    let mut b = util::config(ADDR_B, ADDR_A, 4, 0x2000_0002, 13 ^ 0xb);
    a.path_choice = PathChoice::PortPair;
    b.path_choice = PathChoice::PortPair;
    let mut pair = Pair::with_configs(13, a, b, chunked_lossy_acks());
    let mut workload = Workload::new(8, 3, 25);
    let used = run_workload(&mut pair, &mut workload);
    assert!(used.len() >= 3, "flows spread over paths: {used:?}");
    let (ca, cb) = (&pair.hosts[0].conn, &pair.hosts[1].conn);
    for (x, y) in [(2000, 3000), (2037, 3001), (4000, 4001), (7, 65000)] {
        assert_eq!(ca.route(x, y), cb.route(y, x), "{x} <-> {y}");
    }
}

#[test]
fn peer_restart_is_detected_and_unconfirmed_messages_reach_the_new_peer() {
    let faults = Faults {
        lose_acks_on_reset: false,
        ..Faults::default()
    };
    let mut pair = established(faults, 2);
    // Queue messages on A while its transport is cut, then restart B.
    for i in 0..5u8 {
        pair.send(0, 2000 + u16::from(i), 3000, vec![i; 50], u64::from(i));
    }
    pair.restart(1, 0xdddd_0003);
    assert!(pair.drive(50_000));
    let a = &pair.hosts[0];
    assert!(a.events.contains(&Event::PeerRestarted {
        old_generation: 0x2000_0002,
        new_generation: 0xdddd_0003
    }));
    assert_eq!(a.conn.peer_generation(), 0xdddd_0003);
    let mut got: Vec<u8> = pair.hosts[1]
        .delivered
        .iter()
        .map(|d| d.payload[0])
        .collect();
    got.sort_unstable();
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    assert_eq!(a.released.len(), 5);
}

#[test]
fn close_stops_reconnecting_until_reopened() {
    let now = Instant::ZERO;
    let mut a = active_up(now);
    a.close(now);
    assert_eq!(a.path_state(0), PathState::Disconnecting);
    assert_eq!(events(&mut a), vec![Event::Close { path: 0 }]);
    a.handle_path_down(now, 0).unwrap();
    assert!(events(&mut a).is_empty());
    assert!(a.poll_timeout().is_none());
    a.send(now, 5, 6, vec![], 1).unwrap();
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
}

fn probe(seq: u64, generation: Option<u32>) -> Vec<u8> {
    let mut ext = ExtHeaders::new();
    ext.push(ExtHeader::NPaths(8)).unwrap();
    if let Some(g) = generation {
        ext.push(ExtHeader::GenNum(g)).unwrap();
    }
    HeaderRepr {
        sequence: seq,
        sport: 1,
        dport: 0,
        exthdr: ext,
        ..Default::default()
    }
    .to_bytes()
    .to_vec()
}

/// (sequence, retransmitted, peer generation, payload) of each delivery.
type Got = Vec<(u64, bool, u32, Vec<u8>)>;

fn feed(c: &mut Connection<Vec<u8>>, path: usize, stream: &[u8]) -> Got {
    let mut got = Vec::new();
    c.handle_stream_data(Instant::ZERO, path, stream, |d| {
        assert_eq!(d.path, path);
        got.push((
            d.sequence,
            d.retransmitted,
            d.peer_generation,
            d.payload.to_vec(),
        ))
    });
    got
}

/// B restarted and restored what it had delivered; A kept running and resends what it never
/// saw acknowledged.
#[test]
fn restored_rx_state_drops_resends_of_a_surviving_peer() {
    let now = Instant::ZERO;
    let mut b = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    assert_eq!(b.rx_state(), (0, [0; MAX_PATHS]));
    let mut next = [0u64; MAX_PATHS];
    next[0] = 5;
    next[3] = 9;
    b.restore_rx_state(GEN_A, next);
    assert_eq!(b.rx_state(), (GEN_A, next));
    assert_eq!(b.peer_generation(), GEN_A);
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));

    let r = flags::RETRANSMITTED;
    let mut stream = probe(7, Some(GEN_A));
    stream.extend(message(3, 9, 10, r, b"delivered before the restart"));
    stream.extend(message(4, 9, 10, r, b"delivered before the restart"));
    stream.extend(message(5, 9, 10, r, b"five"));
    stream.extend(message(6, 9, 10, 0, b"six"));
    let got = feed(&mut b, 0, &stream);
    assert_eq!(
        got,
        vec![
            (5, true, GEN_A, b"five".to_vec()),
            (6, false, GEN_A, b"six".to_vec())
        ]
    );
    assert_eq!(b.counters().rx_drop_dup_seq, 2);
    assert_eq!(b.counters().peer_restarts, 0);
    assert!(!events(&mut b)
        .iter()
        .any(|e| matches!(e, Event::PeerRestarted { .. })));
    next[0] = 7;
    assert_eq!(b.rx_state(), (GEN_A, next));

    // Without the restore, the same resends are delivered a second time.
    let mut fresh = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    assert_eq!(fresh.handle_accepted(now, 40000), Ok(0));
    assert_eq!(feed(&mut fresh, 0, &stream).len(), 4);
}

/// Both sides restarted: the new peer generation discards the restored numbers.
#[test]
fn restored_rx_state_is_discarded_when_the_peer_restarted_too() {
    const GEN_A2: u32 = 0xaaaa_0002;
    let now = Instant::ZERO;
    let mut b = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    b.restore_rx_state(GEN_A, [50; MAX_PATHS]);
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    // The new A numbers from 1 again; its message 2 went out twice (a reset in between).
    let mut stream = probe(1, Some(GEN_A2));
    stream.extend(message(2, 9, 10, flags::RETRANSMITTED, b"new peer"));
    let got = feed(&mut b, 0, &stream);
    assert_eq!(got, vec![(2, true, GEN_A2, b"new peer".to_vec())]);
    assert!(events(&mut b).contains(&Event::PeerRestarted {
        old_generation: GEN_A,
        new_generation: GEN_A2
    }));
    let mut expected = [0u64; MAX_PATHS];
    expected[0] = 3;
    assert_eq!(b.rx_state(), (GEN_A2, expected));
}

/// A classic peer (no GEN_NUM in its probe) keeps the restored numbers; the kernel's rule lets
/// its non-retransmitted messages through even if it restarted and numbers from 1.
#[test]
fn restored_rx_state_is_kept_for_a_peer_without_gen_num() {
    let now = Instant::ZERO;
    let mut b = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    let mut next = [0u64; MAX_PATHS];
    next[0] = 50;
    b.restore_rx_state(0, next);
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    let r = flags::RETRANSMITTED;
    let mut stream = probe(60, None);
    stream.extend(message(49, 9, 10, r, b"dup"));
    stream.extend(message(50, 9, 10, r, b"fifty"));
    stream.extend(message(1, 9, 10, 0, b"restarted classic peer"));
    stream.extend(message(1, 9, 10, r, b"dup"));
    stream.extend(message(2, 9, 10, r, b"two"));
    let got: Vec<(u64, Vec<u8>)> = feed(&mut b, 0, &stream)
        .into_iter()
        .map(|(seq, _, generation, payload)| {
            assert_eq!(generation, 0);
            (seq, payload)
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (50, b"fifty".to_vec()),
            (1, b"restarted classic peer".to_vec()),
            (2, b"two".to_vec())
        ]
    );
    assert_eq!(b.counters().rx_drop_dup_seq, 2);
    assert_eq!(b.rx_state().0, 0);
    assert_eq!(b.next_rx_seq(0), 3);
}

// ----- vectored transmit (poll_transmit_slices) -------------------------------------------------

/// One vectored poll on `path` with at most `max_frames` frames and `slots` slices; the
/// slices, copied.
fn gather(
    c: &mut Connection<Vec<u8>>,
    now: Instant,
    path: usize,
    map: &CongMap,
    max_frames: usize,
    slots: usize,
) -> Vec<Vec<u8>> {
    let mut out: [&[u8]; 64] = [&[]; 64];
    let got = c.poll_transmit_slices(now, path, map, max_frames, &mut out[..slots]);
    let slices: Vec<Vec<u8>> = out[..got.slices].iter().map(|s| s.to_vec()).collect();
    assert!(slices.iter().all(|s| !s.is_empty()), "empty slice");
    assert_eq!(slices.iter().map(Vec::len).sum::<usize>(), got.bytes);
    assert_eq!(got.is_empty(), got.bytes == 0);
    slices
}

fn lens(slices: &[Vec<u8>]) -> Vec<usize> {
    slices.iter().map(Vec::len).collect()
}

/// Like `drain`, with vectored writes of up to 32 frames that the socket takes whole.
fn drain_vectored(
    c: &mut Connection<Vec<u8>>,
    now: Instant,
    path: usize,
    map: &CongMap,
) -> Vec<u8> {
    let mut stream = Vec::new();
    loop {
        let bytes = gather(c, now, path, map, 32, 64).concat();
        if bytes.is_empty() {
            return stream;
        }
        c.advance_transmit(path, bytes.len());
        stream.extend_from_slice(&bytes);
    }
}

fn released(c: &mut Connection<Vec<u8>>) -> Vec<u64> {
    events(c)
        .into_iter()
        .filter_map(|e| match e {
            Event::Released { token, .. } => Some(token),
            _ => None,
        })
        .collect()
}

/// Active side with path 0 up and five messages of 0, 10, .. 40 bytes queued behind the
/// congestion map and the probe.
fn loaded(now: Instant) -> Connection<Vec<u8>> {
    let mut a = active_attached(now);
    for i in 0..5u8 {
        a.send(now, 7, 10, vec![i; 10 * usize::from(i)], u64::from(i))
            .unwrap();
    }
    a
}

#[test]
fn vectored_poll_gathers_several_frames_completed_by_one_advance() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let reference = drain(&mut loaded(now), now, 0, &map);

    let mut a = loaded(now);
    let slices = gather(&mut a, now, 0, &map, 32, 64);
    // Map (header, payload), probe (header), message 0 (header, no payload), messages 1..4.
    assert_eq!(
        lens(&slices),
        vec![48, CONG_MAP_BYTES, 48, 48, 48, 10, 48, 20, 48, 30, 48, 40]
    );
    let bytes = slices.concat();
    assert_eq!(bytes, reference, "same stream as the copying API");
    assert_eq!(a.stream_offset(0), 0, "nothing counted before the write");
    assert_eq!((a.queued_messages(0), a.unacked_messages(0)), (0, 6));
    assert!(a.has_pending_transmit(0), "started frames are pending");
    a.advance_transmit(0, bytes.len());
    assert_eq!(a.stream_offset(0), bytes.len() as u64);
    assert!(!a.has_pending_transmit(0));
    assert!(gather(&mut a, now, 0, &map, 32, 64).is_empty());
    let c = a.counters();
    assert_eq!(
        (c.tx_messages, c.tx_bytes, c.cong_map_sent, c.probes_sent),
        (6, 100, 1, 1)
    );
    a.handle_acked(0, bytes.len() as u64);
    assert_eq!(released(&mut a), vec![0, 1, 2, 3, 4]);
}

#[test]
fn vectored_poll_respects_the_frame_limit_and_the_slice_array() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let reference = drain(&mut loaded(now), now, 0, &map);
    let mut a = loaded(now);
    assert!(gather(&mut a, now, 0, &map, 0, 64).is_empty());
    assert_eq!(a.queued_messages(0), 6, "max_frames 0 starts nothing");
    // Map, probe, message 0.
    assert_eq!(
        lens(&gather(&mut a, now, 0, &map, 3, 64)),
        vec![48, CONG_MAP_BYTES, 48, 48]
    );
    assert_eq!(a.queued_messages(0), 4);
    // The started frames come back first; one more frame is started.
    assert_eq!(
        lens(&gather(&mut a, now, 0, &map, 4, 64)),
        vec![48, CONG_MAP_BYTES, 48, 48, 48, 10]
    );
    // Fewer frames than started: only those.
    assert_eq!(
        lens(&gather(&mut a, now, 0, &map, 1, 64)),
        vec![48, CONG_MAP_BYTES]
    );
    // One free slot left: message 2 needs two, so it is not started.
    assert_eq!(lens(&gather(&mut a, now, 0, &map, 32, 7)).len(), 6);
    assert_eq!(a.queued_messages(0), 3);
    // A slice array smaller than the started frames: a prefix of them.
    assert_eq!(lens(&gather(&mut a, now, 0, &map, 32, 1)), vec![48]);
    assert_eq!(a.queued_messages(0), 3);
    // The single-frame API sees the same first frame.
    let chunk = a.poll_transmit_chunk(now, 0, &map).unwrap();
    assert_eq!(
        (chunk.header.len(), chunk.payload.len()),
        (48, CONG_MAP_BYTES)
    );
    assert_eq!(drain_vectored(&mut a, now, 0, &map), reference);
}

#[test]
fn partial_vectored_write_ends_mid_header_then_mid_payload_of_later_frames() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let build = || {
        let mut a = active_attached(now);
        for i in 0..5u8 {
            a.send(now, 7, 10, vec![i; 100], u64::from(i)).unwrap();
        }
        a
    };
    let reference = drain(&mut build(), now, 0, &map);
    let mut a = build();
    let map_frame = 48 + CONG_MAP_BYTES;
    let mut stream = Vec::new();

    // Map, probe, messages 0 and 1 complete, 20 bytes into the header of message 2.
    let bytes = gather(&mut a, now, 0, &map, 32, 64).concat();
    let n = map_frame + 48 + 148 + 148 + 20;
    stream.extend_from_slice(&bytes[..n]);
    a.advance_transmit(0, n);
    assert_eq!(a.stream_offset(0), n as u64);
    assert_eq!(a.counters().tx_messages, 6, "no frame started twice");

    let slices = gather(&mut a, now, 0, &map, 32, 64);
    assert_eq!(lens(&slices), vec![28, 100, 48, 100, 48, 100]);
    let chunk = a.poll_transmit_chunk(now, 0, &map).unwrap();
    assert_eq!((chunk.header.len(), chunk.payload.len()), (28, 100));
    // Rest of message 2, 30 bytes into the payload of message 3.
    let bytes = slices.concat();
    let n = 28 + 100 + 48 + 30;
    stream.extend_from_slice(&bytes[..n]);
    a.advance_transmit(0, n);

    let slices = gather(&mut a, now, 0, &map, 32, 64);
    assert_eq!(lens(&slices), vec![70, 48, 100]);
    let bytes = slices.concat();
    // More than was gathered: only the started frames count.
    a.advance_transmit(0, bytes.len() + 500);
    stream.extend_from_slice(&bytes);
    assert_eq!(stream, reference);
    assert_eq!(a.stream_offset(0), stream.len() as u64);
    assert!(!a.has_pending_transmit(0));
    assert_eq!(a.counters().tx_messages, 6);
}

/// `ack_end` of a frame started behind unwritten frames counts their bytes: each message is
/// released exactly when the acknowledged offset reaches its last byte.
#[test]
fn gathered_messages_are_released_exactly_at_their_last_byte() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = active_attached(now);
    let base = drain(&mut a, now, 0, &map).len() as u64; // map + probe
    a.handle_acked(0, base);
    let _ = events(&mut a);
    a.send(now, 7, 10, vec![1; 10], 1).unwrap();
    a.send(now, 7, 10, vec![2; 200], 2).unwrap();
    a.send(now, 7, 10, vec![], 3).unwrap();
    let bytes = gather(&mut a, now, 0, &map, 32, 64).concat();
    assert_eq!(bytes.len(), 58 + 248 + 48);
    // Message 1 and 10 header bytes of message 2 are written.
    a.advance_transmit(0, 58 + 10);
    // An acknowledgement cannot pass what was written: only message 1 is released.
    a.handle_acked(0, u64::MAX);
    assert_eq!(released(&mut a), vec![1]);
    // Message 4 starts behind the unwritten rest of messages 2 and 3.
    a.send(now, 7, 10, vec![4; 5], 4).unwrap();
    let bytes = gather(&mut a, now, 0, &map, 32, 64).concat();
    assert_eq!(bytes.len(), 238 + 48 + 53);
    a.advance_transmit(0, bytes.len());
    let end1 = base + 58;
    let end2 = end1 + 248;
    let end3 = end2 + 48;
    let end4 = end3 + 53;
    assert_eq!(a.stream_offset(0), end4);
    for (token, end) in [(2, end2), (3, end3), (4, end4)] {
        a.handle_acked(0, end - 1);
        assert_eq!(released(&mut a), Vec::<u64>::new(), "message {token} early");
        a.handle_acked(0, end);
        assert_eq!(
            released(&mut a),
            vec![token],
            "message {token} at its last byte"
        );
    }
    assert_eq!(a.unacked_messages(0), 0);
}

#[test]
fn congestion_map_is_gathered_in_front_of_messages_one_per_path_at_a_time() {
    let now = Instant::ZERO;
    let mut map = CongMap::new();
    map.set(5000);
    let mut a = active_attached(now);
    a.send(now, 7, 10, b"one".to_vec(), 1).unwrap();
    a.send(now, 7, 10, b"two".to_vec(), 2).unwrap();
    let slices = gather(&mut a, now, 0, &map, 32, 64);
    assert_eq!(lens(&slices), vec![48, CONG_MAP_BYTES, 48, 48, 3, 48, 3]);
    let header = HeaderPacket::new_checked(&slices[0][..]).unwrap();
    assert_eq!(header.flags(), flags::CONG_BITMAP);
    assert_eq!(&slices[1][..], &map.as_bytes()[..]);
    let mut stream = slices.concat()[..100].to_vec();
    a.advance_transmit(0, 100); // into the map's payload

    // The map changes while the first map frame is unwritten: the pending map waits for this
    // path's snapshot to be free, and messages queued after the change wait behind it.
    let mut map2 = map.clone();
    map2.set(6000);
    a.local_congestion_changed();
    a.send(now, 7, 10, b"three".to_vec(), 3).unwrap();
    let slices = gather(&mut a, now, 0, &map2, 32, 64);
    assert_eq!(lens(&slices), vec![CONG_MAP_BYTES - 52, 48, 48, 3, 48, 3]);
    assert_eq!(
        &slices[0][..],
        &map.as_bytes()[52..],
        "the snapshot is not torn"
    );
    assert_eq!(a.queued_messages(0), 1);
    assert_eq!(a.counters().cong_map_sent, 1);
    assert!(a.has_pending_transmit(0));
    let bytes = slices.concat();
    a.advance_transmit(0, bytes.len());
    stream.extend_from_slice(&bytes);

    let slices = gather(&mut a, now, 0, &map2, 32, 64);
    assert_eq!(lens(&slices), vec![48, CONG_MAP_BYTES, 48, 5]);
    let bytes = slices.concat();
    a.advance_transmit(0, bytes.len());
    stream.extend_from_slice(&bytes);
    assert_eq!(a.counters().cong_map_sent, 2);

    let out = frames(&stream);
    let summary: Vec<(bool, Vec<u8>)> = out
        .iter()
        .filter(|(h, _)| h.sport != 1)
        .map(|(h, p)| (h.is_cong_bitmap(), p.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (true, map.as_bytes().to_vec()),
            (false, b"one".to_vec()),
            (false, b"two".to_vec()),
            (true, map2.as_bytes().to_vec()),
            (false, b"three".to_vec()),
        ]
    );
}

/// Cancel with several frames started: written messages are released at once, started but
/// unfinished ones (partly written or untouched) once their frame is out; the stream stays
/// well-formed and nothing is released twice.
#[test]
fn cancel_with_several_started_frames_releases_each_once_its_frame_is_out() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = active_attached(now);
    let mut stream = drain(&mut a, now, 0, &map); // map + probe
                                                  // sport 7: 1, 2, 4 (cancelled); sport 8: 3, 5 (kept). 100-byte payloads, 148-byte frames.
    for (token, sport) in [(1u8, 7u16), (2, 7), (3, 8), (4, 7), (5, 8)] {
        a.send(now, sport, 10, vec![token; 100], u64::from(token))
            .unwrap();
    }
    let bytes = gather(&mut a, now, 0, &map, 32, 64).concat();
    assert_eq!(bytes.len(), 5 * 148);
    // Message 1 written, message 2 half written, 3..5 untouched.
    let n = 148 + 70;
    a.advance_transmit(0, n);
    let mut pos = n;
    let _ = events(&mut a);

    assert_eq!(a.cancel_socket(7), 3);
    assert_eq!(
        released(&mut a),
        vec![1],
        "only the written message at once"
    );
    assert_eq!(
        a.unacked_messages(0),
        5,
        "probe and the four started messages"
    );
    assert_eq!(a.queued_messages(0), 0);
    // Finish message 2 except its last byte, then that byte.
    a.advance_transmit(0, 148 * 2 - pos - 1);
    assert!(released(&mut a).is_empty());
    a.advance_transmit(0, 1);
    assert_eq!(released(&mut a), vec![2]);
    pos = 2 * 148;
    // Message 3 (kept) and message 4 (cancelled, untouched until now).
    let slices = gather(&mut a, now, 0, &map, 32, 64);
    assert_eq!(lens(&slices), vec![48, 100, 48, 100, 48, 100]);
    a.advance_transmit(0, 148);
    assert!(released(&mut a).is_empty(), "message 3 is not cancelled");
    a.advance_transmit(0, 148);
    assert_eq!(released(&mut a), vec![4]);
    a.advance_transmit(0, 148);
    assert!(released(&mut a).is_empty());
    pos += 3 * 148;
    assert_eq!(pos, bytes.len());
    assert!(!a.has_pending_transmit(0));
    stream.extend_from_slice(&bytes);

    // The peer reads a well-formed stream (messages already in it are delivered).
    let mut b = passive_up(now);
    let mut got = Vec::new();
    b.handle_stream_data(now, 0, &stream, |d| got.push(d.payload[0]));
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    assert_eq!(frames(&stream).len(), 7);

    assert_eq!(a.unacked_messages(0), 3, "probe, 3 and 5");
    a.handle_acked(0, a.stream_offset(0));
    assert_eq!(released(&mut a), vec![3, 5]);
    assert_eq!(a.counters().cancelled, 3);
}

/// A path dies with frames started: fully written, partly written and untouched ones. Every
/// unacknowledged message goes back to the queue once, in order, flagged RETRANSMITTED with
/// its number; a cancelled unfinished one is released instead.
#[test]
fn path_down_with_several_started_frames_requeues_all_in_order() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = active_attached(now);
    let base = drain(&mut a, now, 0, &map).len();
    a.handle_acked(0, base as u64);
    let _ = events(&mut a);
    // Tokens 1..=6, sequence numbers 2..=7 (the probe is 1); token 5 from another socket.
    for token in 1..=6u8 {
        let sport = if token == 5 { 8 } else { 7 };
        a.send(now, sport, 10, vec![token; 50], u64::from(token))
            .unwrap();
    }
    let bytes = gather(&mut a, now, 0, &map, 32, 64).concat();
    assert_eq!(bytes.len(), 6 * 98);
    // 1 and 2 written, 3 partly, 4..6 untouched; the peer acknowledged message 1.
    a.advance_transmit(0, 98 + 98 + 30);
    a.handle_acked(0, base as u64 + 98);
    assert_eq!(released(&mut a), vec![1]);
    assert_eq!(a.cancel_socket(8), 1);
    assert!(
        released(&mut a).is_empty(),
        "5 is started: released when written"
    );

    now += Duration::from_millis(1);
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(
        events(&mut a),
        vec![
            Event::Released { token: 5, len: 50 },
            Event::Connect { path: 0 }
        ]
    );
    assert_eq!((a.queued_messages(0), a.unacked_messages(0)), (4, 0));
    assert!(!a.has_pending_transmit(0));
    a.handle_connected(now, 0).unwrap();
    let stream = drain_vectored(&mut a, now, 0, &map);
    let out = frames(&stream);
    assert!(out[0].0.is_cong_bitmap());
    let resent: Vec<(u64, u8, u8)> = out[1..5]
        .iter()
        .map(|(h, p)| (h.sequence, h.flags, p[0]))
        .collect();
    let r = flags::RETRANSMITTED;
    assert_eq!(resent, vec![(3, r, 2), (4, r, 3), (5, r, 4), (7, r, 6)]);
    assert_eq!(
        (out[5].0.sport, out[5].0.sequence),
        (1, 8),
        "then a new probe"
    );
    assert_eq!(out.len(), 6);
    assert_eq!(a.counters().tx_retransmits, 4);
    a.handle_acked(0, stream.len() as u64);
    assert_eq!(released(&mut a), vec![2, 3, 4, 6]);
    assert!(!a.has_pending_messages());
}

/// A path dies right after a vectored poll, before the socket took anything: the gathered
/// messages were only started, and all of them are resent.
#[test]
fn path_down_after_a_vectored_poll_with_nothing_written_loses_nothing() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = loaded(now);
    let slices = gather(&mut a, now, 0, &map, 32, 64);
    assert_eq!(slices.len(), 12);
    a.advance_transmit(0, 0);
    now += Duration::from_millis(1);
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    assert_eq!(
        a.queued_messages(0),
        5,
        "five messages; a started probe is not resent"
    );
    a.handle_connected(now, 0).unwrap();
    let out = frames(&drain_vectored(&mut a, now, 0, &map));
    let seqs: Vec<(u64, u8)> = out.iter().map(|(h, _)| (h.sequence, h.flags)).collect();
    let r = flags::RETRANSMITTED;
    assert_eq!(
        seqs,
        vec![
            (0, flags::CONG_BITMAP),
            (2, r),
            (3, r),
            (4, r),
            (5, r),
            (6, r),
            (7, 0)
        ]
    );
    assert_eq!(a.counters().cong_map_sent, 2);
}

/// A map frame that was gathered but not (completely) written when its path died is pending
/// again, so another path sends it; also when it sat behind a message frame.
#[test]
fn gathered_but_unwritten_map_goes_out_on_another_path() {
    let now = Instant::ZERO;
    let mut b = passive_two_paths(now);
    let mut map = CongMap::new();
    drain(&mut b, now, 0, &map);
    drain(&mut b, now, 1, &map);
    // Path 0's probe is acknowledged and answered: data may go on path 1 (fan-out barrier).
    b.handle_acked(0, b.stream_offset(0));
    answer_probe(&mut b, now);
    assert!(!b.has_pending_transmit(0) && !b.has_pending_transmit(1));

    // Path 1 gathers the map and writes nothing.
    map.set(4242);
    b.local_congestion_changed();
    assert_eq!(
        lens(&gather(&mut b, now, 1, &map, 32, 64)),
        vec![48, CONG_MAP_BYTES]
    );
    assert!(!b.has_pending_transmit(0), "the map is taken by path 1");
    b.advance_transmit(1, 0);
    b.handle_path_down(now, 1).unwrap();
    let out = frames(&drain_vectored(&mut b, now, 0, &map));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].1.as_slice(), &map.as_bytes()[..]);

    // Path 1 again, the map gathered behind a message of path 1's socket whose frame is
    // partly written.
    assert_eq!(b.handle_accepted(now, 40009), Ok(1));
    drain(&mut b, now, 1, &map);
    let sport = (2000..).find(|&p| b.route(p, 3000) == 1).unwrap();
    b.send(now, sport, 10, vec![7; 100], 1).unwrap();
    assert_eq!(lens(&gather(&mut b, now, 1, &map, 1, 64)), vec![48, 100]);
    map.clear(4242);
    b.local_congestion_changed();
    assert_eq!(
        lens(&gather(&mut b, now, 1, &map, 32, 64)),
        vec![48, 100, 48, CONG_MAP_BYTES]
    );
    b.advance_transmit(1, 60);
    b.handle_path_down(now, 1).unwrap();
    assert!(b.has_pending_transmit(0));
    let out = frames(&drain_vectored(&mut b, now, 0, &map));
    assert_eq!(out.len(), 1);
    assert!(out[0].0.is_cong_bitmap());
    assert_eq!(out[0].1.as_slice(), &map.as_bytes()[..]);
    assert_eq!(b.counters().cong_map_sent, 6);
}

/// A probe pong (sport 0 → dport 1) from a peer of `generation`, offering `npaths`.
fn probe_pong(seq: u64, npaths: u16, generation: u32) -> Vec<u8> {
    let mut ext = ExtHeaders::new();
    ext.push(ExtHeader::NPaths(npaths)).unwrap();
    ext.push(ExtHeader::GenNum(generation)).unwrap();
    HeaderRepr {
        sequence: seq,
        sport: 0,
        dport: 1,
        exthdr: ext,
        ..Default::default()
    }
    .to_bytes()
    .to_vec()
}

/// A socket's messages move from path 0 to its hashed path when the handshake completes. TCP
/// acknowledging path 0 is not enough to let them go: the peer may not have read those bytes
/// (a receiver that paused the path because a ring was full). Data on other paths waits for
/// the pong to a probe ping queued behind everything path 0 carried before the switch.
#[test]
fn fan_out_waits_for_the_pong_behind_what_path_zero_carried() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = conn(ADDR_A, ADDR_B, GEN_A);
    a.open(now);
    let _ = events(&mut a);
    a.handle_connected(now, 0).unwrap();
    let two = passive_two_paths(now);
    let sport = (2000..).find(|&p| two.route(p, 3000) == 1).unwrap();
    for i in 0..3u8 {
        a.send(now, sport, 10, vec![i; 8], u64::from(i)).unwrap();
    }
    // Before the handshake's pong, data waits on path 0 (the data gate).
    let sent = frames(&drain(&mut a, now, 0, &map));
    assert_eq!(sent.len(), 2, "map and probe; the data waits for the pong");
    a.handle_acked(0, a.stream_offset(0));
    // The pong to the handshake probe: two paths.
    assert!(feed(&mut a, 0, &probe_pong(1, 2, GEN_B)).is_empty());
    assert_eq!(a.npaths(), Some(2));
    a.send(now, sport, 10, vec![9; 8], 9).unwrap();
    assert!(events(&mut a).contains(&Event::Connect { path: 1 }));
    a.handle_connected(now, 1).unwrap();
    let data = |out: Vec<(HeaderRepr, Vec<u8>)>| -> usize {
        out.iter().filter(|(h, _)| !h.is_cong_bitmap()).count()
    };
    assert_eq!(
        data(frames(&drain(&mut a, now, 1, &map))),
        0,
        "path 0 still carries the socket's earlier messages"
    );
    // They go out on path 0 with the barrier ping behind them; TCP acknowledges all of it;
    // still no pong.
    let ping = frames(&drain(&mut a, now, 0, &map));
    assert_eq!(ping.len(), 4);
    assert_eq!((ping[3].0.sport, ping[3].0.dport), (1, 0));
    a.handle_acked(0, a.stream_offset(0));
    assert!(!a.has_pending_transmit(1));
    // A pong flagged RETRANSMITTED answers a ping of an earlier connection: not this one.
    let mut stale = HeaderRepr::parse_bytes(&probe_pong(2, 2, GEN_B)).unwrap();
    stale.flags |= flags::RETRANSMITTED;
    assert!(feed(&mut a, 0, &stale.to_bytes()).is_empty());
    assert!(!a.has_pending_transmit(1));
    // Its pong: the peer has processed everything before it; path 1 may carry data.
    assert!(feed(&mut a, 0, &probe_pong(3, 2, GEN_B)).is_empty());
    let out = frames(&drain(&mut a, now, 1, &map));
    assert_eq!(out.last().unwrap().1, vec![9; 8]);

    // No timeout while the peer is silent: a paused receiver answers once it drains.
    let silent = now + Duration::from_secs(30);
    let mut b2 = conn(ADDR_A, ADDR_B, GEN_A);
    b2.open(now);
    let _ = events(&mut b2);
    b2.handle_connected(now, 0).unwrap();
    b2.send(now, sport, 10, vec![1; 8], 1).unwrap();
    drain(&mut b2, now, 0, &map);
    b2.handle_acked(0, b2.stream_offset(0));
    assert!(feed(&mut b2, 0, &probe_pong(1, 2, GEN_B)).is_empty());
    let _ = events(&mut b2);
    b2.handle_connected(now, 1).unwrap();
    b2.send(now, sport, 10, vec![2; 8], 2).unwrap();
    // The barrier ping goes out; neither acknowledged nor answered.
    drain(&mut b2, now, 0, &map);
    b2.handle_timeout(silent);
    assert!(!b2.has_pending_transmit(1), "still waiting for the pong");

    // Path 0 drops before the pong: the barrier ping is not resent (a peer that had processed
    // it would drop a RETRANSMITTED copy and never answer); a fresh one goes behind the resent
    // data, and its pong releases the barrier.
    now = silent;
    b2.handle_path_down(now, 0).unwrap();
    let _ = events(&mut b2);
    b2.handle_timeout(now + Duration::from_secs(2));
    let _ = events(&mut b2);
    if b2.path_state(0) != PathState::Connecting {
        b2.open(now);
        let _ = events(&mut b2);
    }
    b2.handle_connected(now, 0).unwrap();
    let resent = frames(&drain(&mut b2, now, 0, &map));
    let kinds: Vec<(u16, bool)> = resent
        .iter()
        .filter(|(h, _)| !h.is_cong_bitmap())
        .map(|(h, _)| (h.sport, h.flags & flags::RETRANSMITTED != 0))
        .collect();
    assert_eq!(
        kinds,
        vec![(sport, true), (1, false)],
        "the message resent, then a fresh ping, not a RETRANSMITTED copy"
    );
    b2.handle_acked(0, b2.stream_offset(0));
    b2.handle_timeout(now + Duration::from_secs(30));
    assert!(
        !b2.has_pending_transmit(1),
        "no timeout: waits for the pong"
    );
    assert!(feed(&mut b2, 0, &probe_pong(1, 2, GEN_B)).is_empty());
    assert!(b2.has_pending_transmit(1) || b2.path_state(1) != PathState::Up);
}

/// The 6.1 kernel, as the larger address, can drop an accepted path 0 whose bytes TCP had
/// acknowledged before its RDS layer took the socket (interop test a3). Data on a fresh
/// path-0 connection therefore waits for the pong to the probe: nothing acknowledged before it
/// can be a message; control messages overtake the waiting data; a peer that never answers
/// holds the data up for `reconnect_max` at most.
#[test]
fn data_on_a_fresh_path_zero_waits_for_the_pong() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = conn(ADDR_A, ADDR_B, GEN_A);
    for i in 0..3u8 {
        a.send(now, 7, 10, vec![i; 8], u64::from(i)).unwrap();
    }
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    a.handle_connected(now, 0).unwrap();
    let out = frames(&drain(&mut a, now, 0, &map));
    let ports: Vec<(u16, u16)> = out.iter().map(|(h, _)| (h.sport, h.dport)).collect();
    assert_eq!(ports, vec![(0, 0), (1, 0)], "map and probe only");
    // The peer's own ping is answered at once, ahead of the waiting data.
    let ping = message(1, 9, 0, 0, &[]);
    assert!(feed(&mut a, 0, &ping).is_empty());
    let out = frames(&drain(&mut a, now, 0, &map));
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].0.sport, out[0].0.dport), (0, 9));
    // TCP acknowledges all of it, then the peer drops the connection: no message was in it.
    a.handle_acked(0, a.stream_offset(0));
    assert!(released(&mut a).is_empty());
    now += Duration::from_millis(1);
    a.handle_path_down(now, 0).unwrap();
    let _ = events(&mut a);
    now += Duration::from_millis(1);
    a.handle_timeout(now);
    let _ = events(&mut a);
    a.handle_connected(now, 0).unwrap();
    let out = frames(&drain(&mut a, now, 0, &map));
    assert_eq!(out.len(), 2, "again map and a fresh probe only");
    assert_eq!(out[1].0.flags & flags::RETRANSMITTED, 0);
    // The pong opens the gate: the messages go out, first-time (not RETRANSMITTED).
    attach(&mut a);
    let out = frames(&drain(&mut a, now, 0, &map));
    let got: Vec<(u8, u8)> = out.iter().map(|(h, p)| (p[0], h.flags)).collect();
    assert_eq!(got, vec![(0, 0), (1, 0), (2, 0)]);
    assert_eq!(a.counters().path0_gate_timeouts, 0);

    // A peer that never pongs: the data goes at the deadline.
    let mut b = conn(ADDR_A, ADDR_B, GEN_A);
    b.send(now, 7, 10, vec![5; 8], 5).unwrap();
    let _ = events(&mut b);
    b.handle_connected(now, 0).unwrap();
    assert_eq!(frames(&drain(&mut b, now, 0, &map)).len(), 2);
    let deadline = b.poll_timeout().expect("the gate's deadline");
    assert_eq!(deadline, now + Duration::from_secs(1));
    b.handle_timeout(deadline);
    assert_eq!(b.counters().path0_gate_timeouts, 1);
    let out = frames(&drain(&mut b, deadline, 0, &map));
    assert_eq!(out.last().unwrap().1, vec![5; 8]);
}

/// Paths > 0 connect one at a time in index order, so that a peer mapping accepted
/// connections to its first free path (no SPORT_IDX) gets them in path order even when a SYN
/// is lost.
#[test]
fn paths_connect_one_at_a_time_in_index_order() {
    let now = Instant::ZERO;
    let mut a = active_up(now);
    assert!(feed(&mut a, 0, &probe_pong(1, 4, GEN_B)).is_empty());
    let connects = |a: &mut Connection<Vec<u8>>| -> Vec<usize> {
        events(a)
            .into_iter()
            .filter_map(|e| match e {
                Event::Connect { path } => Some(path),
                _ => None,
            })
            .collect()
    };
    assert_eq!(connects(&mut a), vec![1]);
    a.handle_connected(now, 1).unwrap();
    assert_eq!(connects(&mut a), vec![2]);
    a.handle_connected(now, 2).unwrap();
    assert_eq!(connects(&mut a), vec![3]);
    a.handle_connected(now, 3).unwrap();
    assert!(connects(&mut a).is_empty());
    // Two paths drop: they reconnect in order too.
    a.handle_path_down(now, 3).unwrap();
    a.handle_path_down(now, 2).unwrap();
    assert_eq!(connects(&mut a), vec![]);
    // Path 0 re-probes first (a path > 0 dropped); its pong lets path 2, then path 3, connect
    // (after their backoff: the peer never sent a frame on them).
    let _ = drain(&mut a, now, 0, &CongMap::new());
    assert!(feed(&mut a, 0, &probe_pong(2, 4, GEN_B)).is_empty());
    let later = now + Duration::from_secs(1);
    a.handle_timeout(later);
    assert_eq!(connects(&mut a), vec![2]);
    a.handle_connected(later, 2).unwrap();
    a.handle_timeout(later + Duration::from_secs(1));
    assert_eq!(connects(&mut a), vec![3]);
}

/// `Connection::open`, which every send calls, does nothing once the connection is opened: the
/// state changes schedule the paths themselves. A path that goes down (path 0 and a path > 0),
/// whose connects fail, or that waits for path 0's confirmation, is reconnected by its
/// reconnect timer however many sends come in between, and the sends add no connect of
/// their own.
#[test]
fn paths_that_go_down_reconnect_while_sends_keep_coming() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = active_up(now);
    assert!(feed(&mut a, 0, &probe_pong(1, 2, GEN_B)).is_empty());
    assert!(events(&mut a).contains(&Event::Connect { path: 1 }));
    a.handle_connected(now, 1).unwrap();
    let _ = drain(&mut a, now, 0, &map);
    assert!(feed(&mut a, 0, &probe_pong(2, 2, GEN_B)).is_empty());
    let _ = events(&mut a);
    let sport = [
        (2000..).find(|&p| a.route(p, 3000) == 0).unwrap(),
        (2000..).find(|&p| a.route(p, 3000) == 1).unwrap(),
    ];
    let mut token = 0;
    // Sends on both paths; the engine's events (connects only) after them.
    let mut send_burst = |a: &mut Connection<Vec<u8>>, now: Instant| -> Vec<usize> {
        for _ in 0..50 {
            for &port in &sport {
                token += 1;
                a.send(now, port, 10, vec![7; 8], token).unwrap();
            }
        }
        events(a)
            .into_iter()
            .map(|e| match e {
                Event::Connect { path } => path,
                e => panic!("a send caused {e:?}"),
            })
            .collect()
    };
    assert!(send_burst(&mut a, now).is_empty());

    // Path 1 drops: path 0 probes again; sends meanwhile connect nothing.
    a.handle_path_down(now, 1).unwrap();
    assert!(events(&mut a).is_empty(), "waits for path 0's pong");
    assert!(send_burst(&mut a, now).is_empty());
    let _ = drain(&mut a, now, 0, &map);
    assert!(feed(&mut a, 0, &probe_pong(3, 2, GEN_B)).is_empty());
    // The pong schedules it (after a backoff: the peer never sent a frame on path 1).
    let connect_paths = |a: &mut Connection<Vec<u8>>| -> Vec<usize> {
        events(a)
            .into_iter()
            .filter_map(|e| match e {
                Event::Connect { path } => Some(path),
                _ => None,
            })
            .collect()
    };
    let mut connects = connect_paths(&mut a);
    for pong in 4..7 {
        // Connects that fail, sends in between: the timer survives them.
        if connects.is_empty() {
            assert!(send_burst(&mut a, now).is_empty());
            let at = a.poll_timeout().expect("path 1's reconnect timer");
            assert!(send_burst(&mut a, now).is_empty());
            assert_eq!(a.poll_timeout(), Some(at), "sends leave the timer alone");
            now = at;
            a.handle_timeout(now);
            connects = connect_paths(&mut a);
        }
        assert_eq!(connects, vec![1]);
        assert_eq!(a.path_state(1), PathState::Connecting);
        assert!(send_burst(&mut a, now).is_empty(), "already connecting");
        // Refused: path 1 waits for a fresh pong on path 0 again, then for its timer.
        a.handle_path_down(now, 1).unwrap();
        assert!(connect_paths(&mut a).is_empty());
        assert!(send_burst(&mut a, now).is_empty());
        let _ = drain(&mut a, now, 0, &map);
        assert!(feed(&mut a, 0, &probe_pong(pong, 2, GEN_B)).is_empty());
        connects = connect_paths(&mut a);
    }
    if connects.is_empty() {
        now = a.poll_timeout().expect("path 1's reconnect timer");
        a.handle_timeout(now);
        connects = connect_paths(&mut a);
    }
    assert_eq!(connects, vec![1]);
    a.handle_connected(now, 1).unwrap();

    // Path 0 drops: it reconnects at once (the peer spoke on it), then, refused, by timer.
    a.handle_path_down(now, 0).unwrap();
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    assert!(send_burst(&mut a, now).is_empty());
    a.handle_path_down(now, 0).unwrap();
    assert!(events(&mut a).is_empty());
    assert!(send_burst(&mut a, now).is_empty());
    now = a.poll_timeout().expect("path 0's reconnect timer");
    assert!(
        send_burst(&mut a, now).is_empty(),
        "not a send: the timer connects"
    );
    a.handle_timeout(now);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    assert_eq!(a.path_state(0), PathState::Connecting);
}

/// A doorbell (an inbound connection to the active side) opens a closed connection as a send
/// would: every path it wants is connecting or has a reconnect timer. Here path 1, whose timer
/// the close cleared while path 0, still confirmed, is closing.
#[test]
fn a_doorbell_after_close_schedules_every_wanted_path() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = active_up(now);
    assert!(feed(&mut a, 0, &probe_pong(1, 2, GEN_B)).is_empty());
    assert!(events(&mut a).contains(&Event::Connect { path: 1 }));
    // The connect fails; the next pong gives path 1 a reconnect timer.
    a.handle_path_down(now, 1).unwrap();
    let _ = drain(&mut a, now, 0, &map);
    assert!(feed(&mut a, 0, &probe_pong(2, 2, GEN_B)).is_empty());
    assert!(events(&mut a).is_empty());
    assert!(a.poll_timeout().is_some());
    a.close(now);
    assert_eq!(events(&mut a), vec![Event::Close { path: 0 }]);
    assert_eq!(a.poll_timeout(), None, "closed: no reconnect");
    assert_eq!(a.handle_accepted(now, 40000), Err(AcceptError::WeConnect));
    let connects = events(&mut a);
    assert!(
        connects.contains(&Event::Connect { path: 1 }) || a.poll_timeout().is_some(),
        "{connects:?}"
    );
    a.handle_path_down(now, 0).unwrap();
    assert!(events(&mut a).contains(&Event::Connect { path: 0 }));
}

/// Bytes `from` has for `from_path`, fed to `to` on `to_path`; TCP acknowledges them to `from`
/// when `acked`. Returns the payloads `to` delivered, recording them in `persisted`.
fn carry(
    (from, from_path): (&mut Connection<Vec<u8>>, usize),
    (to, to_path): (&mut Connection<Vec<u8>>, usize),
    acked: bool,
    persisted: &mut util::PersistedRx,
) -> Vec<Vec<u8>> {
    let bytes = drain(from, Instant::ZERO, from_path, &CongMap::new());
    if acked {
        from.handle_acked(from_path, from.stream_offset(from_path));
    }
    let mut got = Vec::new();
    to.handle_stream_data(Instant::ZERO, to_path, &bytes, |d| {
        persisted.record(&d);
        got.push(d.payload.to_vec());
    });
    persisted.sync_generation(to.peer_generation());
    got
}

/// A's connect for path 1 is in flight (its SYN unanswered) when B is SIGKILLed after
/// delivering messages whose TCP acknowledgements A never got. Restarted with its receive state
/// restored, B takes the first connection it accepts, A's path 1, for its path 0 (kernel TCP
/// has no SPORT_IDX). Had A resent its path-0 messages on B's path 1 (numbers 0 there), B would
/// deliver them twice (seen in `receiver_restart_soon_after_restart_no_duplicates`, rdsd-tests).
/// A sends nothing judged by sequence number on a new path > 0 before a fresh pong on path 0,
/// and closes it when B's probe ping comes on it; its path 0 then gets B's path 0.
#[test]
fn connect_in_flight_across_a_peer_restart_is_not_taken_for_path_zero() {
    let config = |local, peer, generation, seed| {
        let mut c = util::config(local, peer, 2, generation, seed);
        c.sport_idx = false;
        c
    };
    let mut now = Instant::ZERO;
    let mut a = Connection::new(config(ADDR_A, ADDR_B, GEN_A, 1)).unwrap();
    let mut b1 = Connection::new(config(ADDR_B, ADDR_A, GEN_B, 2)).unwrap();
    let mut b1_state = util::PersistedRx::default();
    a.open(now);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    a.handle_connected(now, 0).unwrap();
    assert_eq!(b1.handle_accepted(now, 40000), Ok(0));
    for _ in 0..3 {
        carry((&mut a, 0), (&mut b1, 0), true, &mut b1_state);
        carry((&mut b1, 0), (&mut a, 0), true, &mut b1_state.clone());
    }
    assert_eq!(a.npaths(), Some(2));
    // Path 1's connect goes out; B never answers it.
    assert!(events(&mut a).contains(&Event::Connect { path: 1 }));

    // B delivers five messages of a socket on path 0; their ACKs are lost.
    let sport = (2000..).find(|&p| a.route(p, 3000) == 0).unwrap();
    for i in 0..5u8 {
        a.send(now, sport, 10, vec![i; 8], u64::from(i)).unwrap();
    }
    let first = carry((&mut a, 0), (&mut b1, 0), false, &mut b1_state);
    assert_eq!(first.len(), 5);
    assert_eq!(a.unacked_messages(0), 5);

    // B restarts with what it persisted; the SYN of A's path 1 reaches it first.
    let mut b2 = Connection::new(config(ADDR_B, ADDR_A, GEN_B + 1, 3)).unwrap();
    b2.restore_rx_state(b1_state.peer_generation, b1_state.next_rx_seq);
    let mut b2_state = b1_state;
    a.handle_connected(now, 1).unwrap();
    assert_eq!(b2.handle_accepted(now, 40001), Ok(0), "first free path");
    let mut again = Vec::new();
    for _ in 0..3 {
        again.extend(carry((&mut a, 1), (&mut b2, 0), true, &mut b2_state));
        carry(
            (&mut b2, 0),
            (&mut a, 1),
            true,
            &mut util::PersistedRx::default(),
        );
    }
    assert_eq!(a.counters().path_mismaps, 1);
    assert!(events(&mut a).contains(&Event::Close { path: 1 }));
    a.handle_path_down(now, 1).unwrap();
    b2.handle_path_down(now, 0).unwrap();

    // A's path 0, still a connection to the dead B, fails; A reconnects it.
    a.handle_path_down(now, 0).unwrap();
    while !events(&mut a).contains(&Event::Connect { path: 0 }) {
        now += Duration::from_millis(10);
        a.handle_timeout(now);
    }
    a.handle_connected(now, 0).unwrap();
    let b2_path = b2.handle_accepted(now, 40002).unwrap();
    assert_eq!(b2_path, 0, "B's path 0 is A's path 0");
    for i in 5..7u8 {
        a.send(now, sport, 10, vec![i; 8], u64::from(i)).unwrap();
    }
    for _ in 0..4 {
        again.extend(carry((&mut a, 0), (&mut b2, b2_path), true, &mut b2_state));
        carry(
            (&mut b2, b2_path),
            (&mut a, 0),
            true,
            &mut util::PersistedRx::default(),
        );
    }
    assert_eq!(
        again,
        vec![vec![5; 8], vec![6; 8]],
        "no message delivered twice, none lost"
    );
    assert!(
        b2.counters().rx_drop_dup_seq >= 5,
        "the resends were judged"
    );
}

/// The case no probe on a path > 0 shows: A's connect for path 2 is in flight when B restarts,
/// and B's new incarnation would take it for its first free path (1) once A's path 0 is back.
/// The new generation, seen on path 0 before any pong of the new B, closes every path > 0 that
/// is connecting or not yet confirmed; a confirmed one (to the old B) fails by itself.
#[test]
fn paths_connected_before_a_peer_restart_are_closed_unless_confirmed() {
    let mut config = util::config(ADDR_A, ADDR_B, 3, GEN_A, 1);
    config.sport_idx = false;
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut a = Connection::new(config).unwrap();
    a.open(now);
    assert_eq!(events(&mut a), vec![Event::Connect { path: 0 }]);
    a.handle_connected(now, 0).unwrap();
    drain(&mut a, now, 0, &map);
    assert!(feed(&mut a, 0, &probe_pong(1, 3, GEN_B)).is_empty());
    assert!(events(&mut a).contains(&Event::Connect { path: 1 }));
    a.handle_connected(now, 1).unwrap();
    let sport = (2000..).find(|&p| a.route(p, 3000) == 1).unwrap();
    a.send(now, sport, 10, vec![1; 8], 1).unwrap();
    let out = frames(&drain(&mut a, now, 1, &map));
    assert!(
        out.iter().all(|(h, _)| h.is_cong_bitmap()),
        "path 1 sends only the map before a fresh pong"
    );
    let ping = frames(&drain(&mut a, now, 0, &map));
    assert_eq!((ping[0].0.sport, ping[0].0.dport), (1, 0));
    a.handle_acked(0, a.stream_offset(0));
    assert!(feed(&mut a, 0, &probe_pong(2, 3, GEN_B)).is_empty());
    assert!(a.has_pending_transmit(1));
    assert!(events(&mut a).contains(&Event::Connect { path: 2 }));

    // B restarts; A's path 0 comes back to the new B, whose probe is the first message.
    a.handle_path_down(now, 0).unwrap();
    let _ = events(&mut a);
    if a.path_state(0) != PathState::Connecting {
        a.handle_timeout(now + Duration::from_secs(1));
        let _ = events(&mut a);
    }
    a.handle_connected(now, 0).unwrap();
    assert!(feed(&mut a, 0, &probe(1, Some(GEN_B + 1))).is_empty());
    let evs = events(&mut a);
    assert!(evs.contains(&Event::Close { path: 2 }), "{evs:?}");
    assert!(!evs.contains(&Event::Close { path: 1 }), "{evs:?}");
    assert_eq!(a.path_state(1), PathState::Up);
    assert_eq!(a.path_state(2), PathState::Disconnecting);
}

/// Passive side with 3 paths up, classic mapping (a kernel peer: NPATHS 3, no SPORT_IDX, no
/// GEN_NUM), everything written so far.
fn passive_three_classic(now: Instant, map: &CongMap) -> Connection<Vec<u8>> {
    let mut b = passive_up(now);
    let mut ext = ExtHeaders::new();
    ext.push(ExtHeader::NPaths(3)).unwrap();
    let ping = HeaderRepr {
        sequence: 1,
        sport: 1,
        dport: 0,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &ping.to_bytes(), |_| panic!("probe delivered"));
    assert_eq!(b.handle_accepted(now, 50001), Ok(1));
    assert_eq!(b.handle_accepted(now, 50003), Ok(2));
    // The peer answers our probe pings on path 0 (the handshake's and the fan-out barrier's).
    let probes = frames(&drain(&mut b, now, 0, map))
        .iter()
        .filter(|(h, _)| (h.sport, h.dport) == (1, 0))
        .count();
    b.handle_acked(0, b.stream_offset(0));
    for k in 0..probes {
        let mut ext = ExtHeaders::new();
        ext.push(ExtHeader::NPaths(3)).unwrap();
        let pong = HeaderRepr {
            sequence: 2 + k as u64,
            sport: 0,
            dport: 1,
            exthdr: ext,
            ..Default::default()
        };
        b.handle_stream_data(now, 0, &pong.to_bytes(), |_| panic!("pong delivered"));
    }
    for path in 0..3 {
        drain(&mut b, now, path, map);
        assert!(!b.has_pending_transmit(path));
    }
    let _ = events(&mut b);
    b
}

/// The liveness pings (sport LIVENESS_PORT, dport 0, no payload) in what a path wrote.
fn liveness_pings(stream: &[u8]) -> Vec<u64> {
    frames(stream)
        .into_iter()
        .filter(|(h, _)| (h.sport, h.dport) == (rds_proto::wire::LIVENESS_PORT, 0))
        .map(|(h, _)| h.sequence)
        .collect()
}

fn liveness_pong(seq: u64) -> Vec<u8> {
    message(seq, 0, rds_proto::wire::LIVENESS_PORT, 0, &[])
}

/// f4 of the VM lab: the active peer rebooted without a FIN, and our old paths to it look up
/// forever (their keepalive probes were acknowledged). Its connect while all our paths are up
/// is reset as before (classic mapping), but starts a liveness check: a ping on every up
/// path; the paths that answer stay, the others are closed at the deadline, and the peer's
/// next connect takes the freed path.
#[test]
fn a_connect_while_all_paths_are_up_closes_the_paths_that_do_not_answer_a_ping() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut b = passive_three_classic(now, &map);
    assert_eq!(
        b.handle_accepted(now, 50005),
        Err(AcceptError::CheckingPaths)
    );
    assert_eq!(b.counters().liveness_checks, 1);
    let pings: Vec<Vec<u64>> = (0..3)
        .map(|p| liveness_pings(&drain(&mut b, now, p, &map)))
        .collect();
    assert!(pings.iter().all(|p| p.len() == 1), "{pings:?}");
    // The connection is offered again (each pass) while the check runs: nothing new starts.
    assert_eq!(
        b.handle_accepted(now, 50005),
        Err(AcceptError::CheckingPaths)
    );
    assert_eq!(b.counters().liveness_checks, 1);
    assert!((0..3).all(|p| !b.has_pending_transmit(p)));

    // Paths 0 and 2 answer; their pongs are not delivered to a socket.
    assert!(feed(&mut b, 0, &liveness_pong(2)).is_empty());
    assert!(feed(&mut b, 2, &liveness_pong(1)).is_empty());
    let deadline = b.poll_timeout().expect("the check's deadline");
    assert_eq!(deadline, now + Duration::from_secs(3));
    b.handle_timeout(now + (Duration::from_secs(3) - Duration::from_nanos(1)));
    assert!(events(&mut b).is_empty());
    b.handle_timeout(deadline);
    assert_eq!(events(&mut b), vec![Event::Close { path: 1 }]);
    assert_eq!(b.counters().stale_paths_closed, 1);
    b.handle_path_down(deadline, 1).unwrap();
    assert_eq!(
        b.handle_accepted(deadline, 50005),
        Ok(1),
        "the waiting connection"
    );
    assert_eq!(
        (b.path_state(0), b.path_state(2)),
        (PathState::Up, PathState::Up)
    );
}

/// All paths answer: nothing is closed, the waiting connection is refused, and the next check
/// waits for the timeout however often the peer retries. A pong to LIVENESS_PORT that no check
/// waits for is an ordinary pong for a socket bound there.
#[test]
fn liveness_checks_are_one_at_a_time_and_at_most_one_per_timeout() {
    let mut now = Instant::ZERO;
    let map = CongMap::new();
    let mut b = passive_three_classic(now, &map);
    assert_eq!(
        b.handle_accepted(now, 50005),
        Err(AcceptError::CheckingPaths)
    );
    for path in 0..3 {
        assert_eq!(liveness_pings(&drain(&mut b, now, path, &map)).len(), 1);
        assert!(feed(&mut b, path, &liveness_pong(10)).is_empty());
    }
    assert_eq!(b.poll_timeout(), None, "the check ended with the last pong");
    assert_eq!(b.handle_accepted(now, 50005), Err(AcceptError::NoFreePath));
    now += Duration::from_secs(1);
    assert_eq!(b.handle_accepted(now, 50007), Err(AcceptError::NoFreePath));
    assert_eq!(b.counters().liveness_checks, 1);
    assert!((0..3).all(|p| !b.has_pending_transmit(p)));
    assert_eq!(
        feed(&mut b, 1, &liveness_pong(11)).len(),
        1,
        "an app's pong"
    );
    now += Duration::from_secs(2);
    assert_eq!(
        b.handle_accepted(now, 50009),
        Err(AcceptError::CheckingPaths)
    );
    assert_eq!(b.counters().liveness_checks, 2);
    assert_eq!(b.counters().stale_paths_closed, 0);
    // The active side never checks: it connects, the peer does not.
    let mut a = active_up(now);
    assert_eq!(a.handle_accepted(now, 40000), Err(AcceptError::WeConnect));
    assert_eq!(a.counters().liveness_checks, 0);
}

/// Exactly-once across a stale path closed by the check: what it carried unacknowledged is
/// resent with RETRANSMITTED and its original numbers on the path's next connection; the
/// liveness ping is not resent; the receive numbers of the path are kept.
#[test]
fn a_stale_path_closed_by_the_check_resends_its_unacknowledged_messages() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut b = passive_three_classic(now, &map);
    let sport = (2000..).find(|&p| b.route(p, 3000) == 1).unwrap();
    b.send(now, sport, 9, vec![7; 20], 1).unwrap();
    b.send(now, sport, 9, vec![8; 20], 2).unwrap();
    let sent = frames(&drain(&mut b, now, 1, &map));
    assert_eq!(
        feed(&mut b, 1, &message(4, 77, 9, 0, b"from the old peer")).len(),
        1
    );
    assert_eq!(
        b.handle_accepted(now, 50005),
        Err(AcceptError::CheckingPaths)
    );
    let ping = liveness_pings(&drain(&mut b, now, 1, &map));
    assert_eq!(ping.len(), 1);
    for path in [0, 2] {
        drain(&mut b, now, path, &map);
        assert!(feed(&mut b, path, &liveness_pong(20)).is_empty());
    }
    let deadline = b.poll_timeout().unwrap();
    b.handle_timeout(deadline);
    assert_eq!(events(&mut b), vec![Event::Close { path: 1 }]);
    b.handle_path_down(deadline, 1).unwrap();
    assert_eq!(b.handle_accepted(deadline, 50005), Ok(1));
    let resent = frames(&drain(&mut b, deadline, 1, &map));
    let data: Vec<(u64, bool)> = resent
        .iter()
        .filter(|(h, _)| h.sport == sport)
        .map(|(h, _)| (h.sequence, h.flags & flags::RETRANSMITTED != 0))
        .collect();
    let want: Vec<(u64, bool)> = sent
        .iter()
        .filter(|(h, _)| h.sport == sport)
        .map(|(h, _)| (h.sequence, true))
        .collect();
    assert_eq!((data.len(), &data), (2, &want));
    assert!(
        resent
            .iter()
            .all(|(h, _)| h.sport != rds_proto::wire::LIVENESS_PORT),
        "the liveness ping is not resent"
    );
    assert_eq!(b.next_rx_seq(1), 5, "receive numbers survive the reconnect");
}

/// VM lab e2 (a kernel connecting at connection start): the kernel takes our probe's NPATHS and
/// connects its paths > 0 at once, writing data on them, possibly before its own probe or pong
/// has reached us. Such a connection waits for the path count instead of being reset (a reset
/// after TCP acknowledged its data loses that data: RDS/TCP takes the acknowledgement as
/// delivery), then takes the first free path.
#[test]
fn a_path_connected_before_we_know_the_path_count_waits_for_it() {
    let now = Instant::ZERO;
    let map = CongMap::new();
    let mut b = passive_up(now);
    drain(&mut b, now, 0, &map);
    assert_eq!(
        b.handle_accepted(now, 50001),
        Err(AcceptError::CheckingPaths)
    );
    assert_eq!(
        b.handle_accepted(now, 50003),
        Err(AcceptError::CheckingPaths)
    );
    let mut ext = ExtHeaders::new();
    ext.push(ExtHeader::NPaths(8)).unwrap();
    let pong = HeaderRepr {
        sequence: 1,
        sport: 0,
        dport: 1,
        exthdr: ext,
        ..Default::default()
    };
    b.handle_stream_data(now, 0, &pong.to_bytes(), |_| panic!("pong delivered"));
    assert_eq!(b.handle_accepted(now, 50001), Ok(1));
    assert_eq!(b.handle_accepted(now, 50003), Ok(2));
    assert_eq!(b.counters().accepts_rejected, 0);
}

/// VM lab f1: after our restart a classic kernel (no GEN_NUM, no SPORT_IDX) reconnects its
/// paths at once and may land on other indices; its resends are judged by the highest restored
/// number, so one we had delivered is dropped on whichever path it comes back.
#[test]
fn restored_numbers_of_a_peer_without_gen_num_hold_on_every_path() {
    let now = Instant::ZERO;
    let mut b = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    let mut next = [0u64; MAX_PATHS];
    next[3] = 30;
    b.restore_rx_state(0, next);
    assert_eq!(b.rx_state(), (0, [30; MAX_PATHS]));
    assert_eq!(b.handle_accepted(now, 40000), Ok(0));
    let r = flags::RETRANSMITTED;
    let mut stream = message(29, 9, 10, r, b"delivered before our restart");
    stream.extend(message(30, 9, 10, r, b"not delivered"));
    stream.extend(message(31, 9, 10, 0, b"new"));
    let got: Vec<u64> = feed(&mut b, 0, &stream).iter().map(|g| g.0).collect();
    assert_eq!(got, vec![30, 31]);
    assert_eq!(b.counters().rx_drop_dup_seq, 1);
    // With a generation the numbers stay per path (rdsd peers map paths stably).
    let mut c = conn(ADDR_B, ADDR_A, 0xbbbb_0003);
    c.restore_rx_state(GEN_A, next);
    assert_eq!(c.rx_state().1, next);
}
