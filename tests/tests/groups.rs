//! Multicast groups (issue 20): a message sent to a group reaches every eligible member or
//! none, all members see one order, a full member holds the group back (EAGAIN, blocking,
//! POLLOUT) unless it joined with DROP_WHEN_FULL, filters choose by sender, and closing a
//! socket or killing its process leaves its groups. Every check counts messages; none times.

use rdsd_tests::{lo, payload_seq, seq_payload, wait_channel, wait_for, Daemon};
use shm_api::ctrl::FilterRule;
use shm_api::{GroupFilter, GroupFlags, RecvFlags, Socket};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn group(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(239, 1, 2, 3), port)
}

fn errno_of<T: std::fmt::Debug>(r: io::Result<T>) -> i32 {
    r.expect_err("must fail").raw_os_error().expect("an errno")
}

fn bound(app: &shm_api::Rdsd, port: u16) -> Socket {
    let s = app.socket().unwrap();
    s.bind(lo(port)).unwrap();
    s
}

/// Receives `n` messages: (sender port, sequence number).
fn take(s: &Socket, n: usize) -> Vec<(u16, u64)> {
    let mut buf = vec![0u8; 1 << 16];
    (0..n)
        .map(|_| {
            let (len, from) = s.recv_from(&mut buf).unwrap();
            (from.port(), payload_seq(&buf[..len]))
        })
        .collect()
}

/// Everything queued now (non-blocking).
fn drain(s: &Socket) -> Vec<(u16, u64)> {
    let mut buf = vec![0u8; 1 << 16];
    let mut got = Vec::new();
    let flags = RecvFlags {
        dontwait: true,
        ..RecvFlags::default()
    };
    while let Ok(m) = s.recv_msg(&mut buf, flags) {
        got.push((m.from.unwrap().port(), payload_seq(&buf[..m.len])));
    }
    got
}

fn gettid() -> u32 {
    // SAFETY: gettid takes no argument and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

#[test]
fn membership_errors_follow_their_unicast_and_ip_multicast_analogues() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5000);
    let creator = bound(&app, 9401);
    assert_eq!(errno_of(creator.group_create(lo(5000))), libc::EINVAL);
    assert_eq!(errno_of(creator.group_create(group(0))), libc::EINVAL);
    creator.group_create(g).unwrap();
    assert_eq!(errno_of(creator.group_create(g)), libc::EADDRINUSE);
    let m = bound(&app, 9402);
    assert_eq!(
        errno_of(m.group_join(group(5001), GroupFlags::NONE)),
        libc::ENOENT
    );
    let unbound = app.socket().unwrap();
    assert_eq!(
        errno_of(unbound.group_join(g, GroupFlags::NONE)),
        libc::ENOTCONN
    );
    assert_eq!(
        errno_of(m.group_join(g, GroupFlags::from_bits(4))),
        libc::EINVAL
    );
    m.group_join(g, GroupFlags::NONE).unwrap();
    assert_eq!(
        errno_of(m.group_join(g, GroupFlags::NONE)),
        libc::EADDRINUSE
    );
    m.group_set_flags(g, GroupFlags::LOOPBACK).unwrap();
    let too_many = GroupFilter::Only(vec![
        FilterRule {
            addr: Ipv4Addr::LOCALHOST,
            prefix_len: 32,
            first_port: 1,
            last_port: 2,
        };
        17
    ]);
    assert_eq!(errno_of(m.group_set_filter(g, &too_many)), libc::EINVAL);
    assert_eq!(
        errno_of(creator.group_set_filter(g, &GroupFilter::All)),
        libc::EADDRNOTAVAIL,
        "the creator is not a member"
    );
    m.group_leave(g).unwrap();
    assert_eq!(errno_of(m.group_leave(g)), libc::EADDRNOTAVAIL);
    assert_eq!(
        errno_of(m.group_set_flags(g, GroupFlags::NONE)),
        libc::EADDRNOTAVAIL
    );
    // A group address is not a bind address, and port 0 names no group.
    let s = app.socket().unwrap();
    assert_eq!(errno_of(s.bind(g)), libc::EINVAL);
    assert_eq!(errno_of(m.send_to(b"x", group(0))), libc::EINVAL);
    assert_eq!(d.stat("groups_created"), 1);
}

