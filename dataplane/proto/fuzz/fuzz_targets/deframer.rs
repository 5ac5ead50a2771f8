//! Arbitrary bytes, cut into arbitrary chunks, through the stream deframer; and the same bytes
//! through a second deframer that receives every payload byte it can in place
//! (`Deframer::payload_room`, as rdsd's kernel-TCP reads do), which must yield the same frames.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rds_proto::wire::{DeframeError, Deframer};

/// (sequence, payload) of each frame, and whether the stream ended in an oversize error.
type Outcome = (Vec<(u64, Vec<u8>)>, bool);

fn chunked(limit: u8, mut input: &[u8]) -> Outcome {
    let mut deframer = Deframer::with_max_len(u32::from(limit) * 64);
    let mut frames = Vec::new();
    let mut cut = usize::from(limit % 61) + 1;
    while !input.is_empty() {
        let n = cut.min(input.len());
        match deframer.feed(&input[..n], |frame| {
            assert_eq!(frame.payload.len(), frame.header.len as usize);
            frames.push((frame.header.sequence, frame.payload.to_vec()));
        }) {
            Ok(()) => {}
            Err(DeframeError::Oversize { .. }) => {
                assert_eq!(deframer.push(b"x").err(), Some(DeframeError::Failed));
                assert!(
                    deframer.payload_room().is_empty(),
                    "no room after a failure"
                );
                return (frames, true);
            }
            Err(DeframeError::Failed) => unreachable!(),
        }
        input = &input[n..];
        cut = cut * 7 % 113 + 1;
    }
    (frames, false)
}

fn in_place(limit: u8, mut input: &[u8]) -> Outcome {
    let mut deframer = Deframer::with_max_len(u32::from(limit) * 64);
    let mut frames = Vec::new();
    let mut cut = usize::from(limit % 53) + 1;
    loop {
        let room = deframer.payload_room();
        let n = if room.is_empty() {
            cut.min(input.len())
        } else {
            // Part of the room, as a receive that returns what has arrived so far.
            let n = room.len().min(input.len()).min(cut);
            room[..n].copy_from_slice(&input[..n]);
            deframer.payload_filled(n);
            input = &input[n..];
            0
        };
        let mut chunk = &input[..n];
        // An empty push hands over a payload the room completed.
        loop {
            match deframer.push(chunk) {
                Ok((used, frame)) => {
                    if let Some(f) = frame {
                        assert_eq!(f.payload.len(), f.header.len as usize);
                        frames.push((f.header.sequence, f.payload.to_vec()));
                    }
                    chunk = &chunk[used..];
                    if chunk.is_empty() {
                        break;
                    }
                }
                Err(DeframeError::Oversize { .. }) => return (frames, true),
                Err(DeframeError::Failed) => unreachable!(),
            }
        }
        input = &input[n..];
        if input.is_empty() {
            // The end of the stream (a payload may still be open: nothing more to fill).
            return (frames, false);
        }
        cut = cut * 5 % 97 + 1;
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks a small payload limit so that oversize paths are reached too.
    let Some((&limit, rest)) = data.split_first() else {
        return;
    };
    assert_eq!(chunked(limit, rest), in_place(limit, rest));
});
