//! `hugepage-setup`: reserves huge pages for rdsd (and DPDK) and mounts hugetlbfs, in the
//! manner of DPDK's `dpdk-hugepages.py`.
//!
//! ```text
//! hugepage-setup --show                                  pools per page size and NUMA node, mounts
//! hugepage-setup --setup 1G [--pagesize 2M|1G] [--node N] [--mount DIR] [--owner U]
//!                [--group G] [--mode 0770] [--no-mount] [--persist [--root DIR]] [--dry-run]
//! hugepage-setup --clear [--pagesize SIZE] [--node N] [--dry-run]
//! hugepage-setup [--pages N] [--mount DIR] [--check]     the original CLI (tests/run.sh, demo.sh)
//! ```
//!
//! `--setup SIZE` sets the pool of one page size (the default one unless `--pagesize`), on
//! all nodes or on `--node N`, to exactly SIZE of memory (rounded up to whole pages), reads
//! back what the kernel granted, and mounts hugetlbfs (default `/dev/hugepages` for the
//! default page size, `/dev/hugepages-<size>` for another one) unless `--no-mount`. If the
//! kernel grants fewer pages than asked, it still mounts and persists, then fails with
//! asked/granted. `--clear` sets the pools to 0 (pages in use stay, as surplus).
//!
//! The original CLI (`--pages N`, no --show/--setup/--clear) raises `vm.nr_hugepages` to at
//! least N (never lowers it) and mounts; it fails only if no page at all is reserved. rdsd
//! runs without huge pages too (`--hugepages auto` falls back to 4 KiB pages), so callers
//! may treat its failure as a warning.
//!
//! Mounting is idempotent: an existing hugetlbfs mount of the right page size is kept and
//! its owner/mode fixed if `--owner/--group/--mode` ask for others.

mod exec;
mod mount;
mod persist;
mod plan;
mod sysfs;

use anyhow::{bail, Context, Result};
use clap::Parser;
use mount::{MountSpec, MountState};
use plan::Action;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use sysfs::{fmt_size, parse_size, Grant, Scope, Sysfs};

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const MEMINFO: &str = "/proc/meminfo";
const MOUNTS: &str = "/proc/mounts";
const DEFAULT_MOUNT: &str = "/dev/hugepages";

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn mode_arg(s: &str) -> Result<u32, String> {
    mount::parse_mode(s).map_err(|e| e.to_string())
}

/// Reserve huge pages for rdsd and mount hugetlbfs (safe to run again).
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// Original mode: huge pages (of the default size) to have reserved at least; never
    /// lowers the count. 0 = reserve nothing (only mount).
    #[arg(long, default_value_t = 512, conflicts_with_all = ["show", "setup", "clear"])]
    pages: u64,
    /// Original mode: only report the current state; change nothing. Exit 0 if ready.
    #[arg(long, conflicts_with_all = ["show", "setup", "clear", "dry_run"])]
    check: bool,
    /// Show the pools (per page size and NUMA node: total, free, reserved, surplus) and the
    /// hugetlbfs mounts; change nothing.
    #[arg(long, conflicts_with_all = ["setup", "clear"])]
    show: bool,
    /// Reserve SIZE of memory (e.g. 1G, 512M) in huge pages: sets the pool to exactly that.
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    setup: Option<u64>,
    /// Release the reserved pages (of --pagesize, else of every size; on --node, else all).
    #[arg(long, conflicts_with = "setup")]
    clear: bool,
    /// Huge page size for --setup/--clear (2M, 1G); default: the kernel's default size.
    #[arg(long, value_name = "SIZE", value_parser = size_arg)]
    pagesize: Option<u64>,
    /// NUMA node for --setup/--clear (default: the global pool, spread by the kernel).
    #[arg(long, value_name = "N")]
    node: Option<u32>,
    /// Print what would be done; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Where hugetlbfs should be mounted (default /dev/hugepages; /dev/hugepages-<size> for
    /// a non-default --pagesize).
    #[arg(long, value_name = "DIR")]
    mount: Option<PathBuf>,
    /// --setup: do not mount hugetlbfs.
    #[arg(long, requires = "setup", conflicts_with = "mount")]
    no_mount: bool,
    /// Owner (name or uid) of the hugetlbfs mount.
    #[arg(long, value_name = "USER")]
    owner: Option<String>,
    /// Group (name or gid) of the hugetlbfs mount.
    #[arg(long, value_name = "GROUP")]
    group: Option<String>,
    /// Mode (octal) of the hugetlbfs mount, e.g. 0770.
    #[arg(long, value_name = "MODE", value_parser = mode_arg)]
    mode: Option<u32>,
    /// --setup: also write a sysctl.d (or tmpfiles.d) file and a systemd mount unit, so the
    /// setup survives a reboot.
    #[arg(long, requires = "setup")]
    persist: bool,
    /// Directory under which --persist writes etc/... (tests use a temp dir).
    #[arg(long, value_name = "DIR", default_value = "/")]
    root: PathBuf,
    /// sysfs to read and write (tests use a fake tree).
    #[arg(long, value_name = "DIR", default_value = "/sys", hide = true)]
    sysfs: PathBuf,
    /// mount table to read (tests use a fake one).
    #[arg(long, value_name = "FILE", default_value = MOUNTS, hide = true)]
    proc_mounts: PathBuf,
}

