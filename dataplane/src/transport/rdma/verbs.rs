//! Thin owning wrappers over `verbs-sys`: the rdma_cm event channel, cm ids, a device's PD and
//! its completion queue (shared by every path on it), and one path's registered slots and RC
//! QP.

use super::flow::{Completion, InPlaceSge, QueuePair};
use super::wire::SLOT;
use std::io;
use std::ptr;
use verbs_sys as v;

fn last() -> io::Error {
    io::Error::last_os_error()
}

fn check(r: i32, what: &str) -> io::Result<()> {
    if r == 0 {
        Ok(())
    } else {
        let e = last();
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

fn set_nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; only flags change.
    let r = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
    };
    if r < 0 {
        return Err(last());
    }
    Ok(())
}

fn sin(addr: u32, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: addr.to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// The rdma_cm event channel (non-blocking).
pub struct Cm {
    ch: *mut v::rdma_event_channel,
}

// SAFETY: librdmacm objects are not tied to the thread that made them.
unsafe impl Send for Cm {}
// SAFETY: two threads share the channel: the event thread only reads events from it
// (`get_event`, `fd`), the poll core only creates ids on it; librdmacm serialises its own
// state (this split is its documented multi-threaded use).
unsafe impl Sync for Cm {}

/// What happened, for the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmEventKind {
    AddrResolved,
    RouteResolved,
    ConnectRequest,
    Established,
    Rejected,
    Unreachable,
    AddrError,
    RouteError,
    ConnectError,
    Disconnected,
    DeviceRemoval,
    Other,
}

/// Whose an id is: the poll thread (shard) whose link made it, and its slot in that link's
/// table with the slot's generation. Set on the id (`CmId::set_context`), so that the event
/// thread hands each event to its path's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmContext {
    pub shard: usize,
    pub idx: usize,
    pub gen: u32,
}

impl CmContext {
    /// One word: generation (32 bits), shard (8), slot (16). Never 0: a generation is >= 1.
    fn word(self) -> u64 {
        debug_assert!(self.idx < 1 << 16 && self.shard < 1 << 8 && self.gen != 0);
        (u64::from(self.gen) << 32)
            | ((self.shard as u64 & 0xff) << 24)
            | (self.idx as u64 & 0xffff)
    }

    fn from_word(w: u64) -> Option<CmContext> {
        (w != 0).then_some(CmContext {
            shard: (w >> 24 & 0xff) as usize,
            idx: (w & 0xffff) as usize,
            gen: (w >> 32) as u32,
        })
    }
}

/// One rdma_cm event, copied out (the event itself is acknowledged at once).
pub struct CmEvent {
    pub kind: CmEventKind,
    pub status: i32,
    /// The id's context (none for a connect request: its id is new).
    pub context: Option<CmContext>,
    /// The new id of a connect request (owned from here on).
    pub new_id: Option<CmId>,
    pub private: Option<Vec<u8>>,
}

impl Cm {
    /// Opens the event channel (needs `/dev/infiniband/rdma_cm`, module rdma_ucm).
    pub fn new() -> io::Result<Cm> {
        // SAFETY: plain constructor; NULL on failure with errno set.
        let ch = unsafe { v::rdma_create_event_channel() };
        if ch.is_null() {
            let e = last();
            return Err(io::Error::new(
                e.kind(),
                format!("rdma_create_event_channel (is rdma_ucm loaded?): {e}"),
            ));
        }
        // SAFETY: `ch` is a live channel.
        let fd = unsafe { (*ch).fd };
        let c = Cm { ch };
        set_nonblocking(fd)?;
        Ok(c)
    }

