//! rte_eal_init rejects bad arguments with -1 and rte_errno = EINVAL, and can then still be
//! initialised properly; a second init fails with EALREADY.

mod common;

use dpdk_sys::*;

const EINVAL: i32 = 22;
const EALREADY: i32 = 114;

#[test]
fn bad_eal_arguments_are_an_error() {
    let prefix = common::unique_prefix("bad");
    // An option EAL does not know.
    let mut bad = common::Args::new(&[
        "dpdk-sys-test".to_string(),
        "--no-pci".to_string(),
        "--no-huge".to_string(),
        format!("--file-prefix={prefix}"),
        "--this-option-does-not-exist".to_string(),
    ]);
    // SAFETY: argv is a NULL-terminated array of valid C strings that outlives the call.
    let ret = unsafe { rte_eal_init(bad.argc(), bad.argv()) };
    assert_eq!(ret, -1, "unknown EAL option must fail");
    // SAFETY: reading the thread-local rte_errno has no preconditions.
    let err = unsafe { rte_errno() };
    assert_eq!(err, EINVAL, "rte_errno = {err} ({})", strerror(err));
    assert_eq!(strerror(err), "Invalid argument");

    // A core list naming a core that does not exist (RTE_MAX_LCORE is 128 in Debian's build).
    let mut bad_core = common::Args::new(&[
        "dpdk-sys-test".to_string(),
        "-l".to_string(),
        "4000".to_string(),
        "--no-pci".to_string(),
        "--no-huge".to_string(),
        format!("--file-prefix={prefix}"),
    ]);
    // SAFETY: as above.
    let ret = unsafe { rte_eal_init(bad_core.argc(), bad_core.argv()) };
    assert_eq!(ret, -1, "a core beyond RTE_MAX_LCORE must fail");
    // SAFETY: as above.
    assert_eq!(unsafe { rte_errno() }, EINVAL);

    // A failed argument parse leaves EAL un-initialised: a good init still works ...
    let mut good = common::eal_args(&prefix, 64, &[]);
    // SAFETY: as above; no EAL is running in this process yet.
    let ret = unsafe { rte_eal_init(good.argc(), good.argv()) };
    assert!(
        ret >= 0,
        "rte_eal_init after bad arguments: {}",
        // SAFETY: as above.
        strerror(unsafe { rte_errno() })
    );
    // ... and a second one is refused with EALREADY.
    // SAFETY: as above.
    let ret = unsafe { rte_eal_init(good.argc(), good.argv()) };
    assert_eq!(ret, -1);
    // SAFETY: as above.
    assert_eq!(unsafe { rte_errno() }, EALREADY);
    let runtime = common::runtime_dir();
    // SAFETY: EAL is initialised in this process and nothing uses it any more.
    assert_eq!(unsafe { rte_eal_cleanup() }, 0);
    common::remove_runtime_dir(&runtime);
}
