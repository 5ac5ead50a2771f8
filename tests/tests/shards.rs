//! Several poll threads: apps spread over them, and messages between sockets of different
//! poll threads arrive exactly once and in order per (sender, destination), as within one.

use proptest::prelude::*;
use rdsd_tests::{lo, wait_for, Daemon};
use std::collections::{HashMap, VecDeque};
use std::io::ErrorKind;
use std::time::{Duration, Instant};

const POLL_THREADS: usize = 3;

/// rdsd with `POLL_THREADS` poll threads, apps placed by app whatever `RDSD_TESTS_PLACEMENT`
/// says: these tests place their sockets on threads by app (`placement_by_socket_*` start
/// their own).
fn daemon() -> Daemon {
    Daemon::start(&by_app())
}

fn by_app() -> Vec<&'static str> {
    let mut args = vec!["--placement", "app"];
    for _ in 0..POLL_THREADS {
        args.extend(["--poll-core", "-2"]);
    }
    args
}

#[test]
fn apps_spread_over_the_poll_threads() {
    let d = daemon();
    let apps: Vec<_> = (0..2 * POLL_THREADS).map(|_| d.attach()).collect();
    let mut per_thread = [0usize; POLL_THREADS];
    for a in &apps {
        per_thread[a.poll_thread()] += 1;
    }
    // The least-loaded poll thread takes each new app.
    assert_eq!(per_thread, [2; POLL_THREADS], "apps per poll thread");
    // A detached app's place is taken again by the next.
    let gone = apps[1].poll_thread();
    drop(apps);
    // Detaching is the control thread's, after it sees the connection close: wait for it.
    wait_for(
        || {
            let s = d.exact_stats();
            rdsd_tests::stat_from(&s, "apps_attached") == rdsd_tests::stat_from(&s, "apps_detached")
        },
        Duration::from_secs(20),
        "every app detached",
    );
    let again: Vec<_> = (0..POLL_THREADS).map(|_| d.attach()).collect();
    let mut threads: Vec<_> = again.iter().map(|a| a.poll_thread()).collect();
    threads.sort();
    assert_eq!(
        threads,
        (0..POLL_THREADS).collect::<Vec<_>>(),
        "after detach (was {gone})"
    );
}

/// `placement = "socket"`: one process's sockets spread over the poll threads (its library
/// opens an attachment per thread, each on the thread it asks for), and messages between them
/// cross threads exactly once and in order, as between apps. By app (the default) they all
/// stay on the process's one thread.
#[test]
fn placement_by_socket_spreads_one_process_sockets_over_the_poll_threads() {
    let mut args = vec!["--placement", "socket"];
    for _ in 0..POLL_THREADS {
        args.extend(["--poll-core", "-2"]);
    }
    let d = Daemon::start(&args);
    let r = d.attach();
    let first = r.poll_thread();
    let socks: Vec<_> = (0..2 * POLL_THREADS).map(|_| r.socket().unwrap()).collect();
    let threads: Vec<usize> = socks.iter().map(|s| s.poll_thread()).collect();
    let want: Vec<usize> = (0..2 * POLL_THREADS)
        .map(|k| (first + k) % POLL_THREADS)
        .collect();
    assert_eq!(
        threads, want,
        "round-robin from the first attachment's thread"
    );
    assert_eq!(r.attachments(), POLL_THREADS);
    // Every pair of sockets, both ways, in order: each crosses between two threads.
    const N: u32 = 200;
    for (k, s) in socks.iter().enumerate() {
        s.bind(lo(7600 + k as u16)).unwrap();
        s.set_recv_buffer_size(1 << 20).unwrap();
        s.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    }
    for (a, sa) in socks.iter().enumerate() {
        for seq in 0..N {
            for b in (0..socks.len()).filter(|&b| b != a) {
                sa.send_to(&[a as u8, (seq >> 8) as u8, seq as u8], lo(7600 + b as u16))
                    .unwrap();
            }
        }
    }
    let mut buf = [0u8; 16];
    for (b, sb) in socks.iter().enumerate() {
        let mut next = vec![0u32; socks.len()];
        for _ in 0..N * (socks.len() as u32 - 1) {
            let (n, from) = sb.recv_from(&mut buf).unwrap();
            assert_eq!(n, 3);
            let a = buf[0] as usize;
            assert_eq!(from, lo(7600 + a as u16));
            let seq = u32::from(buf[1]) << 8 | u32::from(buf[2]);
            assert_eq!(seq, next[a], "socket {b} from socket {a}: in order, once");
            next[a] += 1;
        }
    }
    drop(socks);
    drop(r);
    // By app: one attachment, one thread.
    let d = Daemon::start(&by_app());
    let r = d.attach();
    let socks: Vec<_> = (0..POLL_THREADS).map(|_| r.socket().unwrap()).collect();
    assert!(socks.iter().all(|s| s.poll_thread() == r.poll_thread()));
    assert_eq!(r.attachments(), 1);
}