    /// The channel's descriptor, readable when an event waits.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.ch).fd }
    }

    /// A new RC id (port space TCP) on this channel.
    pub fn create_id(&self) -> io::Result<CmId> {
        let mut id = ptr::null_mut();
        // SAFETY: `id` receives the new id; the context is set later.
        let r = unsafe { v::rdma_create_id(self.ch, &mut id, ptr::null_mut(), v::RDMA_PS_TCP) };
        check(r, "rdma_create_id")?;
        Ok(CmId { id })
    }

    /// An id listening on `port` on every RDMA device.
    pub fn listen(&self, port: u16) -> io::Result<CmId> {
        let id = self.create_id()?;
        let a = sin(0, port);
        let addr = &a as *const _ as *mut v::sockaddr;
        // SAFETY: `a` is a valid sockaddr_in for the call's duration.
        let r = unsafe { v::rdma_bind_addr(id.id, addr) };
        check(r, "rdma_bind_addr")?;
        // SAFETY: a bound id.
        check(unsafe { v::rdma_listen(id.id, 64) }, "rdma_listen")?;
        Ok(id)
    }

    /// The next event, if one waits (one `read` syscall).
    pub fn get_event(&self) -> Option<CmEvent> {
        let mut ev = ptr::null_mut();
        // SAFETY: non-blocking channel; on success `ev` is a live event until acked below.
        if unsafe { v::rdma_get_cm_event(self.ch, &mut ev) } != 0 {
            return None;
        }
        // SAFETY: `ev` is live until rdma_ack_cm_event; everything needed is copied out.
        unsafe {
            let e = &*ev;
            let kind = match e.event {
                v::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
                v::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
                v::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
                v::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
                v::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
                v::RDMA_CM_EVENT_UNREACHABLE => CmEventKind::Unreachable,
                v::RDMA_CM_EVENT_ADDR_ERROR => CmEventKind::AddrError,
                v::RDMA_CM_EVENT_ROUTE_ERROR => CmEventKind::RouteError,
                v::RDMA_CM_EVENT_CONNECT_ERROR => CmEventKind::ConnectError,
                v::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
                v::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::DeviceRemoval,
                _ => CmEventKind::Other,
            };
            let conn = e.param.conn;
            let private = (!conn.private_data.is_null() && conn.private_data_len > 0).then(|| {
                std::slice::from_raw_parts(
                    conn.private_data as *const u8,
                    conn.private_data_len as usize,
                )
                .to_vec()
            });
            let (new_id, context) = if kind == CmEventKind::ConnectRequest {
                (Some(CmId { id: e.id }), None)
            } else {
                (None, CmContext::from_word((*e.id).context as usize as u64))
            };
            let out = CmEvent {
                kind,
                status: e.status,
                context,
                new_id,
                private,
            };
            v::rdma_ack_cm_event(ev);
            Some(out)
        }
    }
}

impl Drop for Cm {
    fn drop(&mut self) {
        // SAFETY: every id on the channel is destroyed before the link (and so the channel)
        // is dropped: the link's fields drop in order, ids first.
        unsafe { v::rdma_destroy_event_channel(self.ch) }
    }
}

/// An owned rdma_cm id.
pub struct CmId {
    id: *mut v::rdma_cm_id,
}

// SAFETY: as for `Cm`: used by one thread at a time.
unsafe impl Send for CmId {}

impl CmId {
    /// The (source, destination) GIDs rdma_cm resolved for the id (zero before resolution),
    /// for introspection (`RDS_INFO_IB_CONNECTIONS`).
    pub fn gids(&self) -> ([u8; 16], [u8; 16]) {
        // SAFETY: the id is live; `route.addr.addr.ibaddr` is plain data rdma_cm fills when it
        // resolves the address (zeroed before), and only read here, on the id's one thread.
        unsafe {
            let ib = &(*self.id).route.addr.addr.ibaddr;
            (ib.sgid.raw, ib.dgid.raw)
        }
    }

    /// Tags the id with its owner and table slot, so events find their path.
    pub fn set_context(&self, ctx: CmContext) {
        // SAFETY: the id is live; the context is an opaque word, written by the id's poll
        // thread before the call that can produce the id's next event (resolve, connect,
        // accept): the event thread reads it only after the kernel reported that event.
        unsafe { (*self.id).context = ctx.word() as usize as *mut _ }
    }

    /// Binds the id to `laddr:sport` (0: any port) and starts resolving `faddr:port`.
    pub fn resolve_addr(
        &self,
        laddr: u32,
        sport: u16,
        faddr: u32,
        port: u16,
        ms: i32,
    ) -> io::Result<()> {
        let src = sin(laddr, sport);
        let dst = sin(faddr, port);
        // SAFETY: both addresses are valid for the call (librdmacm copies them).
        let r = unsafe {
            v::rdma_resolve_addr(
                self.id,
                &src as *const _ as *mut v::sockaddr,
                &dst as *const _ as *mut v::sockaddr,
                ms,
            )
        };
        check(r, "rdma_resolve_addr")
    }

