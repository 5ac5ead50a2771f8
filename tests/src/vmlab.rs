//! A VM lab with the Linux kernel's own RDS/TCP as the peer of rdsd.
//!
//! Everything comes from Debian packages: the kernel (`linux-image-amd64`, downloaded with
//! `apt-get download` and extracted into `/var/cache/rdsd-vmlab/<kernel-version>/`, never
//! installed on the host), `busybox-static` for the guest's userland and `qemu-system-x86`
//! (TCG, no KVM needed). The guest boots from two concatenated uncompressed cpio archives:
//! a cached base (busybox, the `rds`, `rds_tcp` and virtio-net modules with their
//! dependencies, `/init`) and one per lab (the static guest program `rdsguest`, built from
//! `tests/vmlab/rdsguest.c` with `cc -static`, and `/lab.conf`).
//!
//! The network: a namespace made by the lab holds a tap device (`tap0`, address
//! `10.<n>.0.100/24`) and rdsd (`--local-addr 10.<n>.0.100/32`); qemu runs in that namespace
//! with `-nic tap`. The guest has two addresses, `.2` (smaller than the host's, so the guest
//! connects) and `.200` (larger, so rdsd connects).
//!
//! The guest's console (kernel log) is ttyS0, written to `console.log` in the lab directory;
//! ttyS1 is the control line on qemu's stdio: the host writes `TAG LEN COMMAND` lines, the
//! guest's `/init` checks the length (the host resends a garbled line), answers
//! `RDSG TAG started` and runs each command in the background with `RDSG_TAG=TAG`, and every line a job
//! prints starts with `RDSG TAG `, then `RDSG TAG exit CODE` when it ends.

use crate::Daemon;
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Modules the guest loads (with their dependencies from `modules.dep`, in order).
const GUEST_MODULES: &[&str] = &["virtio_pci", "virtio_net", "rds", "rds_tcp"];

/// Where downloads and extracted kernels are cached (keyed by kernel version below it).
pub fn cache_root() -> PathBuf {
    std::env::var_os("RDSD_VMLAB_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/rdsd-vmlab"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(args: &[&str]) -> String {
    run(Command::new(args[0]).args(&args[1..]))
}

/// An exclusive lock on a file, held until drop (several test binaries share the cache).
struct FileLock(std::fs::File);

impl FileLock {
    fn new(path: &Path) -> FileLock {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(r, 0, "flock {}", path.display());
        FileLock(f)
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// An extracted Debian kernel: its version, `vmlinuz` and the module tree.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// `uname -r` of the guest, e.g. `6.1.0-56-amd64`.
    pub version: String,
    /// The bzImage (`-kernel` takes it as is).
    pub vmlinuz: PathBuf,
    /// Root of the extracted package (holds `lib/modules/<version>`).
    pub root: PathBuf,
    /// The cache directory of this version.
    pub dir: PathBuf,
}

/// The package `linux-image-amd64` currently depends on, e.g. `linux-image-6.1.0-56-amd64`.
fn kernel_package() -> String {
    if let Some(p) = std::env::var_os("RDSD_VMLAB_KERNEL_PKG") {
        return p.to_string_lossy().into_owned();
    }
    let find = || {
        let out = Command::new("apt-cache")
            .args(["depends", "linux-image-amd64"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
            .map(str::to_string)
    };
    if let Some(p) = find() {
        return p;
    }
    sh(&["apt-get", "update", "-qq"]);
    find().expect("apt-cache: linux-image-amd64 depends on no linux-image-<version>-amd64")
}

/// Downloads and extracts the kernel package once per version (cached), runs `depmod`.
pub fn kernel() -> Kernel {
    static K: OnceLock<Kernel> = OnceLock::new();
    K.get_or_init(|| {
        let pkg = kernel_package();
        let version = pkg.strip_prefix("linux-image-").unwrap().to_string();
        let dir = cache_root().join(&version);
        std::fs::create_dir_all(&dir).expect("create the VM lab cache");
        let _lock = FileLock::new(&dir.join(".lock"));
        let root = dir.join("root");
        let done = dir.join(".extracted");
        if !done.exists() {
            let dl = dir.join("dl");
            let _ = std::fs::remove_dir_all(&dl);
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&dl).unwrap();
            eprintln!("vmlab: downloading {pkg} into {}", dl.display());
            run(Command::new("apt-get")
                .args(["download", "-q", &pkg])
                .current_dir(&dl));
            for e in std::fs::read_dir(&dl).unwrap() {
                let p = e.unwrap().path();
                if p.extension().is_some_and(|x| x == "deb") {
                    run(Command::new("dpkg-deb").arg("-x").arg(&p).arg(&root));
                }
            }
            run(Command::new("depmod").arg("-b").arg(&root).arg(&version));
            std::fs::write(&done, b"").unwrap();
        }
        let vmlinuz = root.join("boot").join(format!("vmlinuz-{version}"));
        assert!(vmlinuz.exists(), "{} missing", vmlinuz.display());
        Kernel {
            version,
            vmlinuz,
            root,
            dir,
        }
    })
    .clone()
}

impl Kernel {
    fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.version)
    }

    /// `GUEST_MODULES` and their dependencies as paths relative to the module directory,
    /// in load order (dependencies first).
    pub fn module_load_order(&self, wanted: &[&str]) -> Vec<String> {
        let dep = std::fs::read_to_string(self.modules_dir().join("modules.dep"))
            .expect("modules.dep (depmod ran?)");
        let mut deps: HashMap<String, Vec<String>> = HashMap::new();
        let mut by_name: HashMap<String, String> = HashMap::new();
        for l in dep.lines() {
            let Some((m, rest)) = l.split_once(':') else {
                continue;
            };
            deps.insert(
                m.to_string(),
                rest.split_whitespace().map(str::to_string).collect(),
            );
            let base = Path::new(m).file_name().unwrap().to_string_lossy();
            let name = base.split('.').next().unwrap().replace('-', "_");
            by_name.insert(name, m.to_string());
        }
        fn visit(
            m: &str,
            deps: &HashMap<String, Vec<String>>,
            out: &mut Vec<String>,
            seen: &mut Vec<String>,
        ) {
            if seen.iter().any(|s| s == m) {
                return;
            }
            seen.push(m.to_string());
            // modules.dep lists a module's dependencies in reverse load order.
            for d in deps.get(m).into_iter().flatten().rev() {
                visit(d, deps, out, seen);
            }
            out.push(m.to_string());
        }
        let (mut out, mut seen) = (Vec::new(), Vec::new());
        for w in wanted {
            match by_name.get(*w) {
                Some(m) => visit(m, &deps, &mut out, &mut seen),
                None => {
                    let builtin =
                        std::fs::read_to_string(self.modules_dir().join("modules.builtin"))
                            .unwrap_or_default();
                    assert!(
                        builtin.lines().any(|l| l.ends_with(&format!("/{w}.ko"))),
                        "module {w} is neither in modules.dep nor built in"
                    );
                }
            }
        }
        out
    }
}

/// A newc ("070701") cpio archive writer: what the kernel's initramfs unpacker reads.
#[derive(Default)]
pub struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn header(&mut self, name: &str, mode: u32, len: usize, rdev: (u32, u32)) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            len as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// A directory.
    pub fn dir(&mut self, name: &str) {
        self.header(name, 0o040755, 0, (0, 0));
    }

    /// A regular file with permission bits `perm`.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.header(name, 0o100000 | perm, data.len(), (0, 0));
        self.buf.extend_from_slice(data);
        self.pad();
    }

    /// A character device node.
    pub fn chardev(&mut self, name: &str, major: u32, minor: u32) {
        self.header(name, 0o020600, 0, (major, minor));
    }

    /// The archive with its trailer.
    pub fn finish(mut self) -> Vec<u8> {
        self.header("TRAILER!!!", 0, 0, (0, 0));
        while !self.buf.len().is_multiple_of(512) {
            self.buf.push(0);
        }
        self.buf
    }
}

