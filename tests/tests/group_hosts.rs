//! Multicast groups with members on several hosts (issue 20): hosts in network namespaces,
//! each with its own rdsd on kernel TCP, all configured with `--group-owner 239.77.0.0/16=`
//! host 0. Host 0 orders the groups; the others mirror them for their members.

use rdsd_tests::netns::Lab;
use rdsd_tests::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

/// `rdsctl info -g --json` of `d`: its groups.
fn groups_of(d: &Daemon) -> Vec<serde_json::Value> {
    d.info_json(&["-g"])["groups"]
        .as_array()
        .expect("groups")
        .clone()
}

/// The addresses of the members of group `addr` in `groups`.
fn member_addrs(groups: &[serde_json::Value], addr: &str) -> Vec<String> {
    groups
        .iter()
        .filter(|g| g["addr"] == addr)
        .flat_map(|g| g["members"].as_array().expect("members").iter())
        .map(|m| m["addr"].as_str().unwrap_or("").to_string())
        .collect()
}

/// `n` hosts whose rdsd all say that host 0 owns 239.77.0.0/16 (host 0 sees its own address
/// there and keeps those groups local).
fn lab(n: usize) -> Lab {
    let mut lab = Lab::new(n, 0, &[]);
    let owner = format!("239.77.0.0/16={}", lab.hosts[0].addr);
    for i in 0..n {
        lab.start(i, &["--group-owner", &owner, "--paths", "2"]);
    }
    lab
}

/// Senders on three hosts, members on three hosts: every member gets every message, in one
/// order (the same digest of (sender port, sequence) in arrival order); each member host's
/// senders went through the owner, and the owner sent each message once to each member host.
#[test]
fn a_group_orders_the_messages_of_every_host_for_members_on_every_host() {
    let lab = lab(3);
    let h = &lab.hosts;
    let g = "239.77.0.1:5000";
    let mut creator = h[0].d().app(&["group-create", &h[0].at(7000), g, "1"]);
    creator.expect_within("created", LIMIT);
    const EACH: u64 = 300;
    let total = (3 * EACH).to_string();
    let mut members: Vec<App> = h
        .iter()
        .map(|x| {
            x.d()
                .app(&["group-member", &x.at(7001), g, "0", "1048576", "1", &total])
        })
        .collect();
    for m in &mut members {
        m.expect_within("joined", LIMIT);
    }
    // A join elsewhere takes effect once the owner has it: wait before sending.
    wait_for(
        || h[0].d().stat("group_host_joins") == 2,
        LIMIT,
        "the owner to take both member hosts",
    );
    // The member host mirrors the group and names its owner; the owner lists the hosts.
    let mirrored = groups_of(h[1].d());
    assert_eq!(mirrored.len(), 1, "{mirrored:?}");
    assert_eq!(mirrored[0]["owner"], h[0].addr.to_string());
    let owned = groups_of(h[0].d());
    assert_eq!(owned[0]["owner"], serde_json::Value::Null);
    let listed = member_addrs(&owned, "239.77.0.1");
    for x in h {
        assert!(listed.contains(&x.addr.to_string()), "{listed:?}");
    }
    // The senders stay open until the end: a close drops what rdsd has not sent (rds(7)).
    let mut senders: Vec<App> = h
        .iter()
        .map(|x| {
            x.d()
                .app(&["send", &x.at(7100), g, &EACH.to_string(), "200", "hold"])
        })
        .collect();
    let digests: Vec<String> = members
        .iter_mut()
        .map(|m| m.expect_within("done", LIMIT))
        .collect();
    assert!(
        digests.iter().all(|d| *d == digests[0]),
        "one order on every host: {digests:?}"
    );
    assert!(digests[0].starts_with(&format!("{total} ")), "{digests:?}");
    for s in &mut senders {
        assert_eq!(s.expect_within("sent", LIMIT), EACH.to_string());
        s.kill();
    }
    assert_eq!(h[1].d().stat("group_host_sends"), EACH);
    assert_eq!(h[2].d().stat("group_host_sends"), EACH);
    assert_eq!(h[0].d().stat("group_host_sends"), 0);
    assert_eq!(h[0].d().stat("group_host_data"), 2 * 3 * EACH);
    // The owner numbered every message once; each member host fanned each out to its member.
    assert_eq!(h[0].d().stat("group_sends"), 3 * EACH);
    for x in &h[1..] {
        assert_eq!(x.d().stat("group_deliveries"), 3 * EACH);
        assert_eq!(x.d().stat("group_wire_bad"), 0);
    }
    creator.kill();
}

