//! One test per rule of the group table; sockets are plain numbers, bound at 10.0.0.1:1000+n.

use super::*;
use std::collections::HashSet;

const BASE: u32 = 0x0a00_0001;

fn g(n: u8) -> GroupAddr {
    GroupAddr::new(u32::from(Ipv4Addr::new(239, 1, 2, n)), 5000).unwrap()
}

fn s(sock: u32) -> Sender<u32> {
    Sender {
        sock,
        addr: BASE,
        port: 1000 + sock as u16,
    }
}

fn table() -> GroupTable<u32> {
    GroupTable::default()
}

/// Everyone has room.
fn roomy(_: u32) -> bool {
    true
}

/// Targets, or the blocker, of one send (owned, so the table can be used again).
fn send(t: &mut GroupTable<u32>, grp: GroupAddr, from: u32, full: &[u32]) -> Result<Vec<u32>, u32> {
    match t.send(grp, s(from), 64, |m| !full.contains(&m)).unwrap() {
        SendDecision::Deliver(d) => Ok(d.targets.to_vec()),
        SendDecision::Blocked { by } => Err(by),
    }
}

fn join(t: &mut GroupTable<u32>, grp: GroupAddr, sock: u32, flags: MemberFlags) {
    t.join(grp, sock, flags, Filter::All).unwrap();
}

#[test]
fn a_group_address_is_multicast_with_a_port() {
    assert!(GroupAddr::new(u32::from(Ipv4Addr::new(224, 0, 0, 1)), 1).is_ok());
    assert!(GroupAddr::new(u32::from(Ipv4Addr::new(239, 255, 255, 255)), 65535).is_ok());
    for bad in [
        (Ipv4Addr::new(10, 0, 0, 1), 5000),
        (Ipv4Addr::new(240, 0, 0, 1), 5000),
        (Ipv4Addr::new(223, 255, 255, 255), 5000),
        (Ipv4Addr::new(239, 1, 1, 1), 0),
    ] {
        let e = GroupAddr::new(u32::from(bad.0), bad.1).unwrap_err();
        assert_eq!(e, GroupError::NotMulticast);
        assert_eq!(e.errno(), libc::EINVAL);
    }
    assert!(GroupAddr::is_group_addr(g(1).addr()));
    assert!(!GroupAddr::is_group_addr(BASE));
}

#[test]
fn errnos_follow_their_unicast_and_ip_multicast_analogues() {
    let mut t = table();
    assert_eq!(
        t.join(g(1), 1, MemberFlags::NONE, Filter::All),
        Err(GroupError::NoSuchGroup)
    );
    assert_eq!(GroupError::NoSuchGroup.errno(), libc::ENOENT);
    t.create(g(1), 1).unwrap();
    assert_eq!(t.create(g(1), 2), Err(GroupError::GroupExists));
    assert_eq!(GroupError::GroupExists.errno(), libc::EADDRINUSE);
    join(&mut t, g(1), 2, MemberFlags::NONE);
    assert_eq!(
        t.join(g(1), 2, MemberFlags::LOOPBACK, Filter::All),
        Err(GroupError::AlreadyMember)
    );
    assert_eq!(GroupError::AlreadyMember.errno(), libc::EADDRINUSE);
    assert_eq!(
        t.leave(g(1), 1),
        Err(GroupError::NotMember),
        "the creator never joined"
    );
    assert_eq!(GroupError::NotMember.errno(), libc::EADDRNOTAVAIL);
    assert_eq!(t.leave(g(2), 1), Err(GroupError::NoSuchGroup));
    assert_eq!(MemberFlags::from_bits(4), Err(GroupError::BadFlags));
    assert_eq!(GroupError::BadFlags.errno(), libc::EINVAL);
    assert_eq!(
        MemberFlags::from_bits(3),
        Ok(MemberFlags::LOOPBACK | MemberFlags::DROP_WHEN_FULL)
    );
    assert_eq!(
        t.send(g(2), s(1), 1, roomy).unwrap_err(),
        GroupError::NoSuchGroup
    );
    t.check_invariants();
}

