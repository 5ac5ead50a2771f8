//! hugetlbfs mounts: reading `/proc/mounts`, and planning the [`Action`]s that mount one with
//! a page size, owner, group and mode, or fix the owner/mode of an existing one (idempotent).
//! Planning only: `exec` performs the actions.

use crate::plan::Action;
use crate::sysfs::{fmt_size, parse_size};
use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// One line of `/proc/mounts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    pub source: String,
    pub target: PathBuf,
    pub fstype: String,
    pub options: String,
}

/// Undoes the octal escapes the kernel writes into /proc/mounts (`\040` for a space, `\011`
/// tab, `\012` newline, `\134` backslash).
pub fn unescape_mount_field(s: &str) -> String {
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
pub fn parse_mounts(text: &str) -> Vec<MountEntry> {
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
pub enum MountState {
    /// hugetlbfs (with these options).
    Hugetlbfs(String),
    /// Another filesystem: we won't mount over it.
    Other(String),
    /// Nothing.
    Unmounted,
}

/// The state of `at`: the last entry for a path wins (later mounts hide earlier ones).
pub fn mount_state(mounts: &[MountEntry], at: &Path) -> MountState {
    match mounts.iter().rev().find(|m| m.target == at) {
        Some(m) if m.fstype == "hugetlbfs" => MountState::Hugetlbfs(m.options.clone()),
        Some(m) => MountState::Other(m.fstype.clone()),
        None => MountState::Unmounted,
    }
}

/// The `pagesize=` of a hugetlbfs mount's options, in KiB.
pub fn mount_pagesize_kib(options: &str) -> Option<u64> {
    options
        .split(',')
        .find_map(|o| o.strip_prefix("pagesize="))
        .and_then(|s| parse_size(s).ok())
        .map(|b| b / 1024)
}

/// The mount point as /proc/mounts spells it: absolute, symlinks resolved when it exists.
pub fn normalize(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(p))
            .unwrap_or(p.into())
    };
    std::fs::canonicalize(&abs).unwrap_or(abs)
}

/// A user name or number.
pub fn resolve_user(s: &str) -> Result<u32> {
    if let Ok(n) = s.parse() {
        return Ok(n);
    }
    let c = CString::new(s).context("user name contains a NUL byte")?;
    // SAFETY: c is a valid C string; getpwnam returns null or a pointer to a static passwd
    // that stays valid until the next getpw* call, and we only read pw_uid right away (this
    // program is single-threaded).
    let uid = unsafe {
        let pw = libc::getpwnam(c.as_ptr());
        if pw.is_null() {
            None
        } else {
            Some((*pw).pw_uid)
        }
    };
    uid.with_context(|| format!("no such user {s:?}"))
}

/// A group name or number.
pub fn resolve_group(s: &str) -> Result<u32> {
    if let Ok(n) = s.parse() {
        return Ok(n);
    }
    let c = CString::new(s).context("group name contains a NUL byte")?;
    // SAFETY: as in resolve_user, for getgrnam and gr_gid.
    let gid = unsafe {
        let gr = libc::getgrnam(c.as_ptr());
        if gr.is_null() {
            None
        } else {
            Some((*gr).gr_gid)
        }
    };
    gid.with_context(|| format!("no such group {s:?}"))
}

/// An octal mode: `0770`, `770` or `0o770`.
pub fn parse_mode(s: &str) -> Result<u32> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let m = u32::from_str_radix(digits, 8)
        .with_context(|| format!("bad mode {s:?}: expected octal, e.g. 0770"))?;
    if m > 0o7777 {
        bail!("bad mode {s:?}: more than 4 octal digits");
    }
    Ok(m)
}

/// What a hugetlbfs mount should look like.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountSpec {
    pub dir: PathBuf,
    /// `pagesize=`; None: the default huge page size.
    pub page_kib: Option<u64>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

impl MountSpec {
    /// The `-o` options for mount(2) and for a systemd mount unit.
    pub fn options(&self) -> String {
        let mut o = Vec::new();
        if let Some(k) = self.page_kib {
            o.push(format!("pagesize={}", fmt_size(k * 1024)));
        }
        if let Some(u) = self.uid {
            o.push(format!("uid={u}"));
        }
        if let Some(g) = self.gid {
            o.push(format!("gid={g}"));
        }
        if let Some(m) = self.mode {
            o.push(format!("mode={m:04o}"));
        }
        o.join(",")
    }
}

/// The actions that make `spec` true, given the current mounts (`[]` when it already is).
/// An existing hugetlbfs mount with the right page size is kept; a wrong owner or mode on
/// it is fixed with chown/chmod of its root (which is what uid=/gid=/mode= set).
pub fn plan_mount(
    spec: &MountSpec,
    mounts: &[MountEntry],
    default_kib: u64,
) -> Result<Vec<Action>> {
    let at = &spec.dir;
    match mount_state(mounts, at) {
        MountState::Other(t) => bail!(
            "{} already has a {t} filesystem mounted; pick another --mount",
            at.display()
        ),
        MountState::Unmounted => {
            let mut v = Vec::new();
            if !at.is_dir() {
                v.push(Action::Mkdir(at.clone()));
            }
            v.push(Action::Mount {
                target: at.clone(),
                options: spec.options(),
            });
            Ok(v)
        }
        MountState::Hugetlbfs(opts) => {
            let want = spec.page_kib.unwrap_or(default_kib);
            if let Some(have) = mount_pagesize_kib(&opts) {
                if have != want {
                    bail!(
                        "{} is already a hugetlbfs mount of {} pages, not {}: unmount it or pick \
                         another --mount",
                        at.display(),
                        fmt_size(have * 1024),
                        fmt_size(want * 1024)
                    );
                }
            }
            let meta =
                std::fs::metadata(at).with_context(|| format!("cannot stat {}", at.display()))?;
            let mut v = Vec::new();
            let uid_diff = spec.uid.is_some_and(|u| u != meta.uid());
            let gid_diff = spec.gid.is_some_and(|g| g != meta.gid());
            if uid_diff || gid_diff {
                v.push(Action::Chown {
                    path: at.clone(),
                    uid: spec.uid,
                    gid: spec.gid,
                });
            }
            if let Some(m) = spec.mode {
                if meta.mode() & 0o7777 != m {
                    v.push(Action::Chmod {
                        path: at.clone(),
                        mode: m,
                    });
                }
            }
            Ok(v)
        }
    }
}

/// `owner:group mode` of a path, for reports.
pub fn describe_owner(path: &Path) -> String {
    match std::fs::metadata(path) {
        Ok(m) => format!(
            "uid {} gid {} mode {:04o}",
            m.uid(),
            m.gid(),
            m.mode() & 0o7777
        ),
        Err(e) => format!("({e})"),
    }
}