#[test]
fn every_member_sees_every_sender_in_one_order() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5010);
    let (s1, s2) = (bound(&app, 9411), bound(&app, 9412));
    // m1 sends too, without LOOPBACK: it never gets its own. m3 sends with LOOPBACK.
    let (m1, m2, m3) = (bound(&app, 9413), bound(&app, 9414), bound(&app, 9415));
    s1.group_create(g).unwrap();
    m1.group_join(g, GroupFlags::NONE).unwrap();
    m2.group_join(g, GroupFlags::NONE).unwrap();
    m3.group_join(g, GroupFlags::LOOPBACK).unwrap();
    const EACH: u64 = 300;
    let senders = [&s1, &s2, &m1, &m3];
    let (got1, got2, got3) = std::thread::scope(|sc| {
        for s in senders {
            // The default SO_RCVBUF fills: the senders also block on the group's flow control.
            sc.spawn(move || {
                for i in 0..EACH {
                    s.send_to(&seq_payload(i, 64 + (i as usize % 300)), g)
                        .unwrap();
                }
            });
        }
        let r1 = sc.spawn(|| take(&m1, 3 * EACH as usize));
        let r2 = sc.spawn(|| take(&m2, 4 * EACH as usize));
        let r3 = sc.spawn(|| take(&m3, 4 * EACH as usize));
        (r1.join().unwrap(), r2.join().unwrap(), r3.join().unwrap())
    });
    assert_eq!(got2, got3, "m2 and m3 saw one order");
    let without_m1: Vec<_> = got2.iter().copied().filter(|m| m.0 != 9413).collect();
    assert_eq!(
        got1, without_m1,
        "m1 saw the same order, less its own messages"
    );
    for port in [9411, 9412, 9413, 9415] {
        let seqs: Vec<u64> = got2.iter().filter(|m| m.0 == port).map(|m| m.1).collect();
        assert_eq!(
            seqs,
            (0..EACH).collect::<Vec<_>>(),
            "sender {port} in order"
        );
    }
    assert!(drain(&m1).is_empty() && drain(&m2).is_empty() && drain(&m3).is_empty());
    assert!(
        drain(&s1).is_empty(),
        "a sender that is not a member gets nothing"
    );
    wait_for(
        || d.stat("group_sends") == 4 * EACH,
        LIMIT,
        "the group sends counted",
    );
    assert_eq!(d.exact_stat("group_deliveries"), 11 * EACH);
}

#[test]
fn a_full_member_holds_the_group_back_and_nobody_gets_the_message() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5020);
    let sender = bound(&app, 9421);
    let full = app.socket().unwrap();
    full.set_recv_buffer_size(1024).unwrap();
    full.bind(lo(9422)).unwrap();
    let reader = bound(&app, 9423);
    sender.group_create(g).unwrap();
    full.group_join(g, GroupFlags::NONE).unwrap();
    reader.group_join(g, GroupFlags::NONE).unwrap();
    sender.set_nonblocking(true).unwrap();
    sender.connect(g).unwrap();
    let fd = sender.pollable_fd().unwrap();
    let pollout = || {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) };
        p.revents & libc::POLLOUT != 0
    };
    wait_for(pollout, LIMIT, "POLLOUT before the group fills");
    let mut sent = 0u64;
    let eagain = loop {
        match sender.send(&seq_payload(sent, 200)) {
            Ok(_) => sent += 1,
            Err(e) => break e.raw_os_error(),
        }
        assert!(sent < 10_000, "the group never filled");
    };
    assert_eq!(eagain, Some(libc::EAGAIN), "a full group: EAGAIN");
    // What the library took before it saw the full bit waits at the head of the sender's
    // ring: the reader has exactly what the group numbered, the full member the same.
    // It stops for good once everything is numbered, or once the head record was found
    // blocked (the sender's ring then waits on the full member).
    wait_for(
        || d.stat("group_sends") == sent || d.stat("group_blocked") >= 1,
        LIMIT,
        "the group to stop",
    );
    let numbered = d.stat("group_sends");
    wait_for(
        || !pollout(),
        LIMIT,
        "POLLOUT to clear while a member is full",
    );
    let early = take(&reader, numbered as usize);
    assert!(
        drain(&reader).is_empty(),
        "nobody got a message past the stop"
    );
    // A blocking send waits for the full member.
    sender.set_nonblocking(false).unwrap();
    let tid = AtomicU32::new(0);
    let total = sent + 1;
    std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            tid.store(gettid(), Ordering::Release);
            sender.send(&seq_payload(sent, 200)).unwrap();
        });
        {
            // The library holds the send: it sleeps on the group's full bit.
            wait_for(
                || {
                    let t = tid.load(Ordering::Acquire);
                    t != 0 && wait_channel(std::process::id(), t).contains("futex")
                },
                LIMIT,
                "the blocking send to sleep",
            );
        }
        assert_eq!(d.exact_stat("group_sends"), numbered, "still held back");
        assert!(drain(&reader).is_empty());
        // The full member reads: everything flows, to both, in one order.
        let at_full = take(&full, total as usize);
        t.join().unwrap();
        let mut at_reader = early;
        at_reader.extend(take(&reader, (total - numbered) as usize));
        assert_eq!(at_full, at_reader);
        assert_eq!(
            at_full.iter().map(|m| m.1).collect::<Vec<_>>(),
            (0..total).collect::<Vec<_>>()
        );
    });
    wait_for(pollout, LIMIT, "POLLOUT once the member drained");
    assert!(d.exact_stat("cong_marked") >= 1);
}

