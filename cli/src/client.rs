//! One request, one reply on rdsd's control socket, without attaching (no Hello): what
//! `status`, `stats` and `info` need. Errors keep their errno so `main` can tell "rdsd is not
//! running" from "not permitted".

use shm_api::ctrl::{Reply, Request, MAX_DATAGRAM};
use shm_api::sys;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

/// Longest rdsctl waits for an answer (rdsd's own control_timeout_ms defaults to 10 s).
const REPLY_TIMEOUT: Duration = Duration::from_secs(15);

/// Sends `req` and returns rdsd's successful reply; a failure is an `io::Error` with rdsd's
/// errno (or the connect error: ENOENT/ECONNREFUSED when rdsd is not running, EACCES when the
/// socket is not ours to use).
pub fn request(path: &Path, req: Request) -> io::Result<Reply> {
    request_with_fds(path, req).map(|(r, _)| r)
}

/// [`request`], with the descriptors attached to the reply.
fn request_with_fds(path: &Path, req: Request) -> io::Result<(Reply, Vec<OwnedFd>)> {
    let sock = sys::connect_seqpacket(path)?;
    sock.set_read_timeout(Some(REPLY_TIMEOUT))?;
    sys::send_with_fds(sock.as_raw_fd(), &req.encode(1), &[])?;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (n, fds) = sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0)?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "rdsd closed the control connection without answering",
        ));
    }
    if Reply::is_legacy_len(n) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this rdsd speaks the v1 control protocol (too old for this rdsctl)",
        ));
    }
    let reply = Reply::decode(&buf[..n])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed reply from rdsd"))?;
    if reply.errno != 0 {
        return Err(io::Error::from_raw_os_error(reply.errno));
    }
    Ok((reply, fds))
}

/// The Info document for `sections` (`ctrl::INFO_*`), whole however long (`INFO_WHOLE`).
pub fn info(path: &Path, sections: u32) -> io::Result<serde_json::Value> {
    let sections = sections | shm_api::ctrl::INFO_WHOLE;
    let (r, fds) = request_with_fds(path, Request::Info { sections })?;
    let doc = shm_api::info_body(r, fds)?;
    serde_json::from_slice(&doc).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rdsd's info reply is not JSON: {e}"),
        )
    })
}

/// The counters as `name value` text (the Stats request every rdsd understands).
pub fn stats(path: &Path) -> io::Result<String> {
    let r = request(path, Request::Stats)?;
    Ok(String::from_utf8_lossy(&r.body).into_owned())
}

/// The counters-only Info document; from an rdsd too old for Info (EINVAL), one built from
/// its Stats text (counters without descriptions, no identity).
pub fn counters(path: &Path) -> io::Result<serde_json::Value> {
    match info(path, shm_api::ctrl::INFO_COUNTERS) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let mut m = serde_json::Map::new();
            for l in stats(path)?.lines() {
                if let Some((k, v)) = l.split_once(' ') {
                    m.insert(k.into(), v.trim().parse::<u64>().unwrap_or(0).into());
                }
            }
            Ok(serde_json::json!({ "counters": m }))
        }
        r => r,
    }
}
