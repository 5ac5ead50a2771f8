//! Text output of `rdsctl info`, in the manner of the kernel's rds-info: one titled table per
//! section. Everything is read from rdsd's Info JSON document (schema in
//! `dataplane/src/control/info.rs`); a missing field prints as `-` rather than failing, so a
//! newer or older rdsd still gives a readable table.

use serde_json::Value;
use std::fmt::Write;

fn field(v: &Value, k: &str) -> String {
    match v.get(k) {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => if *b { "yes" } else { "-" }.into(),
        Some(x) => x.to_string(),
    }
}

fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn list<'a>(doc: &'a Value, k: &str) -> &'a [Value] {
    doc.get(k)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn truncated(out: &mut String, doc: &Value, k: &str) {
    let n = num(doc, &format!("{k}_truncated"));
    if n > 0 {
        let _ = writeln!(out, "  ... {n} more not shown (past rdsd's listing limits)");
    }
}

/// `-c`: counters, `name value`.
pub fn counters(doc: &Value) -> String {
    let mut out = String::from("RDS counters:\n");
    if let Some(m) = doc.get("counters").and_then(Value::as_object) {
        for (k, v) in m {
            let _ = writeln!(out, "  {k:<32} {:>14}", v.as_u64().unwrap_or(0));
        }
    }
    out
}

/// `-k`: sockets.
pub fn sockets(doc: &Value) -> String {
    let mut out = String::from("RDS sockets:\n");
    let _ = writeln!(
        out,
        "  {:>15} {:>5} {:>8} {:>8} {:>10} {:>10} {:>4} {:>4} {:>8} {:>8}",
        "BoundAddr",
        "BPort",
        "RcvBuf",
        "SndBuf",
        "RxQueued",
        "TxQueued",
        "Cong",
        "Mon",
        "Pid",
        "App/Slot"
    );
    for s in list(doc, "sockets") {
        let _ = writeln!(
            out,
            "  {:>15} {:>5} {:>8} {:>8} {:>10} {:>10} {:>4} {:>4} {:>8} {:>8}",
            field(s, "addr"),
            num(s, "port"),
            num(s, "rcvbuf"),
            num(s, "sndbuf"),
            num(s, "rx_queued_bytes"),
            num(s, "tx_queued_bytes"),
            field(s, "congested"),
            field(s, "cong_monitor"),
            field(s, "pid"),
            format!("{}/{}", num(s, "app"), num(s, "slot")),
        );
    }
    truncated(&mut out, doc, "sockets");
    out
}

/// `-n`: connections.
pub fn connections(doc: &Value) -> String {
    let mut out = String::from("RDS connections:\n");
    let _ = writeln!(
        out,
        "  {:>15} {:>15} {:>9} {:>10} {:>6} {:>5} {:>10} {:>10} {:>4}",
        "LocalAddr",
        "RemoteAddr",
        "Transport",
        "State",
        "Active",
        "Paths",
        "Gen",
        "PeerGen",
        "Poll"
    );
    for c in list(doc, "connections") {
        let _ = writeln!(
            out,
            "  {:>15} {:>15} {:>9} {:>10} {:>6} {:>5} {:>10} {:>10} {:>4}",
            field(c, "laddr"),
            field(c, "faddr"),
            field(c, "transport"),
            field(c, "state"),
            field(c, "active"),
            field(c, "npaths"),
            num(c, "generation"),
            num(c, "peer_generation"),
            num(c, "shard"),
        );
    }
    truncated(&mut out, doc, "connections");
    out
}