/// An attachment rdsd refuses (here `max_apps`) leaves that thread's sockets on the
/// process's first attachment: spreading is best effort, never an error.
#[test]
fn placement_by_socket_falls_back_to_the_first_attachment_when_refused() {
    let cfg = rdsd_tests::config_file("max_apps = 2\nplacement = \"socket\"\n");
    let cfg = cfg.to_str().unwrap().to_string();
    let d = Daemon::start(&["-c", &cfg, "--poll-core", "-2", "--poll-core", "-2"]);
    // Start-up's own probe attachment must be gone first (a detach is asynchronous).
    rdsd_tests::wait_for(
        || {
            let s = shm_api::stats_at(&d.socket).expect("stats");
            rdsd_tests::stat_from(&s, "apps_attached") == rdsd_tests::stat_from(&s, "apps_detached")
        },
        Duration::from_secs(20),
        "start-up's attachment to leave",
    );
    // Another app takes the second of the two places.
    let _other = d.attach();
    let r = d.attach();
    let socks: Vec<_> = (0..4).map(|_| r.socket().unwrap()).collect();
    assert!(socks.iter().all(|s| s.poll_thread() == r.poll_thread()));
    assert_eq!(r.attachments(), 1);
    socks[0].bind(lo(7700)).unwrap();
    socks[1].bind(lo(7701)).unwrap();
    socks[1]
        .set_recv_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    socks[0].send_to(b"hi", lo(7701)).unwrap();
    let mut buf = [0u8; 4];
    assert_eq!(socks[1].recv_from(&mut buf).unwrap(), (2, lo(7700)));
}

/// One socket of the model: which app (attachment) holds it and its address.
struct Peer {
    app: usize,
    sock: shm_api::Socket,
    port: u16,
}

/// Sends every planned message, draining receivers whenever a send would block, then checks
/// that each receiver got, per sender, exactly the sequence that sender sent, in order.
fn run_plan(
    d: &Daemon,
    apps: usize,
    socks_per_app: usize,
    plan: &[(usize, usize, usize)],
    base_port: u16,
) {
    // The previous case's apps are gone (their detach is asynchronous).
    // (`stats_at` asks without attaching.)
    let attached = || {
        let s = shm_api::stats_at(&d.socket).expect("stats");
        rdsd_tests::stat_from(&s, "apps_attached") - rdsd_tests::stat_from(&s, "apps_detached")
    };
    rdsd_tests::wait_for(
        || attached() == 0,
        Duration::from_secs(20),
        "earlier apps to detach",
    );
    let rdsds: Vec<_> = (0..apps).map(|_| d.attach()).collect();
    let mut peers = Vec::new();
    for (a, r) in rdsds.iter().enumerate() {
        for s in 0..socks_per_app {
            let sock = r.socket().expect("socket");
            let port = base_port + (a * socks_per_app + s) as u16;
            sock.bind(lo(port)).expect("bind");
            sock.set_nonblocking(true).unwrap();
            sock.set_recv_buffer_size(1 << 20).unwrap();
            peers.push(Peer { app: a, sock, port });
        }
    }
    let shards: Vec<usize> = rdsds.iter().map(|r| r.poll_thread()).collect();
    // Nothing else is attached: the apps sit on min(apps, POLL_THREADS) threads.
    let mut distinct = shards.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        apps.min(POLL_THREADS),
        "threads of the apps: {shards:?}"
    );
    // expected[dst][src] = payload sequence numbers still to come, in order.
    let mut expected: Vec<HashMap<usize, VecDeque<u64>>> = vec![HashMap::new(); peers.len()];
    let mut got = vec![0usize; peers.len()];
    let mut buf = vec![0u8; 70_000];
    let mut drain = |peers: &[Peer],
                     expected: &mut Vec<HashMap<usize, VecDeque<u64>>>,
                     got: &mut Vec<usize>| {
        for (dst, p) in peers.iter().enumerate() {
            loop {
                match p.sock.recv_from(&mut buf) {
                    Ok((n, from)) => {
                        let src = peers
                            .iter()
                            .position(|q| q.port == from.port())
                            .expect("sender is one of ours");
                        assert!(n >= 8, "message shorter than its sequence number");
                        let seq = u64::from_le_bytes(buf[..8].try_into().unwrap());
                        let want = expected[dst]
                            .get_mut(&src)
                            .and_then(|q| q.pop_front())
                            .unwrap_or_else(|| {
                                panic!("{src}->{dst}: unexpected message {seq} (duplicate?)")
                            });
                        assert_eq!(
                            seq, want,
                            "{src}(app {}, thread {})->{dst}(app {}, thread {}): out of order",
                            peers[src].app, shards[peers[src].app], p.app, shards[p.app]
                        );
                        assert!(
                            buf[8..n].iter().all(|&b| b == seq as u8),
                            "payload corrupted"
                        );
                        got[dst] += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("recv: {e}"),
                }
            }
        }
    };
    for (i, &(src, dst, len)) in plan.iter().enumerate() {
        let (src, dst) = (src % peers.len(), dst % peers.len());
        let seq = i as u64;
        let mut msg = vec![seq as u8; len.max(8)];
        msg[..8].copy_from_slice(&seq.to_le_bytes());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match peers[src].sock.send_to(&msg, lo(peers[dst].port)) {
                Ok(_) => break,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::ENOBUFS)) => {
                    assert!(Instant::now() < deadline, "send never got room");
                    drain(&peers, &mut expected, &mut got);
                    std::thread::yield_now();
                }
                Err(e) => panic!("send: {e}"),
            }
        }
        expected[dst].entry(src).or_default().push_back(seq);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while expected.iter().any(|m| m.values().any(|q| !q.is_empty())) {
        assert!(
            Instant::now() < deadline,
            "messages missing after 20 s: {:?}",
            expected
                .iter()
                .map(|m| m.values().map(|q| q.len()).sum::<usize>())
                .collect::<Vec<_>>()
        );
        drain(&peers, &mut expected, &mut got);
        std::thread::yield_now();
    }
    assert_eq!(got.iter().sum::<usize>(), plan.len());
}

