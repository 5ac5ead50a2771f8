//! The systemd readiness protocol (sd_notify(3)) by hand: one datagram on the AF_UNIX socket
//! named by `$NOTIFY_SOCKET` (a path, or an abstract name when it starts with `@`). Nothing
//! happens when the variable is unset (rdsd not started by systemd with `Type=notify`).

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `"READY=1"`) to `$NOTIFY_SOCKET`; `Ok(false)` if it is not set.
pub fn notify(state: &str) -> std::io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(p) if !p.is_empty() => notify_to(&p, state).map(|()| true),
        _ => Ok(false),
    }
}

/// Sends `state` to the notify socket `socket`.
pub fn notify_to(socket: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let sock = UnixDatagram::unbound()?;
    let bytes = socket.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), socket)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_one_datagram_to_a_path_and_to_an_abstract_name() {
        let dir = std::env::temp_dir().join(format!("rdsd-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("n.sock");
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=x").unwrap();
        let mut b = [0u8; 64];
        let n = rx.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"READY=1\nSTATUS=x");
        let _ = std::fs::remove_dir_all(&dir);

        use std::os::linux::net::SocketAddrExt;
        let name = format!("rdsd-notify-test-{}", std::process::id());
        let a = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&a).unwrap();
        notify_to(std::ffi::OsStr::new(&format!("@{name}")), "READY=1").unwrap();
        let n = rx.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"READY=1");
        assert!(notify_to(std::ffi::OsStr::new("/nonexistent/x.sock"), "READY=1").is_err());
    }
}
