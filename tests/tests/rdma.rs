//! rdsd's RDMA transport (`dataplane/src/transport/rdma`) for real, over Soft-RoCE, in the VM
//! lab: **two guests** (Debian's 6.1 kernel under qemu TCG) joined by a point-to-point qemu
//! socket network inside a namespace made by the test. Each guest loads `rdma_rxe` (after
//! `crc32_generic`), `ib_uverbs` and `rdma_ucm`, adds `rxe0` on its virtio NIC with
//! `rdma link add`, and runs rdsd with an `[rdma]` section. The initramfs carries rdsd, this
//! test binary (it is the guest app too: the ignored test `guest_app`), `ibv_rc_pingpong`,
//! `rdma`, every shared library they load (ld-linux, libc, libibverbs, librdmacm, libnl, DPDK's
//! libraries that rdsd links) and the rxe provider with `/etc/libibverbs.d/rxe.driver`.
//!
//! Guest A (10.77.0.1, the receiver) and guest B (10.77.0.2, the sender): A has the smaller
//! address, so A's rdsd connects (the smaller-address rule). B's app sends messages of 0, 1,
//! 4096, 4097, 65536 and 1 MiB bytes plus a run of small ones to A; A's app checks every
//! length, every byte and the order, then answers `done`.
//!
//! Needs root (namespace), qemu-system-x86, busybox-static, the cached kernel and rdma-core's
//! packages (tests/run.sh installs them). Without qemu the tests print `SKIPPED` loudly.

use rdsd_tests::vmlab;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SIZES: &[usize] = &[0, 1, 4096, 4097, 65536, 1 << 20];
/// Rounds of SIZES.
const ROUNDS: u64 = 3;
/// Small messages after the rounds (more than the receive credits, to make them cycle).
const SMALL: u64 = 400;
/// Round trips timed in `lab.mode=lat`.
const LAT_ROUNDS: usize = 200;

fn msg_len(i: u64) -> usize {
    let big = SIZES.len() as u64 * ROUNDS;
    if i < big {
        SIZES[(i % SIZES.len() as u64) as usize]
    } else {
        100
    }
}

fn payload(i: u64) -> Vec<u8> {
    (0..msg_len(i))
        .map(|j| ((i * 7 + j as u64 * 13) % 251) as u8)
        .collect()
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"))
}

