//! Every change hugepage-setup makes is an [`Action`]: plain data, which the planners
//! (`mount::plan_mount`, `persist`, `main`) make and `exec::apply` performs. This module names
//! nothing else of the crate.

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
}
