//! One hostile app against a real poll core, for the fuzz targets (`dataplane/fuzz`) and a unit
//! test that keeps this compiling. Built only under `cfg(test)` or `cfg(fuzzing)` (cargo-fuzz).
//!
//! The fuzzer's bytes are a script of what an app can do: send control requests (raw 32-byte
//! frames through `Request::decode`, or well-formed ones), publish records on its tx rings,
//! scribble on any byte of its rings and counters, read its rx rings, and let the poll core run
//! a pass. The poll core must answer every forwarded request, never panic, and after the app
//! detaches hold nothing of it (no socket, no bind, no readiness entry).

use super::*;
use crate::config::{HugepageMode, Overrides};
use shm_api::ring::{Consumer, Producer, RecordHeader, RingMemory};

/// Socket slots of the fuzzed app (a few, so that slot numbers hit live sockets often).
const SLOTS: u32 = 4;
/// Ring bytes (small, so that the wrap and the pad records are reached quickly).
const RING: u32 = 4096;
/// The local address (loopback delivers from the app to itself).
const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

/// A poll core with the loopback transport and one app slot, reused across fuzz inputs (a
/// region is costly to create); every input attaches, plays its script and detaches.
pub struct AppSession {
    core: PollCore,
    chans: Arc<Channels>,
    region: Option<AppRegion>,
    seq: u64,
    dir: std::path::PathBuf,
}

impl Drop for AppSession {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads the fuzzer's script.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn bytes<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.bytes::<1>().map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.bytes().map(u16::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.bytes().map(u64::from_le_bytes)
    }
}

