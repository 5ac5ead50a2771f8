//! Arbitrary bytes, cut into arbitrary chunks, through the stream deframer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rds_proto::wire::{DeframeError, Deframer};

fuzz_target!(|data: &[u8]| {
    // The first byte picks a small payload limit so that oversize paths are reached too.
    let Some((&limit, rest)) = data.split_first() else {
        return;
    };
    let mut deframer = Deframer::with_max_len(u32::from(limit) * 64);
    let mut input = rest;
    let mut cut = usize::from(limit % 61) + 1;
    while !input.is_empty() {
        let n = cut.min(input.len());
        match deframer.feed(&input[..n], |frame| {
            assert_eq!(frame.payload.len(), frame.header.len as usize);
        }) {
            Ok(()) => {}
            Err(DeframeError::Oversize { .. }) => {
                assert_eq!(deframer.push(b"x").err(), Some(DeframeError::Failed));
                return;
            }
            Err(DeframeError::Failed) => unreachable!(),
        }
        input = &input[n..];
        cut = cut * 7 % 113 + 1;
    }
});