    pub fn resolve_route(&self, ms: i32) -> io::Result<()> {
        // SAFETY: an id with a resolved address.
        let r = unsafe { v::rdma_resolve_route(self.id, ms) };
        check(r, "rdma_resolve_route")
    }

    fn params(private: &[u8]) -> v::rdma_conn_param {
        v::rdma_conn_param {
            private_data: private.as_ptr() as *const _,
            private_data_len: private.len() as u8,
            responder_resources: 1,
            initiator_depth: 1,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            ..Default::default()
        }
    }

    pub fn connect(&self, private: &[u8]) -> io::Result<()> {
        let mut p = Self::params(private);
        // SAFETY: `p` and the private data outlive the call (librdmacm copies them).
        check(unsafe { v::rdma_connect(self.id, &mut p) }, "rdma_connect")
    }

    pub fn accept(&self, private: &[u8]) -> io::Result<()> {
        let mut p = Self::params(private);
        // SAFETY: as for connect.
        check(unsafe { v::rdma_accept(self.id, &mut p) }, "rdma_accept")
    }

    /// Rejects a connect request with a native-endian int as the reject data.
    pub fn reject(&self, code: i32) {
        let b = code.to_ne_bytes();
        // SAFETY: a connect-request id; the data is copied by librdmacm.
        unsafe { v::rdma_reject(self.id, b.as_ptr() as *const _, b.len() as u8) };
    }

    pub fn disconnect(&self) {
        // SAFETY: a connected id; errors (already down) do not matter.
        unsafe { v::rdma_disconnect(self.id) };
    }

    /// Destroys the id's QP (before the QP's CQ and PD go).
    pub fn destroy_qp(&self) {
        // SAFETY: the QP was made with rdma_create_qp on this id.
        unsafe { v::rdma_destroy_qp(self.id) }
    }

    /// The peer's port (the source port of an inbound connection).
    pub fn peer_port(&self) -> u16 {
        // SAFETY: a live id; returns the port in network order.
        u16::from_be(unsafe { v::rdma_get_dst_port(self.id) })
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: every event of this id was acknowledged when read (get_event).
        unsafe { v::rdma_destroy_id(self.id) };
    }
}

/// A protection domain on a device context. One per device for the whole process, shared by
/// every poll thread's QPs and by the app regions registered on it: an MR is usable by any QP
/// of its PD, so a QP of one thread may send from a region another thread registered.
pub struct Pd {
    ctx: *mut v::ibv_context,
    pd: *mut v::ibv_pd,
}

// SAFETY: libibverbs objects may be used from any thread, and several threads may create QPs
// and register MRs on one PD at once (libibverbs' documented multi-threaded use); the PD is
// deallocated once, by the last owner.
unsafe impl Send for Pd {}
// SAFETY: as above: every use through `&Pd` is a verbs call libibverbs makes thread-safe.
unsafe impl Sync for Pd {}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: the last reference: every QP and MR on this PD (each link's, which hold a
        // reference through their devices) is gone first.
        unsafe { v::ibv_dealloc_pd(self.pd) };
    }
}

/// The process's PDs, one per device context.
#[derive(Default)]
pub struct Pds(crate::quiet::Mutex<Vec<std::sync::Arc<Pd>>>);

impl Pds {
    /// The PD on `ctx`, allocated on first use (connection setup and start only).
    pub fn get(&self, ctx: *mut v::ibv_context) -> io::Result<std::sync::Arc<Pd>> {
        let mut l = self.0.lock();
        if let Some(pd) = l.iter().find(|p| p.ctx == ctx) {
            return Ok(pd.clone());
        }
        // SAFETY: `ctx` is a live context from librdmacm.
        let pd = unsafe { v::ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(io::Error::other(format!("ibv_alloc_pd: {}", last())));
        }
        let pd = std::sync::Arc::new(Pd { ctx, pd });
        l.push(pd.clone());
        Ok(pd)
    }
}

/// An RDMA device as rdma_cm opened it, as one poll thread uses it: the process's PD on it
/// and the thread's own CQ.
pub struct Device {
    ctx: *mut v::ibv_context,
    /// Made with the first QP on the device; dropped before the PD, which does not involve it
    /// (a CQ belongs to the context).
    cq: Option<Cq>,
    pd: std::sync::Arc<Pd>,
}