/// The app inside each guest (run by the guest's /init; ignored on the host).
#[test]
#[ignore = "runs inside an RDMA lab guest only (LAB_ROLE set by the guest's /init)"]
fn guest_app() {
    let Ok(role) = std::env::var("LAB_ROLE") else {
        eprintln!("guest_app: LAB_ROLE not set; this runs inside the VM lab only");
        return;
    };
    let me: Ipv4Addr = env("LAB_ADDR").parse().unwrap();
    let peer: Ipv4Addr = env("LAB_PEER").parse().unwrap();
    let rdsd = shm_api::Rdsd::attach().expect("attach to rdsd");
    let total = SIZES.len() as u64 * ROUNDS + SMALL;
    let mut buf = vec![0u8; (1 << 20) + 16];
    let socks: u64 = env("LAB_SOCKS").parse().unwrap();
    let slow = std::env::var("LAB_MODE").is_ok_and(|m| m == "slow");
    let cut = std::env::var("LAB_MODE").is_ok_and(|m| m == "cut");
    let lat = std::env::var("LAB_MODE").is_ok_and(|m| m == "lat");
    match role.as_str() {
        "recv" => {
            let s = rdsd.socket().unwrap();
            s.set_recv_buffer_size(16 << 20).unwrap();
            s.bind(SocketAddrV4::new(me, 4000)).unwrap();
            s.set_recv_timeout(Some(Duration::from_secs(90))).unwrap();
            // "ready" until the first message arrives (a message to an unbound port is
            // dropped, as in the kernel, so the sender waits for this).
            let ctl = rdsd.socket().unwrap();
            ctl.bind(SocketAddrV4::new(me, 4002)).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let st = stop.clone();
            let r2 = rdsd.clone();
            let pinger = std::thread::spawn(move || {
                let ping = r2.socket().unwrap();
                ping.bind(SocketAddrV4::new(me, 4003)).unwrap();
                while !st.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = ping.send_to(b"ready", SocketAddrV4::new(peer, 4001));
                    std::thread::sleep(Duration::from_millis(500));
                }
            });
            let t0 = Instant::now();
            let mut bytes = 0u64;
            // Per sending socket (source port 5000 + k), the next message index it owes us.
            let mut next: Vec<u64> = (0..socks).collect();
            for got in 0..total {
                let (n, from) = s
                    .recv_from(&mut buf)
                    .unwrap_or_else(|e| panic!("recv #{got}: {e}"));
                if got == 0 {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                    if slow {
                        // A slow receiver: the rx ring (2 MiB) fills, the path pauses and
                        // stops granting credits, the sender stalls, then everything resumes.
                        std::thread::sleep(Duration::from_secs(4));
                    }
                }
                assert_eq!(*from.ip(), peer, "message #{got} source");
                let k = u64::from(from.port())
                    .checked_sub(5000)
                    .filter(|&k| k < socks)
                    .unwrap_or_else(|| panic!("message #{got} from unexpected port {from}"));
                let i = next[k as usize];
                assert_eq!(
                    n,
                    msg_len(i),
                    "message {i} (socket {k}): length (lost or reordered?)"
                );
                assert!(buf[..n] == payload(i)[..], "message {i}: payload differs");
                next[k as usize] += socks;
                bytes += n as u64;
            }
            let secs = t0.elapsed().as_secs_f64();
            println!("RESULT recv ok messages={total} bytes={bytes} secs={secs:.2}");
            pinger.join().unwrap();
            for _ in 0..5 {
                let _ = ctl.send_to(b"done", SocketAddrV4::new(peer, 4001));
                std::thread::sleep(Duration::from_millis(200));
            }
            // A duplicate would show up here.
            s.set_recv_timeout(Some(Duration::from_secs(2))).unwrap();
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                panic!("an extra message of {n} bytes arrived (duplicate)");
            }
            println!("RESULT no-duplicates");
            if lat {
                // Echo LAT_ROUNDS small messages for the sender's round-trip times.
                s.set_recv_timeout(Some(Duration::from_secs(60))).unwrap();
                for _ in 0..LAT_ROUNDS {
                    let (n, from) = s.recv_from(&mut buf).expect("a ping");
                    s.send_to(&buf[..n], from).expect("echo");
                }
                println!("RESULT echoed {LAT_ROUNDS}");
            }
        }
        "send" => {
            let s = rdsd.socket().unwrap();
            s.set_recv_timeout(Some(Duration::from_secs(90))).unwrap();
            s.bind(SocketAddrV4::new(me, 4001)).unwrap();
            let senders: Vec<shm_api::Socket> = (0..socks)
                .map(|k| {
                    let t = rdsd.socket().unwrap();
                    t.set_send_buffer_size(16 << 20).unwrap();
                    t.bind(SocketAddrV4::new(me, 5000 + k as u16)).unwrap();
                    t
                })
                .collect();
            // A second run (restart mode) may first see the previous receiver's late `done`s.
            loop {
                let (n, _) = s.recv_from(&mut buf).expect("the receiver's ready");
                match &buf[..n] {
                    b"ready" => break,
                    b"done" => continue,
                    m => panic!("unexpected control message {m:?}"),
                }
            }
            println!("RESULT got ready");
            let t0 = Instant::now();
            let dst = SocketAddrV4::new(peer, 4000);
            for i in 0..total {
                if cut && i == total / 2 {
                    // The link is cut mid-stream: queued and in-flight messages must survive
                    // the QP error, the reconnect and the retransmission, exactly once.
                    let ip = |st: &str| {
                        let ok = std::process::Command::new("ip")
                            .args(["link", "set", "eth0", st])
                            .status()
                            .is_ok_and(|s| s.success());
                        assert!(ok, "ip link set eth0 {st}");
                    };
                    ip("down");
                    println!("RESULT link down at message {i}");
                    std::thread::sleep(Duration::from_secs(4));
                    ip("up");
                    println!("RESULT link up");
                    std::thread::sleep(Duration::from_secs(1));
                    let sys =
                        |p: &str| std::fs::read_to_string(p).unwrap_or_else(|e| e.to_string());
                    println!(
                        "RESULT after the cut: rxe0 port state {:?}, gid1 {:?}",
                        sys("/sys/class/infiniband/rxe0/ports/1/state").trim(),
                        sys("/sys/class/infiniband/rxe0/ports/1/gids/1").trim()
                    );
                }
                let p = payload(i);
                senders[(i % socks) as usize]
                    .send_to(&p, dst)
                    .unwrap_or_else(|e| panic!("send {i}: {e}"));
            }
            println!("RESULT sent {total} in {:.2}s", t0.elapsed().as_secs_f64());
            loop {
                let (n, _) = s.recv_from(&mut buf).expect("the receiver's done");
                if &buf[..n] == b"done" {
                    break;
                }
            }
            println!("RESULT send ok");
            if lat {
                // The receiver checks for duplicates for 2 s after its `done`s, then echoes.
                std::thread::sleep(Duration::from_secs(4));
                let mut rtts = Vec::with_capacity(LAT_ROUNDS);
                for k in 0..LAT_ROUNDS {
                    let ping = [k as u8; 64];
                    let t = Instant::now();
                    s.send_to(&ping, dst).expect("ping");
                    loop {
                        let (n, _) = s.recv_from(&mut buf).expect("echo");
                        if buf[..n] == ping {
                            break;
                        }
                    }
                    rtts.push(t.elapsed().as_micros() as u64);
                }
                rtts.sort_unstable();
                println!(
                    "RESULT rdsd-rdma rtt 64B: min {} us, median {} us, p90 {} us ({LAT_ROUNDS} round trips)",
                    rtts[0],
                    rtts[rtts.len() / 2],
                    rtts[rtts.len() * 9 / 10]
                );
            }
        }
        r => panic!("unknown role {r}"),
    }
}

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /tmp /run/rdsd /dev/shm
mount -t tmpfs tmpfs /dev/shm
for m in $(cat /modules/order); do
    insmod /modules/$m || echo "LAB insmod $m failed"
