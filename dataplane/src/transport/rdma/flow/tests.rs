//! Two [`PathFlow`]s joined by a fake RC queue pair: sends are delivered in order into the
//! peer's posted receive buffers (none posted: RNR, retried), each queue completes in order but
//! the test picks how the send and receive queues interleave on the CQ, and a QP error flushes
//! every posted request. Every check is on behaviour: what the peer's protocol layer reads,
//! what `acked()` releases, and when the path is reported down.

use super::*;
use crate::transport::rdma::wire::SLOT;
use proptest::prelude::*;
use rds_proto::wire::{flags, HeaderPacket};
use std::collections::HashSet;

const RECV_N: u32 = 32;
const SEND_N: u32 = 260;
/// `IBV_WC_WR_FLUSH_ERR`.
const FLUSH_ERR: u32 = 5;

fn flushed(wr_id: u64) -> Completion {
    Completion {
        wr_id,
        ok: false,
        status: FLUSH_ERR,
        byte_len: 0,
    }
}

/// A fake RC queue pair: slots, posted requests and the two queues' completions.
struct FakeQp {
    recv: Vec<Vec<u8>>,
    send: Vec<Vec<u8>>,
    ack: Vec<u8>,
    /// Posted receive buffers, in posting order (RC fills them in that order).
    posted_recv: VecDeque<u32>,
    /// Send work-request ids posted and not yet completed to the flow.
    sends_in_flight: HashSet<u64>,
    /// Posted sends not yet on the wire: (id, the bytes gathered from its SGEs).
    sq: VecDeque<(u64, Vec<u8>)>,
    /// Sends the peer received whose completion (the responder's ack) has not come.
    unacked: VecDeque<u64>,
    send_cq: VecDeque<Completion>,
    recv_cq: VecDeque<Completion>,
    errored: bool,
    /// The post calls fail (a QP the provider refuses).
    fail_posts: bool,
    /// Sends that found no posted receive buffer at the peer.
    rnr: u64,
    posted_sends: Vec<(u64, u32, Option<InPlaceSge>)>,
}

impl FakeQp {
    fn new() -> FakeQp {
        FakeQp {
            recv: vec![vec![0; SLOT]; RECV_N as usize],
            send: vec![vec![0; SLOT]; SEND_N as usize],
            ack: vec![0; HDR],
            posted_recv: VecDeque::new(),
            sends_in_flight: HashSet::new(),
            sq: VecDeque::new(),
            unacked: VecDeque::new(),
            send_cq: VecDeque::new(),
            recv_cq: VecDeque::new(),
            errored: false,
            fail_posts: false,
            rnr: 0,
            posted_sends: Vec::new(),
        }
    }

    /// The QP moves to the error state: every posted request completes with a flush error,
    /// each queue in order.
    fn error(&mut self) {
        self.errored = true;
        for slot in self.posted_recv.drain(..) {
            self.recv_cq.push_back(flushed(u64::from(slot)));
        }
        let unacked = self.unacked.drain(..);
        let queued = self.sq.drain(..).map(|(id, _)| id);
        self.send_cq
            .extend(unacked.chain(queued).map(flushed).collect::<Vec<_>>());
    }

    fn refuse(&self) -> std::io::Result<()> {
        if self.fail_posts {
            Err(std::io::Error::from_raw_os_error(libc::ENOMEM))
        } else {
            Ok(())
        }
    }

    fn queue_send(&mut self, wr_id: u64, bytes: Vec<u8>) {
        assert!(bytes.len() <= SLOT, "a SEND larger than a receive buffer");
        assert!(
            self.sends_in_flight.insert(wr_id),
            "send slot {wr_id:#x} posted again before its completion"
        );
        if self.errored {
            self.send_cq.push_back(flushed(wr_id));
        } else {
            self.sq.push_back((wr_id, bytes));
        }
    }
}

impl QueuePair for FakeQp {
    fn recv_slot(&self, slot: u32) -> &[u8] {
        assert!(
            !self.posted_recv.contains(&slot),
            "read a posted receive buffer"
        );
        &self.recv[slot as usize]
    }

    fn send_slot_mut(&mut self, slot: u32) -> &mut [u8] {
        assert!(
            !self.sends_in_flight.contains(&(SEND_TAG | u64::from(slot))),
            "wrote a send slot the device is sending"
        );
        &mut self.send[slot as usize]
    }

    fn ack_slot_mut(&mut self) -> &mut [u8] {
        assert!(
            !self.sends_in_flight.contains(&ACK_WR_ID),
            "wrote the ACK slot while it is sent"
        );
        &mut self.ack
    }

