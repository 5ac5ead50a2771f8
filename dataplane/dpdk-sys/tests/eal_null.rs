//! A whole EAL life cycle on the net_null PMD: init without PCI or hugepages, one port with
//! one rx and one tx queue, an mbuf pool, start, tx burst, rx burst, stop, close, cleanup.
//!
//! net_null's tx frees what it is given and its rx "receives" freshly allocated packets of
//! 64 bytes from the queue's mempool, so no network is involved.

mod common;

use dpdk_sys::*;
use std::ffi::{CStr, CString};

#[test]
fn eal_null_port_tx_rx_cycle() {
    let prefix = common::unique_prefix("null");
    let mut args = common::eal_args(&prefix, 128, &["net_null0"]);
    // SAFETY: argv is a NULL-terminated array of valid C strings that lives until the end
    // of the process (`args` is dropped after rte_eal_cleanup); EAL is initialised once in
    // this process (this file is its own test binary with a single test).
    let ret = unsafe { rte_eal_init(args.argc(), args.argv()) };
    assert!(
        ret >= 0,
        "rte_eal_init failed: {}",
        // SAFETY: reading the thread-local rte_errno has no preconditions.
        strerror(unsafe { rte_errno() })
    );
    // ret is the number of arguments EAL consumed (all but argv[0]).
    assert_eq!(ret, args.argc() - 1);

    // SAFETY: EAL is initialised; these read EAL's configuration.
    unsafe {
        assert_eq!(rte_lcore_id(), 0, "the main thread is lcore 0 (-l 0)");
        assert_eq!(rte_lcore_count(), 1);
        let _ = rte_socket_id();
        assert_eq!(rte_eth_dev_count_avail(), 1, "one port: net_null0");
    }

    let mut port: u16 = u16::MAX;
    let name = CString::new("net_null0").unwrap();
    // SAFETY: name is a valid C string and port a valid out-pointer.
    let rc = unsafe { rte_eth_dev_get_port_by_name(name.as_ptr(), &mut port) };
    assert_eq!(rc, 0, "port of net_null0: {}", strerror(-rc));

    // Device info and MAC address.
    let mut info = rte_eth_dev_info::default();
    // SAFETY: port is valid and info a valid out-pointer.
    let rc = unsafe { rte_eth_dev_info_get(port, &mut info) };
    assert_eq!(rc, 0, "rte_eth_dev_info_get: {}", strerror(-rc));
    assert!(info.max_rx_queues >= 1 && info.max_tx_queues >= 1);
    // SAFETY: driver_name is a static C string owned by the driver.
    let driver = unsafe { CStr::from_ptr(info.driver_name) }.to_string_lossy();
    assert_eq!(driver, "net_null");
    let mut mac = rte_ether_addr::default();
    // SAFETY: port is valid and mac a valid out-pointer.
    let rc = unsafe { rte_eth_macaddr_get(port, &mut mac) };
    assert_eq!(rc, 0, "rte_eth_macaddr_get: {}", strerror(-rc));

    // Configure one rx and one tx queue with the default configuration.
    let conf = rte_eth_conf::default();
    // SAFETY: port is valid and conf a valid, zeroed (all defaults) configuration.
    let rc = unsafe { rte_eth_dev_configure(port, 1, 1, &conf) };
    assert_eq!(rc, 0, "rte_eth_dev_configure: {}", strerror(-rc));

    let pool_name = CString::new("rdsd_test_pool").unwrap();
    // SAFETY: pool_name is a valid C string; the sizes are within DPDK's limits.
    let pool = unsafe {
        rte_pktmbuf_pool_create(
            pool_name.as_ptr(),
            1023,
            32,
            0,
            RTE_MBUF_DEFAULT_BUF_SIZE as u16,
            rte_socket_id() as i32,
        )
    };
    assert!(
        !pool.is_null(),
        "rte_pktmbuf_pool_create: {}",
        // SAFETY: reading the thread-local rte_errno has no preconditions.
        strerror(unsafe { rte_errno() })
    );
    // SAFETY: pool is a valid mbuf pool.
    unsafe {
        assert_eq!(
            rte_pktmbuf_data_room_size(pool),
            RTE_MBUF_DEFAULT_BUF_SIZE as u16
        );
        assert_eq!(rte_mempool_avail_count(pool), 1023);
    }

    // SAFETY: port is configured with one queue each; a null rxconf/txconf means the
    // driver's defaults; pool is a valid mbuf pool that outlives the queues.
    unsafe {
        let sock = rte_eth_dev_socket_id(port) as u32;
        let rc = rte_eth_rx_queue_setup(port, 0, 128, sock, std::ptr::null(), pool);
        assert_eq!(rc, 0, "rte_eth_rx_queue_setup: {}", strerror(-rc));
        let rc = rte_eth_tx_queue_setup(port, 0, 128, sock, std::ptr::null());
        assert_eq!(rc, 0, "rte_eth_tx_queue_setup: {}", strerror(-rc));
        let rc = rte_eth_dev_start(port);
        assert_eq!(rc, 0, "rte_eth_dev_start: {}", strerror(-rc));
    }

    let mut link = rte_eth_link::default();
    // SAFETY: port is started and link a valid out-pointer.
    let rc = unsafe { rte_eth_link_get_nowait(port, &mut link) };
    assert_eq!(rc, 0, "rte_eth_link_get_nowait: {}", strerror(-rc));
    assert_eq!(link.link_status(), RTE_ETH_LINK_UP as u16);

    // Build four frames with mbuf append and the data accessors, and send them.
    const N: usize = 4;
    let mut tx: [*mut rte_mbuf; N] = [std::ptr::null_mut(); N];
    for (i, slot) in tx.iter_mut().enumerate() {
        // SAFETY: pool is a valid mbuf pool; append returns a pointer to `len` writable
        // bytes inside the mbuf's data room (or null, which we check).
        unsafe {
            let m = rte_pktmbuf_alloc(pool);
            assert!(!m.is_null(), "rte_pktmbuf_alloc");
            assert_eq!(rte_pktmbuf_pkt_len(m), 0);
            assert_eq!(rte_pktmbuf_headroom(m), RTE_PKTMBUF_HEADROOM as u16);
            let len = 60 + i as u16;
            let p = rte_pktmbuf_append(m, len) as *mut u8;
            assert!(!p.is_null(), "rte_pktmbuf_append");
            std::ptr::write_bytes(p, 0xa0 + i as u8, len as usize);
            assert_eq!(
                rte_pktmbuf_mtod(m) as *mut u8,
                p,
                "mtod is where append wrote"
            );
            assert_eq!(rte_pktmbuf_data_len(m), len);
            assert_eq!(rte_pktmbuf_pkt_len(m), len as u32);
            assert_eq!(rte_pktmbuf_nb_segs(m), 1);
            assert!(rte_pktmbuf_next(m).is_null());
            assert_eq!(
                *(rte_pktmbuf_mtod_offset(m, 3) as *const u8),
                0xa0 + i as u8
            );
            *slot = m;
        }
    }
    // SAFETY: pool is valid; N mbufs are allocated.
    unsafe { assert_eq!(rte_mempool_in_use_count(pool), N as u32) };
    // SAFETY: tx holds N valid mbufs; the tx burst takes ownership of those it accepts.
    let sent = unsafe { rte_eth_tx_burst(port, 0, tx.as_mut_ptr(), N as u16) } as usize;
    assert_eq!(sent, N, "net_null accepts every packet");
    // SAFETY: tx[sent..] were not accepted and still belong to us.
    unsafe {
        for m in &tx[sent..] {
            rte_pktmbuf_free(*m);
        }
        // net_null's tx freed them back to the pool.
        assert_eq!(rte_mempool_in_use_count(pool), 0);
    }

    // Receive: net_null generates packets from the rx queue's pool.
    let mut rx: [*mut rte_mbuf; 8] = [std::ptr::null_mut(); 8];
    // SAFETY: rx has room for 8 mbuf pointers; the port is started.
    let got = unsafe { rte_eth_rx_burst(port, 0, rx.as_mut_ptr(), rx.len() as u16) } as usize;
    assert!(got > 0, "net_null rx returns generated packets");
    // SAFETY: the first `got` entries are valid mbufs we now own.
    unsafe {
        for m in &rx[..got] {
            assert_eq!(
                rte_pktmbuf_pkt_len(*m),
                64,
                "net_null's default packet size"
            );
            assert!(!rte_pktmbuf_mtod(*m).is_null());
        }
        assert_eq!(rte_mempool_in_use_count(pool), got as u32);
        rte_pktmbuf_free_bulk(rx.as_mut_ptr(), got as u32);
        assert_eq!(rte_mempool_in_use_count(pool), 0);
    }

    // Bulk allocation, trim/adj/prepend, free.
    // SAFETY: pool is valid; the array has room for 2 mbufs.
    unsafe {
        let mut two: [*mut rte_mbuf; 2] = [std::ptr::null_mut(); 2];
        assert_eq!(rte_pktmbuf_alloc_bulk(pool, two.as_mut_ptr(), 2), 0);
        let m = two[0];
        assert!(!rte_pktmbuf_append(m, 100).is_null());
        assert_eq!(rte_pktmbuf_trim(m, 10), 0);
        assert!(!rte_pktmbuf_adj(m, 20).is_null());
        assert!(!rte_pktmbuf_prepend(m, 14).is_null());
        assert_eq!(rte_pktmbuf_data_len(m), 100 - 10 - 20 + 14);
        assert!(
            rte_pktmbuf_append(m, u16::MAX).is_null(),
            "beyond the tailroom"
        );
        assert!(rte_pktmbuf_tailroom(m) > 0);
        rte_pktmbuf_reset(m);
        assert_eq!(rte_pktmbuf_pkt_len(m), 0);
        rte_pktmbuf_free_bulk(two.as_mut_ptr(), 2);
    }

    let mut stats = rte_eth_stats::default();
    // SAFETY: port is valid and stats a valid out-pointer.
    unsafe {
        assert_eq!(rte_eth_stats_get(port, &mut stats), 0);
    }
    assert_eq!(stats.opackets, N as u64);
    assert!(stats.ipackets >= got as u64);

    let runtime = common::runtime_dir();
    // SAFETY: the port is started; after close it must not be used, and it is not. The pool
    // is freed after the port that used it is closed; then EAL is cleaned up once.
    unsafe {
        let rc = rte_eth_dev_stop(port);
        assert_eq!(rc, 0, "rte_eth_dev_stop: {}", strerror(-rc));
        let rc = rte_eth_dev_close(port);
        assert_eq!(rc, 0, "rte_eth_dev_close: {}", strerror(-rc));
        rte_mempool_free(pool);
        let rc = rte_eal_cleanup();
        assert_eq!(rc, 0, "rte_eal_cleanup: {}", strerror(-rc));
    }
    common::remove_runtime_dir(&runtime);
    drop(args);
}
