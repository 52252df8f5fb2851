//! One small error-returning function per verbs call, in the manner of cudarc's `result` module:
//! each takes handles (which carry the [`Verbs`] table that made them, so a call can never reach
//! another library's objects), holds the `unsafe` of its one FFI call
//! with the contract written next to it, and turns the C convention (NULL and `errno`, a returned
//! errno, a negative count) into `Result<_, VerbsError>`. [`VerbsError`] is small and `Copy` (the
//! call's name and its errno), so the data-path calls (`post_send`, `poll_cq`) allocate nothing;
//! the owning types in `dev.rs` turn it into the crate's [`Error`] with the device or QP named
//! ([`VerbsError::on`]).
//!
//! The handles ([`Context`], [`Pd`], [`Mr`], [`Cq`], [`CompChannel`], [`Qp`]) are made only here,
//! by a successful create call, and are neither `Copy` nor `Clone`: holding one means the object
//! exists until its destroy call, which is `unsafe` because the caller must promise the handle is
//! not used again (and, for a parent, that no child handle is). Every other call taking a handle
//! is safe. Registering host memory ([`reg_mr`]) stays `unsafe`: the NIC may read and write the
//! range until the MR is deregistered.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::fmt;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use super::abi::*;
use super::{DeviceList, Verbs};
use crate::error::{Error, ErrorKind};

/// Why a verbs call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    /// The call failed with this `errno` (0: it set none).
    Errno(c_int),
    /// The call returned this negative value (`ibv_poll_cq`).
    Returned(c_int),
    /// The provider's ops table has no entry for the call.
    NotProvided,
    /// The arguments were refused before the call (a work request this layer does not post,
    /// objects of another library).
    Refused(&'static str),
}

/// A failed verbs call: its name and why. Convert with [`VerbsError::on`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VerbsError {
    /// The libibverbs function, e.g. `"ibv_modify_qp"`.
    pub(crate) call: &'static str,
    /// Why it failed.
    pub(crate) cause: Cause,
}

impl VerbsError {
    fn errno(call: &'static str, errno: c_int) -> Self {
        VerbsError { call, cause: Cause::Errno(errno) }
    }

    /// The `errno` of the failure, if the call set one.
    pub(crate) fn os_error(&self) -> Option<c_int> {
        match self.cause {
            Cause::Errno(e) if e != 0 => Some(e),
            _ => None,
        }
    }

    /// The crate's error for this failure: kind `Ib`, message `"<call><detail>"` (`detail` such
    /// as `"(RTR) on QP 7 on mlx5_0 port 1"`), and for an `errno` an [`std::io::Error`] cause, so
    /// the text ends in e.g. `": Invalid argument (os error 22) (IB error)"` and the number stays
    /// readable from the error.
    #[cold]
    pub(crate) fn on(self, detail: impl fmt::Display) -> Error {
        let what = format!("{}{detail}", self.call);
        match self.cause {
            Cause::Errno(0) => Error::new(ErrorKind::Ib, format!("{what}: failed without setting errno")),
            Cause::Errno(e) => Error::new(ErrorKind::Ib, what).with_source(std::io::Error::from_raw_os_error(e)),
            Cause::Returned(n) => Error::new(ErrorKind::Ib, format!("{what}: failed (returned {n})")),
            Cause::NotProvided => Error::new(ErrorKind::Ib, format!("{what}: the provider does not implement it")),
            Cause::Refused(why) => Error::new(ErrorKind::Ib, format!("{what}: refused before the call: {why}")),
        }
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cause {
            Cause::Errno(0) => write!(f, "{} failed without setting errno", self.call),
            Cause::Errno(e) => write!(f, "{}: {} (errno {e})", self.call, std::io::Error::from_raw_os_error(e)),
            Cause::Returned(n) => write!(f, "{} failed (returned {n})", self.call),
            Cause::NotProvided => write!(f, "{}: the provider does not implement it", self.call),
            Cause::Refused(why) => write!(f, "{}: refused before the call: {why}", self.call),
        }
    }
}

