//! `rdsd-run PROGRAM ARGS...`: runs PROGRAM with librdsd-preload.so preloaded, so that its
//! AF_RDS sockets are served by rdsd.
//!
//! The library is looked for in `$RDSD_PRELOAD`, then next to this binary and in `../lib`
//! (as `librdsd-preload.so` or cargo's `librdsd_preload.so`). A statically linked PROGRAM
//! cannot be preloaded (the dynamic loader never runs): that is refused with exit status 126.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

fn library() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RDSD_PRELOAD") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.to_path_buf(), dir.join("../lib")]
        .iter()
        .flat_map(|d| ["librdsd-preload.so", "librdsd_preload.so"].map(|n| d.join(n)))
        .find(|p| p.exists())
}

fn find_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Some(true) for an ELF executable without a PT_INTERP program header (statically linked),
/// Some(false) for a dynamic one, None for anything else (a script: its interpreter decides).
fn is_static_elf(path: &Path) -> Option<bool> {
    let b = std::fs::read(path).ok()?;
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return None; // not a little-endian ELF64
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[32..40].try_into().ok()?) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    const PT_INTERP: u32 = 3;
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        let ty = u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?);
        if ty == PT_INTERP {
            return Some(false);
        }
    }
    Some(true)
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        eprintln!("usage: rdsd-run PROGRAM [ARGS...]   (AF_RDS sockets served by rdsd)");
        exit(2);
    };
    let Some(lib) = library() else {
        eprintln!(
            "rdsd-run: librdsd-preload.so not found next to rdsd-run or in ../lib; \
             set RDSD_PRELOAD to its path"
        );
        exit(127);
    };
    let name = program.to_string_lossy().into_owned();
    let Some(path) = find_program(&name) else {
        eprintln!("rdsd-run: {name}: command not found");
        exit(127);
    };
    if is_static_elf(&path) == Some(true) {
        eprintln!(
            "rdsd-run: {} is statically linked, so LD_PRELOAD cannot reach its socket calls; \
             build it dynamically (without -static) or use librdsd's C API",
            path.display()
        );
        exit(126);
    }
    let mut preload = OsString::from(lib.canonicalize().unwrap_or(lib));
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let err = Command::new(&path)
        .args(args)
        .env("LD_PRELOAD", preload)
        .exec();
    eprintln!("rdsd-run: {}: {err}", path.display());
    exit(126);
}
