//! The body of an `Info` reply (`rdsctl info`, `rdsctl ping`): a JSON document built on the
//! control thread from the counters and, for the other sections, a snapshot the poll core
//! copied out (`poll::snapshot`). Schema `shm_api::ctrl::INFO_SCHEMA`; fields are only added.
//!
//! ```text
//! { "schema": 1,
//!   "rdsd": { "version", "pid", "uptime_s", "start_time_unix", "control_socket",
//!             "local_addrs": ["127.0.0.0/8", ...], "metrics_listen", "transports",
//!             "poll_cpus": [cpu | null, ...], "control_cpu": cpu | null, "idle" },
//!   "counters": { name: value, ... }, "counter_help": { name: text, ... },      (-c)
//!   "thread_counters": [ { name: value (non-zero), ... } per poll thread ],      (-c)
//!   "sockets": [ SockSnapshot ... ], "sockets_truncated": n,                    (-k)
//!   "connections": [ ConnSnapshot ... ], "connections_truncated": n,            (-n, -p)
//!   "recv_queue": { "sockets", "bytes", "entries": [...] },                     (-r)
//!   "send_queue": { "sockets", "socket_bytes", "paths", "msgs", "entries" },    (-s)
//!   "retransmit_queue": { "paths", "msgs", "bytes", "entries": [...] },         (-t)
//!   "groups": [ GroupSnapshot ... ], "groups_truncated": n,                     (-g)
//!   "threads": [ { "thread", "cpu", "apps", "sockets", "connections", "groups",
//!                  "counters": { name: value, ... } } ... ] }                   (threads)
//! ```
//!
//! A thread's `counters` are its own, non-zero ones (thread 0's include the control
//! thread's); `counters` above are their sums.
//!
//! A group is `{ "shard", "addr", "port", "epoch", "creator": {app, slot, pid, addr, port} |
//! null, "members": [ {app, slot, pid, addr, port, flags, loopback, drop_when_full, filter} ],
//! "members_truncated": n, "last_seq", "sends", "deliveries", "drops_full", "filtered", "full" }`
//! (`poll::snapshot::GroupSnapshot`), sorted by address and port.
//!
//! A client that asks with `INFO_WHOLE` (the library and rdsctl always do) gets a document
//! longer than one datagram whole, in a memory file (the engine's `Host::document`), up to
//! `ctrl::MAX_INFO_DOCUMENT`; otherwise it is one datagram. Lists that would not fit are cut
//! (each `*_truncated` says by how many entries; a group's `members` are cut inside the group).

use crate::config::Config;
use crate::poll::snapshot::PollSnapshot;
use crate::stats::Stats;
use serde_json::{json, Map, Value};
use shm_api::ctrl::{self, MAX_DATAGRAM, REPLY_HEADER_LEN};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// When rdsd started.
pub struct Started {
    at: Instant,
    unix: f64,
}

impl Started {
    /// Now, by the monotonic and the wall clock.
    pub fn now() -> Started {
        Started {
            at: Instant::now(),
            unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        }
    }
}

/// Largest body of a reply datagram.
pub(super) const MAX_BODY: usize = MAX_DATAGRAM - REPLY_HEADER_LEN;

