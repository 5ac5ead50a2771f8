//! `include/rdsd.h` is what cbindgen makes of the crate today, and librdsd.so carries the
//! versioned soname.

use std::path::Path;
use std::process::Command;

fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

#[test]
fn checked_in_header_is_up_to_date() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::temp_dir().join(format!("rdsd-h-{}.h", std::process::id()));
    let run = Command::new("cbindgen")
        .current_dir(dir)
        .args(["-q", "--config", "cbindgen.toml", "--output"])
        .arg(&out)
        .status();
    match run {
        Ok(s) => assert!(s.success(), "cbindgen failed"),
        Err(e) => {
            let msg = format!(
                "cbindgen not runnable ({e}): cargo install cbindgen --version 0.29.4 --locked (tests/run.sh does)"
            );
            assert!(!in_ci(), "{msg}");
            eprintln!("{msg}; header not checked");
            return;
        }
    }
    let fresh = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let checked_in = std::fs::read_to_string(dir.join("include/rdsd.h")).unwrap();
    assert!(
        fresh == checked_in,
        "shm-api/capi/include/rdsd.h is stale: run `cbindgen --config cbindgen.toml --output \
         include/rdsd.h` in shm-api/capi"
    );
}

#[test]
fn header_compiles_as_c_and_cpp() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    for (cc, lang) in [("cc", "c"), ("c++", "c++")] {
        let st = Command::new(cc)
            .args(["-fsyntax-only", "-Wall", "-Werror", "-x", lang])
            .arg("-I")
            .arg(&dir)
            .arg("-")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(
                    b"#include <rdsd.h>\nint main(void) { return rdsd_is_socket(0); }\n",
                )?;
                c.wait()
            });
        match st {
            Ok(s) => assert!(s.success(), "rdsd.h does not compile as {lang}"),
            Err(e) => {
                assert!(
                    !in_ci(),
                    "{cc} missing ({e}): apt-get install build-essential"
                );
                eprintln!("{cc} missing; not checked");
            }
        }
    }
}