#[test]
fn limits_give_enobufs() {
    let mut t = GroupTable::new(GroupLimits {
        max_groups: 2,
        max_members: 2,
    });
    t.create(g(1), 1).unwrap();
    t.create(g(2), 1).unwrap();
    assert_eq!(t.create(g(3), 1), Err(GroupError::TooManyGroups));
    join(&mut t, g(1), 1, MemberFlags::NONE);
    join(&mut t, g(1), 2, MemberFlags::NONE);
    assert_eq!(
        t.join(g(1), 3, MemberFlags::NONE, Filter::All),
        Err(GroupError::TooManyMembers)
    );
    assert_eq!(GroupError::TooManyMembers.errno(), libc::ENOBUFS);
    t.leave(g(1), 2).unwrap();
    join(&mut t, g(1), 3, MemberFlags::NONE);
}

#[test]
fn a_group_lives_while_its_creator_is_open_or_it_has_members() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    join(&mut t, g(1), 2, MemberFlags::NONE);
    t.leave(g(1), 2).unwrap();
    assert!(t.exists(g(1)), "the creator's socket is still open");
    join(&mut t, g(1), 3, MemberFlags::NONE);
    assert_eq!(t.close_socket(1), 1);
    assert!(t.exists(g(1)), "a member is left");
    assert_eq!(t.group(g(1)).unwrap().creator, None);
    t.leave(g(1), 3).unwrap();
    assert!(!t.exists(g(1)), "no creator, no member");
    assert!(t.is_empty());
    t.check_invariants();

    // Created again: a new epoch, numbered from 1 again.
    t.create(g(1), 2).unwrap();
    join(&mut t, g(1), 2, MemberFlags::LOOPBACK);
    let SendDecision::Deliver(d) = t.send(g(1), s(2), 8, roomy).unwrap() else {
        panic!("blocked")
    };
    assert_eq!((d.epoch, d.seq), (2, 1));
}

#[test]
fn closing_a_socket_leaves_all_its_groups() {
    let mut t = table();
    for n in 1..=3 {
        t.create(g(n), 9).unwrap();
        join(&mut t, g(n), 1, MemberFlags::NONE);
        join(&mut t, g(n), 2, MemberFlags::NONE);
    }
    assert_eq!(t.groups_of(1).len(), 3);
    assert_eq!(t.close_socket(1), 3);
    assert_eq!(t.close_socket(1), 0);
    assert!(t.groups_of(1).is_empty());
    for n in 1..=3 {
        assert_eq!(send(&mut t, g(n), 9, &[]), Ok(vec![2]));
    }
    assert_eq!(t.close_socket(9), 3, "creator of three");
    assert_eq!(t.len(), 3, "2 is still a member of each");
    t.close_socket(2);
    assert!(t.is_empty());
    t.check_invariants();
}

#[test]
fn an_apps_death_closes_its_sockets() {
    // Sockets 10..19 are app 1's, 20..29 app 2's.
    let mut t = table();
    t.create(g(1), 10).unwrap();
    join(&mut t, g(1), 11, MemberFlags::NONE);
    join(&mut t, g(1), 21, MemberFlags::NONE);
    t.create(g(2), 12).unwrap();
    assert_eq!(t.app_died(|s| s / 10 == 1), 3);
    assert!(!t.exists(g(2)));
    assert_eq!(t.group(g(1)).unwrap().members.len(), 1);
    assert_eq!(send(&mut t, g(1), 30, &[]), Ok(vec![21]));
    t.check_invariants();
}

#[test]
fn the_sender_gets_its_own_message_only_with_loopback() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    join(&mut t, g(1), 1, MemberFlags::NONE);
    join(&mut t, g(1), 2, MemberFlags::LOOPBACK);
    assert_eq!(send(&mut t, g(1), 1, &[]), Ok(vec![2]));
    assert_eq!(send(&mut t, g(1), 2, &[]), Ok(vec![1, 2]));
    // A non-member may send too; nobody is "the sender" among the members then.
    assert_eq!(send(&mut t, g(1), 7, &[]), Ok(vec![1, 2]));
    // The sender's own full buffer does not block it when it does not receive its messages.
    assert_eq!(send(&mut t, g(1), 1, &[1]), Ok(vec![2]));
    assert_eq!(send(&mut t, g(1), 2, &[2]), Err(2));
}

