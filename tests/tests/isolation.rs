//! Shared memory is untrusted input: an app that scribbles on its own rings is evicted (and
//! counted) while rdsd and other apps carry on; a library/daemon version mismatch is refused.

use rdsd_tests::*;
use shm_api::ctrl::{Reply, Request};
use std::os::fd::AsRawFd;
use std::time::Duration;

#[test]
fn garbage_rings_evict_only_the_offender() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    let a = r.socket().unwrap();
    let b = r.socket().unwrap();
    a.bind(lo(9501)).unwrap();
    b.bind(lo(9502)).unwrap();
    b.set_recv_timeout(Some(Duration::from_secs(5))).unwrap();
    // A victim app in another process with messages queued for it.
    let mut victim = d.app(&["recv", "127.0.0.1:9503", "50"]);
    victim.expect("bound");
    let modes = ["huge-index", "misaligned", "huge-len", "bad-kind", "random"];
    for (k, mode) in modes.iter().enumerate() {
        let addr = format!("127.0.0.1:{}", 9510 + k);
        let mut bad = d.app(&["scribble", mode, &addr]);
        bad.expect("scribbled");
        bad.expect("evicted");
        assert_eq!(bad.wait(), 0);
        assert_eq!(d.stat("apps_evicted"), k as u64 + 1, "mode {mode}");
        // The port of the evicted app is free again.
        let s = r.socket().unwrap();
        s.bind(addr.parse().unwrap())
            .expect("evicted app's port released");
        // Everyone else is fine.
        let mut buf = [0u8; 64];
        for i in 0..10u64 {
            a.send_to(&seq_payload(i, 40), lo(9502)).unwrap();
            let (n, from) = b.recv_from(&mut buf).unwrap();
            assert_eq!(
                (payload_seq(&buf[..n]), from),
                (i, lo(9501)),
                "after {mode}"
            );
            a.send_to(&seq_payload(k as u64 * 10 + i, 40), lo(9503))
                .unwrap();
        }
    }
    assert_eq!(
        victim.expect("received"),
        "50",
        "the victim got every message intact and in order"
    );
}

#[test]
fn version_mismatch_is_refused_with_the_daemon_version() {
    let d = Daemon::start(&[]);
    let sock = shm_api::sys::connect_seqpacket(&d.socket).unwrap();
    shm_api::sys::send_with_fds(
        sock.as_raw_fd(),
        &Request::Hello {
            version: 999,
            shard: None,
        }
        .encode(5),
        &[],
    )
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, fds) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
    let reply = Reply::decode(&buf[..n]).unwrap();
    assert_eq!(reply.errno, libc::EPROTONOSUPPORT);
    assert_eq!(reply.value, shm_api::layout::LAYOUT_VERSION as u64);
    assert_eq!(reply.id, 5, "the reply echoes the request id");
    assert!(fds.is_empty(), "no region handed to a mismatched library");
    assert_eq!(d.stat("attach_refused"), 1);
}

#[test]
fn a_v1_library_is_told_clearly_that_it_is_too_old() {
    let d = Daemon::start(&[]);
    let sock = shm_api::sys::connect_seqpacket(&d.socket).unwrap();
    // The v1 Hello: 24 bytes, no request id.
    let hello = Request::Hello {
        version: 1,
        shard: None,
    }
    .encode_v1();
    shm_api::sys::send_with_fds(sock.as_raw_fd(), &hello, &[]).unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, fds) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
    assert_eq!(
        n,
        shm_api::ctrl::LEGACY_REPLY_HEADER_LEN,
        "a v1 reply, as v1 reads it"
    );
    let errno = i32::from_le_bytes(buf[0..4].try_into().unwrap());
    let value = u64::from_le_bytes(buf[8..16].try_into().unwrap());
    assert_eq!(errno, libc::EPROTONOSUPPORT);
    assert_eq!(value, shm_api::layout::LAYOUT_VERSION as u64);
    assert!(fds.is_empty());
    // A v1 rdsctl still reads the counters.
    shm_api::sys::send_with_fds(sock.as_raw_fd(), &Request::Stats.encode_v1(), &[]).unwrap();
    let (n, _) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
    let text = String::from_utf8_lossy(&buf[shm_api::ctrl::LEGACY_REPLY_HEADER_LEN..n]);
    assert!(text.contains("attach_refused 1\n"), "{text}");
}

#[test]
fn malformed_control_requests_are_rejected_and_counted() {
    let d = Daemon::start(&[]);
    let sock = shm_api::sys::connect_seqpacket(&d.socket).unwrap();
    for junk in [&b"x"[..], &[0xff; 24][..], &[0u8; 100][..]] {
        shm_api::sys::send_with_fds(sock.as_raw_fd(), junk, &[]).unwrap();
        let mut buf = vec![0u8; 4096];
        let (n, _) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
        assert_eq!(Reply::decode(&buf[..n]).unwrap().errno, libc::EINVAL);
    }
    // Operations before attach are refused too.
    let req = Request::Bind {
        slot: 0,
        addr: std::net::Ipv4Addr::LOCALHOST,
        port: 5,
    };
    shm_api::sys::send_with_fds(sock.as_raw_fd(), &req.encode(6), &[]).unwrap();
    let mut buf = vec![0u8; 4096];
    let (n, _) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0).unwrap();
    let reply = Reply::decode(&buf[..n]).unwrap();
    assert_eq!((reply.errno, reply.id), (libc::ENOTCONN, 6));
    assert_eq!(d.stat("ctrl_bad_requests"), 3);
    assert!(d.attach().is_alive());
}