done
for kv in $(cat /proc/cmdline); do
    case "$kv" in
        lab.role=*) LAB_ROLE=${kv#*=};;
        lab.addr=*) LAB_ADDR=${kv#*=};;
        lab.peer=*) LAB_PEER=${kv#*=};;
        lab.paths=*) LAB_PATHS=${kv#*=};;
        lab.socks=*) LAB_SOCKS=${kv#*=};;
        lab.mode=*) LAB_MODE=${kv#*=};;
    esac
done
export LAB_ROLE LAB_ADDR LAB_PEER LAB_PATHS LAB_SOCKS LAB_MODE
ip link set lo up
ip link set eth0 up
ip addr add $LAB_ADDR/24 dev eth0
if /usr/bin/rdma link add rxe0 type rxe netdev eth0; then echo "LAB rxe up"; else echo "LAB rxe failed"; fi
echo "LAB ibdevs $(ls /sys/class/infiniband/ 2>&1)"
echo "LAB uverbs $(ls /dev/infiniband/ 2>&1)"
# Wait for the peer (ARP) before anything connects.
for i in $(seq 1 60); do ping -c 1 -W 1 $LAB_PEER >/dev/null 2>&1 && break; done
echo "LAB peer reachable"
if [ -n "$LAB_PINGPONG" ] || grep -q lab.pingpong /proc/cmdline; then
    if [ "$LAB_ROLE" = recv ]; then
        /usr/bin/ibv_rc_pingpong -d rxe0 -g 1 -n 5 2>&1 | sed 's/^/LAB pingpong /'
    else
        sleep 3; /usr/bin/ibv_rc_pingpong -d rxe0 -g 1 -n 5 $LAB_PEER 2>&1 | sed 's/^/LAB pingpong /'
    fi
fi
case "$LAB_MODE" in cut|restart) export RDSD_LOG=info,rdsd::transport::rdma=debug;; esac
if [ "$LAB_MODE" = lat ]; then
    # perftest next to rdsd, same guests (TCG: functional figures only).
    for t in ib_send_lat ib_send_bw; do
        if [ "$LAB_ROLE" = recv ]; then
            timeout 60 /usr/bin/$t -d rxe0 -x 1 -n 200 -s 64 -p 18800 2>&1 | grep -E '^ *[0-9]' | sed "s/^/LAB perftest $t /"
        else
            sleep 3; timeout 60 /usr/bin/$t -d rxe0 -x 1 -n 200 -s 64 -p 18800 $LAB_PEER 2>&1 | grep -E '^ *[0-9]' | sed "s/^/LAB perftest $t /"
        fi
    done
