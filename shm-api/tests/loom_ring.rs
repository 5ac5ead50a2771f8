//! Model checks of the SPSC record ring (`shm_api::ring`) under loom.
//!
//! Run with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/work/target-loom \
//!     cargo test -p shm-api --test loom_ring --release
//! ```
//!
//! Every data byte of the ring is its own `loom::cell::UnsafeCell<u8>`, so loom reports any
//! payload or header byte that is read and written without a happens-before edge between the
//! two (i.e. any hole in the publish/release protocol), and every counter is a loom atomic, so
//! every interleaving (and every weak-memory outcome loom models) of the counter accesses is
//! explored up to the preemption bound.
#![cfg(loom)]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering as StdOrdering};

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

use shm_api::ring::{
    record_size, Consumer, Producer, PushError, RecordHeader, RingCorrupt, RingMemory, KIND_DATA,
    RECORD_HEADER_LEN,
};

/// Data-area size of every modelled ring: room for four minimal records, so wraps, pads and
/// `Full` come after a handful of operations.
const CAP: usize = 64;

struct Inner {
    producer: AtomicU64,
    consumer: AtomicU64,
    data: Vec<UnsafeCell<u8>>,
}

/// Ring memory shared by the modelled "processes" (threads).
#[derive(Clone)]
struct LoomMemory(Arc<Inner>);

impl LoomMemory {
    fn new() -> Self {
        LoomMemory(Arc::new(Inner {
            producer: AtomicU64::new(0),
            consumer: AtomicU64::new(0),
            data: (0..CAP).map(|_| UnsafeCell::new(0)).collect(),
        }))
    }
}

impl RingMemory for LoomMemory {
    fn producer(&self) -> &AtomicU64 {
        &self.0.producer
    }
    fn consumer(&self) -> &AtomicU64 {
        &self.0.consumer
    }
    fn capacity(&self) -> usize {
        CAP
    }
    fn write(&self, off: usize, src: &[u8]) {
        assert!(
            off <= CAP && src.len() <= CAP - off,
            "ring wrote out of bounds: {off}+{}",
            src.len()
        );
        for (cell, &b) in self.0.data[off..off + src.len()].iter().zip(src) {
            // SAFETY: loom tracks this access and fails the model on a concurrent one.
            cell.with_mut(|p| unsafe { *p = b });
        }
    }
    fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off <= CAP && dst.len() <= CAP - off,
            "ring read out of bounds: {off}+{}",
            dst.len()
        );
        for (cell, b) in self.0.data[off..off + dst.len()].iter().zip(dst) {
            // SAFETY: loom tracks this access and fails the model on a concurrent write.
            *b = cell.with(|p| unsafe { *p });
        }
    }
}

/// A record as the oracle and the consumer see it.
type Rec = (RecordHeader, Vec<u8>);

/// Record `i` of a test sequence: payload bytes unique to (i, position) so a torn or stale
/// record can't compare equal.
fn rec(i: u32, len: usize) -> Rec {
    let payload: Vec<u8> = (0..len)
        .map(|j| (i as u8).wrapping_mul(37).wrapping_add(j as u8 + 1))
        .collect();
    let mut h = RecordHeader::data(len as u32, 0x0a00_0000 + i, 1000 + i as u16);
    h.flags = i as u16;
    h.aux = 0;
    (h, payload)
}

/// One `peek`: `Ok(Some)` with the record copied out and consumed (not released).
fn pop(c: &mut Consumer<LoomMemory>) -> Result<Option<Rec>, RingCorrupt> {
    let Some(r) = c.peek()? else { return Ok(None) };
    assert_eq!(r.header.kind, KIND_DATA, "peek never returns a pad");
    let mut v = vec![0u8; r.header.len as usize];
    assert_eq!(c.read_payload(&r, &mut v), v.len());
    c.consume(&r);
    Ok(Some((r.header, v)))
}

