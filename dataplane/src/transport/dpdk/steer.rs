//! Software steering between the queue pairs of one DPDK port (`[dpdk] queues` > 1).
//!
//! Each of the first `queues` poll threads owns one rx/tx queue pair and the RDS connections
//! `config::conn_shard` gives it (a hash of the address pair). A frame that arrives on
//! another thread's queue is handed to its owner through the owner's inbox (an `ArrayQueue`
//! of mbuf pointers: any thread may hand over, only the owner takes out). The port gives no
//! help: af_packet fans frames out by the kernel's own flow hash, and memif delivers on the
//! queue the peer sent on (queue k to queue k: with the same `queues` at both ends, and the
//! hash symmetric, a connection's frames arrive on its owner's queue and nothing moves). A
//! NIC with RSS or flow rules could do this in hardware; no port here has them.
//!
//! * **Who owns a frame** ([`owner`]): an IPv4 frame, the owner of (destination, source); an
//!   ARP reply, every thread (each keeps its own neighbour cache and may have asked); anything
//!   else (ARP requests, which any thread can answer), the thread that received it.
//! * **Port start and stop** ([`Gate`]): only queue 0's thread starts a port late (a memif
//!   client whose server was not there yet) or restarts it (a memif link that stayed down).
//!   DPDK's bursts must not run on a stopped port, so every other thread marks itself busy
//!   around each burst and checks that the port runs; queue 0's thread, before it stops the
//!   port, clears `running` and waits until no other thread is busy (a few microseconds: one
//!   burst). The flags are each thread's own cache line, read only by a stop.

use crossbeam_queue::ArrayQueue;
use dpdk_sys as sys;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Frames an inbox holds; past that, handed-over frames are dropped (and counted): TCP resends.
pub const INBOX: usize = 4096;

/// An mbuf handed between poll threads.
pub struct Mbuf(pub *mut sys::rte_mbuf);

// SAFETY: an mbuf belongs to whoever holds the pointer; handing it over moves it (the sender
// never touches it again), and DPDK mbufs and their pool may be used from any thread.
unsafe impl Send for Mbuf {}

/// One cache line per thread.
#[repr(align(128))]
struct Flag(AtomicBool);

/// The port's start/stop gate (see the module docs).
pub struct Gate {
    running: AtomicBool,
    busy: Vec<Flag>,
}

impl Gate {
    /// Thread `q` is about to burst: false if the port is stopped (then it must not).
    pub fn enter(&self, q: usize) -> bool {
        self.busy[q].0.store(true, Ordering::SeqCst);
        if self.running.load(Ordering::SeqCst) {
            return true;
        }
        self.busy[q].0.store(false, Ordering::Release);
        false
    }

    /// Thread `q`'s burst is over.
    pub fn leave(&self, q: usize) {
        self.busy[q].0.store(false, Ordering::Release);
    }

    /// Queue 0's thread is about to stop the port: no other thread bursts from here on.
    pub fn close(&self) {
        self.running.store(false, Ordering::SeqCst);
        for f in &self.busy[1..] {
            while f.0.load(Ordering::SeqCst) {
                std::hint::spin_loop();
            }
        }
    }

    /// The port runs (again): the other threads may burst.
    pub fn open(&self) {
        self.running.store(true, Ordering::Release);
    }
}

/// What the threads of one port share.
pub struct Steering {
    inboxes: Vec<ArrayQueue<Mbuf>>,
    /// The start/stop gate.
    pub gate: Gate,
    /// Frames dropped because an inbox was full (counted on the thread that handed them over,
    /// which cannot keep them).
    drops: Vec<AtomicU64>,
}