/// Serialises `doc`, halving its longest list (`sockets`, `connections`, `groups`, a queue's
/// `entries`, a group's `members`, a message listing, the poll threads) until it fits in `max` bytes; each cut list gets a
/// `<list>_truncated` count (next to it, in the same object) of the entries left out.
pub(super) fn fit(doc: Map<String, Value>, max: usize) -> Vec<u8> {
    const LISTS: [&str; 11] = [
        "/thread_counters",
        "/threads",
        "/send_messages",
        "/retrans_messages",
        "/recv_messages",
        "/sockets",
        "/connections",
        "/recv_queue/entries",
        "/send_queue/entries",
        "/retransmit_queue/entries",
        "/groups",
    ];
    let mut doc = Value::Object(doc);
    loop {
        let body = serde_json::to_vec(&doc).unwrap_or_default();
        if body.len() <= max {
            return body;
        }
        let len = |doc: &Value, p: &str| doc.pointer(p).and_then(Value::as_array).map(Vec::len);
        let groups = len(&doc, "/groups").unwrap_or(0);
        let members = (0..groups).map(|i| format!("/groups/{i}/members"));
        let longest = LISTS
            .into_iter()
            .map(String::from)
            .chain(members)
            .filter_map(|p| Some((len(&doc, &p)?, p)))
            .filter(|&(n, _)| n > 0)
            .max_by_key(|&(n, _)| n);
        let Some((n, path)) = longest else {
            return body;
        };
        let (parent, key) = path.rsplit_once('/').expect("a pointer");
        let Some(obj) = doc.pointer_mut(parent).and_then(Value::as_object_mut) else {
            return body;
        };
        let keep = n / 2;
        if let Some(list) = obj.get_mut(key).and_then(Value::as_array_mut) {
            list.truncate(keep);
        }
        let cut = format!("{key}_truncated");
        let before = obj.get(&cut).and_then(Value::as_u64).unwrap_or(0);
        obj.insert(cut, json!(before + (n - keep) as u64));
    }
}

/// `body` (a document from [`document`]) cut to fit in `max` bytes.
pub(super) fn refit(body: &[u8], max: usize) -> Vec<u8> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(doc)) => fit(doc, max),
        _ => b"{}".to_vec(),
    }
}

/// The Info document for `sections` (`snap` is `None` for counters only) at `now` (cut it to
/// size with [`fit`]); `owner` gives the (pid, uid) of an app index, for the snapshot's
/// sockets.
pub(super) fn document(
    cfg: &Config,
    stats: &Stats,
    started: &Started,
    now: Instant,
    sections: u32,
    snap: Option<PollSnapshot>,
    owner: impl Fn(usize) -> Option<(i32, u32)>,
) -> Map<String, Value> {
    let mut doc = Map::new();
    doc.insert("schema".into(), json!(ctrl::INFO_SCHEMA));
    let transports = snap.as_ref().map(|s| s.transports.clone());
    let uptime = now.saturating_duration_since(started.at);
    doc.insert(
        "rdsd".into(),
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "uptime_s": (uptime.as_millis() as f64) / 1000.0,
            "start_time_unix": started.unix,
            "control_socket": cfg.control_socket.display().to_string(),
            "local_addrs": cfg.local_addrs.iter()
                .map(|p| format!("{}/{}", p.addr, p.len)).collect::<Vec<_>>(),
            "metrics_listen": cfg.metrics_listen.map(|a| a.to_string()),
            "transports": transports,
            // Where the threads run (null: not pinned) and how the poll threads wait.
            "poll_cpus": cfg.poll_cores,
            "control_cpu": cfg.control_core,
            "idle": clap::ValueEnum::to_possible_value(&cfg.idle).map(|v| v.get_name().to_string()),
        }),
    );
    if sections & ctrl::INFO_COUNTERS != 0 {
        let d = stats.described();
        let mut values = Map::new();
        let mut help = Map::new();
        for (k, v, h) in d {
            values.insert(k.clone(), json!(v));
            help.insert(k, json!(h));
        }
        doc.insert("counters".into(), Value::Object(values));
        doc.insert("counter_help".into(), Value::Object(help));
        // Each poll thread's own, non-zero (`rdsctl stats --prometheus`'s per-thread series;
        // no poll thread is asked, as for the sums).
        let per: Vec<Value> = stats
            .per_thread()
            .into_iter()
            .map(|t| nonzero(t).into())
            .collect();
        doc.insert("thread_counters".into(), Value::Array(per));
    }
    if let Some(mut snap) = snap {
        for s in &mut snap.sockets {
            if let Some((pid, uid)) = owner(s.app) {
                s.pid = pid;
                s.uid = uid;
            }
        }
        for g in &mut snap.groups {
            let socks = g
                .creator
                .iter_mut()
                .chain(g.members.iter_mut().map(|m| &mut m.sock));
            for s in socks {
                if let Some((pid, _)) = owner(s.app) {
                    s.pid = pid;
                }
            }
        }
        if sections & ctrl::INFO_THREADS != 0 {
            doc.insert("threads".into(), threads(cfg, stats, &snap));
        }
        add_sections(&mut doc, sections, snap);
    }
    doc
}

