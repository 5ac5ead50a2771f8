//! `--persist`: the configuration that makes the reservation and the mount survive a reboot.
//!
//! - The default page size, all nodes: `etc/sysctl.d/80-rdsd-hugepages.conf`
//!   (`vm.nr_hugepages = N`), applied by systemd-sysctl early at boot.
//! - Another page size or one NUMA node (sysctl has no key for those):
//!   `etc/tmpfiles.d/rdsd-hugepages.conf` with a `w` line that writes the sysfs file at boot.
//!   1 GiB pages are best reserved on the kernel command line (memory fragments after boot);
//!   the file says so.
//! - The mount: `etc/systemd/system/<escaped path>.mount` (for /dev/hugepages this overrides
//!   systemd's own dev-hugepages.mount, adding the owner, group and mode).
//!
//! Everything is written under `--root` (default `/`), so tests can use a temp dir.

use crate::mount::MountSpec;
use crate::plan::Action;
use crate::sysfs::{fmt_size, Scope};
use std::path::Path;

/// systemd's path escaping (`systemd-escape --path`): `/dev/hugepages` -> `dev-hugepages`,
/// `/mnt/huge-1G` -> `mnt-huge\x2d1G`.
pub fn systemd_escape_path(p: &Path) -> String {
    let s = p.to_string_lossy();
    let trimmed = s.trim_matches('/');
    if trimmed.is_empty() {
        return "-".to_string();
    }
    let mut out = String::new();
    for (i, b) in trimmed.bytes().enumerate() {
        match b {
            b'/' => out.push('-'),
            b'.' if i == 0 => out.push_str("\\x2e"),
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' | b'.' => out.push(b as char),
            _ => out.push_str(&format!("\\x{b:02x}")),
        }
    }
    out
}

/// The files `--persist` writes for a reservation of `pages` pages of `page_kib` KiB in
/// `scope`, and the mount (if any), under `root`. `default_kib` is the default page size.
pub fn plan_persist(
    root: &Path,
    sysfs_for_boot: &Path,
    pages: u64,
    page_kib: u64,
    default_kib: u64,
    scope: Scope,
    mount: Option<&MountSpec>,
) -> Vec<Action> {
    let mut v = Vec::new();
    let size = fmt_size(page_kib * 1024);
    if scope == Scope::Global && page_kib == default_kib {
        v.push(Action::WriteFile {
            path: root.join("etc/sysctl.d/80-rdsd-hugepages.conf"),
            content: format!(
                "# Written by hugepage-setup --persist: {pages} huge pages of {size} for rdsd.\n\
                 vm.nr_hugepages = {pages}\n"
            ),
        });
    } else {
        let rel = match scope {
            Scope::Global => format!("kernel/mm/hugepages/hugepages-{page_kib}kB/nr_hugepages"),
            Scope::Node(n) => {
                format!("devices/system/node/node{n}/hugepages/hugepages-{page_kib}kB/nr_hugepages")
            }
        };
        let file = sysfs_for_boot.join(rel);
        let mut content = format!(
            "# Written by hugepage-setup --persist: {pages} huge pages of {size} for rdsd.\n"
        );
        if page_kib >= 1 << 20 {
            content.push_str(&format!(
                "# Pages of {size} may not be available once memory fragments; the reliable way\n\
                 # is the kernel command line: default_hugepagesz={size} hugepagesz={size} hugepages={pages}\n"
            ));
        }
        content.push_str(&format!("w {} - - - - {pages}\n", file.display()));
        v.push(Action::WriteFile {
            path: root.join("etc/tmpfiles.d/rdsd-hugepages.conf"),
            content,
        });
    }
    if let Some(m) = mount {
        let unit = format!("{}.mount", systemd_escape_path(&m.dir));
        let opts = m.options();
        let mut content = String::from(
            "# Written by hugepage-setup --persist: hugetlbfs for rdsd.\n\
             [Unit]\n\
             Description=Huge pages file system for rdsd\n\
             DefaultDependencies=no\n\
             Before=sysinit.target\n\
             ConditionPathExists=/sys/kernel/mm/hugepages\n\
             ConditionCapability=CAP_SYS_ADMIN\n\
             \n\
             [Mount]\n\
             What=hugetlbfs\n",
        );
        content.push_str(&format!("Where={}\n", m.dir.display()));
        content.push_str("Type=hugetlbfs\n");
        if !opts.is_empty() {
            content.push_str(&format!("Options={opts}\n"));
        }
        content.push_str("\n[Install]\nWantedBy=sysinit.target\n");
        v.push(Action::WriteFile {
            path: root.join("etc/systemd/system").join(unit),
            content,
        });
    }
    v
}
