//! A real application process for the integration tests. Each subcommand prints progress lines
//! on stdout that the test reads; a failed check exits with status 1.

use rdsd_tests::{payload_seq, seq_payload};
use shm_api::{is_daemon_gone, Rdsd, RecvFlags};
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> T {
    args.get(i).and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        eprintln!("rds-testapp: bad or missing {what}");
        std::process::exit(2)
    })
}

fn say(s: impl AsRef<str>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", s.as_ref());
    let _ = out.flush();
}

/// FNV-1a over (sender port, sequence) pairs in arrival order: two members that got the same
/// messages in the same order print the same digest.
const DIGEST_START: u64 = 0xcbf2_9ce4_8422_2325;

fn digest_step(digest: u64, port: u16, seq: u64) -> u64 {
    [u64::from(port), seq]
        .into_iter()
        .fold(digest, |d, v| (d ^ v).wrapping_mul(0x100_0000_01b3))
}

fn fail(s: impl AsRef<str>) -> ! {
    say(format!("FAIL {}", s.as_ref()));
    std::process::exit(1)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = args.first().map(String::as_str).unwrap_or("");
    if cmd == "garbage-peer" {
        return garbage_peer(&args);
    }
    if cmd == "burst-peer" {
        return burst_peer(&args);
    }
    if cmd == "attach-as" {
        return attach_as(&args);
    }
    if cmd == "join-as" {
        return join_as(&args);
    }
    let rdsd = Rdsd::attach().unwrap_or_else(|e| fail(format!("attach: {e}")));
    match cmd {
        // recv ADDR COUNT [RCVBUF]: receive COUNT sequence-numbered messages, check order.
        "recv" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let count: u64 = arg(&args, 2, "count");
            let s = rdsd.socket().unwrap();
            if let Some(rb) = args.get(3) {
                s.set_recv_buffer_size(rb.parse().unwrap()).unwrap();
            }
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            say(format!("bound {}", s.local_addr().unwrap().port()));
            let mut buf = vec![0u8; 1 << 20];
            let mut expect = 0u64;
            while expect < count {
                let (n, _from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv: {e}")));
                let seq = payload_seq(&buf[..n]);
                if seq != expect {
                    fail(format!("out of order: got {seq}, expected {expect}"));
                }
                expect += 1;
            }
            say(format!("received {expect}"));
        }
        // send SRC DST COUNT LEN [hold]: send COUNT sequence-numbered messages (blocking); with
        // "hold", keep the socket open afterwards until killed (a close drops what rdsd has
        // not sent yet, as in rds(7)).
        "send" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let count: u64 = arg(&args, 3, "count");
            let len: usize = arg(&args, 4, "len");
            let s = rdsd.socket().unwrap();
            s.bind(src).unwrap_or_else(|e| fail(format!("bind: {e}")));
            for i in 0..count {
                s.send_to(&seq_payload(i, len), dst)
                    .unwrap_or_else(|e| fail(format!("send {i}: {e}")));
            }
            say(format!("sent {count}"));
            if args.get(5).is_some_and(|a| a == "hold") {
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        }
        // echo ADDR COUNT: bind, then send each of COUNT messages back to its sender.
        "echo" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let count: u64 = arg(&args, 2, "count");
            let s = rdsd.socket().unwrap();
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            say(format!("bound {}", s.local_addr().unwrap().port()));
            let mut buf = vec![0u8; 1 << 20];
            for i in 0..count {
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv {i}: {e}")));
                s.send_to(&buf[..n], from)
                    .unwrap_or_else(|e| fail(format!("echo {i}: {e}")));
            }
            say(format!("echoed {count}"));
        }
        // ping SRC DST COUNT LEN: COUNT round trips of LEN-byte messages with an echo at DST.
        "ping" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let count: u64 = arg(&args, 3, "count");
            let len: usize = arg(&args, 4, "len");
            let s = rdsd.socket().unwrap();
            s.bind(src).unwrap_or_else(|e| fail(format!("bind: {e}")));
            let mut buf = vec![0u8; len.max(64)];
            for i in 0..count {
                s.send_to(&seq_payload(i, len), dst)
                    .unwrap_or_else(|e| fail(format!("send {i}: {e}")));
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv {i}: {e}")));
                if from != dst || payload_seq(&buf[..n]) != i {
                    fail(format!("round trip {i}: wrong reply"));
                }
            }
            say(format!("pinged {count}"));
        }
        // hold ADDR [N]: binds N sockets (default 1) on ADDR's port and the ones after it,
        // says "bound", and sleeps with them open.
        "hold" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let n: u16 = args.get(2).map_or(1, |_| arg(&args, 2, "count"));
            let _held: Vec<_> = (0..n)
                .map(|k| {
                    let s = rdsd.socket().unwrap();
                    let at = SocketAddrV4::new(*addr.ip(), addr.port() + k);
                    s.bind(at)
                        .unwrap_or_else(|e| fail(format!("bind {at}: {e}")));
                    s
                })
                .collect();
            say("bound");
            std::thread::sleep(Duration::from_secs(3600));
        }
        // flood SRC DST: send forever (to be killed mid-traffic).
        "flood" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let s = rdsd.socket().unwrap();
            s.bind(src).unwrap();
            s.set_nonblocking(true).unwrap();
            say("flooding");
            let mut i = 0u64;
            loop {
                match s.send_to(&seq_payload(i, 256), dst) {
                    Ok(_) => i += 1,
                    Err(e) if is_daemon_gone(&e) => fail("rdsd gone"),
                    Err(_) => std::thread::yield_now(),
                }
            }
        }
        // scribble MODE: break our own ring in a given way, then report eviction.
        "scribble" => {
            let mode = args.get(1).cloned().unwrap_or_default();
            let s = rdsd.socket().unwrap();
            s.bind(arg(&args, 2, "addr")).unwrap();
            let (base, len) = rdsd.region_for_tests();
            let slot_off = rdsd.slot_offset_for_tests(s.slot_for_tests());
            let tx_ring = slot_off + 512; // control block, then tx ring header
                                          // SAFETY: our own mapping; offsets inside it. This process deliberately corrupts
                                          // its own region to prove rdsd survives it.
            unsafe {
                let producer = base.add(tx_ring) as *mut u64;
                let data = base.add(tx_ring + 256);
                match mode.as_str() {
                    "huge-index" => producer.write_volatile(u64::MAX / 3),
                    "misaligned" => producer.write_volatile(24),
                    "huge-len" => {
                        data.cast::<u32>().write_volatile(u32::MAX - 5);
                        data.add(4).cast::<u16>().write_volatile(1);
                        producer.write_volatile(64);
                    }
                    "bad-kind" => {
                        data.add(4).cast::<u16>().write_volatile(0x7777);
                        producer.write_volatile(32);
                    }
                    "random" => {
                        let mut x = 0x9e3779b97f4a7c15u64 ^ std::process::id() as u64;
                        for i in 0..4096usize {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            data.add(i % (len - tx_ring - 256)).write_volatile(x as u8);
                        }
                        producer.write_volatile(4096);
                    }
                    other => fail(format!("unknown mode {other}")),
                }
            }
            say("scribbled");
            let start = Instant::now();
            let mut buf = [0u8; 64];
            loop {
                match s.recv_msg(
                    &mut buf,
                    RecvFlags {
                        dontwait: true,
                        ..Default::default()
                    },
                ) {
                    Err(e) if is_daemon_gone(&e) => {
                        say("evicted");
                        break;
                    }
                    _ if start.elapsed() > Duration::from_secs(10) => fail("not evicted"),
                    _ => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        // block-recv ADDR: block in recv; report rdsd's death, then re-attach and round-trip.
        "block-recv" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let s = rdsd.socket().unwrap();
            s.bind(addr).unwrap();
            say("waiting");
            let mut buf = [0u8; 64];
            let t = Instant::now();
            match s.recv_from(&mut buf) {
                Err(e) if is_daemon_gone(&e) => {
                    say(format!("gone after {} ms: {e}", t.elapsed().as_millis()))
                }
                other => fail(format!("unexpected {other:?}")),
            }
            drop(s);
            drop(rdsd);
            let start = Instant::now();
            let again = loop {
                match Rdsd::attach() {
                    Ok(r) => break r,
                    Err(_) if start.elapsed() < Duration::from_secs(30) => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    Err(e) => fail(format!("reattach: {e}")),
                }
            };
            say("reattached");
            let a = again.socket().unwrap();
            a.bind(addr)
                .unwrap_or_else(|e| fail(format!("rebind: {e}")));
            a.send_to(b"hi", addr).unwrap();
            let (n, from) = a.recv_from(&mut buf).unwrap();
            if &buf[..n] != b"hi" || from != addr {
                fail("bad roundtrip");
            }
            say("roundtrip ok");
        }
        // cong-sender SRC DST: monitor on; non-blocking sends until ENOBUFS; wait for the
        // congestion update; then one blocking send.
        "cong-sender" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let s = rdsd.socket().unwrap();
            s.bind(src).unwrap();
            s.set_cong_monitor(true).unwrap();
            let mut i = 0u64;
            let start = Instant::now();
            loop {
                match s.send_msg(&seq_payload(i, 512), Some(dst), true) {
                    Ok(_) => i += 1,
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::yield_now(),
                    Err(e) => fail(format!("send: {e}")),
                }
                if start.elapsed() > Duration::from_secs(20) {
                    fail("never congested");
                }
            }
            say(format!("enobufs {i}"));
            s.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut buf = [0u8; 16];
            let m = s
                .recv_msg(&mut buf, RecvFlags::default())
                .unwrap_or_else(|e| fail(format!("recv: {e}")));
            match m.cong_update {
                Some(mask) if m.len == 0 => say(format!("cong_update {mask}")),
                _ => fail(format!("expected a congestion update, got {m:?}")),
            }
            s.send_to(&seq_payload(i, 512), dst)
                .unwrap_or_else(|e| fail(format!("send after clear: {e}")));
            say(format!("sent-after-clear {}", i + 1));
        }
        // recv-multi ADDR TOTAL: receive TOTAL messages from any senders; each sender's
        // sequence must run 0, 1, 2, ... without gaps, duplicates or reordering.
        "recv-multi" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let total: u64 = arg(&args, 2, "total");
            let s = rdsd.socket().unwrap();
            s.set_recv_buffer_size(8 << 20).unwrap();
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            say("bound");
            let mut next = std::collections::HashMap::<SocketAddrV4, u64>::new();
            let mut buf = vec![0u8; 1 << 20];
            for _ in 0..total {
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv: {e}")));
                let seq = payload_seq(&buf[..n]);
                let e = next.entry(from).or_insert(0);
                if seq != *e {
                    fail(format!("from {from}: got {seq}, expected {e}"));
                }
                *e += 1;
            }
            say(format!("received {total} sources {}", next.len()));
        }
        // group-member ADDR GROUP FLAGS RCVBUF READ COUNT: binds ADDR, joins GROUP with FLAGS,
        // prints "joined"; if READ is 1, receives COUNT messages (sender port and sequence),
        // then prints "done COUNT DIGEST", the digest a hash of the sequence in arrival order
        // (two members that got the same messages in the same order print the same); if READ is
        // 0, never reads (a member that holds the group back until it dies).
        "group-member" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let group: SocketAddrV4 = arg(&args, 2, "group");
            let flags: u32 = arg(&args, 3, "flags");
            let rcvbuf: usize = arg(&args, 4, "rcvbuf");
            let read: u8 = arg(&args, 5, "read");
            let count: u64 = arg(&args, 6, "count");
            let s = rdsd.socket().unwrap();
            s.set_recv_buffer_size(rcvbuf).unwrap();
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            s.group_join(group, shm_api::GroupFlags::from_bits(flags))
                .unwrap_or_else(|e| fail(format!("join: {e}")));
            say("joined");
            if read == 0 {
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            let mut buf = vec![0u8; 1 << 20];
            let mut digest = DIGEST_START;
            for _ in 0..count {
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv: {e}")));
                digest = digest_step(digest, from.port(), payload_seq(&buf[..n]));
            }
            say(format!("done {count} {digest:016x}"));
        }
        // group-talk ADDR GROUP FLAGS COUNT EXPECT GO: binds ADDR, joins GROUP with FLAGS,
        // prints "joined"; once the file GO exists sends COUNT messages to the group, then
        // receives EXPECT and prints "done EXPECT DIGEST own K" (the digest as group-member's,
        // K the messages from its own socket).
        "group-talk" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let group: SocketAddrV4 = arg(&args, 2, "group");
            let flags: u32 = arg(&args, 3, "flags");
            let count: u64 = arg(&args, 4, "count");
            let expect: u64 = arg(&args, 5, "expect");
            let go = std::path::PathBuf::from(&args[6]);
            let s = rdsd.socket().unwrap();
            s.set_recv_buffer_size(1 << 20).unwrap();
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            s.group_join(group, shm_api::GroupFlags::from_bits(flags))
                .unwrap_or_else(|e| fail(format!("join: {e}")));
            say("joined");
            while !go.exists() {
                std::thread::sleep(Duration::from_millis(10));
            }
            for i in 0..count {
                s.send_to(&seq_payload(i, 100), group)
                    .unwrap_or_else(|e| fail(format!("send {i}: {e}")));
            }
            let mut buf = vec![0u8; 1 << 16];
            let (mut digest, mut own) = (DIGEST_START, 0);
            for _ in 0..expect {
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv: {e}")));
                own += u64::from(from == addr);
                digest = digest_step(digest, from.port(), payload_seq(&buf[..n]));
            }
            say(format!("done {expect} {digest:016x} own {own}"));
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // group-create ADDR GROUP OPEN: binds ADDR, creates GROUP (any uid may join if OPEN is
        // 1), prints "created" (or "error ERRNO"), then holds it until killed.
        "group-create" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let group: SocketAddrV4 = arg(&args, 2, "group");
            let open: u8 = arg(&args, 3, "open");
            let s = rdsd.socket().unwrap();
            s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
            let r = if open == 1 {
                s.group_create_open(group)
            } else {
                s.group_create(group)
            };
            match r {
                Ok(()) => say("created"),
                Err(e) => say(format!("error {}", e.raw_os_error().unwrap_or(0))),
            }
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // fanout SRC COUNT DST...: one socket sends COUNT messages to each destination in turn.
        "fanout" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let count: u64 = arg(&args, 2, "count");
            let dsts: Vec<SocketAddrV4> =
                args[3..].iter().map(|a| a.parse().expect("dst")).collect();
            let s = rdsd.socket().unwrap();
            s.bind(src).unwrap();
            for i in 0..count {
                for d in &dsts {
                    s.send_to(&seq_payload(i, 100), *d)
                        .unwrap_or_else(|e| fail(format!("send: {e}")));
                }
            }
            say(format!("sent {count}"));
        }
        // multi-send SRC_IP FIRST_PORT NSOCKS DST COUNT: NSOCKS sockets (ports FIRST_PORT..)
        // each send COUNT messages to DST, interleaved.
        "multi-send" => {
            let ip: std::net::Ipv4Addr = arg(&args, 1, "src ip");
            let first: u16 = arg(&args, 2, "first port");
            let n: u16 = arg(&args, 3, "nsocks");
            let dst: SocketAddrV4 = arg(&args, 4, "dst");
            let count: u64 = arg(&args, 5, "count");
            let socks: Vec<_> = (0..n)
                .map(|k| {
                    let s = rdsd.socket().unwrap();
                    s.bind(SocketAddrV4::new(ip, first + k)).unwrap();
                    s
                })
                .collect();
            for i in 0..count {
                for s in &socks {
                    s.send_to(&seq_payload(i, 64 + (i as usize % 200)), dst)
                        .unwrap_or_else(|e| fail(format!("send: {e}")));
                }
            }
            say(format!("sent {}", count * n as u64));
        }
        // send-resilient SRC DST COUNT GAP_US: sends COUNT messages, pausing GAP_US between
        // them; if rdsd dies, attaches again, re-binds and goes on with the same sequence.
        "send-resilient" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let count: u64 = arg(&args, 3, "count");
            let gap: u64 = arg(&args, 4, "gap us");
            let mut r = rdsd;
            let mut s = r.socket().unwrap();
            s.bind(src).unwrap();
            s.set_send_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut restarts = 0;
            let mut i = 0u64;
            say("sending");
            while i < count {
                match s.send_to(&seq_payload(i, 128), dst) {
                    Ok(_) => i += 1,
                    Err(e) if is_daemon_gone(&e) => {
                        restarts += 1;
                        drop(s);
                        r = reattach();
                        s = r.socket().unwrap();
                        s.bind(src).unwrap_or_else(|e| fail(format!("rebind: {e}")));
                        s.set_send_timeout(Some(Duration::from_secs(30))).unwrap();
                    }
                    Err(e) => fail(format!("send {i}: {e}")),
                }
                if gap > 0 {
                    std::thread::sleep(Duration::from_micros(gap));
                }
            }
            say(format!("sent {count} restarts {restarts}"));
            // Stay attached until the test is done: a closed socket drops unsent messages.
            std::thread::sleep(Duration::from_secs(600));
        }
        // recv-resilient ADDR LAST: receives until sequence LAST; if rdsd dies, attaches again
        // and re-binds. Sequences must strictly increase (no duplicate, no reordering).
        "recv-resilient" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let last: u64 = arg(&args, 2, "last");
            let mut r = rdsd;
            let mut s = r.socket().unwrap();
            s.set_recv_buffer_size(8 << 20).unwrap();
            s.bind(addr).unwrap();
            say("bound");
            let (mut gaps, mut missing, mut restarts, mut got) = (0u64, 0u64, 0u64, 0u64);
            let mut prev: Option<u64> = None;
            let mut buf = vec![0u8; 4096];
            loop {
                match s.recv_from(&mut buf) {
                    Ok((n, _)) => {
                        let seq = payload_seq(&buf[..n]);
                        let expect = prev.map_or(0, |p| p + 1);
                        if prev.is_some_and(|p| seq <= p) {
                            fail(format!(
                                "duplicate or reordering: {seq} after {}",
                                prev.unwrap()
                            ));
                        }
                        if seq != expect {
                            gaps += 1;
                            missing += seq - expect;
                        }
                        prev = Some(seq);
                        got += 1;
                        if seq == last {
                            break;
                        }
                    }
                    Err(e) if is_daemon_gone(&e) => {
                        restarts += 1;
                        drop(s);
                        r = reattach();
                        s = r.socket().unwrap();
                        s.set_recv_buffer_size(8 << 20).unwrap();
                        s.bind(addr)
                            .unwrap_or_else(|e| fail(format!("rebind: {e}")));
                        say("rebound");
                    }
                    Err(e) => fail(format!("recv: {e}")),
                }
            }
            say(format!(
                "done got {got} gaps {gaps} missing {missing} restarts {restarts}"
            ));
        }
        // send-bounded SRC DST COUNT LEN SNDBUF TIMEOUT_MS [GAP_US]: blocking sends of COUNT
        // sequence-numbered messages of LEN bytes (SO_SNDBUF = SNDBUF unless 0), pausing GAP_US
        // after each; fails if one send or the whole run takes longer than TIMEOUT_MS. Prints
        // "sent COUNT in MS ms", then stays attached (a closed socket drops unsent messages)
        // until killed.
        "send-bounded" => {
            let src: SocketAddrV4 = arg(&args, 1, "src");
            let dst: SocketAddrV4 = arg(&args, 2, "dst");
            let count: u64 = arg(&args, 3, "count");
            let len: usize = arg(&args, 4, "len");
            let sndbuf: usize = arg(&args, 5, "sndbuf");
            let limit = Duration::from_millis(arg(&args, 6, "timeout ms"));
            let gap: u64 = if args.len() > 7 {
                arg(&args, 7, "gap us")
            } else {
                0
            };
            let s = rdsd.socket().unwrap();
            if sndbuf > 0 {
                s.set_send_buffer_size(sndbuf)
                    .unwrap_or_else(|e| fail(format!("SO_SNDBUF: {e}")));
            }
            s.set_send_timeout(Some(limit)).unwrap();
            s.bind(src).unwrap_or_else(|e| fail(format!("bind: {e}")));
            say("sending");
            let start = Instant::now();
            for i in 0..count {
                s.send_to(&seq_payload(i, len), dst)
                    .unwrap_or_else(|e| fail(format!("send {i} of {count}: {e}")));
                if gap > 0 {
                    std::thread::sleep(Duration::from_micros(gap));
                }
                if start.elapsed() > limit {
                    fail(format!("only {} of {count} sent in {limit:?}", i + 1));
                }
            }
            say(format!(
                "sent {count} in {} ms",
                start.elapsed().as_millis()
            ));
            std::thread::sleep(Duration::from_secs(600));
        }
        // recv-resilient-count ADDR LAST IDLE_MS: like recv-resilient, but counts duplicates
        // (a sequence seen before) and reorderings (a lower sequence not seen before) instead
        // of failing on the first, and gives up after IDLE_MS without a message. Prints up to
        // 20 "anomaly ..." lines, then
        // "done got G gaps N missing M dups D reorders R restarts K last L timeout T".
        "recv-resilient-count" => {
            let addr: SocketAddrV4 = arg(&args, 1, "addr");
            let last: u64 = arg(&args, 2, "last");
            let idle = Duration::from_millis(arg(&args, 3, "idle ms"));
            let open = |r: &Rdsd| {
                let s = r.socket().unwrap();
                s.set_recv_buffer_size(8 << 20).unwrap();
                s.set_recv_timeout(Some(idle)).unwrap();
                s.bind(addr)
                    .unwrap_or_else(|e| fail(format!("rebind: {e}")));
                s
            };
            let mut r = rdsd;
            let mut s = open(&r);
            say("bound");
            let (mut gaps, mut missing, mut restarts, mut got) = (0u64, 0u64, 0u64, 0u64);
            let (mut dups, mut reorders, mut timeout, mut reports) = (0u64, 0u64, 0u64, 0);
            let mut seen = vec![false; last as usize + 1];
            let mut prev: Option<u64> = None;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                match s.recv_from(&mut buf) {
                    Ok((n, _)) => {
                        let seq = payload_seq(&buf[..n]);
                        if seq > last {
                            fail(format!("sequence {seq} beyond {last}"));
                        }
                        got += 1;
                        let p = prev.unwrap_or(0);
                        if prev.is_some_and(|p| seq <= p) {
                            let dup = seen[seq as usize];
                            if dup {
                                dups += 1;
                            } else {
                                reorders += 1;
                            }
                            if reports < 20 {
                                reports += 1;
                                let what = if dup { "duplicate" } else { "reordered" };
                                say(format!(
                                    "anomaly {what} {seq} after {p} (restarts so far {restarts})"
                                ));
                            }
                        } else {
                            let expect = prev.map_or(0, |p| p + 1);
                            if seq != expect {
                                gaps += 1;
                                missing += seq - expect;
                            }
                            prev = Some(seq);
                        }
                        seen[seq as usize] = true;
                        if seq == last {
                            break;
                        }
                    }
                    Err(e) if is_daemon_gone(&e) => {
                        restarts += 1;
                        drop(s);
                        r = reattach();
                        s = open(&r);
                        say("rebound");
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ETIMEDOUT) => {
                        timeout = 1;
                        break;
                    }
                    Err(e) => fail(format!("recv: {e}")),
                }
            }
            say(format!(
                "done got {got} gaps {gaps} missing {missing} dups {dups} reorders {reorders} \
                 restarts {restarts} last {} timeout {timeout}",
                prev.map_or(-1, |p| p as i64)
            ));
        }
        // pingpong A B COUNT SECS LIMIT_MS: two sockets bound at A and B bounce a message
        // back and forth until at least COUNT round trips are done and SECS seconds have
        // passed; every receive must come within LIMIT_MS. Prints "started" once bound, then
        // "pingpong N round trips in MS ms, max rtt US us".
        "pingpong" => {
            let a: SocketAddrV4 = arg(&args, 1, "a");
            let b: SocketAddrV4 = arg(&args, 2, "b");
            let count: u64 = arg(&args, 3, "count");
            let secs: u64 = arg(&args, 4, "secs");
            let limit = Duration::from_millis(arg(&args, 5, "limit ms"));
            let sa = rdsd
                .socket()
                .unwrap_or_else(|e| fail(format!("socket: {e}")));
            let sb = rdsd
                .socket()
                .unwrap_or_else(|e| fail(format!("socket: {e}")));
            sa.bind(a).unwrap_or_else(|e| fail(format!("bind: {e}")));
            sb.bind(b).unwrap_or_else(|e| fail(format!("bind: {e}")));
            sa.set_recv_timeout(Some(limit)).unwrap();
            sb.set_recv_timeout(Some(limit)).unwrap();
            say("started");
            let start = Instant::now();
            let mut buf = [0u8; 256];
            let mut i = 0u64;
            let mut max_rtt = Duration::ZERO;
            while i < count || start.elapsed() < Duration::from_secs(secs) {
                let t = Instant::now();
                sa.send_to(&seq_payload(i, 64), b)
                    .unwrap_or_else(|e| fail(format!("send {i}: {e}")));
                let (n, from) = sb
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv {i} at b: {e}")));
                if payload_seq(&buf[..n]) != i || from != a {
                    fail(format!("round trip {i}: wrong message at b"));
                }
                sb.send_to(&buf[..n], a)
                    .unwrap_or_else(|e| fail(format!("echo {i}: {e}")));
                let (n, from) = sa
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| fail(format!("recv {i} at a: {e}")));
                if payload_seq(&buf[..n]) != i || from != b {
                    fail(format!("round trip {i}: wrong echo at a"));
                }
                max_rtt = max_rtt.max(t.elapsed());
                i += 1;
            }
            say(format!(
                "pingpong {i} round trips in {} ms, max rtt {} us",
                start.elapsed().as_millis(),
                max_rtt.as_micros()
            ));
        }
        other => fail(format!("unknown command {other:?}")),
    }
}