/// Result of one verbs call.
pub(crate) type VResult<T> = std::result::Result<T, VerbsError>;

fn last_errno() -> c_int {
    nix::errno::Errno::last_raw()
}

fn clear_errno() {
    nix::errno::Errno::clear();
}

/// A call returning 0 or an errno (the rdma-core convention); some providers return -1 and set
/// errno instead.
#[inline]
fn check_rc(call: &'static str, rc: c_int) -> VResult<()> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::errno(call, rc)),
        _ => Err(VerbsError::errno(call, last_errno())),
    }
}

/// A call returning an object or NULL with errno.
fn check_ptr<T>(call: &'static str, p: *mut T) -> VResult<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| VerbsError::errno(call, last_errno()))
}

macro_rules! handle {
    ($(#[$m:meta])* $name:ident, $raw:ty) => {
        $(#[$m])*
        /// It keeps the library that made it, so every later call goes to the same one.
        pub(crate) struct $name(NonNull<$raw>, &'static Verbs);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_tuple(stringify!($name)).field(&self.0).finish()
            }
        }

        // SAFETY: libibverbs objects may be used from any thread (the library is thread safe and
        // locks internally where it must); the handle is only an address and owns nothing that
        // is tied to the creating thread.
        unsafe impl Send for $name {}
        // SAFETY: as above; every call through `&handle` is one the library allows concurrently.
        unsafe impl Sync for $name {}

        impl $name {
            /// The raw object (to compare with what a call hands back, or to pass to the library).
            #[inline]
            pub(crate) fn as_ptr(&self) -> *mut $raw {
                self.0.as_ptr()
            }
        }
    };
}

handle!(
    /// An open device context (`ibv_context`), from [`open_device`].
    Context,
    ibv_context
);
handle!(
    /// A protection domain, from [`alloc_pd`].
    Pd,
    ibv_pd
);
handle!(
    /// A memory region, from [`reg_mr`] or [`reg_dmabuf_mr`].
    Mr,
    ibv_mr
);
handle!(
    /// A completion channel, from [`create_comp_channel`].
    CompChannel,
    ibv_comp_channel
);
handle!(
    /// A completion queue, from [`create_cq`].
    Cq,
    ibv_cq
);
handle!(
    /// A queue pair, from [`create_qp`].
    Qp,
    ibv_qp
);

impl Mr {
    /// `(lkey, rkey)`.
    #[inline]
    pub(crate) fn keys(&self) -> (u32, u32) {
        // SAFETY: the MR is registered (the handle exists), so the struct the library returned
        // is live; the keys are plain integers it never changes.
        unsafe { ((*self.as_ptr()).lkey, (*self.as_ptr()).rkey) }
    }
}

impl Cq {
    /// The number of entries the provider granted (at least what was asked).
    pub(crate) fn cqe(&self) -> c_int {
        // SAFETY: the CQ exists (the handle does); cqe is set at creation.
        unsafe { (*self.as_ptr()).cqe }
    }

    /// The context's ops table entry for `poll_cq`, `req_notify_cq`, ...
    #[inline]
    fn ops(&self) -> &ibv_context_ops {
        // SAFETY: the CQ exists, and so does its context (closing the context is `unsafe` and
        // requires every child handle gone); the provider filled the ops table at open and never
        // changes it while the context is open.
        unsafe { &(*(*self.as_ptr()).context).ops }
    }
}

impl Qp {
    /// The QP number.
    pub(crate) fn num(&self) -> u32 {
        // SAFETY: the QP exists (the handle does); qp_num is set at creation.
        unsafe { (*self.as_ptr()).qp_num }
    }

    #[inline]
    fn ops(&self) -> &ibv_context_ops {
        // SAFETY: as for `Cq::ops`.
        unsafe { &(*(*self.as_ptr()).context).ops }
    }
}

impl CompChannel {
    /// The channel's file descriptor (readable when an armed CQ has an event).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel exists (the handle does) and owns its fd until it is destroyed,
        // which cannot happen while this borrow of the handle lives.
        unsafe { BorrowedFd::borrow_raw((*self.as_ptr()).fd) }
    }
}

