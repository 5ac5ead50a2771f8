//! Stream deframer: splits a TCP byte stream into `[48-byte header][h_len payload]` messages
//! (spec §6.3).
//!
//! Steady state does not allocate: a message that lies entirely inside the input slice is
//! returned by reference into that slice; one that straddles input slices is assembled in an
//! internal buffer whose capacity is reused (and bounded by the size limit). A reader may also
//! receive the rest of a long payload straight into that buffer ([`Deframer::payload_room`]),
//! saving a copy through its own.

use super::header::{HeaderRepr, HEADER_LEN};
use super::MAX_MSG_SIZE;
use core::fmt;

/// A complete message: the parsed header and its payload (`payload.len() == header.len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The parsed header.
    pub header: HeaderRepr,
    /// The payload.
    pub payload: &'a [u8],
}

/// A complete message located by [`Deframer::advance`]; see [`Deframer::payload`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef {
    /// The parsed header.
    pub header: HeaderRepr,
    source: PayloadSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PayloadSource {
    /// `input[start..end]` of the call that completed the frame.
    Input(usize, usize),
    /// The deframer's internal buffer.
    Buffer,
}

/// Why the deframer refused the stream. After an error the deframer stays failed until
/// [`Deframer::reset`]: the stream position is lost, so the connection must be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeframeError {
    /// `h_len` is above the limit (1 MiB by default).
    Oversize {
        /// The announced length.
        len: u32,
    },
    /// An earlier call failed; the stream is unusable.
    Failed,
}

impl fmt::Display for DeframeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeframeError::Oversize { len } => write!(f, "message length {len} exceeds the limit"),
            DeframeError::Failed => write!(f, "stream already failed"),
        }
    }
}

impl std::error::Error for DeframeError {}

/// Two-phase stream deframer (header, then payload).
#[derive(Debug, Clone)]
pub struct Deframer {
    header: [u8; HEADER_LEN],
    header_filled: usize,
    /// Parsed header while in the payload phase.
    current: Option<HeaderRepr>,
    /// The payload being assembled: its first `fill` bytes. Its length only grows (to the
    /// largest payload assembled so far), so that `payload_room` hands out initialised bytes
    /// without zeroing them for every message.
    payload: Vec<u8>,
    fill: usize,
    max_len: u32,
    failed: bool,
}

impl Default for Deframer {
    fn default() -> Self {
        Self::new()
    }
}

impl Deframer {
    /// A deframer with the standard 1 MiB payload limit.
    pub fn new() -> Self {
        Self::with_max_len(MAX_MSG_SIZE)
    }

    /// A deframer with a custom payload limit.
    pub fn with_max_len(max_len: u32) -> Self {
        Deframer {
            header: [0; HEADER_LEN],
            header_filled: 0,
            current: None,
            payload: Vec::new(),
            fill: 0,
            max_len,
            failed: false,
        }
    }

    /// Forgets any partial message and clears the failed state (a new connection).
    /// Keeps the buffer's capacity.
    pub fn reset(&mut self) {
        self.header_filled = 0;
        self.current = None;
        self.fill = 0;
        self.failed = false;
    }

    /// True when no partial message is buffered.
    pub fn is_idle(&self) -> bool {
        self.header_filled == 0 && self.current.is_none()
    }

    /// What the frame in progress still needs: (header bytes, payload bytes); (0, 0) between
    /// frames. rds-info's `hdr_rem` and `data_rem` of a TCP socket.
    pub fn remaining(&self) -> (usize, usize) {
        match &self.current {
            Some(h) => (0, (h.len as usize).saturating_sub(self.fill)),
            None if self.header_filled > 0 => (HEADER_LEN - self.header_filled, 0),
            None => (0, 0),
        }
    }

    /// True after an error, until [`Deframer::reset`].
    pub fn has_failed(&self) -> bool {
        self.failed
    }

    fn check_len(&mut self, header: &HeaderRepr) -> Result<usize, DeframeError> {
        if header.len > self.max_len {
            self.failed = true;
            return Err(DeframeError::Oversize { len: header.len });
        }
        // Fits in usize: bounded by max_len (u32).
        Ok(header.len as usize)
    }