/// Pushes `r`, retrying (with a loom yield, so the spin is finite in the model) while full.
/// Gives up after `tries` Full answers; returns whether it was pushed.
fn push_retry(
    p: &mut Producer<LoomMemory>,
    r: &Rec,
    tries: usize,
    saw_full: &StdAtomicBool,
) -> bool {
    for _ in 0..tries {
        match p.push(r.0, &r.1) {
            Ok(()) => return true,
            Err(PushError::Full) => {
                saw_full.store(true, StdOrdering::Relaxed);
                thread::yield_now();
            }
            Err(PushError::TooLarge) => panic!("record of {} bytes reported too large", r.1.len()),
        }
    }
    false
}

/// Drains `c` completely (single-threaded, after all writers are gone).
fn drain(c: &mut Consumer<LoomMemory>) -> Vec<Rec> {
    let mut out = Vec::new();
    while let Some(r) = pop(c).expect("ring is valid") {
        out.push(r);
        c.release();
    }
    assert!(c.is_empty().expect("ring is valid"));
    out
}

/// Explores `f` under loom with at most `preemption_bound` preemptions per execution (`None`:
/// every interleaving; `LOOM_MAX_PREEMPTIONS` overrides either) and prints how many executions
/// that took.
fn check<F>(name: &str, preemption_bound: Option<usize>, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = preemption_bound;
    }
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = runs.clone();
    b.check(move || {
        counter.fetch_add(1, StdOrdering::Relaxed);
        f()
    });
    eprintln!(
        "{name}: {} executions (preemption bound {:?})",
        runs.load(StdOrdering::Relaxed),
        b.preemption_bound
    );
}

/// (a) Concurrent producer and consumer: varied lengths, batched publishes, a lap wrap with a
/// PAD record and (in the interleavings where the consumer lags) `Full`. Every record popped
/// equals the oracle's front; after the producer finishes and the consumer drains, nothing is
/// lost or duplicated. Loom checks every payload byte for data races.
#[test]
fn spsc_stream_matches_oracle() {
    static SAW_FULL: StdAtomicBool = StdAtomicBool::new(false);

    // Layout on the 64-byte ring: r0 32 B @0, r1 16 B @32 (batch 1); r2 48 B doesn't fit in
    // the 16 bytes before the wrap, so a PAD fills [48, 64) and r2 takes [64, 112) (offsets
    // 0..48 of lap 2), which is `Full` until the consumer releases r0 and r1; r3 16 B at
    // [112, 128) (batch 2). Both ends finish at 128. (`full_publishes_the_pad` covers a record
    // that also needs the pad's space.)
    let records = vec![rec(0, 5), rec(1, 0), rec(2, 20), rec(3, 0)];
    assert_eq!(
        records
            .iter()
            .map(|r| record_size(r.1.len()))
            .collect::<Vec<_>>(),
        [32, 16, 48, 16]
    );

    check("spsc_stream_matches_oracle", Some(3), move || {
        let mem = LoomMemory::new();
        let mut producer = Producer::new(mem.clone());
        let mut consumer = Consumer::new(mem.clone());
        let sent = records.clone();

        let p = thread::spawn(move || {
            // A record that can never fit is refused without touching the ring.
            assert_eq!(
                producer.push(RecordHeader::data(0, 0, 0), &[0; CAP]),
                Err(PushError::TooLarge)
            );
            assert!(push_retry(&mut producer, &sent[0], 1, &SAW_FULL));
            assert!(push_retry(&mut producer, &sent[1], 1, &SAW_FULL));
            producer.publish();
            // r2: wraps (PAD) and is Full until the consumer releases r0 and r1.
            assert!(push_retry(&mut producer, &sent[2], usize::MAX, &SAW_FULL));
            assert!(push_retry(&mut producer, &sent[3], usize::MAX, &SAW_FULL));
            producer.publish();
            producer
        });

        let mut oracle: VecDeque<Rec> = records.iter().cloned().collect();
        let mut got = 0;
        while got < records.len() {
            match pop(&mut consumer).expect("an honest producer never corrupts the ring") {
                Some(r) => {
                    assert_eq!(
                        Some(r),
                        oracle.pop_front(),
                        "record {got} out of order or torn"
                    );
                    got += 1;
                    // Release in batches of two (and whenever we would wait).
                    if got % 2 == 0 {
                        consumer.release();
                    }
                }
                None => {
                    consumer.release();
                    thread::yield_now();
                }
            }
        }
        consumer.release();
        let mut producer = p.join().unwrap();

        assert!(oracle.is_empty());
        assert!(drain(&mut consumer).is_empty(), "duplicated records");
        assert!(producer.is_drained());
        assert_eq!(producer.free_bytes(), CAP);
        // Both ends went through the PAD into the second lap.
        assert_eq!(mem.producer().load(Ordering::Relaxed), 128);
        assert_eq!(mem.consumer().load(Ordering::Relaxed), 128);
    });

    assert!(
        SAW_FULL.load(StdOrdering::Relaxed),
        "model never exercised Full"
    );
}