#[test]
fn drop_when_full_members_are_skipped_and_counted() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5030);
    let sender = bound(&app, 9431);
    let dropper = app.socket().unwrap();
    dropper.set_recv_buffer_size(1024).unwrap();
    dropper.bind(lo(9432)).unwrap();
    let reader = bound(&app, 9433);
    sender.group_create(g).unwrap();
    dropper.group_join(g, GroupFlags::DROP_WHEN_FULL).unwrap();
    reader.group_join(g, GroupFlags::NONE).unwrap();
    const N: u64 = 100;
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for i in 0..N {
                sender.send_to(&seq_payload(i, 200), g).unwrap();
            }
        });
        let got = take(&reader, N as usize);
        assert_eq!(
            got.iter().map(|m| m.1).collect::<Vec<_>>(),
            (0..N).collect::<Vec<_>>()
        );
    });
    let kept = drain(&dropper);
    let k = kept.len() as u64;
    if app.poll_thread() == 0 {
        assert!(k > 0 && k < N, "the dropper took {k} of {N}");
    } else {
        // Its socket is on another poll thread than shard 0, which orders every group and
        // hears of its congestion by note: a burst can overrun SO_RCVBUF by what is in flight.
        assert!(k > 0, "the dropper took nothing");
    }
    assert_eq!(
        kept.iter().map(|m| m.1).collect::<Vec<_>>(),
        (0..k).collect::<Vec<_>>(),
        "it got a prefix, then was skipped"
    );
    assert_eq!(d.exact_stat("group_drops_full"), N - k);
    assert_eq!(d.exact_stat("group_deliveries"), N + k);
}

#[test]
fn filters_choose_by_sender_and_never_hold_the_group_back() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5040);
    let (s1, s2) = (bound(&app, 9441), bound(&app, 9442));
    let (only, except, all) = (bound(&app, 9443), bound(&app, 9444), bound(&app, 9445));
    s1.group_create(g).unwrap();
    let from_s1 = vec![FilterRule {
        addr: Ipv4Addr::LOCALHOST,
        prefix_len: 32,
        first_port: 9441,
        last_port: 9441,
    }];
    for m in [&only, &except, &all] {
        m.group_join(g, GroupFlags::NONE).unwrap();
    }
    only.group_set_filter(g, &GroupFilter::Only(from_s1.clone()))
        .unwrap();
    except
        .group_set_filter(g, &GroupFilter::Except(from_s1))
        .unwrap();
    // `only` stops reading: its filter rejects s2, so s2's messages never wait for it.
    only.set_recv_buffer_size(1024).unwrap();
    const N: u64 = 50;
    for i in 0..N {
        s1.send_to(&seq_payload(i, 16), g).unwrap();
    }
    assert_eq!(
        take(&only, N as usize),
        (0..N).map(|i| (9441, i)).collect::<Vec<_>>()
    );
    for i in 0..3 * N {
        s2.send_to(&seq_payload(i, 16), g).unwrap();
    }
    let got_all = take(&all, 4 * N as usize);
    assert_eq!(
        take(&except, 3 * N as usize),
        (0..3 * N).map(|i| (9442, i)).collect::<Vec<_>>()
    );
    assert_eq!(got_all.len() as u64, 4 * N);
    assert!(drain(&only).is_empty());
    assert_eq!(d.exact_stat("group_filtered"), 4 * N);
    // Back to every message.
    only.group_set_filter(g, &GroupFilter::All).unwrap();
    s2.send_to(&seq_payload(7, 16), g).unwrap();
    assert_eq!(take(&only, 1), vec![(9442, 7)]);
}