/// `ibv_open_device` on the device called `name` in `list`; `None` when the list has no such
/// device.
pub(crate) fn open_device(list: &DeviceList, name: &str) -> Option<VResult<Context>> {
    let v = list.v;
    let dev = list.find(name)?;
    clear_errno();
    // SAFETY: dev is a device of `list`, which is live for this call (borrowed); the context the
    // call opens does not depend on the list staying alive.
    let ctx = unsafe { (v.open_device)(dev) };
    Some(check_ptr("ibv_open_device", ctx).map(|p| Context(p, v)))
}

/// `ibv_close_device`.
///
/// # Safety
/// Every PD, CQ, channel, MR and QP made from `ctx` is destroyed, and `ctx` is not used again.
pub(crate) unsafe fn close_device(ctx: &Context) -> VResult<()> {
    let v = ctx.1;
    // SAFETY: the caller's contract; ctx came from ibv_open_device.
    check_rc("ibv_close_device", unsafe { (v.close_device)(ctx.as_ptr()) })
}

/// `ibv_query_device`.
pub(crate) fn query_device(ctx: &Context) -> VResult<ibv_device_attr> {
    let v = ctx.1;
    // SAFETY: all-zero bytes are a valid ibv_device_attr (integers and byte arrays only).
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is open (the handle exists); attr is a valid out-pointer of verbs.h's layout
    // (checked against the header by `abi_matches_the_system_header`).
    check_rc("ibv_query_device", unsafe { (v.query_device)(ctx.as_ptr(), &mut attr) })?;
    Ok(attr)
}

/// `ibv_query_port`.
pub(crate) fn query_port(ctx: &Context, port: u8) -> VResult<ibv_port_attr> {
    let v = ctx.1;
    // SAFETY: all-zero bytes are a valid ibv_port_attr (integers only).
    let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is open; a is a valid out-pointer. The exported ibv_query_port fills at most
    // the compat (older, smaller) layout, which ours contains.
    check_rc("ibv_query_port", unsafe { (v.query_port)(ctx.as_ptr(), port, &mut a) })?;
    Ok(a)
}

/// `ibv_query_gid`: the raw GID at `index` of `port`.
pub(crate) fn query_gid(ctx: &Context, port: u8, index: u32) -> VResult<[u8; 16]> {
    let v = ctx.1;
    let mut g = ibv_gid { raw: [0; 16] };
    let index = c_int::try_from(index).map_err(|_| VerbsError::errno("ibv_query_gid", libc_einval()))?;
    // SAFETY: ctx is open; g is a valid out-pointer.
    check_rc("ibv_query_gid", unsafe { (v.query_gid)(ctx.as_ptr(), port, index, &mut g) })?;
    Ok(g.raw)
}

fn libc_einval() -> c_int {
    nix::errno::Errno::EINVAL as c_int
}

/// `ibv_alloc_pd`.
pub(crate) fn alloc_pd(ctx: &Context) -> VResult<Pd> {
    let v = ctx.1;
    clear_errno();
    // SAFETY: ctx is open.
    check_ptr("ibv_alloc_pd", unsafe { (v.alloc_pd)(ctx.as_ptr()) }).map(|p| Pd(p, v))
}

/// `ibv_dealloc_pd`.
///
/// # Safety
/// Every MR and QP of `pd` is destroyed, and `pd` is not used again.
pub(crate) unsafe fn dealloc_pd(pd: &Pd) -> VResult<()> {
    let v = pd.1;
    // SAFETY: the caller's contract; pd came from ibv_alloc_pd.
    check_rc("ibv_dealloc_pd", unsafe { (v.dealloc_pd)(pd.as_ptr()) })
}

