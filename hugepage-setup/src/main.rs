//! `hugepage-setup`: reserves huge pages for rdsd's shared regions and mounts hugetlbfs.
//!
//! ```text
//! hugepage-setup [--pages N] [--mount /dev/hugepages] [--check]
//! ```
//!
//! Idempotent: it raises `/proc/sys/vm/nr_hugepages` to at least N (never lowers it), reads
//! back what the kernel actually reserved from `/proc/meminfo` (it may find fewer contiguous
//! pages than asked), and mounts hugetlbfs at the mount point unless `/proc/mounts` already
//! shows it there. `--check` changes nothing and only reports.
//!
//! Exit status: 0 when at least one huge page is reserved (or N is 0) and hugetlbfs is mounted;
//! 1 otherwise, with a message on stderr. rdsd runs without huge pages too (`--hugepages auto`
//! falls back to 4 KiB pages), so callers may treat a failure as a warning.

use anyhow::{bail, Context, Result};
use clap::Parser;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const MEMINFO: &str = "/proc/meminfo";
const MOUNTS: &str = "/proc/mounts";

/// Reserve huge pages for rdsd and mount hugetlbfs (safe to run again).
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// Huge pages to have reserved at least (512 × 2 MiB = 1 GiB). 0 = reserve nothing.
    #[arg(long, default_value_t = 512)]
    pages: u64,
    /// Where hugetlbfs should be mounted.
    #[arg(long, default_value = "/dev/hugepages")]
    mount: PathBuf,
    /// Only report the current state; change nothing. Exit 0 if ready, 1 if not.
    #[arg(long)]
    check: bool,
}

/// The huge-page lines of `/proc/meminfo`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct HugeInfo {
    /// HugePages_Total: pages in the persistent pool (plus surplus).
    total: u64,
    /// HugePages_Free: pages not yet handed out.
    free: u64,
    /// HugePages_Rsvd: promised to mappings but not yet faulted in.
    rsvd: u64,
    /// HugePages_Surp: surplus pages above nr_hugepages.
    surplus: u64,
    /// Hugepagesize in KiB (2048 on x86-64); 0 if the line is missing.
    page_kib: u64,
}

impl HugeInfo {
    /// Pages a new mapping could still reserve.
    fn available(&self) -> u64 {
        self.free.saturating_sub(self.rsvd)
    }
}

/// Parses `/proc/meminfo`. HugePages_Total and HugePages_Free must be present (a kernel
/// without hugetlb support has neither).
fn parse_meminfo(text: &str) -> Result<HugeInfo> {
    let mut info = HugeInfo::default();
    let (mut have_total, mut have_free) = (false, false);
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let Some(num) = rest.split_whitespace().next() else {
            continue;
        };
        let field = match key.trim() {
            "HugePages_Total" => {
                have_total = true;
                &mut info.total
            }
            "HugePages_Free" => {
                have_free = true;
                &mut info.free
            }
            "HugePages_Rsvd" => &mut info.rsvd,
            "HugePages_Surp" => &mut info.surplus,
            "Hugepagesize" => &mut info.page_kib,
            _ => continue,
        };
        *field = num
            .parse()
            .with_context(|| format!("bad number in meminfo line {line:?}"))?;
    }
    if !(have_total && have_free) {
        bail!("{MEMINFO} has no HugePages_Total/HugePages_Free lines: this kernel lacks hugetlb support");
    }
    Ok(info)
}

/// One line of `/proc/mounts`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct MountEntry {
    source: String,
    target: PathBuf,
    fstype: String,
    options: String,
}

/// Undoes the octal escapes the kernel writes into /proc/mounts (`\040` for a space, `\011`
/// tab, `\012` newline, `\134` backslash).
fn unescape_mount_field(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (oct[0] - b'0') as u32 * 64
                    + (oct[1] - b'0') as u32 * 8
                    + (oct[2] - b'0') as u32;
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `/proc/mounts` (fstab format); malformed lines are skipped.
fn parse_mounts(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let source = unescape_mount_field(f.next()?);
            let target = PathBuf::from(unescape_mount_field(f.next()?));
            let fstype = unescape_mount_field(f.next()?);
            let options = f.next().map(unescape_mount_field).unwrap_or_default();
            Some(MountEntry {
                source,
                target,
                fstype,
                options,
            })
        })
        .collect()
}

/// What is mounted at a path.
#[derive(Clone, Debug, PartialEq, Eq)]
enum MountState {
    /// hugetlbfs (with these options).
    Hugetlbfs(String),
    /// Another filesystem: we won't mount over it.
    Other(String),
    /// Nothing.
    Unmounted,
}

/// The state of `at`: the last entry for a path wins (later mounts hide earlier ones).
fn mount_state(mounts: &[MountEntry], at: &Path) -> MountState {
    match mounts.iter().rev().find(|m| m.target == at) {
        Some(m) if m.fstype == "hugetlbfs" => MountState::Hugetlbfs(m.options.clone()),
        Some(m) => MountState::Other(m.fstype.clone()),
        None => MountState::Unmounted,
    }
}

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))
}

