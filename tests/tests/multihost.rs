//! RDS over kernel TCP between "hosts" in network namespaces, each with its own rdsd.
//! Every test checks exactly-once, in-order delivery with sequence-numbered payloads.

use rdsd_tests::netns::Lab;
use rdsd_tests::*;
use shm_api::Socket;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

fn addr(s: &str) -> SocketAddrV4 {
    s.parse().unwrap()
}

#[test]
fn exchange_in_both_directions() {
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let mut r1 = h1.d().app(&["recv", &h1.at(5000), "3000"]);
    let mut r0 = h0.d().app(&["recv", &h0.at(5000), "3000"]);
    r1.expect("bound");
    r0.expect("bound");
    let s0 = h0
        .d()
        .app(&["send", &h0.at(5001), &h1.at(5000), "3000", "300"]);
    let s1 = h1
        .d()
        .app(&["send", &h1.at(5001), &h0.at(5000), "3000", "300"]);
    assert_eq!(r1.expect("received"), "3000");
    assert_eq!(r0.expect("received"), "3000");
    assert_eq!((s0.wait(), s1.wait()), (0, 0));
    assert_eq!(h1.d().stat("tcp_delivered"), 3000);
    assert_eq!(h0.d().stat("tcp_delivered"), 3000);
    // The smaller address connected every path; the larger accepted them.
    assert_eq!(h0.d().stat("tcp_path_up"), 8);
    assert_eq!(h1.d().stat("tcp_accepts"), 8);
    // Each from a source port that names its path (SPORT_IDX), so the passive side maps them
    // by port, not by accept order; none was taken for another path.
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &h0.ns,
            "ss",
            "-Htn",
            "state",
            "established",
        ])
        .args(["dport", "=", ":16385"])
        .output()
        .expect("ss");
    let mut residues: Vec<u16> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .nth(2)?
                .rsplit_once(':')?
                .1
                .parse()
                .ok()
        })
        .map(|port: u16| port % 8)
        .collect();
    residues.sort_unstable();
    assert_eq!(residues, (0..8).collect::<Vec<u16>>(), "source ports mod 8");
    assert_eq!(h0.d().stat("tcp_path_mismaps"), 0);
    assert_eq!(h1.d().stat("tcp_path_mismaps"), 0);
}

#[test]
fn fan_out_to_every_host_and_many_to_one() {
    let lab = Lab::new(3, 3, &[]);
    let h = &lab.hosts;
    let mut rs: Vec<App> = h
        .iter()
        .map(|x| x.d().app(&["recv", &x.at(6000), "1000"]))
        .collect();
    for r in &mut rs {
        r.expect("bound");
    }
    // One socket on host 0 to sockets on hosts 0 (loopback), 1 and 2 (TCP).
    let f = h[0].d().app(&[
        "fanout",
        &h[0].at(6001),
        "1000",
        &h[0].at(6000),
        &h[1].at(6000),
        &h[2].at(6000),
    ]);
    for r in &mut rs {
        assert_eq!(r.expect("received"), "1000");
    }
    assert_eq!(f.wait(), 0);
    // Many to one: senders on all three hosts into one socket on host 2.
    let mut sink = h[2].d().app(&["recv-multi", &h[2].at(6100), "3000"]);
    sink.expect("bound");
    let senders: Vec<App> = h
        .iter()
        .map(|x| {
            x.d()
                .app(&["send", &x.at(6101), &h[2].at(6100), "1000", "500"])
        })
        .collect();
    assert_eq!(sink.expect("received"), "3000 sources 3");
    for s in senders {
        assert_eq!(s.wait(), 0);
    }
}