// SAFETY: as for `Cm`: one thread at a time; librdmacm owns the context, the PD is `Sync`.
unsafe impl Send for Device {}

impl Device {
    /// Every device rdma_cm knows, each with the process's PD on it.
    pub fn all(pds: &Pds) -> io::Result<Vec<Device>> {
        let mut n = 0;
        // SAFETY: returns a NULL-terminated array (or NULL) that we free below; the contexts
        // themselves stay open for the life of the process (librdmacm keeps them).
        let list = unsafe { v::rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(io::Error::other(format!("rdma_get_devices: {}", last())));
        }
        let mut out = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: `i < n` entries of the array are valid.
            let ctx = unsafe { *list.add(i) };
            if !ctx.is_null() {
                match Device::open(ctx, pds) {
                    Ok(d) => out.push(d),
                    Err(e) => tracing::warn!(error = %e, "rdma: a device without a PD"),
                }
            }
        }
        // SAFETY: the list came from rdma_get_devices and is freed once.
        unsafe { v::rdma_free_devices(list) };
        Ok(out)
    }

    /// An open context, with the process's PD on it.
    pub fn open(ctx: *mut v::ibv_context, pds: &Pds) -> io::Result<Device> {
        Ok(Device {
            ctx,
            cq: None,
            pd: pds.get(ctx)?,
        })
    }

    pub fn context(&self) -> *mut v::ibv_context {
        self.ctx
    }

    /// The device's CQ, made or grown so that it holds `entries` completions.
    pub fn cq_for(&mut self, entries: usize) -> io::Result<&Cq> {
        match &mut self.cq {
            Some(cq) => cq.grow_to(entries)?,
            None => self.cq = Some(Cq::new(self.ctx, entries)?),
        }
        Ok(self.cq.as_ref().expect("made above"))
    }

    /// The device's CQ, if a QP was ever made on it.
    pub fn cq(&self) -> Option<&Cq> {
        self.cq.as_ref()
    }
}

/// One completion queue, with its completion channel, for every QP of a device: a pass polls
/// it once whatever the number of paths, and each work request's id carries its path's tag
/// (see `super::tag`). Sized for the outstanding requests of every QP on it, grown as QPs are
/// added (an overrun would move every QP on it to the error state).
pub struct Cq {
    chan: *mut v::ibv_comp_channel,
    cq: *mut v::ibv_cq,
}

// SAFETY: as for `Cm`: one thread at a time.
unsafe impl Send for Cq {}

impl Cq {
    fn new(ctx: *mut v::ibv_context, entries: usize) -> io::Result<Cq> {
        let mut q = Cq {
            chan: ptr::null_mut(),
            cq: ptr::null_mut(),
        };
        let cqe = i32::try_from(entries).map_err(|_| io::Error::other("rdma: CQ too large"))?;
        // SAFETY: `ctx` is a live context; failures leave NULLs that Drop skips.
        unsafe {
            q.chan = v::ibv_create_comp_channel(ctx);
            if q.chan.is_null() {
                return Err(io::Error::other(format!(
                    "ibv_create_comp_channel: {}",
                    last()
                )));
            }
            set_nonblocking((*q.chan).fd)?;
            q.cq = v::ibv_create_cq(ctx, cqe, ptr::null_mut(), q.chan, 0);
            if q.cq.is_null() {
                return Err(io::Error::other(format!(
                    "ibv_create_cq({cqe}): {}",
                    last()
                )));
            }
        }
        Ok(q)
    }

    /// Completions the CQ holds (the provider may have rounded the request up).
    pub fn capacity(&self) -> usize {
        // SAFETY: a live CQ.
        unsafe { (*self.cq).cqe.max(0) as usize }
    }

    /// Grows the CQ (doubling, at least to `entries`); the completions it holds are kept.
    fn grow_to(&mut self, entries: usize) -> io::Result<()> {
        if self.capacity() >= entries {
            return Ok(());
        }
        let want = entries.max(self.capacity() * 2);
        let cqe = i32::try_from(want).map_err(|_| io::Error::other("rdma: CQ too large"))?;
        // SAFETY: a live CQ; the provider keeps its completions across the resize.
        let r = unsafe { v::ibv_resize_cq(self.cq, cqe) };
        if r != 0 {
            return Err(io::Error::other(format!(
                "rdma: cannot grow the completion queue from {} to {want} entries (too many paths on this device): {}",
                self.capacity(),
                io::Error::from_raw_os_error(r)
            )));
        }
        tracing::debug!(entries = self.capacity(), "rdma: completion queue grown");
        Ok(())
    }