/// `ibv_reg_mr` of `[addr, addr + len)` with `access` (`IBV_ACCESS_*`).
///
/// # Safety
/// The range is memory that stays valid (mapped, not freed or reused for Rust objects the NIC
/// must not touch) until the returned MR is deregistered: the NIC reads and, with write access,
/// writes it on its own, on behalf of this process and of peers holding the rkey.
pub(crate) unsafe fn reg_mr(pd: &Pd, addr: u64, len: usize, access: c_uint) -> VResult<Mr> {
    let v = pd.1;
    clear_errno();
    // SAFETY: pd is live; the range is the caller's contract.
    let mr = unsafe { (v.reg_mr)(pd.as_ptr(), addr as *mut c_void, len, access as c_int) };
    check_ptr("ibv_reg_mr", mr).map(|p| Mr(p, v))
}

/// `ibv_reg_dmabuf_mr`: `len` bytes at `offset` of the dma-buf `fd`, seen at address `iova`.
/// `NotProvided` where the library predates it (rdma-core 34).
pub(crate) fn reg_dmabuf_mr(pd: &Pd, offset: u64, len: usize, iova: u64, fd: c_int, access: c_uint) -> VResult<Mr> {
    let v = pd.1;
    let Some(f) = v.reg_dmabuf_mr else {
        return Err(VerbsError { call: "ibv_reg_dmabuf_mr", cause: Cause::NotProvided });
    };
    clear_errno();
    // SAFETY: pd is live. Any fd value may be passed: the kernel looks it up (EBADF if closed),
    // checks that it is a dma-buf and that the range lies in it, and takes its own reference to
    // the buffer, so the NIC only ever reaches the exporter's pages, which the exporter keeps (or
    // revokes) itself.
    let mr = unsafe { f(pd.as_ptr(), offset, len, iova, fd, access as c_int) };
    check_ptr("ibv_reg_dmabuf_mr", mr).map(|p| Mr(p, v))
}

/// `ibv_dereg_mr`.
///
/// # Safety
/// `mr` is not used again.
pub(crate) unsafe fn dereg_mr(mr: &Mr) -> VResult<()> {
    let v = mr.1;
    // SAFETY: the caller's contract; mr came from ibv_reg_mr or ibv_reg_dmabuf_mr. Work requests
    // still naming its keys fail with an error completion, never touch memory.
    check_rc("ibv_dereg_mr", unsafe { (v.dereg_mr)(mr.as_ptr()) })
}

/// `ibv_create_comp_channel`.
pub(crate) fn create_comp_channel(ctx: &Context) -> VResult<CompChannel> {
    let v = ctx.1;
    clear_errno();
    // SAFETY: ctx is open.
    check_ptr("ibv_create_comp_channel", unsafe { (v.create_comp_channel)(ctx.as_ptr()) }).map(|p| CompChannel(p, v))
}

/// `ibv_destroy_comp_channel`.
///
/// # Safety
/// No CQ using `ch` remains, every event taken from it was acknowledged, and `ch` is not used
/// again.
pub(crate) unsafe fn destroy_comp_channel(ch: &CompChannel) -> VResult<()> {
    let v = ch.1;
    // SAFETY: the caller's contract; ch came from ibv_create_comp_channel.
    check_rc("ibv_destroy_comp_channel", unsafe { (v.destroy_comp_channel)(ch.as_ptr()) })
}

/// `ibv_create_cq` with at least `cqe` entries, raising events on `channel` if given.
///
/// The caller keeps `channel` until the CQ is destroyed (its destroy is `unsafe` and says so).
pub(crate) fn create_cq(ctx: &Context, cqe: c_int, channel: Option<&CompChannel>) -> VResult<Cq> {
    let v = ctx.1;
    if channel.is_some_and(|c| !std::ptr::eq(v, c.1)) {
        return Err(VerbsError { call: "ibv_create_cq", cause: Cause::Refused("a channel of another library") });
    }
    let ch = channel.map_or(std::ptr::null_mut(), CompChannel::as_ptr);
    clear_errno();
    // SAFETY: ctx is open; ch is null or a live channel of this context; no CQ context pointer
    // and vector 0.
    let cq = unsafe { (v.create_cq)(ctx.as_ptr(), cqe, std::ptr::null_mut(), ch, 0) };
    check_ptr("ibv_create_cq", cq).map(|p| Cq(p, v))
}

