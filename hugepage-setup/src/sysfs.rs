//! The huge page pools as sysfs shows them, per page size and per NUMA node, and the sizes
//! users type (`1G`, `512M`, `2048kB`).
//!
//! ```text
//! <sysfs>/kernel/mm/hugepages/hugepages-<KiB>kB/{nr,free,resv,surplus}_hugepages
//! <sysfs>/devices/system/node/node<N>/hugepages/hugepages-<KiB>kB/{nr,free,surplus}_hugepages
//! ```
//!
//! The sysfs root is a parameter so that tests can build a fake tree in a temp dir.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Parses a size: a number with an optional binary suffix K, M, G or T (case-insensitive,
/// optionally followed by `B` or `iB`: `1G`, `1GB`, `1GiB`, `2048kB`). No suffix means bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if num.is_empty() {
        bail!("bad size {s:?}: expected a number with an optional K/M/G/T suffix, e.g. 1G");
    }
    let n: u64 = num
        .parse()
        .with_context(|| format!("bad size {s:?}: number too large"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => bail!("bad size {s:?}: unknown suffix {suffix:?} (use K, M, G or T)"),
    };
    n.checked_mul(1u64 << shift)
        .with_context(|| format!("bad size {s:?}: too large"))
}

/// Formats a byte count the way the kernel names page sizes: `2M`, `1G`, `64K`.
pub fn fmt_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "T"), (30, "G"), (20, "M"), (10, "K")];
    for (shift, u) in UNITS {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{u}", bytes >> shift);
        }
    }
    format!("{bytes}")
}

/// The counters of one pool (one page size, globally or on one node).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// nr_hugepages: the persistent pool.
    pub total: u64,
    /// free_hugepages.
    pub free: u64,
    /// resv_hugepages (global pools only; the kernel has no per-node count).
    pub reserved: Option<u64>,
    /// surplus_hugepages.
    pub surplus: u64,
}

/// Which pool a change applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The global count (`/sys/kernel/mm/hugepages`): the kernel spreads pages over nodes.
    Global,
    /// One NUMA node.
    Node(u32),
}