    fn post_recv(&mut self, slot: u32) -> std::io::Result<()> {
        self.refuse()?;
        assert!(slot < RECV_N && !self.posted_recv.contains(&slot));
        if self.errored {
            self.recv_cq.push_back(flushed(u64::from(slot)));
        } else {
            self.posted_recv.push_back(slot);
        }
        Ok(())
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        slot: u32,
        bytes: u32,
        extra: Option<InPlaceSge>,
    ) -> std::io::Result<()> {
        self.refuse()?;
        assert_eq!(wr_id, SEND_TAG | u64::from(slot));
        let mut data = self.send[slot as usize][..bytes as usize].to_vec();
        if let Some(e) = extra.filter(|e| e.len > 0) {
            // SAFETY: the tests keep every payload they write (`Side::queue`, then
            // `Side::written`) alive and unmodified until the end of the test.
            let chunk = unsafe { std::slice::from_raw_parts(e.addr as *const u8, e.len as usize) };
            data.extend_from_slice(chunk);
        }
        self.posted_sends.push((wr_id, bytes, extra));
        self.queue_send(wr_id, data);
        Ok(())
    }

    fn post_ack(&mut self, wr_id: u64) -> std::io::Result<()> {
        self.refuse()?;
        assert_eq!(wr_id, ACK_WR_ID);
        let data = self.ack.clone();
        self.queue_send(wr_id, data);
        Ok(())
    }
}

/// A frame the protocol layer hands in.
#[derive(Clone, Debug)]
struct Frame {
    hdr: [u8; HDR],
    payload: Vec<u8>,
}

fn frame(seq: u64, len: usize, hdr_flags: u8) -> Frame {
    let mut hdr = [0u8; HDR];
    let mut h = HeaderPacket::new_unchecked(&mut hdr[..]);
    h.set_sequence(seq);
    h.set_len(len as u32);
    h.set_sport(4000);
    h.set_dport(5000);
    h.set_flags(hdr_flags);
    h.fill_checksum();
    let payload = (0..len)
        .map(|i| (seq as usize).wrapping_mul(131).wrapping_add(i * 7) as u8)
        .collect();
    Frame { hdr, payload }
}

/// One end: its flow, its fake QP and a protocol layer that writes and reads frames.
struct Side {
    flow: PathFlow,
    qp: FakeQp,
    /// Payloads sent in place (the fake's lkey), not copied into the slots.
    in_place: bool,
    /// Whether this side counts credits (the peer offered some).
    flow_control: bool,
    next_seq: u64,
    /// Frames handed in and not yet taken by `write`.
    queue: VecDeque<Frame>,
    /// Frames taken, with the offset of their end.
    written: Vec<(Frame, u64)>,
    /// Whole frames `read` returned.
    read: Vec<Vec<u8>>,
    /// `write` said `Closed`.
    closed: bool,
    /// Frames in `read` already compared with the peer's `written`.
    verified: usize,
}

impl Side {
    fn new(now: Instant, peer_offers: u32, in_place: bool) -> Side {
        let mut flow = PathFlow::new(now);
        let mut qp = FakeQp::new();
        flow.attach(&mut qp, RECV_N, SEND_N).unwrap();
        flow.peer_credits(Some(peer_offers), RECV_N);
        flow.established(now);
        Side {
            flow,
            qp,
            in_place,
            flow_control: peer_offers > 0,
            next_seq: 1,
            queue: VecDeque::new(),
            written: Vec::new(),
            read: Vec::new(),
            closed: false,
            verified: 0,
        }
    }

    fn submit(&mut self, len: usize) {
        let f = frame(self.next_seq, len, 0);
        self.next_seq += 1;
        self.queue.push_back(f);
    }

    /// Writes queued frames until the link says no. Returns frames taken.
    fn pump_writes(&mut self) -> usize {
        let mut n = 0;
        while let Some(f) = self.queue.front() {
            let lkey = self.in_place.then_some(0x5eed);
            match self.flow.write(&mut self.qp, &f.hdr, &f.payload, lkey) {
                Write::Wrote(len) => {
                    assert_eq!(len, HDR + f.payload.len());
                    let f = self.queue.pop_front().expect("front");
                    self.written.push((f, self.flow.written()));
                    n += 1;
                }
                Write::WouldBlock => break,
                Write::Closed => {
                    self.closed = true;
                    break;
                }
            }
        }
        n
    }

