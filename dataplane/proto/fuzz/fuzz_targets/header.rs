//! HeaderRepr::parse and the extension-header reader on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rds_proto::wire::{verify_header_checksum, ExtHeader, HeaderPacket, HeaderRepr};

fuzz_target!(|data: &[u8]| {
    let _ = verify_header_checksum(data);
    let Ok(packet) = HeaderPacket::new_checked(data) else {
        return;
    };
    let repr = HeaderRepr::parse(&packet).expect("checked length");
    let mut records = repr.exthdr.iter();
    let used: usize = records.by_ref().map(|r| r.record_len()).sum();
    assert!(used <= 16);
    let _ = records.stopped_on_invalid();
    // Emit then parse again: identical apart from padding and checksum.
    let again = HeaderRepr::parse_bytes(&repr.to_bytes()).expect("48 bytes");
    assert_eq!(again, repr);
    let mut ext = repr.exthdr;
    let _ = ext.push(ExtHeader::SportIdx(0));
});