/// `ibv_destroy_cq`.
///
/// # Safety
/// No QP using `cq` remains, every event for it was acknowledged, and `cq` is not used again.
pub(crate) unsafe fn destroy_cq(cq: &Cq) -> VResult<()> {
    let v = cq.1;
    // SAFETY: the caller's contract; cq came from ibv_create_cq.
    check_rc("ibv_destroy_cq", unsafe { (v.destroy_cq)(cq.as_ptr()) })
}

/// `ibv_req_notify_cq`: an event on the channel for the next completion (all of them unless
/// `solicited_only`).
#[inline]
pub(crate) fn req_notify_cq(cq: &Cq, solicited_only: bool) -> VResult<()> {
    let Some(f) = cq.ops().req_notify_cq else {
        return Err(VerbsError { call: "ibv_req_notify_cq", cause: Cause::NotProvided });
    };
    // SAFETY: cq is live; f is its provider's entry.
    check_rc("ibv_req_notify_cq", unsafe { f(cq.as_ptr(), solicited_only as c_int) })
}

/// `ibv_get_cq_event`: takes one event (blocking until there is one) and returns the CQ it is for,
/// as a raw pointer to compare with [`Cq::as_ptr`]. Acknowledge it with [`ack_cq_events`].
pub(crate) fn get_cq_event(ch: &CompChannel) -> VResult<*mut ibv_cq> {
    let v = ch.1;
    let mut cq: *mut ibv_cq = std::ptr::null_mut();
    let mut ctx: *mut c_void = std::ptr::null_mut();
    clear_errno();
    // SAFETY: ch is live; cq and ctx are valid out-pointers.
    check_rc("ibv_get_cq_event", unsafe { (v.get_cq_event)(ch.as_ptr(), &mut cq, &mut ctx) })?;
    Ok(cq)
}

/// `ibv_ack_cq_events`: acknowledges `n` events taken for `cq`.
pub(crate) fn ack_cq_events(cq: &Cq, n: u32) {
    let v = cq.1;
    // SAFETY: cq is live. Acknowledging more events than were taken only makes a later
    // ibv_destroy_cq wait; it touches no memory it should not.
    unsafe { (v.ack_cq_events)(cq.as_ptr(), n) }
}

/// `ibv_poll_cq`: takes up to `out.len()` completions into `out`; returns how many.
#[inline]
pub(crate) fn poll_cq(cq: &Cq, out: &mut [ibv_wc]) -> VResult<usize> {
    let Some(f) = cq.ops().poll_cq else {
        return Err(VerbsError { call: "ibv_poll_cq", cause: Cause::NotProvided });
    };
    let n = out.len().min(c_int::MAX as usize) as c_int;
    // SAFETY: cq is live; out is valid for n entries of verbs.h's ibv_wc layout.
    let got = unsafe { f(cq.as_ptr(), n, out.as_mut_ptr()) };
    if got < 0 {
        return Err(VerbsError { call: "ibv_poll_cq", cause: Cause::Returned(got) });
    }
    Ok(got as usize)
}

/// `ibv_create_qp` of an RC queue pair in `pd` with capacities `cap`, no SRQ. Only RC QPs are
/// made here, which [`post_send`]'s safety relies on (a UD QP's provider reads an address-handle
/// pointer out of the work request).
///
/// The caller keeps the CQs until the QP is destroyed (their destroy is `unsafe` and says so).
pub(crate) fn create_qp(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, cap: ibv_qp_cap) -> VResult<Qp> {
    let v = pd.1;
    if !std::ptr::eq(v, send_cq.1) || !std::ptr::eq(v, recv_cq.1) {
        return Err(VerbsError { call: "ibv_create_qp", cause: Cause::Refused("CQs of another library") });
    }
    let mut init = ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: send_cq.as_ptr(),
        recv_cq: recv_cq.as_ptr(),
        srq: std::ptr::null_mut(),
        cap,
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
    };
    clear_errno();
    // SAFETY: pd and both CQs are live (their handles are borrowed); init is a valid attribute
    // struct with no SRQ.
    check_ptr("ibv_create_qp", unsafe { (v.create_qp)(pd.as_ptr(), &mut init) }).map(|p| Qp(p, v))
}