/// Tests: a stand-in for the kernel's reaction to a write into a fake sysfs.
#[cfg(test)]
type FakeKernel = Box<dyn Fn(&Sysfs)>;

/// Where the state lives and what we may do; injectable for tests.
struct Ctx {
    sysfs: Sysfs,
    mounts_file: PathBuf,
    /// Running as root (or writing a fake sysfs, which needs no privilege).
    privileged: bool,
    dry_run: bool,
    /// Tests: plays the kernel after a write to a fake sysfs (e.g. grants fewer pages).
    #[cfg(test)]
    fake_kernel: Option<FakeKernel>,
}

impl Ctx {
    fn from_cli(cli: &Cli) -> Ctx {
        let real = cli.sysfs == Path::new("/sys");
        Ctx {
            sysfs: Sysfs::new(&cli.sysfs),
            mounts_file: cli.proc_mounts.clone(),
            privileged: is_root() || !real,
            dry_run: cli.dry_run,
            #[cfg(test)]
            fake_kernel: None,
        }
    }

    fn mounts(&self) -> Result<Vec<mount::MountEntry>> {
        let t = std::fs::read_to_string(&self.mounts_file)
            .with_context(|| format!("cannot read {}", self.mounts_file.display()))?;
        Ok(mount::parse_mounts(&t))
    }

