//! A group's send decision allocates nothing in steady state: once the table's targets buffer
//! has grown to the group's size, deciding (delivered, blocked, filtered, DROP_WHEN_FULL) and
//! the POLLOUT queries reuse it. Memberships allocate when they are made, never per message.

use rdsd::group::{Filter, GroupAddr, GroupTable, MemberFlags, SendDecision, Sender, SenderRule};

use rdsd::quiet::allocations;

#[global_allocator]
static ALLOC: rdsd::quiet::CountingAlloc = rdsd::quiet::CountingAlloc;

const MEMBERS: u32 = 64;
const ADDR: u32 = 0x0a00_0001;

fn sender(sock: u32) -> Sender<u32> {
    Sender {
        sock,
        addr: ADDR,
        port: 1000 + sock as u16,
    }
}

/// One round of 64 sends from rotating senders with a rotating set of full members; returns
/// (delivered, blocked).
fn round(t: &mut GroupTable<u32>, group: GroupAddr, round: u32) -> (u32, u32) {
    let (mut delivered, mut blocked) = (0, 0);
    for i in 0..64 {
        let from = (round + i) % MEMBERS;
        let full = (round * 7 + i * 3) % 128; // >= MEMBERS: nobody is full
        let room = |m: u32| m != full;
        let query = t.blocked_by(group, sender(from), 64, room).unwrap();
        let _ = t.any_blocker(group, room).unwrap();
        match t.send(group, sender(from), 64, room).unwrap() {
            SendDecision::Deliver(d) => {
                assert_eq!(query, None);
                assert!(!d.targets.is_empty());
                delivered += 1;
            }
            SendDecision::Blocked { by } => {
                assert_eq!(query, Some(by));
                blocked += 1;
            }
        }
    }
    (delivered, blocked)
}

#[test]
fn steady_state_group_sends_allocate_nothing() {
    let mut t: GroupTable<u32> = GroupTable::default();
    let group = GroupAddr::new(0xef01_0203, 5000).unwrap();
    t.create(group, 0).unwrap();
    for m in 0..MEMBERS {
        // Every 4th member drops when full, every 8th hears only from sockets 0..=15, every
        // 3rd gets its own messages.
        let mut flags = MemberFlags::NONE;
        if m % 4 == 0 {
            flags = flags | MemberFlags::DROP_WHEN_FULL;
        }
        if m % 3 == 0 {
            flags = flags | MemberFlags::LOOPBACK;
        }
        let filter = if m % 8 == 1 {
            Filter::Only(vec![SenderRule::new(ADDR, 32, 1000, 1015).unwrap()].into())
        } else {
            Filter::All
        };
        t.join(group, m, flags, filter).unwrap();
    }
    for r in 0..4 {
        round(&mut t, group, r);
    }
    let before = allocations();
    let (mut delivered, mut blocked) = (0, 0);
    for r in 4..100 {
        let (d, b) = round(&mut t, group, r);
        delivered += d;
        blocked += b;
    }
    let allocated = allocations() - before;
    assert!(delivered > 1000 && blocked > 1000, "{delivered} {blocked}");
    assert!(
        t.counters.drops_full > 0 && t.counters.filtered > 0,
        "{:?}",
        t.counters
    );
    assert_eq!(allocated, 0, "allocations in steady state");
}
