//! rdsd on a DPDK port (userspace TCP on smoltcp over `net_af_packet`) against the Linux
//! kernel's own RDS/TCP in the VM lab's guest. The lab's tap is bridged with a veth pair in
//! the namespace; the DPDK port sits on the veth's free end with an address the kernel does
//! not have (.101: above the guest's .2, below its .200, so both connection directions run).
//! The tap carries no virtio-net header, so the guest finishes its own checksums and
//! segments, as a packet socket needs.
//!
//! A separate test binary with a lab of its own (a second guest boot), so that it never runs
//! next to the shared lab of `interop.rs`.

use rdsd_tests::vmlab::{Job, VmLab};
use rdsd_tests::*;
use shm_api::Socket;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

fn at(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

fn field(line: &str, key: &str) -> u64 {
    Job::field(line, key)
}

/// Sends `count` messages of `len` bytes (rdsguest's payload convention) to `dest`.
fn send(s: &Socket, dest: SocketAddrV4, count: u64, len: usize) {
    for seq in 0..count {
        let mut p = vec![(seq % 251) as u8; len];
        p[..8].copy_from_slice(&seq.to_le_bytes());
        s.send_to(&p, dest).unwrap();
    }
}

/// Receives `count` messages of `len` bytes, in order per source, every byte checked.
fn recv(s: &Socket, count: u64, len: usize, limit: Duration) {
    let mut buf = vec![0u8; len + 16];
    let mut next: HashMap<SocketAddrV4, u64> = HashMap::new();
    let deadline = Instant::now() + limit;
    for i in 0..count {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out after {i} of {count}");
        s.set_recv_timeout(Some(left)).unwrap();
        let (n, from) = s.recv_from(&mut buf).expect("recv");
        assert_eq!(n, len, "length of message {i} from {from}");
        let seq = payload_seq(&buf[..n]);
        let want = next.entry(from).or_insert(0);
        assert_eq!(seq, *want, "message {i} from {from}: order");
        assert!(
            buf[8..n].iter().all(|&b| b == (seq % 251) as u8),
            "payload of {seq}"
        );
        *want += 1;
    }
}

#[test]
fn dpdk_rdsd_and_kernel_rds_both_ways_both_address_orders() {
    rdsd_tests::require!(rdsd_tests::root(), rdsd_tests::vmlab::INSTALL);
    let lab =
        VmLab::new_with(&[], false).map_err(|e| format!("the VM lab cannot start qemu: {}", e.0));
    rdsd_tests::require!(lab.as_ref().map(|_| ()), rdsd_tests::vmlab::INSTALL);
    let mut lab = lab.expect("checked");
    // The lab's own rdsd (kernel TCP) would hold the RDS port in the namespace.
    lab.kill_rdsd();
    let iface = lab.add_bridged_port();
    let o = lab.host.octets();
    let addr = Ipv4Addr::new(o[0], o[1], o[2], 101);
    let cfg = config_file(&format!(
        "[dpdk]\nvdev = \"net_af_packet0,iface={iface}\"\naddr = \"{addr}/24\"\n"
    ));
    let d = Daemon::start_in(
        Some(&lab.ns),
        &["-c", cfg.to_str().unwrap(), "--local-addr", "127.0.0.0/8"],
    );
    let r = d.attach();
    for (guest, port, count, len) in [
        (lab.guest_low, 7800, 500, 300), // the kernel (smaller) connects to the DPDK port
        (lab.guest_high, 7810, 500, 300), // the DPDK side (smaller) connects to the kernel
        (lab.guest_low, 7820, 20, 65536),
        (lab.guest_high, 7830, 4, 1 << 20),
    ] {
        let s = r.socket().unwrap();
        s.set_send_buffer_size(4 << 20).unwrap();
        s.set_send_timeout(Some(Duration::from_secs(120))).unwrap();
        s.bind(at(addr, port)).unwrap();
        let rx = lab.guest(&format!("recv {guest}:{port} {count} 180000"));
        rx.expect("bound", Duration::from_secs(30));
        let tx = lab.guest(&format!(
            "send {guest}:{} {addr}:{port} {count} {len}",
            port + 1
        ));
        send(&s, at(guest, port), count, len);
        recv(&s, count, len, Duration::from_secs(180));
        let done = rx.expect("done", Duration::from_secs(180));
        assert_eq!(
            (field(&done, "got"), field(&done, "bad")),
            (count, 0),
            "{guest}: {done}"
        );
        tx.expect("sent", Duration::from_secs(60));
        eprintln!("{guest} <-> DPDK rdsd {addr}: {count} x {len} B each way");
    }
    assert!(d.stat("dpdk_rx_packets") > 0 && d.stat("dpdk_tx_packets") > 0);
    assert!(
        d.stat("dpdk_accepts") >= 1,
        "the kernel connected to the DPDK port"
    );
    assert!(
        d.stat("dpdk_connects") >= 1,
        "the DPDK port connected to the kernel"
    );
}