fn read_nr_hugepages() -> Result<u64> {
    let s = read(NR_HUGEPAGES)?;
    s.trim()
        .parse()
        .with_context(|| format!("unexpected content {s:?} in {NR_HUGEPAGES}"))
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The mount point as /proc/mounts spells it: absolute, symlinks resolved when it exists.
fn normalize(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or(p.into())
    };
    std::fs::canonicalize(&abs).unwrap_or(abs)
}

fn mount_hugetlbfs(at: &Path) -> Result<()> {
    std::fs::create_dir_all(at)
        .with_context(|| format!("cannot create mount point {}", at.display()))?;
    let target =
        CString::new(at.as_os_str().as_bytes()).context("mount point contains a NUL byte")?;
    let fstype = CString::new("hugetlbfs").expect("no NUL");
    // SAFETY: all three pointers are valid NUL-terminated strings that outlive the call; a
    // null `data` means default options (the default huge page size, the same pool that
    // nr_hugepages and rdsd's MFD_HUGETLB memfds use).
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        bail!("mount -t hugetlbfs hugetlbfs {} failed: {e}", at.display());
    }
    Ok(())
}

fn page_desc(info: &HugeInfo) -> String {
    match info.page_kib {
        0 => "huge pages".to_string(),
        k if k % 1024 == 0 => format!("{} MiB pages", k / 1024),
        k => format!("{k} KiB pages"),
    }
}

fn report(info: &HugeInfo, nr: u64, state: &MountState, at: &Path) {
    println!(
        "huge pages: nr_hugepages={nr} HugePages_Total={} HugePages_Free={} HugePages_Rsvd={} ({}; {} MiB reserved)",
        info.total,
        info.free,
        info.rsvd,
        page_desc(info),
        info.total * info.page_kib / 1024
    );
    match state {
        MountState::Hugetlbfs(o) => println!("hugetlbfs: mounted at {} ({o})", at.display()),
        MountState::Other(t) => println!(
            "hugetlbfs: NOT mounted at {} ({t} is mounted there)",
            at.display()
        ),
        MountState::Unmounted => println!("hugetlbfs: not mounted at {}", at.display()),
    }
}

