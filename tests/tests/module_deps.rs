//! Module import direction, checked from the sources: in every crate of the workspace, each
//! top-level module (`src/x.rs` or `src/x/`) names only the modules its row of the table below
//! allows (`crate::x`, `crate::{x, ..}`, `super::x` leaving the module), the table has no cycle,
//! and every row is used; likewise rdsd's transports among themselves. `lib.rs`/`main.rs`/`src/bin/` are the roots that wire the modules
//! together; a name that is not a module (an item of the root) is not counted.
//!
//! A plain scan instead of a tool such as `cargo modules dependencies --acyclic`: that builds
//! rust-analyzer (many minutes on the CI machine) and checks only for cycles, not for the
//! direction written here and in ARCHITECTURE.md ("Module dependencies"), whose rdsd line
//! this test also compares with the table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's modules and what each may name.
type Table = &'static [(&'static str, &'static [&'static str])];

/// rdsd (`dataplane/src`), top to bottom. ARCHITECTURE.md's "Module dependencies" says the same.
const RDSD: Table = &[
    ("control", &["config", "poll", "shm", "stats"]),
    // poll → transport: the fuzzing harness (`poll/fuzzing.rs`) builds a Loopback, and a
    // poll thread delivers its own sockets' messages to its own sockets with
    // `transport::loopback::deliver` (no dynamic call); nothing else.
    (
        "poll",
        &[
            "clock",
            "config",
            "fault",
            "group",
            "quiet",
            "seam",
            "shm",
            "statefile",
            "stats",
            "transport",
        ],
    ),
    (
        "transport",
        &[
            "config", "fault", "prefix", "protocol", "quiet", "seam", "stats",
        ],
    ),
    (
        "protocol",
        &["clock", "prefix", "quiet", "seam", "statefile", "stats"],
    ),
    ("shm", &["config"]),
    ("config", &["prefix"]),
    // Local multicast groups (issue 20): the sans-IO rules, a leaf; `poll/groups.rs` wires them.
    ("group", &[]),
    // Per-thread counts of allocations and locks (the quiet fast path's proof), a leaf.
    ("quiet", &[]),
    ("seam", &[]),
    ("statefile", &[]),
    ("stats", &[]),
    ("fault", &[]),
    ("prefix", &[]),
    ("clock", &[]),
];

