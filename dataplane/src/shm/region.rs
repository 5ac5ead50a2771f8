//! Creating the shared regions: one per app (read-write for that app only) and the daemon
//! region (sealed so that apps can only ever map it read-only).

use crate::config::HugepageMode;
use shm_api::layout::{
    AppRegionHeader, DaemonHeader, DaemonView, RegionGeometry, SlotControl, DAEMON_REGION_LEN,
    LAYOUT_VERSION, SHM_MAGIC, SLOTS_OFFSET,
};
use shm_api::ring::RawRing;
use shm_api::sys::{self, Mapping, HUGE_PAGE};
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;

/// Seals the size of a memfd so a hostile holder can't shrink it under rdsd (which would turn
/// rdsd's next access into SIGBUS).
fn seal_size(fd: &OwnedFd, extra: libc::c_int) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | extra | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on our own fd.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn sealable_memfd(name: &str, len: usize, huge: bool) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    let cname = std::ffi::CString::new(name).expect("no NUL");
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    if huge {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: valid name; result checked and owned.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: our own fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A memfd holding a copy of `bytes`, sealed against any change: what rdsd hands a client to
/// read (a long `Info` document). Written with `pwrite`, so the file offset the client shares
/// stays at 0.
pub fn sealed_copy(name: &str, bytes: &[u8]) -> io::Result<OwnedFd> {
    let fd = sealable_memfd(name, bytes.len(), false)?;
    std::os::unix::fs::FileExt::write_all_at(&std::fs::File::from(fd.try_clone()?), bytes, 0)?;
    seal_size(&fd, libc::F_SEAL_WRITE)?;
    Ok(fd)
}

/// One app's region, as rdsd sees it.
///
/// Dropping it (or [`AppRegion::release`]) unmaps it and then punches every page out of the
/// memfd, so the memory returns to the host even if the app keeps the fd (or a mapping) after
/// it detached: a hostile app can't pin rdsd's hugepages by holding descriptors.
pub struct AppRegion {
    map: ManuallyDrop<Mapping>,
    fd: OwnedFd,
    geometry: RegionGeometry,
    /// `geometry.slot_len()`, kept: every delivery finds its slot's control block.
    slot_len: usize,
    hugetlb: bool,
    released: bool,
}

impl AppRegion {
    /// Creates and initialises a region laid out by `geometry`.
    pub fn create(
        name: &str,
        geometry: RegionGeometry,
        mode: HugepageMode,
    ) -> io::Result<AppRegion> {
        let mut huge_err = None;
        if mode != HugepageMode::Off {
            let len = geometry.region_len(HUGE_PAGE);
            // mmap of a hugetlbfs file reserves its pages up front, so running out shows here
            // and never as SIGBUS later.
            match sealable_memfd(name, len, true).and_then(|fd| {
                seal_size(&fd, 0)?;
                let map = Mapping::new(fd.as_raw_fd(), len, true, false)?;
                Ok((fd, map))
            }) {
                Ok((fd, map)) => return Ok(AppRegion::init(fd, map, geometry, true)),
                Err(e) if mode == HugepageMode::Require => return Err(e),
                Err(e) => huge_err = Some(e),
            }
        }
        let len = geometry.region_len(4096);
        let fd = sealable_memfd(name, len, false)?;
        seal_size(&fd, 0)?;
        let map = Mapping::new(fd.as_raw_fd(), len, true, false)?;
        let _ = map.advise_hugepage();
        if let Some(e) = huge_err {
            tracing::debug!(error = %e, "no hugetlbfs pages for this region; using 4 KiB pages");
        }
        Ok(AppRegion::init(fd, map, geometry, false))
    }

    fn init(fd: OwnedFd, map: Mapping, geometry: RegionGeometry, hugetlb: bool) -> AppRegion {
        let header = AppRegionHeader {
            magic: SHM_MAGIC,
            version: LAYOUT_VERSION,
            max_sockets: geometry.max_sockets,
            region_len: map.len() as u64,
            slots_offset: geometry.slot_offset(0) as u64,
            slot_len: geometry.slot_len() as u64,
            tx_ring_capacity: geometry.tx_ring_capacity,
            rx_ring_capacity: geometry.rx_ring_capacity,
            poll_shard: 0,
            reserved: 0,
        };
        // SAFETY: offset 0 of a fresh mapping far larger than the header; nobody else has it yet.
        unsafe { std::ptr::write(map.as_ptr() as *mut AppRegionHeader, header) };
        AppRegion {
            map: ManuallyDrop::new(map),
            fd,
            geometry,
            slot_len: geometry.slot_len(),
            hugetlb,
            released: false,
        }
    }

    /// Names the poll thread that serves this app. Called before the region is sent to the app
    /// (the header is written once, then only read).
    pub fn set_poll_shard(&mut self, shard: u32) {
        let hdr = self.map.as_ptr() as *mut AppRegionHeader;
        // SAFETY: the header lies at offset 0 of our own mapping (see `init`); `&mut self` and
        // "not sent yet" mean nobody reads it concurrently.
        unsafe { std::ptr::addr_of_mut!((*hdr).poll_shard).write(shard) };
    }

    /// The memfd to pass to the app.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Mapped length.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Start of rdsd's mapping (for registration with an RDMA device; the app writes any of
    /// it at will, so nothing may read it through a reference).
    pub fn base(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// True if backed by hugetlbfs pages.
    pub fn hugetlb(&self) -> bool {
        self.hugetlb
    }

    /// The layout.
    pub fn geometry(&self) -> RegionGeometry {
        self.geometry
    }

    /// Slot `slot`'s control block. Every field in it may be scribbled on by the app.
    pub fn slot_control(&self, slot: u32) -> &SlotControl {
        assert!(slot < self.geometry.max_sockets);
        let off = SLOTS_OFFSET + slot as usize * self.slot_len;
        debug_assert_eq!(off, self.geometry.slot_offset(slot));
        // SAFETY: in bounds by construction of the geometry and page aligned. The app writes this
        // memory at will, which is sound only because every byte of SlotControl, padding
        // included, is an atomic (interior-mutable): the reference asserts nothing immutable,
        // and every access through it is an atomic load/store/RMW.
        unsafe { &*(self.map.as_ptr().add(off) as *const SlotControl) }
    }

    /// Slot `slot`'s tx ring (app → rdsd).
    pub fn tx_ring(&self, slot: u32) -> RawRing {
        self.ring(
            self.geometry.tx_ring_offset(slot),
            self.geometry.tx_ring_capacity,
        )
    }

    /// Slot `slot`'s rx ring (rdsd → app).
    pub fn rx_ring(&self, slot: u32) -> RawRing {
        self.ring(
            self.geometry.rx_ring_offset(slot),
            self.geometry.rx_ring_capacity,
        )
    }

    fn ring(&self, off: usize, cap: u32) -> RawRing {
        assert!(off + shm_api::layout::RING_HEADER_LEN + cap as usize <= self.map.len());
        // SAFETY: in bounds (asserted), 128-aligned; the mapping outlives every RawRing made
        // here because the poll thread drops a socket's rings before it hands the region back.
        unsafe {
            RawRing::new(
                NonNull::new(self.map.as_ptr().add(off)).expect("non-null"),
                cap as usize,
            )
        }
    }

    /// Zeroes slot `slot` (control block and ring counters) before it is handed out again.
    pub fn reset_slot(&self, slot: u32) {
        let off = self.geometry.slot_offset(slot);
        // SAFETY: the control block and the two ring headers are in bounds; the slot is not in
        // use by the app (it was closed or never opened), so nothing else touches it now.
        unsafe {
            std::ptr::write_bytes(
                self.map.as_ptr().add(off),
                0,
                shm_api::layout::SLOT_CONTROL_LEN,
            );
            for r in [
                self.geometry.tx_ring_offset(slot),
                self.geometry.rx_ring_offset(slot),
            ] {
                std::ptr::write_bytes(
                    self.map.as_ptr().add(r),
                    0,
                    shm_api::layout::RING_HEADER_LEN,
                );
            }
        }
    }

    /// Unmaps the region, then deallocates its pages (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE on the
    /// memfd; the seals forbid only resizing). Any mapping the app kept loses the pages too;
    /// if it touches them again it allocates fresh ones as its own, exactly as it could with a
    /// memfd of its own. Returns whether the pages were returned.
    pub fn release(mut self) -> bool {
        self.release_now()
    }

    fn release_now(&mut self) -> bool {
        if self.released {
            return true;
        }
        self.released = true;
        let len = self.map.len() as libc::off_t;
        // SAFETY: `released` guards this, so the mapping is dropped exactly once, and nothing
        // uses it afterwards: every ring and slot view into it is gone (the poll core drops a
        // socket's rings before it hands the region back, and `release_now` runs only when the
        // region is consumed or dropped).
        unsafe { ManuallyDrop::drop(&mut self.map) };
        let fd = self.fd.as_raw_fd();
        if self.hugetlb {
            // A hugetlbfs hole punch frees the pages present in the range but keeps the
            // reservations of pages never touched (the kernel drops those only on truncation,
            // which our seals forbid), and the file, kept open by the app, would hold them for
            // good. So first turn every reservation into a page (this consumes the region's
            // own reservations: it can't fail for want of pages), then punch them all.
            if let Err(error) = fallocate_whole(fd, 0, len) {
                tracing::warn!(%error, "could not fill a detached hugetlb region before punching it");
            }
        }
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match fallocate_whole(fd, punch, len) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "could not punch out a detached app's region");
                false
            }
        }
    }
}

