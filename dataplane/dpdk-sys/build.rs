//! Generates the DPDK bindings and compiles the C wrappers of DPDK's inline functions.
//!
//! Needs (Debian 12): `clang libclang-dev pkg-config libdpdk-dev` (see README.md and
//! `install-deps.sh`). Everything comes from `pkg-config libdpdk`: the include flags for
//! bindgen and for the wrapper (the raw `--cflags`, which carry `-include rte_config.h`), and
//! the link flags.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// The apt packages the build needs, for error messages.
const DEPS: &str = "clang libclang-dev pkg-config libdpdk-dev";
/// The DPDK release these bindings are written and tested against (Debian 12's).
const MIN_DPDK: &str = "22.11";

/// Functions that are real exported symbols of librte_*.so; bindgen declares them.
const FUNCTIONS: &[&str] = &[
    // EAL
    "rte_eal_init",
    "rte_eal_cleanup",
    "rte_eal_process_type",
    "rte_eal_get_runtime_dir",
    "rte_socket_id",
    "rte_lcore_count",
    "rte_get_main_lcore",
    "rte_thread_register",
    "rte_thread_unregister",
    "rte_strerror",
    // ethdev control path
    "rte_eth_dev_count_avail",
    "rte_eth_dev_is_valid_port",
    "rte_eth_dev_get_port_by_name",
    "rte_eth_dev_get_name_by_port",
    "rte_eth_find_next_owned_by",
    "rte_eth_dev_socket_id",
    "rte_eth_dev_configure",
    "rte_eth_dev_adjust_nb_rx_tx_desc",
    "rte_eth_rx_queue_setup",
    "rte_eth_tx_queue_setup",
    "rte_eth_dev_start",
    "rte_eth_dev_stop",
    "rte_eth_dev_close",
    "rte_eth_dev_info_get",
    "rte_eth_macaddr_get",
    "rte_eth_link_get",
    "rte_eth_link_get_nowait",
    "rte_eth_promiscuous_enable",
    "rte_eth_dev_set_mtu",
    "rte_eth_dev_get_mtu",
    "rte_eth_stats_get",
    // mempool / mbuf pool
    "rte_pktmbuf_pool_create",
    "rte_mempool_free",
    "rte_mempool_avail_count",
    "rte_mempool_in_use_count",
];

/// Types used by those functions' signatures come along automatically; these are named
/// explicitly because callers build or read them.
const TYPES: &[&str] = &[
    "rte_mbuf",
    "rte_mempool",
    "rte_eth_conf",
    "rte_eth_rxconf",
    "rte_eth_txconf",
    "rte_eth_dev_info",
    "rte_eth_link",
    "rte_eth_stats",
    "rte_ether_addr",
    "rte_proc_type_t",
    "rte_eth_rx_mq_mode",
    "rte_eth_tx_mq_mode",
];

/// `#define` constants a transport needs (bindgen evaluates the simple arithmetic ones).
const VARS: &[&str] = &[
    "RTE_MAX_ETHPORTS",
    "RTE_MAX_LCORE",
    "RTE_PKTMBUF_HEADROOM",
    "RTE_MBUF_DEFAULT_DATAROOM",
    "RTE_MBUF_DEFAULT_BUF_SIZE",
    "RTE_MEMPOOL_CACHE_MAX_SIZE",
    "RTE_ETHER_ADDR_LEN",
    "RTE_ETHER_MTU",
    "RTE_ETHER_MAX_LEN",
    "RTE_ETH_LINK_UP",
    "RTE_ETH_LINK_DOWN",
    "RTE_ETH_LINK_FULL_DUPLEX",
    "RTE_ETH_SPEED_NUM_.*",
    "RTE_ETH_DEV_NO_OWNER",
    "SOCKET_ID_ANY",
    "LCORE_ID_ANY",
    "RTE_MIN_ERRNO",
    "RTE_MAX_ERRNO",
    "E_RTE_SECONDARY",
    "E_RTE_NO_CONFIG",
];

/// Stops the build with a message (no panic backtrace: the message is the point).
fn fail(msg: String) -> ! {
    eprintln!("\n{msg}\n");
    println!(
        "cargo:warning={}",
        msg.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
    );
    std::process::exit(1);
}

