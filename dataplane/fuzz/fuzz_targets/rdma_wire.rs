//! The RDS/IB wire pieces the RDMA link reads from a peer: the rdma_cm private data and the
//! fragment headers; and the fields it stamps into a header it sends.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rds_proto::wire::HeaderPacket;
use rdsd::transport::rdma::wire::{
    ack_only, fragments, is_cong_map, stamp, FragHdr, PrivData, FRAG, HDR, PRIV_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Some(p) = PrivData::decode(data) {
        assert!(data.len() >= PRIV_LEN);
        let again = PrivData::decode(&p.encode()).expect("32 bytes");
        // `encode` always writes our minor mask; everything parsed survives.
        assert_eq!(again, p);
        let _ = p.compatible();
    }
    let Some(first) = FragHdr::parse(data) else {
        assert!(data.len() < HDR);
        return;
    };
    let n = fragments(first.len as usize);
    assert!(n >= 1 && (n - 1) * FRAG < (first.len as usize).max(1));
    let _ = is_cong_map(data);
    let _ = first.is_ack_only();
    // Later fragments of the same message follow in the input, HDR bytes apart.
    for next in data[HDR..].chunks_exact(HDR).filter_map(FragHdr::parse) {
        assert!(next.same_message(&next));
        let _ = next.same_message(&first);
    }
    // Stamping any received header yields a valid checksum and exactly the stamped fields.
    let mut hdr = [0u8; HDR];
    hdr.copy_from_slice(&data[..HDR]);
    let ack = first.seq ^ first.ack;
    stamp(&mut hdr, ack, first.credit, first.sport & 1 == 1);
    let h = HeaderPacket::new_unchecked(&hdr[..]);
    assert!(h.verify_checksum());
    let stamped = FragHdr::parse(&hdr).expect("HDR bytes");
    assert_eq!((stamped.ack, stamped.credit), (ack, first.credit));
    assert_eq!(
        (stamped.seq, stamped.len, stamped.sport, stamped.dport),
        (first.seq, first.len, first.sport, first.dport)
    );
    ack_only(&mut hdr, ack, first.credit);
    assert!(FragHdr::parse(&hdr).expect("HDR bytes").is_ack_only());
});