/// (a2) `Full` publishes: r0 48 B @0 is pushed but not explicitly published; then r1, a
/// whole-ring record (64 B), needs a PAD at [48, 64) and all of lap 2, so it answers `Full`.
/// As `push_with` promises, that answer publishes r0 and the pad, and the producer just waits
/// for space (without pushing again) until the consumer has released r0 *and skipped the pad*.
/// Without that publish both sides would wait forever (loom reports the livelock).
#[test]
fn full_publishes_the_pad() {
    static SAW_FULL: StdAtomicBool = StdAtomicBool::new(false);
    let records = vec![rec(0, 32), rec(1, 48)];
    assert_eq!(
        records
            .iter()
            .map(|r| record_size(r.1.len()))
            .sum::<usize>(),
        48 + CAP
    );

    check("full_publishes_the_pad", None, move || {
        let mem = LoomMemory::new();
        let mut producer = Producer::new(mem.clone());
        let mut consumer = Consumer::new(mem.clone());
        let sent = records.clone();
        let p = thread::spawn(move || {
            producer.push(sent[0].0, &sent[0].1).unwrap();
            // Nothing is published yet, so the consumer can't have freed anything: always Full.
            assert_eq!(producer.push(sent[1].0, &sent[1].1), Err(PushError::Full));
            SAW_FULL.store(true, StdOrdering::Relaxed);
            while producer.free_bytes() < CAP {
                thread::yield_now();
            }
            producer.push(sent[1].0, &sent[1].1).unwrap();
            producer.publish();
        });
        let mut oracle: VecDeque<Rec> = records.iter().cloned().collect();
        while !oracle.is_empty() {
            match pop(&mut consumer).expect("valid") {
                Some(r) => {
                    assert_eq!(Some(r), oracle.pop_front());
                    consumer.release();
                }
                None => thread::yield_now(),
            }
        }
        p.join().unwrap();
        assert!(drain(&mut consumer).is_empty());
        assert_eq!(mem.consumer().load(Ordering::Relaxed), 48 + 16 + 64);
    });
    assert!(
        SAW_FULL.load(StdOrdering::Relaxed),
        "model never exercised Full"
    );
}

/// (b1) The producer is killed mid-operation: it has written (part of) a record but never
/// published it. The consumer, running concurrently, must never see that record or a torn
/// one. A restarted producer (`Producer::new` on the same memory) continues from the published
/// position, overwriting the dead bytes, and the consumer sees exactly the published records.
#[test]
fn producer_killed_before_publish() {
    let r0 = rec(0, 7);
    let dead = rec(1, 10); // 32 B at [32, 64): no wrap, so pushing it never answers Full
    let r2 = rec(2, 3);

    check("producer_killed_before_publish", None, move || {
        let mem = LoomMemory::new();
        let mut consumer = Consumer::new(mem.clone());
        let (r0c, deadc, r2c) = (r0.clone(), dead.clone(), r2.clone());
        let pmem = mem.clone();

        let p = thread::spawn(move || {
            let mut first = Producer::new(pmem.clone());
            first.push(r0c.0, &r0c.1).unwrap();
            first.publish();
            // Killed while copying the payload: header and half the payload are on the ring,
            // nothing is published.
            first
                .push_with(deadc.0, |m, off| {
                    m.write(off, &deadc.1[..deadc.1.len() / 2])
                })
                .unwrap();
            drop(first); // SIGKILL: no publish, no destructor protocol.

            // The restarted producer attaches to the same memory.
            let mut second = Producer::new(pmem);
            second.push(r2c.0, &r2c.1).unwrap();
            second.publish();
        });

        // Concurrently: whatever the consumer sees is r0 then r2, never the dead record.
        let mut seen = Vec::new();
        for _ in 0..3 {
            match pop(&mut consumer).expect("valid") {
                Some(r) => {
                    assert_ne!(r.0, dead.0, "consumer observed an unpublished record");
                    seen.push(r);
                    consumer.release();
                }
                None => thread::yield_now(),
            }
        }
        p.join().unwrap();
        seen.extend(drain(&mut consumer));
        assert_eq!(seen, vec![r0.clone(), r2.clone()]);
    });
}