    /// Hands up to `max` completions to the flow, taking them from the send queue where the
    /// bit of `pattern` is set and from the receive queue where it is clear (when that queue
    /// is empty, from the other), then lets the flow progress. Returns completions handled.
    fn poll(&mut self, pattern: u64, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            let from_send = (pattern >> (n % 64)) & 1 == 1;
            let wc = match (
                from_send,
                self.qp.send_cq.is_empty(),
                self.qp.recv_cq.is_empty(),
            ) {
                (_, true, true) => break,
                (true, false, _) | (false, false, true) => self.qp.send_cq.pop_front(),
                _ => self.qp.recv_cq.pop_front(),
            }
            .expect("not empty");
            if wc.wr_id & SEND_TAG != 0 {
                assert!(self.qp.sends_in_flight.remove(&wc.wr_id));
            }
            self.flow.on_completion(wc);
            n += 1;
        }
        n + self.flow.progress(&mut self.qp)
    }

    fn read_one(&mut self) -> bool {
        match self.flow.read(&mut self.qp) {
            Some(f) => {
                self.read.push(f.to_vec());
                true
            }
            None => false,
        }
    }

    fn written_end(&self) -> u64 {
        self.written.last().map_or(0, |w| w.1)
    }

    fn dead(&self) -> bool {
        self.flow.state() == PathState::Dead
    }
}

/// Two sides over the fake wire, on a virtual clock.
struct Pair {
    sides: [Side; 2],
    now: Instant,
}

impl Pair {
    /// `offers[k]`: the initial credits side k grants (0: the kernel's flow control off).
    fn new(offers: [u32; 2], in_place: [bool; 2]) -> Pair {
        let now = Instant::now();
        Pair {
            sides: [
                Side::new(now, offers[1], in_place[0]),
                Side::new(now, offers[0], in_place[1]),
            ],
            now,
        }
    }

    fn ends(&mut self, from: usize) -> (&mut Side, &mut Side) {
        let [a, b] = &mut self.sides;
        if from == 0 {
            (a, b)
        } else {
            (b, a)
        }
    }

    /// Puts the oldest posted send of side `from` on the wire. Returns true on progress.
    fn transmit(&mut self, from: usize) -> bool {
        let (s, r) = self.ends(from);
        let Some((wr_id, bytes)) = s.qp.sq.pop_front() else {
            return false;
        };
        if r.qp.errored {
            // The responder does not answer: the requester's retries run out.
            s.qp.sq.push_front((wr_id, bytes));
            s.qp.error();
            return true;
        }
        let Some(slot) = r.qp.posted_recv.pop_front() else {
            if s.flow_control {
                panic!("a SEND with credits found no posted receive buffer (RNR)");
            }
            s.qp.rnr += 1;
            s.qp.sq.push_front((wr_id, bytes));
            return false;
        };
        r.qp.recv[slot as usize][..bytes.len()].copy_from_slice(&bytes);
        r.qp.recv_cq.push_back(Completion {
            wr_id: u64::from(slot),
            ok: true,
            status: 0,
            byte_len: bytes.len() as u32,
        });
        s.qp.unacked.push_back(wr_id);
        true
    }

    /// The responder's ack for side `side`'s oldest send on the wire arrives.
    fn complete_send(&mut self, side: usize) -> bool {
        let qp = &mut self.sides[side].qp;
        match qp.unacked.pop_front() {
            Some(id) => {
                qp.send_cq.push_back(Completion {
                    wr_id: id,
                    ok: true,
                    status: 0,
                    byte_len: 0,
                });
                true
            }
            None => false,
        }
    }

    /// The shell's housekeeping for side `k` (`poll_aux`): poll everything, then the stall
    /// check. Returns work done.
    fn service(&mut self, k: usize, pattern: u64) -> usize {
        let s = &mut self.sides[k];
        let n = s.poll(pattern, usize::MAX);
        if s.flow.state() == PathState::Up {
            s.flow.check_stall(self.now, n > 0);
        }
        n
    }

    /// What must hold at every moment: each side reads exactly the other's frames, in order,
    /// whole; and `acked()` never releases a frame the peer's protocol layer has not read.
    fn check_safety(&mut self) {
        for k in 0..2 {
            let [a, b] = &mut self.sides;
            let (s, r) = if k == 0 { (a, b) } else { (b, a) };
            assert!(
                r.read.len() <= s.written.len(),
                "read a frame never written"
            );
            let new = r.verified..r.read.len();
            r.verified = r.read.len();
            for (got, (want, _)) in r.read[new.clone()].iter().zip(&s.written[new]) {
                let h = FragHdr::parse(got).expect("a header");
                let w = FragHdr::parse(&want.hdr).expect("a header");
                assert!(h.same_message(&w), "frames out of order or mixed");
                assert_eq!(&got[HDR..], &want.payload[..], "payload of seq {}", w.seq);
                assert!(HeaderPacket::new_unchecked(&got[..HDR]).verify_checksum());
            }
            let read_end = r.read.len().checked_sub(1).map_or(0, |i| s.written[i].1);
            let acked = s.flow.acked();
            assert!(
                acked <= read_end,
                "released {acked} but the peer read only up to {read_end}"
            );
            assert!(
                acked == 0 || s.written.binary_search_by_key(&acked, |w| w.1).is_ok(),
                "acked {acked} is not a frame boundary"
            );
        }
    }