fi
printf '[rdma]\n' > /tmp/rdsd.toml
start_rdsd() {
/bin/rdsd --config /tmp/rdsd.toml --control-socket /run/rdsd/rdsd.sock --local-addr $LAB_ADDR/32 --paths $LAB_PATHS --hugepages off >> /tmp/rdsd.log 2>&1 &
RDSD_PID=$!
for i in $(seq 1 120); do [ -S /run/rdsd/rdsd.sock ] && /bin/rdsctl --socket /run/rdsd/rdsd.sock status >/dev/null 2>&1 && break; kill -0 $RDSD_PID 2>/dev/null || break; sleep 0.5; done
if [ -S /run/rdsd/rdsd.sock ]; then echo "LAB rdsd up"; else
    echo "LAB rdsd did not start:"
    sed 's/^/LAB rdsd /' /tmp/rdsd.log
    ( /bin/rdsd --version; echo "exit $?"; timeout 10 /bin/rdsd --config /tmp/rdsd.toml --control-socket /run/rdsd/rdsd.sock --local-addr $LAB_ADDR/32 --paths $LAB_PATHS --hugepages off; echo "exit $?"; ls -l /lib64/ /lib/x86_64-linux-gnu/ | head -50 ) 2>&1 | sed 's/^/LAB rdsd-fg /'
fi
}
start_rdsd
export RDSD_SOCKET=/run/rdsd/rdsd.sock
/bin/rdmatest guest_app --ignored --exact --nocapture --test-threads 1 2>&1 | sed 's/^/LAB app /'
echo "LAB app-done"
if [ "$LAB_MODE" = restart ]; then
    # The receiver's rdsd dies (SIGKILL) and comes back; a second stream follows.
    if [ "$LAB_ROLE" = recv ]; then
        kill -9 $RDSD_PID; sleep 1; start_rdsd; echo "LAB rdsd restarted"
    fi
    /bin/rdmatest guest_app --ignored --exact --nocapture --test-threads 1 2>&1 | sed 's/^/LAB app2 /'
    echo "LAB app2-done"
fi
if [ "$LAB_MODE" = restart ] || [ "$LAB_MODE" = cut ]; then
    ip neigh show 2>&1 | sed 's/^/LAB neigh /'
    /usr/bin/rdma resource show cm_id 2>&1 | sed 's/^/LAB cm_id /'
    /usr/bin/rdma resource show qp 2>&1 | sed 's/^/LAB qp /'
    dmesg | tail -n 20 | sed 's/^/LAB dmesg /'
fi
if [ "$LAB_MODE" = cut ]; then
    # Does Soft-RoCE itself still connect after the link flap?
    if [ "$LAB_ROLE" = recv ]; then
        timeout 30 /usr/bin/ibv_rc_pingpong -d rxe0 -g 1 -n 5 -p 18700 2>&1 | sed 's/^/LAB post-cut pingpong /'
    else
        sleep 5; timeout 25 /usr/bin/ibv_rc_pingpong -d rxe0 -g 1 -n 5 -p 18700 $LAB_PEER 2>&1 | sed 's/^/LAB post-cut pingpong /'
    fi