    /// A clear error when a change needs root and we are not.
    fn need_root(&self, actions: &[Action]) -> Result<()> {
        if self.dry_run || self.privileged || actions.is_empty() {
            return Ok(());
        }
        let what: Vec<String> = actions.iter().map(|a| a.describe()).collect();
        bail!(
            "must run as root to:\n  {}\n(try: sudo hugepage-setup ...; --show and --dry-run need no privilege)",
            what.join("\n  ")
        )
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The pool counters as a table.
fn show(ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let sizes = ctx.sysfs.page_sizes()?;
    let default = ctx.sysfs.default_page_kib()?;
    writeln!(
        out,
        "huge page pools ({}; default page size {}):",
        ctx.sysfs.root.display(),
        fmt_size(default * 1024)
    )?;
    writeln!(
        out,
        "  {:<6} {:<6} {:>8} {:>8} {:>8} {:>8} {:>10}",
        "size", "node", "total", "free", "reserved", "surplus", "memory"
    )?;
    let nodes = ctx.sysfs.nodes();
    for k in &sizes {
        let mut rows = vec![("all".to_string(), Scope::Global)];
        rows.extend(nodes.iter().map(|n| (format!("{n}"), Scope::Node(*n))));
        for (name, scope) in rows {
            let c = match ctx.sysfs.counts(scope, *k) {
                Ok(c) => c,
                Err(_) if scope != Scope::Global => continue,
                Err(e) => return Err(e),
            };
            writeln!(
                out,
                "  {:<6} {:<6} {:>8} {:>8} {:>8} {:>8} {:>10}",
                fmt_size(k * 1024),
                name,
                c.total,
                c.free,
                c.reserved.map_or("-".to_string(), |r| r.to_string()),
                c.surplus,
                fmt_size(c.total * k * 1024)
            )?;
        }
    }
    let mounts: Vec<_> = ctx
        .mounts()?
        .into_iter()
        .filter(|m| m.fstype == "hugetlbfs")
        .collect();
    writeln!(out, "hugetlbfs mounts:")?;
    if mounts.is_empty() {
        writeln!(out, "  none")?;
    }
    for m in mounts {
        let ps = mount::mount_pagesize_kib(&m.options).unwrap_or(default);
        writeln!(
            out,
            "  {} pagesize {} {} ({})",
            m.target.display(),
            fmt_size(ps * 1024),
            mount::describe_owner(&m.target),
            m.options
        )?;
    }
    Ok(())
}

fn scope_of(cli: &Cli) -> Scope {
    cli.node.map_or(Scope::Global, Scope::Node)
}

/// Page size in KiB from --pagesize (checked to be a whole number of KiB).
fn page_kib_of(cli: &Cli, ctx: &Ctx) -> Result<u64> {
    match cli.pagesize {
        Some(b) if b % 1024 != 0 || b == 0 => bail!("bad --pagesize {b}: not a whole KiB"),
        Some(b) => Ok(b / 1024),
        None => ctx.sysfs.default_page_kib(),
    }
}

/// The mount that --setup (or the original mode) asks for; None with --no-mount.
fn mount_spec(cli: &Cli, page_kib: u64, default_kib: u64) -> Result<Option<MountSpec>> {
    if cli.no_mount {
        return Ok(None);
    }
    let dir = match &cli.mount {
        Some(d) => mount::normalize(d),
        None if page_kib == default_kib => PathBuf::from(DEFAULT_MOUNT),
        None => PathBuf::from(format!("{DEFAULT_MOUNT}-{}", fmt_size(page_kib * 1024))),
    };
    Ok(Some(MountSpec {
        dir,
        page_kib: (page_kib != default_kib).then_some(page_kib),
        uid: cli.owner.as_deref().map(mount::resolve_user).transpose()?,
        gid: cli.group.as_deref().map(mount::resolve_group).transpose()?,
        mode: cli.mode,
    }))
}

/// Pages needed for `bytes` (rounded up).
fn pages_for(bytes: u64, page_kib: u64) -> u64 {
    bytes.div_ceil(page_kib * 1024)
}

/// --setup SIZE.
fn setup(cli: &Cli, ctx: &Ctx, bytes: u64, out: &mut dyn Write) -> Result<()> {
    let page_kib = page_kib_of(cli, ctx)?;
    let default_kib = ctx.sysfs.default_page_kib()?;
    let scope = scope_of(cli);
    ctx.sysfs.validate(scope, page_kib)?;
    let pages = pages_for(bytes, page_kib);
    let file = ctx.sysfs.nr_file(scope, page_kib);
    let before = ctx.sysfs.counts(scope, page_kib)?;
    writeln!(
        out,
        "setup: {} = {pages} pages of {}{}",
        fmt_size(pages * page_kib * 1024),
        fmt_size(page_kib * 1024),
        match scope {
            Scope::Global => String::new(),
            Scope::Node(n) => format!(" on node {n}"),
        }
    )?;
    let mut actions = Vec::new();
    if before.total != pages {
        actions.push(Action::SetPages {
            file: file.clone(),
            from: before.total,
            to: pages,
        });
    } else {
        writeln!(out, "{} is already {pages}", file.display())?;
    }
    let spec = mount_spec(cli, page_kib, default_kib)?;
    if let Some(spec) = &spec {
        let m = mount::plan_mount(spec, &ctx.mounts()?, default_kib)?;
        if m.is_empty() {
            writeln!(
                out,
                "hugetlbfs already mounted at {} as asked",
                spec.dir.display()
            )?;
        }
        actions.extend(m);
    }
    let mut persist_actions = Vec::new();
    if cli.persist {
        persist_actions = persist::plan_persist(
            &cli.root,
            Path::new("/sys"),
            pages,
            page_kib,
            default_kib,
            scope,
            spec.as_ref(),
        );
    }
    ctx.need_root(&actions)?;
    if cli.root == Path::new("/") {
        ctx.need_root(&persist_actions)?;
    }

    // The pages first, then read back what the kernel granted; mount and persist even if it
    // granted fewer (they are right either way), then report the shortfall as an error.
    let (set, rest): (Vec<Action>, Vec<Action>) = actions
        .into_iter()
        .partition(|a| matches!(a, Action::SetPages { .. }));
    exec::apply(&set, ctx.dry_run, out)?;
    #[cfg(test)]
    if let (Some(k), false) = (&ctx.fake_kernel, ctx.dry_run) {
        k(&ctx.sysfs);
    }
    let grant = if ctx.dry_run || set.is_empty() {
        None
    } else {
        let after = ctx.sysfs.counts(scope, page_kib)?;
        writeln!(out, "granted: {} of {pages} pages", after.total)?;
        Some(Grant {
            asked: pages,
            granted: after.total,
        })
    };
    exec::apply(&rest, ctx.dry_run, out)?;
    exec::apply(&persist_actions, ctx.dry_run, out)?;
    if cli.persist && !ctx.dry_run {
        writeln!(
            out,
            "persisted; to apply now: systemctl daemon-reload && systemctl enable {}",
            spec.as_ref()
                .map(|s| format!("{}.mount", persist::systemd_escape_path(&s.dir)))
                .unwrap_or_else(|| "(no mount)".into())
        )?;
    }
    if let Some(g) = grant {
        g.check(page_kib, scope)?;
    }
    Ok(())
}

/// --clear.
fn clear(cli: &Cli, ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let scope = scope_of(cli);
    let sizes = match cli.pagesize {
        Some(_) => vec![page_kib_of(cli, ctx)?],
        None => ctx.sysfs.page_sizes()?,
    };
    let mut actions = Vec::new();
    for k in &sizes {
        ctx.sysfs.validate(scope, *k)?;
        let c = ctx.sysfs.counts(scope, *k)?;
        if c.total != 0 {
            actions.push(Action::SetPages {
                file: ctx.sysfs.nr_file(scope, *k),
                from: c.total,
                to: 0,
            });
        }
    }
    if actions.is_empty() {
        writeln!(out, "nothing to clear: no pages reserved")?;
        return Ok(());
    }
    ctx.need_root(&actions)?;
    exec::apply(&actions, ctx.dry_run, out)?;
    if !ctx.dry_run {
        for k in &sizes {
            let c = ctx.sysfs.counts(scope, *k)?;
            if c.total != 0 {
                writeln!(
                    out,
                    "warning: {} {} pages are still in use and stay until freed",
                    c.total,
                    fmt_size(k * 1024)
                )?;
            }
        }
    }
    Ok(())
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

// ---- The original CLI: `hugepage-setup [--pages N] [--mount DIR] [--check]` ----

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))
}

