//! rdsd's RDMA transport against the Linux kernel's own RDS over RDMA (`rds_rdma`), both over
//! Soft-RoCE, in two VM-lab guests: guest K (10.77.0.1) runs the 6.1 kernel's RDS with
//! `rds_rdma` and the static `rdsguest` program (`RDSG_TRANSPORT=ib`); guest R (10.77.0.2)
//! runs rdsd with an `[rdma]` section, `rdsctl` and `rds-testapp`. The issue called this a
//! stretch goal. What happens (2026-11-23, rdsd at dec3726; details in `tests/vmlab/README.md`):
//!
//! * **Works**: the kernel connects (it is the smaller address) and rdsd accepts: the REQ/REP
//!   private data agree on version 3.1 (`RDS/IB: Active conn connected ... version 3.1`); the
//!   kernel's pings reach rdsd and are answered; rdsd's messages reach the kernel's socket in
//!   order and intact (107 of 200 in every run, `bad=0`).
//! * **Does not**: the kernel never sends an explicit RDS ACK (`ib_ack_sent` stays 0 although
//!   `recv_ack_required` counts our ACK_REQUIRED frames), and its pongs reach rdsd only
//!   seconds late; after 5 s without an ack rdsd's keepalive takes the path down, rdsd's
//!   doorbells then make the kernel drop its connection (`ib_listen_closed_stale`,
//!   `ib_connect_raced`) and the two churn through ~1,500 connections. Why the kernel's
//!   transmit side stays silent on an established connection is not known yet.
//!
//! Fixed on the way (all in rdsd): a kernel peer offers 0 credits (its `flow_control` sysctl
//! is 0), and rdsd used to take that as "no credits" and never sent; the kernel acks only on
//! `RDS_FLAG_ACK_REQUIRED`, which rdsd now sets; the kernel accepts connects from the larger
//! address, so an accepted doorbell is now kept as the path.
//!
//! Ignored (a diagnostic, 110 s): run it with
//! `cargo test -p rdsd-tests --test rdma_kernel -- --ignored --nocapture`.
use rdsd_tests::vmlab;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Guest K's `/init`, after `vmlab::GUEST_INIT_PREAMBLE`.
const KERNEL_INIT: &str = r#"ip link set lo up
ip link set eth0 up
ip addr add 10.77.0.1/24 dev eth0
/usr/bin/rdma link add rxe0 type rxe netdev eth0 && echo "LAB rxe up"
for i in $(seq 1 60); do ping -c 1 -W 1 10.77.0.2 >/dev/null 2>&1 && break; done
echo "LAB modules $(cut -d' ' -f1 /proc/modules | grep rds | tr '\n' ' ')"
echo "LAB sysctl $(for f in /proc/sys/net/rds/ib/*; do printf '%s=%s ' ${f##*/} $(cat $f); done)"
export RDSG_TAG=k RDSG_TRANSPORT=ib
# The peer's rdsd is up once it answers; the kernel pings it (the kernel connects).
sleep 6
timeout 40 /bin/rdsguest ping 10.77.0.1:4000 10.77.0.2:0 5 2>&1 | sed 's/^/LAB kping /'
timeout 70 /bin/rdsguest recv 10.77.0.1:4001 200 60000 2>&1 | sed 's/^/LAB krecv /'
/bin/rdsguest counters-all 2>&1 | sed 's/^/LAB kcount /'
dmesg | grep -m1 'conn connected' | sed 's/^/LAB kconn /'
dmesg | grep -iE 'rds|rdma' | grep -v 'Active conn connected' | tail -n 30 | sed 's/^/LAB kdmesg /'
echo "LAB end"
poweroff -f
"#;

/// Guest R's `/init`, after `vmlab::GUEST_INIT_PREAMBLE`.
const RDSD_INIT: &str = r#"ip link set lo up
ip link set eth0 up
ip addr add 10.77.0.2/24 dev eth0
/usr/bin/rdma link add rxe0 type rxe netdev eth0 && echo "LAB rxe up"
for i in $(seq 1 60); do ping -c 1 -W 1 10.77.0.1 >/dev/null 2>&1 && break; done
printf '[rdma]\n' > /tmp/rdsd.toml
export RDSD_LOG=info
/bin/rdsd --config /tmp/rdsd.toml --control-socket /run/rdsd/rdsd.sock --local-addr 10.77.0.2/32 --paths 1 --hugepages off > /tmp/rdsd.log 2>&1 &
for i in $(seq 1 60); do /bin/rdsctl --socket /run/rdsd/rdsd.sock status >/dev/null 2>&1 && break; sleep 0.5; done
echo "LAB rdsd up"
# The kernel pings us first (about 6 s after its boot); then we ping it and send to it.
sleep 25
timeout 30 /bin/rdsctl --socket /run/rdsd/rdsd.sock ping 10.77.0.1 -c 5 2>&1 | sed 's/^/LAB rping /'
RDSD_SOCKET=/run/rdsd/rdsd.sock timeout 60 /bin/rds-testapp send 10.77.0.2:5000 10.77.0.1:4001 200 1000 2>&1 | sed 's/^/LAB rsend /'
sleep 10
/bin/rdsctl --socket /run/rdsd/rdsd.sock stats 2>&1 | grep -E '^rdma_' | sed 's/^/LAB stat /'
/bin/rdsctl --socket /run/rdsd/rdsd.sock info -p 2>&1 | sed 's/^/LAB paths /'
grep -vE 'PassivePending|role=Doorbell' /tmp/rdsd.log | head -n 120 | sed 's/^/LAB rdsd /'
echo "LAB end"
poweroff -f
"#;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn which(b: &str) -> PathBuf {
    ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(b))
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{b} missing (apt-get install iproute2)"))
}