/// `-p`: paths of every connection.
pub fn paths(doc: &Value) -> String {
    let mut out = String::from("RDS paths:\n");
    let _ = writeln!(
        out,
        "  {:>15} {:>15} {:>4} {:>13} {:>10} {:>10} {:>7} {:>7} {:>12} {:>6} {:>11}",
        "LocalAddr",
        "RemoteAddr",
        "Path",
        "State",
        "NextTxSeq",
        "NextRxSeq",
        "Queued",
        "Unacked",
        "UnackedBytes",
        "Paused",
        "TcpPorts"
    );
    for c in list(doc, "connections") {
        for p in list(c, "paths") {
            let _ = writeln!(
                out,
                "  {:>15} {:>15} {:>4} {:>13} {:>10} {:>10} {:>7} {:>7} {:>12} {:>6} {:>11}",
                field(c, "laddr"),
                field(c, "faddr"),
                num(p, "index"),
                field(p, "state"),
                num(p, "next_tx_seq"),
                num(p, "next_rx_seq"),
                num(p, "queued_msgs"),
                num(p, "unacked_msgs"),
                field(p, "unacked_bytes"),
                field(p, "rx_paused"),
                match (p["local_port"].as_u64(), p["peer_port"].as_u64()) {
                    (Some(l), Some(r)) => format!("{l}>{r}"),
                    _ => "-".into(),
                },
            );
            // An RDMA path's queue pair (rds-info -I's fields).
            if let Some(q) = p.get("rdma").filter(|q| q.is_object()) {
                let _ = writeln!(
                    out,
                    "      rdma gid {} > {}, send_wr {}, recv_wr {}, send_sge {}",
                    field(q, "src_gid"),
                    field(q, "dst_gid"),
                    num(q, "max_send_wr"),
                    num(q, "max_recv_wr"),
                    num(q, "max_send_sge")
                );
            }
        }
    }
    out
}

/// `-r`: receive queues (bytes delivered to sockets and not read yet).
pub fn recv_queue(doc: &Value) -> String {
    let q = doc.get("recv_queue").cloned().unwrap_or(Value::Null);
    let mut out = format!(
        "Receive queue: {} socket(s), {} byte(s) unread\n",
        num(&q, "sockets"),
        num(&q, "bytes")
    );
    for e in list(&q, "entries") {
        let flag = |name: &str, text: &'static str| {
            if e.get(name) == Some(&Value::Bool(true)) {
                text
            } else {
                ""
            }
        };
        let backlog = match e.get("backlog_bytes").and_then(Value::as_u64) {
            Some(n) if n > 0 => format!(" ({n} in rdsd's backlog)"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  {:>15}:{:<5} {:>10} bytes{backlog}  pid {}{}{}",
            field(e, "addr"),
            num(e, "port"),
            num(e, "bytes"),
            field(e, "pid"),
            flag("congested", "  congested"),
            flag("backed_up", "  backed up (its senders wait)"),
        );
    }
    truncated(&mut out, &q, "entries");
    out
}

/// `-s`: send queues (bytes sockets sent that rdsd has not released; messages waiting on paths).
pub fn send_queue(doc: &Value) -> String {
    let q = doc.get("send_queue").cloned().unwrap_or(Value::Null);
    let mut out = format!(
        "Send queue: {} socket(s) with {} byte(s) not yet released; {} message(s) queued on {} path(s)\n",
        num(&q, "sockets"),
        num(&q, "socket_bytes"),
        num(&q, "msgs"),
        num(&q, "paths")
    );
    for e in list(&q, "entries") {
        if let Some(s) = e.get("socket") {
            let _ = writeln!(
                out,
                "  socket {:>15}:{:<5} {:>10} bytes  pid {}",
                field(s, "addr"),
                num(s, "port"),
                num(e, "bytes"),
                field(s, "pid")
            );
        } else if let Some(p) = e.get("path") {
            let _ = writeln!(
                out,
                "  path   {} -> {} #{} ({}) {:>6} msgs",
                field(p, "laddr"),
                field(p, "faddr"),
                num(p, "index"),
                field(p, "transport"),
                num(e, "msgs")
            );
        }
    }
    truncated(&mut out, &q, "entries");
    out
}

/// `-t`: retransmit queues (messages written and not yet acknowledged).
pub fn retransmit_queue(doc: &Value) -> String {
    let q = doc.get("retransmit_queue").cloned().unwrap_or(Value::Null);
    let mut out = format!(
        "Retransmit queue: {} message(s), {} byte(s) unacknowledged on {} path(s)\n",
        num(&q, "msgs"),
        num(&q, "bytes"),
        num(&q, "paths")
    );
    for e in list(&q, "entries") {
        let _ = writeln!(
            out,
            "  path   {} -> {} #{} ({}) {:>6} msgs {:>10} bytes",
            field(e, "laddr"),
            field(e, "faddr"),
            num(e, "index"),
            field(e, "transport"),
            num(e, "msgs"),
            field(e, "bytes")
        );
    }
    truncated(&mut out, &q, "entries");
    out
}

