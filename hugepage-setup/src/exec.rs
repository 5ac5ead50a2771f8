//! The executor of a plan: prints each [`Action`] and performs it (mount(2), chown(2),
//! chmod, file writes) or, with `--dry-run`, only says what it would do. It reads the plan and
//! nothing else of the crate; the planners never perform anything.

use crate::plan::Action;
use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Prints and performs (or, when `dry_run`, only prints) each action, in order.
pub fn apply(actions: &[Action], dry_run: bool, out: &mut dyn Write) -> Result<()> {
    for a in actions {
        if dry_run {
            writeln!(out, "would: {}", a.describe())?;
        } else {
            writeln!(out, "{}", a.describe())?;
            perform(a)?;
        }
    }
    Ok(())
}

fn perform(action: &Action) -> Result<()> {
    match action {
        Action::SetPages { file, to, .. } => {
            std::fs::write(file, format!("{to}\n")).with_context(|| {
                format!(
                    "cannot write {} (a container with a read-only /sys can't reserve huge \
                     pages)",
                    file.display()
                )
            })
        }
        Action::Mkdir(p) => {
            std::fs::create_dir_all(p).with_context(|| format!("cannot create {}", p.display()))
        }
        Action::Mount { target, options } => mount_hugetlbfs(target, options),
        Action::Chown { path, uid, gid } => chown(path, *uid, *gid),
        Action::Chmod { path, mode } => {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(*mode))
                .with_context(|| format!("cannot chmod {}", path.display()))
        }
        Action::WriteFile { path, content } => {
            if let Some(d) = path.parent() {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("cannot create {}", d.display()))?;
            }
            std::fs::write(path, content)
                .with_context(|| format!("cannot write {}", path.display()))
        }
    }
}

/// mount -t hugetlbfs -o OPTIONS hugetlbfs TARGET
fn mount_hugetlbfs(at: &Path, options: &str) -> Result<()> {
    let target =
        CString::new(at.as_os_str().as_bytes()).context("mount point contains a NUL byte")?;
    let fstype = CString::new("hugetlbfs").expect("no NUL");
    let data = CString::new(options).context("mount options contain a NUL byte")?;
    // SAFETY: all four pointers are valid NUL-terminated strings that outlive the call; an
    // empty `data` means default options (the default huge page size, root-owned, 0755).
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        bail!(
            "mount -t hugetlbfs -o '{options}' hugetlbfs {} failed: {e}",
            at.display()
        );
    }
    Ok(())
}

/// chown(2) with "leave unchanged" for None.
fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> Result<()> {
    std::os::unix::fs::chown(path, uid, gid)
        .with_context(|| format!("cannot chown {}", path.display()))
}