/// attach-as UID N SILENT: switches to UID (and GID), opens SILENT control connections that
/// say nothing, then attaches N times, holding everything. Prints "attached K" for each
/// success, or "refused K errno E: MESSAGE" and stops at the first failure; then "done" and
/// sleeps until killed.
fn attach_as(args: &[String]) {
    let uid: u32 = arg(args, 1, "uid");
    let n: u32 = arg(args, 2, "count");
    let silent: u32 = arg(args, 3, "silent");
    // SAFETY: a credential syscall on this process; no memory is passed.
    let gid_set = unsafe { libc::setresgid(uid, uid, uid) } == 0;
    // SAFETY: as above (the uid after the gid, while we may still change the gid).
    if !gid_set || unsafe { libc::setresuid(uid, uid, uid) } != 0 {
        fail(format!("setresuid: {}", std::io::Error::last_os_error()));
    }
    let path = std::env::var_os("RDSD_SOCKET").expect("RDSD_SOCKET");
    let quiet: Vec<_> = (0..silent)
        .map(|_| {
            shm_api::sys::connect_seqpacket(std::path::Path::new(&path))
                .unwrap_or_else(|e| fail(format!("connect: {e}")))
        })
        .collect();
    let mut held = Vec::new();
    for k in 0..n {
        match Rdsd::attach() {
            Ok(r) => {
                held.push(r);
                say(format!("attached {k}"));
            }
            Err(e) => {
                say(format!(
                    "refused {k} errno {}: {}",
                    e.raw_os_error().unwrap_or(-1),
                    shm_api::explain(&e)
                ));
                break;
            }
        }
    }
    say("done");
    drop(quiet);
    std::thread::sleep(Duration::from_secs(600));
}

