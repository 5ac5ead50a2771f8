//! Control datagrams as rdsd reads them from any app (requests) and as the library reads them
//! from rdsd (replies, the Hello body): never a panic, and whatever decodes encodes back to
//! the same meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shm_api::ctrl::{
    frame_id, HelloInfo, Reply, Request, LEGACY_REQUEST_LEN, REPLY_HEADER_LEN, REQUEST_LEN,
};

fuzz_target!(|data: &[u8]| {
    let id = frame_id(data);
    if let Ok((got, req)) = Request::decode(data) {
        assert_eq!(data.len(), REQUEST_LEN);
        assert_eq!(got, id);
        assert_eq!(Request::decode(&req.encode(id)), Ok((id, req)));
    }
    if let Ok(req) = Request::decode_legacy(data) {
        assert_eq!(data.len(), LEGACY_REQUEST_LEN);
        assert!(matches!(req, Request::Hello { .. } | Request::Stats));
        assert_eq!(Request::decode_legacy(&req.encode_v1()), Ok(req));
    }
    // The first 24 bytes of any frame as a v1 request: what `serve` tries first.
    if let Some(v1) = data.get(..LEGACY_REQUEST_LEN) {
        let _ = Request::decode_legacy(v1);
    }
    if let Some(reply) = Reply::decode(data) {
        assert_eq!(reply.body.len(), data.len() - REPLY_HEADER_LEN);
        assert_eq!(Reply::decode(&reply.encode()), Some(reply.clone()));
        let _ = Reply::is_legacy_len(data.len());
        if let Some(info) = HelloInfo::decode(&reply.body) {
            assert_eq!(HelloInfo::decode(&info.encode()), Some(info));
        }
    }
});