const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /tmp
for m in $(cat /modules/order); do
    insmod /modules/$m || echo "insmod $m failed"
done
. /lab.conf
ip link set lo up
ip link set eth0 up
for a in $GUEST_ADDRS; do ip addr add $a/24 dev eth0; done
# qemu 7.2 under TCG, with the host loaded, now and then stops taking frames off the NIC's
# transmit ring: the guest logs "NETDEV WATCHDOG ... transmit queue 0 timed out" every 5 s and
# sends nothing more, for good (the test in progress then times out, whatever rdsd does). A
# reset of the device recovers it: rebind the driver, then put back the link and every address
# (with their routes); TCP retransmits what was lost. Each reset is logged on the console.
nic_watch() {
    q=/sys/class/net/eth0/queues/tx-0/tx_timeout
    last=$(cat $q 2>/dev/null || echo 0)
    while sleep 1; do
        now=$(cat $q 2>/dev/null) || continue
        [ "$now" = "$last" ] && continue
        addrs=$(ip -4 -o addr show dev eth0 | awk '{print $4}')
        echo "vmlab: NIC reset (transmit timeouts: $now)" > /dev/console
        echo virtio0 > /sys/bus/virtio/drivers/virtio_net/unbind
        echo virtio0 > /sys/bus/virtio/drivers/virtio_net/bind
        ip link set eth0 up
        for a in $addrs; do ip addr add $a dev eth0; done
        last=$(cat $q 2>/dev/null || echo 0)
    done
}
nic_watch &
stty -F /dev/ttyS1 raw -echo
echo "RDSG init ready $(uname -r) $(cat /proc/uptime)" > /dev/ttyS1
while read -r tag len cmd; do
    [ -n "$tag" ] || continue
    # Input bytes can get lost on the serial line: a length check catches it, the host resends.
    # The tag is checked too: a tag that lost bytes would otherwise run the job a second time
    # under another name.
    case "$tag" in j[0-9]*) ;; *) echo "RDSG garbled $tag $len" > /dev/ttyS1; continue;; esac
    case "$tag" in *[!j0-9]*) echo "RDSG garbled $tag $len" > /dev/ttyS1; continue;; esac
    if [ "${#cmd}" != "$len" ]; then
        echo "RDSG garbled $tag $len ${#cmd}" > /dev/ttyS1
        continue
    fi
    # A resent line whose first copy did run: answer again, run once.
    case "$seen" in *" $tag "*) echo "RDSG $tag started" > /dev/ttyS1; continue;; esac
    seen="$seen $tag "
    echo "RDSG $tag started" > /dev/ttyS1
    ( export RDSG_TAG=$tag; eval "$cmd"; echo "RDSG $tag exit $?" ) </dev/null >/dev/ttyS1 2>&1 &
done < /dev/ttyS1
echo "control line closed" > /dev/console
poweroff -f
"#;

/// The base initramfs for `k` (busybox, modules, /init), cached next to the kernel.
pub fn base_initramfs(k: &Kernel) -> PathBuf {
    let path = k.dir.join("base.cpio");
    let _lock = FileLock::new(&k.dir.join(".lock"));
    // Rebuild when /init changes (its text is part of the cache key).
    let key = k.dir.join("base.cpio.key");
    let want_key = format!("{:x}", fnv(INIT.as_bytes()));
    if path.exists() && std::fs::read_to_string(&key).ok().as_deref() == Some(&want_key) {
        return path;
    }
    let busybox = busybox_path();
    let mut c = Cpio::default();
    for d in ["bin", "dev", "proc", "sys", "tmp", "modules"] {
        c.dir(d);
    }
    c.chardev("dev/console", 5, 1);
    c.file("bin/busybox", 0o755, &std::fs::read(&busybox).unwrap());
    c.file("init", 0o755, INIT.as_bytes());
    add_modules(&mut c, k, GUEST_MODULES);
    std::fs::write(&path, c.finish()).unwrap();
    std::fs::write(&key, want_key).unwrap();
    path
}