/// (b2) The consumer is killed after consuming records but before releasing them. The
/// producer keeps pushing concurrently and must never overwrite the unreleased bytes (loom
/// flags any overlap with the dead consumer's reads as a race; the oracle checks contents): a
/// restarted consumer (`Consumer::new`) reads exactly the unreleased records, intact, followed
/// by everything pushed since, in order.
#[test]
fn consumer_killed_before_release() {
    // r0, r1: 32 B each, filling the 64-byte ring. r2..r4: 16 B each; only as many fit as the
    // dead consumer released.
    let records: Vec<Rec> = vec![rec(0, 10), rec(1, 12), rec(2, 0), rec(3, 0), rec(4, 0)];
    static FULL_SEEN: StdAtomicBool = StdAtomicBool::new(false);

    check("consumer_killed_before_release", None, move || {
        let mem = LoomMemory::new();
        let mut producer = Producer::new(mem.clone());
        let mut consumer = Consumer::new(mem.clone());
        let sent = records.clone();

        let p = thread::spawn(move || {
            let mut pushed = Vec::new();
            for (i, r) in sent.iter().enumerate() {
                // Two tries each: the dead consumer may never free enough space.
                if !push_retry(&mut producer, r, 2, &FULL_SEEN) {
                    break; // keep the sequence in order
                }
                pushed.push(r.clone());
                if i == 1 {
                    producer.publish();
                }
            }
            producer.publish();
            pushed
        });

        // The first consumer pops up to two records; it releases the first and dies right after
        // consuming the second.
        let expected = records.clone();
        let c = thread::spawn(move || {
            let mut popped = 0usize;
            let mut released = 0usize;
            for _ in 0..4 {
                if popped == 2 {
                    break;
                }
                match pop(&mut consumer).expect("valid") {
                    Some(r) => {
                        assert_eq!(r, expected[popped]);
                        popped += 1;
                        if popped == 1 {
                            consumer.release();
                            released = 1;
                        }
                    }
                    None => thread::yield_now(),
                }
            }
            drop(consumer); // SIGKILL: the consumed second record is never released.
            released
        });

        let pushed = p.join().unwrap();
        let released = c.join().unwrap();
        // Records pushed are a prefix of the sequence; the first two always fit.
        assert!(pushed.len() >= 2);
        assert_eq!(pushed[..], records[..pushed.len()]);
        // The producer can only have reused space the dead consumer released.
        let pushed_bytes: usize = pushed.iter().map(|r| record_size(r.1.len())).sum();
        let released_bytes: usize = records[..released]
            .iter()
            .map(|r| record_size(r.1.len()))
            .sum();
        assert!(pushed_bytes <= CAP + released_bytes);

        // Restarted consumer: exactly the unreleased records, intact, then the rest.
        let mut restarted = Consumer::new(mem.clone());
        assert_eq!(drain(&mut restarted), pushed[released..]);
    });
    assert!(
        FULL_SEEN.load(StdOrdering::Relaxed),
        "model never filled the ring"
    );
}