/// join-as UID ADDR GROUP: as UID, binds ADDR and joins GROUP; prints "joined" and then
/// "got SEQ" for the first message, or "refused errno N".
fn join_as(args: &[String]) {
    let uid: u32 = arg(args, 1, "uid");
    let addr: SocketAddrV4 = arg(args, 2, "addr");
    let group: SocketAddrV4 = arg(args, 3, "group");
    // SAFETY: credential syscalls on this process; no memory is passed.
    let gid_set = unsafe { libc::setresgid(uid, uid, uid) } == 0;
    // SAFETY: as above (the uid after the gid, while we may still change the gid).
    if !gid_set || unsafe { libc::setresuid(uid, uid, uid) } != 0 {
        fail(format!("setresuid: {}", std::io::Error::last_os_error()));
    }
    let rdsd = Rdsd::attach().unwrap_or_else(|e| fail(format!("attach: {e}")));
    let s = rdsd.socket().unwrap();
    s.bind(addr).unwrap_or_else(|e| fail(format!("bind: {e}")));
    if let Err(e) = s.group_join(group, shm_api::GroupFlags::NONE) {
        say(format!("refused errno {}", e.raw_os_error().unwrap_or(-1)));
        return;
    }
    say("joined");
    let mut buf = [0u8; 64];
    let (n, _) = s
        .recv_from(&mut buf)
        .unwrap_or_else(|e| fail(format!("recv: {e}")));
    say(format!("got {}", payload_seq(&buf[..n])));
}