    /// Runs every side until nothing moves (the protocol layers read everything), one virtual
    /// millisecond per round.
    fn drain(&mut self) {
        for _round in 0..100_000 {
            self.now += Duration::from_millis(1);
            let mut moved = 0;
            for k in 0..2 {
                moved += self.sides[k].pump_writes();
                while self.transmit(k) {
                    moved += 1;
                }
                while self.complete_send(k) {
                    moved += 1;
                }
                moved += self.service(k, 0x5555_5555_5555_5555);
                while self.sides[k].read_one() {
                    moved += 1;
                }
                self.check_safety();
            }
            if moved == 0 {
                return;
            }
        }
        panic!("no quiescence after 100000 rounds (livelock)");
    }

    /// Nothing disappears silently: after `drain`, each side either has every frame it was
    /// handed acknowledged (and read by the peer), or knows the path is dead, at once or by
    /// its stall timer, so that the protocol layer resends everything beyond `acked()`.
    fn check_nothing_lost(&mut self) {
        self.check_safety();
        let later = self.now + STALL_TIMEOUT + Duration::from_millis(1);
        for k in 0..2 {
            let (s, r) = (&self.sides[k], &self.sides[1 - k]);
            let all = s.flow.acked() == s.written_end() && s.queue.is_empty();
            if all {
                assert_eq!(r.read.len(), s.written.len());
                continue;
            }
            let s = &mut self.sides[k];
            let reported = s.dead() || s.flow.check_stall(later, false);
            assert!(
                reported,
                "side {k}: frames beyond acked {} (written {}, queued {}) on a path that \
                 still looks up: {:?}",
                s.flow.acked(),
                s.written_end(),
                s.queue.len(),
                s.flow.snapshot()
            );
            assert!(s.dead());
            // A dead path refuses writes and, once drained, reads: the protocol layer sees it.
            let f = frame(u64::MAX, 1, 0);
            assert_eq!(
                s.flow.write(&mut s.qp, &f.hdr, &f.payload, None),
                Write::Closed
            );
        }
    }
}

#[test]
fn a_1_mib_message_goes_as_256_fragments_each_with_the_header() {
    for in_place in [false, true] {
        let mut p = Pair::new([RECV_N; 2], [in_place; 2]);
        p.sides[0].submit(1 << 20);
        assert_eq!(p.sides[0].pump_writes(), 1);
        // Credits: RECV_N, the last kept for a frame with a credit update.
        assert_eq!(p.sides[0].qp.posted_sends.len(), RECV_N as usize - 1);
        p.drain();
        let a = &p.sides[0];
        let posted = &a.qp.posted_sends;
        assert_eq!(posted.len(), 256);
        let want = &a.written[0].0;
        for (k, (_, bytes, extra)) in posted.iter().enumerate() {
            let chunk = &want.payload[k * FRAG..(k + 1) * FRAG];
            match extra {
                Some(e) => {
                    assert_eq!(*bytes as usize, HDR, "in place: only the header is copied");
                    assert_eq!((e.addr, e.len), (chunk.as_ptr() as u64, FRAG as u32));
                }
                None => assert_eq!(*bytes as usize, SLOT),
            }
        }
        assert_eq!(p.sides[1].read.len(), 1);
        assert_eq!(p.sides[1].read[0].len(), HDR + (1 << 20));
        assert_eq!(a.flow.acked(), (HDR + (1 << 20)) as u64);
        p.check_nothing_lost();
    }
}

#[test]
fn a_frame_larger_than_the_free_send_slots_waits_whole() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    for _ in 0..3 {
        p.sides[0].submit(100 * FRAG);
    }
    assert_eq!(p.sides[0].pump_writes(), 2, "260 slots: two frames of 100");
    assert_eq!(p.sides[0].flow.snapshot().free_send, 60);
    p.drain();
    assert_eq!(p.sides[1].read.len(), 3);
    p.check_nothing_lost();
}