/// (c1) A hostile producer stores nonsense producer positions while the consumer reads: the
/// consumer only ever returns valid records (a prefix of what was really written) or
/// `RingCorrupt`, and never panics or indexes out of bounds.
#[test]
fn hostile_producer_counter() {
    let records = vec![rec(0, 5), rec(1, 0)];

    check("hostile_producer_counter", None, move || {
        let mem = LoomMemory::new();
        // Honest records written and published before the producer turns hostile.
        let mut producer = Producer::new(mem.clone());
        for r in &records {
            producer.push(r.0, &r.1).unwrap();
        }
        producer.publish(); // head = 48
        let mut consumer = Consumer::new(mem.clone());

        let hostile = mem.clone();
        let h = thread::spawn(move || {
            // Mid-record (r0 is 32 B long), "behind the consumer" near the top of the u64
            // space, a lap of never-written bytes, and far beyond the capacity.
            for bad in [16u64, u64::MAX - 15, 64, 8, 1 << 40] {
                hostile.producer().store(bad, Ordering::Release);
            }
        });

        let mut oracle: VecDeque<Rec> = records.iter().cloned().collect();
        for _ in 0..4 {
            match pop(&mut consumer) {
                Ok(Some(r)) => {
                    assert_eq!(
                        Some(r),
                        oracle.pop_front(),
                        "consumer returned invented data"
                    );
                    consumer.release();
                }
                Ok(None) => thread::yield_now(),
                Err(RingCorrupt(_)) => break,
            }
        }
        h.join().unwrap();
    });
}

/// (c1b) A hostile producer publishes a record's header before writing its payload. The
/// consumer must not trust the header's length beyond the published position: it answers
/// `RingCorrupt` (or nothing yet) and never reads the payload bytes still being written (loom
/// would flag that read as a data race with the producer's writes).
#[test]
fn hostile_producer_publishes_header_before_payload() {
    let r = rec(7, 16); // 32 B: header [0, 16), payload [16, 32)
    check(
        "hostile_producer_publishes_header_before_payload",
        None,
        move || {
            let mem = LoomMemory::new();
            let mut consumer = Consumer::new(mem.clone());
            let hostile = mem.clone();
            let (h, payload) = r.clone();
            let t = thread::spawn(move || {
                // Write just the header via a real producer, publish a position that covers only
                // the header, then write the payload.
                let mut p = Producer::new(hostile.clone());
                p.push_with(h, |_, _| {}).unwrap();
                hostile
                    .producer()
                    .store(RECORD_HEADER_LEN as u64, Ordering::Release);
                hostile.write(RECORD_HEADER_LEN, &payload);
            });
            for _ in 0..2 {
                match pop(&mut consumer) {
                    Ok(Some(r)) => panic!("consumer trusted a record longer than published: {r:?}"),
                    Ok(None) => thread::yield_now(),
                    Err(RingCorrupt(_)) => break,
                }
            }
            t.join().unwrap();
        },
    );
}

/// (c2) A hostile peer scribbles the *consumer* counter (misaligned) and the producer counter
/// while a consumer attaches with `Consumer::new`. Whatever positions the consumer attaches to,
/// it must answer `RingCorrupt` or valid data, never read a header across the end of the data
/// area.
#[test]
fn hostile_peer_scribbles_consumer_counter_at_attach() {
    check(
        "hostile_peer_scribbles_consumer_counter_at_attach",
        None,
        move || {
            let mem = LoomMemory::new();
            let hostile = mem.clone();
            let h = thread::spawn(move || {
                // tail 56 leaves only 8 bytes before the wrap; head 72 claims one aligned record.
                hostile.consumer().store(56, Ordering::Release);
                hostile.producer().store(72, Ordering::Release);
            });

            let mut consumer = Consumer::new(mem.clone());
            for _ in 0..3 {
                match pop(&mut consumer) {
                    // Only zero bytes were ever written: nothing valid can be read.
                    Ok(Some(r)) => panic!("consumer invented a record: {r:?}"),
                    Ok(None) => thread::yield_now(),
                    Err(RingCorrupt(_)) => break,
                }
            }
            h.join().unwrap();
        },
    );
}