fn read_nr_hugepages() -> Result<u64> {
    let s = read(NR_HUGEPAGES)?;
    s.trim()
        .parse()
        .with_context(|| format!("unexpected content {s:?} in {NR_HUGEPAGES}"))
}

fn page_desc(info: &HugeInfo) -> String {
    match info.page_kib {
        0 => "huge pages".to_string(),
        k if k % 1024 == 0 => format!("{} MiB pages", k / 1024),
        k => format!("{k} KiB pages"),
    }
}

fn report(
    out: &mut dyn Write,
    info: &HugeInfo,
    nr: u64,
    state: &MountState,
    at: &Path,
) -> Result<()> {
    writeln!(
        out,
        "huge pages: nr_hugepages={nr} HugePages_Total={} HugePages_Free={} HugePages_Rsvd={} ({}; {} MiB reserved)",
        info.total,
        info.free,
        info.rsvd,
        page_desc(info),
        info.total * info.page_kib / 1024
    )?;
    match state {
        MountState::Hugetlbfs(o) => writeln!(out, "hugetlbfs: mounted at {} ({o})", at.display())?,
        MountState::Other(t) => writeln!(
            out,
            "hugetlbfs: NOT mounted at {} ({t} is mounted there)",
            at.display()
        )?,
        MountState::Unmounted => writeln!(out, "hugetlbfs: not mounted at {}", at.display())?,
    }
    Ok(())
}