fn reattach() -> Rdsd {
    let start = Instant::now();
    loop {
        match Rdsd::attach() {
            Ok(r) => return r,
            Err(_) if start.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => fail(format!("reattach: {e}")),
        }
    }
}

/// garbage-peer ADDR PORT MODE: a malformed RDS/TCP peer (no rdsd needed).
fn garbage_peer(args: &[String]) {
    use std::io::Write;
    let addr: std::net::SocketAddr = format!("{}:{}", args[1], args[2]).parse().expect("addr");
    let mode = args.get(3).map(String::as_str).unwrap_or("");
    let mut t = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| fail(format!("connect: {e}")));
    let mut hdr = [0u8; 48];
    match mode {
        "random" => {
            let mut x = 0x2545F4914F6CDD1Du64;
            let junk: Vec<u8> = (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = t.write_all(&junk);
        }
        "oversize" => {
            hdr[7] = 1; // sequence 1
            hdr[16..20].copy_from_slice(&(2u32 << 20).to_be_bytes()); // h_len 2 MiB
            hdr[20..22].copy_from_slice(&5u16.to_be_bytes());
            hdr[22..24].copy_from_slice(&6u16.to_be_bytes());
            let _ = t.write_all(&hdr);
            let _ = t.write_all(&[0u8; 4096]);
        }
        "truncated" => {
            hdr[7] = 1;
            hdr[16..20].copy_from_slice(&1000u32.to_be_bytes());
            hdr[20..22].copy_from_slice(&5u16.to_be_bytes());
            hdr[22..24].copy_from_slice(&6u16.to_be_bytes());
            let _ = t.write_all(&hdr[..30]);
            std::thread::sleep(Duration::from_millis(50));
            let _ = t.write_all(&hdr[30..]);
            let _ = t.write_all(&[7u8; 100]);
        }
        "bad-exthdr" => {
            hdr[7] = 1;
            hdr[20..22].copy_from_slice(&5u16.to_be_bytes());
            hdr[32] = 5; // NPATHS claims 2 bytes ...
            hdr[33] = 0xff;
            hdr[34] = 0xff;
            hdr[35] = 200; // ... then a type >= 16
            let _ = t.write_all(&hdr);
        }
        other => fail(format!("unknown mode {other}")),
    }
    let _ = t.flush();
    std::thread::sleep(Duration::from_millis(200));
    say("sent garbage");
}