fi
/bin/rdsctl --socket /run/rdsd/rdsd.sock info -p 2>&1 | sed 's/^/LAB paths /'
/bin/rdsctl --socket /run/rdsd/rdsd.sock stats 2>&1 | grep -E '^(rdma|tcp)_|^rx_(paused|resumed) ' | sed 's/^/LAB stat /'
grep -v 'rdma: path event.*PassivePending' /tmp/rdsd.log | sed 's/^/LAB rdsd /' | tail -n 60
[ "$LAB_MODE" = cut ] && cp /tmp/rdsd.log /dev/null && sed 's/^/LAB full /' /tmp/rdsd.log | head -150
echo "LAB end"
poweroff -f
"#;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn build_initrd(dir: &Path, k: &vmlab::Kernel) -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let rdsd = rdsd_tests::rdsd_bin();
    assert!(
        rdsd.exists(),
        "{} missing: cargo build --workspace --bins",
        rdsd.display()
    );
    let which = |b: &str| -> PathBuf {
        ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
            .iter()
            .map(|d| Path::new(d).join(b))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{b} missing (apt-get install iproute2 ibverbs-utils)"))
    };
    let rdma = which("rdma");
    let pingpong = which("ibv_rc_pingpong");
    let (prov, files) = vmlab::rxe_provider_files();
    let mut bins: Vec<(String, PathBuf)> = vec![
        ("bin/rdsd".into(), rdsd),
        ("bin/rdmatest".into(), me),
        ("bin/rdsctl".into(), rdsd_tests::bin_dir().join("rdsctl")),
        ("usr/bin/rdma".into(), rdma),
        ("usr/bin/ibv_rc_pingpong".into(), pingpong),
        ("usr/bin/ib_send_lat".into(), which("ib_send_lat")),
        ("usr/bin/ib_send_bw".into(), which("ib_send_bw")),
    ];
    bins.extend(prov);
    let bins_ref: Vec<(&str, &Path)> = bins
        .iter()
        .map(|(g, h)| (g.as_str(), h.as_path()))
        .collect();
    let files_ref: Vec<(&str, Vec<u8>, u32)> = files
        .iter()
        .map(|(g, d, m)| (g.as_str(), d.clone(), *m))
        .collect();
    let img = vmlab::custom_initramfs(k, vmlab::RDMA_GUEST_MODULES, INIT, &bins_ref, &files_ref);
    let p = dir.join("rdma-initrd.cpio");
    std::fs::write(&p, img).unwrap();
    p
}

struct Ns(String);

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Boots the two guests with `paths` paths and returns (receiver output, sender output).
fn two_guests(paths: u8, extra: &str) -> Option<(String, String, f64)> {
    static N: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    assert!(
        is_root(),
        "the RDMA lab creates a network namespace: run as root"
    );
    let qemu = std::env::var_os("RDSD_VMLAB_QEMU").unwrap_or("qemu-system-x86_64".into());
    if Command::new(&qemu).arg("--version").output().is_err() {
        eprintln!("\n*** SKIPPED: the VM lab cannot start qemu ({qemu:?}); RDMA NOT TESTED ***\n");
        return None;
    }
    let k = vmlab::kernel();
    let dir = std::env::temp_dir().join(format!("rdsd-rdma-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let initrd = build_initrd(&dir, &k);
    let ns = Ns(format!("rr{}n{n}", std::process::id() % 100_000));
    let _ = Command::new("ip").args(["netns", "del", &ns.0]).status();
    assert!(Command::new("ip")
        .args(["netns", "add", &ns.0])
        .status()
        .unwrap()
        .success());
    assert!(Command::new("ip")
        .args(["-n", &ns.0, "link", "set", "lo", "up"])
        .status()
        .unwrap()
        .success());
    let port = 17000 + n;
    let net = |listen: bool, mac: u8| -> Vec<String> {
        vec![
            "-netdev".into(),
            format!(
                "socket,id=n0,{}=127.0.0.1:{port}",
                if listen { "listen" } else { "connect" }
            ),
            "-device".into(),
            format!("virtio-net-pci,netdev=n0,mac=52:54:00:12:34:{mac:02x}"),
        ]
    };
    let (a, b) = ("10.77.0.1", "10.77.0.2");
    let t0 = Instant::now();
    let mut ga = match vmlab::BatchGuest::boot(
        &k,
        &initrd,
        &format!("lab.role=recv lab.addr={a} lab.peer={b} lab.paths={paths} {extra}"),
        &net(true, 1),
        Some(&ns.0),
        1024,
    ) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("\n*** SKIPPED: {e:?}; RDMA NOT TESTED ***\n");
            return None;
        }
    };
    std::thread::sleep(Duration::from_millis(1500));
    let mut gb = vmlab::BatchGuest::boot(
        &k,
        &initrd,
        &format!("lab.role=send lab.addr={b} lab.peer={a} lab.paths={paths} {extra}"),
        &net(false, 2),
        Some(&ns.0),
        1024,
    )
    .expect("second guest");
    let ok_a = ga.wait(Duration::from_secs(540));
    let ok_b = gb.wait(Duration::from_secs(60));
    let secs = t0.elapsed().as_secs_f64();
    let (oa, ob) = (ga.output(), gb.output());
    let lab = |s: &str| -> String {
        s.lines()
            .filter(|l| l.starts_with("LAB"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    eprintln!(
        "--- receiver (A) ---\n{}\n--- sender (B) ---\n{}\n--- {secs:.1} s",
        lab(&oa),
        lab(&ob)
    );
    assert!(ok_a && ok_b, "a guest did not finish (A {ok_a}, B {ok_b})");
    if std::env::var_os("RDSD_VMLAB_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Some((oa, ob, secs))
}

/// A counter from the `LAB stat NAME VALUE` lines of a guest (panics when missing).
fn stat(out: &str, name: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("LAB stat "))
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok())?
        })
        .unwrap_or_else(|| panic!("counter {name} not in the guest's output"))
}

