//! Property tests of the wire codec: repr round trips, deframing under arbitrary chunking,
//! and no panics on arbitrary bytes.

use proptest::prelude::*;
use rds_proto::wire::{
    compute_header_checksum, uncongested_mask, verify_header_checksum, CongMap, DeframeError,
    Deframer, ExtHeader, ExtHeaders, HeaderPacket, HeaderRepr, CONG_MAP_BYTES, HEADER_LEN,
    MAX_MSG_SIZE,
};

fn ext_header() -> impl Strategy<Value = ExtHeader> {
    prop_oneof![
        any::<u32>().prop_map(ExtHeader::Version),
        any::<u32>().prop_map(|rkey| ExtHeader::Rdma { rkey }),
        (any::<u32>(), any::<u32>())
            .prop_map(|(rkey, offset)| ExtHeader::RdmaDest { rkey, offset }),
        (any::<u32>(), any::<u8>())
            .prop_map(|(bytes, direction)| ExtHeader::RdmaBytes { bytes, direction }),
        any::<u16>().prop_map(ExtHeader::NPaths),
        any::<u32>().prop_map(ExtHeader::GenNum),
        any::<u8>().prop_map(ExtHeader::SportIdx),
    ]
}

/// Records that fit, pushed in order; returns the area and the accepted records.
fn ext_headers() -> impl Strategy<Value = (ExtHeaders, Vec<ExtHeader>)> {
    prop::collection::vec(ext_header(), 0..5).prop_map(|records| {
        let mut ext = ExtHeaders::new();
        let mut accepted = Vec::new();
        for r in records {
            if ext.push(r).is_ok() {
                accepted.push(r);
            }
        }
        (ext, accepted)
    })
}

fn header_repr() -> impl Strategy<Value = HeaderRepr> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u16>(),
        any::<u16>(),
        any::<u8>(),
        any::<u8>(),
        ext_headers(),
    )
        .prop_map(
            |(sequence, ack, len, sport, dport, flags, credit, (exthdr, _))| HeaderRepr {
                sequence,
                ack,
                len,
                sport,
                dport,
                flags,
                credit,
                exthdr,
            },
        )
}

fn message() -> impl Strategy<Value = (HeaderRepr, Vec<u8>)> {
    (header_repr(), prop::collection::vec(any::<u8>(), 0..600)).prop_map(|(mut h, payload)| {
        h.len = payload.len() as u32;
        (h, payload)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn header_emit_parse_identity(repr in header_repr()) {
        let bytes = repr.to_bytes();
        prop_assert_eq!(HeaderRepr::parse_bytes(&bytes), Ok(repr));
        let packet = HeaderPacket::new_checked(&bytes[..]).unwrap();
        prop_assert_eq!(packet.padding(), [0; 4]);
        prop_assert_eq!(packet.checksum(), 0);
    }

    #[test]
    fn ext_records_read_back((ext, accepted) in ext_headers()) {
        let read: Vec<ExtHeader> = ext.iter().collect();
        prop_assert_eq!(read, accepted);
        let used: usize = ext.iter().map(|r| r.record_len()).sum();
        prop_assert!(used <= 16);
        prop_assert!(ext.as_bytes()[used..].iter().all(|&b| b == 0), "zero-filled after the records");
    }

    #[test]
    fn ext_reader_never_panics_or_overruns(raw in any::<[u8; 16]>()) {
        let ext = ExtHeaders::from_bytes(raw);
        let used: usize = ext.iter().map(|r| r.record_len()).sum();
        prop_assert!(used <= 16);
        let mut copy = ext;
        let _ = copy.push(ExtHeader::SportIdx(0));
    }

    #[test]
    fn checksum_fill_then_verify(repr in header_repr(), flip in 0usize..HEADER_LEN * 8) {
        let mut bytes = repr.to_bytes();
        let csum = compute_header_checksum(&bytes).unwrap();
        bytes[30..32].copy_from_slice(&csum.to_be_bytes());
        prop_assert!(verify_header_checksum(&bytes));
        bytes[flip / 8] ^= 1 << (flip % 8);
        // A single bit flip is always detected, unless it only turned the checksum into 0
        // (which means "no checksum").
        let stored = u16::from_be_bytes([bytes[30], bytes[31]]);
        prop_assert!(!verify_header_checksum(&bytes) || stored == 0);
    }

    #[test]
    fn deframer_yields_exactly_the_messages(
        messages in prop::collection::vec(message(), 0..12),
        cuts in prop::collection::vec(1usize..200, 1..50),
    ) {
        let mut stream = Vec::new();
        for (h, p) in &messages {
            stream.extend_from_slice(&h.to_bytes());
            stream.extend_from_slice(p);
        }
        let mut d = Deframer::new();
        let mut got = Vec::new();
        let mut rest = &stream[..];
        let mut i = 0;
        while !rest.is_empty() {
            let n = cuts[i % cuts.len()].min(rest.len());
            i += 1;
            d.feed(&rest[..n], |f| got.push((f.header, f.payload.to_vec()))).unwrap();
            rest = &rest[n..];
        }
        prop_assert_eq!(got, messages);
        prop_assert!(d.is_idle());
    }

    #[test]
    fn deframer_never_panics_on_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..4000),
        cut in 1usize..300,
    ) {
        let mut d = Deframer::with_max_len(2000);
        for chunk in bytes.chunks(cut) {
            match d.feed(chunk, |f| assert_eq!(f.payload.len(), f.header.len as usize)) {
                Ok(()) => {}
                Err(DeframeError::Oversize { len }) => { assert!(len > 2000); break; }
                Err(DeframeError::Failed) => unreachable!("first error is Oversize"),
            }
        }
        let _ = HeaderRepr::parse_bytes(&bytes);
    }

    #[test]
    fn cong_map_mask_matches_bitwise_definition(
        old_ports in prop::collection::vec(any::<u16>(), 0..50),
        cleared in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let mut old = CongMap::new();
        for &p in &old_ports { old.set(p); }
        let mut new = old.clone();
        let mut expected = 0u64;
        for idx in cleared {
            if old_ports.is_empty() { break; }
            let p = old_ports[idx.index(old_ports.len())];
            new.clear(p);
        }
        for &p in &old_ports {
            if !new.test(p) { expected |= 1 << (p % 64); }
        }
        prop_assert_eq!(uncongested_mask(old.as_bytes(), new.as_bytes()), expected);
        prop_assert_eq!(old.update(new.as_bytes()), Ok(expected));
        prop_assert_eq!(old.as_bytes().len(), CONG_MAP_BYTES);
    }
}

#[test]
fn oversize_limit_is_one_mebibyte() {
    let at_limit = HeaderRepr {
        len: MAX_MSG_SIZE,
        ..Default::default()
    };
    assert!(Deframer::new().push(&at_limit.to_bytes()).is_ok());
    let over = HeaderRepr {
        len: MAX_MSG_SIZE + 1,
        ..Default::default()
    };
    assert_eq!(
        Deframer::new().push(&over.to_bytes()).err(),
        Some(DeframeError::Oversize {
            len: MAX_MSG_SIZE + 1
        })
    );
}