    /// Polls up to `out.len()` completions (at most 32); no syscall.
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        // Not initialised: 1.5 KiB to zero on every pass, of which the provider writes what
        // it returns.
        let mut raw = [const { std::mem::MaybeUninit::<v::ibv_wc>::uninit() }; 32];
        let n = out.len().min(raw.len());
        // SAFETY: `raw` has room for `n` completions (`MaybeUninit<T>` has `T`'s layout).
        let got = unsafe { v::rdsd_ibv_poll_cq(self.cq, n as i32, raw.as_mut_ptr().cast()) };
        let got = (got.max(0) as usize).min(n);
        for (o, w) in out.iter_mut().zip(&raw[..got]) {
            // SAFETY: ibv_poll_cq wrote the first `got` entries.
            let w = unsafe { w.assume_init_ref() };
            *o = Completion {
                wr_id: w.wr_id,
                ok: w.status == v::IBV_WC_SUCCESS,
                status: w.status,
                byte_len: w.byte_len,
            };
        }
        got
    }

    /// Asks for an event on the channel at the next completion (before parking).
    pub fn arm(&self) {
        // SAFETY: a live CQ with a completion channel.
        unsafe { v::rdsd_ibv_req_notify_cq(self.cq, 0) };
    }

    /// Reads and acknowledges every event waiting on the channel (non-blocking).
    pub fn drain_channel(&self) {
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: non-blocking channel; returns -1 (EAGAIN) when empty.
            if unsafe { v::ibv_get_cq_event(self.chan, &mut cq, &mut ctx) } != 0 {
                break;
            }
            // SAFETY: one event of this CQ was just read.
            unsafe { v::ibv_ack_cq_events(cq, 1) };
        }
    }

    /// The completion channel's descriptor.
    pub fn channel_fd(&self) -> i32 {
        // SAFETY: the channel is live.
        unsafe { (*self.chan).fd }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP on it is gone (the link drops its paths before its devices); each
        // object is destroyed once, the CQ before its channel.
        unsafe {
            if !self.cq.is_null() {
                v::ibv_destroy_cq(self.cq);
            }
            if !self.chan.is_null() {
                v::ibv_destroy_comp_channel(self.chan);
            }
        }
    }
}

/// A memory region registered for local reads by the device (an app's region, sent from in
/// place). Deregistered on drop.
pub struct Mr {
    mr: *mut v::ibv_mr,
}

// SAFETY: as for `Cm`.
unsafe impl Send for Mr {}

impl Mr {
    /// Registers `base..base + len` on `dev` for sends (no remote access, no local writes:
    /// the device only reads it).
    pub fn register(dev: &Device, base: *const u8, len: usize) -> io::Result<Mr> {
        // SAFETY: the caller keeps the range mapped until the Mr is dropped (the poll core
        // unmaps an app region only after `region_detached`); access 0 = local read only.
        let mr = unsafe { v::ibv_reg_mr(dev.pd.pd, base as *mut _, len, 0) };
        if mr.is_null() {
            return Err(io::Error::other(format!("ibv_reg_mr: {}", last())));
        }
        Ok(Mr { mr })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr).lkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; no send from it is in flight (a message
        // sent in place is released only after its send completed).
        unsafe { v::ibv_dereg_mr(self.mr) };
    }
}

/// One path's verbs resources: registered slots and the RC QP (on its device's shared PD and
/// CQ).
///
/// Slots: `0..recv_n` receive buffers, then `send_n` send slots, then one ACK slot.
pub struct Qp {
    ctx: *mut v::ibv_context,
    mr: *mut v::ibv_mr,
    qp: *mut v::ibv_qp,
    mem: *mut u8,
    len: usize,
    recv_n: u32,
    send_n: u32,
    /// ORed into every work request id: names the path on the shared CQ.
    tag: u64,
}

// SAFETY: as for `Cm`: one thread at a time; the memory is owned by this struct.
unsafe impl Send for Qp {}

