//! Gives librdsd.so its versioned soname (the major version of the C ABI).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librdsd.so.0");
    println!("cargo:rerun-if-changed=build.rs");
}
