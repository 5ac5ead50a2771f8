//! Shared by the EAL tests. Each EAL test is its own integration-test file, hence its own
//! process: EAL can be initialised only once per process.

use std::ffi::{c_char, CString};

/// EAL arguments as C strings; `argv()` gives the pointer array rte_eal_init wants. Kept
/// alive for the whole process (EAL may keep pointers into argv).
pub struct Args {
    _owned: Vec<CString>,
    ptrs: Vec<*mut c_char>,
}

impl Args {
    pub fn new(args: &[String]) -> Args {
        let owned: Vec<CString> = args
            .iter()
            .map(|a| CString::new(a.as_str()).unwrap())
            .collect();
        let mut ptrs: Vec<*mut c_char> = owned.iter().map(|c| c.as_ptr() as *mut c_char).collect();
        ptrs.push(std::ptr::null_mut());
        Args {
            _owned: owned,
            ptrs,
        }
    }

    pub fn argc(&self) -> i32 {
        (self.ptrs.len() - 1) as i32
    }

    pub fn argv(&mut self) -> *mut *mut c_char {
        self.ptrs.as_mut_ptr()
    }
}

/// A file prefix no other test run uses (EAL keeps its runtime files under it).
pub fn unique_prefix(tag: &str) -> String {
    format!("rdsd-dpdk-sys-{tag}-{}", std::process::id())
}

/// EAL's runtime directory (`/var/run/dpdk/<prefix>` as root), read while EAL is up.
pub fn runtime_dir() -> std::path::PathBuf {
    // SAFETY: EAL is initialised; rte_eal_get_runtime_dir returns a pointer to a static
    // NUL-terminated buffer, copied out at once.
    let p = unsafe { std::ffi::CStr::from_ptr(dpdk_sys::rte_eal_get_runtime_dir()) };
    std::path::PathBuf::from(p.to_string_lossy().into_owned())
}

/// Removes the runtime directory EAL leaves behind after rte_eal_cleanup, so test runs do
/// not accumulate them.
pub fn remove_runtime_dir(dir: &std::path::Path) {
    if dir.to_string_lossy().contains("rdsd-dpdk-sys-") {
        let _ = std::fs::remove_dir_all(dir);
        // And its parent (`/var/run/dpdk`) if that left it empty; fails harmlessly otherwise.
        if let Some(parent) = dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// The EAL arguments every test uses: one lcore, no PCI, no hugepages (`mem_mb` of plain
/// memory), no telemetry, a unique file prefix, quiet logs, then `vdevs` (`--vdev=` values).
pub fn eal_args(prefix: &str, mem_mb: u32, vdevs: &[&str]) -> Args {
    let mut v: Vec<String> = [
        "dpdk-sys-test",
        "-l",
        "0",
        "--no-pci",
        "--no-huge",
        "-m",
        &mem_mb.to_string(),
        "--no-telemetry",
        &format!("--file-prefix={prefix}"),
        "--log-level=lib.eal:error",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(vdevs.iter().map(|d| format!("--vdev={d}")));
    Args::new(&v)
}
