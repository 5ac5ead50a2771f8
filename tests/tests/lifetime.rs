//! App and daemon lifetime: a SIGKILLed app releases everything at once, rdsd's death is a
//! clear error (not a hang) and apps attach again when it is back, SIGTERM is a clean stop.

use rdsd_tests::*;
use std::time::{Duration, Instant};

#[test]
fn sigkilled_app_mid_traffic_releases_ports_at_once_and_others_are_unaffected() {
    let d = Daemon::start(&[]);
    let r = d.attach();
    // The flood target never reads: the flooder is mid-send (congested, retrying) when killed.
    let sink = r.socket().unwrap();
    sink.bind(lo(9300)).unwrap();
    let mut flood = d.app(&["flood", "127.0.0.1:9301", "127.0.0.1:9300"]);
    flood.expect("flooding");
    let mut holder = d.app(&["hold", "127.0.0.1:9302"]);
    holder.expect("bound");
    // A healthy pair in this process.
    let a = r.socket().unwrap();
    let b = r.socket().unwrap();
    a.bind(lo(9310)).unwrap();
    b.bind(lo(9311)).unwrap();
    wait_for(
        || d.stat("loop_delivered") > 100,
        Duration::from_secs(10),
        "flood traffic",
    );
    let detached = d.stat("apps_detached");
    flood.kill();
    holder.kill();
    // Both ports are free again within moments: a new process can bind them.
    let t = Instant::now();
    let again = r.socket().unwrap();
    wait_until(
        Duration::from_secs(10),
        "port 9301 to be free again",
        || again.bind(lo(9301)),
        Result::is_ok,
    )
    .expect("bound");
    let mut p2 = d.app(&["hold", "127.0.0.1:9302"]);
    p2.expect("bound");
    eprintln!("port reusable after {:?}", t.elapsed());
    // Exactly the two killed apps (reading counters does not attach).
    wait_until(
        Duration::from_secs(10),
        "both killed apps to be detached",
        || d.stat("apps_detached"),
        |&n| n == detached + 2,
    );
    // The healthy pair never noticed.
    let mut buf = [0u8; 64];
    b.set_recv_timeout(Some(Duration::from_secs(5))).unwrap();
    for i in 0..100u64 {
        a.send_to(&seq_payload(i, 32), lo(9311)).unwrap();
        let (n, _) = b.recv_from(&mut buf).unwrap();
        assert_eq!(payload_seq(&buf[..n]), i);
    }
}

#[test]
fn rdsd_death_is_a_clear_error_and_apps_reattach_after_restart() {
    let mut d = Daemon::start(&[]);
    let mut app = d.app(&["block-recv", "127.0.0.1:9400"]);
    app.expect("waiting");
    // Kill rdsd only once the app really blocks in its receive (on the slot's futex).
    let pid = app.child.id();
    wait_for(
        || blocked_on_futex(pid),
        Duration::from_secs(10),
        "the app to block in recv",
    );
    d.kill();
    let gone = app.expect("gone after");
    let ms: u64 = gone.split_whitespace().next().unwrap().parse().unwrap();
    assert!(ms < 3000, "blocked recv noticed rdsd's death late: {gone}");
    assert!(gone.contains("rdsd is gone"), "clear message: {gone}");
    d.spawn();
    app.expect("reattached");
    app.expect("roundtrip ok");
    assert_eq!(app.wait(), 0);
}

#[test]
fn nonblocking_calls_report_a_dead_rdsd() {
    let mut d = Daemon::start(&[]);
    let r = d.attach();
    let a = r.socket().unwrap();
    a.bind(lo(9450)).unwrap();
    d.kill();
    let mut buf = [0u8; 8];
    let e = a
        .recv_msg(
            &mut buf,
            shm_api::RecvFlags {
                dontwait: true,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(shm_api::is_daemon_gone(&e), "{e}");
    assert!(shm_api::is_daemon_gone(&r.socket().unwrap_err()));
}

#[test]
fn sigterm_stops_rdsd_cleanly() {
    let mut d = Daemon::start(&[]);
    let _r = d.attach();
    d.signal(libc::SIGTERM);
    let mut child = d.child.take().unwrap();
    let status = wait_until(
        Duration::from_secs(10),
        "rdsd to exit on SIGTERM",
        || child.try_wait().unwrap(),
        Option::is_some,
    )
    .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!d.socket.exists(), "control socket removed on shutdown");
}

#[test]
fn second_rdsd_on_the_same_socket_refuses_to_start() {
    let d = Daemon::start(&[]);
    let out = std::process::Command::new(rdsd_bin())
        .args([
            "--poll-core",
            "-2",
            "--control-core",
            "-2",
            "--control-socket",
        ])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already serving"));
    assert!(d.attach().is_alive(), "the first one is untouched");
}

#[test]
fn bad_configuration_is_a_clear_error() {
    let f = std::env::temp_dir().join(format!("rdsd-bad-{}.toml", std::process::id()));
    std::fs::write(&f, "idle = \"sometimes\"\n").unwrap();
    let out = std::process::Command::new(rdsd_bin())
        .arg("--config")
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("idle"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(f);
}

/// After a SIGKILL and restart, a message for a port an app had bound before waits (the rebind
/// grace) until an app binds the port again, instead of being dropped as sent to an unbound
/// port; with `rebind_grace_ms = 0` it is dropped. Ephemeral ports are not waited for.
#[test]
fn messages_for_a_port_bound_before_a_restart_wait_for_its_app() {
    for (grace, kept) in [(2000, true), (0, false)] {
        let cfg = config_file(&format!("rebind_grace_ms = {grace}\n"));
        let cfg = cfg.to_str().unwrap();
        let mut d = Daemon::start(&["-c", cfg]);
        let ephemeral = {
            let r = d.attach();
            let s = r.socket().unwrap();
            s.bind(lo(9460)).unwrap();
            let e = r.socket().unwrap();
            e.bind(lo(0)).unwrap();
            d.kill();
            e.local_addr().unwrap()
        };
        d.spawn();
        let r = d.attach();
        let tx = r.socket().unwrap();
        tx.bind(lo(9461)).unwrap();
        tx.set_nonblocking(true).unwrap();
        tx.send_to(b"sent before the rebind", lo(9460)).unwrap();
        // The ephemeral port is not waited for: dropped at once.
        let tx2 = r.socket().unwrap();
        tx2.bind(lo(9462)).unwrap();
        tx2.send_to(b"to a dead ephemeral port", ephemeral).unwrap();
        // Both messages reached their unbound ports: with the grace, one held and the
        // ephemeral one dropped; without it, both dropped.
        let (held, dropped) = wait_until(
            Duration::from_secs(10),
            "both messages to reach their unbound ports",
            || (d.stat("rx_held_for_rebind"), d.stat("drop_unbound_dest")),
            |&(held, dropped)| {
                if kept {
                    held >= 1 && dropped == 1
                } else {
                    dropped == 2
                }
            },
        );
        eprintln!("grace {grace} ms: rx_held_for_rebind {held}, drop_unbound_dest {dropped}");
        let rx = r.socket().unwrap();
        rx.bind(lo(9460)).unwrap();
        rx.set_recv_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = [0u8; 64];
        let got = rx.recv_from(&mut buf);
        if kept {
            let (n, from) = got.expect("the held message");
            assert_eq!(
                (&buf[..n], from),
                (&b"sent before the rebind"[..], lo(9461))
            );
            assert_eq!(d.stat("drop_unbound_dest"), 1, "only the ephemeral port's");
        } else {
            assert!(got.is_err(), "dropped with the grace off");
            assert_eq!(d.stat("drop_unbound_dest"), 2);
            assert_eq!(d.stat("rx_held_for_rebind"), 0);
        }
    }
}

/// This test process's CPUs (`Cpus_allowed_list` of /proc/self/status), ascending.
fn own_cpus() -> Vec<usize> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list")
        .trim();
    let mut cpus = Vec::new();
    for part in list.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap());
    }
    cpus
}

