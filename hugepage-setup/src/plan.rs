//! Every change hugepage-setup makes is an [`Action`]; `apply` prints each one and either
//! performs it or, with `--dry-run`, only says what it would do.

use crate::mount;
use anyhow::{Context, Result};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write a page count into a sysfs/procfs `nr_hugepages` file.
    SetPages {
        file: PathBuf,
        from: u64,
        to: u64,
    },
    Mkdir(PathBuf),
    Mount {
        target: PathBuf,
        options: String,
    },
    Chown {
        path: PathBuf,
        uid: Option<u32>,
        gid: Option<u32>,
    },
    Chmod {
        path: PathBuf,
        mode: u32,
    },
    /// Write a configuration file (`--persist`), creating its directory.
    WriteFile {
        path: PathBuf,
        content: String,
    },
}

impl Action {
    /// One line that says what the action does.
    pub fn describe(&self) -> String {
        match self {
            Action::SetPages { file, from, to } => {
                format!("echo {to} > {}   (was {from})", file.display())
            }
            Action::Mkdir(p) => format!("mkdir -p {}", p.display()),
            Action::Mount { target, options } => {
                if options.is_empty() {
                    format!("mount -t hugetlbfs hugetlbfs {}", target.display())
                } else {
                    format!(
                        "mount -t hugetlbfs -o {options} hugetlbfs {}",
                        target.display()
                    )
                }
            }
            Action::Chown { path, uid, gid } => {
                let u = uid.map(|u| u.to_string()).unwrap_or_default();
                let g = gid.map(|g| format!(":{g}")).unwrap_or_default();
                format!("chown {u}{g} {}", path.display())
            }
            Action::Chmod { path, mode } => format!("chmod {mode:04o} {}", path.display()),
            Action::WriteFile { path, content } => {
                let mut s = format!("write {}:", path.display());
                for l in content.lines() {
                    s.push_str("\n    ");
                    s.push_str(l);
                }
                s
            }
        }
    }

    fn perform(&self) -> Result<()> {
        match self {
            Action::SetPages { file, to, .. } => std::fs::write(file, format!("{to}\n"))
                .with_context(|| {
                    format!(
                        "cannot write {} (a container with a read-only /sys can't reserve huge \
                         pages)",
                        file.display()
                    )
                }),
            Action::Mkdir(p) => {
                std::fs::create_dir_all(p).with_context(|| format!("cannot create {}", p.display()))
            }
            Action::Mount { target, options } => mount::mount_hugetlbfs(target, options),
            Action::Chown { path, uid, gid } => mount::chown(path, *uid, *gid),
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
}

/// Prints and performs (or, when `dry_run`, only prints) each action, in order.
pub fn apply(actions: &[Action], dry_run: bool, out: &mut dyn Write) -> Result<()> {
    for a in actions {
        if dry_run {
            writeln!(out, "would: {}", a.describe())?;
        } else {
            writeln!(out, "{}", a.describe())?;
            a.perform()?;
        }
    }
    Ok(())
}