/// `ibv_modify_qp` with the fields of `attr` that `mask` (`IBV_QP_*`) selects.
pub(crate) fn modify_qp(qp: &Qp, attr: &mut ibv_qp_attr, mask: c_int) -> VResult<()> {
    let v = qp.1;
    // SAFETY: qp is live; attr is a valid attribute struct (plain data).
    check_rc("ibv_modify_qp", unsafe { (v.modify_qp)(qp.as_ptr(), attr, mask) })
}

/// `ibv_destroy_qp`.
///
/// # Safety
/// `qp` is not used again.
pub(crate) unsafe fn destroy_qp(qp: &Qp) -> VResult<()> {
    let v = qp.1;
    // SAFETY: the caller's contract; qp came from ibv_create_qp.
    check_rc("ibv_destroy_qp", unsafe { (v.destroy_qp)(qp.as_ptr()) })
}

/// `IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED`: the flags [`post_send`] lets
/// through (not `IBV_SEND_INLINE`, which makes the CPU read the SGE's address).
const SAFE_SEND_FLAGS: c_uint = 1 | IBV_SEND_SIGNALED | (1 << 2);

/// `ibv_post_send` of `wrs` as one list, `wrs[i]` with `sges[i]` as its scatter entry when its
/// `num_sge` is 1 (0 for none). This links the list itself (`next`, `sg_list`), so the pointers in
/// it are always right. Only RDMA WRITE, WRITE_WITH_IMM and FETCH_AND_ADD without
/// `IBV_SEND_INLINE` go through: for those the NIC checks every address against the keys' MRs (a
/// bad one is an error completion, never a stray access); anything else is refused before the
/// call, as is `sges.len() != wrs.len()`.
#[inline]
pub(crate) fn post_send(qp: &Qp, wrs: &mut [ibv_send_wr], sges: &mut [ibv_sge]) -> VResult<()> {
    const CALL: &str = "ibv_post_send";
    let refused = |why| Err(VerbsError { call: CALL, cause: Cause::Refused(why) });
    if wrs.is_empty() {
        return Ok(());
    }
    if sges.len() != wrs.len() {
        return refused("one scatter entry per work request is needed");
    }
    let Some(f) = qp.ops().post_send else {
        return Err(VerbsError { call: CALL, cause: Cause::NotProvided });
    };
    let n = wrs.len();
    let base = wrs.as_mut_ptr();
    let sbase = sges.as_mut_ptr();
    for i in 0..n {
        // SAFETY: i < n = wrs.len(), so base + i is an element of wrs (exclusively borrowed).
        let w = unsafe { &mut *base.add(i) };
        if !matches!(w.opcode, IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_ATOMIC_FETCH_AND_ADD) {
            return refused("only RDMA WRITE, WRITE_WITH_IMM and FETCH_AND_ADD are posted");
        }
        if w.send_flags & !SAFE_SEND_FLAGS != 0 {
            return refused("send flags other than FENCE, SIGNALED and SOLICITED");
        }
        w.sg_list = match w.num_sge {
            0 => std::ptr::null_mut(),
            // SAFETY: i < n = sges.len(), so sbase + i is an element of sges.
            1 => unsafe { sbase.add(i) },
            _ => return refused("at most one scatter entry per work request"),
        };
        // SAFETY: i + 1 < n, so base + i + 1 is an element of wrs.
        w.next = if i + 1 < n { unsafe { base.add(i + 1) } } else { std::ptr::null_mut() };
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: qp is a live RC QP (the only kind create_qp makes); base is a list of n WRs linked
    // above, each pointing only into wrs and sges (both borrowed until this returns), with
    // opcodes and flags for which an RC provider reads nothing else from this process's memory;
    // bad is a valid out-pointer.
    check_rc(CALL, unsafe { f(qp.as_ptr(), base, &mut bad) })
}

/// `ibv_post_recv` of one receive with scatter entry `sge` (`None`: no entry, for
/// write-with-immediate). The NIC checks the entry against its key's MR.
#[inline]
pub(crate) fn post_recv(qp: &Qp, wr_id: u64, sge: Option<ibv_sge>) -> VResult<()> {
    let Some(f) = qp.ops().post_recv else {
        return Err(VerbsError { call: "ibv_post_recv", cause: Cause::NotProvided });
    };
    let mut sge = sge;
    let (sg_list, num_sge) = match sge.as_mut() {
        Some(s) => (s as *mut ibv_sge, 1),
        None => (std::ptr::null_mut(), 0),
    };
    let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list, num_sge };
    let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
    // SAFETY: qp is live; wr is a one-element list whose sg_list is null or the local sge (live
    // until this returns); bad is a valid out-pointer.
    check_rc("ibv_post_recv", unsafe { f(qp.as_ptr(), &mut wr, &mut bad) })
}