/// The original mode: at least `--pages` pages of the default size (never lowers), mount.
fn run_legacy(cli: &Cli, ctx: &Ctx, out: &mut dyn Write) -> Result<bool> {
    if cli.pagesize.is_some() || cli.node.is_some() {
        bail!("--pagesize and --node go with --setup or --clear (--pages is the default size, all nodes)");
    }
    let default_kib = ctx.sysfs.default_page_kib().unwrap_or(2048);
    let spec = mount_spec(cli, default_kib, default_kib)?.expect("--no-mount needs --setup");
    let at = spec.dir.clone();
    let before = parse_meminfo(&read(MEMINFO)?)?;
    let nr = read_nr_hugepages()?;
    let mounts = ctx.mounts()?;
    let state = mount::mount_state(&mounts, &at);
    let pages_ok = |info: &HugeInfo| cli.pages == 0 || info.total >= 1;

    if cli.check {
        report(out, &before, nr, &state, &at)?;
        let target = if nr >= cli.pages { "met" } else { "NOT met" };
        writeln!(out, "target of {} pages: {target}", cli.pages)?;
        let ready = pages_ok(&before) && matches!(state, MountState::Hugetlbfs(_));
        writeln!(
            out,
            "{}",
            if ready {
                "ready"
            } else {
                "not ready: run hugepage-setup as root"
            }
        )?;
        return Ok(ready);
    }

    let mut actions = Vec::new();
    let need_pages = nr < cli.pages;
    if need_pages {
        actions.push(Action::SetPages {
            file: NR_HUGEPAGES.into(),
            from: nr,
            to: cli.pages,
        });
    } else {
        writeln!(
            out,
            "{NR_HUGEPAGES} is already {nr} (>= {} requested): leaving it",
            cli.pages
        )?;
    }
    let mount_actions = mount::plan_mount(&spec, &mounts, default_kib)?;
    actions.extend(mount_actions);
    ctx.need_root(&actions)?;
    exec::apply(&actions, ctx.dry_run, out)?;
    if ctx.dry_run {
        return Ok(true);
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
    let mounted_state = mount::mount_state(&ctx.mounts()?, &at);
    report(out, &after, nr_after, &mounted_state, &at)?;
    writeln!(
        out,
        "got {} of {} requested pages ({} available for new regions)",
        after.total,
        cli.pages,
        after.available()
    )?;

    if !pages_ok(&after) {
        bail!(
            "the kernel reserved no huge pages at all (asked for {}); rdsd will fall back to 4 KiB pages",
            cli.pages
        );
    }
    Ok(true)
}

fn run(cli: &Cli, ctx: &Ctx, out: &mut dyn Write) -> Result<bool> {
    if cli.show {
        show(ctx, out)?;
        Ok(true)
    } else if let Some(bytes) = cli.setup {
        setup(cli, ctx, bytes, out)?;
        Ok(true)
    } else if cli.clear {
        clear(cli, ctx, out)?;
        Ok(true)
    } else {
        run_legacy(cli, ctx, out)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ctx = Ctx::from_cli(&cli);
    let mut out = std::io::stdout();
    match run(&cli, &ctx, &mut out) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            let _ = out.flush();
            eprintln!("hugepage-setup: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mount::{mount_state, parse_mounts, unescape_mount_field, MountEntry};

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

#[cfg(test)]
mod cli_tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A temp dir removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "hugepage-setup-test-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_pool(dir: &Path, nr: u64, free: u64, global: bool) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("nr_hugepages"), format!("{nr}\n")).unwrap();
        std::fs::write(dir.join("free_hugepages"), format!("{free}\n")).unwrap();
        std::fs::write(dir.join("surplus_hugepages"), "0\n").unwrap();
        if global {
            std::fs::write(dir.join("resv_hugepages"), "0\n").unwrap();
            std::fs::write(dir.join("nr_overcommit_hugepages"), "0\n").unwrap();
        }
    }

    /// A fake sysfs with 2 MiB and 1 GiB pools, two NUMA nodes; 2 MiB: 8 pages on node 0.
    fn fake_sysfs(t: &TempDir) -> PathBuf {
        let root = t.0.join("sys");
        for k in [2048u64, 1048576] {
            let n = if k == 2048 { 8 } else { 0 };
            write_pool(
                &root.join(format!("kernel/mm/hugepages/hugepages-{k}kB")),
                n,
                n,
                true,
            );
            write_pool(
                &root.join(format!(
                    "devices/system/node/node0/hugepages/hugepages-{k}kB"
                )),
                n,
                n,
                false,
            );
            write_pool(
                &root.join(format!(
                    "devices/system/node/node1/hugepages/hugepages-{k}kB"
                )),
                0,
                0,
                false,
            );
        }
        root
    }

    /// A fake /proc/mounts with `mounted` as a 2 MiB hugetlbfs mount.
    fn fake_mounts(t: &TempDir, mounted: &Path) -> PathBuf {
        let p = t.0.join("mounts");
        std::fs::write(
            &p,
            format!(
                "proc /proc proc rw 0 0\nhugetlbfs {} hugetlbfs rw,relatime,pagesize=2M 0 0\n",
                mounted.display()
            ),
        )
        .unwrap();
        p
    }

    fn parse(args: &[&str]) -> Cli {
        let mut v = vec!["hugepage-setup"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).unwrap()
    }

    fn ctx(cli: &Cli) -> Ctx {
        Ctx::from_cli(cli)
    }

    fn run_to_string(cli: &Cli, ctx: &Ctx) -> (Result<bool>, String) {
        let mut out = Vec::new();
        let r = run(cli, ctx, &mut out);
        (r, String::from_utf8(out).unwrap())
    }

    fn read_nr(p: &Path) -> u64 {
        std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2048kB").unwrap(), 2 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 2T ").unwrap(), 2 << 40);
        for bad in ["", "G", "1X", "-1G", "1.5G", "99999999999T"] {
            assert!(parse_size(bad).is_err(), "{bad:?} must be rejected");
        }
        assert_eq!(fmt_size(2 << 20), "2M");
        assert_eq!(fmt_size(1 << 30), "1G");
        assert_eq!(fmt_size(1536 << 10), "1536K");
        assert_eq!(fmt_size(100), "100");
        assert_eq!(pages_for(1 << 30, 2048), 512);
        assert_eq!(pages_for((1 << 30) + 1, 2048), 513, "rounded up");
        assert_eq!(pages_for(1 << 30, 1 << 20), 1);
        assert_eq!(mount::parse_mode("0770").unwrap(), 0o770);
        assert_eq!(mount::parse_mode("1777").unwrap(), 0o1777);
        assert!(mount::parse_mode("0789").is_err());
        assert!(mount::parse_mode("77777").is_err());
        assert_eq!(
            mount::mount_pagesize_kib("rw,pagesize=1024M"),
            Some(1 << 20)
        );
        assert_eq!(mount::mount_pagesize_kib("rw,relatime"), None);
    }

    #[test]
    fn cli_modes_and_conflicts() {
        let c = parse(&["--pages", "256"]);
        assert_eq!(c.pages, 256);
        assert!(c.setup.is_none() && !c.show && !c.clear);
        let c = parse(&[
            "--setup",
            "1G",
            "--pagesize",
            "1G",
            "--node",
            "1",
            "--dry-run",
        ]);
        assert_eq!(c.setup, Some(1 << 30));
        assert_eq!(c.pagesize, Some(1 << 30));
        assert_eq!(c.node, Some(1));
        let c = parse(&[
            "--setup",
            "64M",
            "--mount",
            "/mnt/h",
            "--owner",
            "root",
            "--group",
            "0",
            "--mode",
            "0770",
            "--persist",
            "--root",
            "/tmp/x",
        ]);
        assert_eq!(c.mode, Some(0o770));
        assert!(c.persist);
        for bad in [
            &["--setup", "1G", "--clear"][..],
            &["--show", "--setup", "1G"],
            &["--show", "--pages", "3"],
            &["--persist"],
            &["--no-mount"],
            &["--setup", "lots"],
            &["--setup", "1G", "--mode", "999"],
            &["--check", "--dry-run"],
        ] {
            let mut v = vec!["hugepage-setup"];
            v.extend_from_slice(bad);
            assert!(Cli::try_parse_from(v).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn show_lists_pools_per_size_and_node_and_mounts() {
        let t = TempDir::new("show");
        let sys = fake_sysfs(&t);
        let mnt = t.0.join("huge");
        std::fs::create_dir_all(&mnt).unwrap();
        let mounts = fake_mounts(&t, &mnt);
        let cli = parse(&[
            "--show",
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        assert!(r.unwrap());
        assert!(out.contains("default page size 2M"), "{out}");
        let row = |size: &str, node: &str, total: u64| {
            out.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() >= 3 && f[0] == size && f[1] == node && f[2] == total.to_string()
            })
        };
        assert!(row("2M", "all", 8), "{out}");
        assert!(row("2M", "0", 8), "{out}");
        assert!(row("2M", "1", 0), "{out}");
        assert!(row("1G", "all", 0), "{out}");
        assert!(row("1G", "1", 0), "{out}");
        assert!(
            out.contains(&format!("{} pagesize 2M", mnt.display())),
            "{out}"
        );
    }

    #[test]
    fn dry_run_prints_and_changes_nothing() {
        let t = TempDir::new("dry");
        let sys = fake_sysfs(&t);
        let mounts = fake_mounts(&t, Path::new("/somewhere/else"));
        let mnt = t.0.join("not-yet");
        let root = t.0.join("root");
        let cli = parse(&[
            "--setup",
            "1G",
            "--dry-run",
            "--mount",
            mnt.to_str().unwrap(),
            "--owner",
            "0",
            "--mode",
            "0770",
            "--persist",
            "--root",
            root.to_str().unwrap(),
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let mut c = ctx(&cli);
        c.privileged = false; // a dry run needs no privilege
        let (r, out) = run_to_string(&cli, &c);
        r.unwrap();
        let nr = sys.join("kernel/mm/hugepages/hugepages-2048kB/nr_hugepages");
        assert!(
            out.contains(&format!("would: echo 512 > {}   (was 8)", nr.display())),
            "{out}"
        );
        assert!(
            out.contains(&format!("would: mkdir -p {}", mnt.display())),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "would: mount -t hugetlbfs -o uid=0,mode=0770 hugetlbfs {}",
                mnt.display()
            )),
            "{out}"
        );
        assert!(out.contains("would: write "), "{out}");
        assert!(out.contains("vm.nr_hugepages = 512"), "{out}");
        // Nothing changed.
        assert_eq!(read_nr(&nr), 8);
        assert!(!mnt.exists());
        assert!(!root.exists());

        // The same for a node and 1 GiB pages, and for --clear.
        let cli = parse(&[
            "--setup",
            "2G",
            "--pagesize",
            "1G",
            "--node",
            "1",
            "--no-mount",
            "--dry-run",
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        let node1 =
            sys.join("devices/system/node/node1/hugepages/hugepages-1048576kB/nr_hugepages");
        assert!(
            out.contains(&format!("would: echo 2 > {}   (was 0)", node1.display())),
            "{out}"
        );
        let cli = parse(&["--clear", "--dry-run", "--sysfs", sys.to_str().unwrap()]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert!(
            out.contains(&format!("would: echo 0 > {}   (was 8)", nr.display())),
            "{out}"
        );
        assert_eq!(read_nr(&nr), 8);
    }

    #[test]
    fn setup_and_clear_on_a_fake_sysfs() {
        let t = TempDir::new("setup");
        let sys = fake_sysfs(&t);
        let mounts = fake_mounts(&t, Path::new("/x"));
        let s = sys.to_str().unwrap();
        let m = mounts.to_str().unwrap();
        let cli = parse(&[
            "--setup",
            "64M",
            "--node",
            "1",
            "--no-mount",
            "--sysfs",
            s,
            "--proc-mounts",
            m,
        ]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert!(out.contains("granted: 32 of 32 pages"), "{out}");
        let node1 = sys.join("devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages");
        assert_eq!(read_nr(&node1), 32);
        // Again: nothing to do.
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert!(out.contains("is already 32"), "{out}");

        let cli = parse(&["--clear", "--pagesize", "2M", "--sysfs", s, "--node", "1"]);
        let (r, _) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert_eq!(read_nr(&node1), 0);

        // Unknown page size and node: errors that list what exists.
        let cli = parse(&[
            "--setup",
            "1G",
            "--pagesize",
            "4M",
            "--no-mount",
            "--sysfs",
            s,
        ]);
        let e = run_to_string(&cli, &ctx(&cli)).0.unwrap_err().to_string();
        assert!(
            e.contains("4M is not supported") && e.contains("2M, 1G"),
            "{e}"
        );
        let cli = parse(&["--setup", "1G", "--node", "7", "--no-mount", "--sysfs", s]);
        let e = run_to_string(&cli, &ctx(&cli)).0.unwrap_err().to_string();
        assert!(e.contains("node 7 does not exist (nodes: 0, 1)"), "{e}");
    }

    #[test]
    fn fewer_pages_granted_is_an_error_with_asked_and_granted() {
        let t = TempDir::new("fewer");
        let sys = fake_sysfs(&t);
        let mnt = t.0.join("huge");
        std::fs::create_dir_all(&mnt).unwrap();
        let mounts = fake_mounts(&t, &mnt);
        let root = t.0.join("root");
        let cli = parse(&[
            "--setup",
            "1G",
            "--mount",
            mnt.to_str().unwrap(),
            "--persist",
            "--root",
            root.to_str().unwrap(),
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let mut c = ctx(&cli);
        // The "kernel" finds only 100 pages.
        c.fake_kernel = Some(Box::new(|s: &Sysfs| {
            let f = s.nr_file(Scope::Global, 2048);
            let asked = read_nr(&f);
            std::fs::write(&f, format!("{}\n", asked.min(100))).unwrap();
        }));
        let (r, out) = run_to_string(&cli, &c);
        let e = format!("{:#}", r.unwrap_err());
        assert!(out.contains("granted: 100 of 512 pages"), "{out}");
        assert!(
            e.contains("asked for 512 pages of 2M (1G), the kernel granted 100 (200M)"),
            "{e}"
        );
        assert!(e.contains("hugepagesz=2M hugepages=512"), "{e}");
        // The persistent configuration was still written (it may well succeed at boot).
        assert!(root.join("etc/sysctl.d/80-rdsd-hugepages.conf").exists());

        // The check itself.
        let g = Grant {
            asked: 4,
            granted: 4,
        };
        g.check(2048, Scope::Global).unwrap();
        let g = Grant {
            asked: 4,
            granted: 1,
        };
        let e = g.check(1 << 20, Scope::Node(1)).unwrap_err().to_string();
        assert!(
            e.contains("asked for 4 pages of 1G on node 1 (4G), the kernel granted 1 (1G)"),
            "{e}"
        );
    }

    #[test]
    fn persist_writes_sysctl_and_mount_unit_under_root() {
        let t = TempDir::new("persist");
        let sys = fake_sysfs(&t);
        let mnt = t.0.join("huge");
        std::fs::create_dir_all(&mnt).unwrap();
        let mounts = fake_mounts(&t, &mnt);
        let root = t.0.join("root");
        let me = std::fs::metadata(&mnt).unwrap();
        let (uid, gid) = (me.uid().to_string(), me.gid().to_string());
        let cli = parse(&[
            "--setup",
            "256M",
            "--mount",
            mnt.to_str().unwrap(),
            "--owner",
            &uid,
            "--group",
            &gid,
            "--mode",
            "0770",
            "--persist",
            "--root",
            root.to_str().unwrap(),
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        // The existing hugetlbfs mount is kept; only its mode is fixed.
        assert!(
            out.contains(&format!("chmod 0770 {}", mnt.display())),
            "{out}"
        );
        assert!(!out.contains("mount -t"), "{out}");
        assert!(!out.contains("chown"), "{out}");
        assert_eq!(std::fs::metadata(&mnt).unwrap().mode() & 0o7777, 0o770);

        let sysctl = root.join("etc/sysctl.d/80-rdsd-hugepages.conf");
        let text = std::fs::read_to_string(&sysctl).unwrap();
        assert!(text.contains("vm.nr_hugepages = 128\n"), "{text}");
        assert!(
            out.contains(&format!("write {}:", sysctl.display())),
            "{out}"
        );

        let unit_name = format!("{}.mount", persist::systemd_escape_path(&mnt));
        let unit = root.join("etc/systemd/system").join(&unit_name);
        let text = std::fs::read_to_string(&unit).unwrap();
        assert!(
            text.contains(&format!("Where={}\n", mnt.display())),
            "{text}"
        );
        assert!(text.contains("Type=hugetlbfs\n"), "{text}");
        assert!(
            text.contains(&format!("Options=uid={uid},gid={gid},mode=0770\n")),
            "{text}"
        );
        assert!(text.contains("WantedBy=sysinit.target"), "{text}");
        assert!(out.contains(&unit_name), "{out}");

        // Running it again changes nothing (same files, no chmod).
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert!(!out.contains("chmod"), "{out}");
        assert!(out.contains("already mounted"), "{out}");

        // 1 GiB pages on a node go to tmpfiles.d (sysctl has no key for them).
        let cli = parse(&[
            "--setup",
            "1G",
            "--pagesize",
            "1G",
            "--node",
            "0",
            "--no-mount",
            "--persist",
            "--root",
            root.to_str().unwrap(),
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let (r, _) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        let text =
            std::fs::read_to_string(root.join("etc/tmpfiles.d/rdsd-hugepages.conf")).unwrap();
        assert!(
            text.contains(
                "w /sys/devices/system/node/node0/hugepages/hugepages-1048576kB/nr_hugepages - - - - 1\n"
            ),
            "{text}"
        );
        assert!(text.contains("hugepagesz=1G hugepages=1"), "{text}");
    }

    #[test]
    fn systemd_unit_names() {
        use persist::systemd_escape_path as e;
        assert_eq!(e(Path::new("/dev/hugepages")), "dev-hugepages");
        assert_eq!(e(Path::new("/dev/hugepages-1G")), "dev-hugepages\\x2d1G");
        assert_eq!(e(Path::new("/mnt/a b/")), "mnt-a\\x20b");
        assert_eq!(e(Path::new("/")), "-");
    }

    #[test]
    fn without_root_changes_are_refused_clearly() {
        let t = TempDir::new("noroot");
        let sys = fake_sysfs(&t);
        let mounts = fake_mounts(&t, Path::new("/x"));
        let cli = parse(&[
            "--setup",
            "32M",
            "--no-mount",
            "--sysfs",
            sys.to_str().unwrap(),
            "--proc-mounts",
            mounts.to_str().unwrap(),
        ]);
        let mut c = ctx(&cli);
        c.privileged = false;
        let e = run_to_string(&cli, &c).0.unwrap_err().to_string();
        assert!(e.contains("must run as root to:"), "{e}");
        assert!(e.contains("echo 16 >"), "{e}");
        // 16M = 8 pages = what is there already: nothing to do, no root needed.
        let cli = parse(&[
            "--setup",
            "16M",
            "--no-mount",
            "--sysfs",
            sys.to_str().unwrap(),
        ]);
        let mut c = ctx(&cli);
        c.privileged = false;
        // (8 pages were reserved by fake_sysfs; the earlier refusal wrote nothing.)
        run_to_string(&cli, &c).0.unwrap();
        let cli = parse(&["--clear", "--sysfs", sys.to_str().unwrap()]);
        let mut c = ctx(&cli);
        c.privileged = false;
        let e = run_to_string(&cli, &c).0.unwrap_err().to_string();
        assert!(e.contains("must run as root"), "{e}");
    }

    /// Real pages: as root, raise the default pool by 4 pages, check --show, restore.
    #[test]
    fn real_reserve_show_restore_as_root() {
        let nr = Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages");
        rdsd_tests::require!(rdsd_tests::root(), rdsd_tests::AS_ROOT);
        rdsd_tests::require!(
            if nr.exists() {
                Ok(())
            } else {
                Err("no 2 MiB huge pages in this kernel")
            },
            "a kernel with CONFIG_HUGETLBFS and 2 MiB pages"
        );
        let prev = read_nr(nr);
        struct Restore<'a>(&'a Path, u64);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                let _ = std::fs::write(self.0, format!("{}\n", self.1));
            }
        }
        let _restore = Restore(nr, prev);
        let want = prev + 4;
        let size = format!("{}M", want * 2);
        let cli = parse(&["--setup", &size, "--pagesize", "2M", "--no-mount"]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        if let Err(e) = &r {
            if e.to_string().contains("the kernel granted") {
                rdsd_tests::require!(
                    Err::<(), _>(format!("the kernel could not find 4 more pages: {e:#}")),
                    "free memory for 4 more 2 MiB pages (echo 3 > /proc/sys/vm/drop_caches)"
                );
            }
        }
        r.unwrap();
        assert!(
            out.contains(&format!("granted: {want} of {want} pages")),
            "{out}"
        );
        assert_eq!(read_nr(nr), want);

        let cli = parse(&["--show"]);
        let (r, out) = run_to_string(&cli, &ctx(&cli));
        r.unwrap();
        assert!(
            out.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() >= 3 && f[0] == "2M" && f[1] == "all" && f[2] == want.to_string()
            }),
            "{out}"
        );
        drop(_restore);
        assert_eq!(read_nr(nr), prev, "the previous count is restored");
    }
}