    /// Consumes bytes from `input` until one message completes or the input runs out.
    ///
    /// Returns how many bytes were consumed and the completed message, if any. Call again with
    /// the rest of the input (`&input[consumed..]`) to get further messages. A returned frame
    /// borrows either `input` or the deframer's buffer.
    pub fn push<'a>(
        &'a mut self,
        input: &'a [u8],
    ) -> Result<(usize, Option<Frame<'a>>), DeframeError> {
        let (used, frame) = self.advance(input)?;
        Ok((
            used,
            frame.map(|f| Frame {
                header: f.header,
                payload: self.payload(&f, input),
            }),
        ))
    }

    /// Like [`Deframer::push`], but returns a borrow-free [`FrameRef`]; fetch the payload with
    /// [`Deframer::payload`], passing the same `input`. This lets a caller act on the header
    /// while mutating other state before it borrows the payload.
    pub fn advance(&mut self, input: &[u8]) -> Result<(usize, Option<FrameRef>), DeframeError> {
        if self.failed {
            return Err(DeframeError::Failed);
        }
        let mut used = 0;

        if self.current.is_none() {
            if self.header_filled == 0 && input.len() >= HEADER_LEN {
                // Fast path: a header at the start of the input, nothing buffered.
                let header = HeaderRepr::parse_bytes(input).map_err(|_| DeframeError::Failed)?;
                let len = self.check_len(&header)?;
                if input.len() - HEADER_LEN >= len {
                    let end = HEADER_LEN + len;
                    let frame = FrameRef {
                        header,
                        source: PayloadSource::Input(HEADER_LEN, end),
                    };
                    return Ok((end, Some(frame)));
                }
                used = HEADER_LEN;
                self.begin_payload(header, len);
            } else {
                let take = (HEADER_LEN - self.header_filled).min(input.len());
                self.header[self.header_filled..self.header_filled + take]
                    .copy_from_slice(&input[..take]);
                self.header_filled += take;
                used = take;
                if self.header_filled < HEADER_LEN {
                    return Ok((used, None));
                }
                let header =
                    HeaderRepr::parse_bytes(&self.header).map_err(|_| DeframeError::Failed)?;
                let len = self.check_len(&header)?;
                self.begin_payload(header, len);
            }
        }

        let Some(header) = self.current else {
            return Ok((used, None));
        };
        let want = header.len as usize - self.fill;
        let take = want.min(input.len() - used);
        self.payload[self.fill..self.fill + take].copy_from_slice(&input[used..used + take]);
        self.fill += take;
        used += take;
        if self.fill < header.len as usize {
            return Ok((used, None));
        }
        // Complete: back to the header phase; the buffer stays valid until the next call.
        self.current = None;
        self.header_filled = 0;
        Ok((
            used,
            Some(FrameRef {
                header,
                source: PayloadSource::Buffer,
            }),
        ))
    }

    /// The payload of a frame returned by the latest [`Deframer::advance`] call, which must
    /// have been given the same `input`. Never panics: a mismatched input yields a short or
    /// empty slice.
    pub fn payload<'a>(&'a self, frame: &FrameRef, input: &'a [u8]) -> &'a [u8] {
        match frame.source {
            PayloadSource::Input(start, end) => input.get(start..end).unwrap_or(&[]),
            PayloadSource::Buffer => &self.payload[..self.fill],
        }
    }

    /// In the payload phase, the bytes of the current payload still to come, to be written in
    /// place (a receive syscall straight into them); report what was written with
    /// [`Deframer::payload_filled`], then call [`Deframer::advance`] (with no input, if
    /// nothing follows) for the frame once it is complete. Empty outside the payload phase.
    pub fn payload_room(&mut self) -> &mut [u8] {
        match self.current {
            Some(h) if !self.failed => &mut self.payload[self.fill..h.len as usize],
            _ => &mut [],
        }
    }

    /// `n` bytes of [`Deframer::payload_room`] were written (at most its length).
    pub fn payload_filled(&mut self, n: usize) {
        let room = self.payload_room().len();
        debug_assert!(n <= room, "{n} bytes filled in a room of {room}");
        self.fill += n.min(room);
    }

    fn begin_payload(&mut self, header: HeaderRepr, len: usize) {
        if self.payload.len() < len {
            // Zeroed once per size reached, not per message.
            self.payload.resize(len, 0);
        }
        self.fill = 0;
        self.current = Some(header);
    }

    /// Feeds a whole slice, calling `on_frame` for every completed message. Stops at the first
    /// error.
    pub fn feed(
        &mut self,
        mut input: &[u8],
        mut on_frame: impl FnMut(Frame<'_>),
    ) -> Result<(), DeframeError> {
        while !input.is_empty() {
            let (used, frame) = self.push(input)?;
            if let Some(frame) = frame {
                on_frame(frame);
            }
            input = &input[used..];
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(seq: u64, payload: &[u8]) -> Vec<u8> {
        let h = HeaderRepr {
            sequence: seq,
            len: payload.len() as u32,
            sport: 2,
            dport: 3,
            ..Default::default()
        };
        let mut v = h.to_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn remaining_says_what_the_frame_in_progress_still_needs() {
        let stream = message(1, &[9; 500]);
        let mut d = Deframer::new();
        assert_eq!(d.remaining(), (0, 0));
        d.advance(&stream[..10]).unwrap();
        assert_eq!(d.remaining(), (HEADER_LEN - 10, 0));
        d.advance(&stream[10..HEADER_LEN + 100]).unwrap();
        assert_eq!(d.remaining(), (0, 400));
        let (_, f) = d.advance(&stream[HEADER_LEN + 100..]).unwrap();
        assert!(f.is_some());
        assert_eq!(d.remaining(), (0, 0));
    }

    #[test]
    fn the_rest_of_a_payload_can_be_received_in_place() {
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut stream = message(1, &big);
        stream.extend(message(2, b"after"));
        let mut d = Deframer::new();
        assert!(d.payload_room().is_empty(), "no room before a header");
        // A first read: the header and 1000 payload bytes.
        let (used, f) = d.advance(&stream[..HEADER_LEN + 1000]).unwrap();
        assert_eq!((used, f), (HEADER_LEN + 1000, None));
        // Straight into the room, in two receives.
        let mut at = HEADER_LEN + 1000;
        for n in [60_000, 39_000] {
            let room = d.payload_room();
            assert_eq!(room.len(), HEADER_LEN + big.len() - at);
            room[..n].copy_from_slice(&stream[at..at + n]);
            d.payload_filled(n);
            at += n;
        }
        // Complete: an empty input hands the frame over.
        assert!(d.payload_room().is_empty());
        let (used, f) = d.push(&[]).unwrap();
        assert_eq!(used, 0);
        let f = f.expect("the frame");
        assert_eq!((f.header.sequence, f.payload), (1, &big[..]));
        // The stream goes on where the room ended; a shorter payload reuses the buffer.
        let (used, f) = d.push(&stream[at..]).unwrap();
        assert_eq!(used, stream.len() - at);
        assert_eq!(f.expect("next").payload, b"after");
        let third = message(3, &big[..10]);
        let (_, f) = d.push(&third).unwrap();
        assert_eq!(f.expect("third").payload, &big[..10]);
    }

    #[test]
    fn byte_by_byte_and_whole() {
        let mut stream = message(1, b"hello");
        stream.extend(message(2, b""));
        stream.extend(message(3, &[7u8; 300]));
        for chunk in [1usize, 2, 47, 48, 49, 1000] {
            let mut d = Deframer::new();
            let mut got = Vec::new();
            for c in stream.chunks(chunk) {
                d.feed(c, |f| got.push((f.header.sequence, f.payload.to_vec())))
                    .unwrap();
            }
            assert_eq!(
                got,
                vec![(1, b"hello".to_vec()), (2, vec![]), (3, vec![7u8; 300])],
                "chunk {chunk}"
            );
            assert!(d.is_idle());
        }
    }

    #[test]
    fn oversize_fails_and_stays_failed() {
        let h = HeaderRepr {
            len: MAX_MSG_SIZE + 1,
            ..Default::default()
        };
        let mut d = Deframer::new();
        assert_eq!(d.push(&h.to_bytes()[..10]).unwrap().0, 10);
        assert_eq!(
            d.push(&h.to_bytes()[10..]).unwrap_err(),
            DeframeError::Oversize {
                len: MAX_MSG_SIZE + 1
            }
        );
        assert_eq!(d.push(b"x").unwrap_err(), DeframeError::Failed);
        d.reset();
        assert!(d.push(&message(1, b"ok")).unwrap().1.is_some());
        // Exactly the limit is fine.
        let h = HeaderRepr {
            len: MAX_MSG_SIZE,
            ..Default::default()
        };
        assert!(Deframer::new().push(&h.to_bytes()).is_ok());
    }
}