#[test]
fn four_paths_keep_per_socket_order() {
    let lab = Lab::new(2, 2, &["--paths", "4"]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let mut sink = h1.d().app(&["recv-multi", &h1.at(7000), "16000"]);
    sink.expect("bound");
    // 16 sockets hash onto the 4 paths.
    let ip = h0.addr.to_string();
    let s = h0
        .d()
        .app(&["multi-send", &ip, "7100", "16", &h1.at(7000), "1000"]);
    assert_eq!(sink.expect("received"), "16000 sources 16");
    assert_eq!(s.wait(), 0);
    assert_eq!(h0.d().stat("tcp_path_up"), 4, "4 paths negotiated, not 8");
    assert_eq!(h1.d().stat("tcp_accepts"), 4);
}

#[test]
fn slow_remote_receiver_congests_the_sender_which_recovers() {
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let r = h1.d().attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(4096).unwrap();
    rcv.bind(addr(&h1.at(8000))).unwrap();
    let mut snd = h0.d().app(&["cong-sender", &h0.at(8001), &h1.at(8000)]);
    let n: u64 = snd.expect("enobufs").parse().unwrap();
    assert!(n >= 9, "ENOBUFS after {n}");
    assert!(h1.d().stat("cong_marked") >= 1);
    // At least one map when the paths came up (coalesced per connection), then at least one
    // update (exact reads: the counter is summed lazily).
    wait_until(
        Duration::from_secs(10),
        "a map update at the sender",
        || h0.d().exact_stat("tcp_cong_maps_received"),
        |&n| n >= 2,
    );
    let mut buf = [0u8; 1024];
    rcv.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    // Messages in flight when the map arrived are still delivered: read until the sender's
    // update and last message show up.
    let mut next = 0u64;
    let mask: u64 = loop {
        let (len, _) = rcv.recv_from(&mut buf).unwrap();
        assert_eq!(payload_seq(&buf[..len]), next);
        next += 1;
        if next == n {
            break snd.expect("cong_update").parse().unwrap();
        }
    };
    assert_ne!(mask & (1 << (8000 % 64)), 0);
    assert_eq!(snd.expect("sent-after-clear"), (n + 1).to_string());
    let (len, _) = rcv.recv_from(&mut buf).unwrap();
    assert_eq!(payload_seq(&buf[..len]), n);
}

/// 5% random loss and 5% duplication of this host's outgoing TCP segments (no netem here).
fn loss_and_dup_rules() -> &'static str {
    "table ip fault {
        chain out {
            type filter hook output priority 0; policy accept;
            meta l4proto tcp numgen random mod 100 < 5 drop
        }
        chain dupl {
            type filter hook postrouting priority 0; policy accept;
            meta l4proto tcp oifname \"eth0\" numgen random mod 100 < 5 dup to ip daddr device \"eth0\"
        }
    }"
}

#[test]
fn five_percent_loss_and_duplication() {
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    h0.nft(loss_and_dup_rules());
    h1.nft(loss_and_dup_rules());
    let mut r = h1.d().app(&["recv-multi", &h1.at(9000), "4000"]);
    r.expect("bound");
    let mut back = h0.d().app(&["recv-multi", &h0.at(9000), "2000"]);
    back.expect("bound");
    let s = h0
        .d()
        .app(&["send", &h0.at(9001), &h1.at(9000), "4000", "700"]);
    let s2 = h1
        .d()
        .app(&["send", &h1.at(9001), &h0.at(9000), "2000", "200"]);
    assert_eq!(r.expect("received"), "4000 sources 1");
    assert_eq!(back.expect("received"), "2000 sources 1");
    assert_eq!((s.wait(), s2.wait()), (0, 0));
}