/// Random sockets on random poll threads, random sends (sizes from a sequence number alone to
/// 64 KiB), checked against the model. One daemon for every case; each case's apps detach
/// before the next attaches.
#[test]
fn cross_thread_delivery_is_exactly_once_and_in_order() {
    let d = daemon();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    });
    let plans = (
        2usize..6,
        1usize..4,
        proptest::collection::vec(
            (
                0usize..64,
                0usize..64,
                prop_oneof![8usize..64, 64usize..65_536],
            ),
            1..300,
        ),
    );
    let base = std::cell::Cell::new(20_000u16);
    runner
        .run(&plans, |(apps, socks, plan)| {
            base.set(base.get() + 32);
            run_plan(&d, apps, socks, &plan, base.get());
            Ok(())
        })
        .unwrap();
    // Messages of 16 KiB and more crossed in place (the receiving thread copied them from the
    // sender's tx ring); the model checked them like the others.
    assert!(d.stat("tx_in_place") > 0, "no message crossed in place");
}

#[test]
fn a_burst_between_two_poll_threads_keeps_its_order() {
    // Many small messages fill the pair ring and the receiver's ring several times over.
    let d = daemon();
    let plan: Vec<_> = (0..20_000).map(|i| (0, 1, 8 + i % 200)).collect();
    run_plan(&d, 2, 1, &plan, 30_000);
}

/// A receiver that never reads (SO_RCVBUF at its maximum: no congestion) on one poll thread
/// and a sender with a 64 MiB send buffer on another, on ports `port` (sender) and `port + 1`;
/// the sender sends `len`-byte messages (sequence number first, then its low byte) until its
/// send buffer stays full: everything downstream of it is full too. Returns how many went.
fn fill_towards_a_stalled_receiver(
    tx: &shm_api::Socket,
    rx: &shm_api::Socket,
    port: u16,
    len: usize,
) -> u64 {
    rx.bind(lo(port + 1)).unwrap();
    rx.set_recv_buffer_size(1 << 30).unwrap();
    rx.set_nonblocking(true).unwrap();
    tx.bind(lo(port)).unwrap();
    tx.set_nonblocking(true).unwrap();
    // A send buffer larger than the rings: the tx ring itself fills last.
    tx.set_send_buffer_size(64 << 20).unwrap();
    let mut sent = 0u64;
    let mut refused_in_a_row = 0;
    while refused_in_a_row < 200 {
        let mut msg = vec![sent as u8; len];
        msg[..8].copy_from_slice(&sent.to_le_bytes());
        match tx.send_to(&msg, lo(port + 1)) {
            Ok(_) => {
                sent += 1;
                refused_in_a_row = 0;
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                refused_in_a_row += 1;
                std::thread::sleep(Duration::from_millis(1)); // paces the retries only
            }
            Err(e) => panic!("send: {e}"),
        }
    }
    sent
}

#[test]
fn a_closing_sender_loses_nothing_when_the_other_thread_is_backed_up() {
    // The receiver (another app, so another poll thread) does not read and takes all it can
    // (SO_RCVBUF at its maximum: no congestion), so its rx ring fills, then the pair ring
    // between the threads, then (SO_SNDBUF larger than all of them) the sender's own tx ring. The sender closes with messages
    // still on its tx ring: they are kept for the pair ring, not dropped.
    let d = daemon();
    let (ra, rb) = (d.attach(), d.attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    let (rx, tx) = (rb.socket().unwrap(), ra.socket().unwrap());
    let sent = fill_towards_a_stalled_receiver(&tx, &rx, 31_000, 1000);
    eprintln!("{sent} messages sent before the send buffer stayed full");
    // More than the rx ring (2 MiB: 2048 records of 1 KiB) and the pair ring (2 MiB: 2016
    // records with their envelopes) hold: the rest were still on the tx ring.
    assert!(sent > 2048 + 2016, "only {sent} sent");
    let closed = d.stat("sockets_closed");
    drop(tx);
    // Read nothing until rdsd has closed the sender (its Close is asynchronous).
    rdsd_tests::wait_for(
        || d.stat("sockets_closed") > closed,
        Duration::from_secs(20),
        "the sender's close",
    );
    let mut buf = vec![0u8; 2000];
    let mut got = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while got < sent {
        match rx.recv(&mut buf) {
            Ok(n) => {
                assert_eq!(n, 1000);
                assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), got);
                got += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "{got} of {sent} arrived");
                std::thread::yield_now();
            }
            Err(e) => panic!("recv: {e}"),
        }
    }
    assert_eq!(d.stat("drop_socket_closed"), 0, "sent {sent}");
}

