//! The test-only fault hooks (`dataplane/src/fault.rs`) exist only in the fault-injection build:
//! the ordinary rdsd binary does not even contain the names of their variables, so no
//! environment can arm them; the build the hook tests use does.

use rdsd_tests::{rdsd_bin, rdsd_fault_bin};

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn only_the_fault_injection_build_knows_the_rdsd_test_variables() {
    let plain = std::fs::read(rdsd_bin()).expect("read rdsd");
    let faulty = std::fs::read(rdsd_fault_bin()).expect("read the fault-injection rdsd");
    for var in ["RDSD_TEST_STALL_POLL_MS", "RDSD_TEST_RDMA_QP_ERROR_EVERY"] {
        assert!(
            !contains(&plain, var.as_bytes()),
            "{var} is in the ordinary rdsd binary"
        );
        assert!(
            contains(&faulty, var.as_bytes()),
            "{var} is missing from the fault-injection build"
        );
    }
}
