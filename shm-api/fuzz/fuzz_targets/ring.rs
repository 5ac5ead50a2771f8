//! Both ends of a ring as rdsd runs them, against a peer that writes any byte of the ring:
//! the consumer (rdsd drains an app's tx ring) and the producer (rdsd fills an app's rx ring).
//! Never a panic or an access outside the data area (RawRing asserts every copy), every record
//! handed out lies inside the data area and inside what was published, and the consumer's
//! work per call is bounded; so is the producer's listing of unread records.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shm_api::ring::{
    record_size, Consumer, HeapRing, Producer, RecordHeader, RingMemory, RECORD_HEADER_LEN,
};
use std::sync::atomic::Ordering;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, mut script)) = data.split_first() else {
        return;
    };
    let cap = 64usize << (shape % 7); // 64 B .. 4 KiB
    let heap = HeapRing::new(cap);
    let ring = heap.ring();
    // The peer may have left any positions behind before either end attaches.
    if shape & 0x80 != 0 {
        ring.producer()
            .store(u64::from(shape) * 16, Ordering::Relaxed);
        ring.consumer()
            .store(u64::from(shape & 0x78), Ordering::Relaxed);
    }
    let mut producer = Producer::new(ring);
    let mut consumer = Consumer::new(ring);
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, rest) = script.split_at_checked(n)?;
        script = rest;
        Some(head)
    };
    while let Some(op) = take(1).map(|b| b[0]) {
        match op % 6 {
            // The honest producer pushes (and sometimes publishes) a record.
            0 => {
                let Some(b) = take(2) else { break };
                let len = usize::from(u16::from_le_bytes([b[0], b[1]])) % (cap + 32);
                let _ = producer.push(RecordHeader::data(len as u32, 7, 9), &vec![0xa5; len]);
                if op & 0x80 != 0 {
                    producer.publish();
                }
                let free = producer.free_bytes();
                assert!(free <= cap);
            }
            // The peer scribbles on the data area.
            1 => {
                let Some(b) = take(18) else { break };
                let off = usize::from(u16::from_le_bytes([b[0], b[1]])) % cap;
                let n = 16.min(cap - off);
                ring.write(off, &b[2..2 + n]);
            }
            // The peer moves a position: anywhere, or near where it is.
            2 => {
                let Some(b) = take(8) else { break };
                let v = u64::from_le_bytes(b.try_into().expect("8"));
                let counter = if op & 0x40 != 0 {
                    ring.producer()
                } else {
                    ring.consumer()
                };
                let v = if op & 0x80 != 0 {
                    counter.load(Ordering::Relaxed).wrapping_add(v % 64 * 16)
                } else {
                    v
                };
                counter.store(v, Ordering::Release);
            }
            // The consumer drains what it is shown, validating everything.
            3 => {
                let mut n = 0;
                loop {
                    let start = consumer.position();
                    match consumer.peek() {
                        Ok(Some(rec)) => {
                            let len = rec.header.len as usize;
                            assert!(rec.payload_offset >= RECORD_HEADER_LEN);
                            assert!(rec.payload_offset + len <= cap, "payload inside the ring");
                            let step = rec.end().wrapping_sub(consumer.position());
                            assert_eq!(step, record_size(len) as u64);
                            assert!(
                                rec.end().wrapping_sub(start)
                                    <= consumer.published().wrapping_sub(start),
                                "inside what was published"
                            );
                            let mut buf = [0u8; 32];
                            assert_eq!(consumer.read_payload(&rec, &mut buf), len.min(32));
                            consumer.consume(&rec);
                        }
                        Ok(None) | Err(_) => break,
                    }
                    n += 1;
                    // What was cached before (at most a capacity) plus one fresh look (at most
                    // another): nobody publishes during the drain.
                    assert!(n <= 2 * cap / RECORD_HEADER_LEN, "bounded work per drain");
                }
                if op & 0x80 != 0 {
                    consumer.release();
                }
            }
            // Held space (zero copy) and release.
            4 => {
                let pos = consumer.position();
                consumer.hold_from(if op & 0x80 != 0 { Some(pos) } else { None });
                consumer.release();
            }
            _ => {
                let _ = consumer.is_empty();
                let _ = producer.is_drained();
                // The listing of unread records (RDS_INFO_RECV_MESSAGES) and POLLOUT's room,
                // on whatever the peer left: bounded, in range.
                let mut n = 0;
                producer.unconsumed(usize::MAX, |h| {
                    assert!(record_size(h.len as usize) <= cap, "a listed record fits");
                    n += 1;
                });
                assert!(n <= cap / RECORD_HEADER_LEN, "bounded listing");
                assert!(consumer.producer_free() <= cap);
                let len = usize::from(op);
                assert!(producer.room_needed(len) <= cap + record_size(len));
            }
        }
    }
});