impl Qp {
    /// The device `id` resolved to (or arrived on).
    pub fn device_of(id: &CmId) -> io::Result<*mut v::ibv_context> {
        // SAFETY: `id` is live and bound to a device after address resolution or a request.
        let verbs = unsafe { (*id.id).verbs };
        if verbs.is_null() {
            return Err(io::Error::other("rdma: id has no device"));
        }
        Ok(verbs)
    }

    /// Work requests one QP can have outstanding (its share of the device's CQ).
    pub fn completions_needed(recv_n: u32, send_n: u32) -> usize {
        (recv_n + send_n + 1) as usize
    }

    /// Creates the resources on `dev`, the device `id` is bound to, completing on `cq` (the
    /// device's), with `tag` in every work request id.
    pub fn new(
        id: &CmId,
        dev: &Device,
        cq: &Cq,
        recv_n: u32,
        send_n: u32,
        tag: u64,
    ) -> io::Result<Qp> {
        let verbs = dev.ctx;
        let nslots = (recv_n + send_n + 1) as usize;
        let len = nslots * SLOT;
        let mem = Box::into_raw(vec![0u8; len].into_boxed_slice()) as *mut u8;
        let mut q = Qp {
            ctx: verbs,
            mr: ptr::null_mut(),
            qp: ptr::null_mut(),
            mem,
            len,
            recv_n,
            send_n,
            tag,
        };
        // SAFETY: each call gets live objects made just before; failures leave NULLs that
        // Drop skips.
        unsafe {
            q.mr = v::ibv_reg_mr(
                dev.pd.pd,
                mem as *mut _,
                len,
                v::IBV_ACCESS_LOCAL_WRITE as i32,
            );
            if q.mr.is_null() {
                return Err(io::Error::other(format!("ibv_reg_mr: {}", last())));
            }
            let mut attr = v::ibv_qp_init_attr {
                send_cq: cq.cq,
                recv_cq: cq.cq,
                qp_type: v::IBV_QPT_RC,
                sq_sig_all: 0,
                ..Default::default()
            };
            attr.cap.max_send_wr = send_n + 1;
            attr.cap.max_recv_wr = recv_n;
            // A fragment sent in place: [header from a send slot][payload in the app's region].
            attr.cap.max_send_sge = 2;
            attr.cap.max_recv_sge = 1;
            check(
                v::rdma_create_qp(id.id, dev.pd.pd, &mut attr),
                "rdma_create_qp",
            )?;
            q.qp = (*id.id).qp;
        }
        Ok(q)
    }

