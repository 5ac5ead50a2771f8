//! Local congestion across processes: SO_RCVBUF accounting, the congestion bit seen by another
//! app, ENOBUFS, blocked senders woken, RDS_CONG_MONITOR notifications.

use rdsd_tests::*;
use std::time::{Duration, Instant};

#[test]
fn slow_receiver_congests_remote_app_which_is_notified_and_recovers() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(4096).unwrap();
    rcv.bind(lo(9000)).unwrap();
    let mut snd = d.app(&["cong-sender", "127.0.0.1:9001", "127.0.0.1:9000"]);
    let n: u64 = snd.expect("enobufs").parse().unwrap();
    // Marked once queued bytes exceed 4096: at least 9 messages of 512 B got in first.
    assert!(n >= 9, "ENOBUFS after only {n} messages");
    assert_eq!(d.stat("cong_marked"), 1);
    // Drain: the port clears below rcvbuf/2 and the sender's monitor gets its port bit.
    let mut buf = [0u8; 1024];
    rcv.set_recv_timeout(Some(Duration::from_secs(10))).unwrap();
    for i in 0..n {
        let (len, from) = rcv.recv_from(&mut buf).unwrap();
        assert_eq!((payload_seq(&buf[..len]), from), (i, lo(9001)));
    }
    let mask: u64 = snd.expect("cong_update").parse().unwrap();
    assert_ne!(
        mask & (1 << (9000 % 64)),
        0,
        "mask {mask:#x} names port 9000"
    );
    assert_eq!(snd.expect("sent-after-clear"), (n + 1).to_string());
    let (len, _) = rcv.recv_from(&mut buf).unwrap();
    assert_eq!(
        payload_seq(&buf[..len]),
        n,
        "nothing lost or reordered across congestion"
    );
    assert!(d.stat("cong_cleared") >= 1);
    assert!(d.stat("cong_notifications") >= 1);
}

#[test]
fn blocking_sender_waits_for_congestion_to_clear() {
    let d = Daemon::start(&[]);
    // Receiver process with a tiny rcvbuf reading slowly.
    let r = d.attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(2048).unwrap();
    rcv.bind(lo(9100)).unwrap();
    let snd = d.app(&["send", "127.0.0.1:9101", "127.0.0.1:9100", "300", "512"]);
    let mut buf = [0u8; 1024];
    rcv.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 0..300u64 {
        if i % 50 == 0 {
            // A slow reader (load, not synchronisation).
            std::thread::sleep(Duration::from_millis(20));
        }
        let (len, _) = rcv.recv_from(&mut buf).unwrap();
        assert_eq!(payload_seq(&buf[..len]), i);
    }
    assert_eq!(snd.wait(), 0, "blocked sender finished");
    assert!(
        d.stat("cong_marked") >= 1,
        "the sender really was held back by congestion"
    );
    // The last clear follows the receiver's last read in the poll core's next pass.
    wait_until(
        Duration::from_secs(10),
        "every mark to be cleared: (cong_marked, cong_cleared)",
        || (d.stat("cong_marked"), d.stat("cong_cleared")),
        |(marked, cleared)| marked == cleared,
    );
}

#[test]
fn send_timeout_on_congested_port() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    let rcv = r.socket().unwrap();
    rcv.set_recv_buffer_size(1024).unwrap();
    rcv.bind(lo(9200)).unwrap();
    let s = r.socket().unwrap();
    s.bind(lo(9201)).unwrap();
    s.send_to(&[0u8; 1000], lo(9200)).unwrap();
    s.send_to(&[0u8; 1000], lo(9200)).unwrap();
    wait_for(
        || d.stat("cong_marked") == 1,
        Duration::from_secs(5),
        "congestion",
    );
    assert_eq!(
        s.send_msg(b"x", Some(lo(9200)), true)
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENOBUFS),
        "non-blocking send to a congested port"
    );
    s.set_send_timeout(Some(Duration::from_millis(150)))
        .unwrap();
    let t = Instant::now();
    assert_eq!(
        s.send_to(b"x", lo(9200)).unwrap_err().raw_os_error(),
        Some(libc::ETIMEDOUT)
    );
    assert!(t.elapsed() >= Duration::from_millis(150));
    // Other ports are unaffected.
    let other = r.socket().unwrap();
    other.bind(lo(9202)).unwrap();
    s.send_msg(b"y", Some(lo(9202)), true)
        .expect("uncongested port");
    // Closing the congested socket clears its bit.
    drop(rcv);
    wait_for(
        || d.stat("cong_cleared") == 1,
        Duration::from_secs(5),
        "clear on close",
    );
}