#[test]
fn credits_run_out_while_the_reader_pauses_and_come_back_when_it_reads() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    for _ in 0..100 {
        p.sides[0].submit(10);
    }
    p.sides[0].pump_writes();
    // The reader pauses: fragments are taken off the wire but frames are not read.
    for _ in 0..50 {
        while p.transmit(0) {}
        while p.complete_send(0) {}
        p.sides[0].poll(!0, usize::MAX);
        p.sides[1].poll(0, usize::MAX);
        while p.transmit(1) {}
        while p.complete_send(1) {}
        p.check_safety();
    }
    let b = &p.sides[1];
    assert!(
        b.flow.snapshot().asm_ready,
        "one frame reassembled ahead of read"
    );
    assert_eq!(b.read.len(), 0);
    // The receiver holds every buffer but the one frame it reassembled ahead (the rest
    // completed, not processed, not re-posted): the sender stops, its last credit kept.
    let a = &p.sides[0];
    assert_eq!(a.qp.posted_sends.len(), RECV_N as usize - 1);
    assert_eq!(a.flow.snapshot().credits, 1);
    assert!(a.flow.snapshot().pending > 0);
    assert_eq!(a.flow.acked(), 0);
    // Reading frees buffers; their credits reach the sender and everything arrives.
    p.drain();
    assert_eq!(p.sides[1].read.len(), 100);
    assert_eq!(p.sides[0].qp.rnr, 0);
    p.check_nothing_lost();
}

#[test]
fn acked_waits_for_the_peers_ack_and_for_the_send_completion() {
    let mut p = Pair::new([RECV_N; 2], [true; 2]);
    p.sides[0].submit(5000);
    p.sides[0].pump_writes();
    while p.transmit(0) {}
    // The receiver reads and acks before the sender's send completions come back: the
    // receive completion of the ACK is polled ahead of the send completions.
    p.sides[1].poll(0, usize::MAX);
    assert!(p.sides[1].read_one());
    while p.transmit(1) {}
    p.complete_send(1);
    p.sides[1].poll(!0, usize::MAX);
    p.sides[0].poll(0, 1);
    assert_eq!(p.sides[0].flow.snapshot().unacked, 0, "h_ack arrived");
    assert_eq!(
        p.sides[0].flow.acked(),
        0,
        "the payload is still being sent in place"
    );
    p.complete_send(0);
    p.sides[0].poll(!0, usize::MAX);
    assert_eq!(p.sides[0].flow.acked(), 0, "one of two fragments completed");
    p.complete_send(0);
    p.sides[0].poll(!0, usize::MAX);
    assert_eq!(p.sides[0].flow.acked(), (HDR + 5000) as u64);
    p.check_nothing_lost();
}

#[test]
fn a_qp_error_mid_stream_takes_the_path_down_and_keeps_the_rest_unacked() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    for _ in 0..20 {
        p.sides[0].submit(3 * FRAG);
    }
    p.sides[0].pump_writes();
    for _ in 0..10 {
        p.transmit(0);
    }
    // Three of those went out and were read, but their completions never come.
    p.sides[1].poll(0, usize::MAX);
    while p.sides[1].read_one() {}
    p.sides[0].qp.error();
    p.drain();
    let a = &p.sides[0];
    assert!(a.dead());
    assert!(a.flow.acked() < a.written_end());
    assert_eq!(p.sides[1].read.len(), 3);
    p.check_nothing_lost();
}

#[test]
fn the_peers_qp_error_is_seen_when_we_send_or_by_the_stall_timer() {
    // With something still to send: the next SEND finds no responder.
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].submit(10);
    p.drain();
    p.sides[1].qp.error();
    p.sides[0].submit(10);
    p.drain();
    assert!(p.sides[0].dead());
    p.check_nothing_lost();

    // With everything sent but not acknowledged: only the stall timer can tell.
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].submit(10);
    p.sides[0].pump_writes();
    p.transmit(0);
    p.complete_send(0);
    p.sides[1].qp.error();
    p.drain();
    assert!(
        !p.sides[0].dead(),
        "no completion error: the QP cannot know"
    );
    p.check_nothing_lost();
}

#[test]
fn the_stall_timer_fires_only_while_frames_wait_without_progress() {
    let t0 = Instant::now();
    let mut f = PathFlow::new(t0);
    let mut qp = FakeQp::new();
    f.attach(&mut qp, RECV_N, SEND_N).unwrap();
    f.peer_credits(Some(RECV_N), RECV_N);
    f.established(t0);
    assert!(
        !f.check_stall(t0 + Duration::from_secs(60), false),
        "idle: nothing waits"
    );
    let fr = frame(1, 10, 0);
    assert_eq!(
        f.write(&mut qp, &fr.hdr, &fr.payload, None),
        Write::Wrote(58)
    );
    let t1 = t0 + Duration::from_secs(61);
    assert!(!f.check_stall(t1, true));
    assert!(
        !f.check_stall(t1 + STALL_TIMEOUT, false),
        "not longer than the timeout"
    );
    assert!(
        !f.check_stall(t1 + STALL_TIMEOUT, true),
        "progress resets it"
    );
    assert!(f.check_stall(t1 + STALL_TIMEOUT * 2 + Duration::from_millis(1), false));
    assert_eq!(f.state(), PathState::Dead);
}

