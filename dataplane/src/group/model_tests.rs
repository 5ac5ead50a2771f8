//! A model-based property test of the group table. Random scripts create groups, join (random
//! flags and filters), leave, change filters and flags, close sockets and kill apps, while
//! several senders queue messages (a FIFO per sender, as its tx ring) and members with random
//! receive-buffer sizes drain at random. A simulated poll thread tries each sender's head
//! message against the table and, on `Deliver`, enqueues it into every target's buffer.
//!
//! Every decision is compared with a plain model of the rules (memberships as a list, filters
//! evaluated from their description), and the run's outcome is checked on its own terms: each
//! member's received messages are in the group's one order, each message is at exactly its
//! targets (all or none, once each, every target had room), non-DROP_WHEN_FULL eligible members
//! are never skipped, filtered and non-LOOPBACK senders never receive, a blocked send reaches
//! nobody, and the counters add up.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

const APPS: u8 = 3;
const SLOTS: u8 = 3;
const GROUPS: u8 = 3;
/// 10.0.0.1; app `a` is bound at 10.0.0.(1 + a), slot `s` at port 1000 + s.
const BASE: u32 = 0x0a00_0001;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Sock {
    app: u8,
    slot: u8,
}

impl Sock {
    fn sender(self) -> Sender<Sock> {
        Sender {
            sock: self,
            addr: BASE + u32::from(self.app),
            port: 1000 + u16::from(self.slot),
        }
    }

    fn all() -> impl Iterator<Item = Sock> {
        (0..APPS).flat_map(|app| (0..SLOTS).map(move |slot| Sock { app, slot }))
    }
}

fn gaddr(g: u8) -> GroupAddr {
    GroupAddr::new(u32::from(Ipv4Addr::new(239, 0, 0, g)), 5000).unwrap()
}

/// A filter as the model sees it: keep (`Only`) or drop (`Except`) senders of one app (or of
/// all apps: the rule is 10.0.0.0/30) bound to a slot in `lo..=hi`.
#[derive(Clone, Copy, Debug)]
enum FilterSpec {
    All,
    Only(u8, bool, u8, u8),
    Except(u8, bool, u8, u8),
}

impl FilterSpec {
    fn rule(app: u8, wide: bool, lo: u8, hi: u8) -> SenderRule {
        let (prefix, addr) = if wide {
            (30, BASE)
        } else {
            (32, BASE + u32::from(app))
        };
        SenderRule::new(addr, prefix, 1000 + u16::from(lo), 1000 + u16::from(hi)).unwrap()
    }

    fn build(self) -> Filter {
        match self {
            FilterSpec::All => Filter::All,
            FilterSpec::Only(a, w, lo, hi) => Filter::Only(vec![Self::rule(a, w, lo, hi)].into()),
            FilterSpec::Except(a, w, lo, hi) => {
                Filter::Except(vec![Self::rule(a, w, lo, hi)].into())
            }
        }
    }