/// Across hosts only groups created open take members (the owner cannot vouch for another
/// host's uids): a join elsewhere of a closed group is refused by the owner, and the member
/// host drops its memberships; a group in the owner's range cannot be created elsewhere; the
/// last member leaving tells the owner.
#[test]
fn the_owner_decides_who_joins_and_hears_when_a_host_leaves() {
    let lab = lab(2);
    let h = &lab.hosts;
    let mut elsewhere = h[1]
        .d()
        .app(&["group-create", &h[1].at(7000), "239.77.0.9:5000", "1"]);
    assert_eq!(
        elsewhere.expect_within("error", LIMIT),
        libc::EADDRNOTAVAIL.to_string()
    );
    let mut closed = h[0]
        .d()
        .app(&["group-create", &h[0].at(7000), "239.77.0.2:5000", "0"]);
    closed.expect_within("created", LIMIT);
    let mut m = h[1].d().app(&[
        "group-member",
        &h[1].at(7001),
        "239.77.0.2:5000",
        "0",
        "65536",
        "1",
        "1",
    ]);
    m.expect_within("joined", LIMIT);
    wait_for(
        || h[1].d().stat("group_host_refused") == 1,
        LIMIT,
        "the owner to refuse the join of a closed group",
    );
    assert_eq!(h[0].d().stat("group_host_joins"), 0);
    // An open group: joined; the member's death makes its host leave the group there.
    let mut open = h[0]
        .d()
        .app(&["group-create", &h[0].at(7002), "239.77.0.3:5000", "1"]);
    open.expect_within("created", LIMIT);
    let mut m2 = h[1].d().app(&[
        "group-member",
        &h[1].at(7003),
        "239.77.0.3:5000",
        "0",
        "65536",
        "0",
        "0",
    ]);
    m2.expect_within("joined", LIMIT);
    wait_for(
        || h[0].d().stat("group_host_joins") == 1,
        LIMIT,
        "the owner to take the member host",
    );
    let hosts_listed =
        || member_addrs(&groups_of(h[0].d()), "239.77.0.3").contains(&h[1].addr.to_string());
    assert!(hosts_listed());
    m2.kill();
    wait_for(
        || !hosts_listed(),
        LIMIT,
        "the owner to drop the host whose last member died",
    );
    for a in [&mut m, &mut closed, &mut open, &mut elsewhere] {
        a.kill();
    }
}

/// A member host that is unreachable for a while loses nothing: the owner's local member gets
/// the messages at once (the host's share waits in RDS's queue to it, within the host's 8 MiB
/// window; past it the group's sends would block), and once the link is back the host's
/// member gets every message, in the same order.
#[test]
fn an_unreachable_member_host_gets_everything_in_order_once_back() {
    let lab = lab(2);
    let h = &lab.hosts;
    let g = "239.77.0.4:5000";
    let mut creator = h[0].d().app(&["group-create", &h[0].at(7000), g, "1"]);
    creator.expect_within("created", LIMIT);
    const N: &str = "400";
    let mut near = h[0]
        .d()
        .app(&["group-member", &h[0].at(7001), g, "0", "1048576", "1", N]);
    let mut far = h[1]
        .d()
        .app(&["group-member", &h[1].at(7001), g, "0", "1048576", "1", N]);
    near.expect_within("joined", LIMIT);
    far.expect_within("joined", LIMIT);
    wait_for(
        || h[0].d().stat("group_host_joins") == 1,
        LIMIT,
        "the owner to take the member host",
    );
    h[1].link(false);
    let mut sender = h[0].d().app(&["send", &h[0].at(7100), g, N, "300", "hold"]);
    let got_near = near.expect_within("done", LIMIT);
    // The outage the test is named for (its length, not synchronisation).
    std::thread::sleep(Duration::from_secs(1));
    h[1].link(true);
    let got_far = far.expect_within("done", LIMIT);
    assert_eq!(got_near, got_far, "the same messages in the same order");
    sender.kill();
    creator.kill();
}

/// A member host applies its members' flags to the owner's messages: two sockets of host 1
/// are members and senders, one with LOOPBACK (it gets its own messages back, through the
/// owner, in the group's order) and one without (it gets only the other's); the owner's
/// member gets both streams in the order the LOOPBACK member saw them.
#[test]
fn a_member_host_applies_loopback_to_its_own_senders() {
    let lab = lab(2);
    let h = &lab.hosts;
    let g = "239.77.0.5:5000";
    let mut creator = h[0].d().app(&["group-create", &h[0].at(7000), g, "1"]);
    creator.expect_within("created", LIMIT);
    let go = std::env::temp_dir().join(format!("rdsd-group-go-{}", std::process::id()));
    let _ = std::fs::remove_file(&go);
    let go_s = go.to_str().expect("utf-8 path");
    const COUNT: u64 = 200;
    let (each, both) = (COUNT.to_string(), (2 * COUNT).to_string());
    let mut with = h[1]
        .d()
        .app(&["group-talk", &h[1].at(7001), g, "1", &each, &both, go_s]);
    let mut without = h[1]
        .d()
        .app(&["group-talk", &h[1].at(7002), g, "0", &each, &each, go_s]);
    let mut owner_side = h[0].d().app(&[
        "group-member",
        &h[0].at(7003),
        g,
        "0",
        "1048576",
        "1",
        &both,
    ]);
    for a in [&mut with, &mut without, &mut owner_side] {
        a.expect_within("joined", LIMIT);
    }
    wait_for(
        || h[0].d().stat("group_host_joins") == 1,
        LIMIT,
        "the owner to take the member host",
    );
    std::fs::write(&go, b"").unwrap();
    let got_with = with.expect_within("done", LIMIT);
    let got_without = without.expect_within("done", LIMIT);
    let got_owner = owner_side.expect_within("done", LIMIT);
    let _ = std::fs::remove_file(&go);
    // "EXPECT DIGEST own K"
    let field = |s: &str, i: usize| s.split_whitespace().nth(i).unwrap_or("").to_string();
    assert_eq!(
        field(&got_with, 3),
        each,
        "LOOPBACK: its own {COUNT}: {got_with}"
    );
    assert_eq!(
        field(&got_without, 3),
        "0",
        "no LOOPBACK: none of its own: {got_without}"
    );
    assert_eq!(
        got_owner,
        format!("{both} {}", field(&got_with, 1)),
        "the owner's member saw what the LOOPBACK member saw, in the same order"
    );
    assert_eq!(h[1].d().stat("group_host_sends"), 2 * COUNT);
    for a in [&mut with, &mut without, &mut owner_side, &mut creator] {
        a.kill();
    }
}