/// One lab at a time (two TCG guests already fill this machine's cores).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check(paths: u8, socks: u64, extra: &str) -> Option<(String, String)> {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, secs) = two_guests(paths, &format!("lab.socks={socks} {extra}"))?;
    assert!(
        a.contains("LAB rxe up") && b.contains("LAB rxe up"),
        "rxe did not come up"
    );
    assert!(
        a.contains("RESULT recv ok") && a.contains("RESULT no-duplicates"),
        "the receiver did not get every message exactly once, in order"
    );
    assert!(b.contains("RESULT send ok"), "the sender did not finish");
    // Over RDMA, not kernel TCP: the receiver's rdma counters saw every message.
    let total = SIZES.len() as u64 * ROUNDS + SMALL;
    assert!(
        stat(&a, "rdma_delivered") >= total,
        "rdma_delivered on the receiver: {}",
        stat(&a, "rdma_delivered")
    );
    assert_eq!(stat(&a, "tcp_delivered"), 0, "nothing went over kernel TCP");
    if !extra.contains("cut") && !extra.contains("restart") {
        // Without a fault nothing is retransmitted, so nothing is dropped as a duplicate.
        assert_eq!(stat(&a, "rdma_drop_dup_seq"), 0);
    }
    assert!(stat(&b, "rdma_tx_messages") >= total);
    for l in a
        .lines()
        .chain(b.lines())
        .filter(|l| l.contains("RESULT") || l.contains("pingpong"))
    {
        eprintln!("{l}");
    }
    eprintln!("paths={paths} sockets={socks} {extra}: two guests, {secs:.1} s in all");
    Some((a, b))
}

/// One path, one socket; `ibv_rc_pingpong` first as a check of rxe itself.
#[test]
fn rdma_exactly_once_two_guests_one_path() {
    if let Some((a, _)) = check(1, 1, "lab.pingpong=1 lab.mode=lat") {
        assert!(
            a.contains("LAB pingpong 5 iters"),
            "ibv_rc_pingpong did not run between the guests"
        );
    }
}

/// Eight paths, eight sending sockets (their source ports hash onto different paths).
#[test]
fn rdma_exactly_once_two_guests_eight_paths() {
    if let Some((a, b)) = check(8, 8, "") {
        assert!(
            b.contains("paths negotiated peer=10.77.0.1 npaths=8"),
            "8 paths not negotiated"
        );
        // `rdsctl info -p` on the receiver: LocalAddr RemoteAddr Path State NextTxSeq NextRxSeq
        let rows: Vec<Vec<&str>> = a
            .lines()
            .filter_map(|l| l.strip_prefix("LAB paths "))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() >= 6 && f[0] == "10.77.0.1")
            .collect();
        let up = rows.iter().filter(|f| f[3] == "up").count();
        let carrying = rows
            .iter()
            .filter(|f| f[5].parse::<u64>().is_ok_and(|n| n > 10))
            .count();
        eprintln!("receiver: {up} paths up, {carrying} carried data");
        assert_eq!(up, 8, "every path is an RC QP of its own, up");
        assert!(
            carrying >= 3,
            "the 8 sockets spread over several paths ({carrying})"
        );
    }
}