/// `-m`: every queued message (rds-info -s, -t, -r): local and remote `addr:port`, length,
/// sequence number (none for received messages: rdsd's rx records carry none) and path.
pub fn messages(doc: &Value) -> String {
    let mut out = String::from("RDS messages:\n");
    let _ = writeln!(
        out,
        "  {:<7} {:>21} {:>21} {:>8} {:>10} {:>4}",
        "Queue", "Local", "Remote", "Bytes", "Seq", "Path"
    );
    for (key, kind) in [
        ("send_messages", "send"),
        ("retrans_messages", "retrans"),
        ("recv_messages", "recv"),
    ] {
        for m in list(doc, key) {
            let seq = m
                .get("seq")
                .map_or("-".into(), |_| num(m, "seq").to_string());
            let path = m
                .get("path")
                .map_or("-".into(), |_| num(m, "path").to_string());
            let _ = writeln!(
                out,
                "  {:<7} {:>21} {:>21} {:>8} {:>10} {:>4}",
                kind,
                format!("{}:{}", field(m, "laddr"), num(m, "lport")),
                format!("{}:{}", field(m, "faddr"), num(m, "fport")),
                num(m, "len"),
                seq,
                path
            );
        }
        truncated(&mut out, doc, key);
    }
    out
}

/// `addr:port` of a socket (`-` if it is unbound or missing).
fn sock_name(s: Option<&Value>) -> String {
    match s.and_then(|s| s.get("addr")).and_then(Value::as_str) {
        Some(a) => format!("{a}:{}", num(s.expect("has addr"), "port")),
        None => "-".into(),
    }
}

/// `-g`: multicast groups (rdsd's extension): one row per group, one line per member below.
/// The last column is the creator's socket, or `owner ADDR` for a group another host orders
/// (a member host of a group ordered here is a member at `ADDR:65534`).
pub fn groups(doc: &Value) -> String {
    let mut out = String::from("RDS groups:\n");
    let _ = writeln!(
        out,
        "  {:>15} {:>5} {:>6} {:>7} {:>10} {:>10} {:>10} {:>9} {:>9} {:>21}",
        "GroupAddr",
        "GPort",
        "Epoch",
        "Members",
        "LastSeq",
        "Sends",
        "Deliveries",
        "DropsFull",
        "Filtered",
        "Creator"
    );
    for g in list(doc, "groups") {
        let members = list(g, "members");
        let _ = writeln!(
            out,
            "  {:>15} {:>5} {:>6} {:>7} {:>10} {:>10} {:>10} {:>9} {:>9} {:>21}",
            field(g, "addr"),
            num(g, "port"),
            num(g, "epoch"),
            members.len() as u64 + num(g, "members_truncated"),
            num(g, "last_seq"),
            num(g, "sends"),
            num(g, "deliveries"),
            num(g, "drops_full"),
            num(g, "filtered"),
            match g.get("owner").and_then(Value::as_str) {
                // A group another host orders, mirrored here for its local members.
                Some(owner) => format!("owner {owner}"),
                None => sock_name(g.get("creator").filter(|c| !c.is_null())),
            },
        );
        for m in members {
            let flags: Vec<&str> = ["loopback", "drop_when_full"]
                .into_iter()
                .filter(|k| m.get(*k) == Some(&Value::Bool(true)))
                .collect();
            let _ = writeln!(
                out,
                "      member {:<21} flags {:<23} pid {:<8} filter {}",
                sock_name(Some(m)),
                if flags.is_empty() {
                    "-".to_string()
                } else {
                    flags.join(",")
                },
                field(m, "pid"),
                field(m, "filter"),
            );
        }
        let n = num(g, "members_truncated");
        if n > 0 {
            let _ = writeln!(
                out,
                "      ... {n} more member(s) not shown (past rdsd's listing limits)"
            );
        }
    }
    truncated(&mut out, doc, "groups");
    out
}