/// The CPUs thread `tid` of `pid` may run on, as the kernel lists them.
fn thread_cpus(pid: u32, tid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

/// Confined to one CPU other than CPU 0 (as taskset, a cgroup cpuset or systemd's
/// `CPUAffinity=` confine a daemon), rdsd on its embedded default pins its control and poll
/// threads inside that set (with a warning that they share it), and refuses a CPU outside it;
/// two poll threads on one CPU are refused however they are spelled.
#[test]
fn threads_are_pinned_inside_the_cpu_set_rdsd_is_given() {
    let cpus = own_cpus();
    assert!(
        cpus.len() >= 2,
        "this test confines rdsd to a CPU other than the first: it needs 2 CPUs, has {cpus:?}"
    );
    let last = cpus[cpus.len() - 1].to_string();
    let sock = std::env::temp_dir().join(format!("rdsd-cpuset-{}.sock", std::process::id()));
    let mut child = std::process::Command::new("taskset")
        .args(["-c", &last])
        .arg(rdsd_bin())
        .args(["--hugepages", "off", "--log", "info", "--control-socket"])
        .arg(&sock)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("taskset (util-linux) runs rdsd");
    // taskset execs rdsd: the child's pid is rdsd's.
    let pid = child.id();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut log = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(log
        .iter()
        .any(|l: &String| l.contains("poll thread 0 pinned"))
        && log.iter().any(|l| l.contains("control thread pinned")))
    {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => log.push(l),
            Err(_) => panic!("rdsd did not pin its threads: {log:#?}"),
        }
    }
    let shared = log
        .iter()
        .any(|l| l.contains("shares its CPU with poll thread 0"));
    let pinned_at = |what: &str| {
        log.iter()
            .find(|l| l.contains(what))
            .is_some_and(|l| l.ends_with(&format!("cpu={last}")))
    };
    let mut seen = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let tid = t.unwrap().file_name().into_string().unwrap();
        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap();
        seen.push((comm.trim().to_string(), thread_cpus(pid, &tid)));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&sock);
    assert!(pinned_at("poll thread 0 pinned"), "{log:#?}");
    assert!(pinned_at("control thread pinned"), "{log:#?}");
    assert!(shared, "the shared CPU is named: {log:#?}");
    assert!(
        seen.iter().all(|(_, c)| *c == last),
        "every thread on cpu {last}: {seen:?}"
    );

    let refused = |pre: &[&str], args: &[&str]| {
        let mut cmd = if pre.is_empty() {
            std::process::Command::new(rdsd_bin())
        } else {
            let mut c = std::process::Command::new("taskset");
            c.args(pre).arg(rdsd_bin());
            c
        };
        let out = cmd
            .args(["--hugepages", "off", "--control-socket"])
            .arg(&sock)
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} started");
        assert!(!sock.exists(), "{args:?}: nothing served");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = refused(&["-c", &last], &["--poll-core", "0"]);
    assert!(
        e.contains("cpu 0 is not one this process may run on") && e.contains(&last),
        "{e}"
    );
    let e = refused(&["-c", &last], &["--control-core", "0"]);
    assert!(
        e.contains("control_core") && e.contains("cpu 0 is not"),
        "{e}"
    );
    let e = refused(&[], &["--poll-core", &last, "--poll-core", "-1"]);
    assert!(
        e.contains("poll threads 0 and 1 both to cpu") && e.contains(&last),
        "{e}"
    );
}