/// The non-zero counters of a list, as a JSON object.
fn nonzero(counters: Vec<(String, u64)>) -> Map<String, Value> {
    counters
        .into_iter()
        .filter(|&(_, v)| v != 0)
        .map(|(n, v)| (n, json!(v)))
        .collect()
}

/// The `threads` section: per poll thread, where it runs, what it serves (counted before any
/// list is cut to fit) and its own non-zero counters.
fn threads(cfg: &Config, stats: &Stats, snap: &PollSnapshot) -> Value {
    let apps = &snap.apps_per_shard;
    let per = stats.per_thread();
    let count =
        |k: usize, shards: &mut dyn Iterator<Item = usize>| shards.filter(|&s| s == k).count();
    Value::Array(
        per.into_iter()
            .enumerate()
            .map(|(k, counters)| {
                let counters = nonzero(counters);
                json!({
                    "thread": k,
                    "cpu": cfg.poll_cores.get(k).copied().flatten(),
                    "apps": apps.get(k).copied().unwrap_or(0),
                    "sockets": count(k, &mut snap.sockets.iter().map(|s| s.shard)),
                    "connections": count(k, &mut snap.connections.iter().map(|c| c.shard)),
                    "groups": count(k, &mut snap.groups.iter().map(|g| g.shard)),
                    "counters": counters,
                })
            })
            .collect(),
    )
}

fn add_sections(doc: &mut Map<String, Value>, sections: u32, snap: PollSnapshot) {
    if sections & ctrl::INFO_MESSAGES != 0 {
        add_messages(doc, &snap);
    }
    if sections & ctrl::INFO_RECV_QUEUE != 0 {
        let q: Vec<_> = snap
            .sockets
            .iter()
            .filter(|s| s.rx_queued_bytes > 0 || s.rx_pending)
            .collect();
        doc.insert(
            "recv_queue".into(),
            json!({
                "sockets": q.len(),
                "bytes": q.iter().map(|s| s.rx_queued_bytes).sum::<u64>(),
                "entries": q.iter().map(|s| json!({
                    "addr": s.addr, "port": s.port, "pid": s.pid,
                    "bytes": s.rx_queued_bytes, "congested": s.congested,
                    "backlog_bytes": s.rx_backlog_bytes, "backed_up": s.backed_up,
                })).collect::<Vec<_>>(),
            }),
        );
    }
    let paths = || {
        snap.connections.iter().flat_map(|c| {
            c.paths
                .iter()
                .map(move |p| (c.transport, c.laddr, c.faddr, p))
        })
    };
    if sections & ctrl::INFO_SEND_QUEUE != 0 {
        let socks: Vec<_> = snap
            .sockets
            .iter()
            .filter(|s| s.tx_queued_bytes > 0)
            .collect();
        let ps: Vec<_> = paths().filter(|x| x.3.queued_msgs > 0).collect();
        let mut entries: Vec<Value> = socks
            .iter()
            .map(|s| {
                json!({"socket": {"addr": s.addr, "port": s.port, "pid": s.pid},
                           "bytes": s.tx_queued_bytes})
            })
            .collect();
        entries.extend(ps.iter().map(|(t, l, f, p)| {
            json!({"path": {"transport": t, "laddr": l, "faddr": f, "index": p.index},
                       "msgs": p.queued_msgs})
        }));
        doc.insert(
            "send_queue".into(),
            json!({
                "sockets": socks.len(),
                "socket_bytes": socks.iter().map(|s| s.tx_queued_bytes).sum::<u64>(),
                "paths": ps.len(),
                "msgs": ps.iter().map(|x| x.3.queued_msgs).sum::<usize>(),
                "entries": entries,
            }),
        );
    }
    if sections & ctrl::INFO_RETRANS_QUEUE != 0 {
        let ps: Vec<_> = paths().filter(|x| x.3.unacked_msgs > 0).collect();
        doc.insert(
            "retransmit_queue".into(),
            json!({
                "paths": ps.len(),
                "msgs": ps.iter().map(|x| x.3.unacked_msgs).sum::<usize>(),
                "bytes": ps.iter().filter_map(|x| x.3.unacked_bytes).sum::<u64>(),
                "entries": ps.iter().map(|(t, l, f, p)| json!({
                    "transport": t, "laddr": l, "faddr": f, "index": p.index,
                    "msgs": p.unacked_msgs, "bytes": p.unacked_bytes,
                })).collect::<Vec<_>>(),
            }),
        );
    }
    if sections & ctrl::INFO_SOCKETS != 0 {
        doc.insert("sockets".into(), json!(snap.sockets));
    }
    if sections & ctrl::INFO_GROUPS != 0 {
        let mut groups = snap.groups;
        groups.sort_by_key(|g| (g.addr, g.port, g.shard));
        doc.insert("groups".into(), json!(groups));
    }
    if sections & (ctrl::INFO_CONNECTIONS | ctrl::INFO_PATHS) != 0 {
        let mut conns = serde_json::to_value(&snap.connections).unwrap_or(json!([]));
        if sections & ctrl::INFO_PATHS == 0 {
            for c in conns.as_array_mut().into_iter().flatten() {
                if let Some(o) = c.as_object_mut() {
                    o.remove("paths");
                }
            }
        }
        doc.insert("connections".into(), conns);
    }
}