/// The other crates: path from the workspace root, table.
const OTHERS: &[(&str, Table)] = &[
    (
        "dataplane/proto/src",
        &[
            ("conn", &["rng", "time", "wire"]),
            ("rng", &[]),
            ("time", &[]),
            ("wire", &[]),
        ],
    ),
    (
        "shm-api/src",
        &[
            ("socket", &["bias_lock", "ctrl", "layout", "ring", "sys"]),
            ("bias_lock", &["sys"]),
            ("layout", &["gate", "ring"]),
            ("gate", &["sync"]),
            ("ring", &["sync"]),
            // A child of `socket` (`#[path]`), in its own file: `Socket::group_*`.
            ("ctrl", &[]),
            ("hoptrace", &[]),
            ("sync", &[]),
            ("sys", &[]),
        ],
    ),
    (
        "shm-api/capi/src",
        &[
            ("ops", &["table"]),
            ("table", &["fork", "slots"]),
            ("slots", &["fork"]),
            ("fork", &[]),
        ],
    ),
    ("shm-api/preload/src", &[("epoll", &[])]),
    (
        "hugepage-setup/src",
        &[
            ("persist", &["mount", "plan", "sysfs"]),
            ("mount", &["plan", "sysfs"]),
            ("exec", &["plan"]),
            ("plan", &[]),
            ("sysfs", &[]),
        ],
    ),
    (
        "cli/src",
        &[("client", &[]), ("ping", &[]), ("render", &[])],
    ),
    (
        "bench/src",
        &[
            ("blocking", &["daemon", "rds", "unix", "util"]),
            ("fanout", &["daemon", "rds", "unix", "util"]),
            ("stress", &["daemon", "unix", "util"]),
            ("rds", &["util"]),
            ("unix", &["util"]),
            ("daemon", &[]),
            ("util", &[]),
        ],
    ),
    (
        "tests/src",
        &[("vmlab", &["netns"]), ("netns", &[]), ("raw", &[])],
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    &s[..s.find(|c: char| !is_ident(c)).unwrap_or(s.len())]
}

/// The first path segment of every item a `crate::{...}` group names (`a::b`, `c` → a, c).
fn group_heads(group: &str) -> Vec<&str> {
    let (mut depth, mut start, mut heads) = (0, true, Vec::new());
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => start = true,
            c if start && is_ident(c) => {
                heads.push(ident(&group[i..]));
                start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The modules of one level a file names, outside comments: `{root}x`, `{root}{x, y::z}`
/// (`root` is `crate::`, or `crate::transport::` for the modules of `transport/`), and `super::`
/// chains that climb out of the file's module of that level.
fn named_modules(text: &str, root: &str, module_path: &[String]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find(root) {
            let before = rest[..i].chars().next_back();
            let after = &rest[i + root.len()..];
            rest = after;
            if before.is_some_and(is_ident) {
                continue; // `foo_crate::`, not our crate
            }
            if let Some(group) = after.strip_prefix('{') {
                out.extend(group_heads(group).into_iter().map(String::from));
            } else {
                out.insert(ident(after).to_string());
            }
        }
        let mut rest = code;
        while let Some(i) = rest.find("super::") {
            if rest[..i].chars().next_back().is_some_and(is_ident) {
                rest = &rest[i + 7..];
                continue;
            }
            let mut climbs = 0;
            let mut tail = &rest[i..];
            while let Some(t) = tail.strip_prefix("super::") {
                climbs += 1;
                tail = t;
            }
            if climbs >= module_path.len() {
                out.insert(ident(tail).to_string());
            }
            rest = tail;
        }
    }
    out
}

/// module → the other modules of `src`'s level it names, and the files that name them.
fn graph(src: &Path, root: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    let mut modules = BTreeSet::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let first = rel.iter().next().unwrap().to_string_lossy();
        let name = first.trim_end_matches(".rs").to_string();
        if !["lib", "main", "bin", "mod"].contains(&name.as_str()) {
            modules.insert(name);
        }
    }
    let mut g: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for m in &modules {
        g.entry(m.clone()).or_default();
    }
    for f in &files {
        let rel = f.strip_prefix(src).unwrap();
        let mut path: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if !modules.contains(&path[0]) {
            continue;
        }
        if path.len() > 1 && path.last().unwrap() == "mod" {
            path.pop();
        }
        let text = std::fs::read_to_string(f).unwrap();
        for named in named_modules(&text, root, &path) {
            if named != path[0] && modules.contains(&named) {
                g.get_mut(&path[0])
                    .unwrap()
                    .entry(named)
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    g
}

/// A cycle in `table`, if it has one (depth-first search).
fn cycle(table: Table) -> Option<Vec<&'static str>> {
    fn visit(
        m: &'static str,
        table: Table,
        stack: &mut Vec<&'static str>,
        done: &mut BTreeSet<&'static str>,
    ) -> Option<Vec<&'static str>> {
        if let Some(i) = stack.iter().position(|s| *s == m) {
            let mut c = stack[i..].to_vec();
            c.push(m);
            return Some(c);
        }
        if !done.insert(m) {
            return None;
        }
        stack.push(m);
        let deps = table.iter().find(|(n, _)| *n == m).map_or(&[][..], |r| r.1);
        for d in deps {
            if let Some(c) = visit(d, table, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    table
        .iter()
        .find_map(|(m, _)| visit(m, table, &mut Vec::new(), &mut done))
}

/// What is wrong with `src` (whose modules are named `{root}x`) against `table`, one line each.
fn check(src: &str, root: &str, table: Table) -> Vec<String> {
    let g = graph(&workspace().join(src), root);
    let mut errors = Vec::new();
    if let Some(c) = cycle(table) {
        errors.push(format!(
            "{src}: the table itself has a cycle: {}",
            c.join(" → ")
        ));
    }
    for (m, named) in &g {
        let Some((_, allowed)) = table.iter().find(|(n, _)| n == m) else {
            errors.push(format!(
                "{src}: module `{m}` has no row in the table: place it"
            ));
            continue;
        };
        for (dep, files) in named {
            if !allowed.contains(&dep.as_str()) {
                let files: Vec<_> = files.iter().map(String::as_str).collect();
                errors.push(format!(
                    "{src}: `{m}` names `{dep}` (in {}), which its row does not allow",
                    files.join(", ")
                ));
            }
        }
        for dep in *allowed {
            if !named.contains_key(*dep) {
                errors.push(format!(
                    "{src}: `{m}` → `{dep}` is in the table but no longer in the code: remove it \
                     (and from ARCHITECTURE.md for rdsd)"
                ));
            }
        }
    }
    for (m, _) in table {
        if !g.contains_key(*m) {
            errors.push(format!(
                "{src}: the table names `{m}`, which is not a module"
            ));
        }
    }
    errors
}

#[test]
fn rdsd_modules_import_in_one_direction() {
    let errors = check("dataplane/src", "crate::", RDSD);
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

/// A transport is a folder of its own: transports name each other only where one is built on
/// another (DPDK on the userspace TCP) or on a shared helper (`handoff`).
#[test]
fn transports_do_not_name_each_other() {
    const TRANSPORTS: Table = &[
        ("dpdk", &["utcp"]),
        ("rdma", &["handoff"]),
        ("tcp", &["handoff"]),
        ("utcp", &[]),
        ("loopback", &[]),
        ("handoff", &[]),
    ];
    let errors = check("dataplane/src/transport", "crate::transport::", TRANSPORTS);
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

#[test]
fn every_crates_modules_import_in_one_direction() {
    let errors: Vec<String> = OTHERS
        .iter()
        .flat_map(|(src, table)| check(src, "crate::", table))
        .collect();
    assert!(errors.is_empty(), "\n{}", errors.join("\n"));
}

/// ARCHITECTURE.md's "Module dependencies" spans (`a → b, c`) are exactly the rdsd table's
/// rows that name something.
#[test]
fn architecture_md_states_the_rdsd_table() {
    let text = std::fs::read_to_string(workspace().join("ARCHITECTURE.md")).unwrap();
    let para = text
        .split("\n\n")
        .find(|p| p.starts_with("Module dependencies"))
        .expect("a paragraph starting with \"Module dependencies\" in ARCHITECTURE.md");
    let mut stated = BTreeMap::new();
    for span in para.split('`').skip(1).step_by(2) {
        if let Some((m, deps)) = span.split_once(" → ") {
            let deps: BTreeSet<&str> = deps.split(',').map(str::trim).collect();
            stated.insert(m.trim(), deps);
        }
    }
    let table: BTreeMap<&str, BTreeSet<&str>> = RDSD
        .iter()
        .filter(|(_, d)| !d.is_empty())
        .map(|(m, d)| (*m, d.iter().copied().collect()))
        .collect();
    assert_eq!(stated, table, "ARCHITECTURE.md: {para}");
}

#[test]
fn the_scan_sees_every_spelling() {
    let path = vec!["transport".to_string(), "dpdk".to_string()];
    let text = "use crate::config::Config;\n\
                use crate::{seam::{A, B}, stats};\n\
                let x = crate::fault::f(); // crate::poll in a comment\n\
                use super::super::protocol::Link;\n\
                use super::utcp;\n\
                let y = my_crate::shm::X;";
    let got: Vec<String> = named_modules(text, "crate::", &path).into_iter().collect();
    assert_eq!(
        got,
        ["config", "fault", "protocol", "seam", "stats"],
        "super::utcp stays inside transport; my_crate:: is another crate"
    );
}

/// Inside the poll thread: the socket table uses the zero-copy holds, never the other way
/// round (their shared name, `SockRef`, lives in the leaf `poll/sock_ref.rs`).
#[test]
fn the_holds_do_not_import_the_socket_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dataplane/src/poll");
    for (file, forbidden) in [
        ("inplace.rs", "table"),
        ("sock_ref.rs", "table"),
        ("sock_ref.rs", "inplace"),
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for line in text.lines().filter(|l| l.trim_start().starts_with("use ")) {
            assert!(
                !line.contains(&format!("super::{forbidden}")),
                "poll/{file} imports poll/{forbidden}: {line}"
            );
        }
    }
}
