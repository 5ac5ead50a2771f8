//! Real frames: a veth pair inside a private network namespace, one net_af_packet port on
//! each end. Port 0 tx-bursts frames that port 1 rx-bursts, byte for byte.
//!
//! Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN for the namespace) and `ip` (iproute2); skipped
//! otherwise. The namespace is entered by the test thread with unshare(CLONE_NEWNET) before
//! rte_eal_init, so EAL's threads, its packet sockets and the `ip` children all live in it and
//! the host's network is untouched; it disappears with the process.

mod common;

use dpdk_sys::*;
use std::ffi::CString;
use std::process::Command;
use std::time::{Duration, Instant};

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("run ip");
    assert!(st.success(), "ip {args:?} failed");
}

#[test]
fn af_packet_veth_frames_cross() {
    rdsd_tests::require!(rdsd_tests::root(), rdsd_tests::AS_ROOT);
    rdsd_tests::require!(
        Command::new("ip").arg("-V").output().map(|_| ()),
        "apt-get install iproute2 (tests/run.sh does it)"
    );
    // SAFETY: unshare(CLONE_NEWNET) only moves this thread into a new network namespace.
    let unshared = unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0;
    rdsd_tests::require!(
        if unshared {
            Ok(())
        } else {
            Err(format!(
                "unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            ))
        },
        rdsd_tests::AS_ROOT
    );
    ip(&[
        "link", "add", "rdsdva", "type", "veth", "peer", "name", "rdsdvb",
    ]);
    ip(&["link", "set", "rdsdva", "up"]);
    ip(&["link", "set", "rdsdvb", "up"]);

    let prefix = common::unique_prefix("afp");
    let mut args = common::eal_args(
        &prefix,
        128,
        &["net_af_packet0,iface=rdsdva", "net_af_packet1,iface=rdsdvb"],
    );
    // SAFETY: argv is a NULL-terminated array of valid C strings that outlives EAL; EAL is
    // initialised once in this process.
    let ret = unsafe { rte_eal_init(args.argc(), args.argv()) };
    assert!(
        ret >= 0,
        "rte_eal_init: {}",
        // SAFETY: reading the thread-local rte_errno has no preconditions.
        strerror(unsafe { rte_errno() })
    );
    // SAFETY: EAL is initialised.
    assert_eq!(unsafe { rte_eth_dev_count_avail() }, 2);

    let pool_name = CString::new("afp_pool").unwrap();
    // SAFETY: valid name; sizes within DPDK's limits.
    let pool = unsafe {
        rte_pktmbuf_pool_create(
            pool_name.as_ptr(),
            2047,
            32,
            0,
            RTE_MBUF_DEFAULT_BUF_SIZE as u16,
            SOCKET_ID_ANY,
        )
    };
    assert!(
        !pool.is_null(),
        "pool: {}",
        // SAFETY: reading the thread-local rte_errno has no preconditions.
        strerror(unsafe { rte_errno() })
    );

    let mut ports = [0u16; 2];
    for (i, port) in ports.iter_mut().enumerate() {
        let name = CString::new(format!("net_af_packet{i}")).unwrap();
        let conf = rte_eth_conf::default();
        // SAFETY: valid name and out-pointer; the port is configured with one queue each,
        // default queue configuration (null), and a pool that outlives the queues.
        unsafe {
            assert_eq!(rte_eth_dev_get_port_by_name(name.as_ptr(), port), 0);
            let rc = rte_eth_dev_configure(*port, 1, 1, &conf);
            assert_eq!(rc, 0, "configure: {}", strerror(-rc));
            let rc =
                rte_eth_rx_queue_setup(*port, 0, 128, SOCKET_ID_ANY as u32, std::ptr::null(), pool);
            assert_eq!(rc, 0, "rx queue: {}", strerror(-rc));
            let rc = rte_eth_tx_queue_setup(*port, 0, 128, SOCKET_ID_ANY as u32, std::ptr::null());
            assert_eq!(rc, 0, "tx queue: {}", strerror(-rc));
            let rc = rte_eth_dev_start(*port);
            assert_eq!(rc, 0, "start: {}", strerror(-rc));
        }
    }
    let mut macs = [rte_ether_addr::default(); 2];
    for (port, mac) in ports.iter().zip(macs.iter_mut()) {
        // SAFETY: valid port and out-pointer.
        unsafe { assert_eq!(rte_eth_macaddr_get(*port, mac), 0) };
    }

    // Four frames from port 0 (rdsdva) to port 1 (rdsdvb), with a private ethertype and a
    // numbered payload.
    const N: usize = 4;
    let frame = |i: usize| -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&macs[1].addr_bytes);
        f.extend_from_slice(&macs[0].addr_bytes);
        f.extend_from_slice(&[0x88, 0xb5]); // local experimental ethertype
        f.extend((0..100).map(|b| (b as u8) ^ (i as u8)));
        f
    };
    let mut tx = [std::ptr::null_mut::<rte_mbuf>(); N];
    for (i, slot) in tx.iter_mut().enumerate() {
        let f = frame(i);
        // SAFETY: pool is valid; append returns f.len() writable bytes (checked non-null).
        unsafe {
            let m = rte_pktmbuf_alloc(pool);
            assert!(!m.is_null());
            let p = rte_pktmbuf_append(m, f.len() as u16) as *mut u8;
            assert!(!p.is_null());
            std::ptr::copy_nonoverlapping(f.as_ptr(), p, f.len());
            *slot = m;
        }
    }
    // SAFETY: tx holds N valid mbufs; the burst takes the ones it accepts.
    let sent = unsafe { rte_eth_tx_burst(ports[0], 0, tx.as_mut_ptr(), N as u16) } as usize;
    // SAFETY: the rest are still ours.
    unsafe {
        for m in &tx[sent..] {
            rte_pktmbuf_free(*m);
        }
    }
    assert_eq!(sent, N);

    // Receive on port 1; the kernel may also deliver its own frames (IPv6 router
    // solicitations and the like): keep only ours.
    let mut got: Vec<Vec<u8>> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < N && Instant::now() < deadline {
        let mut rx = [std::ptr::null_mut::<rte_mbuf>(); 16];
        // SAFETY: room for 16 pointers; the port is started.
        let n = unsafe { rte_eth_rx_burst(ports[1], 0, rx.as_mut_ptr(), 16) } as usize;
        for m in &rx[..n] {
            // SAFETY: m is a valid single-segment mbuf we own (af_packet gives one segment
            // for frames that fit the data room); copied out, then freed.
            unsafe {
                let len = rte_pktmbuf_data_len(*m) as usize;
                let p = rte_pktmbuf_mtod(*m) as *const u8;
                let bytes = std::slice::from_raw_parts(p, len).to_vec();
                if bytes.len() > 14 && bytes[12..14] == [0x88, 0xb5] {
                    got.push(bytes);
                }
                rte_pktmbuf_free(*m);
            }
        }
        if n == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(got.len(), N, "frames received on the other end of the veth");
    for (i, f) in got.iter().enumerate() {
        assert_eq!(f, &frame(i), "frame {i} arrives intact and in order");
    }

    let runtime = common::runtime_dir();
    // SAFETY: ports are started; after close they are not used; pool freed after the
    // ports; EAL cleaned up once.
    unsafe {
        for p in ports {
            assert_eq!(rte_eth_dev_stop(p), 0);
            assert_eq!(rte_eth_dev_close(p), 0);
        }
        rte_mempool_free(pool);
        assert_eq!(rte_eal_cleanup(), 0);
    }
    common::remove_runtime_dir(&runtime);
    drop(args);
}