/// `ibv_wc_status_str`: the library's text for a completion status.
pub(crate) fn wc_status_str(v: &Verbs, status: u32) -> Option<&'static CStr> {
    // SAFETY: ibv_wc_status_str accepts any value and returns a static string or null.
    let p = unsafe { (v.wc_status_str)(status) };
    // SAFETY: non-null, static and NUL-terminated (libibverbs' contract).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_call_and_errno() {
        let e = VerbsError::errno("ibv_modify_qp", 22).on("(RTR) on mlx5_0");
        assert_eq!(e.kind(), ErrorKind::Ib);
        let s = e.to_string();
        assert!(s.starts_with("ibv_modify_qp(RTR) on mlx5_0: "), "{s}");
        assert!(s.contains("os error 22"), "{s}");
        assert_eq!(VerbsError::errno("x", 22).os_error(), Some(22));
        assert_eq!(VerbsError::errno("x", 0).os_error(), None);
        let s = VerbsError::errno("ibv_alloc_pd", 0).on(" on d").to_string();
        assert!(s.contains("ibv_alloc_pd on d: failed without setting errno"), "{s}");
        let s = VerbsError { call: "ibv_poll_cq", cause: Cause::Returned(-2) }.on(" on d").to_string();
        assert!(s.contains("ibv_poll_cq on d: failed (returned -2)"), "{s}");
        let s = VerbsError { call: "ibv_poll_cq", cause: Cause::NotProvided }.on(" on d").to_string();
        assert!(s.contains("ibv_poll_cq on d: the provider does not implement it"), "{s}");
        assert_eq!(
            VerbsError::errno("ibv_post_send", 12).to_string(),
            format!("ibv_post_send: {} (errno 12)", std::io::Error::from_raw_os_error(12))
        );
    }

    /// Every wrapper against the in-process provider (its table passed directly, so nothing is
    /// installed for the process): successes hand back live handles, failures name the call and
    /// carry the provider's errno, and `post_send` refuses what it cannot post safely before
    /// calling the provider.
    #[cfg(feature = "ib-fake")]
    #[test]
    fn wrappers_against_the_test_provider() {
        use super::super::fake;
        static V: std::sync::OnceLock<Verbs> = std::sync::OnceLock::new();
        let v: &'static Verbs = V.get_or_init(fake::table);
        fake::add_device("vres0");
        let list = DeviceList::of(v).unwrap();
        assert!(open_device(&list, "no-such-device").is_none());
        let ctx = open_device(&list, "vres0").unwrap().unwrap();
        drop(list);
        let attr = query_device(&ctx).unwrap();
        assert!(attr.max_qp_wr > 0 && attr.phys_port_cnt >= 1);
        assert_eq!(query_port(&ctx, 1).unwrap().state, IBV_PORT_ACTIVE);
        assert_eq!(query_port(&ctx, 9).err(), Some(VerbsError::errno("ibv_query_port", 22)));
        assert_ne!(query_gid(&ctx, 1, 0).unwrap(), [0; 16]);
        let pd = alloc_pd(&ctx).unwrap();

        // SAFETY: an empty range at address 0: nothing for the NIC to reach (and it is refused).
        let e = unsafe { reg_mr(&pd, 0, 0, IBV_ACCESS_LOCAL_WRITE) }.unwrap_err();
        assert_eq!(e, VerbsError::errno("ibv_reg_mr", 22));
        let mem = vec![0u64; 4];
        // SAFETY: mem outlives the MR (deregistered below, before mem drops).
        let mr = unsafe { reg_mr(&pd, mem.as_ptr() as u64, 32, IBV_ACCESS_LOCAL_WRITE) }.unwrap();
        let (lkey, _) = mr.keys();

        assert_eq!(create_cq(&ctx, 0, None).unwrap_err(), VerbsError::errno("ibv_create_cq", 22));
        let ch = create_comp_channel(&ctx).unwrap();
        let cq = create_cq(&ctx, 16, Some(&ch)).unwrap();
        assert!(cq.cqe() >= 16);
        req_notify_cq(&cq, false).unwrap();
        let mut wcs = [ibv_wc::default(); 4];
        assert_eq!(poll_cq(&cq, &mut wcs).unwrap(), 0);

        let cap = ibv_qp_cap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let qp = create_qp(&pd, &cq, &cq, cap).unwrap();
        assert!(qp.num() > 0);
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_INIT, ..Default::default() };
        assert_eq!(modify_qp(&qp, &mut a, 0).unwrap_err(), VerbsError::errno("ibv_modify_qp", 22));
        // A receive in RESET: the provider refuses it (its errno comes back).
        assert_eq!(post_recv(&qp, 1, None).unwrap_err(), VerbsError::errno("ibv_post_recv", 12));

        let wr = |opcode, flags, num_sge| ibv_send_wr {
            wr_id: 7,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge,
            opcode,
            send_flags: flags,
            imm_data: 0,
            wr: ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr: 0, rkey: 0 } },
            qp_type_xrc_remote_srqn: 0,
            bind_mw_or_tso: [0; 6],
        };
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey };
        let refused = |r: VResult<()>| matches!(r, Err(VerbsError { call: "ibv_post_send", cause: Cause::Refused(_) }));
        // SEND (2) reads no remote key; INLINE (1 << 3) makes the CPU read the SGE; two SGEs.
        assert!(refused(post_send(&qp, &mut [wr(2, 0, 1)], &mut [sge])));
        assert!(refused(post_send(&qp, &mut [wr(IBV_WR_RDMA_WRITE, 1 << 3, 1)], &mut [sge])));
        assert!(refused(post_send(&qp, &mut [wr(IBV_WR_RDMA_WRITE, 0, 2)], &mut [sge])));
        assert!(refused(post_send(&qp, &mut [wr(IBV_WR_RDMA_WRITE, 0, 1)], &mut [])));
        assert_eq!(post_send(&qp, &mut [], &mut []), Ok(()));
        // A well-formed list reaches the provider, which refuses it outside RTS.
        let r = post_send(
            &qp,
            &mut [wr(IBV_WR_RDMA_WRITE, 0, 1), wr(IBV_WR_RDMA_WRITE_WITH_IMM, IBV_SEND_SIGNALED, 0)],
            &mut [sge, ibv_sge::default()],
        );
        assert_eq!(r.unwrap_err(), VerbsError::errno("ibv_post_send", 22));
        assert!(wc_status_str(v, IBV_WC_SUCCESS).is_some());

        // SAFETY: children first; no handle is used after its destroy.
        unsafe {
            destroy_qp(&qp).unwrap();
            destroy_cq(&cq).unwrap();
            destroy_comp_channel(&ch).unwrap();
            dereg_mr(&mr).unwrap();
            dealloc_pd(&pd).unwrap();
            close_device(&ctx).unwrap();
        }
        drop(mem);
    }
}
