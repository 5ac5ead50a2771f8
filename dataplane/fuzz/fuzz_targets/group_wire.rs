//! The group protocol between rdsd hosts (`rdsd::group::wire`): any bytes a peer host sends to
//! the group port either parse into a message that emits back to the same bytes (up to the
//! payload) or are refused with a reason; parsing never panics. Each input is tried as it is
//! and behind a valid magic and version, so the fuzzer spends its time on the kinds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdsd::group::wire::GroupMsg;

fn check(data: &[u8]) {
    let Ok(m) = GroupMsg::parse(data) else {
        return;
    };
    let again = m.emit();
    assert_eq!(GroupMsg::parse(&again), Ok(m));
    // Everything the message holds came from `data`: the emitted bytes are a prefix of it
    // (kinds without a payload ignore trailing bytes).
    assert_eq!(&data[..again.len()], &again[..]);
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut framed = b"RG\x01".to_vec();
    framed.extend_from_slice(data);
    check(&framed);
});