#[test]
fn link_down_for_two_seconds_mid_stream_loses_nothing() {
    let lab = Lab::new(2, 2, &[]);
    let (h0, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let mut r = h1.d().app(&["recv-resilient", &h1.at(9100), "1999"]);
    r.expect("bound");
    let mut s = h0
        .d()
        .app(&["send-resilient", &h0.at(9101), &h1.at(9100), "2000", "1500"]);
    s.expect("sending");
    // Mid-stream: host 1 delivered part of it.
    let delivered = wait_until(
        Duration::from_secs(20),
        "host 1 to deliver part of the stream",
        || h1.d().stat("tcp_delivered"),
        |&n| n >= 200,
    );
    assert!(
        delivered < 2000,
        "the link goes down mid-stream: {delivered}"
    );
    h0.link(false);
    // The outage the test is named for (its length, not synchronisation).
    std::thread::sleep(Duration::from_secs(2));
    h0.link(true);
    let done = r.expect("done");
    assert!(done.starts_with("got 2000 gaps 0 missing 0"), "{done}");
    assert!(s.expect("sent").starts_with("2000"));
}

/// Kills and restarts the rdsd of host `victim` while host 0 streams to host 1 (with `then`
/// as its flags instead of `first`'s, if given).
fn restart_mid_stream(victim: usize) -> String {
    restart_mid_stream_with(victim, &[], None)
}

fn restart_mid_stream_with(victim: usize, first: &[&str], then: Option<&[&str]>) -> String {
    let mut lab = Lab::new(2, 2, first);
    let (a0, a1) = (lab.hosts[0].at(9201), lab.hosts[1].at(9200));
    let mut r = lab.hosts[1].d().app(&["recv-resilient", &a1, "2999"]);
    r.expect("bound");
    let mut s = lab.hosts[0]
        .d()
        .app(&["send-resilient", &a0, &a1, "3000", "500"]);
    s.expect("sending");
    // Mid-stream: host 1 delivered part of it.
    let delivered = wait_until(
        Duration::from_secs(20),
        "host 1 to deliver part of the stream",
        || lab.hosts[1].d().stat("tcp_delivered"),
        |&n| n >= 300,
    );
    let survivor = 1 - victim;
    let downs = lab.hosts[survivor].d().stat("tcp_path_down");
    lab.hosts[victim].daemon.as_mut().unwrap().kill();
    assert!(delivered < 3000, "killed mid-stream: {delivered}");
    // The killed rdsd's sockets closed: the other host sees its paths go down.
    wait_until(
        Duration::from_secs(10),
        "the other host to see the killed rdsd's paths go down",
        || lab.hosts[survivor].d().stat("tcp_path_down"),
        |&n| n > downs,
    );
    match then {
        Some(flags) => {
            // Lab::start's flags, then these.
            let local = format!("{}/32", lab.hosts[victim].addr);
            let mut all = vec!["--local-addr", &local, "--local-addr", "127.0.0.0/8"];
            all.extend_from_slice(flags);
            lab.hosts[victim].daemon.as_mut().unwrap().spawn_with(&all);
        }
        None => lab.hosts[victim].daemon.as_mut().unwrap().spawn(),
    }
    let t = Instant::now();
    let done = r.expect("done");
    eprintln!(
        "restart of host {victim}: {done} ({:?} after restart)",
        t.elapsed()
    );
    assert_one_restart(&done, victim);
    assert!(s.expect("sent").starts_with("3000"));
    done
}

#[test]
fn receiver_rdsd_sigkilled_and_restarted_mid_stream() {
    restart_mid_stream(1);
}

#[test]
fn sender_rdsd_sigkilled_and_restarted_mid_stream() {
    restart_mid_stream(0);
}

/// The receive state does not depend on which poll thread owns a connection: a receiver
/// restarted with two poll threads instead of one (its connection may now be the second
/// thread's) delivers the rest of the stream exactly once, and so does one restarted with one
/// instead of two.
#[test]
fn restarts_that_change_the_poll_thread_count_lose_and_repeat_nothing() {
    let (one, two) = (
        ["--poll-core", "-2"],
        ["--poll-core", "-2", "--poll-core", "-2"],
    );
    restart_mid_stream_with(1, &one, Some(&two));
    restart_mid_stream_with(1, &two, Some(&one));
}

#[test]
fn cancel_sent_to_a_dead_peer_frees_the_send_buffer() {
    let mut lab = Lab::new(2, 2, &[]);
    let dest = addr(&lab.hosts[1].at(9300));
    // The peer's rdsd is gone for good: nothing will ever be acknowledged.
    lab.hosts[1].daemon.as_mut().unwrap().kill();
    let r = lab.hosts[0].d().attach();
    let s: Socket = r.socket().unwrap();
    s.bind(addr(&lab.hosts[0].at(9301))).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut sent = 0;
    let err = loop {
        match s.send_to(&[1u8; 1000], dest) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 10_000);
    };
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EAGAIN),
        "unacknowledged messages fill SO_SNDBUF"
    );
    assert!(sent >= 100, "{sent}");
    s.cancel_sent_to(Some(dest)).unwrap();
    // Room comes back within a pass or two; the generous bound is for a loaded CI machine, and
    // a failure shows the last error and what rdsd counted (where the bytes stayed).
    let start = Instant::now();
    loop {
        let last = match s.send_to(&[2u8; 1000], dest) {
            Ok(_) => break,
            Err(e) => e,
        };
        if start.elapsed() > Duration::from_secs(20) {
            let d = lab.hosts[0].d();
            let _ = shm_api::info_at(&d.socket, shm_api::ctrl::INFO_SOCKETS);
            panic!(
                "no send-buffer room 20 s after the cancel (last error: {last}); sent {sent}; \
                 rdsd {}; its nonzero counters: {}",
                if d.running() { "running" } else { "gone" },
                shm_api::stats_at(&d.socket).map_or_else(
                    |e| format!("unreadable ({e})"),
                    |t| t
                        .lines()
                        .filter(|l| !l.ends_with(" 0"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// POLLOUT means a send would go. Large messages sent in place keep their tx-ring space until
/// acknowledged, so with SO_SNDBUF above the ring the ring fills first: the fd must then stop
/// saying writable (not send the app spinning on EAGAIN), and say it again once room is back.
#[test]
fn pollout_waits_for_tx_ring_room_when_the_ring_fills_before_the_send_buffer() {
    let mut lab = Lab::new(2, 2, &[]);
    let dest = addr(&lab.hosts[1].at(9302));
    // Nothing is ever acknowledged: in-place messages hold their ring space.
    lab.hosts[1].daemon.as_mut().unwrap().kill();
    let r = lab.hosts[0].d().attach();
    let s: Socket = r.socket().unwrap();
    s.bind(addr(&lab.hosts[0].at(9303))).unwrap();
    s.set_nonblocking(true).unwrap();
    s.set_send_buffer_size(64 << 20).unwrap();
    let fd = s.pollable_fd().unwrap();
    let writable = || shm_api::sys::poll_one(fd, libc::POLLOUT, 0).unwrap() & libc::POLLOUT != 0;
    let big = vec![3u8; 256 << 10];
    let mut sent = 0;
    let err = loop {
        match s.send_to(&big, dest) {
            Ok(_) => sent += 1,
            Err(e) => break e,
        }
        assert!(
            sent < 256,
            "the 2 MiB tx ring should fill long before 64 MiB"
        );
    };
    assert_eq!(err.raw_os_error(), Some(libc::EAGAIN));
    assert!(sent >= 4, "{sent}");
    wait_for(
        || !writable(),
        Duration::from_secs(20),
        "POLLOUT to clear while the tx ring is full",
    );
    // Nothing changes while nothing is acknowledged: it stays clear, and sends still fail.
    assert_eq!(
        shm_api::sys::poll_one(fd, libc::POLLOUT, 300).unwrap() & libc::POLLOUT,
        0
    );
    assert_eq!(
        s.send_to(&big, dest).unwrap_err().raw_os_error(),
        Some(libc::EAGAIN)
    );
    // The cancel releases the held space: POLLOUT comes back, and then the send goes.
    s.cancel_sent_to(Some(dest)).unwrap();
    assert_ne!(
        shm_api::sys::poll_one(fd, libc::POLLOUT, 20_000).unwrap() & libc::POLLOUT,
        0,
        "POLLOUT after the cancel"
    );
    s.send_to(&big, dest).unwrap();
    assert!(
        lab.hosts[0].d().exact_stat("tx_in_place") >= sent,
        "the messages went in place"
    );
}

#[test]
fn malformed_peer_drops_only_its_connection() {
    // Host 0 runs no rdsd: it plays a broken RDS/TCP peer against host 2. It must have the
    // smaller address: rdsd resets connections from larger peers and connects back instead.
    let mut lab = Lab::new(3, 0, &[]);
    lab.start(1, &[]);
    lab.start(2, &[]);
    let (bad, h0, h1) = (&lab.hosts[0], &lab.hosts[1], &lab.hosts[2]);
    let target = h1.addr.to_string();
    let mut downs = h1.d().stat("tcp_path_down");
    for mode in ["random", "oversize", "truncated", "bad-exthdr"] {
        bad.exec(&[
            testapp_bin().to_str().unwrap(),
            "garbage-peer",
            &target,
            "16385",
            mode,
        ]);
        wait_for(
            || h1.d().stat("tcp_path_down") > downs,
            Duration::from_secs(5),
            mode,
        );
        downs = h1.d().stat("tcp_path_down");
    }
    assert!(h1.d().stat("tcp_drop_oversize") >= 1);
    assert!(h1.d().stat("tcp_drop_bad_header") + h1.d().stat("tcp_path_errors") >= 1);
    // rdsd is up and healthy peers still talk.
    let mut r = h1.d().app(&["recv", &h1.at(9400), "500"]);
    r.expect("bound");
    let s = h0
        .d()
        .app(&["send", &h0.at(9401), &h1.at(9400), "500", "100"]);
    assert_eq!(r.expect("received"), "500");
    assert_eq!(s.wait(), 0);
}

/// Network receive publishes per read, not per message (issue 18, item 2): a peer writes 64
/// messages at once, the receiving rdsd reads them in a few reads, and each read publishes the
/// receiver's ring once (it used to publish once per message).
#[test]
fn messages_read_together_are_published_together() {
    // Host 0 runs no rdsd: it plays a kernel-like peer (the smaller address connects).
    let mut lab = Lab::new(2, 0, &[]);
    lab.start(1, &[]);
    let (peer, h1) = (&lab.hosts[0], &lab.hosts[1]);
    let mut r = h1.d().app(&["recv", &h1.at(9500), "64"]);
    r.expect("bound");
    let before = (
        h1.d().exact_stat("rx_publishes"),
        h1.d().stat("tcp_delivered"),
    );
    let target = h1.addr.to_string();
    let testapp = testapp_bin();
    let argv = [testapp.to_str().unwrap(), "burst-peer", &target, "16385"];
    peer.exec(&[&argv[..], &["9501", "9500", "64", "64"]].concat());
    assert_eq!(r.expect("received"), "64");
    let publishes = h1.d().exact_stat("rx_publishes") - before.0;
    assert_eq!(h1.d().stat("tcp_delivered") - before.1, 64);
    eprintln!("{publishes} rx publishes for 64 messages written at once");
    // 64 messages of 112 bytes on the wire, written at once: a read or a few, not 64.
    assert!(
        (1..=8).contains(&publishes),
        "{publishes} rx publishes for 64 messages written at once"
    );
}

/// Kernel TCP on two poll threads (issue 18): each connection, with every path of it, is
/// owned by one thread (the one with the fewest connections when it was first seen: a host's
/// two peers on its two threads), and messages cross between the apps' threads and the
/// connections' threads in order, exactly once, both ways.
#[test]
fn connections_are_spread_over_the_poll_threads_and_lose_nothing() {
    let two = ["--poll-core", "-2", "--poll-core", "-2", "--paths", "2"];
    let lab = Lab::new(3, 3, &two);
    let h = &lab.hosts;
    let mut sinks: Vec<App> = h
        .iter()
        .map(|x| x.d().app(&["recv-multi", &x.at(6000), "4000"]))
        .collect();
    for s in &mut sinks {
        s.expect("bound");
    }
    // Two apps per host: the sink on one thread, the sender on the other (fewest apps first).
    let senders: Vec<App> = (0..3)
        .map(|i| {
            let others: Vec<String> = (0..3).filter(|&j| j != i).map(|j| h[j].at(6000)).collect();
            h[i].d()
                .app(&["fanout", &h[i].at(6001), "2000", &others[0], &others[1]])
        })
        .collect();
    for s in &mut sinks {
        assert_eq!(s.expect("received"), "4000 sources 2");
    }
    for s in senders {
        assert_eq!(s.wait(), 0);
    }
    let mut owners: Vec<u64> = Vec::new();
    for x in h {
        let conns = x.d().info_json(&["-n"])["connections"]
            .as_array()
            .expect("connections")
            .clone();
        let mut peers: Vec<&str> = conns.iter().map(|c| c["faddr"].as_str().unwrap()).collect();
        peers.sort();
        peers.dedup();
        assert_eq!(
            peers.len(),
            2,
            "one connection per peer, on one thread: {conns:?}"
        );
        assert_eq!(conns.len(), 2, "{conns:?}");
        let mut mine: Vec<u64> = conns
            .iter()
            .map(|c| c["shard"].as_u64().expect("shard"))
            .collect();
        owners.extend(&mine);
        // Placed by load: a host's two peers on its two threads (a hash of the address pairs
        // put both on one thread on two of these three hosts).
        mine.sort();
        assert_eq!(mine, [0, 1], "{conns:?}");
        assert_eq!(x.d().stat("tcp_delivered"), 4000);
        // Counted once: a network message the connection's thread hands to the sink's thread is
        // no local delivery there.
        assert_eq!(x.d().stat("loop_delivered"), 0);
        // Each connection's paths are read and written by its thread alone: a thread delivers
        // from the network the 2000 messages of each peer it owns, and writes only if it owns
        // one (`rdsctl threads`' counters).
        let threads = x.d().info_json(&["-T"])["threads"].clone();
        for k in 0..2u64 {
            let owned = conns
                .iter()
                .filter(|c| c["shard"].as_u64() == Some(k))
                .count() as u64;
            let c = &threads[k as usize]["counters"];
            let of = |n: &str| c[n].as_u64().unwrap_or(0);
            assert_eq!(of("tcp_delivered"), 2000 * owned, "thread {k}: {threads}");
            assert_eq!(
                of("tcp_tx_messages") > 0,
                owned > 0,
                "thread {k}: {threads}"
            );
        }
    }
    eprintln!("connection owners: {owners:?}");
}