impl AppSession {
    /// A poll core over a temporary state directory (unique per process and thread).
    pub fn new() -> AppSession {
        let dir = std::env::temp_dir().join(format!(
            "rdsd-fuzz-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        let over = Overrides {
            state_file: Some(dir.join("state")),
            local_addrs: vec![format!("{LOCAL}/32")],
            hugepages: Some(HugepageMode::Off),
            max_sockets_per_app: Some(SLOTS),
            ..Default::default()
        };
        let mut cfg = Config::load(None, &over).expect("fuzz config");
        cfg.max_apps = 1;
        cfg.tx_ring_bytes = RING;
        cfg.rx_ring_bytes = RING;
        let cfg = Arc::new(cfg);
        let stats = Arc::new(Stats::default());
        let daemon = Arc::new(DaemonRegion::create(false).expect("daemon region"));
        let chans = Arc::new(Channels::new(1));
        let wake = Arc::new(shm_api::sys::eventfd().expect("eventfd"));
        let region = AppRegion::create("rdsd-fuzz-app", cfg.geometry(), HugepageMode::Off)
            .expect("app region");
        let loopback: Box<dyn Transport> =
            Box::new(crate::transport::loopback::Loopback::new(&cfg, &stats));
        let core = PollCore::new(cfg, stats, daemon, chans.clone(), wake, vec![loopback]);
        AppSession {
            core,
            chans,
            region: Some(region),
            seq: 0,
            dir,
        }
    }

    /// Queues `cmd`, runs one pass and returns the answer (which must come, with its seq).
    fn cmd(&mut self, cmd: Cmd) -> CmdReply {
        self.seq += 1;
        let seq = self.seq;
        if !matches!(cmd, Cmd::Detach { .. }) {
            self.chans.arm(0, seq);
        }
        assert!(
            self.chans.cmds[0].push((seq, cmd)).is_ok(),
            "command queue full"
        );
        self.core.run_once();
        let (s, app, reply) = self.chans.replies.pop().expect("every command is answered");
        assert_eq!((s, app), (seq, 0), "the answer names its command");
        assert!(self.chans.replies.pop().is_none(), "one answer per command");
        reply
    }

    fn request(&mut self, req: Request, readiness: Option<readiness::Readiness>) {
        match self.cmd(Cmd::Request {
            app: 0,
            req,
            readiness,
        }) {
            CmdReply::Reply(_) => {}
            _ => panic!("a request is answered with a reply"),
        }
    }

    fn attach(&mut self) {
        let region = self
            .region
            .take()
            .expect("the region is ours between inputs");
        let (doorbell, _app_end) = std::os::unix::net::UnixDatagram::pair().expect("socketpair");
        let reply = self.cmd(Cmd::Attach {
            app: 0,
            region,
            doorbell: doorbell.into(),
            uid: 1000,
        });
        assert!(matches!(reply, CmdReply::Attached));
    }

    fn detach(&mut self) {
        match self.cmd(Cmd::Detach { app: 0 }) {
            CmdReply::Detached(Some(region)) => self.region = Some(region),
            _ => panic!("loopback pins nothing: the region comes back at once"),
        }
        while self.chans.evictions.pop().is_some() {}
        self.core.table.assert_nothing_left(0);
    }

    /// The app's view of its region (while attached, the region sits in the table).
    fn region(&self) -> &AppRegion {
        match &self.region {
            Some(r) => r,
            None => self.core.table.region(0).expect("attached"),
        }
    }

    /// Plays one script: attach, the app's actions, detach.
    pub fn run(&mut self, data: &[u8]) {
        self.attach();
        let mut s = Script(data);
        while let Some(op) = s.u8() {
            let slot = u32::from(op >> 4) % (SLOTS + 1);
            if self.play(op & 0x0f, slot, &mut s).is_none() {
                break;
            }
        }
        self.core.run_once();
        while self.chans.replies.pop().is_some() {}
        self.detach();
    }

    fn play(&mut self, op: u8, slot: u32, s: &mut Script<'_>) -> Option<()> {
        let live = slot < SLOTS;
        match op {
            // A raw control frame, as the control thread decodes it and forwards it.
            0 => {
                let frame: [u8; shm_api::ctrl::REQUEST_LEN] = s.bytes()?;
                if let Ok((_, req)) = Request::decode(&frame) {
                    self.request(req, None);
                }
            }
            // Well-formed requests on a slot (the decoder rarely yields a local address).
            1 => {
                let (port, arg) = (s.u16()? % 8, s.u8()?);
                let group = Ipv4Addr::new(239, 0, 0, 1);
                let req = match arg % 14 {
                    0 => Request::SocketOpen,
                    1 => Request::Bind {
                        slot,
                        addr: if arg & 0x80 == 0 {
                            LOCAL
                        } else {
                            Ipv4Addr::new(10, 0, 0, 2)
                        },
                        port,
                    },
                    2 => Request::SetRcvBuf {
                        slot,
                        bytes: u32::from(arg) << 8,
                    },
                    3 => Request::SetSndBuf {
                        slot,
                        bytes: u32::from(arg) << 8,
                    },
                    4 => Request::SetCongMonitor {
                        slot,
                        on: arg & 0x80 != 0,
                    },
                    5 => Request::CancelSentTo {
                        slot,
                        dest: (arg & 0x80 != 0).then_some((LOCAL, port)),
                    },
                    6 => Request::EnableReadiness { slot },
                    7 => Request::Close { slot },
                    // Groups on a few ports of one multicast address (`port` 0 among them).
                    8 => Request::GroupCreate {
                        slot,
                        addr: group,
                        port,
                        flags: u32::from(arg >> 7),
                    },
                    9 => Request::GroupJoin {
                        slot,
                        addr: group,
                        port,
                        flags: u32::from(arg >> 5),
                        update: arg & 0x10 != 0,
                    },
                    10 => Request::GroupLeave {
                        slot,
                        addr: group,
                        port,
                    },
                    11 => Request::GroupFilter {
                        slot,
                        addr: group,
                        port,
                        step: shm_api::ctrl::FilterStep {
                            mode: match arg >> 6 {
                                0 => shm_api::ctrl::FilterMode::All,
                                1 => shm_api::ctrl::FilterMode::Only,
                                _ => shm_api::ctrl::FilterMode::Except,
                            },
                            index: (arg >> 4) & 1,
                            count: 2,
                            rule: shm_api::ctrl::FilterRule {
                                addr: LOCAL,
                                prefix_len: 24 + (arg & 0xf),
                                first_port: 0,
                                last_port: port,
                            },
                        },
                    },
                    12 => Request::GroupConnect {
                        slot,
                        addr: group,
                        port,
                    },
                    _ => Request::Hello {
                        version: 0,
                        shard: None,
                    },
                };
                let readiness = match req {
                    Request::SocketOpen if arg & 0x80 != 0 => {
                        readiness::create().ok().map(|(_app_end, state)| state)
                    }
                    _ => None,
                };
                self.request(req, readiness);
            }
            // A well-behaved send: one record published on the tx ring.
            2 if live => {
                let (len, port) = (s.u16()? % 1024, s.u16()? % 8);
                let mut p = Producer::new(self.region().tx_ring(slot));
                // One in four to a group (the ports of op 1's groups).
                let dest = if len % 4 == 0 {
                    Ipv4Addr::new(239, 0, 0, 1)
                } else {
                    LOCAL
                };
                let header = RecordHeader::data(u32::from(len), u32::from(dest), port);
                if p.push(header, &vec![0x5a; usize::from(len)]).is_ok() {
                    p.publish();
                }
            }
            // Scribble 16 bytes anywhere in a ring's data area (tx or rx).
            3 if live => {
                let (at, tx) = (s.u16()?, s.u8()? & 1 == 0);
                let bytes: [u8; 16] = s.bytes()?;
                let ring = if tx {
                    self.region().tx_ring(slot)
                } else {
                    self.region().rx_ring(slot)
                };
                let off = usize::from(at) % ring.capacity();
                let n = bytes.len().min(ring.capacity() - off);
                ring.write(off, &bytes[..n]);
            }
            // Set a counter the app may write: tx producer or rx consumer, to anything.
            4 if live => {
                let (which, v) = (s.u8()?, s.u64()?);
                let (tx, rx) = (self.region().tx_ring(slot), self.region().rx_ring(slot));
                let near = |base: u64| base.wrapping_add(v % 256 * 16);
                match which % 4 {
                    0 => tx.producer().store(v, Ordering::Release),
                    1 => tx.producer().store(
                        near(tx.consumer().load(Ordering::Relaxed)),
                        Ordering::Release,
                    ),
                    2 => rx.consumer().store(v, Ordering::Release),
                    _ => rx.consumer().store(
                        near(rx.consumer().load(Ordering::Relaxed)),
                        Ordering::Release,
                    ),
                }
            }
            // The app reads what arrived, as the library would (a corrupt ring just stops it).
            5 if live => {
                let mut c = Consumer::new(self.region().rx_ring(slot));
                let mut buf = [0u8; 64];
                while let Ok(Some(rec)) = c.peek() {
                    c.read_payload(&rec, &mut buf);
                    c.consume(&rec);
                }
                c.release();
            }
            6 => {
                self.core.run_once();
                while self.chans.replies.pop().is_some() {}
            }
            7 => {
                self.detach();
                self.attach();
            }
            // rds-info's listings over whatever the app left in its rings.
            8 => {
                let _ = self.core.snapshot(true);
            }
            // The ring room the app says its refused send needs (POLLOUT), any value.
            9 if live => {
                let want = u32::from_le_bytes(s.bytes()?);
                self.region()
                    .slot_control(slot)
                    .tx_ring_want
                    .store(want, Ordering::Relaxed);
            }
            _ => {}
        }
        Some(())
    }
}

impl Default for AppSession {
    fn default() -> AppSession {
        AppSession::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script that opens, binds, sends to itself, reads, scribbles and closes; then garbage.
    #[test]
    fn scripts_run_and_leave_nothing_behind() {
        let mut session = AppSession::new();
        let mut script = vec![
            0x01, 0, 0, 0, // SocketOpen (slot 0)
            0x01, 3, 0, 1, // Bind slot 0 to LOCAL:3
            0x02, 10, 0, 3, 0,    // send 10 bytes to port 3
            0x06, // a pass: delivered to itself
            0x05, // read it
            0x04, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // tx producer = junk
            0x06, // a pass: the app is evicted
        ];
        session.run(&script);
        script.extend((0..=255u8).cycle().take(4096));
        session.run(&script);
        session.run(&[0x17; 64]);
        session.run(&[]);
    }
}