    fn accepts(self, from: Sock) -> bool {
        let hit = |a: u8, wide: bool, lo: u8, hi: u8| {
            (wide || from.app == a) && (lo..=hi).contains(&from.slot)
        };
        match self {
            FilterSpec::All => true,
            FilterSpec::Only(a, w, lo, hi) => hit(a, w, lo, hi),
            FilterSpec::Except(a, w, lo, hi) => !hit(a, w, lo, hi),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Create(u8, Sock),
    Join(u8, Sock, u32, FilterSpec),
    Leave(u8, Sock),
    SetFilter(u8, Sock, FilterSpec),
    SetFlags(u8, Sock, u32),
    Close(Sock),
    AppDied(u8),
    /// Queue a message of this length on the sender's tx ring.
    Send(Sock, u8, usize),
    /// One pass: each sender's head message is tried once.
    Pump,
    Drain(Sock, u8),
}

fn sock() -> impl Strategy<Value = Sock> {
    (0..APPS, 0..SLOTS).prop_map(|(app, slot)| Sock { app, slot })
}

fn filter() -> impl Strategy<Value = FilterSpec> {
    let rule = (0..APPS, any::<bool>(), 0..SLOTS, 0..SLOTS)
        .prop_map(|(a, w, x, y)| (a, w, x.min(y), x.max(y)));
    prop_oneof![
        4 => Just(FilterSpec::All),
        1 => rule.clone().prop_map(|(a, w, lo, hi)| FilterSpec::Only(a, w, lo, hi)),
        1 => rule.prop_map(|(a, w, lo, hi)| FilterSpec::Except(a, w, lo, hi)),
    ]
}

/// Flags: mostly valid, sometimes an unknown bit.
fn flags() -> impl Strategy<Value = u32> {
    prop_oneof![8 => 0u32..4, 1 => 4u32..16]
}

fn op() -> impl Strategy<Value = Op> {
    let g = 0..GROUPS;
    prop_oneof![
        3 => (g.clone(), sock()).prop_map(|(g, s)| Op::Create(g, s)),
        12 => (g.clone(), sock(), flags(), filter()).prop_map(|(g, s, f, x)| Op::Join(g, s, f, x)),
        2 => (g.clone(), sock()).prop_map(|(g, s)| Op::Leave(g, s)),
        1 => (g.clone(), sock(), filter()).prop_map(|(g, s, x)| Op::SetFilter(g, s, x)),
        1 => (g.clone(), sock(), flags()).prop_map(|(g, s, f)| Op::SetFlags(g, s, f)),
        1 => sock().prop_map(Op::Close),
        1 => (0..APPS).prop_map(Op::AppDied),
        10 => (sock(), g, 1usize..120).prop_map(|(s, g, l)| Op::Send(s, g, l)),
        6 => Just(Op::Pump),
        8 => (sock(), 1u8..4).prop_map(|(s, n)| Op::Drain(s, n)),
    ]
}

struct MGroup {
    creator: Option<Sock>,
    /// (socket, flag bits, filter), in join order.
    members: Vec<(Sock, u32, FilterSpec)>,
    incarnation: u64,
}

/// One socket's life from open to close: the sockets of the model are reopened at once.
type Life = (Sock, u32);

struct Delivered {
    /// Who should have it (the decision's targets, each with room).
    to: BTreeSet<Life>,
    sender: Sock,
}

struct World {
    t: GroupTable<Sock>,
    groups: BTreeMap<u8, MGroup>,
    incarnations: u64,
    epoch_of: HashMap<u64, u64>,
    last_seq: HashMap<u64, u64>,
    caps: HashMap<Sock, usize>,
    /// Receive buffers: (message id, length).
    bufs: HashMap<Sock, VecDeque<(u64, usize)>>,
    life: HashMap<Sock, u32>,
    /// What each socket life received: (epoch, seq, message id), in arrival order.
    logs: BTreeMap<Life, Vec<(u64, u64, u64)>>,
    /// Each sender's tx ring: (group, length, message id).
    pending: BTreeMap<Sock, VecDeque<(u8, usize, u64)>>,
    delivered: HashMap<u64, Delivered>,
    want: GroupCounters,
    next_msg: u64,
    blocked_attempts: u64,
    /// Creations of a group number that had existed before.
    recreated: u64,
    ever_created: BTreeSet<u8>,
}

impl World {
    fn new(caps: &[usize]) -> World {
        let caps: HashMap<Sock, usize> = Sock::all().zip(caps.iter().copied()).collect();
        World {
            t: GroupTable::default(),
            groups: BTreeMap::new(),
            incarnations: 0,
            epoch_of: HashMap::new(),
            last_seq: HashMap::new(),
            bufs: Sock::all().map(|s| (s, VecDeque::new())).collect(),
            life: Sock::all().map(|s| (s, 0)).collect(),
            logs: BTreeMap::new(),
            pending: BTreeMap::new(),
            delivered: HashMap::new(),
            want: GroupCounters::default(),
            next_msg: 0,
            blocked_attempts: 0,
            recreated: 0,
            ever_created: BTreeSet::new(),
            caps,
        }
    }

    fn used(&self, s: Sock) -> usize {
        self.bufs[&s].iter().map(|m| m.1).sum()
    }

    fn room(&self, s: Sock, len: usize) -> bool {
        self.used(s) + len <= self.caps[&s]
    }

    fn member(&mut self, g: u8, s: Sock) -> Result<&mut (Sock, u32, FilterSpec), GroupError> {
        let grp = self.groups.get_mut(&g).ok_or(GroupError::NoSuchGroup)?;
        grp.members
            .iter_mut()
            .find(|m| m.0 == s)
            .ok_or(GroupError::NotMember)
    }

    fn drop_dead(&mut self, g: u8) {
        if self.groups[&g].creator.is_none() && self.groups[&g].members.is_empty() {
            self.groups.remove(&g);
        }
    }

    /// The model's side of closing `s`; returns how many groups it was in.
    fn model_close(&mut self, s: Sock) -> usize {
        let mut n = 0;
        let ids: Vec<u8> = self.groups.keys().copied().collect();
        for g in ids {
            let grp = self.groups.get_mut(&g).unwrap();
            let before = grp.members.len();
            grp.members.retain(|m| m.0 != s);
            let was_creator = grp.creator == Some(s);
            if was_creator {
                grp.creator = None;
            }
            if was_creator || before != grp.members.len() {
                n += 1;
            }
            self.drop_dead(g);
        }
        // The socket is gone with its buffer and its unsent messages; a new one opens.
        self.bufs.get_mut(&s).unwrap().clear();
        self.pending.remove(&s);
        *self.life.get_mut(&s).unwrap() += 1;
        n
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Create(g, s) => {
                let want = if self.groups.contains_key(&g) {
                    Err(GroupError::GroupExists)
                } else {
                    self.incarnations += 1;
                    let incarnation = self.incarnations;
                    if !self.ever_created.insert(g) {
                        self.recreated += 1;
                    }
                    self.groups.insert(
                        g,
                        MGroup {
                            creator: Some(s),
                            members: Vec::new(),
                            incarnation,
                        },
                    );
                    Ok(())
                };
                assert_eq!(self.t.create(gaddr(g), s), want);
            }
            Op::Join(g, s, bits, spec) => {
                let flags = match MemberFlags::from_bits(bits) {
                    Ok(f) => f,
                    Err(e) => {
                        assert!(bits > 3);
                        assert_eq!(e, GroupError::BadFlags);
                        return;
                    }
                };
                let want = match self.groups.get_mut(&g) {
                    None => Err(GroupError::NoSuchGroup),
                    Some(grp) if grp.members.iter().any(|m| m.0 == s) => {
                        Err(GroupError::AlreadyMember)
                    }
                    Some(grp) => {
                        grp.members.push((s, bits, spec));
                        Ok(())
                    }
                };
                assert_eq!(self.t.join(gaddr(g), s, flags, spec.build()), want);
            }
            Op::Leave(g, s) => {
                let want = self.member(g, s).map(|_| ());
                if want.is_ok() {
                    self.groups
                        .get_mut(&g)
                        .unwrap()
                        .members
                        .retain(|m| m.0 != s);
                    self.drop_dead(g);
                }
                assert_eq!(self.t.leave(gaddr(g), s), want);
            }
            Op::SetFilter(g, s, spec) => {
                let want = self.member(g, s).map(|m| m.2 = spec);
                assert_eq!(self.t.set_filter(gaddr(g), s, spec.build()), want);
            }
            Op::SetFlags(g, s, bits) => {
                let Ok(flags) = MemberFlags::from_bits(bits) else {
                    assert!(bits > 3);
                    return;
                };
                let want = self.member(g, s).map(|m| m.1 = bits);
                assert_eq!(self.t.set_flags(gaddr(g), s, flags), want);
            }
            Op::Close(s) => {
                let n = self.model_close(s);
                assert_eq!(self.t.close_socket(s), n);
            }
            Op::AppDied(app) => {
                let mut in_groups = 0;
                for slot in 0..SLOTS {
                    in_groups += usize::from(self.model_close(Sock { app, slot }) > 0);
                }
                assert_eq!(self.t.app_died(|s| s.app == app), in_groups);
            }
            Op::Send(s, g, len) => {
                self.next_msg += 1;
                self.pending
                    .entry(s)
                    .or_default()
                    .push_back((g, len, self.next_msg));
            }
            Op::Pump => {
                let senders: Vec<Sock> = self.pending.keys().copied().collect();
                for s in senders {
                    self.attempt(s);
                }
            }
            Op::Drain(s, n) => {
                let buf = self.bufs.get_mut(&s).unwrap();
                for _ in 0..n {
                    buf.pop_front();
                }
            }
        }
        self.t.check_invariants();
    }

    /// The simulated poll thread tries `s`'s oldest unsent message.
    fn attempt(&mut self, s: Sock) {
        let Some(&(g, len, msg)) = self.pending.get(&s).and_then(|q| q.front()) else {
            return;
        };
        let Some(grp) = self.groups.get(&g) else {
            assert_eq!(
                self.t
                    .send(gaddr(g), s.sender(), len, |_| true)
                    .unwrap_err(),
                GroupError::NoSuchGroup
            );
            self.pending.get_mut(&s).unwrap().pop_front(); // dropped, as to an unbound port
            return;
        };
        // The model's decision.
        let (mut targets, mut skipped, mut filtered, mut blockers) = (vec![], 0, 0, vec![]);
        for &(m, bits, spec) in &grp.members {
            let flags = MemberFlags::from_bits(bits).unwrap();
            if m == s && !flags.contains(MemberFlags::LOOPBACK) {
                continue;
            }
            if !spec.accepts(s) {
                filtered += 1;
            } else if self.room(m, len) {
                targets.push(m);
            } else if flags.contains(MemberFlags::DROP_WHEN_FULL) {
                skipped += 1;
            } else {
                blockers.push(m);
            }
        }
        let incarnation = grp.incarnation;

        let room =
            |m: Sock| self.bufs[&m].iter().map(|x| x.1).sum::<usize>() + len <= self.caps[&m];
        let query = self.t.blocked_by(gaddr(g), s.sender(), len, room).unwrap();
        let any = self.t.any_blocker(gaddr(g), room).unwrap();
        let before: Vec<usize> = Sock::all().map(|x| self.bufs[&x].len()).collect();
        match self.t.send(gaddr(g), s.sender(), len, room).unwrap() {
            SendDecision::Blocked { by } => {
                assert!(
                    blockers.contains(&by),
                    "{by:?} is not a blocker: {blockers:?}"
                );
                assert_eq!(query, Some(by), "POLLOUT agrees with the send");
                assert!(any.is_some(), "the conservative bit is set too");
                self.blocked_attempts += 1;
                // Nobody got it: no buffer changed, the message stays at the head.
                let after: Vec<usize> = Sock::all().map(|x| self.bufs[&x].len()).collect();
                assert_eq!(before, after);
                assert!(!self.delivered.contains_key(&msg));
            }
            SendDecision::Deliver(d) => {
                assert!(blockers.is_empty(), "delivered past blockers {blockers:?}");
                for &(m, bits, spec) in &grp.members {
                    let flags = MemberFlags::from_bits(bits).unwrap();
                    let own = m == s && !flags.contains(MemberFlags::LOOPBACK);
                    if own || !spec.accepts(s) {
                        assert!(!d.targets.contains(&m), "{m:?}: own message or filtered");
                    } else if !flags.contains(MemberFlags::DROP_WHEN_FULL) {
                        assert!(d.targets.contains(&m), "{m:?} (no DROP_WHEN_FULL) skipped");
                    }
                }
                assert_eq!(query, None, "POLLOUT agrees with the send");
                assert_eq!(d.targets, &targets[..]);
                assert_eq!((d.skipped_full, d.filtered), (skipped, filtered));
                let epoch = *self.epoch_of.entry(incarnation).or_insert(d.epoch);
                assert_eq!(d.epoch, epoch, "one epoch per incarnation");
                assert_eq!(
                    self.epoch_of.values().filter(|e| **e == epoch).count(),
                    1,
                    "a new incarnation has a new epoch"
                );
                let last = self.last_seq.entry(epoch).or_insert(0);
                assert_eq!(d.seq, *last + 1, "numbered densely");
                *last = d.seq;
                let (epoch, seq) = (d.epoch, d.seq);
                self.want.sends += 1;
                self.want.deliveries += targets.len() as u64;
                self.want.drops_full += u64::from(skipped);
                self.want.filtered += u64::from(filtered);
                // The caller's enqueues: each target must take it (all or none).
                let mut to = BTreeSet::new();
                for m in targets {
                    assert!(self.room(m, len), "{m:?} named a target without room");
                    self.bufs.get_mut(&m).unwrap().push_back((msg, len));
                    let life = (m, self.life[&m]);
                    self.logs.entry(life).or_default().push((epoch, seq, msg));
                    to.insert(life);
                }
                self.delivered.insert(msg, Delivered { to, sender: s });
                self.pending.get_mut(&s).unwrap().pop_front();
            }
        }
    }

    /// The run's outcome on its own terms.
    fn check_outcome(&self) {
        // One order per group: every member's receipts of an epoch are increasing, and a
        // (epoch, seq) is one message everywhere.
        let mut msg_at: HashMap<(u64, u64), u64> = HashMap::new();
        let mut got: HashMap<u64, BTreeSet<Life>> = HashMap::new();
        for (life, log) in &self.logs {
            let mut last: HashMap<u64, u64> = HashMap::new();
            for &(epoch, seq, msg) in log {
                let l = last.entry(epoch).or_insert(0);
                assert!(
                    seq > *l,
                    "{life:?} got seq {seq} after {l} in epoch {epoch}"
                );
                *l = seq;
                assert_eq!(*msg_at.entry((epoch, seq)).or_insert(msg), msg);
                assert!(
                    got.entry(msg).or_default().insert(*life),
                    "{life:?} got {msg} twice"
                );
            }
        }
        // Total order, pairwise: two members that both got A and B got them in the same order.
        let lives: Vec<&Vec<(u64, u64, u64)>> = self.logs.values().collect();
        for (i, c) in lives.iter().enumerate() {
            let at_c: HashMap<u64, usize> = c.iter().enumerate().map(|(k, m)| (m.2, k)).collect();
            for d in &lives[i + 1..] {
                let common: Vec<usize> = d.iter().filter_map(|m| at_c.get(&m.2).copied()).collect();
                assert!(
                    common.windows(2).all(|w| w[0] < w[1]),
                    "two orders: {c:?} {d:?}"
                );
            }
        }
        // All or none: each delivered message is at exactly its targets.
        for (msg, d) in &self.delivered {
            let empty = BTreeSet::new();
            assert_eq!(got.get(msg).unwrap_or(&empty), &d.to, "message {msg}");
        }
        assert_eq!(self.t.counters, self.want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn groups_deliver_all_or_none_in_one_order(
        caps in prop::collection::vec(1usize..400, (APPS * SLOTS) as usize),
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let mut w = World::new(&caps);
        for op in ops {
            w.apply(op);
        }
        // Drain everyone and flush what can go, as a quiet poll thread would.
        for _ in 0..4 {
            for s in Sock::all() {
                w.bufs.get_mut(&s).unwrap().clear();
            }
            w.apply(Op::Pump);
        }
        w.check_outcome();
    }
}

/// The generator reaches the interesting cases: blocked sends, DROP_WHEN_FULL skips, filter
/// rejections, loopback deliveries and groups that die and come back.
#[test]
fn the_scripts_cover_every_rule() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut blocked, mut loopback, mut recreated) = (0, 0, 0);
    let mut totals = GroupCounters::default();
    for _ in 0..200 {
        let caps = prop::collection::vec(1usize..400, (APPS * SLOTS) as usize)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let ops = prop::collection::vec(op(), 1..200)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        let mut w = World::new(&caps);
        for op in ops {
            w.apply(op);
        }
        w.check_outcome();
        blocked += w.blocked_attempts;
        loopback += w
            .delivered
            .values()
            .filter(|d| d.to.iter().any(|l| l.0 == d.sender))
            .count();
        recreated += w.recreated;
        totals.add(&w.t.counters);
    }
    assert!(blocked > 100, "blocked attempts: {blocked}");
    assert!(loopback > 100, "loopback deliveries: {loopback}");
    assert!(recreated > 10, "groups created again: {recreated}");
    assert!(totals.drops_full > 100, "{totals:?}");
    assert!(totals.filtered > 100, "{totals:?}");
    assert!(totals.deliveries > 1000, "{totals:?}");
}