/// Messages of 16 KiB and more cross in place: the pair ring carries a reference into the
/// sender's tx ring, held until the receiving thread has copied them (into the rx ring or,
/// while that is full, the receiver's backlog). A sender app that leaves while its messages
/// wait (the receiver does not read) loses none of them. (Its region stays mapped while
/// references are still in the pair ring: `poll::shard_tests::an_app_that_leaves_with_references_in_the_pair_ring_loses_nothing`;
/// here the receiving thread has copied them all by then.)
#[test]
fn an_app_that_leaves_with_large_messages_in_flight_to_another_thread_loses_nothing() {
    let d = daemon();
    let (ra, rb) = (d.attach(), d.attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    const LEN: usize = 32 << 10;
    let (rx, tx) = (rb.socket().unwrap(), ra.socket().unwrap());
    let sent = fill_towards_a_stalled_receiver(&tx, &rx, 31_100, LEN);
    let in_place = d.stat("tx_in_place");
    eprintln!("{sent} messages of {LEN} B sent, {in_place} of them in place");
    assert!(in_place > 0, "large messages cross in place");
    // The rx ring (2 MiB) took about 64; the rest wait in the backlog, as references in the
    // pair ring, or on the tx ring.
    assert!(sent > 64, "only {sent} sent");
    let detached = d.stat("apps_detached");
    drop(tx);
    drop(ra);
    rdsd_tests::wait_for(
        || d.stat("apps_detached") > detached,
        Duration::from_secs(20),
        "the sender app's detach",
    );
    let mut buf = vec![0u8; LEN + 1];
    let mut got = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while got < sent {
        match rx.recv(&mut buf) {
            Ok(n) => {
                assert_eq!(n, LEN);
                assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), got);
                assert!(buf[8..n].iter().all(|&b| b == got as u8), "message {got}");
                got += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                assert!(Instant::now() < deadline, "{got} of {sent} arrived");
                std::thread::yield_now();
            }
            Err(e) => panic!("recv: {e}"),
        }
    }
    assert_eq!(d.stat("drop_socket_closed"), 0);
}