#[test]
fn path_age_and_staleness_follow_the_given_clock() {
    let t0 = Instant::now();
    let mut f = PathFlow::new(t0);
    assert_eq!(f.age(t0 + Duration::from_secs(3)), Duration::from_secs(3));
    assert!(!f.stale(t0 + Duration::from_secs(10)), "never up");
    f.established(t0 + Duration::from_secs(1));
    assert!(!f.stale(t0 + Duration::from_secs(2)));
    assert!(f.stale(t0 + Duration::from_secs(2) + Duration::from_millis(1)));
    f.kill();
    assert!(
        !f.stale(t0 + Duration::from_secs(10)),
        "dead paths are not stale"
    );
}

#[test]
fn a_fragment_of_another_message_takes_the_path_down() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].submit(2 * FRAG);
    p.sides[0].pump_writes();
    p.transmit(0);
    // The second fragment claims another sequence number.
    let (_, second) = p.sides[0].qp.sq.front_mut().expect("second fragment");
    HeaderPacket::new_unchecked(&mut second[..HDR]).set_sequence(99);
    p.transmit(0);
    p.sides[1].poll(0, usize::MAX);
    assert!(p.sides[1].dead());
    assert!(
        !p.sides[1].read_one(),
        "no partial frame reaches the protocol layer"
    );
}

#[test]
fn a_message_longer_than_rds_allows_takes_the_path_down_at_its_first_fragment() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].submit(10);
    p.sides[0].pump_writes();
    let (_, first) = p.sides[0].qp.sq.front_mut().expect("posted");
    HeaderPacket::new_unchecked(&mut first[..HDR]).set_len(u32::MAX);
    p.transmit(0);
    p.sides[1].poll(0, usize::MAX);
    assert!(p.sides[1].dead());
    assert!(
        p.sides[1].flow.asm.capacity() < SLOT,
        "nothing buffered for it"
    );
}

#[test]
fn an_ack_only_frame_between_two_fragments_counts_only_for_its_ack() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[1].submit(1);
    p.drain();
    p.sides[0].submit(2 * FRAG);
    p.sides[0].pump_writes();
    p.transmit(0);
    // An ACK-only frame of side 0 (granting 5 credits) squeezed between the fragments.
    let second = p.sides[0].qp.sq.pop_front().expect("second fragment");
    let mut ack = vec![0u8; HDR];
    wire::ack_only(&mut ack, 1, 5);
    p.sides[0].qp.sq.push_front(second);
    p.sides[0].qp.sq.push_front((ACK_WR_ID, ack));
    p.transmit(0);
    p.transmit(0);
    let credits = p.sides[1].flow.credits;
    p.sides[1].poll(0, usize::MAX);
    assert_eq!(p.sides[1].flow.credits, credits + 5);
    assert!(p.sides[1].read_one(), "reassembled around the ACK");
    assert_eq!(p.sides[1].read[0].len(), HDR + 2 * FRAG);
    assert_eq!(
        &p.sides[1].read[0][HDR..],
        &p.sides[0].written[0].0.payload[..]
    );
}

#[test]
fn ack_required_every_eighth_frame_and_at_the_end_of_a_burst_never_on_a_congestion_map() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    for _ in 0..10 {
        p.sides[0].submit(1);
    }
    let cong = frame(11, 1, flags::CONG_BITMAP);
    p.sides[0].queue.push_back(cong);
    p.sides[0].pump_writes();
    p.drain();
    let asked: Vec<bool> = p.sides[1]
        .read
        .iter()
        .map(|f| HeaderPacket::new_unchecked(&f[..HDR]).flags() & flags::ACK_REQUIRED != 0)
        .collect();
    // Each frame posts at write time: every frame is the last of its burst.
    assert_eq!(asked[..10], [true; 10]);
    assert!(!asked[10], "a congestion map keeps its flags");
    assert_eq!(
        HeaderPacket::new_unchecked(&p.sides[1].read[10][..HDR]).flags(),
        flags::CONG_BITMAP
    );

    // Frames queued behind exhausted credits go out as one burst: every 8th and the last.
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].flow.credits = 0;
    for _ in 0..20 {
        p.sides[0].submit(1);
    }
    p.sides[0].pump_writes();
    assert!(p.sides[0].qp.posted_sends.is_empty());
    let a = &mut p.sides[0];
    a.flow.credits = RECV_N;
    a.flow.progress(&mut a.qp);
    p.drain();
    let asked: Vec<usize> = (0..20)
        .filter(|&i| {
            HeaderPacket::new_unchecked(&p.sides[1].read[i][..HDR]).flags() & flags::ACK_REQUIRED
                != 0
        })
        .collect();
    assert_eq!(asked, [7, 15, 19]);
}