#[test]
fn a_group_lives_while_its_creator_or_a_member_does() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5050);
    let creator = bound(&app, 9451);
    let member = bound(&app, 9452);
    let sender = bound(&app, 9453);
    creator.group_create(g).unwrap();
    member.group_join(g, GroupFlags::NONE).unwrap();
    drop(creator);
    sender.send_to(&seq_payload(1, 8), g).unwrap();
    assert_eq!(
        take(&member, 1),
        vec![(9453, 1)],
        "the member keeps it alive"
    );
    // Closing the last member ends it: later sends find no group (dropped and counted, as to
    // an unbound port) and the address can be created again.
    drop(member);
    // With several poll threads the close reaches shard 0, which owns the groups, as a note:
    // a send racing it may still find the group (and its copy for the closed member is
    // dropped). The close is waited for, so that this send is the one after it.
    wait_for(
        || d.exact_stat("group_members_closed") == 1,
        LIMIT,
        "the member's close seen by the groups' owner",
    );
    sender.send_to(&seq_payload(2, 8), g).unwrap();
    wait_for(
        || d.stat("group_no_group") == 1,
        LIMIT,
        "the send to a dead group counted",
    );
    let again = bound(&app, 9454);
    again.group_create(g).unwrap();
    assert_eq!(
        errno_of(sender.group_join(group(5051), GroupFlags::NONE)),
        libc::ENOENT
    );
}

/// A group's members read what anyone sends it: only the creator's uid and root may join,
/// unless the creator made it open. And one app cannot take every group or every congestion
/// entry of the host.
#[test]
fn joins_follow_the_creators_uid_and_groups_are_bounded_per_app_and_address() {
    let d = Daemon::start(&[]);
    // Let other users reach the control socket (the test's temp dir is world-readable).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&d.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let app = d.attach();
    let creator = bound(&app, 9491);
    let (closed, open) = (group(5090), group(5091));
    creator.group_create(closed).unwrap();
    creator.group_create_open(open).unwrap();
    let mut nobody = d.app(&["join-as", "65534", "127.0.0.1:9492", &closed.to_string()]);
    assert_eq!(nobody.expect("refused errno"), libc::EACCES.to_string());
    let mut other = d.app(&["join-as", "65534", "127.0.0.1:9493", &open.to_string()]);
    other.expect("joined");
    creator.send_to(&seq_payload(7, 8), open).unwrap();
    assert_eq!(other.expect("got"), "7");
    // 64 groups per app: the creator has 2, so 62 more fit, on 62 more addresses.
    let more = |i: u16| SocketAddrV4::new(Ipv4Addr::new(239, 2, (i >> 8) as u8, i as u8), 1);
    for i in 0..62 {
        creator.group_create(more(i)).unwrap();
    }
    assert_eq!(errno_of(creator.group_create(more(62))), libc::ENOBUFS);
    // 64 group addresses per host: another app can add groups on those, not a 65th address.
    // The creator's groups use 63 addresses (239.1.2.3 and 62 more): one more address fits.
    let app2 = d.attach();
    let s2 = bound(&app2, 9494);
    s2.group_create(more(63)).unwrap();
    assert_eq!(errno_of(s2.group_create(more(64))), libc::ENOBUFS);
    s2.group_create(SocketAddrV4::new(*more(0).ip(), 2))
        .unwrap();
    // Closing the creator gives them back.
    drop(creator);
    s2.group_create(more(64)).unwrap();
}

/// Members SIGKILLed mid-stream: the two that hold the group back die while senders wait on
/// them, the two that read get every message in one order, and nothing is half-delivered.
#[test]
fn killed_members_never_leave_a_message_half_delivered() {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5060);
    let (s1, s2) = (bound(&app, 9461), bound(&app, 9462));
    s1.group_create(g).unwrap();
    const EACH: u64 = 400;
    let total = (2 * EACH).to_string();
    let gs = g.to_string();
    let member = |port: u16, read: &str| {
        let addr = lo(port).to_string();
        let rcvbuf = if read == "1" { "200000" } else { "1024" };
        let mut m = d.app(&["group-member", &addr, &gs, "0", rcvbuf, read, &total]);
        m.expect("joined");
        m
    };
    let mut readers = [member(9463, "1"), member(9464, "1")];
    let mut victims = [member(9465, "0"), member(9466, "0")];
    std::thread::scope(|sc| {
        for s in [&s1, &s2] {
            sc.spawn(move || {
                for i in 0..EACH {
                    s.send_to(&seq_payload(i, 100), g).unwrap();
                }
            });
        }
        // The victims never read: once both are congested the group is stuck on them.
        wait_for(|| d.stat("cong_marked") >= 2, LIMIT, "both victims to fill");
        let stuck = d.stat("group_sends");
        assert!(stuck < 2 * EACH, "the group stopped at {stuck}");
        for v in victims.iter_mut() {
            v.kill();
        }
    });
    let done: Vec<String> = readers.iter_mut().map(|r| r.expect("done")).collect();
    assert_eq!(
        done[0], done[1],
        "both readers saw the same messages in one order"
    );
    assert!(
        done[0].starts_with(&format!("{} ", 2 * EACH)),
        "{}",
        done[0]
    );
    // The victims' memberships ended with them, the readers' when they exited.
    wait_for(
        || d.stat("group_members_closed") == 4,
        LIMIT,
        "every member process's membership to end with it",
    );
    assert_eq!(d.exact_stat("group_sends"), 2 * EACH);
}