/// (c3) A hostile consumer scribbles both counters while a producer attaches with
/// `Producer::new` and pushes: the producer must answer `Ok` or `Full` and never write a
/// record or pad across the end of the data area (or overflow).
#[test]
fn hostile_peer_scribbles_counters_at_producer_attach() {
    check(
        "hostile_peer_scribbles_counters_at_producer_attach",
        None,
        move || {
            let mem = LoomMemory::new();
            let hostile = mem.clone();
            let h = thread::spawn(move || {
                // A misaligned producer position, then a consumer position "ahead" of it.
                hostile.producer().store(8, Ordering::Release);
                hostile.consumer().store(u64::MAX - 15, Ordering::Release);
            });

            let mut producer = Producer::new(mem.clone());
            for len in [20usize, 0, 9] {
                match producer.push(RecordHeader::data(0, 0, 0), &vec![0xa5; len]) {
                    Ok(()) | Err(PushError::Full) => {}
                    Err(e) => panic!("{e:?}"),
                }
            }
            producer.publish();
            let _ = producer.free_bytes();
            let _ = producer.is_drained();
            h.join().unwrap();
            // (Out-of-bounds writes fail `LoomMemory::write`'s assert; run with
            // `-C overflow-checks=on` to also catch position arithmetic overflow.)
        },
    );
}

/// The words of `shm_api::gate` for two member slots (two gates each) and the daemon region.
struct GateWords {
    gates: [[shm_api::gate::Gate; 2]; 2],
    commit: AtomicU64,
}

/// (h) The commit point of a group fan-out (`shm_api::gate`): the writer (rdsd) pushes fan-out
/// g's copy into two members' rings, gates it in each slot's next gate and publishes each
/// ring; fan-outs 1 and 2 are both uncommitted before they commit, in order (a window of two,
/// as when the first waits for copies on another poll thread). Member 0 reads what
/// `gate::pending` lets it, at every interleaving. Whenever it reads copy g, fan-out g is
/// committed and member 1's copy of g is published: stopping the writer at any point (rdsd
/// dying) never leaves a message read by one member that another cannot read. And a copy
/// seen committed stays so (member 0 never skips one).
#[test]
fn group_gate_reads_only_committed_copies() {
    check("group_gate_reads_only_committed_copies", Some(3), || {
        use shm_api::gate::{commit, gate, pending, Gate};
        let rings = [LoomMemory::new(), LoomMemory::new()];
        let w = Arc::new(GateWords {
            gates: [
                [Gate::default(), Gate::default()],
                [Gate::default(), Gate::default()],
            ],
            commit: AtomicU64::new(0),
        });
        let writer = {
            let (w, rings) = (w.clone(), rings.clone());
            thread::spawn(move || {
                let mut p = rings.map(Producer::new);
                for g in 1..=2u32 {
                    for (m, p) in p.iter_mut().enumerate() {
                        let (h, payload) = rec(g, 8);
                        p.push(h, &payload).expect("room for two copies");
                        let next = &w.gates[m][g as usize - 1];
                        gate(next, p.position(), u64::from(g));
                    }
                    for p in p.iter_mut() {
                        p.publish();
                    }
                }
                commit(&w.commit, 1);
                commit(&w.commit, 2);
            })
        };
        let mut c = Consumer::new(rings[0].clone());
        let mut next = 1u64;
        for _ in 0..3 {
            if let Some(r) = c.peek().expect("valid ring") {
                if !pending(&w.gates[0], &w.commit, r.end()) {
                    let g = u64::from(r.header.port - 1000);
                    assert_eq!(g, next, "copies are read in order, none skipped");
                    assert!(
                        w.commit.load(Ordering::Acquire) >= g,
                        "copy {g} read before its fan-out was committed"
                    );
                    assert!(
                        rings[1].producer().load(Ordering::Acquire) >= g * record_size(8) as u64,
                        "copy {g} read while member 1's copy was not published"
                    );
                    c.consume(&r);
                    c.release();
                    next += 1;
                }
            }
            thread::yield_now();
        }
        writer.join().unwrap();
    });
}