#[test]
fn a_peer_without_credits_gets_every_send_and_rnr_is_retried() {
    // The kernel's default: flow control off (0 credits offered).
    let mut p = Pair::new([0, RECV_N], [false; 2]);
    assert!(!p.sides[1].flow_control);
    for _ in 0..100 {
        p.sides[1].submit(10);
    }
    p.sides[1].pump_writes();
    assert_eq!(
        p.sides[1].qp.posted_sends.len(),
        100,
        "no credit holds them back"
    );
    while p.transmit(1) {}
    assert!(p.sides[1].qp.rnr > 0, "more sends than posted buffers");
    p.drain();
    assert_eq!(p.sides[0].read.len(), 100);
    p.check_nothing_lost();
}

#[test]
fn a_failed_post_takes_the_path_down() {
    let mut p = Pair::new([RECV_N; 2], [false; 2]);
    p.sides[0].qp.fail_posts = true;
    p.sides[0].submit(10);
    p.sides[0].pump_writes();
    assert!(p.sides[0].dead());
    p.sides[0].qp.fail_posts = false;
    p.drain();
    p.check_nothing_lost();
}

#[test]
fn peer_credits_from_the_private_data() {
    let mut f = PathFlow::new(Instant::now());
    f.peer_credits(None, 64);
    assert_eq!((f.credits, f.flow_control), (64, true));
    f.peer_credits(Some(0), 64);
    assert_eq!((f.credits, f.flow_control), (0, false));
    f.peer_credits(Some(7), 64);
    assert_eq!((f.credits, f.flow_control), (7, true));
}

/// One step of the property tests.
#[derive(Clone, Debug)]
enum Op {
    /// Side `k`'s protocol layer hands in frames of this payload length.
    Submit(usize, usize, u8),
    /// Up to this many of side `k`'s posted sends go on the wire.
    Transmit(usize, u8),
    /// Up to this many of side `k`'s sends on the wire complete.
    CompleteSends(usize, u8),
    /// Side `k` handles up to `n` completions, interleaving the two queues by the pattern.
    Poll(usize, u64, u8),
    /// Side `k`'s protocol layer reads a frame.
    Read(usize),
    /// Side `k`'s protocol layer writes what it has queued.
    Write(usize),
    /// Side `k`'s QP errors.
    QpError(usize),
    /// The clock moves (the stall timer runs in `Poll`'s housekeeping).
    Tick(u16),
}

fn payload_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => Just(0usize),
        6 => 1usize..200,
        2 => Just(FRAG),
        2 => Just(FRAG + 1),
        4 => 200usize..5 * FRAG,
        2 => 5 * FRAG..40 * FRAG,
        1 => Just(1usize << 20),
    ]
}

fn op(errors: bool) -> impl Strategy<Value = Op> {
    let side = 0usize..2;
    prop_oneof![
        4 => (side.clone(), payload_len(), 1u8..4).prop_map(|(k, l, n)| Op::Submit(k, l, n)),
        6 => (side.clone(), 1u8..40).prop_map(|(k, n)| Op::Transmit(k, n)),
        4 => (side.clone(), 1u8..40).prop_map(|(k, n)| Op::CompleteSends(k, n)),
        6 => (side.clone(), any::<u64>(), 1u8..64).prop_map(|(k, p, n)| Op::Poll(k, p, n)),
        4 => side.clone().prop_map(Op::Read),
        3 => side.clone().prop_map(Op::Write),
        (if errors { 1 } else { 0 }) => side.prop_map(Op::QpError),
        // Without errors no time passes: a long tick would rightly fire the stall timer on a
        // path whose peer the ops leave unpolled.
        (if errors { 1 } else { 0 }) => (0u16..3000).prop_map(Op::Tick),
    ]
}