#[test]
fn a_full_member_blocks_the_group_and_nobody_gets_the_message() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    for m in 2..=5 {
        join(&mut t, g(1), m, MemberFlags::NONE);
    }
    let mut asked = Vec::new();
    let d = t
        .send(g(1), s(1), 64, |m| {
            asked.push(m);
            m != 4
        })
        .unwrap();
    assert_eq!(d, SendDecision::Blocked { by: 4 });
    assert_eq!(asked, [2, 3, 4], "stops at the first blocker");
    assert_eq!(t.counters, GroupCounters::default(), "nothing counted");
    assert_eq!(t.group(g(1)).unwrap().last_seq, 0, "nothing numbered");
    assert_eq!(t.blocked_by(g(1), s(1), 64, |m| m != 4), Ok(Some(4)));
    assert_eq!(t.any_blocker(g(1), |m| m != 4), Ok(Some(4)));
    // Drained: it goes to all, numbered 1.
    let SendDecision::Deliver(d) = t.send(g(1), s(1), 64, roomy).unwrap() else {
        panic!("blocked")
    };
    assert_eq!(
        (d.seq, d.targets, d.skipped_full),
        (1, &[2, 3, 4, 5][..], 0)
    );
    assert_eq!(t.blocked_by(g(1), s(1), 64, roomy), Ok(None));
}

#[test]
fn drop_when_full_members_are_skipped_and_counted() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    join(&mut t, g(1), 2, MemberFlags::DROP_WHEN_FULL);
    join(&mut t, g(1), 3, MemberFlags::NONE);
    join(&mut t, g(1), 4, MemberFlags::DROP_WHEN_FULL);
    let SendDecision::Deliver(d) = t.send(g(1), s(1), 64, |m| m == 3).unwrap() else {
        panic!("blocked")
    };
    assert_eq!((d.targets, d.skipped_full), (&[3][..], 2));
    assert_eq!(t.blocked_by(g(1), s(1), 64, |m| m == 3), Ok(None));
    assert_eq!(t.any_blocker(g(1), |m| m == 3), Ok(None));
    assert_eq!(
        t.counters,
        GroupCounters {
            sends: 1,
            deliveries: 1,
            drops_full: 2,
            filtered: 0
        }
    );
    // The non-DROP member still blocks.
    assert_eq!(send(&mut t, g(1), 1, &[2, 3]), Err(3));
}

#[test]
fn filters_pick_senders_and_filtered_members_never_block() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    // 2 hears only from socket 1; 3 from everyone but 10.0.0.0/24 port 1001..=1002.
    let only_1 = Filter::Only(vec![SenderRule::socket(BASE, 1001)].into());
    let not_1_2 = Filter::Except(vec![SenderRule::new(BASE, 24, 1001, 1002).unwrap()].into());
    t.join(g(1), 2, MemberFlags::NONE, only_1).unwrap();
    t.join(g(1), 3, MemberFlags::NONE, not_1_2).unwrap();
    join(&mut t, g(1), 4, MemberFlags::NONE);
    assert_eq!(
        send(&mut t, g(1), 1, &[3]),
        Ok(vec![2, 4]),
        "3 is full but filtered"
    );
    assert_eq!(
        send(&mut t, g(1), 5, &[2]),
        Ok(vec![3, 4]),
        "2 is full but filtered"
    );
    assert_eq!(send(&mut t, g(1), 2, &[]), Ok(vec![4]), "2 is the sender");
    assert_eq!(t.counters.filtered, 3, "a sender never counts as filtered");
    assert_eq!(t.blocked_by(g(1), s(5), 64, |m| m != 2), Ok(None));
    assert_eq!(
        t.any_blocker(g(1), |m| m != 2),
        Ok(Some(2)),
        "the sender-independent bit is conservative"
    );
    t.set_filter(g(1), 2, Filter::All).unwrap();
    assert_eq!(send(&mut t, g(1), 5, &[]), Ok(vec![2, 3, 4]));
    assert_eq!(
        t.set_filter(g(1), 9, Filter::All),
        Err(GroupError::NotMember)
    );
}