    fn addr(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize + 1) * SLOT <= self.len);
        // SAFETY: in bounds of our allocation (slot < recv_n + send_n + 1).
        unsafe { self.mem.add(slot as usize * SLOT) }
    }

    /// A completed receive slot's bytes (not posted: the device does not write it now).
    pub fn slot(&self, recv: u32) -> &[u8] {
        assert!(recv < self.recv_n);
        // SAFETY: in bounds; the slot is not posted while the caller reads it.
        unsafe { std::slice::from_raw_parts(self.addr(recv), SLOT) }
    }

    /// A free send slot, to fill.
    pub fn slot_mut(&mut self, send: u32) -> &mut [u8] {
        assert!(send < self.send_n);
        // SAFETY: in bounds; a free send slot is not being sent by the device.
        unsafe { std::slice::from_raw_parts_mut(self.addr(self.recv_n + send), SLOT) }
    }

    /// The ACK-only frame's slot (one in flight at a time).
    pub fn ack_slot_mut(&mut self) -> &mut [u8] {
        // SAFETY: in bounds; not in flight (the caller checks `ack_inflight`).
        unsafe { std::slice::from_raw_parts_mut(self.addr(self.recv_n + self.send_n), super::HDR) }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr).lkey }
    }

    pub fn post_recv(&self, recv: u32) -> io::Result<()> {
        let mut sge = v::ibv_sge {
            addr: self.addr(recv) as u64,
            length: SLOT as u32,
            lkey: self.lkey(),
        };
        let mut wr = v::ibv_recv_wr {
            wr_id: u64::from(recv) | self.tag,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the WR and SGE live for the call (the provider copies them); the buffer is
        // registered and stays allocated until the QP is destroyed.
        let r = unsafe { v::rdsd_ibv_post_recv(self.qp, &mut wr, &mut bad) };
        check(r, "ibv_post_recv")
    }

    /// Posts a SEND of `bytes` from `slot`, followed by `extra` (address, length, lkey of a
    /// registered app region) when the payload is sent in place.
    fn post(
        &self,
        wr_id: u64,
        slot: u32,
        bytes: u32,
        extra: Option<(u64, u32, u32)>,
    ) -> io::Result<()> {
        let mut sge = [
            v::ibv_sge {
                addr: self.addr(slot) as u64,
                length: bytes,
                lkey: self.lkey(),
            },
            v::ibv_sge::default(),
        ];
        let mut n = 1;
        if let Some((addr, length, lkey)) = extra.filter(|e| e.1 > 0) {
            sge[1] = v::ibv_sge { addr, length, lkey };
            n = 2;
        }
        let mut wr = v::ibv_send_wr {
            wr_id: wr_id | self.tag,
            sg_list: sge.as_mut_ptr(),
            num_sge: n,
            opcode: v::IBV_WR_SEND,
            send_flags: v::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        let mut bad = ptr::null_mut();
        // SAFETY: as for post_recv; the slot and the app bytes stay untouched until the
        // completion (the app region is registered and its ring space held until release).
        let r = unsafe { v::rdsd_ibv_post_send(self.qp, &mut wr, &mut bad) };
        check(r, "ibv_post_send")
    }

    pub fn post_send(
        &self,
        wr_id: u64,
        send: u32,
        bytes: u32,
        extra: Option<(u64, u32, u32)>,
    ) -> io::Result<()> {
        self.post(wr_id, self.recv_n + send, bytes, extra)
    }

    pub fn post_ack(&self, wr_id: u64) -> io::Result<()> {
        self.post(wr_id, self.recv_n + self.send_n, super::HDR as u32, None)
    }

    /// The device this QP is on.
    pub fn context(&self) -> *mut v::ibv_context {
        self.ctx
    }

    /// Moves the QP to the error state: every posted work request completes with a flush
    /// error, as after a fatal transport error (the fault-injection hook of the tests).
    pub fn force_error(&self) -> io::Result<()> {
        let mut attr = v::ibv_qp_attr {
            qp_state: v::IBV_QPS_ERR,
            ..Default::default()
        };
        // SAFETY: a live QP; the attribute struct lives for the call.
        let r = unsafe { v::ibv_modify_qp(self.qp, &mut attr, v::IBV_QP_STATE as i32) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(r))
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP itself was destroyed by the owner (`CmId::destroy_qp`) before; the MR
        // is deregistered once; the memory is ours; the PD and CQ are the device's (the link
        // drops them after every path).
        unsafe {
            if !self.mr.is_null() {
                v::ibv_dereg_mr(self.mr);
            }
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.mem, self.len,
            )));
        }
    }
}

impl QueuePair for Qp {
    fn recv_slot(&self, slot: u32) -> &[u8] {
        self.slot(slot)
    }

    fn send_slot_mut(&mut self, slot: u32) -> &mut [u8] {
        self.slot_mut(slot)
    }

    fn ack_slot_mut(&mut self) -> &mut [u8] {
        Qp::ack_slot_mut(self)
    }

    fn post_recv(&mut self, slot: u32) -> io::Result<()> {
        Qp::post_recv(self, slot)
    }

    fn post_send(
        &mut self,
        wr_id: u64,
        slot: u32,
        bytes: u32,
        extra: Option<InPlaceSge>,
    ) -> io::Result<()> {
        Qp::post_send(
            self,
            wr_id,
            slot,
            bytes,
            extra.map(|e| (e.addr, e.len, e.lkey)),
        )
    }

    fn post_ack(&mut self, wr_id: u64) -> io::Result<()> {
        Qp::post_ack(self, wr_id)
    }
}

#[cfg(test)]
mod tests {
    use super::CmContext;

    #[test]
    fn an_ids_context_word_names_its_thread_slot_and_generation() {
        for (shard, idx, gen) in [(0, 0, 1), (1, 65_535, u32::MAX), (255, 7, 0x8000_0001)] {
            let c = CmContext { shard, idx, gen };
            assert_ne!(c.word(), 0, "0 means no context");
            assert_eq!(CmContext::from_word(c.word()), Some(c));
        }
        assert_eq!(CmContext::from_word(0), None);
    }
}