fn run(cli: &Cli) -> Result<bool> {
    let at = normalize(&cli.mount);
    let before = parse_meminfo(&read(MEMINFO)?)?;
    let nr = read_nr_hugepages()?;
    let state = mount_state(&parse_mounts(&read(MOUNTS)?), &at);
    let pages_ok = |info: &HugeInfo| cli.pages == 0 || info.total >= 1;

    if cli.check {
        report(&before, nr, &state, &at);
        let target = if nr >= cli.pages { "met" } else { "NOT met" };
        println!("target of {} pages: {target}", cli.pages);
        let ready = pages_ok(&before) && matches!(state, MountState::Hugetlbfs(_));
        println!(
            "{}",
            if ready {
                "ready"
            } else {
                "not ready: run hugepage-setup as root"
            }
        );
        return Ok(ready);
    }

    if let MountState::Other(t) = &state {
        bail!(
            "{} already has a {t} filesystem mounted; pick another --mount",
            at.display()
        );
    }
    let need_pages = nr < cli.pages;
    let need_mount = state == MountState::Unmounted;
    if (need_pages || need_mount) && !is_root() {
        let mut what = Vec::new();
        if need_pages {
            what.push(format!("raise {NR_HUGEPAGES} from {nr} to {}", cli.pages));
        }
        if need_mount {
            what.push(format!("mount hugetlbfs at {}", at.display()));
        }
        bail!(
            "must run as root to {} (try: sudo hugepage-setup ...; --check only reports)",
            what.join(" and ")
        );
    }

    if need_pages {
        println!("raising {NR_HUGEPAGES} from {nr} to {}", cli.pages);
        std::fs::write(NR_HUGEPAGES, format!("{}\n", cli.pages)).with_context(|| {
            format!("cannot write {NR_HUGEPAGES} (a container with a read-only /proc/sys can't reserve huge pages)")
        })?;
    } else {
        println!(
            "{NR_HUGEPAGES} is already {nr} (>= {} requested): leaving it",
            cli.pages
        );
    }
    let after = parse_meminfo(&read(MEMINFO)?)?;
    let nr_after = read_nr_hugepages()?;
    if need_pages && nr_after < cli.pages {
        eprintln!(
            "hugepage-setup: warning: asked for {} huge pages, the kernel reserved only {nr_after} \
             (memory is too fragmented or too small); reserve them at boot with hugepages={} on the \
             kernel command line, or retry after `echo 3 > /proc/sys/vm/drop_caches`",
            cli.pages, cli.pages
        );
    }

    let mounted_state = if need_mount {
        mount_hugetlbfs(&at)?;
        println!("mounted hugetlbfs at {}", at.display());
        mount_state(&parse_mounts(&read(MOUNTS)?), &at)
    } else {
        state
    };
    report(&after, nr_after, &mounted_state, &at);
    println!(
        "got {} of {} requested pages ({} available for new regions)",
        after.total,
        cli.pages,
        after.available()
    );

    if !pages_ok(&after) {
        bail!(
            "the kernel reserved no huge pages at all (asked for {}); rdsd will fall back to 4 KiB pages",
            cli.pages
        );
    }
    Ok(true)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("hugepage-setup: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO_SAMPLE: &str = "MemTotal:        8148136 kB\n\
MemFree:          524288 kB\n\
AnonHugePages:         0 kB\n\
ShmemHugePages:        0 kB\n\
FileHugePages:      2048 kB\n\
HugePages_Total:     300\n\
HugePages_Free:      280\n\
HugePages_Rsvd:       16\n\
HugePages_Surp:        0\n\
Hugepagesize:       2048 kB\n\
Hugetlb:          614400 kB\n";

    #[test]
    fn meminfo_huge_lines() {
        let i = parse_meminfo(MEMINFO_SAMPLE).unwrap();
        assert_eq!(
            i,
            HugeInfo {
                total: 300,
                free: 280,
                rsvd: 16,
                surplus: 0,
                page_kib: 2048
            }
        );
        assert_eq!(i.available(), 264);
        assert_eq!(page_desc(&i), "2 MiB pages");
    }

    #[test]
    fn meminfo_ignores_lookalikes_and_requires_the_pool_lines() {
        // AnonHugePages / ShmemHugePages must not be taken for HugePages_*.
        let no_pool = "MemTotal: 1 kB\nAnonHugePages: 5 kB\nShmemHugePages: 7 kB\n";
        assert!(parse_meminfo(no_pool).is_err());
        let zero =
            "HugePages_Total:       0\nHugePages_Free:        0\nHugepagesize:    1048576 kB\n";
        let i = parse_meminfo(zero).unwrap();
        assert_eq!((i.total, i.free, i.page_kib), (0, 0, 1 << 20));
        assert_eq!(page_desc(&i), "1024 MiB pages");
        assert!(parse_meminfo("HugePages_Total: x\nHugePages_Free: 1\n").is_err());
    }

    const MOUNTS_SAMPLE: &str = "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n\
udev /dev devtmpfs rw,nosuid,relatime,size=4052172k,nr_inodes=1013043,mode=755 0 0\n\
hugetlbfs /dev/hugepages hugetlbfs rw,relatime,pagesize=2M 0 0\n\
tmpfs /mnt/with\\040space tmpfs rw 0 0\n\
hugetlbfs /mnt/huge hugetlbfs rw,pagesize=2M 0 0\n\
tmpfs /mnt/huge tmpfs rw 0 0\n\
garbage\n";

    #[test]
    fn mounts_parsing_and_state() {
        let m = parse_mounts(MOUNTS_SAMPLE);
        assert_eq!(m.len(), 7, "the malformed line is skipped");
        assert_eq!(
            m[3],
            MountEntry {
                source: "hugetlbfs".into(),
                target: "/dev/hugepages".into(),
                fstype: "hugetlbfs".into(),
                options: "rw,relatime,pagesize=2M".into()
            }
        );
        assert_eq!(m[4].target, Path::new("/mnt/with space"));
        assert_eq!(
            mount_state(&m, Path::new("/dev/hugepages")),
            MountState::Hugetlbfs("rw,relatime,pagesize=2M".into())
        );
        assert_eq!(
            mount_state(&m, Path::new("/dev")),
            MountState::Other("devtmpfs".into())
        );
        assert_eq!(
            mount_state(&m, Path::new("/dev/hugepages2")),
            MountState::Unmounted
        );
        // The later mount hides the earlier one.
        assert_eq!(
            mount_state(&m, Path::new("/mnt/huge")),
            MountState::Other("tmpfs".into())
        );
    }

    #[test]
    fn unescape() {
        assert_eq!(unescape_mount_field("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape_mount_field("plain"), "plain");
        assert_eq!(unescape_mount_field("trail\\04"), "trail\\04");
        assert_eq!(unescape_mount_field("\\999"), "\\999");
        assert_eq!(unescape_mount_field("end\\"), "end\\");
    }

    #[test]
    fn real_proc_files_parse() {
        // Whatever this machine has, the parsers must accept it.
        if let Ok(t) = std::fs::read_to_string(MEMINFO) {
            if t.contains("HugePages_Total") {
                parse_meminfo(&t).unwrap();
            }
        }
        if let Ok(t) = std::fs::read_to_string(MOUNTS) {
            assert!(parse_mounts(&t).iter().any(|m| m.target == Path::new("/")));
        }
    }
}