/// The message listings: what `RDS_INFO_{SEND,RETRANS,RECV}_MESSAGES` report. Local address
/// and port first, as the kernel's records have them (for a received message, the
/// receiver's). rdsd's rx records carry no sequence number: received messages have none.
fn add_messages(doc: &mut Map<String, Value>, snap: &PollSnapshot) {
    let listing = |unacked: bool| {
        let mut out = Vec::new();
        for c in &snap.connections {
            for p in &c.paths {
                let list = if unacked {
                    &p.retrans_messages
                } else {
                    &p.send_messages
                };
                out.extend(list.iter().map(|m| {
                    json!({
                        "transport": c.transport, "path": p.index, "seq": m.seq, "len": m.len,
                        "laddr": c.laddr, "faddr": c.faddr, "lport": m.sport, "fport": m.dport,
                    })
                }));
            }
        }
        Value::Array(out)
    };
    doc.insert("send_messages".into(), listing(false));
    doc.insert("retrans_messages".into(), listing(true));
    let mut recv = Vec::new();
    for s in &snap.sockets {
        let Some(laddr) = s.addr else { continue };
        recv.extend(s.rx_messages.iter().map(|&(len, faddr, fport)| {
            json!({
                "pid": s.pid, "len": len, "laddr": laddr, "faddr": faddr,
                "lport": s.port, "fport": fport,
            })
        }));
    }
    doc.insert("recv_messages".into(), Value::Array(recv));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lists_are_cut_to_one_datagram_and_say_so() {
        let sock = json!({"app": 1, "slot": 2, "addr": "10.0.0.1", "port": 4000,
                          "rcvbuf": 106496, "sndbuf": 106496, "rx_queued_bytes": 0});
        let mut doc = Map::new();
        doc.insert("schema".into(), json!(1));
        doc.insert("sockets".into(), json!(vec![sock; 4096]));
        doc.insert("connections".into(), json!([{"laddr": "10.0.0.1"}]));
        let body = fit(doc.clone(), MAX_BODY);
        assert!(body.len() <= MAX_BODY);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let kept = v["sockets"].as_array().unwrap().len();
        assert!(kept > 0 && kept < 4096);
        assert_eq!(kept as u64 + v["sockets_truncated"].as_u64().unwrap(), 4096);
        assert_eq!(v["connections"].as_array().unwrap().len(), 1);
        assert!(v.get("connections_truncated").is_none());
        // So are the poll threads' own counters (a counters-only reply on a many-core host).
        let mut doc = Map::new();
        let one: Map<String, Value> = (0..100)
            .map(|k| (format!("counter_{k}"), json!(u64::MAX)))
            .collect();
        doc.insert("thread_counters".into(), json!(vec![one; 256]));
        let body = fit(doc, MAX_BODY);
        assert!(body.len() <= MAX_BODY);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let kept = v["thread_counters"].as_array().unwrap().len() as u64;
        assert!(kept > 0 && kept + v["thread_counters_truncated"].as_u64().unwrap() == 256);
        // Queue entries are cut too, next to their list.
        let mut doc = Map::new();
        let e = json!({"addr": "10.0.0.1", "port": 4000, "pid": 7, "bytes": 300});
        doc.insert(
            "recv_queue".into(),
            json!({"sockets": 4096, "bytes": 1, "entries": vec![e; 4096]}),
        );
        let v: Value = serde_json::from_slice(&fit(doc.clone(), MAX_BODY)).unwrap();
        let q = &v["recv_queue"];
        let kept = q["entries"].as_array().unwrap().len() as u64;
        assert!(kept > 0 && kept + q["entries_truncated"].as_u64().unwrap() == 4096);
        assert_eq!(q["sockets"].as_u64(), Some(4096));
        // Groups are cut, and so are the members of one big group, inside it.
        let member = json!({"app": 1, "slot": 2, "pid": 7, "addr": "10.0.0.1", "port": 4000,
                            "flags": 3, "loopback": true, "drop_when_full": true,
                            "filter": "all"});
        let group = |n| {
            json!({"shard": 0, "addr": "239.1.2.3", "port": 5000, "epoch": 1,
                               "creator": null, "members": vec![member.clone(); n],
                               "last_seq": 0, "sends": 0, "deliveries": 0})
        };
        let mut doc = Map::new();
        doc.insert("groups".into(), json!(vec![group(1); 2048]));
        let v: Value = serde_json::from_slice(&fit(doc, MAX_BODY)).unwrap();
        let kept = v["groups"].as_array().unwrap().len() as u64;
        assert!(kept > 0 && kept + v["groups_truncated"].as_u64().unwrap() == 2048);
        let mut doc = Map::new();
        doc.insert("groups".into(), json!([group(1), group(1024)]));
        let body = fit(doc, MAX_BODY);
        assert!(body.len() <= MAX_BODY);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let g = &v["groups"][1];
        let kept = g["members"].as_array().unwrap().len() as u64;
        assert!(kept > 0 && kept + g["members_truncated"].as_u64().unwrap() == 1024);
        assert_eq!(v["groups"].as_array().unwrap().len(), 2);
        assert!(
            v.get("groups_truncated").is_none()
                && v["groups"][0].get("members_truncated").is_none()
        );
        // Message listings are cut too.
        let m = json!({"transport": "tcp", "path": 3, "seq": 1234567, "len": 1000,
                       "laddr": "10.0.0.1", "faddr": "10.0.0.2", "lport": 4000, "fport": 5000});
        let mut doc = Map::new();
        doc.insert("send_messages".into(), json!(vec![m.clone(); 20_000]));
        doc.insert("recv_messages".into(), json!(vec![m; 10]));
        let body = fit(doc, MAX_BODY);
        assert!(body.len() <= MAX_BODY);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let kept = v["send_messages"].as_array().unwrap().len() as u64;
        assert!(kept > 0 && kept + v["send_messages_truncated"].as_u64().unwrap() == 20_000);
        assert_eq!(v["recv_messages"].as_array().unwrap().len(), 10);
        // Small documents are untouched.
        let small = json!({"schema": 1, "sockets": [{"port": 1}], "recv_queue": {"entries": [1]}});
        let Value::Object(m) = small.clone() else {
            unreachable!()
        };
        assert_eq!(
            serde_json::from_slice::<Value>(&fit(m, MAX_BODY)).unwrap(),
            small
        );
    }
}