/// A receiver that sleeps 4 s after the first message while 3.4 MB are on their way: its rx
/// ring fills, the path pauses and stops re-posting receive buffers, so the sender runs out of
/// credits and stalls; then the receiver drains and nothing is lost.
#[test]
fn rdma_slow_receiver_exhausts_credits_and_recovers() {
    if let Some((a, _)) = check(1, 1, "lab.mode=slow") {
        assert!(stat(&a, "rx_paused") > 0, "the receiver never paused");
        assert!(stat(&a, "rx_resumed") > 0, "the receiver never resumed");
    }
}

/// The receiver's rdsd is SIGKILLed after a first stream and restarted: the sender's rdsd
/// notices the new incarnation (its connect takes the stale paths down), and a second stream
/// reaches the new rdsd exactly once, in order, over new queue pairs.
///
/// (It was ignored for a while with "rdma_cm address resolution times out after the restart":
/// the second sender had taken the first receiver's late `done` for its `ready`, failed and
/// powered its guest off, so the restarted rdsd's ARP for it went unanswered.)
#[test]
fn rdma_peer_rdsd_killed_and_restarted() {
    if let Some((a, b)) = check(1, 1, "lab.mode=restart") {
        assert!(
            a.contains("LAB rdsd restarted"),
            "the receiver's rdsd was not restarted"
        );
        let second = |s: &str| -> String {
            s.lines()
                .filter(|l| l.starts_with("LAB app2 "))
                .collect::<Vec<_>>()
                .join("\n")
        };
        let (a2, b2) = (second(&a), second(&b));
        assert!(
            a2.contains("RESULT recv ok") && a2.contains("RESULT no-duplicates"),
            "the second stream, to the restarted rdsd:\n{a2}"
        );
        assert!(b2.contains("RESULT send ok"), "the second sender:\n{b2}");
        // The sender's rdsd saw its old path go (the peer's new QP replaced it).
        assert!(
            stat(&b, "rdma_path_down") >= 1,
            "the sender never took the dead incarnation's path down"
        );
    }
}

/// The sender's link goes down for 4 s halfway through (`ip link set eth0 down` in the guest):
/// the RC QPs fail, the paths reconnect, unacknowledged messages are retransmitted, and the
/// receiver still sees every message exactly once, in order.
///
/// Ignored: it fails. What the runs show: the flap stalls the RC QP (the sender's keepalive
/// sees no completion for 5 s) or ends it with a LOC_LEN_ERR completion; the paths go down and
/// the protocol layer reconnects as designed, but from then on rdma_cm between the two guests
/// no longer completes: address resolution times out (-110), REPs go unanswered (the
/// passive side sees REJ "timeout"), connects time out, for minutes; the receiver is left at
/// 17 of 418 messages. The rxe port is ACTIVE with its GID, and `ibv_rc_pingpong` (QP numbers
/// over TCP, no rdma_cm) still works between the same guests (`post-cut pingpong` in the
/// output). Whether Soft-RoCE's CM/neighbour state after a netdev flap or our reconnect path
/// is at fault is not known. In cut mode rdsd logs rdma_cm events (`LAB full`).
#[test]
#[ignore = "fails: after `ip link set eth0 down/up` in a guest, rdma_cm reconnects never complete (see the doc comment)"]
fn rdma_link_cut_mid_stream_loses_nothing() {
    if let Some((a, b)) = check(1, 1, "lab.mode=cut") {
        assert!(b.contains("RESULT link down"), "the link was not cut");
        let downs = stat(&a, "rdma_path_down") + stat(&b, "rdma_path_down");
        eprintln!(
            "path_down A+B {downs}, retransmits B {}, dup drops A {}",
            stat(&b, "rdma_retransmits"),
            stat(&a, "rdma_drop_dup_seq")
        );
    }
}