/// `hog_holds_up_no_other_destination` with the senders on one poll thread and the hog and
/// its neighbour on another: what the hog's ring cannot take waits in its backlog, its bytes
/// given back to the sender (as the kernel's loopback once a message is queued for its
/// receiver; on the way, in the pair ring, they stay the sender's:
/// `poll::shard_tests::a_crossing_message_is_its_senders_until_the_other_thread_takes_it`),
/// so the sender's later message to the neighbour is not held up behind its send buffer.
/// (Before 2026-12-06 a parked message kept its sender's bytes, and the sender was refused
/// once its send buffer was in the backlog.)
#[test]
fn a_receiver_of_another_thread_that_stops_reading_holds_up_no_other_destination() {
    let d = daemon();
    let (ra, rb) = (d.attach(), d.attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    let [tx, tx2] = [(); 2].map(|_| ra.socket().unwrap());
    let [hog, other] = [(); 2].map(|_| rb.socket().unwrap());
    rdsd_tests::hog_holds_up_no_other_destination(&d, [&tx, &hog, &other, &tx2], 32_020);
}

/// A burst that crosses between poll threads is published into the receiver's rx ring once
/// (issue 18, item 2), counted: 64 messages sent as one batch by an app of one thread to a
/// socket of an app of another cost 1 rx publish (the receiving thread takes them off the pair
/// ring as one burst), and arrive in order.
#[test]
fn a_burst_from_another_thread_publishes_the_receivers_ring_once() {
    let d = daemon();
    let (tx_app, rx_app) = (d.attach(), d.attach());
    assert_ne!(tx_app.poll_thread(), rx_app.poll_thread());
    let a = tx_app.socket().unwrap();
    let b = rx_app.socket().unwrap();
    a.bind(lo(7821)).unwrap();
    b.bind(lo(7822)).unwrap();
    let payloads: Vec<Vec<u8>> = (0..64u64).map(|i| i.to_le_bytes().to_vec()).collect();
    let batch: Vec<_> = payloads.iter().map(|p| (&p[..], Some(lo(7822)))).collect();
    let before = d.exact_stat("rx_publishes");
    assert_eq!(a.send_batch(&batch, false).unwrap(), 64);
    let mut buf = [0u8; 64];
    for i in 0..64u64 {
        let (n, from) = b.recv_from(&mut buf).unwrap();
        assert_eq!((&buf[..n], from), (&i.to_le_bytes()[..], lo(7821)));
    }
    assert_eq!(d.exact_stat("rx_publishes") - before, 1);
}

/// [`rdsd_tests::send_until_refused`] of 64 KiB messages from `tx` to port `to`.
fn send_until_refused(tx: &shm_api::Socket, to: u16, seq: &mut u64, errno: i32, at_least: u64) {
    let send = |i| tx.send_to(&rdsd_tests::seq_payload(i, 64 << 10), lo(to));
    rdsd_tests::send_until_refused(send, seq, errno, at_least);
}

/// Two apps on two poll threads: on the second a hog (SO_RCVBUF 1 GiB, at `base + 1`) that
/// reads nothing and its neighbour (`base + 2`); on the first a nonblocking sender (`base`).
struct HogRig {
    ra: shm_api::Rdsd,
    hog: shm_api::Socket,
    other: shm_api::Socket,
    tx: shm_api::Socket,
}

fn hog_rig(d: &Daemon, base: u16) -> HogRig {
    let (ra, rb) = (d.attach(), d.attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    let hog = rb.socket().unwrap();
    hog.bind(lo(base + 1)).unwrap();
    hog.set_recv_buffer_size(1 << 30).unwrap();
    let other = rb.socket().unwrap();
    other.bind(lo(base + 2)).unwrap();
    other
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let tx = ra.socket().unwrap();
    tx.bind(lo(base)).unwrap();
    tx.set_nonblocking(true).unwrap();
    HogRig { ra, hog, other, tx }
}

/// A new socket of the sending app (`base + 3`) reaches the hog's neighbour (`base + 2`) while
/// the hog reads nothing.
fn neighbour_gets_through(ra: &shm_api::Rdsd, other: &shm_api::Socket, base: u16) {
    let tx2 = ra.socket().unwrap();
    tx2.bind(lo(base + 3)).unwrap();
    tx2.send_to(b"not held up", lo(base + 2)).unwrap();
    let mut buf = [0u8; 64];
    let (n, from) = other.recv_from(&mut buf).expect("past the hog");
    assert_eq!((&buf[..n], from), (&b"not held up"[..], lo(base + 3)));
}

/// A receiver that stops reading, with SO_RCVBUF above its rx ring (so the ring alone never
/// makes it congested), must not cut the other sockets of its poll thread off from another
/// thread: what finds its ring full waits in its backlog in rdsd, and the ring between the two
/// threads goes on. (Before the backlog, the record at the head of that ring waited, and every
/// message behind it too.) The backlog's share bounds what waits (then the sender is held,
/// EAGAIN). Then the receiver reads everything, once and in order.
#[test]
fn a_receiver_that_stops_reading_does_not_cut_off_the_others_of_its_thread() {
    let d = daemon();
    let HogRig { ra, hog, other, tx } = hog_rig(&d, 32_100);
    // More than the hog's rx ring (2 MiB) in flight. (Messages of 64 KiB cross in place: the
    // sender's tx ring, 2 MiB, holds those on their way, so that bounds them too.)
    tx.set_send_buffer_size(8 << 20).unwrap();
    let mut sent = 0;
    // Never congested: refused once the hog's backlog is past its share, far past the ring
    // (3 MiB: 48 messages).
    send_until_refused(&tx, 32_101, &mut sent, libc::EAGAIN, 49);
    assert!(
        sent * (64 << 10) > 3 << 20,
        "only {sent} messages of 64 KiB went out"
    );
    assert!(d.exact_stat("rx_backlogged") > 0, "{}", d.exact_stats());
    // Another socket of the same sending app reaches the hog's neighbour.
    neighbour_gets_through(&ra, &other, 32_100);
    let mut buf = vec![0u8; 128 << 10];
    // The hog reads its ring and its backlog: every message once, in order.
    hog.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 0..sent {
        let n = hog.recv(&mut buf).unwrap();
        assert_eq!(n, 64 << 10);
        assert_eq!(rdsd_tests::payload_seq(&buf[..n]), i);
    }
    // And the sender has its buffer back: another ring's worth goes out.
    let mut again = sent;
    send_until_refused(&tx, 32_101, &mut again, libc::EAGAIN, sent + 2 * sent / 3);
}

/// A receiver with a huge SO_RCVBUF that never reads, fed from another poll thread with
/// messages small enough to be copied into the pair ring (so only SO_SNDBUF, 1 GiB here, bounds
/// them): its backlog stops at its share (8 MiB), then the sender waits on its own tx ring
/// (EAGAIN once that is full), as a sender of the receiver's own thread waits for a full rx
/// ring. The thread's backlogs never reach their cap, and the two threads' other sockets still
/// talk. (Before, the backlog grew to the 64 MiB cap, and then the ring between the two
/// threads stopped at the next record for the hog, with everything behind it.)
#[test]
fn a_receiver_that_never_reads_cannot_fill_the_backlogs() {
    const LEN: usize = 8 << 10;
    let d = daemon();
    let HogRig { ra, hog, other, tx } = hog_rig(&d, 32_400);
    tx.set_send_buffer_size(1 << 30).unwrap();
    let mut sent = 0;
    let send = |i| tx.send_to(&rdsd_tests::seq_payload(i, LEN), lo(32_401));
    // Into the hog's backlog past its ring (2 MiB), and on until refused for good: the
    // backlog's share (8 MiB) and the sender's tx ring (2 MiB) are full then.
    rdsd_tests::send_until_refused(send, &mut sent, libc::EAGAIN, (10 << 20) / LEN as u64);
    let stats = d.exact_stats();
    let stat = |name: &str| rdsd_tests::stat_from(&stats, name);
    assert_eq!(stat("rx_backlog_capped"), 0, "{stats}");
    assert!(stat("tx_held_for_backlog") > 0, "{stats}");
    // Ring, backlog share, the sender's tx ring and what was on its way: far below the cap.
    assert!(
        sent * (LEN as u64) < 24 << 20,
        "{sent} messages of {LEN} B went out"
    );
    // `rdsctl info -r` says so.
    let q = d.info_json(&["-r"]);
    let hog_entry = q["recv_queue"]["entries"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["port"] == 32_401))
        .unwrap_or_else(|| panic!("the hog in the receive queue: {q}"));
    assert_eq!(hog_entry["backed_up"], true, "{hog_entry}");
    assert!(
        hog_entry["backlog_bytes"].as_u64().unwrap() >= 8 << 20,
        "{hog_entry}"
    );
    // Another socket of the sending app reaches the hog's neighbour.
    neighbour_gets_through(&ra, &other, 32_400);
    let mut buf = vec![0u8; 64 << 10];
    // The hog reads: every message once, in order, and the sender goes on.
    hog.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 0..sent {
        let n = hog.recv(&mut buf).unwrap();
        assert_eq!((n, rdsd_tests::payload_seq(&buf[..n])), (LEN, i));
    }
    let send = |i| tx.send_to(&rdsd_tests::seq_payload(i, LEN), lo(32_401));
    let mut again = sent;
    rdsd_tests::send_until_refused(send, &mut again, libc::EAGAIN, sent + sent / 2);
}

/// What waits in a receiver's backlog counts toward its SO_RCVBUF, as the kernel's receive
/// queue does: past it the port is congested (ENOBUFS), however much of it is in the rx ring.
#[test]
fn a_backlog_counts_toward_the_receive_buffer() {
    let d = daemon();
    let (ra, rb) = (d.attach(), d.attach());
    assert_ne!(ra.poll_thread(), rb.poll_thread());
    let rx = rb.socket().unwrap();
    rx.bind(lo(32_201)).unwrap();
    // Above the rx ring (2 MiB): congestion needs the backlog.
    rx.set_recv_buffer_size(3 << 20).unwrap();
    let tx = ra.socket().unwrap();
    tx.bind(lo(32_200)).unwrap();
    tx.set_nonblocking(true).unwrap();
    tx.set_send_buffer_size(16 << 20).unwrap();
    let mut sent = 0;
    send_until_refused(&tx, 32_201, &mut sent, libc::ENOBUFS, 1);
    assert!(
        sent * (64 << 10) > 3 << 20,
        "congested after {sent} messages of 64 KiB: before SO_RCVBUF"
    );
    assert!(d.exact_stat("rx_backlogged") > 0);
    let mut buf = vec![0u8; 128 << 10];
    rx.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 0..sent {
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(rdsd_tests::payload_seq(&buf[..n]), i);
    }
    // Read: no longer congested.
    wait_for(
        || tx.send_to(b"again", lo(32_201)).is_ok(),
        Duration::from_secs(20),
        "the port uncongested once read",
    );
}

/// A group message from another poll thread's socket that a full member blocks waits parked
/// on shard 0 (which orders the groups), with its sender's later group messages behind it,
/// and the ring between the two threads goes on: the same app's unicast to a socket of
/// shard 0 is not held up (before, the blocked group message at the head of that ring held
/// everything behind it). Once the member reads, every group message arrives, in order.
#[test]
fn a_full_group_member_holds_up_only_the_group() {
    use shm_api::GroupFlags;
    use std::net::{Ipv4Addr, SocketAddrV4};
    let d = daemon();
    let apps: Vec<_> = (0..POLL_THREADS).map(|_| d.attach()).collect();
    let (on_0, elsewhere) = on_0_and_elsewhere(&apps);
    let g = SocketAddrV4::new(Ipv4Addr::new(239, 7, 7, 7), 6100);
    let sender = elsewhere.socket().unwrap();
    sender.bind(lo(32_300)).unwrap();
    sender.group_create(g).unwrap();
    let full = on_0.socket().unwrap();
    full.set_recv_buffer_size(1024).unwrap();
    full.bind(lo(32_301)).unwrap();
    full.group_join(g, GroupFlags::NONE).unwrap();
    let neighbour = on_0.socket().unwrap();
    neighbour.bind(lo(32_302)).unwrap();
    neighbour
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // One batch: the library sees the group's room once, so most of it reaches shard 0 after
    // the member is full.
    const N: u64 = 48;
    let payloads: Vec<Vec<u8>> = (0..N).map(|i| rdsd_tests::seq_payload(i, 200)).collect();
    let batch: Vec<_> = payloads.iter().map(|p| (&p[..], Some(g))).collect();
    assert_eq!(sender.send_batch(&batch, false).unwrap(), N as usize);
    wait_for(
        || d.exact_stat("group_parked") > 0,
        Duration::from_secs(20),
        "a group message parked on shard 0",
    );
    let other = elsewhere.socket().unwrap();
    other.bind(lo(32_303)).unwrap();
    other.send_to(b"not held up", lo(32_302)).unwrap();
    let mut buf = [0u8; 512];
    let (n, from) = neighbour.recv_from(&mut buf).expect("past the full member");
    assert_eq!((&buf[..n], from), (&b"not held up"[..], lo(32_303)));
    // The member reads: the group goes on, every message once and in order.
    full.set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    for i in 0..N {
        let (n, from) = full.recv_from(&mut buf).unwrap();
        assert_eq!(from, lo(32_300));
        assert_eq!(rdsd_tests::payload_seq(&buf[..n]), i);
    }
}

/// The other direction: a member of another poll thread whose rx ring is full (SO_RCVBUF
/// above the ring, so shard 0 never hears it congested) holds up its own group and nothing
/// else. Shard 0 orders the groups but cannot look into that member's ring; the member's
/// thread keeps room in it for shard 0's copies and says how much (credit), so shard 0 decides
/// a fan-out only when every copy fits, as it does for its own members. Before the credit, a
/// copy that found the ring full waited on the member's thread, and with it the commit of its
/// fan-out and every later fan-out of every group (a second group's message never arrived);
/// before the copy waits, that copy held the ring from shard 0 to that thread (shard 0's
/// unicast to it, and the connections shard 0 owns). Once the member reads, every message
/// arrives once, in order.
#[test]
fn a_full_group_member_of_another_thread_holds_up_only_its_group() {
    use shm_api::GroupFlags;
    use std::net::{Ipv4Addr, SocketAddrV4};
    let d = daemon();
    let apps: Vec<_> = (0..POLL_THREADS).map(|_| d.attach()).collect();
    let (on_0, elsewhere) = on_0_and_elsewhere(&apps);
    let g = SocketAddrV4::new(Ipv4Addr::new(239, 7, 7, 8), 6200);
    let sender = on_0.socket().unwrap();
    sender.bind(lo(32_400)).unwrap();
    sender.group_create(g).unwrap();
    sender.set_send_buffer_size(16 << 20).unwrap();
    sender.set_nonblocking(true).unwrap();
    sender.connect(g).unwrap();
    let full = elsewhere.socket().unwrap();
    full.set_recv_buffer_size(1 << 30).unwrap();
    full.bind(lo(32_401)).unwrap();
    full.group_join(g, GroupFlags::NONE).unwrap();
    let neighbour = elsewhere.socket().unwrap();
    neighbour.bind(lo(32_402)).unwrap();
    neighbour
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // A second group, its member on the same thread as the full one.
    let g2 = SocketAddrV4::new(Ipv4Addr::new(239, 7, 7, 9), 6201);
    let member2 = elsewhere.socket().unwrap();
    member2.bind(lo(32_406)).unwrap();
    member2
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let sender2 = on_0.socket().unwrap();
    sender2.bind(lo(32_407)).unwrap();
    sender2.group_create(g2).unwrap();
    member2.group_join(g2, GroupFlags::NONE).unwrap();
    const LEN: usize = 100 << 10;
    let mut sent = 0u64;
    // Past the member's ring (2 MiB), then refused for good.
    let past_ring = (2 << 20) as u64 / LEN as u64 + 2;
    let send = |i| sender.send(&rdsd_tests::seq_payload(i, LEN));
    rdsd_tests::send_until_refused(send, &mut sent, libc::EAGAIN, past_ring);
    assert!(
        sent as usize * LEN > 2 << 20,
        "{sent} sent: past the member's ring"
    );
    // Blocked on shard 0 (with the credit), or a copy waiting on the member's thread (the
    // rule before it, under which the next check failed: never arrived).
    wait_for(
        || d.exact_stat("group_blocked") > 0 || d.exact_stat("group_copies_waited") > 0,
        Duration::from_secs(20),
        "the group's sends held up by the full member",
    );
    // `rdsctl info -g` shows the member's credit: less than one more copy's charge (two
    // records) once the group is blocked by it (with the credit).
    if d.exact_stat("group_blocked") > 0 {
        let doc = d.info_json(&["-g"]);
        let credit = doc["groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["members"].as_array().unwrap().iter())
            .find(|m| m["port"] == 32_401)
            .and_then(|m| m["credit"].as_u64())
            .expect("the full member's credit listed");
        assert!(credit < 2 * (16 + LEN as u64), "{credit}");
    }
    // The other group goes on: its message is decided and committed at once.
    sender2
        .send_to(&rdsd_tests::seq_payload(7, 64), g2)
        .unwrap();
    let mut buf = vec![0u8; LEN + 1];
    let (n, from) = member2
        .recv_from(&mut buf)
        .expect("the other group's message past the full member");
    assert_eq!((rdsd_tests::payload_seq(&buf[..n]), from), (7, lo(32_407)));
    let other = on_0.socket().unwrap();
    other.bind(lo(32_403)).unwrap();
    other.send_to(b"not held up", lo(32_402)).unwrap();
    let (n, from) = neighbour
        .recv_from(&mut buf)
        .expect("shard 0's unicast past the full member");
    assert_eq!((&buf[..n], from), (&b"not held up"[..], lo(32_403)));
    // A group message from a socket of the member's thread waits parked on shard 0, not in
    // the ring to shard 0: the same app's unicast to a socket of shard 0 gets through.
    let late = elsewhere.socket().unwrap();
    late.bind(lo(32_404)).unwrap();
    // As large as the blocked ones: no room for it either (a small one may fit the room
    // left, and be decided before the blocked ones, as on one thread).
    late.set_send_buffer_size(1 << 20).unwrap();
    late.send_to(&rdsd_tests::seq_payload(u64::MAX, LEN), g)
        .unwrap();
    wait_for(
        || d.exact_stat("group_parked") > 0,
        Duration::from_secs(20),
        "the late group message parked on shard 0",
    );
    let on_0_rx = on_0.socket().unwrap();
    on_0_rx.bind(lo(32_405)).unwrap();
    on_0_rx
        .set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    late.send_to(b"to shard 0", lo(32_405)).unwrap();
    let (n, from) = on_0_rx
        .recv_from(&mut buf)
        .expect("past the parked group message");
    assert_eq!((&buf[..n], from), (&b"to shard 0"[..], lo(32_404)));
    full.set_recv_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // Every message once; the sender's in order, the late one among them (decided when the
    // member had room again, before or after the sender's blocked ones).
    let (mut next, mut late_seen) = (0u64, 0);
    for _ in 0..=sent {
        let (n, from) = full.recv_from(&mut buf).unwrap();
        if from == lo(32_404) {
            assert_eq!(rdsd_tests::payload_seq(&buf[..n]), u64::MAX);
            late_seen += 1;
        } else {
            assert_eq!(from, lo(32_400));
            assert_eq!(rdsd_tests::payload_seq(&buf[..n]), next);
            next += 1;
        }
    }
    assert_eq!((next, late_seen), (sent, 1));
    // Every copy fitted when it arrived: none waited on the member's thread.
    assert_eq!(d.exact_stat("group_copies_waited"), 0);
    assert!(d.exact_stat("group_credit_grants") > 0);
}

/// Of apps attached one per poll thread: the one on shard 0 (which orders the groups) and one
/// on another thread.
fn on_0_and_elsewhere(apps: &[shm_api::Rdsd]) -> (&shm_api::Rdsd, &shm_api::Rdsd) {
    let on_0 = apps
        .iter()
        .find(|a| a.poll_thread() == 0)
        .expect("an app on 0");
    let elsewhere = apps.iter().find(|a| a.poll_thread() != 0).expect("one not");
    (on_0, elsewhere)
}

/// Steady pairs keep their order and lose nothing while, on the same poll threads, flooding
/// apps are SIGKILLed mid-stream, the never-reading receivers they flood are SIGKILLed and come
/// back, and apps break their own tx rings (and are evicted): rdsd stays up, and at the end
/// every app is gone and every region freed. (Placement by app over three threads: the
/// processes land on every thread, so each kind of trouble meets the others' crossings.)
#[test]
fn steady_pairs_survive_killed_floods_and_scribblers_on_every_thread() {
    let d = daemon();
    let count = 150_000u64.to_string();
    let addr = |port: u16| lo(port).to_string();
    let mut receivers: Vec<_> = (0..3)
        .map(|i| d.app(&["recv", &addr(7101 + i), &count]))
        .collect();
    for r in &mut receivers {
        r.expect("bound");
    }
    let senders: Vec<_> = (0..3u16)
        .map(|i| {
            let len = (16 + 300 * i).to_string();
            d.app(&["send", &addr(7201 + i), &addr(7101 + i), &count, &len])
        })
        .collect();
    let hold = |d: &Daemon| {
        let mut h = d.app(&["hold", &addr(7400), "3"]);
        h.expect("bound");
        h
    };
    let mut sinks = hold(&d);
    let modes = ["huge-index", "misaligned", "huge-len", "bad-kind", "random"];
    for k in 0..25u16 {
        if k % 8 == 7 {
            sinks.kill();
            sinks = hold(&d);
        }
        let mut flood = d.app(&["flood", &addr(7300 + k), &addr(7400 + k % 3)]);
        flood.expect("flooding");
        let mut scribbler = d.app(&["scribble", modes[usize::from(k) % 5], &addr(7500 + k)]);
        scribbler.expect("scribbled");
        std::thread::sleep(Duration::from_millis(20 + 40 * u64::from(k % 5)));
        flood.kill();
        scribbler.expect_within("evicted", Duration::from_secs(20));
        assert!(d.running(), "rdsd died in round {k}");
    }
    sinks.kill();
    for mut r in receivers {
        assert_eq!(r.expect_within("received", Duration::from_secs(120)), count);
    }
    for s in senders {
        assert_eq!(s.wait(), 0);
    }
    assert!(d.running());
    wait_for(
        || {
            let s = d.exact_stats();
            let at = |n: &str| rdsd_tests::stat_from(&s, n);
            // `Daemon::start`'s probe attached once too.
            at("apps_attached") == at("apps_detached") && at("regions_freed") == at("apps_detached")
        },
        Duration::from_secs(20),
        "every app detached and every region freed",
    );
    assert_eq!(
        d.stat("apps_evicted"),
        25,
        "every scribbler, and no one else"
    );
}