/// The static busybox that every initramfs carries.
fn busybox_path() -> PathBuf {
    ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("busybox missing: apt-get install busybox-static")
}

/// Adds `modules` and their dependencies, numbered in load order, and `modules/order` (what
/// `/init` insmods, in that order).
fn add_modules(c: &mut Cpio, k: &Kernel, modules: &[&str]) {
    let mut order = String::new();
    for (i, m) in k.module_load_order(modules).iter().enumerate() {
        let name = format!(
            "{i:02}-{}",
            Path::new(m).file_name().unwrap().to_string_lossy()
        );
        assert!(
            name.ends_with(".ko"),
            "{m}: compressed modules are not handled (busybox insmod)"
        );
        c.file(
            &format!("modules/{name}"),
            0o644,
            &std::fs::read(k.modules_dir().join(m)).unwrap(),
        );
        order.push_str(&name);
        order.push('\n');
    }
    c.file("modules/order", 0o644, order.as_bytes());
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Builds the static guest program (`tests/vmlab/rdsguest.c`) into `dir`.
pub fn build_guest_program(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("vmlab/rdsguest.c");
    let out = dir.join("rdsguest");
    run(Command::new("cc")
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(&src));
    out
}

/// Lines from the guest, demultiplexed by job tag.
#[derive(Default)]
struct Lines {
    by_tag: HashMap<String, VecDeque<String>>,
    all: Vec<String>,
    eof: bool,
}

type Shared = Arc<(Mutex<Lines>, Condvar)>;

static LAB_ID: AtomicU32 = AtomicU32::new(0);

/// The lab: a namespace with a tap, rdsd in it, and a guest VM on the tap.
pub struct VmLab {
    /// The namespace holding the tap, rdsd and qemu.
    pub ns: String,
    /// rdsd's address (on `tap0`).
    pub host: Ipv4Addr,
    /// The guest's address below the host's (the guest connects).
    pub guest_low: Ipv4Addr,
    /// The guest's address above the host's (rdsd connects).
    pub guest_high: Ipv4Addr,
    /// A third guest address (smaller than the host's), for a test that needs a connection
    /// nobody used before.
    pub guest_mp: Ipv4Addr,
    /// A fourth guest address (larger than the host's), likewise unused by other tests.
    pub guest_high2: Ipv4Addr,
    /// rdsd, in the namespace.
    pub daemon: Option<Daemon>,
    /// The lab's directory (initramfs, console log).
    pub dir: PathBuf,
    /// Seconds from qemu's start to the guest's "ready" line, last boot.
    pub boot_secs: f64,
    kernel: Kernel,
    initrd: PathBuf,
    qemu: Option<Child>,
    stdin: Mutex<Option<ChildStdin>>,
    lines: Shared,
    next_tag: AtomicU32,
    rdsd_extra: Vec<String>,
    pcap: Option<Child>,
    tap_offload: bool,
    /// NIC resets of the guests before the last boot (each boot starts a new console log).
    nic_resets_before: usize,
}

/// The install step for what the VM lab needs (qemu, busybox, the kernel package's tools).
pub const INSTALL: &str = "apt-get install qemu-system-x86 busybox-static kmod libc6-dev linux-libc-dev (tests/run.sh does it), and run as root";

/// Why the lab could not start qemu at all (the only reason a VM test may skip; see
/// `crate::skip_or_fail`).
#[derive(Debug)]
pub struct QemuUnavailable(pub String);

impl VmLab {
    /// Builds everything and boots the guest; `rdsd_extra` are extra rdsd flags.
    pub fn new(rdsd_extra: &[&str]) -> Result<VmLab, QemuUnavailable> {
        VmLab::new_with(rdsd_extra, true)
    }

    /// As [`VmLab::new`]; with `tap_offload` false the tap has no virtio-net header, so the
    /// guest computes checksums and segments itself: what a packet socket (a DPDK
    /// `net_af_packet` port bridged to the tap) needs to see finished frames.
    pub fn new_with(rdsd_extra: &[&str], tap_offload: bool) -> Result<VmLab, QemuUnavailable> {
        assert!(
            crate::netns::is_root(),
            "the VM lab creates a network namespace and a tap: run as root"
        );
        let qemu = qemu_bin();
        if Command::new(&qemu).arg("--version").output().is_err() {
            return Err(QemuUnavailable(format!(
                "{} cannot run (apt-get install qemu-system-x86)",
                qemu.display()
            )));
        }
        let kernel = kernel();
        let base = base_initramfs(&kernel);
        let id = LAB_ID.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let ns = format!("rv{}x{id}", pid % 100_000);
        let net = 20 + (pid as usize * 3 + id as usize) % 200;
        let host = Ipv4Addr::new(10, net as u8, 0, 100);
        let guest_low = Ipv4Addr::new(10, net as u8, 0, 2);
        let guest_high = Ipv4Addr::new(10, net as u8, 0, 200);
        let guest_mp = Ipv4Addr::new(10, net as u8, 0, 3);
        let guest_high2 = Ipv4Addr::new(10, net as u8, 0, 201);
        let dir = std::env::temp_dir().join(format!("rdsd-vmlab-{ns}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let prog = build_guest_program(&dir);
        let mut c = Cpio::default();
        c.dir("bin");
        c.file("bin/rdsguest", 0o755, &std::fs::read(&prog).unwrap());
        c.file(
            "lab.conf",
            0o644,
            format!("GUEST_ADDRS=\"{guest_low} {guest_high} {guest_mp} {guest_high2}\"\nHOST_ADDR={host}\n")
                .as_bytes(),
        );
        let mut initrd = std::fs::read(&base).unwrap();
        initrd.extend_from_slice(&c.finish());
        let initrd_path = dir.join("initrd.cpio");
        std::fs::write(&initrd_path, initrd).unwrap();

        let _ = Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(Stdio::null())
            .status();
        sh(&["ip", "netns", "add", &ns]);
        sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        sh(&[
            "ip", "-n", &ns, "tuntap", "add", "dev", "tap0", "mode", "tap",
        ]);
        sh(&[
            "ip",
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{host}/24"),
            "dev",
            "tap0",
        ]);
        sh(&["ip", "-n", &ns, "link", "set", "tap0", "up"]);
        let mut lab = VmLab {
            ns,
            host,
            guest_low,
            guest_high,
            guest_mp,
            guest_high2,
            daemon: None,
            dir,
            boot_secs: 0.0,
            kernel,
            initrd: initrd_path,
            qemu: None,
            stdin: Mutex::new(None),
            lines: Arc::default(),
            next_tag: AtomicU32::new(0),
            rdsd_extra: rdsd_extra.iter().map(|s| s.to_string()).collect(),
            pcap: None,
            tap_offload,
            nic_resets_before: 0,
        };
        // RDSD_VMLAB_PCAP=FILE: capture the tap from the start (needs tcpdump).
        if let Some(f) = std::env::var_os("RDSD_VMLAB_PCAP") {
            lab.pcap = Some(lab.capture(Path::new(&f)));
            std::thread::sleep(Duration::from_millis(500));
        }
        lab.start_rdsd();
        lab.boot()?;
        Ok(lab)
    }

    /// Starts rdsd in the namespace (first start, or after [`VmLab::kill_rdsd`]).
    pub fn start_rdsd(&mut self) {
        if let Some(d) = &mut self.daemon {
            d.spawn();
            return;
        }
        let local = format!("{}/32", self.host);
        let mut args = vec!["--local-addr", &local, "--local-addr", "127.0.0.0/8"];
        args.extend(self.rdsd_extra.iter().map(String::as_str));
        self.daemon = Some(Daemon::start_in(Some(&self.ns), &args));
    }

    /// Bridges the tap with a new veth pair in the namespace (the host address moves from the
    /// tap to the bridge) and returns the free end's name: a DPDK `net_af_packet` port there
    /// reaches the guest on the same subnet. The free end has no address.
    pub fn add_bridged_port(&self) -> &'static str {
        let ns = self.ns.as_str();
        let host = format!("{}/24", self.host);
        sh(&["ip", "-n", ns, "link", "add", "br0", "type", "bridge"]);
        sh(&["ip", "-n", ns, "addr", "del", &host, "dev", "tap0"]);
        sh(&["ip", "-n", ns, "link", "set", "tap0", "master", "br0"]);
        sh(&["ip", "-n", ns, "addr", "add", &host, "dev", "br0"]);
        sh(&[
            "ip", "-n", ns, "link", "add", "dpk0", "type", "veth", "peer", "name", "dpk1",
        ]);
        sh(&["ip", "-n", ns, "link", "set", "dpk1", "master", "br0"]);
        for l in ["br0", "dpk0", "dpk1"] {
            sh(&["ip", "-n", ns, "link", "set", l, "up"]);
        }
        "dpk0"
    }

    /// SIGKILLs rdsd (restart it with [`VmLab::start_rdsd`]).
    pub fn kill_rdsd(&mut self) {
        if let Some(d) = &mut self.daemon {
            d.kill();
        }
    }

    /// rdsd.
    pub fn d(&self) -> &Daemon {
        self.daemon.as_ref().expect("rdsd")
    }

    /// Boots the guest (again) and waits for its control line.
    pub fn boot(&mut self) -> Result<(), QemuUnavailable> {
        self.shutdown_vm();
        self.nic_resets_before = self.nic_resets();
        self.lines = Arc::default();
        let console = self.dir.join("console.log");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns])
            .arg(qemu_bin())
            .args(["-accel", "tcg", "-m", "512", "-smp", "1", "-no-reboot"])
            .args(["-display", "none", "-monitor", "none"])
            .arg("-kernel")
            .arg(&self.kernel.vmlinuz)
            .arg("-initrd")
            .arg(&self.initrd)
            .args([
                "-append",
                "console=ttyS0 panic=-1 quiet loglevel=4 rdinit=/init",
            ])
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .args(["-serial", "stdio"])
            .arg("-nic")
            .arg(format!(
                "tap,ifname=tap0,script=no,downscript=no,model=virtio-net-pci{}",
                if self.tap_offload {
                    ""
                } else {
                    ",vnet_hdr=off"
                }
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let start = Instant::now();
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return Err(QemuUnavailable(format!("spawn qemu: {e}"))),
        };
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        *self.stdin.get_mut().unwrap_or_else(|e| e.into_inner()) = child.stdin.take();
        self.qemu = Some(child);
        let shared = self.lines.clone();
        let trace = std::env::var_os("RDSD_VMLAB_TRACE").is_some();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).split(b'\n') {
                let Ok(l) = l else { break };
                let l = String::from_utf8_lossy(&l)
                    .trim_end_matches('\r')
                    .to_string();
                if trace {
                    eprintln!("vmlab< {l}");
                }
                let (m, cv) = &*shared;
                let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(rest) = l.find("RDSG ").map(|i| &l[i + 5..]) {
                    if let Some((tag, msg)) = rest.split_once(' ') {
                        g.by_tag
                            .entry(tag.to_string())
                            .or_default()
                            .push_back(msg.to_string());
                    }
                }
                g.all.push(l);
                cv.notify_all();
            }
            let (m, cv) = &*shared;
            m.lock().unwrap_or_else(|e| e.into_inner()).eof = true;
            cv.notify_all();
        });
        let errlog = self.dir.join("qemu.stderr");
        std::thread::spawn(move || {
            let mut f = std::fs::File::create(errlog).unwrap();
            let _ = std::io::copy(&mut BufReader::new(stderr), &mut f);
        });
        let ready = Job {
            tag: "init".into(),
            lines: self.lines.clone(),
        };
        match ready.try_expect("ready", Duration::from_secs(240)) {
            Ok(l) => {
                self.boot_secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "vmlab: guest {} ready in {:.1} s ({l})",
                    self.kernel.version, self.boot_secs
                );
                Ok(())
            }
            Err(e) => {
                let exited = self.qemu.as_mut().unwrap().try_wait().ok().flatten();
                let stderr =
                    std::fs::read_to_string(self.dir.join("qemu.stderr")).unwrap_or_default();
                let console = std::fs::read_to_string(&console).unwrap_or_default();
                if let (Some(st), true) = (exited, console.trim().is_empty()) {
                    return Err(QemuUnavailable(format!(
                        "qemu exited ({st}) before the guest printed anything: {stderr}"
                    )));
                }
                panic!(
                    "guest did not come up: {e}\nqemu stderr:\n{stderr}\nconsole:\n{}",
                    tail(&console, 4000)
                );
            }
        }
    }

    fn shutdown_vm(&mut self) {
        *self.stdin.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        if let Some(mut c) = self.qemu.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the guest VM (restart it with [`VmLab::boot`]).
    pub fn kill_vm(&mut self) {
        self.shutdown_vm();
    }

    /// Starts `rdsguest ARGS` in the guest as a new job.
    pub fn guest(&self, args: &str) -> Job {
        self.guest_sh(&format!("rdsguest {args}"))
    }

    /// Runs a shell command line in the guest as a new job.
    pub fn guest_sh(&self, cmd: &str) -> Job {
        let tag = format!("j{}", self.next_tag.fetch_add(1, Ordering::Relaxed) + 1);
        let job = Job {
            tag,
            lines: self.lines.clone(),
        };
        // Bytes written to the serial line are sometimes lost (seen right after a job's exit
        // and after a boot): the guest checks each line's length and runs a tag only once.
        let garbled = Job {
            tag: "garbled".into(),
            lines: self.lines.clone(),
        };
        for _ in 0..5 {
            {
                let mut g = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
                let stdin = g.as_mut().expect("guest running");
                stdin
                    .write_all(format!("\n{} {} {cmd}\n", job.tag, cmd.len()).as_bytes())
                    .and_then(|_| stdin.flush())
                    .expect("write to the guest's control line");
            }
            match job.try_expect("started", Duration::from_secs(10)) {
                Ok(_) => return job,
                Err(e) => {
                    let g = garbled.try_expect("", Duration::ZERO);
                    eprintln!("vmlab: {e} ({g:?}); resending the command line");
                }
            }
        }
        panic!("the guest's control line keeps garbling {cmd:?}");
    }

    /// Kills every `rdsguest` in the guest (left over from a failed test).
    pub fn reset_guest(&self) {
        let j = self.guest_sh("killall -9 rdsguest 2>/dev/null; true");
        j.expect("exit", Duration::from_secs(30));
    }

    /// The guest's console (kernel log) so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(self.dir.join("console.log")).unwrap_or_default()
    }

    /// How many times the guests of this lab (every boot) reset their NIC after qemu stopped
    /// taking their frames (`INIT`'s `nic_watch`), as their consoles say.
    pub fn nic_resets(&self) -> usize {
        self.nic_resets_before + self.console().matches("vmlab: NIC reset").count()
    }

    /// Takes the host side of the link down or up.
    pub fn link(&self, up: bool) {
        sh(&[
            "ip",
            "-n",
            &self.ns,
            "link",
            "set",
            "tap0",
            if up { "up" } else { "down" },
        ]);
    }

    /// Loads an nftables ruleset into the namespace.
    pub fn nft(&self, ruleset: &str) {
        crate::netns::nft_in(&self.ns, ruleset);
    }

    /// Removes every nftables rule of the namespace.
    pub fn nft_flush(&self) {
        sh(&["ip", "netns", "exec", &self.ns, "nft", "flush", "ruleset"]);
    }

    /// Both ends' state, for a test that timed out waiting for messages: rdsd's non-zero
    /// counters and its connections, paths and queues (`rdsctl info`), the namespace's TCP
    /// sockets (`ss -tni`), the guest kernel's RDS connections, TCP sockets and message
    /// queues (`rdsguest info`, each queue's first and last messages) and non-zero RDS
    /// counters, and the end of the guest's console. Each part is best effort and bounded
    /// in time.
    pub fn diagnose(&self) -> String {
        let mut out = String::new();
        if let Some(d) = &self.daemon {
            let counters: Vec<String> = d
                .stats()
                .lines()
                .filter(|l| !l.ends_with(" 0"))
                .map(str::to_string)
                .collect();
            out += &format!("rdsd counters (non-zero): {}\n", counters.join(", "));
            match Command::new(crate::bin_dir().join("rdsctl"))
                .arg("-s")
                .arg(&d.socket)
                .args(["info", "-k", "-n", "-p", "-r", "-s", "-t"])
                .output()
            {
                Ok(o) => {
                    out += "rdsctl info:\n";
                    out += &String::from_utf8_lossy(&o.stdout);
                    out += &String::from_utf8_lossy(&o.stderr);
                }
                Err(e) => out += &format!("rdsctl info: {e}\n"),
            }
        }
        if let Ok(o) = Command::new("ip")
            .args(["netns", "exec", &self.ns, "ss", "-tni"])
            .output()
        {
            out += "ss -tni (rdsd's namespace):\n";
            out += &String::from_utf8_lossy(&o.stdout);
        }
        // A guest whose control line fails makes `guest` panic: say so, keep the rest.
        let guest =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.diagnose_guest()));
        out += &guest.unwrap_or_else(|_| "guest kernel: no answer on the control line\n".into());
        out += &format!(
            "guest NIC resets after qemu stopped transmitting: {}\n",
            self.nic_resets()
        );
        out += "guest console (end):\n";
        out += tail(&self.console(), 3000);
        out
    }

    /// The guest kernel's part of [`VmLab::diagnose`].
    fn diagnose_guest(&self) -> String {
        let mut out = String::new();
        if self.qemu.is_some() {
            let info = self
                .guest("info")
                .lines_until("info ", Duration::from_secs(30));
            out += "guest kernel (rdsguest info):\n";
            let mut kinds: Vec<(String, Vec<&String>)> = Vec::new();
            for l in &info {
                let kind = l
                    .split_whitespace()
                    .nth(1)
                    .filter(|_| l.starts_with("msg "));
                match kind {
                    Some(k) => match kinds.iter_mut().find(|(n, _)| n == k) {
                        Some((_, v)) => v.push(l),
                        None => kinds.push((k.to_string(), vec![l])),
                    },
                    None => out += &format!("  {l}\n"),
                }
            }
            for (k, v) in &kinds {
                out += &format!(
                    "  {} {k} messages; first {}, last {}\n",
                    v.len(),
                    v[0],
                    v[v.len() - 1]
                );
            }
            let counters = self
                .guest("counters-all")
                .lines_until("exit", Duration::from_secs(30));
            let counters: Vec<&str> = counters
                .iter()
                .filter_map(|l| l.strip_prefix("counter "))
                .collect();
            out += &format!(
                "guest kernel counters (non-zero): {}\n",
                counters.join(", ")
            );
        }
        out
    }

    /// Starts `tcpdump -w FILE` on the tap (needs tcpdump); stop it by dropping the child.
    pub fn capture(&self, file: &Path) -> Child {
        Command::new("ip")
            .args([
                "netns", "exec", &self.ns, "tcpdump", "-i", "tap0", "-s", "0", "-w",
            ])
            .arg(file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tcpdump (apt-get install tcpdump)")
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

fn qemu_bin() -> PathBuf {
    std::env::var_os("RDSD_VMLAB_QEMU")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"))
}

impl Drop for VmLab {
    fn drop(&mut self) {
        let resets = self.nic_resets();
        if resets > 0 {
            eprintln!("vmlab: the guest reset its NIC {resets} time(s): qemu stopped transmitting");
        }
        self.shutdown_vm();
        if let Some(mut c) = self.pcap.take() {
            // SAFETY: SIGTERM to our own child, so tcpdump flushes its file.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
        self.daemon = None;
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        if std::env::var_os("RDSD_VMLAB_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// One command running in the guest: its `RDSG <tag>` lines.
pub struct Job {
    /// The job's tag.
    pub tag: String,
    lines: Shared,
}

impl Job {
    /// Waits up to `limit` for a line starting with `prefix`; returns the rest. Lines of this
    /// job before it are skipped; a `FAIL` line or the job's exit is an error.
    pub fn try_expect(&self, prefix: &str, limit: Duration) -> Result<String, String> {
        let deadline = Instant::now() + limit;
        let (m, cv) = &*self.lines;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            while let Some(l) = g.by_tag.get_mut(&self.tag).and_then(|q| q.pop_front()) {
                if let Some(rest) = l.strip_prefix(prefix) {
                    return Ok(rest.trim().to_string());
                }
                if l.starts_with("FAIL") || (l.starts_with("exit") && prefix != "exit") {
                    return Err(format!(
                        "guest job {} while waiting for {prefix:?}: {l}",
                        self.tag
                    ));
                }
                eprintln!("vmlab [{}] {l}", self.tag);
            }
            if g.eof {
                return Err(format!("qemu's output ended while waiting for {prefix:?}"));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "timed out after {limit:?} waiting for guest job {} line {prefix:?}",
                    self.tag
                ));
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Like [`Job::try_expect`], panicking on error.
    pub fn expect(&self, prefix: &str, limit: Duration) -> String {
        self.try_expect(prefix, limit)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every line of this job up to and including the first that starts with `prefix`, or
    /// those that came within `limit` (a diagnosis must not hang on a stuck guest).
    pub fn lines_until(&self, prefix: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let (m, cv) = &*self.lines;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        let mut got = Vec::new();
        loop {
            while let Some(l) = g.by_tag.get_mut(&self.tag).and_then(|q| q.pop_front()) {
                let last = l.starts_with(prefix);
                if l == "started" {
                    continue;
                }
                got.push(l);
                if last {
                    return got;
                }
            }
            let now = Instant::now();
            if g.eof || now >= deadline {
                return got;
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// `key=value` out of a result line.
    pub fn field(line: &str, key: &str) -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
    }
}

/// The lab shared by the tests of one test binary (booted once, reused, serialised).
static SHARED: Mutex<Option<Result<VmLab, String>>> = Mutex::new(None);

extern "C" fn cleanup_shared() {
    let g = match SHARED.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    };
    if let Some(mut g) = g {
        g.take();
    }
}

/// Exclusive access to the shared lab.
pub struct LabGuard(MutexGuard<'static, Option<Result<VmLab, String>>>);

impl std::ops::Deref for LabGuard {
    type Target = VmLab;
    fn deref(&self) -> &VmLab {
        self.0.as_ref().unwrap().as_ref().unwrap()
    }
}

impl std::ops::DerefMut for LabGuard {
    fn deref_mut(&mut self) -> &mut VmLab {
        self.0.as_mut().unwrap().as_mut().unwrap()
    }
}

/// Tests with dozens of sockets need more descriptors than the usual soft limit.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The shared lab, booted on first use; `None` (after `crate::skip_or_fail`: a failure in CI,
/// a counted skip elsewhere) only when qemu cannot start at all. Torn down at process exit. Each caller holds it exclusively until the guard
/// drops; a previous test's leftover guest jobs are killed first.
/// How many times the shared lab's guests have reset their NIC so far (0 before it exists).
pub fn shared_nic_resets() -> usize {
    let g = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    match &*g {
        Some(Ok(lab)) => lab.nic_resets(),
        _ => 0,
    }
}

/// Runs a test of the shared lab. If it fails and the guest reset its NIC while it ran (qemu
/// had stopped taking its frames: the lab's fault, `tests/vmlab/README.md`), it says so, boots
/// a fresh guest and a fresh rdsd, and runs the test once more; a second failure fails it.
/// A failure without a NIC reset fails at once.
pub fn retry_after_nic_reset(test: impl Fn()) {
    let before = shared_nic_resets();
    let Err(failure) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&test)) else {
        return;
    };
    let after = shared_nic_resets();
    if after == before {
        std::panic::resume_unwind(failure);
    }
    eprintln!(
        "vmlab: the test failed after the guest reset its NIC {} time(s) while it ran (qemu \
         had stopped taking its frames); booting a fresh guest and rdsd and running it once more",
        after - before
    );
    {
        let mut g = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Ok(lab)) = g.as_mut() {
            lab.shutdown_vm();
            lab.daemon = None;
        }
    }
    test();
}

pub fn shared_lab() -> Option<LabGuard> {
    let mut g = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if g.is_none() {
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(cleanup_shared) };
        raise_fd_limit();
        *g = Some(VmLab::new(&[]).map_err(|e| e.0));
    }
    if let Some(Err(why)) = &*g {
        let why = format!("the VM lab cannot start qemu: {why}");
        drop(g);
        crate::skip_or_fail(&why, INSTALL);
        return None;
    }
    let mut lab = LabGuard(g);
    // A test that failed may have left the lab in any state: guest jobs, rdsd down, no VM.
    if lab
        .qemu
        .as_mut()
        .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    {
        lab.boot().expect("reboot the guest");
    }
    if lab.daemon.as_ref().and_then(|d| d.child.as_ref()).is_none() {
        lab.start_rdsd();
    }
    lab.link(true);
    lab.nft_flush();
    lab.reset_guest();
    Some(lab)
}

// ----- RDMA guests (Soft-RoCE): self-contained initramfs with dynamic binaries -------------

/// Modules an RDMA guest loads: virtio-net, and Soft-RoCE with the userspace verbs and
/// rdma_cm devices. `rdma_rxe` needs `crc32_generic` loaded first (its crc32 is looked up by
/// name, not a module dependency).
pub const RDMA_GUEST_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "crc32_generic",
    "rdma_rxe",
    "ib_uverbs",
    "rdma_ucm",
];

/// The shared libraries `bin` loads (from `ldd`), the dynamic loader included.
pub fn shared_libs(bin: &Path) -> Vec<PathBuf> {
    let out = run(Command::new("ldd").arg(bin));
    let mut libs = Vec::new();
    for l in out.lines() {
        let path = match l.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next().unwrap_or(""),
            None => l.split_whitespace().next().unwrap_or(""),
        };
        if path.starts_with('/') && !libs.iter().any(|p: &PathBuf| p == Path::new(path)) {
            libs.push(PathBuf::from(path));
        }
    }
    libs
}

/// The start of every batch guest's `/init` (append the lab's own script to it): busybox's
/// applets, /proc, /sys, /dev, a tmpfs /dev/shm (shm-api's regions), and the initramfs's
/// modules loaded in order.
pub const GUEST_INIT_PREAMBLE: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /tmp /run/rdsd /dev/shm
mount -t tmpfs tmpfs /dev/shm
for m in $(cat /modules/order); do insmod /modules/$m || echo "LAB insmod $m failed"; done
"#;

/// The wire between two [`BatchGuest`]s: qemu's UDP socket netdev inside a network namespace
/// made for them (deleted on drop). Each guest's frames are datagrams to the other's port on
/// 127.0.0.1, so an nftables rule in the namespace can drop them: a cut wire with both links
/// up.
pub struct GuestWire {
    /// The namespace both qemus run in.
    pub ns: String,
    /// The UDP ports of guest 0 and guest 1.
    pub ports: (u16, u16),
}

impl GuestWire {
    /// A fresh namespace `name` with loopback up; the guests use ports `port` and `port + 1`.
    pub fn new(name: &str, port: u16) -> GuestWire {
        let _ = Command::new("ip").args(["netns", "del", name]).status();
        for args in [
            vec!["netns", "add", name],
            vec!["-n", name, "link", "set", "lo", "up"],
        ] {
            assert!(
                Command::new("ip").args(&args).status().unwrap().success(),
                "ip {args:?}"
            );
        }
        GuestWire {
            ns: name.to_string(),
            ports: (port, port + 1),
        }
    }

    /// qemu arguments for guest `side` (0 or 1): its end of the wire and a virtio NIC.
    pub fn netdev(&self, side: usize, mac: u8) -> Vec<String> {
        let (me, peer) = if side == 0 {
            self.ports
        } else {
            (self.ports.1, self.ports.0)
        };
        vec![
            "-netdev".into(),
            format!("socket,id=n0,udp=127.0.0.1:{peer},localaddr=127.0.0.1:{me}"),
            "-device".into(),
            format!("virtio-net-pci,netdev=n0,mac=52:54:00:12:34:{mac:02x}"),
        ]
    }
}

impl Drop for GuestWire {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

/// A self-contained initramfs: busybox, `modules` (with their dependencies, in load order,
/// listed in `/modules/order`), each `(guest path, host file)` of `bins` with every shared
/// library it needs at the same path as on the host (plus `lib64` → `lib/x86_64-linux-gnu`
/// style layouts handled by copying the real path and its `ldd` name), `files`
/// (`(guest path, bytes, mode)`), and `/init`.
pub fn custom_initramfs(
    k: &Kernel,
    modules: &[&str],
    init: &str,
    bins: &[(&str, &Path)],
    files: &[(&str, Vec<u8>, u32)],
) -> Vec<u8> {
    let busybox = busybox_path();
    let mut c = Cpio::default();
    let mut dirs: Vec<String> = ["bin", "dev", "proc", "sys", "tmp", "modules", "run", "etc"]
        .iter()
        .map(|d| d.to_string())
        .collect();
    for d in &dirs {
        c.dir(d);
    }
    let mut mkdirs = |c: &mut Cpio, path: &str| {
        let mut acc = String::new();
        for part in Path::new(path)
            .parent()
            .into_iter()
            .flat_map(|p| p.components())
        {
            let s = part.as_os_str().to_string_lossy();
            if s == "/" {
                continue;
            }
            if !acc.is_empty() {
                acc.push('/');
            }
            acc.push_str(&s);
            if !dirs.contains(&acc) {
                c.dir(&acc);
                dirs.push(acc.clone());
            }
        }
    };
    c.chardev("dev/console", 5, 1);
    c.file("bin/busybox", 0o755, &std::fs::read(&busybox).unwrap());
    c.file("init", 0o755, init.as_bytes());
    add_modules(&mut c, k, modules);
    let mut libs: Vec<PathBuf> = Vec::new();
    for (gpath, host) in bins {
        let g = gpath.trim_start_matches('/');
        mkdirs(&mut c, g);
        c.file(
            g,
            0o755,
            &std::fs::read(host).unwrap_or_else(|e| panic!("{}: {e}", host.display())),
        );
        for l in shared_libs(host) {
            if !libs.contains(&l) {
                libs.push(l);
            }
        }
    }
    for l in &libs {
        let g = l.to_string_lossy().trim_start_matches('/').to_string();
        mkdirs(&mut c, &g);
        // The real file under the name the binary asks for (symlinks resolved).
        let data = std::fs::read(std::fs::canonicalize(l).unwrap()).unwrap();
        c.file(&g, 0o755, &data);
    }
    for (gpath, data, mode) in files {
        let g = gpath.trim_start_matches('/');
        mkdirs(&mut c, g);
        c.file(g, *mode, data);
    }
    c.finish()
}

/// Binaries (`(guest path, host file)`) and files (`(guest path, bytes, mode)`) for an initramfs.
pub type GuestContent = (Vec<(String, PathBuf)>, Vec<(String, Vec<u8>, u32)>);

/// The files that make libibverbs find Soft-RoCE in a guest: the rxe provider (with the
/// libraries it needs) and `/etc/libibverbs.d/rxe.driver`. Returns `(bins, files)` entries
/// for [`custom_initramfs`].
pub fn rxe_provider_files() -> GuestContent {
    let dir = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs");
    let prov = std::fs::read_dir(dir)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("librxe-rdmav"))
        })
        .expect(
            "the rxe provider (librxe-rdmav*.so) is missing: apt-get install ibverbs-providers",
        );
    let driver = std::fs::read("/etc/libibverbs.d/rxe.driver")
        .expect("/etc/libibverbs.d/rxe.driver missing: apt-get install ibverbs-providers");
    (
        vec![(prov.to_string_lossy().into_owned(), prov)],
        vec![("etc/libibverbs.d/rxe.driver".into(), driver, 0o644)],
    )
}

/// A guest booted in batch mode: its `/init` runs to the end and powers off; the serial
/// console (ttyS0) is qemu's stdout, collected here.
pub struct BatchGuest {
    child: Child,
    out: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl BatchGuest {
    /// Boots `initrd` with the kernel `k`, kernel command line extra `append`, and
    /// `net` (qemu network arguments), inside namespace `ns` if given.
    pub fn boot(
        k: &Kernel,
        initrd: &Path,
        append: &str,
        net: &[String],
        ns: Option<&str>,
        mem_mb: u32,
    ) -> Result<BatchGuest, QemuUnavailable> {
        let qemu = qemu_bin();
        if Command::new(&qemu).arg("--version").output().is_err() {
            return Err(QemuUnavailable(format!(
                "{} cannot run (apt-get install qemu-system-x86)",
                qemu.display()
            )));
        }
        let mut cmd = match ns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&qemu);
                c
            }
            None => Command::new(&qemu),
        };
        // `-cpu max`: rdsd links Debian's DPDK, whose librte_eal is built for corei7 (SSE4.2)
        // and dies with SIGILL on qemu's default TCG CPU (qemu64).
        cmd.args(["-accel", "tcg", "-cpu", "max", "-smp", "1", "-no-reboot"])
            .args(["-m", &mem_mb.to_string()])
            .args(["-display", "none", "-monitor", "none"])
            .arg("-kernel")
            .arg(&k.vmlinuz)
            .arg("-initrd")
            .arg(initrd)
            .args([
                "-append",
                &format!("console=ttyS0 panic=-1 loglevel=3 rdinit=/init {append}"),
            ])
            .args(["-serial", "stdio"])
            .args(net)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .map_err(|e| QemuUnavailable(format!("spawn qemu: {e}")))?;
        let stdout = child.stdout.take().unwrap();
        let out: Arc<Mutex<String>> = Arc::default();
        let o = out.clone();
        let trace = std::env::var_os("RDSD_VMLAB_TRACE").is_some();
        let reader = std::thread::spawn(move || {
            for l in BufReader::new(stdout).split(b'\n') {
                let Ok(l) = l else { break };
                let l = String::from_utf8_lossy(&l)
                    .trim_end_matches('\r')
                    .to_string();
                if trace {
                    eprintln!("guest< {l}");
                }
                let mut g = o.lock().unwrap_or_else(|e| e.into_inner());
                g.push_str(&l);
                g.push('\n');
            }
        });
        Ok(BatchGuest {
            child,
            out,
            reader: Some(reader),
        })
    }

    /// Everything the guest printed so far.
    pub fn output(&self) -> String {
        self.out.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the guest has printed a line containing `needle` (true), or until it
    /// powers off or `limit` passes (false; the guest keeps running). For host-side actions
    /// timed by the guest, such as cutting the wire mid-stream.
    pub fn wait_for(&mut self, needle: &str, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            if self.output().contains(needle) {
                return true;
            }
            if Instant::now() > end || matches!(self.child.try_wait(), Ok(Some(_))) {
                return self.output().contains(needle);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the guest to power off (true) or `limit` to pass (false; it is killed).
    pub fn wait(&mut self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                return true;
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for BatchGuest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