/// With several poll threads shard 0 owns and orders every group: a socket of another poll
/// thread creates, joins and sends (its requests and messages cross to shard 0, its copies
/// come back through the pair ring), and a full member there holds the group back everywhere.
#[test]
fn groups_of_several_poll_threads_are_ordered_by_shard_0() {
    let d = Daemon::start(&["--poll-core", "-2", "--poll-core", "-2"]);
    let mut apps = [d.attach(), d.attach()];
    apps.sort_by_key(|a| a.poll_thread());
    let [app0, app1] = apps;
    assert_eq!((app0.poll_thread(), app1.poll_thread()), (0, 1));
    let g = group(5070);
    // Created from poll thread 1; members on both threads; senders on both.
    let creator = bound(&app1, 9471);
    creator.group_create(g).unwrap();
    assert_eq!(errno_of(creator.group_create(g)), libc::EADDRINUSE);
    let (near, far) = (bound(&app0, 9472), bound(&app1, 9473));
    near.group_join(g, GroupFlags::NONE).unwrap();
    far.group_join(g, GroupFlags::LOOPBACK).unwrap();
    assert_eq!(
        errno_of(far.group_join(g, GroupFlags::NONE)),
        libc::EADDRINUSE
    );
    let sender0 = bound(&app0, 9474);
    const EACH: u64 = 300;
    let (got_near, got_far) = std::thread::scope(|sc| {
        for s in [&sender0, &creator, &far] {
            sc.spawn(move || {
                for i in 0..EACH {
                    s.send_to(&seq_payload(i, 64 + (i as usize % 500)), g)
                        .unwrap();
                }
            });
        }
        let a = sc.spawn(|| take(&near, 3 * EACH as usize));
        let b = sc.spawn(|| take(&far, 3 * EACH as usize));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(got_near, got_far, "one order on both poll threads");
    for port in [9471, 9473, 9474] {
        let seqs: Vec<u64> = got_near
            .iter()
            .filter(|m| m.0 == port)
            .map(|m| m.1)
            .collect();
        assert_eq!(
            seqs,
            (0..EACH).collect::<Vec<_>>(),
            "sender {port} in order"
        );
    }
    // A full member of poll thread 1 holds back a sender of poll thread 0. (The near member
    // takes all it can: shard 0 hears of the far member's fullness only after what crossed
    // meanwhile, which may be hundreds of messages on a loaded machine.)
    near.set_recv_buffer_size(1 << 30).unwrap();
    far.set_recv_buffer_size(1024).unwrap();
    sender0.set_nonblocking(true).unwrap();
    let mut sent = 0u64;
    let err = loop {
        match sender0.send_to(&seq_payload(sent, 200), g) {
            Ok(_) => sent += 1,
            Err(e) => break e.raw_os_error(),
        }
        assert!(sent < 10_000, "the group never filled");
    };
    assert_eq!(err, Some(libc::EAGAIN));
    // Both read at once: neither member's backlog may wait for the other's reader.
    let (a, b) = std::thread::scope(|sc| {
        let a = sc.spawn(|| take(&far, sent as usize));
        let b = sc.spawn(|| take(&near, sent as usize));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a, b);
    // Leaving and closing on poll thread 1 reach shard 0.
    far.group_leave(g).unwrap();
    assert_eq!(errno_of(far.group_leave(g)), libc::EADDRNOTAVAIL);
    drop(creator);
    drop(near);
    wait_for(
        || d.stat("group_members_closed") == 1,
        LIMIT,
        "the near member's close",
    );
    sender0.set_nonblocking(false).unwrap();
    sender0.send_to(&seq_payload(0, 8), g).unwrap();
    wait_for(
        || d.stat("group_no_group") == 1,
        LIMIT,
        "the group to end with its creator and last member",
    );
    assert!(drain(&far).is_empty());
}

/// A deterministic pseudo-random stream (xorshift64*), so a failing seed replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Messages received, as (sender port, sequence number).
type Received = Vec<(u16, u64)>;

/// Whether `part` appears in `whole` in order (not necessarily contiguous).
fn is_subsequence<T: PartialEq>(part: &[T], whole: &[T]) -> bool {
    let mut it = whole.iter();
    part.iter().all(|p| it.any(|w| w == p))
}

/// Random members join (each membership a fresh socket, with a random SO_RCVBUF and maybe
/// DROP_WHEN_FULL), read at random and close, while three senders send blocking messages of
/// random sizes. Two stable members read everything: their sequences are the group's one
/// order and hold every message sent. Against it, each churning member without DROP_WHEN_FULL
/// got one contiguous run (all or none: nothing skipped while it was a member), and each with
/// it got an ordered subsequence.
#[test]
fn random_membership_churn_keeps_one_order_and_all_or_none() {
    for seed in [1u64, 0x5eed, 0xdead_beef] {
        churn_run(seed);
    }
}

fn churn_run(seed: u64) {
    let d = Daemon::start(&[]);
    let app = d.attach();
    let g = group(5080);
    let senders = [bound(&app, 9481), bound(&app, 9482), bound(&app, 9483)];
    senders[0].group_create(g).unwrap();
    let stable = [bound(&app, 9484), bound(&app, 9485)];
    for s in &stable {
        s.set_recv_buffer_size(1 << 20).unwrap();
        s.group_join(g, GroupFlags::NONE).unwrap();
    }
    // The senders go on until enough memberships came and went during the traffic, then
    // each sends an end marker; the stable members read up to the third marker.
    const END: u64 = u64::MAX;
    const CHURNS: usize = 12;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut rng = Rng(seed | 1);
    // (flags, received) of every churning membership, in the order they ended.
    let mut ended: Vec<(bool, Vec<(u16, u64)>)> = Vec::new();
    let read_to_end = |s: &Socket| {
        let mut got: Received = Vec::new();
        while got.iter().filter(|m| m.1 == END).count() < 3 {
            got.extend(take(s, 1));
        }
        got
    };
    let (global, other, sent) = std::thread::scope(|sc| {
        let mut counts = Vec::new();
        for (k, s) in senders.iter().enumerate() {
            let mut r = Rng((seed + k as u64 + 1) * 0x9e37_79b9);
            let stop = &stop;
            counts.push(sc.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let len = 8 + r.below(3000) as usize;
                    s.send_to(&seq_payload(i, len), g).unwrap();
                    i += 1;
                    if i.is_multiple_of(4) {
                        // Spread the traffic over the churn (pacing only; nothing is timed).
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
                s.send_to(&seq_payload(END, 8), g).unwrap();
                i
            }));
        }
        let a = sc.spawn(|| read_to_end(&stable[0]));
        let b = sc.spawn(|| read_to_end(&stable[1]));
        // (socket, DROP_WHEN_FULL, received so far) of every live churning membership.
        let mut live: Vec<(Socket, bool, Received)> = Vec::new();
        let mut port = 20_000u16;
        let mut during = 0;
        while during < CHURNS {
            match rng.below(4) {
                0 if live.len() < 3 => {
                    let s = app.socket().unwrap();
                    s.set_recv_buffer_size(1024 + rng.below(64 << 10) as usize)
                        .unwrap();
                    port += 1;
                    s.bind(lo(port)).unwrap();
                    let drop_when_full = rng.below(2) == 0;
                    let flags = if drop_when_full {
                        GroupFlags::DROP_WHEN_FULL
                    } else {
                        GroupFlags::NONE
                    };
                    s.group_join(g, flags).unwrap();
                    live.push((s, drop_when_full, Vec::new()));
                }
                1 | 2 if !live.is_empty() => {
                    let k = rng.below(live.len() as u64) as usize;
                    let got = drain(&live[k].0);
                    live[k].2.extend(got);
                }
                3 if !live.is_empty() => {
                    let k = rng.below(live.len() as u64) as usize;
                    let (s, drop_when_full, got) = live.swap_remove(k);
                    // Leave first or just close: both end the membership.
                    if rng.below(2) == 0 {
                        s.group_leave(g).unwrap();
                    }
                    drop(s);
                    during += usize::from(!got.is_empty());
                    ended.push((drop_when_full, got));
                }
                _ => std::thread::yield_now(),
            }
        }
        // The last members leave before the senders stop: none holds their last sends back.
        for (s, drop_when_full, mut got) in live.drain(..) {
            got.extend(drain(&s));
            ended.push((drop_when_full, got));
        }
        stop.store(true, Ordering::Relaxed);
        let sent: Vec<u64> = counts.into_iter().map(|c| c.join().unwrap()).collect();
        (a.join().unwrap(), b.join().unwrap(), sent)
    });
    assert_eq!(global, other, "seed {seed}: the stable members disagree");
    for (k, s) in senders.iter().enumerate() {
        let port = s.local_addr().unwrap().port();
        let seqs: Vec<u64> = global.iter().filter(|m| m.0 == port).map(|m| m.1).collect();
        let mut want: Vec<u64> = (0..sent[k]).collect();
        want.push(END);
        assert_eq!(
            seqs, want,
            "seed {seed}: every message of sender {port}, once, in order"
        );
    }
    for (i, (drop_when_full, got)) in ended.iter().enumerate() {
        if got.is_empty() {
            continue;
        }
        if *drop_when_full {
            assert!(
                is_subsequence(got, &global),
                "seed {seed}: member {i} (DROP_WHEN_FULL) out of order"
            );
        } else {
            let at = global
                .iter()
                .position(|m| *m == got[0])
                .expect("its first message is in the order");
            assert_eq!(
                &global[at..at + got.len()],
                &got[..],
                "seed {seed}: member {i} missed a message while it was a member"
            );
        }
    }
}

/// rdsd killed in the middle of a fan-out (the fault-injection build SIGKILLs itself right
/// after publishing the first member's copy of the 40th message): no member reads that
/// message although one copy sits published in a ring; every member, in two apps, reads the
/// 39 before it, whatever it noticed first, then learns that rdsd is gone. Without the commit
/// point the first member reads 40 and the others 39.
#[test]
fn a_crash_in_the_middle_of_a_fanout_delivers_the_message_to_nobody() {
    // One poll thread, whatever RDSD_TESTS_POLL_THREADS says: the hook fires in a fan-out to
    // two or more members of the thread that orders the group.
    let mut d = Daemon::start_with_faults(&[("die-in-fanout", "40")], &["--poll-core", "-2"]);
    let (a1, a2) = (d.attach(), d.attach());
    let g = group(5100);
    let sender = bound(&a1, 9601);
    sender.group_create(g).unwrap();
    let members = [bound(&a1, 9602), bound(&a2, 9603), bound(&a2, 9604)];
    for m in &members {
        m.set_recv_buffer_size(1 << 20).unwrap();
        m.group_join(g, GroupFlags::NONE).unwrap();
    }
    let mut sent = 0u64;
    for i in 0..60u64 {
        if sender.send_to(&seq_payload(i, 64), g).is_err() {
            break;
        }
        sent += 1;
    }
    assert!(sent >= 40, "the sender stopped at {sent}");
    let child = d.child.as_mut().expect("running");
    wait_for(
        || child.try_wait().ok().flatten().is_some(),
        LIMIT,
        "rdsd to die in the 40th fan-out",
    );
    // The second app learns of the death before it reads (a request fails): it still reads
    // what was committed.
    assert!(a2.socket().is_err(), "rdsd is dead");
    for (k, m) in members.iter().enumerate() {
        assert_eq!(
            read_until_gone(m, lo(9601)),
            (0..39).collect::<Vec<u64>>(),
            "member {k}"
        );
    }
}

/// What `m` still reads from `sender` after rdsd died, until the library says rdsd is gone.
fn read_until_gone(m: &Socket, sender: SocketAddrV4) -> Vec<u64> {
    let mut buf = vec![0u8; 4096];
    let mut got = Vec::new();
    loop {
        match m.recv_from(&mut buf) {
            Ok((n, from)) => {
                assert_eq!(from, sender);
                got.push(payload_seq(&buf[..n]));
            }
            Err(e) => {
                assert!(shm_api::is_daemon_gone(&e), "{e}");
                return got;
            }
        }
    }
}

/// The same crash with the members on two poll threads: shard 0 orders the group and has one
/// member; two members are served by poll thread 1, whose copies cross in the pair ring.
/// Shard 0 commits a fan-out only once poll thread 1 reports its copies published, so rdsd
/// dying right after thread 1 published the first copy of message 19 (the fault build counts,
/// on thread 1, the group copies it publishes: the 39th) leaves message 19 read by nobody,
/// although that member has it in its ring. Without the wait the far members read 19 (and
/// later ones) that the near member never gets. Up to `GATES` fan-outs may be uncommitted at
/// once (commits go in order), so the messages just before 19 may be lost too, for every
/// member alike: all three read the same run 0..k, with k at most 19 and at least 19 - GATES.
#[test]
fn a_crash_while_copies_cross_poll_threads_delivers_the_message_to_nobody() {
    let mut d = Daemon::start_with_faults(
        &[("die-in-fanout", "39")],
        &["--poll-core", "-2", "--poll-core", "-2"],
    );
    let mut apps = [d.attach(), d.attach()];
    apps.sort_by_key(|a| a.poll_thread());
    let [near, far] = apps;
    assert_eq!((near.poll_thread(), far.poll_thread()), (0, 1));
    let g = group(5110);
    let sender = bound(&near, 9611);
    sender.group_create(g).unwrap();
    let members = [bound(&near, 9612), bound(&far, 9613), bound(&far, 9614)];
    for m in &members {
        m.set_recv_buffer_size(1 << 20).unwrap();
        m.group_join(g, GroupFlags::NONE).unwrap();
    }
    for i in 0..60u64 {
        if sender.send_to(&seq_payload(i, 64), g).is_err() {
            break;
        }
    }
    let child = d.child.as_mut().expect("running");
    wait_for(
        || child.try_wait().ok().flatten().is_some(),
        LIMIT,
        "rdsd to die at the 39th copy on poll thread 1",
    );
    let read: Vec<Vec<u64>> = members
        .iter()
        .map(|m| read_until_gone(m, lo(9611)))
        .collect();
    let k = read[0].len() as u64;
    assert_eq!(
        read[0],
        (0..k).collect::<Vec<u64>>(),
        "a run from 0, in order"
    );
    assert!(
        (19 - shm_api::gate::GATES as u64..=19).contains(&k),
        "{k} read: message 19 by nobody, at most GATES uncommitted lost"
    );
    assert!(read.iter().all(|r| *r == read[0]), "all or none: {read:?}");
}

/// A fan-out held open between its first publish and its commit (the fault build's
/// `--fault stall-in-fanout`, released when the test removes a file): no member can read
/// the message, although one copy may already be published; a non-blocking receive says
/// EAGAIN, a blocking one with SO_RCVTIMEO gives up, and blocking receivers wait until the
/// commit wakes them, then all three have it.
#[test]
fn an_uncommitted_copy_is_read_by_nobody_until_the_commit() {
    /// The stall's file, removed however the test ends (rdsd would stall until killed).
    struct Hold(std::path::PathBuf);
    impl Drop for Hold {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let hold = Hold(std::env::temp_dir().join(format!("rdsd-fanout-hold-{}", std::process::id())));
    std::fs::write(&hold.0, b"").unwrap();
    let d = Daemon::start_with_faults(
        &[("stall-in-fanout", hold.0.to_str().unwrap())],
        &["--poll-core", "-2"],
    );
    let app = d.attach();
    let g = group(5101);
    let sender = bound(&app, 9611);
    sender.group_create(g).unwrap();
    let members: Vec<Socket> = (9612..9615).map(|p| bound(&app, p)).collect();
    for m in &members {
        m.group_join(g, GroupFlags::NONE).unwrap();
    }
    sender.send_to(&seq_payload(7, 64), g).unwrap();
    wait_for(|| d.stat("group_sends") == 1, LIMIT, "the fan-out to start");
    let mut buf = [0u8; 128];
    let nb = RecvFlags {
        dontwait: true,
        ..RecvFlags::default()
    };
    for _ in 0..200 {
        for m in &members {
            assert_eq!(errno_of(m.recv_msg(&mut buf, nb)), libc::EAGAIN);
        }
        std::thread::yield_now();
    }
    members[0]
        .set_recv_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    assert_eq!(errno_of(members[0].recv(&mut buf)), libc::ETIMEDOUT);
    members[0].set_recv_timeout(None).unwrap();
    std::thread::scope(|s| {
        let readers: Vec<_> = members
            .iter()
            .map(|m| {
                s.spawn(move || {
                    let mut buf = [0u8; 128];
                    let (n, from) = m.recv_from(&mut buf).unwrap();
                    (payload_seq(&buf[..n]), from)
                })
            })
            .collect();
        // Not a bound on anything: gives the readers time to go to sleep, so the commit's
        // wake-up is what ends their wait.
        std::thread::sleep(Duration::from_millis(100));
        std::fs::remove_file(&hold.0).unwrap();
        for r in readers {
            assert_eq!(r.join().unwrap(), (7, lo(9611)));
        }
    });
    assert_eq!(d.stat("group_deliveries"), 3);
}