/// A sysfs tree (the real `/sys` or a fake one).
#[derive(Clone, Debug)]
pub struct Sysfs {
    pub root: PathBuf,
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs { root: root.into() }
    }

    fn global_dir(&self) -> PathBuf {
        self.root.join("kernel/mm/hugepages")
    }

    fn node_dir(&self, node: u32) -> PathBuf {
        self.root
            .join(format!("devices/system/node/node{node}/hugepages"))
    }

    /// The directory of one pool.
    pub fn pool_dir(&self, scope: Scope, page_kib: u64) -> PathBuf {
        let base = match scope {
            Scope::Global => self.global_dir(),
            Scope::Node(n) => self.node_dir(n),
        };
        base.join(format!("hugepages-{page_kib}kB"))
    }

    /// The `nr_hugepages` file of one pool (what setup and clear write).
    pub fn nr_file(&self, scope: Scope, page_kib: u64) -> PathBuf {
        self.pool_dir(scope, page_kib).join("nr_hugepages")
    }

    /// Page sizes this kernel supports, in KiB, ascending.
    pub fn page_sizes(&self) -> Result<Vec<u64>> {
        let dir = self.global_dir();
        let rd = std::fs::read_dir(&dir).with_context(|| {
            format!(
                "cannot read {}: this kernel has no hugetlb support",
                dir.display()
            )
        })?;
        let mut sizes: Vec<u64> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix("hugepages-")?
                    .strip_suffix("kB")?
                    .parse()
                    .ok()
            })
            .collect();
        sizes.sort_unstable();
        Ok(sizes)
    }

    /// The default huge page size (the one `vm.nr_hugepages`, `/proc/meminfo` and hugetlbfs
    /// without `pagesize=` use): read from `<proc>/meminfo` when it is the real sysfs, else
    /// the smallest size (2 MiB on x86-64, which is the default there).
    pub fn default_page_kib(&self) -> Result<u64> {
        if self.root == Path::new("/sys") {
            if let Ok(t) = std::fs::read_to_string("/proc/meminfo") {
                if let Some(k) = t
                    .lines()
                    .find_map(|l| l.strip_prefix("Hugepagesize:"))
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                {
                    return Ok(k);
                }
            }
        }
        self.page_sizes()?
            .first()
            .copied()
            .context("no huge page sizes in sysfs")
    }

    /// NUMA nodes with a hugepages directory, ascending (empty without NUMA support).
    pub fn nodes(&self) -> Vec<u32> {
        let Ok(rd) = std::fs::read_dir(self.root.join("devices/system/node")) else {
            return Vec::new();
        };
        let mut nodes: Vec<u32> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_prefix("node")?
                    .parse()
                    .ok()
            })
            .filter(|n| self.node_dir(*n).is_dir())
            .collect();
        nodes.sort_unstable();
        nodes
    }

    fn read_u64(path: &Path) -> Result<u64> {
        let s = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        s.trim()
            .parse()
            .with_context(|| format!("unexpected content {s:?} in {}", path.display()))
    }

    /// The counters of one pool.
    pub fn counts(&self, scope: Scope, page_kib: u64) -> Result<Counts> {
        let d = self.pool_dir(scope, page_kib);
        Ok(Counts {
            total: Self::read_u64(&d.join("nr_hugepages"))?,
            free: Self::read_u64(&d.join("free_hugepages"))?,
            reserved: match scope {
                Scope::Global => Some(Self::read_u64(&d.join("resv_hugepages"))?),
                Scope::Node(_) => None,
            },
            surplus: Self::read_u64(&d.join("surplus_hugepages"))?,
        })
    }

    /// Checks that a page size and node exist, with errors that list what does.
    pub fn validate(&self, scope: Scope, page_kib: u64) -> Result<()> {
        let sizes = self.page_sizes()?;
        if !sizes.contains(&page_kib) {
            let list: Vec<String> = sizes.iter().map(|k| fmt_size(k * 1024)).collect();
            bail!(
                "huge page size {} is not supported by this kernel/CPU (supported: {})",
                fmt_size(page_kib * 1024),
                list.join(", ")
            );
        }
        if let Scope::Node(n) = scope {
            let nodes = self.nodes();
            if !nodes.contains(&n) {
                let list: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
                bail!(
                    "NUMA node {n} does not exist (nodes: {})",
                    if list.is_empty() {
                        "none: no NUMA support".to_string()
                    } else {
                        list.join(", ")
                    }
                );
            }
            if !self.pool_dir(scope, page_kib).is_dir() {
                bail!("node {n} has no {} pool", fmt_size(page_kib * 1024));
            }
        }
        Ok(())
    }
}

/// The result of asking the kernel for a number of pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub asked: u64,
    pub granted: u64,
}

impl Grant {
    /// An error when the kernel granted fewer pages than asked (it may not find enough
    /// free contiguous memory; for 1 GiB pages, often none after boot).
    pub fn check(&self, page_kib: u64, scope: Scope) -> Result<()> {
        if self.granted >= self.asked {
            return Ok(());
        }
        let size = fmt_size(page_kib * 1024);
        let where_ = match scope {
            Scope::Global => String::new(),
            Scope::Node(n) => format!(" on node {n}"),
        };
        bail!(
            "asked for {} pages of {size}{where_} ({}), the kernel granted {} ({}): memory is \
             too small or too fragmented. Reserve them at boot instead (kernel command line: \
             hugepagesz={size} hugepages={}), or retry after `echo 3 > /proc/sys/vm/drop_caches` \
             and `echo 1 > /proc/sys/vm/compact_memory`",
            self.asked,
            fmt_size(self.asked * page_kib * 1024),
            self.granted,
            fmt_size(self.granted * page_kib * 1024),
            self.asked
        )
    }
}
