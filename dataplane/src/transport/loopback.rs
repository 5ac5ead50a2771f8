//! The loopback transport: delivery to a socket bound on this host, ring to ring.

use crate::poll::{Outcome, PollCore, SockRef};
use crate::shm::region::wake_slot;
use crate::stats::Stats;
use shm_api::ring::{PushError, Record, RecordHeader};
use std::sync::atomic::Ordering;

/// Copies `rec` (on `from`'s tx ring, sent from `src`) into the rx ring of the socket bound at
/// its destination. `Blocked` leaves it on the tx ring for a later pass.
pub fn deliver(core: &mut PollCore, from: SockRef, src: (u32, u16), rec: &Record) -> Outcome {
    let dest = (rec.header.addr, rec.header.port);
    let Some(&to) = core.binds.get(&dest) else {
        // rds(7): a datagram to an unbound port is silently dropped.
        Stats::bump(&core.stats.drop_unbound_dest);
        return Outcome::Dropped;
    };
    let len = rec.header.len as usize;
    let src_ptr = {
        let app = core.apps[from.app].as_ref().expect("sender app");
        // The consumer validated payload_offset + len against the ring's data area.
        app.region
            .tx_ring(from.slot)
            .data_ptr()
            .wrapping_add(rec.payload_offset)
    };
    let header = RecordHeader::data(len as u32, src.0, src.1);
    let app = core.apps[to.app]
        .as_mut()
        .expect("bound sockets belong to live apps");
    let sock = app.socks[to.slot as usize]
        .as_mut()
        .expect("bound sockets are open");
    let pushed = sock.rx.push_with(header, |mem, off| {
        // SAFETY: `src_ptr..+len` lies in the sender's tx ring data area (validated by the
        // ring consumer) and `off..+len` in the receiver's rx ring data area (reserved by the
        // producer). The two rings never overlap, even for a socket sending to itself.
        unsafe { std::ptr::copy_nonoverlapping(src_ptr, mem.data_ptr().add(off), len) }
    });
    match pushed {
        Ok(()) => {
            sock.rx.publish();
            sock.rx_produced += len as u64;
            let produced = sock.rx_produced;
            let ctl = app.region.slot_control(to.slot);
            ctl.rx_produced_bytes.store(produced, Ordering::Release);
            wake_slot(ctl);
            Stats::bump(&core.stats.loop_delivered);
            core.stats
                .loop_bytes
                .fetch_add(len as u64, Ordering::Relaxed);
            core.after_enqueue(to);
            Outcome::Delivered
        }
        Err(PushError::Full) => Outcome::Blocked,
        Err(PushError::TooLarge) => {
            Stats::bump(&core.stats.drop_no_route);
            Outcome::Dropped
        }
    }
}