impl Steering {
    /// For `queues` threads; `running`: whether the port is started.
    pub fn new(queues: usize, running: bool) -> Steering {
        Steering {
            inboxes: (0..queues).map(|_| ArrayQueue::new(INBOX)).collect(),
            gate: Gate {
                running: AtomicBool::new(running),
                busy: (0..queues).map(|_| Flag(AtomicBool::new(false))).collect(),
            },
            drops: (0..queues).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Queue pairs (threads).
    pub fn queues(&self) -> usize {
        self.inboxes.len()
    }

    /// Hands `m` to thread `to`; a full inbox frees it (counted for thread `from`).
    pub fn hand_over(&self, from: usize, to: usize, m: Mbuf) {
        if let Err(Mbuf(m)) = self.inboxes[to].push(m) {
            // SAFETY: the push failed, so the mbuf is still ours; freed once.
            unsafe { sys::rte_pktmbuf_free(m) };
            self.drops[from].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The next frame handed to thread `q`.
    pub fn take(&self, q: usize) -> Option<Mbuf> {
        self.inboxes[q].pop()
    }

    /// Frames thread `q` handed over and saw dropped.
    pub fn drops(&self, q: usize) -> u64 {
        self.drops[q].load(Ordering::Relaxed)
    }
}

impl Drop for Steering {
    fn drop(&mut self) {
        for inbox in &self.inboxes {
            while let Some(Mbuf(m)) = inbox.pop() {
                // SAFETY: handed over and never taken: ours, freed once.
                unsafe { sys::rte_pktmbuf_free(m) };
            }
        }
    }
}

/// Who should process a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// This thread (whoever received it).
    Receiver,
    /// Thread k.
    Thread(usize),
    /// Every thread.
    All,
}

/// The owner of an Ethernet frame among `queues` threads (see the module docs). Reads at
/// most the first 34 bytes; a short or odd frame stays with its receiver (which drops it).
pub fn owner(frame: &[u8], queues: usize) -> Owner {
    const IPV4: [u8; 2] = [0x08, 0x00];
    const ARP: [u8; 2] = [0x08, 0x06];
    let Some(ethertype) = frame.get(12..14) else {
        return Owner::Receiver;
    };
    if ethertype == IPV4 {
        let (Some(src), Some(dst)) = (frame.get(26..30), frame.get(30..34)) else {
            return Owner::Receiver;
        };
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        // Our address is the destination: (laddr, faddr) = (dst, src).
        return Owner::Thread(crate::config::conn_shard(queues, be(dst), be(src)));
    }
    if ethertype == ARP && frame.get(20..22) == Some(&[0, 2]) {
        return Owner::All;
    }
    Owner::Receiver
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[26..30].copy_from_slice(&src);
        f[30..34].copy_from_slice(&dst);
        f
    }

    #[test]
    fn frames_go_to_their_connection_owner_and_arp_replies_to_all() {
        let (a, b) = ([10, 0, 0, 1], [10, 0, 0, 2]);
        for queues in [2, 3, 4] {
            let want =
                crate::config::conn_shard(queues, u32::from_be_bytes(a), u32::from_be_bytes(b));
            // Both directions of one connection: the same owner (the hash is symmetric).
            assert_eq!(owner(&ipv4(b, a), queues), Owner::Thread(want));
            assert_eq!(owner(&ipv4(a, b), queues), Owner::Thread(want));
        }
        let mut arp = vec![0u8; 42];
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        arp[20..22].copy_from_slice(&[0, 1]);
        assert_eq!(owner(&arp, 2), Owner::Receiver, "a request: anyone answers");
        arp[20..22].copy_from_slice(&[0, 2]);
        assert_eq!(owner(&arp, 2), Owner::All, "a reply: every neighbour cache");
        assert_eq!(owner(&arp[..21], 2), Owner::Receiver, "short");
        assert_eq!(owner(&ipv4(a, b)[..33], 2), Owner::Receiver, "short");
        assert_eq!(owner(&[0u8; 10], 2), Owner::Receiver);
        let mut ipv6 = ipv4(a, b);
        ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
        assert_eq!(owner(&ipv6, 2), Owner::Receiver);
    }

    #[test]
    fn a_stopped_port_lets_no_burst_in_and_a_stop_waits_for_bursts_out() {
        let s = std::sync::Arc::new(Steering::new(3, true));
        assert!(s.gate.enter(1));
        let stopper = {
            let s = s.clone();
            std::thread::spawn(move || {
                s.gate.close();
                // Only reached once thread 1 left its burst.
                s.gate.enter(2)
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!stopper.is_finished(), "the stop waits for the burst");
        s.gate.leave(1);
        assert!(!stopper.join().unwrap(), "stopped: no burst");
        assert!(!s.gate.enter(1));
        s.gate.open();
        assert!(s.gate.enter(2));
        s.gate.leave(2);
    }
}
