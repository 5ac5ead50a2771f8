//! Work that needs a system call, moved off the poll core: a thread blocks in `poll(2)` on one
//! descriptor (rdma_cm's event channel, the RDS/TCP listener), turns what is ready into items
//! and hands them over through a lock-free queue, setting an eventfd that wakes a parked poll
//! core. The poll core's passes then pop items without a syscall.

use crossbeam_queue::ArrayQueue;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Items waiting for the poll core (connection setup only: a handful per path).
const QUEUE: usize = 1024;
/// How often the thread looks at `stop` while its descriptor is quiet.
const TICK_MS: i32 = 100;

/// The receiving end, owned by a transport.
pub struct Handoff<T> {
    queue: Arc<ArrayQueue<T>>,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    /// The thread, held (and stopped and joined on drop) by the first receiving end only.
    thread: Option<std::thread::JoinHandle<()>>,
}

impl<T: Send + 'static> Handoff<T> {
    /// Starts thread `name`: each time `fd` is readable it calls `produce`, which hands over
    /// every item ready now (it must not block: `fd` is non-blocking).
    pub fn spawn<F>(name: &str, fd: RawFd, produce: F) -> io::Result<Handoff<T>>
    where
        F: FnMut(&mut dyn FnMut(T)) + Send + 'static,
    {
        let mut ends = Handoff::spawn_sharded(name, fd, 1, |_: &T| 0, produce)?;
        Ok(ends.pop().expect("one end"))
    }

    /// [`Handoff::spawn`] with `ends` receiving ends (one per poll thread): each item goes to
    /// end `route(&item)` (taken modulo `ends`). The first end owns the thread.
    pub fn spawn_sharded<F, R>(
        name: &str,
        fd: RawFd,
        ends: usize,
        route: R,
        mut produce: F,
    ) -> io::Result<Vec<Handoff<T>>>
    where
        F: FnMut(&mut dyn FnMut(T)) + Send + 'static,
        R: Fn(&T) -> usize + Send + 'static,
    {
        let ends = ends.max(1);
        let mut wakes = Vec::with_capacity(ends);
        for _ in 0..ends {
            // SAFETY: eventfd with a valid flag set; the descriptor is owned from here on.
            let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if efd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a fresh descriptor nobody else owns.
            wakes.push(Arc::new(unsafe { OwnedFd::from_raw_fd(efd) }));
        }
        let queues: Vec<Arc<ArrayQueue<T>>> = (0..ends)
            .map(|_| Arc::new(ArrayQueue::new(QUEUE)))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let (qs, ws, s) = (queues.clone(), wakes.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    let mut pfd = libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd for the call.
                    if unsafe { libc::poll(&mut pfd, 1, TICK_MS) } <= 0 {
                        continue;
                    }
                    produce(&mut |item| {
                        let k = route(&item) % qs.len();
                        push(&qs[k], &ws[k], &s, item)
                    });
                }
            })?;
        let mut thread = Some(thread);
        Ok(queues
            .into_iter()
            .zip(wakes)
            .map(|(queue, wake)| Handoff {
                queue,
                wake,
                stop: stop.clone(),
                thread: thread.take(),
            })
            .collect())
    }

    /// The next item, if one waits (no syscall).
    pub fn pop(&self) -> Option<T> {
        self.queue.pop()
    }

    /// True when no item waits (no syscall).
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Before parking: resets the eventfd (one `read`) and says whether items already wait,
    /// in which case the poll core must not sleep. Reset first, then look, so an item pushed
    /// in between still finds the eventfd set.
    pub fn arm(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: an 8-byte read into a local from our non-blocking eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), &mut v as *mut u64 as *mut _, 8) };
        !self.queue.is_empty()
    }

    /// Readable when items wait.
    pub fn fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }
}

/// Queues `item` (waiting while the poll core is behind) and wakes the poll core.
fn push<T>(q: &ArrayQueue<T>, wake: &OwnedFd, stop: &AtomicBool, mut item: T) {
    loop {
        match q.push(item) {
            Ok(()) => break,
            Err(back) => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                item = back;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
    let one = 1u64;
    // SAFETY: an 8-byte write from a local to our eventfd.
    unsafe { libc::write(wake.as_raw_fd(), &one as *const u64 as *const _, 8) };
}

impl<T> Drop for Handoff<T> {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::Release);
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_cross_and_the_eventfd_wakes() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let fd = b.as_raw_fd();
        let h: Handoff<Vec<u8>> = Handoff::spawn("handoff-test", fd, move |push| {
            let mut buf = [0u8; 64];
            while let Ok(n) = b.recv(&mut buf) {
                push(buf[..n].to_vec());
            }
        })
        .unwrap();
        assert!(!h.arm(), "nothing waits yet");
        a.send(b"one").unwrap();
        a.send(b"two").unwrap();
        let mut pfd = libc::pollfd {
            fd: h.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5000) }, 1, "woken");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut got = Vec::new();
        while got.len() < 2 && std::time::Instant::now() < deadline {
            if let Some(v) = h.pop() {
                got.push(v);
            }
        }
        assert_eq!(got, vec![b"one".to_vec(), b"two".to_vec()]);
        drop(h); // joins the thread within a tick
    }

    #[test]
    fn sharded_items_reach_the_end_their_route_names() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let fd = b.as_raw_fd();
        let ends: Vec<Handoff<u8>> = Handoff::spawn_sharded(
            "handoff-test",
            fd,
            3,
            |v: &u8| usize::from(*v),
            move |push| {
                let mut buf = [0u8; 1];
                while let Ok(1) = b.recv(&mut buf) {
                    push(buf[0]);
                }
            },
        )
        .unwrap();
        for v in [0u8, 1, 2, 4, 5] {
            a.send(&[v]).unwrap();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut got = vec![Vec::new(); 3];
        while got.iter().map(Vec::len).sum::<usize>() < 5 && std::time::Instant::now() < deadline {
            for (k, e) in ends.iter().enumerate() {
                if let Some(v) = e.pop() {
                    got[k].push(v);
                }
            }
        }
        assert_eq!(got, vec![vec![0], vec![1, 4], vec![2, 5]]);
        assert!(!ends[1].arm() && !ends[2].arm(), "all taken");
    }
}