/// The counters of an Info document as Prometheus text.
pub fn prometheus(doc: &Value) -> String {
    let help = doc.get("counter_help").and_then(Value::as_object);
    let counters: Vec<(&str, u64, &str)> = doc
        .get("counters")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    let h = help
                        .and_then(|h| h.get(k))
                        .and_then(Value::as_str)
                        .unwrap_or("rdsd counter");
                    (k.as_str(), v.as_u64().unwrap_or(0), h)
                })
                .collect()
        })
        .unwrap_or_default();
    let r = doc.get("rdsd");
    let version = r.and_then(|r| r.get("version")).and_then(Value::as_str);
    let start = r
        .and_then(|r| r.get("start_time_unix"))
        .and_then(Value::as_f64);
    let mut text = shm_api::ctrl::prometheus_text(&counters, version.zip(start));
    // Each poll thread's (an rdsd older than them sends none).
    if let Some(per) = doc.get("thread_counters").and_then(Value::as_array) {
        text.push_str(&shm_api::ctrl::prometheus_thread_text(
            per.len(),
            |k, name| per[k].get(name).and_then(Value::as_u64).unwrap_or(0),
        ));
    }
    text
}

/// What `rdsctl threads` shows of each poll thread's counters: (column, counters summed).
const THREAD_COLUMNS: [(&str, &[&str]); 9] = [
    ("passes", &["poll_passes"]),
    ("parks", &["poll_parks"]),
    ("local", &["loop_delivered"]),
    (
        "net out",
        &["tcp_tx_messages", "dpdk_tx_messages", "rdma_tx_messages"],
    ),
    (
        "net in",
        &["tcp_delivered", "dpdk_delivered", "rdma_delivered"],
    ),
    ("cross out", &["shard_records_out"]),
    ("cross in", &["shard_records_in"]),
    // Steady traffic makes neither (ARCHITECTURE.md, "Quiet fast path"): a rate above 0 under
    // a steady load says which thread does what it should not.
    ("allocs", &["poll_allocations"]),
    ("locks", &["poll_locks"]),
];