fn run(p: &mut Pair, ops: &[Op]) {
    for op in ops {
        match *op {
            Op::Submit(k, len, n) => {
                for _ in 0..n {
                    p.sides[k].submit(len);
                }
            }
            Op::Transmit(k, n) => {
                for _ in 0..n {
                    p.transmit(k);
                }
            }
            Op::CompleteSends(k, n) => {
                for _ in 0..n {
                    p.complete_send(k);
                }
            }
            Op::Poll(k, pattern, n) => {
                let s = &mut p.sides[k];
                let done = s.poll(pattern, usize::from(n));
                if s.flow.state() == PathState::Up {
                    s.flow.check_stall(p.now, done > 0);
                }
            }
            Op::Read(k) => {
                p.sides[k].read_one();
            }
            Op::Write(k) => {
                p.sides[k].pump_writes();
            }
            Op::QpError(k) => p.sides[k].qp.error(),
            Op::Tick(ms) => p.now += Duration::from_millis(u64::from(ms)),
        }
        p.check_safety();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Without errors, completions in any interleaving and a reader that pauses at will:
    /// every frame arrives once, whole and in order, no SEND ever finds the receiver without
    /// a buffer, and everything ends acknowledged.
    #[test]
    fn every_frame_arrives_once_in_order_and_is_acknowledged(
        ops in prop::collection::vec(op(false), 1..120),
        in_place in any::<[bool; 2]>(),
    ) {
        let mut p = Pair::new([RECV_N; 2], in_place);
        run(&mut p, &ops);
        p.drain();
        for k in 0..2 {
            let (s, r) = (&p.sides[k], &p.sides[1 - k]);
            prop_assert!(!s.dead(), "side {} down: {:?}", k, s.flow.snapshot());
            prop_assert!(s.queue.is_empty());
            prop_assert_eq!(s.flow.acked(), s.written_end());
            prop_assert_eq!(r.read.len(), s.written.len());
            prop_assert_eq!(s.qp.rnr, 0);
        }
        p.check_nothing_lost();
    }

    /// With QP errors anywhere, and a peer that may have flow control off: the peer reads a
    /// prefix of what was written, `acked()` never covers a frame the peer did not read, and
    /// every frame beyond `acked()` is on a path reported dead (so the protocol layer resends
    /// it): nothing disappears silently.
    #[test]
    fn qp_errors_lose_nothing_silently(
        ops in prop::collection::vec(op(true), 1..120),
        offers in prop::array::uniform2(prop_oneof![3 => Just(RECV_N), 1 => Just(0u32)]),
        in_place in any::<[bool; 2]>(),
    ) {
        let mut p = Pair::new(offers, in_place);
        run(&mut p, &ops);
        p.drain();
        p.check_nothing_lost();
    }
}

/// A fragment a hostile peer might send: a header with chosen fields (from small ranges, so
/// that fragments often match), then a size that is often consistent with `h_len`.
fn hostile_fragment() -> impl Strategy<Value = Vec<u8>> {
    (
        any::<[u64; 2]>(),
        prop_oneof![Just(0u32), 1u32..3 * FRAG as u32, any::<u32>()],
        any::<[u16; 2]>(),
        any::<[u8; 2]>(),
        0u8..4,
        0usize..SLOT + 1,
    )
        .prop_map(
            |([seq, ack], len, [sport, dport], [credit, fl], size, any_size)| {
                let total = match size {
                    0 => HDR,
                    1 => HDR + (len as usize).min(FRAG),
                    2 => SLOT,
                    _ => any_size,
                };
                let mut b = vec![0x5a; total.max(HDR)];
                let mut h = HeaderPacket::new_unchecked(&mut b[..HDR]);
                h.set_sequence(seq % 2);
                h.set_ack(ack);
                h.set_len(len);
                h.set_sport(sport % 2);
                h.set_dport(dport % 2);
                h.set_credit(credit);
                h.set_flags(fl);
                b.truncate(total);
                b
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Whatever a peer puts in the receive buffers, the flow does not panic, and every frame
    /// it hands up is whole: its payload length is the header's, at most 1 MiB.
    #[test]
    fn hostile_fragments_never_panic_and_never_yield_a_partial_frame(
        frags in prop::collection::vec((hostile_fragment(), any::<bool>()), 1..64),
    ) {
        let mut p = Pair::new([RECV_N; 2], [false; 2]);
        p.sides[0].submit(10);
        p.sides[0].pump_writes();
        for (bytes, read) in frags {
            let b = &mut p.sides[1];
            if let Some(slot) = b.qp.posted_recv.pop_front() {
                b.qp.recv[slot as usize][..bytes.len()].copy_from_slice(&bytes);
                b.qp.recv_cq.push_back(Completion {
                    wr_id: u64::from(slot),
                    ok: true,
                    status: 0,
                    byte_len: bytes.len() as u32,
                });
            }
            b.poll(0, usize::MAX);
            if read {
                if let Some(f) = b.flow.read(&mut b.qp) {
                    let h = FragHdr::parse(f).expect("a whole header");
                    prop_assert_eq!(f.len(), HDR + h.len as usize);
                    prop_assert!(h.len <= MAX_MSG_SIZE);
                }
            }
        }
    }
}