/// `fallocate(fd, mode, 0, len)`, retried when a signal interrupts it (filling a large
/// hugetlb region takes long enough for a SIGTERM or SIGCHLD to land).
fn fallocate_whole(fd: libc::c_int, mode: libc::c_int, len: libc::off_t) -> io::Result<()> {
    for _ in 0..100 {
        // SAFETY: fallocate on our own fd, within its (sealed) size.
        if unsafe { libc::fallocate(fd, mode, 0, len) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Err(io::Error::from(io::ErrorKind::Interrupted))
}

impl Drop for AppRegion {
    fn drop(&mut self) {
        self.release_now();
    }
}

/// The daemon region: poll-core sleep flag and congestion maps. Apps map it read-only; the
/// memfd is sealed against writable mappings after rdsd maps it.
pub struct DaemonRegion {
    map: Mapping,
    fd: OwnedFd,
}

impl DaemonRegion {
    /// Creates the region and seals it.
    pub fn create(may_sleep: bool) -> io::Result<DaemonRegion> {
        let fd = sealable_memfd("rdsd-daemon", DAEMON_REGION_LEN, false)?;
        let map = Mapping::new(fd.as_raw_fd(), DAEMON_REGION_LEN, true, true)?;
        // F_SEAL_FUTURE_WRITE: no new writable mapping or write(2) from anyone, apps included;
        // ours stays writable.
        seal_size(&fd, libc::F_SEAL_FUTURE_WRITE)?;
        let r = DaemonRegion { map, fd };
        // SAFETY: header at offset 0 of a fresh mapping of the right size.
        unsafe {
            let h = r.map.as_ptr() as *mut DaemonHeader;
            std::ptr::addr_of_mut!((*h).magic).write(SHM_MAGIC);
            std::ptr::addr_of_mut!((*h).version).write(LAYOUT_VERSION);
        }
        let view = r.view();
        let header = view.header();
        header
            .may_sleep
            .store(may_sleep as u32, std::sync::atomic::Ordering::Release);
        // Poll threads that park make a global membarrier before their last look, so apps'
        // doorbell checks need no fence (`DaemonHeader::park_barrier`).
        let barrier = may_sleep && shm_api::sys::membarrier_global_supported();
        header
            .park_barrier
            .store(barrier as u32, std::sync::atomic::Ordering::Release);
        Ok(r)
    }

    /// The memfd to pass to apps.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// A new read-only open file description of the region for one app (so no description is
    /// shared between rdsd and more than one app: an app's fcntl or lseek on its copy touches
    /// nobody else's). Falls back to a dup where /proc is missing.
    pub fn fd_for_app(&self) -> io::Result<OwnedFd> {
        use std::os::fd::FromRawFd;
        let path = format!("/proc/self/fd/{}\0", self.fd.as_raw_fd());
        // SAFETY: a NUL-terminated path; the result is checked and owned.
        let fd = unsafe {
            libc::open(
                path.as_ptr() as *const libc::c_char,
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "reopening the daemon region failed; passing a dup");
            return self.fd.try_clone();
        }
        // SAFETY: fresh fd from open(2).
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Typed access.
    pub fn view(&self) -> DaemonView {
        // SAFETY: the mapping is DAEMON_REGION_LEN bytes and lives as long as `self`; callers
        // keep `self` alive (it is shared through an Arc) while they use the view.
        unsafe { DaemonView::new(self.map.as_ptr()) }
    }
}

/// Wakes the app threads blocked on this slot if any of those that `whom` selects
/// ([`shm_api::layout::RECV_WAITERS`], [`shm_api::layout::SEND_WAITERS`] or both) announced
/// itself; a syscall only when such a thread waits; true if it made one. The caller changed
/// the slot's state (published, released) and then made a SeqCst fence, once for every slot
/// it checks (`SocketTable::wake_pending`, a group fan-out): it pairs with the fence a thread
/// makes after adding itself to `waiters`.
#[must_use = "count the wake-up (Stats::app_wakeups)"]
pub fn wake_slot_after_fence(ctl: &SlotControl, whom: u32) -> bool {
    use std::sync::atomic::Ordering;
    if ctl.waiters.load(Ordering::Relaxed) & whom != 0 {
        ctl.wake_seq.fetch_add(1, Ordering::Release);
        sys::futex_wake(&ctl.wake_seq);
        return true;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_region_cannot_be_mapped_writable_by_fd_holders() {
        let r = DaemonRegion::create(true).unwrap();
        let w = Mapping::new(r.fd().as_raw_fd(), DAEMON_REGION_LEN, true, false);
        assert!(
            w.is_err(),
            "a writable mapping of the sealed daemon region must fail"
        );
        let ro = Mapping::new(r.fd().as_raw_fd(), DAEMON_REGION_LEN, false, false).unwrap();
        // Our own writes show through the app's read-only mapping.
        r.view()
            .entry(3)
            .addr
            .store(0x7f000001, std::sync::atomic::Ordering::Release);
        // SAFETY: the read-only mapping is the right size.
        let v = unsafe { DaemonView::new(ro.as_ptr()) };
        assert_eq!(v.find(0x7f000001), Some(3));
    }

    #[test]
    fn app_region_cannot_be_shrunk() {
        let g = RegionGeometry {
            max_sockets: 1,
            tx_ring_capacity: 2 << 20,
            rx_ring_capacity: 2 << 20,
        };
        let r = AppRegion::create("t", g, HugepageMode::Off).unwrap();
        // SAFETY: our own fd.
        let rc = unsafe { libc::ftruncate(r.fd().as_raw_fd(), 4096) };
        assert!(rc < 0, "shrinking a sealed region must fail");
        assert!(!r.hugetlb());
    }

    fn blocks(fd: &OwnedFd) -> i64 {
        // SAFETY: fstat into a zeroed struct on our own fd.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            assert_eq!(libc::fstat(fd.as_raw_fd(), &mut st), 0);
            st.st_blocks
        }
    }

    #[test]
    fn released_region_holds_no_pages_even_if_its_fd_is_kept() {
        let g = RegionGeometry {
            max_sockets: 2,
            tx_ring_capacity: 2 << 20,
            rx_ring_capacity: 2 << 20,
        };
        let r = AppRegion::create("t", g, HugepageMode::Off).unwrap();
        r.reset_slot(1);
        let kept = r.fd().try_clone().unwrap();
        assert!(blocks(&kept) > 0, "the header and slot pages are allocated");
        assert!(r.release());
        assert_eq!(blocks(&kept), 0, "the kept fd pins nothing");
    }

    #[test]
    fn each_app_gets_its_own_daemon_region_description() {
        let r = DaemonRegion::create(true).unwrap();
        let a = r.fd_for_app().unwrap();
        // Flags set on the app's description do not reach rdsd's.
        shm_api::sys::set_nonblocking(a.as_raw_fd(), true).unwrap();
        // SAFETY: F_GETFL on our own fds.
        let (fa, fr) = unsafe {
            (
                libc::fcntl(a.as_raw_fd(), libc::F_GETFL),
                libc::fcntl(r.fd().as_raw_fd(), libc::F_GETFL),
            )
        };
        assert_ne!(fa & libc::O_NONBLOCK, 0);
        assert_eq!(fr & libc::O_NONBLOCK, 0);
        let ro = Mapping::new(a.as_raw_fd(), DAEMON_REGION_LEN, false, false);
        assert!(ro.is_ok(), "the app can map it read-only");
    }
}