/// The poll threads of `after` (an Info document with the `threads` section), with their
/// counters' growth since `before` (the same rdsd, earlier), or, without `before`, since
/// rdsd started. `None`: the document has no such section (an rdsd
/// older than it).
pub fn thread_rows(before: Option<&Value>, after: &Value) -> Option<Vec<Value>> {
    let now = after.get("threads")?.as_array()?;
    let was = before
        .and_then(|b| b.get("threads"))
        .and_then(Value::as_array);
    let counter = |t: Option<&Value>, k: &str| {
        t.and_then(|t| t.pointer(&format!("/counters/{k}")))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    Some(
        now.iter()
            .enumerate()
            .map(|(k, t)| {
                let old = was.and_then(|w| w.get(k));
                let mut grown = serde_json::Map::new();
                for (name, v) in t.get("counters").and_then(Value::as_object).into_iter().flatten() {
                    let d = v.as_u64().unwrap_or(0).saturating_sub(counter(old, name));
                    if d > 0 {
                        grown.insert(name.clone(), d.into());
                    }
                }
                let grew = |k: &str| grown.get(k).and_then(Value::as_u64).unwrap_or(0);
                let (busy, passes) = (grew("poll_busy_passes"), grew("poll_passes"));
                serde_json::json!({
                    "thread": t.get("thread"), "cpu": t.get("cpu"), "apps": t.get("apps"),
                    "sockets": t.get("sockets"), "connections": t.get("connections"),
                    "groups": t.get("groups"),
                    "busy_percent": if passes > 0 { 100.0 * busy as f64 / passes as f64 } else { 0.0 },
                    "counters": grown,
                })
            })
            .collect(),
    )
}

/// `rdsctl threads`: a row per poll thread ([`thread_rows`]); rates per second over `secs`,
/// or totals since rdsd started when `secs` is 0.
pub fn threads(rows: &[Value], secs: f64) -> String {
    let mut out = if secs > 0.0 {
        format!("RDS poll threads (per second, over {secs:.2} s):\n")
    } else {
        String::from("RDS poll threads (totals since rdsd started):\n")
    };
    let _ = write!(
        out,
        "  {:>6} {:>4} {:>5} {:>7} {:>5} {:>6} {:>6}",
        "Thread", "Cpu", "Apps", "Sockets", "Conns", "Groups", "Busy%"
    );
    for (name, _) in THREAD_COLUMNS {
        let _ = write!(out, " {:>10}", name.replace(' ', ""));
    }
    out.push('\n');
    for r in rows {
        let _ = write!(
            out,
            "  {:>6} {:>4} {:>5} {:>7} {:>5} {:>6} {:>6.1}",
            field(r, "thread"),
            field(r, "cpu"),
            field(r, "apps"),
            field(r, "sockets"),
            field(r, "connections"),
            field(r, "groups"),
            r.get("busy_percent").and_then(Value::as_f64).unwrap_or(0.0),
        );
        for (_, names) in THREAD_COLUMNS {
            let n: u64 = names
                .iter()
                .map(|k| {
                    r.pointer(&format!("/counters/{k}"))
                        .and_then(Value::as_u64)
                        .unwrap_or(0)
                })
                .sum();
            let v = if secs > 0.0 {
                (n as f64 / secs).round() as u64
            } else {
                n
            };
            let _ = write!(out, " {v:>10}");
        }
        out.push('\n');
    }
    out.push_str(
        "  (Busy%: passes that found work; local: deliveries between sockets of this host; net \
         out/in: messages written to / delivered from the network; cross out/in: records put \
         into / taken from other poll threads' pair rings; allocs, locks: heap allocations and \
         rdsd locks, none in steady traffic.)\n",
    );
    out
}

/// The one-line identity of rdsd for `status`.
pub fn identity(doc: &Value) -> String {
    let r = doc.get("rdsd").cloned().unwrap_or(Value::Null);
    let addrs = list(&r, "local_addrs")
        .iter()
        .filter_map(Value::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    let cpu = |v: &Value| {
        v.as_u64()
            .map_or("unpinned".to_string(), |c| format!("cpu {c}"))
    };
    // An rdsd older than these fields sends none.
    let threads = match list(&r, "poll_cpus") {
        [] => String::new(),
        polls => format!(
            ", {} poll thread{} ({}; idle {}), control thread {}",
            polls.len(),
            if polls.len() == 1 { "" } else { "s" },
            polls.iter().map(cpu).collect::<Vec<_>>().join(", "),
            field(&r, "idle"),
            cpu(r.get("control_cpu").unwrap_or(&Value::Null)),
        ),
    };
    format!(
        "pid {}, version {}, up {} s, local addresses {}{}{}",
        field(&r, "pid"),
        field(&r, "version"),
        field(&r, "uptime_s"),
        if addrs.is_empty() { "-" } else { &addrs },
        threads,
        match r.get("metrics_listen").and_then(Value::as_str) {
            Some(m) => format!(", metrics at http://{m}/metrics"),
            None => String::new(),
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc() -> Value {
        json!({
            "schema": 1,
            "rdsd": {"version": "0.1.0", "pid": 42, "uptime_s": 1.5, "start_time_unix": 100.0,
                     "local_addrs": ["10.0.0.1/32", "127.0.0.0/8"], "metrics_listen": null},
            "counters": {"apps_attached": 2, "tcp_delivered": 7},
            "counter_help": {"apps_attached": "Processes that attached.", "tcp_delivered": "D."},
            "sockets": [{"app": 1, "slot": 0, "pid": 99, "uid": 0, "addr": "10.0.0.1",
                         "port": 4000, "rcvbuf": 106496, "sndbuf": 106496,
                         "rx_queued_bytes": 300, "rx_pending": true, "tx_queued_bytes": 0,
                         "congested": false, "cong_monitor": true, "pollable": false},
                        {"app": 1, "slot": 1, "addr": null, "port": 0}],
            "sockets_truncated": 3,
            "connections": [{"transport": "tcp", "laddr": "10.0.0.1", "faddr": "10.0.0.2",
                "state": "up", "active": true, "generation": 5, "peer_generation": 6, "shard": 1,
                "npaths": 8, "paths": [{"index": 0, "state": "up", "next_tx_seq": 12,
                "next_rx_seq": 9, "queued_msgs": 1, "unacked_msgs": 2, "tx_stream_bytes": 500,
                "unacked_bytes": 96, "rx_paused": false, "local_port": 40001,
                "peer_port": 16385}]}],
            "recv_queue": {"sockets": 1, "bytes": 300, "entries": [{"addr": "10.0.0.1",
                "port": 4000, "pid": 99, "bytes": 300, "congested": false}]},
            "send_queue": {"sockets": 0, "socket_bytes": 0, "paths": 1, "msgs": 1,
                "entries": [{"path": {"transport": "tcp", "laddr": "10.0.0.1",
                "faddr": "10.0.0.2", "index": 0}, "msgs": 1}]},
            "retransmit_queue": {"paths": 1, "msgs": 2, "bytes": 96, "entries": [
                {"transport": "tcp", "laddr": "10.0.0.1", "faddr": "10.0.0.2", "index": 0,
                 "msgs": 2, "bytes": 96}]},
            "groups": [{"shard": 0, "addr": "239.1.2.3", "port": 5000, "epoch": 4,
                "creator": {"app": 1, "slot": 0, "pid": 99, "addr": "10.0.0.1", "port": 4000},
                "members": [
                    {"app": 1, "slot": 1, "pid": 99, "addr": "10.0.0.1", "port": 4001,
                     "flags": 0, "loopback": false, "drop_when_full": false, "filter": "all"},
                    {"app": 2, "slot": 0, "pid": 100, "addr": "10.0.0.1", "port": 4002,
                     "flags": 3, "loopback": true, "drop_when_full": true,
                     "filter": "only 10.0.0.1/32:4000"}],
                "members_truncated": 5,
                "last_seq": 12, "sends": 12, "deliveries": 20, "drops_full": 3, "filtered": 1},
                {"shard": 1, "addr": "239.1.2.4", "port": 1, "epoch": 1, "creator": null,
                 "members": [], "last_seq": 0, "sends": 0, "deliveries": 0, "drops_full": 0,
                 "filtered": 0}],
            "groups_truncated": 2
        })
    }

    #[test]
    fn tables_show_every_row_and_column() {
        let d = doc();
        let c = counters(&d);
        assert!(
            c.lines()
                .any(|l| l.split_whitespace().eq(["apps_attached", "2"])),
            "{c}"
        );
        let k = sockets(&d);
        let row: Vec<&str> = k.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            ["10.0.0.1", "4000", "106496", "106496", "300", "0", "-", "yes", "99", "1/0"]
        );
        assert!(
            k.lines().nth(3).unwrap().trim_start().starts_with("- "),
            "{k}"
        );
        assert!(k.contains("3 more not shown"), "{k}");
        let n = connections(&d);
        let row: Vec<&str> = n.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            ["10.0.0.1", "10.0.0.2", "tcp", "up", "yes", "8", "5", "6", "1"]
        );
        let p = paths(&d);
        let row: Vec<&str> = p.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            [
                "10.0.0.1",
                "10.0.0.2",
                "0",
                "up",
                "12",
                "9",
                "1",
                "2",
                "96",
                "-",
                "40001>16385"
            ]
        );
        assert!(recv_queue(&d).starts_with("Receive queue: 1 socket(s), 300 byte(s) unread\n"));
        let mut backed = d.clone();
        backed["recv_queue"]["entries"][0]["backlog_bytes"] = json!(9 << 20);
        backed["recv_queue"]["entries"][0]["backed_up"] = json!(true);
        assert!(recv_queue(&backed).contains(
            "300 bytes (9437184 in rdsd's backlog)  pid 99  backed up (its senders wait)"
        ));
        assert!(send_queue(&d).contains("1 message(s) queued on 1 path(s)"));
        assert!(send_queue(&d).contains("#0 (tcp)"));
        assert!(retransmit_queue(&d)
            .starts_with("Retransmit queue: 2 message(s), 96 byte(s) unacknowledged on 1 path(s)"));
        let g = groups(&d);
        let rows: Vec<Vec<&str>> = g.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(rows[0], ["RDS", "groups:"]);
        assert_eq!(
            rows[2],
            [
                "239.1.2.3",
                "5000",
                "4",
                "7",
                "12",
                "12",
                "20",
                "3",
                "1",
                "10.0.0.1:4000"
            ],
            "{g}"
        );
        assert_eq!(
            rows[3],
            [
                "member",
                "10.0.0.1:4001",
                "flags",
                "-",
                "pid",
                "99",
                "filter",
                "all"
            ]
        );
        assert_eq!(
            rows[4],
            [
                "member",
                "10.0.0.1:4002",
                "flags",
                "loopback,drop_when_full",
                "pid",
                "100",
                "filter",
                "only",
                "10.0.0.1/32:4000"
            ]
        );
        assert!(
            g.lines()
                .nth(5)
                .unwrap()
                .contains("5 more member(s) not shown"),
            "{g}"
        );
        assert_eq!(
            rows[6],
            ["239.1.2.4", "1", "1", "0", "0", "0", "0", "0", "0", "-"]
        );
        assert!(
            g.lines().nth(7).unwrap().contains("2 more not shown"),
            "{g}"
        );
    }

    #[test]
    fn missing_sections_and_fields_do_not_fail() {
        let d = json!({"schema": 1});
        assert_eq!(sockets(&d).lines().count(), 2);
        assert_eq!(paths(&d).lines().count(), 2);
        assert_eq!(groups(&d).lines().count(), 2);
        assert!(recv_queue(&d).starts_with("Receive queue: 0 socket(s)"));
        assert!(identity(&d).contains("pid -"));
    }

    #[test]
    fn prometheus_and_identity() {
        let d = doc();
        let p = prometheus(&d);
        assert!(p.contains("# HELP rdsd_apps_attached_total Processes that attached.\n"));
        assert!(p.contains("# TYPE rdsd_tcp_delivered_total counter\nrdsd_tcp_delivered_total 7\n"));
        assert!(p.contains("rdsd_build_info{version=\"0.1.0\"} 1\n"));
        let i = identity(&d);
        assert_eq!(
            i,
            "pid 42, version 0.1.0, up 1.5 s, local addresses 10.0.0.1/32, 127.0.0.0/8"
        );
        // Where the threads run, when rdsd says.
        let mut d = d;
        d["rdsd"]["poll_cpus"] = json!([3, null]);
        d["rdsd"]["control_cpu"] = json!(0);
        d["rdsd"]["idle"] = json!("spin");
        assert_eq!(
            identity(&d),
            "pid 42, version 0.1.0, up 1.5 s, local addresses 10.0.0.1/32, 127.0.0.0/8, \
             2 poll threads (cpu 3, unpinned; idle spin), control thread cpu 0"
        );
    }

    #[test]
    fn an_rdma_path_shows_its_queue_pair() {
        let d = json!({"connections": [{"transport": "rdma", "laddr": "10.77.0.1",
            "faddr": "10.77.0.2", "paths": [{"index": 0, "state": "up", "next_tx_seq": 3,
            "next_rx_seq": 2, "queued_msgs": 0, "unacked_msgs": 0, "unacked_bytes": null,
            "rx_paused": false, "local_port": null, "peer_port": null,
            "rdma": {"src_gid": "::ffff:10.77.0.1", "dst_gid": "::ffff:10.77.0.2",
                "max_send_wr": 321, "max_recv_wr": 64, "max_send_sge": 2}}]}]});
        let p = paths(&d);
        let lines: Vec<&str> = p.lines().collect();
        assert!(lines[2].trim_start().starts_with("10.77.0.1"), "{p}");
        assert_eq!(
            lines[3].trim(),
            "rdma gid ::ffff:10.77.0.1 > ::ffff:10.77.0.2, send_wr 321, recv_wr 64, send_sge 2"
        );
    }
}