#[test]
#[ignore = "diagnostic: interop with the kernel's rds_rdma is partial (see the module doc)"]
fn rdsd_rdma_against_the_kernels_rds_rdma() {
    assert!(
        is_root(),
        "the lab creates a network namespace: run as root"
    );
    let k = vmlab::kernel();
    let dir = std::env::temp_dir().join(format!("rdsd-rdmak-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (prov, files) = vmlab::rxe_provider_files();
    let files_ref: Vec<(&str, Vec<u8>, u32)> = files
        .iter()
        .map(|(g, d, m)| (g.as_str(), d.clone(), *m))
        .collect();
    let rdma = which("rdma");
    // Static: a plain file (the initramfs builder runs ldd on `bins`).
    let guest_prog = std::fs::read(vmlab::build_guest_program(&dir)).unwrap();
    let mut kfiles = files_ref.clone();
    kfiles.push(("bin/rdsguest", guest_prog, 0o755));
    let mut kmods: Vec<&str> = vmlab::RDMA_GUEST_MODULES.to_vec();
    kmods.extend(["rds", "rds_rdma"]);
    let mut kbins: Vec<(String, PathBuf)> = vec![("usr/bin/rdma".into(), rdma.clone())];
    kbins.extend(prov.iter().cloned());
    let kref: Vec<(&str, &Path)> = kbins
        .iter()
        .map(|(g, h)| (g.as_str(), h.as_path()))
        .collect();
    let kimg = vmlab::custom_initramfs(
        &k,
        &kmods,
        &format!("{}{KERNEL_INIT}", vmlab::GUEST_INIT_PREAMBLE),
        &kref,
        &kfiles,
    );
    let mut rbins: Vec<(String, PathBuf)> = vec![
        ("bin/rdsd".into(), rdsd_tests::rdsd_bin()),
        ("bin/rdsctl".into(), rdsd_tests::bin_dir().join("rdsctl")),
        (
            "bin/rds-testapp".into(),
            rdsd_tests::bin_dir().join("rds-testapp"),
        ),
        ("usr/bin/rdma".into(), rdma),
    ];
    rbins.extend(prov.iter().cloned());
    let rref: Vec<(&str, &Path)> = rbins
        .iter()
        .map(|(g, h)| (g.as_str(), h.as_path()))
        .collect();
    let rimg = vmlab::custom_initramfs(
        &k,
        vmlab::RDMA_GUEST_MODULES,
        &format!("{}{RDSD_INIT}", vmlab::GUEST_INIT_PREAMBLE),
        &rref,
        &files_ref,
    );
    let (ki, ri) = (dir.join("k.cpio"), dir.join("r.cpio"));
    std::fs::write(&ki, kimg).unwrap();
    std::fs::write(&ri, rimg).unwrap();
    let wire = vmlab::GuestWire::new(
        &format!("rk{}", std::process::id() % 100_000),
        17500 + 2 * (std::process::id() % 200) as u16,
    );
    let t0 = Instant::now();
    let mut gk =
        match vmlab::BatchGuest::boot(&k, &ki, "", &wire.netdev(0, 1), Some(&wire.ns), 1024) {
            Ok(g) => g,
            Err(e) => {
                rdsd_tests::skip_or_fail(&format!("{e:?}; NOT TESTED"), vmlab::INSTALL);
                return;
            }
        };
    std::thread::sleep(Duration::from_millis(1500));
    let mut gr = vmlab::BatchGuest::boot(&k, &ri, "", &wire.netdev(1, 2), Some(&wire.ns), 1024)
        .expect("second guest");
    let ok_k = gk.wait(Duration::from_secs(240));
    let ok_r = gr.wait(Duration::from_secs(120));
    let lab = |s: String| -> String {
        s.lines()
            .filter(|l| l.starts_with("LAB"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    eprintln!(
        "--- kernel guest ---\n{}\n--- rdsd guest ---\n{}\n--- {:.1} s",
        lab(gk.output()),
        lab(gr.output()),
        t0.elapsed().as_secs_f64()
    );
    assert!(ok_k && ok_r, "a guest did not finish");
    // What works today must keep working: the handshake, and rdsd's messages reaching the
    // kernel's socket intact and in order.
    let k_out = gk.output();
    assert!(
        k_out.contains("version 3.1"),
        "the kernel's RDS/IB did not connect to rdsd with version 3.1"
    );
    let got = k_out
        .lines()
        .find_map(|l| l.split("got=").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert!(got > 0, "the kernel received nothing from rdsd");
    assert!(
        k_out.contains("bad=0"),
        "the kernel saw messages out of order or corrupted"
    );
}