/// burst-peer ADDR PORT SPORT DPORT COUNT LEN: a kernel-like RDS/TCP peer (no rdsd needed, no
/// extension headers) that writes COUNT sequence-numbered data messages of LEN bytes from RDS
/// port SPORT to DPORT in one `write`, so the receiving rdsd reads many messages at once.
fn burst_peer(args: &[String]) {
    use std::io::Write;
    let addr: std::net::SocketAddr = format!("{}:{}", args[1], args[2]).parse().expect("addr");
    let (sport, dport): (u16, u16) = (arg(args, 3, "sport"), arg(args, 4, "dport"));
    let (count, len): (u64, usize) = (arg(args, 5, "count"), arg(args, 6, "len"));
    let mut t = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| fail(format!("connect: {e}")));
    let mut wire = Vec::with_capacity(count as usize * (48 + len));
    for i in 0..count {
        let mut hdr = [0u8; 48];
        hdr[0..8].copy_from_slice(&(i + 1).to_be_bytes());
        hdr[16..20].copy_from_slice(&(len as u32).to_be_bytes());
        hdr[20..22].copy_from_slice(&sport.to_be_bytes());
        hdr[22..24].copy_from_slice(&dport.to_be_bytes());
        wire.extend_from_slice(&hdr);
        wire.extend_from_slice(&seq_payload(i, len));
    }
    t.write_all(&wire)
        .unwrap_or_else(|e| fail(format!("write: {e}")));
    // Closing at once could reset the connection before the receiver read it all.
    std::thread::sleep(Duration::from_secs(1));
    say(format!("sent {count}"));
}
