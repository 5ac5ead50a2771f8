//! rdma_cm's events off the poll core. Reading the event channel is a `read(2)`; a thread of
//! its own blocks on it, copies and acknowledges each event (so `rdma_destroy_id` on the poll
//! core never waits on it) and hands it over through a lock-free queue, waking a parked poll
//! core through an eventfd. The poll core's passes then see rdma_cm without a syscall.

use super::verbs::{Cm, CmEvent};
use crossbeam_queue::ArrayQueue;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Events waiting for the poll core (connection setup only: a handful per path).
const QUEUE: usize = 1024;
/// How often the thread looks at `stop` while the channel is quiet.
const TICK_MS: i32 = 100;

/// The receiving end, owned by the link.
pub struct CmEvents {
    queue: Arc<ArrayQueue<CmEvent>>,
    wake: Arc<OwnedFd>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CmEvents {
    /// Starts the thread reading `cm`'s channel.
    pub fn spawn(cm: Arc<Cm>) -> io::Result<CmEvents> {
        // SAFETY: eventfd with a valid flag set; the descriptor is owned from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let queue = Arc::new(ArrayQueue::new(QUEUE));
        let stop = Arc::new(AtomicBool::new(false));
        let (q, w, s) = (queue.clone(), wake.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("rdsd-rdma-cm".into())
            .spawn(move || run(&cm, &q, &w, &s))?;
        Ok(CmEvents {
            queue,
            wake,
            stop,
            thread: Some(thread),
        })
    }

    /// The next event, if one waits (no syscall).
    pub fn pop(&self) -> Option<CmEvent> {
        self.queue.pop()
    }

    /// Before parking: resets the eventfd (one `read`) and says whether events already wait,
    /// in which case the poll core must not sleep. Reset first, then look, so an event pushed
    /// in between still finds the eventfd set.
    pub fn arm(&self) -> bool {
        let mut v = 0u64;
        // SAFETY: an 8-byte read into a local from our non-blocking eventfd.
        unsafe { libc::read(self.wake.as_raw_fd(), &mut v as *mut u64 as *mut _, 8) };
        !self.queue.is_empty()
    }

    /// Readable when events wait.
    pub fn fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }
}

impl Drop for CmEvents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(cm: &Cm, queue: &ArrayQueue<CmEvent>, wake: &OwnedFd, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd: cm.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        if unsafe { libc::poll(&mut pfd, 1, TICK_MS) } <= 0 {
            continue;
        }
        while let Some(mut ev) = cm.get_event() {
            // The queue only fills if the poll core stalls; the event is acknowledged already,
            // so waiting here blocks nobody's rdma_destroy_id.
            loop {
                match queue.push(ev) {
                    Ok(()) => break,
                    Err(back) => {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        ev = back;
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
            }
            let one = 1u64;
            // SAFETY: an 8-byte write from a local to our eventfd.
            unsafe { libc::write(wake.as_raw_fd(), &one as *const u64 as *const _, 8) };
        }
    }
}
