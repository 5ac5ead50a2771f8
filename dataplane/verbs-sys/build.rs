//! Generates the libibverbs/librdmacm bindings and compiles the wrappers of the inline verbs.
//!
//! Needs (Debian 12): `clang libclang-dev pkg-config libibverbs-dev librdmacm-dev`.
//! Everything comes from `pkg-config libibverbs librdmacm`.

use std::env;
use std::path::PathBuf;

const DEPS: &str = "clang libclang-dev pkg-config libibverbs-dev librdmacm-dev";

/// Exported functions we call (bindgen declares them).
const FUNCTIONS: &[&str] = &[
    "ibv_get_device_list",
    "ibv_free_device_list",
    "ibv_get_device_name",
    "ibv_alloc_pd",
    "ibv_dealloc_pd",
    "ibv_reg_mr",
    "ibv_dereg_mr",
    "ibv_create_cq",
    "ibv_destroy_cq",
    "ibv_resize_cq",
    "ibv_create_comp_channel",
    "ibv_destroy_comp_channel",
    "ibv_get_cq_event",
    "ibv_ack_cq_events",
    "ibv_wc_status_str",
    "ibv_modify_qp",
    "rdma_create_event_channel",
    "rdma_destroy_event_channel",
    "rdma_create_id",
    "rdma_destroy_id",
    "rdma_bind_addr",
    "rdma_listen",
    "rdma_resolve_addr",
    "rdma_resolve_route",
    "rdma_connect",
    "rdma_accept",
    "rdma_reject",
    "rdma_disconnect",
    "rdma_get_cm_event",
    "rdma_ack_cm_event",
    "rdma_create_qp",
    "rdma_destroy_qp",
    "rdma_event_str",
    "rdma_migrate_id",
    "rdma_get_dst_port",
    "rdma_get_devices",
    "rdma_free_devices",
];

const TYPES: &[&str] = &[
    "ibv_wc",
    "ibv_send_wr",
    "ibv_recv_wr",
    "ibv_sge",
    "ibv_qp_attr",
    "ibv_qp_attr_mask",
    "ibv_qp_init_attr",
    "ibv_wc_status",
    "ibv_wc_opcode",
    "ibv_wr_opcode",
    "ibv_send_flags",
    "ibv_access_flags",
    "rdma_cm_event",
    "rdma_cm_event_type",
    "rdma_conn_param",
    "rdma_port_space",
];

fn fail(msg: String) -> ! {
    eprintln!("\n{msg}\n");
    println!(
        "cargo:warning={}",
        msg.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
    );
    std::process::exit(1);
}

fn main() {
    println!("cargo:rerun-if-changed=src/wrapper.h");
    println!("cargo:rerun-if-changed=src/wrapper.c");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let mut includes = Vec::new();
    for lib in ["libibverbs", "librdmacm"] {
        let l = pkg_config::Config::new().probe(lib).unwrap_or_else(|e| {
            fail(format!(
                "verbs-sys: {lib} not found by pkg-config: install {DEPS}.\npkg-config said: {e}"
            ))
        });
        includes.extend(l.include_paths);
    }
    let mut build = cc::Build::new();
    build.file("src/wrapper.c").include("src").warnings(true);
    for i in &includes {
        build.include(i);
    }
    build.compile("rdsd_verbs_wrapper");

    let mut b = bindgen::Builder::default()
        .header("src/wrapper.h")
        .clang_args(includes.iter().map(|i| format!("-I{}", i.display())))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("rdsd_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .generate_comments(false)
        .layout_tests(true);
    for f in FUNCTIONS {
        b = b.allowlist_function(f);
    }
    for t in TYPES {
        b = b.allowlist_type(t);
    }
    let bindings = b
        .generate()
        .unwrap_or_else(|e| fail(format!("verbs-sys: bindgen failed: {e}\n(needs {DEPS})")));
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings
        .write_to_file(&out)
        .expect("cannot write bindings.rs");
}