fn pkg_config(arg: &str) -> String {
    let out = Command::new("pkg-config")
        .args([arg, "libdpdk"])
        .output()
        .unwrap_or_else(|e| {
            fail(format!(
                "dpdk-sys: cannot run pkg-config ({e}).\n\
                 Install the Debian packages: apt-get install {DEPS}\n\
                 (or run dataplane/dpdk-sys/install-deps.sh)"
            ))
        });
    if !out.status.success() {
        fail(format!(
            "dpdk-sys: `pkg-config {arg} libdpdk` failed: {}\n\
             DPDK's development files are missing: install the Debian package libdpdk-dev\n\
             (apt-get install {DEPS}, or run dataplane/dpdk-sys/install-deps.sh).\n\
             For a DPDK installed elsewhere, point PKG_CONFIG_PATH at its libdpdk.pc.",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    String::from_utf8(out.stdout).expect("pkg-config output is not UTF-8")
}

fn main() {
    println!("cargo:rerun-if-changed=src/wrapper.h");
    println!("cargo:rerun-if-changed=src/wrapper.c");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    // Link flags (and the version check) through the pkg-config crate; it emits the
    // rustc-link-lib/-search lines. Its error text already names the .pc file; add the package.
    let lib = pkg_config::Config::new()
        .atleast_version(MIN_DPDK)
        .probe("libdpdk")
        .unwrap_or_else(|e| {
            fail(format!(
                "dpdk-sys: libdpdk >= {MIN_DPDK} not found by pkg-config.\n\
                 Install the Debian package libdpdk-dev (apt-get install {DEPS},\n\
                 or run dataplane/dpdk-sys/install-deps.sh).\n\
                 pkg-config said: {e}"
            ))
        });
    println!("cargo:version={}", lib.version);

    // The raw compile flags, as DPDK's own build expects them: include paths, and
    // `-include rte_config.h` (the headers rely on the RTE_* macros it defines).
    //
    // `-march=...` is dropped. Debian's libdpdk.pc says `-march=corei7`; a locally built DPDK
    // says `-march=native` unless configured otherwise. `-march` picks the instructions *and*
    // the tuning for the build machine's CPU, and the wrapper object is linked into our
    // binary, which must run wherever the Rust code (built for the Rust target's baseline)
    // runs, not only on the build host. For bindgen the flag only changes which __SSE*/__AVX*
    // macros are predefined, not any struct layout.
    //
    // What DPDK's headers do need on x86-64 is its ISA floor: rte_memcpy.h (pulled in by
    // rte_mbuf.h/rte_mempool.h) uses SSSE3 intrinsics, which GCC rejects without the ISA
    // option even when the function is never called. So on x86-64 we pass `-msse4.2`, DPDK's
    // documented x86 minimum (the same ISA as corei7, without the tuning). This adds no run
    // time requirement: Debian's librte_eal is itself built for corei7 and refuses to start
    // (rte_eal_init checks the CPU flags) on a CPU without SSE4.2.
    //
    // pkg-config's output has no quoted arguments with spaces, so splitting on whitespace is
    // exact.
    let cflags_raw = pkg_config("--cflags");
    let mut cflags: Vec<String> = Vec::new();
    for f in cflags_raw.split_whitespace() {
        if f.starts_with("-march=") || f.starts_with("-mtune=") || f.starts_with("-mcpu=") {
            continue;
        }
        cflags.push(f.to_string());
    }
    let target_arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if target_arch == "x86_64" {
        cflags.push("-msse4.2".to_string());
    }

    // The wrappers of the inline functions (see src/wrapper.c for why each exists).
    let mut build = cc::Build::new();
    build.file("src/wrapper.c").include("src").warnings(true);
    for f in &cflags {
        build.flag(f);
    }
    build.compile("rdsd_dpdk_wrapper");

    let mut b = bindgen::Builder::default()
        .header("src/wrapper.h")
        .clang_args(&cflags)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("rdsd_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        // DPDK's doc comments contain C snippets that rustdoc would try to run as doctests.
        .generate_comments(false)
        .layout_tests(true);
    for f in FUNCTIONS {
        b = b.allowlist_function(f);
    }
    for t in TYPES {
        b = b.allowlist_type(t);
    }
    for v in VARS {
        b = b.allowlist_var(v);
    }
    let bindings = b.generate().unwrap_or_else(|e| {
        fail(format!(
            "dpdk-sys: bindgen failed: {e}\n\
             bindgen needs libclang: apt-get install {DEPS}"
        ))
    });
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings
        .write_to_file(&out)
        .expect("cannot write bindings.rs");
}