#[test]
fn sender_rules_match_prefixes_and_port_ranges() {
    let m = |addr: Ipv4Addr, port| FilterInput {
        src_addr: u32::from(addr),
        src_port: port,
        len: 0,
    };
    let r = SenderRule::new(u32::from(Ipv4Addr::new(10, 1, 2, 99)), 16, 10, 20).unwrap();
    assert!(r.matches(&m(Ipv4Addr::new(10, 1, 0, 1), 10)));
    assert!(r.matches(&m(Ipv4Addr::new(10, 1, 255, 1), 20)));
    assert!(!r.matches(&m(Ipv4Addr::new(10, 2, 0, 1), 15)));
    assert!(!r.matches(&m(Ipv4Addr::new(10, 1, 0, 1), 21)));
    let any = SenderRule::new(0, 0, 0, u16::MAX).unwrap();
    assert!(any.matches(&m(Ipv4Addr::new(255, 255, 255, 255), 0)));
    assert_eq!(SenderRule::new(0, 33, 0, 1), Err(GroupError::BadFilter));
    assert_eq!(SenderRule::new(0, 8, 2, 1), Err(GroupError::BadFilter));
    assert!(!Filter::Only(Box::new([])).accepts(&m(Ipv4Addr::LOCALHOST, 1)));
    assert!(Filter::Except(Box::new([])).accepts(&m(Ipv4Addr::LOCALHOST, 1)));
    // As `rdsctl info` shows them.
    assert_eq!(r.to_string(), "10.1.0.0/16:10-20");
    assert_eq!(Filter::All.to_string(), "all");
    let one = SenderRule::socket(u32::from(Ipv4Addr::new(10, 0, 0, 1)), 1000);
    assert_eq!(
        Filter::Only(Box::new([one, r])).to_string(),
        "only 10.0.0.1/32:1000,10.1.0.0/16:10-20"
    );
    assert_eq!(
        Filter::Except(Box::new([one])).to_string(),
        "except 10.0.0.1/32:1000"
    );
}

#[test]
fn a_filter_holds_at_most_max_rules() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    let rules = |n| vec![SenderRule::socket(BASE, 1); n].into_boxed_slice();
    assert_eq!(
        t.join(
            g(1),
            2,
            MemberFlags::NONE,
            Filter::Only(rules(Filter::MAX_RULES + 1))
        ),
        Err(GroupError::BadFilter)
    );
    assert!(t.group(g(1)).unwrap().members.is_empty());
    t.join(
        g(1),
        2,
        MemberFlags::NONE,
        Filter::Except(rules(Filter::MAX_RULES)),
    )
    .unwrap();
    assert_eq!(
        t.set_filter(g(1), 2, Filter::Except(rules(Filter::MAX_RULES + 1))),
        Err(GroupError::BadFilter)
    );
    assert_eq!(GroupError::BadFilter.errno(), libc::EINVAL);
}

#[test]
fn flags_can_change_after_joining() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    join(&mut t, g(1), 2, MemberFlags::NONE);
    assert_eq!(send(&mut t, g(1), 1, &[2]), Err(2));
    t.set_flags(g(1), 2, MemberFlags::DROP_WHEN_FULL).unwrap();
    assert_eq!(send(&mut t, g(1), 1, &[2]), Ok(vec![]));
    assert_eq!(t.counters.drops_full, 1);
}

#[test]
fn sequence_numbers_are_one_order_per_group_whatever_the_sender() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    t.create(g(2), 1).unwrap();
    for m in 1..=3 {
        join(&mut t, g(1), m, MemberFlags::LOOPBACK);
        join(&mut t, g(2), m, MemberFlags::LOOPBACK);
    }
    let mut seen = Vec::new();
    for (i, from) in [1, 2, 3, 3, 1, 2].into_iter().enumerate() {
        let grp = if i % 2 == 0 { g(1) } else { g(2) };
        let SendDecision::Deliver(d) = t.send(grp, s(from), 1, roomy).unwrap() else {
            panic!("blocked")
        };
        seen.push((d.epoch, d.seq));
    }
    assert_eq!(seen, [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]);
    let v = t.group(g(1)).unwrap();
    assert_eq!(
        (v.last_seq, v.counters.sends, v.counters.deliveries),
        (3, 3, 9)
    );
    assert_eq!(t.groups().count(), 2);
}

#[test]
fn the_targets_buffer_is_reused() {
    let mut t = table();
    t.create(g(1), 1).unwrap();
    for m in 0..64 {
        join(&mut t, g(1), m, MemberFlags::NONE);
    }
    let _ = t.send(g(1), s(1), 1, roomy).unwrap();
    let cap = t.targets.capacity();
    let ptr = t.targets.as_ptr();
    for _ in 0..100 {
        let _ = t.send(g(1), s(1), 1, roomy).unwrap();
    }
    assert_eq!((t.targets.capacity(), t.targets.as_ptr()), (cap, ptr));
    let distinct: HashSet<_> = t.targets.iter().collect();
    assert_eq!(distinct.len(), 63);
}
