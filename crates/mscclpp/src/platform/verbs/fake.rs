//! An in-process verbs provider for tests (cargo feature `ib-fake`), behind the same function
//! table as libibverbs: the transport runs its real code (work requests, completions, QP state
//! changes) against it. It is selected only by `mscclpp::ib::fake::install`, never as a fallback.
//!
//! Model: every fake device is RoCE-like (link layer Ethernet, one active port, MTU 1024, GID 0
//! link-local RoCE v1, GID 1 `::ffff:127.0.0.1` RoCE v2, HCA atomics). RC semantics: a fabric
//! thread executes each QP's send queue in order: RDMA WRITE, WRITE_WITH_IMM (consuming a posted
//! receive of the peer QP, waiting while none is posted, as with infinite RNR retry) and 8-byte
//! FETCH_AND_ADD, with lkey/rkey, bounds and access checks (local protection and remote access
//! errors). A peer that does not answer (QP gone or not yet ready, link broken) is retried for
//! [`RETRY_WINDOW`], then the WR completes with retry-exceeded and the QP enters the error state;
//! later WRs complete with flush errors. Send-queue slots are freed when a signalled completion
//! is polled (as real providers do), so posting past `max_send_wr` fails with ENOMEM; a full CQ
//! is an overflow, counted in [`FakeStats`] and fatal to the CQ.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::ffi::{CString, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::abi::*;
use super::{GidTypeFn, Verbs};
use crate::sync::lock;

mod fabric;
use fabric::*;

/// How long the fake retries a WR whose peer does not answer before retry-exceeded.
pub const RETRY_WINDOW: Duration = Duration::from_millis(1500);

const EINVAL: c_int = 22;
const ENOMEM: c_int = 12;
const ENODEV: c_int = 19;
const EFAULT: c_int = 14;
const IBV_WC_LOC_PROT_ERR: c_uint = 4;
const IBV_WC_LOC_LEN_ERR: c_uint = 1;
const IBV_WC_REM_INV_REQ_ERR: c_uint = 9;
const IBV_WC_WITH_IMM: c_uint = 1 << 1;
const MTU_1024: c_uint = 3;

/// Counters a test can check (`#[non_exhaustive]`: more counters may come).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FakeStats {
    /// Completions that found their CQ full (a transport bug).
    pub cq_overflows: u64,
    /// `post_send` calls refused because the send queue was full.
    pub sq_full_refusals: u64,
    /// The most completions ever waiting in one CQ.
    pub max_cq_depth: u64,
    /// Work requests executed.
    pub executed: u64,
    /// Completion events raised on armed CQs (a sleeping receive thread woken).
    pub cq_events: u64,
}

struct Dev {
    name: CString,
    link_broken: AtomicBool,
    /// Memory registration fails (as without dma-buf support or nvidia-peermem).
    refuse_mr: AtomicBool,
    /// The device reports no RDMA atomics.
    no_atomics: AtomicBool,
}

impl Dev {
    fn new(name: &str) -> Arc<Dev> {
        Arc::new(Dev {
            name: c(name),
            link_broken: AtomicBool::new(false),
            refuse_mr: AtomicBool::new(false),
            no_atomics: AtomicBool::new(false),
        })
    }
}

struct Mr {
    dev: usize,
    pd: usize,
    addr: u64,
    len: u64,
    access: c_uint,
}

#[derive(Clone, Copy)]
struct Wr {
    wr_id: u64,
    seq: u64,
    opcode: c_uint,
    signaled: bool,
    sge: Option<ibv_sge>,
    remote_addr: u64,
    rkey: u32,
    add: u64,
    imm: u32,
    first_try: Option<Instant>,
}

struct QpState {
    state: c_uint,
    dest_qpn: u32,
    access: c_uint,
    sq: VecDeque<Wr>,
    rq: VecDeque<u64>,
    posted: u64,
    retired: u64,
    max_send_wr: u32,
    max_recv_wr: u32,
}

struct Qp {
    qpn: u32,
    dev: usize,
    pd: usize,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    st: Mutex<QpState>,
}

/// A completion, and the QP and sequence number whose send-queue slots it frees when polled.
type Entry = (ibv_wc, Option<(Arc<Qp>, u64)>);

struct CqState {
    entries: VecDeque<Entry>,
    overflowed: bool,
}

struct Cq {
    cap: usize,
    st: Mutex<CqState>,
    /// The completion channel (as the address of its `FChannel`) and whether the CQ is armed.
    channel: Option<Arc<Channel>>,
    armed: AtomicBool,
    /// The address of this CQ's `ibv_cq`, reported by `get_cq_event`.
    handle: AtomicU64,
}

/// A completion channel: a pipe whose read end is the channel's fd; one byte per event.
struct Channel {
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
    fired: Mutex<VecDeque<u64>>,
}

#[derive(Default)]
struct Fabric {
    devs: Vec<Arc<Dev>>,
    qps: HashMap<u32, Arc<Qp>>,
    mrs: HashMap<u32, Mr>,
    next_qpn: u32,
    next_key: u32,
    stats: FakeStats,
}

struct Global {
    fabric: Mutex<Fabric>,
    work: Mutex<u64>,
    work_cond: Condvar,
}

fn global() -> &'static Global {
    static G: OnceLock<Global> = OnceLock::new();
    G.get_or_init(|| {
        let mut f = Fabric { next_qpn: 0x100, next_key: 0x1000, ..Default::default() };
        for n in ["fake0", "fake1"] {
            f.devs.push(Dev::new(n));
        }
        std::thread::Builder::new()
            .name("mscclpp-fake-ib".into())
            .spawn(fabric_thread)
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!("the fake IB fabric thread did not start: {e}"));
        Global { fabric: Mutex::new(f), work: Mutex::new(0), work_cond: Condvar::new() }
    })
}

fn c(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

fn kick() {
    let g = global();
    *lock(&g.work) += 1;
    g.work_cond.notify_all();
}

/// Adds a fake device called `name` (no-op when it exists).
pub(crate) fn add_device(name: &str) {
    let mut f = lock(&global().fabric);
    if !f.devs.iter().any(|d| d.name.as_bytes() == name.as_bytes()) {
        f.devs.push(Dev::new(name));
    }
}

/// Runs `f` on device `name`; false when there is none.
fn with_dev(name: &str, f: impl FnOnce(&Dev)) -> bool {
    let fab = lock(&global().fabric);
    fab.devs.iter().find(|d| d.name.as_bytes() == name.as_bytes()).map(|d| f(d)).is_some()
}

/// Breaks (or mends) the link of device `name`: WRs of its QPs get no answer.
pub(crate) fn set_link_broken(name: &str, broken: bool) -> bool {
    with_dev(name, |d| d.link_broken.store(broken, Ordering::SeqCst))
}

/// Makes memory registration on device `name` fail with EFAULT (or work again).
pub(crate) fn set_refuse_registration(name: &str, refuse: bool) -> bool {
    with_dev(name, |d| d.refuse_mr.store(refuse, Ordering::SeqCst))
}

/// Makes device `name` report no RDMA atomics (or report them again).
pub(crate) fn set_atomics(name: &str, atomics: bool) -> bool {
    with_dev(name, |d| d.no_atomics.store(!atomics, Ordering::SeqCst))
}

/// The counters so far.
pub(crate) fn stats() -> FakeStats {
    lock(&global().fabric).stats
}

// ---- the objects handed out, each with the libibverbs struct first ------------------------

#[repr(C)]
struct FDevice {
    index: usize,
}

#[repr(C)]
struct FContext {
    ctx: ibv_context,
    dev: usize,
}

#[repr(C)]
struct FPd {
    pd: ibv_pd,
    dev: usize,
}

#[repr(C)]
struct FMr {
    mr: ibv_mr,
}

#[repr(C)]
struct FCq {
    cq: ibv_cq,
    st: Arc<Cq>,
}

#[repr(C)]
struct FQp {
    qp: ibv_qp,
    st: Arc<Qp>,
}

fn set_errno(e: c_int) {
    nix::errno::Errno::set_raw(e);
}

unsafe extern "C" fn get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    let n = lock(&global().fabric).devs.len();
    let mut v: Vec<*mut ibv_device> =
        (0..n).map(|index| Box::into_raw(Box::new(FDevice { index })) as *mut ibv_device).collect();
    v.push(std::ptr::null_mut());
    if !num.is_null() {
        // SAFETY: the caller passes a valid out-pointer (or null, checked).
        unsafe { *num = n as c_int };
    }
    Box::into_raw(v.into_boxed_slice()) as *mut *mut ibv_device
}

unsafe extern "C" fn free_device_list(list: *mut *mut ibv_device) {
    if list.is_null() {
        return;
    }
    let mut n = 0;
    // SAFETY: the list came from get_device_list: n device pointers and a null.
    while !unsafe { *list.add(n) }.is_null() {
        n += 1;
    }
    // SAFETY: reconstructs the boxed slice of n + 1 entries made above, and each FDevice box.
    unsafe {
        let b = Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1));
        for d in &b[..n] {
            drop(Box::from_raw(*d as *mut FDevice));
        }
    }
}

unsafe extern "C" fn get_device_name(dev: *mut ibv_device) -> *const c_char {
    // SAFETY: dev came from get_device_list.
    let i = unsafe { (*(dev as *mut FDevice)).index };
    lock(&global().fabric).devs.get(i).map(|d| d.name.as_ptr()).unwrap_or(std::ptr::null())
}

unsafe extern "C" fn open_device(dev: *mut ibv_device) -> *mut ibv_context {
    // SAFETY: dev came from get_device_list.
    let i = unsafe { (*(dev as *mut FDevice)).index };
    // SAFETY: all-zero bytes are a valid ibv_context (null pointers, None ops, zero ints).
    let mut ctx: ibv_context = unsafe { std::mem::zeroed() };
    ctx.ops.poll_cq = Some(poll_cq);
    ctx.ops.post_send = Some(post_send);
    ctx.ops.post_recv = Some(post_recv);
    ctx.ops.req_notify_cq = Some(req_notify_cq);
    ctx.device = dev;
    Box::into_raw(Box::new(FContext { ctx, dev: i })) as *mut ibv_context
}

unsafe extern "C" fn close_device(ctx: *mut ibv_context) -> c_int {
    // SAFETY: ctx came from open_device and is closed once.
    drop(unsafe { Box::from_raw(ctx as *mut FContext) });
    0
}

unsafe extern "C" fn query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    // SAFETY: ctx came from open_device.
    let dev = unsafe { (*(ctx as *mut FContext)).dev };
    let no_atomics = lock(&global().fabric).devs.get(dev).is_some_and(|d| d.no_atomics.load(Ordering::SeqCst));
    // SAFETY: attr is a valid out-pointer.
    let a = unsafe { &mut *attr };
    a.max_qp_wr = 16384;
    a.max_cqe = 65536;
    a.max_qp_rd_atom = 16;
    a.max_qp_init_rd_atom = 16;
    a.atomic_cap = if no_atomics { 0 } else { 1 };
    a.phys_port_cnt = 1;
    a.max_mr_size = u64::MAX;
    0
}

unsafe extern "C" fn query_port(_ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int {
    if port != 1 {
        return EINVAL;
    }
    // SAFETY: attr is a valid out-pointer.
    let a = unsafe { &mut *attr };
    a.state = IBV_PORT_ACTIVE;
    a.max_mtu = MTU_1024;
    a.active_mtu = MTU_1024;
    a.gid_tbl_len = 4;
    a.max_msg_sz = 1 << 31;
    a.lid = 0;
    a.link_layer = IBV_LINK_LAYER_ETHERNET;
    0
}

fn fake_gid(index: c_int) -> Option<[u8; 16]> {
    match index {
        0 => Some([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe, 0, 0, 1]),
        1 => Some([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]),
        _ => None,
    }
}

unsafe extern "C" fn query_gid(_ctx: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int {
    if port != 1 || !(0..4).contains(&index) {
        return EINVAL;
    }
    // SAFETY: gid is a valid out-pointer.
    unsafe { (*gid).raw = fake_gid(index).unwrap_or([0; 16]) };
    0
}

fn gid_type(_dev: &str, _port: u8, index: u32) -> Option<String> {
    match index {
        0 => Some("IB/RoCE v1".into()),
        1 => Some("RoCE v2".into()),
        _ => None,
    }
}

unsafe extern "C" fn alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: ctx came from open_device.
    let dev = unsafe { (*(ctx as *mut FContext)).dev };
    Box::into_raw(Box::new(FPd { pd: ibv_pd { context: ctx, handle: 0 }, dev })) as *mut ibv_pd
}

unsafe extern "C" fn dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: pd came from alloc_pd and is freed once.
    drop(unsafe { Box::from_raw(pd as *mut FPd) });
    0
}

unsafe extern "C" fn reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr {
    // SAFETY: pd came from alloc_pd.
    let (dev, ctx) = unsafe { ((*(pd as *mut FPd)).dev, (*pd).context) };
    if addr.is_null() || len == 0 {
        set_errno(EINVAL);
        return std::ptr::null_mut();
    }
    register(pd, dev, ctx, addr as u64, len, access)
}

fn register(pd: *mut ibv_pd, dev: usize, ctx: *mut ibv_context, addr: u64, len: usize, access: c_int) -> *mut ibv_mr {
    let mut f = lock(&global().fabric);
    if f.devs.get(dev).is_some_and(|d| d.refuse_mr.load(Ordering::SeqCst)) {
        set_errno(EFAULT);
        return std::ptr::null_mut();
    }
    f.next_key = f.next_key.wrapping_add(0x101);
    let key = f.next_key;
    f.mrs.insert(key, Mr { dev, pd: pd as usize, addr, len: len as u64, access: access as c_uint });
    let mr = ibv_mr { context: ctx, pd, addr: addr as *mut c_void, length: len, handle: key, lkey: key, rkey: key };
    Box::into_raw(Box::new(FMr { mr })) as *mut ibv_mr
}

unsafe extern "C" fn reg_dmabuf_mr(
    pd: *mut ibv_pd,
    _offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: pd came from alloc_pd.
    let (dev, ctx) = unsafe { ((*(pd as *mut FPd)).dev, (*pd).context) };
    if fd < 0 || len == 0 {
        set_errno(EINVAL);
        return std::ptr::null_mut();
    }
    register(pd, dev, ctx, iova, len, access)
}

unsafe extern "C" fn dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: mr came from reg_mr and is freed once.
    let b = unsafe { Box::from_raw(mr as *mut FMr) };
    // Taking the fabric lock waits for a WR being executed, as hardware finishes DMA first.
    lock(&global().fabric).mrs.remove(&b.mr.rkey);
    0
}

#[repr(C)]
struct FChannel {
    ch: ibv_comp_channel,
    st: Arc<Channel>,
}

unsafe extern "C" fn create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    use std::os::fd::AsRawFd;
    let Ok((read, write)) = nix::unistd::pipe() else {
        set_errno(ENOMEM);
        return std::ptr::null_mut();
    };
    let fd = read.as_raw_fd();
    let st = Arc::new(Channel { read, write, fired: Mutex::new(VecDeque::new()) });
    Box::into_raw(Box::new(FChannel { ch: ibv_comp_channel { context: ctx, fd, refcnt: 0 }, st }))
        as *mut ibv_comp_channel
}

unsafe extern "C" fn destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    // SAFETY: ch came from create_comp_channel and is freed once.
    drop(unsafe { Box::from_raw(ch as *mut FChannel) });
    0
}

unsafe extern "C" fn get_cq_event(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, ctx: *mut *mut c_void) -> c_int {
    // SAFETY: ch came from create_comp_channel.
    let c = unsafe { &(*(ch as *mut FChannel)).st };
    let mut b = [0u8; 1];
    // Blocks until an event's byte is there, as the real call does.
    match nix::unistd::read(&c.read, &mut b) {
        Ok(1) => {}
        _ => return -1,
    }
    let Some(h) = lock(&c.fired).pop_front() else { return -1 };
    // SAFETY: valid out-pointers.
    unsafe {
        *cq = h as *mut ibv_cq;
        *ctx = std::ptr::null_mut();
    }
    0
}

unsafe extern "C" fn ack_cq_events(_cq: *mut ibv_cq, _n: c_uint) {}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    // SAFETY: cq came from create_cq.
    let c = unsafe { &(*(cq as *mut FCq)).st };
    if c.channel.is_none() {
        return EINVAL;
    }
    c.armed.store(true, Ordering::SeqCst);
    0
}

unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    _cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    if cqe <= 0 {
        set_errno(EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: all-zero bytes are a valid ibv_cq.
    let mut cq: ibv_cq = unsafe { std::mem::zeroed() };
    cq.context = ctx;
    cq.cqe = cqe;
    cq.channel = channel;
    // SAFETY: a non-null channel came from create_comp_channel and outlives the CQ.
    let ch = (!channel.is_null()).then(|| unsafe { (*(channel as *mut FChannel)).st.clone() });
    let st = Arc::new(Cq {
        cap: cqe as usize,
        st: Mutex::new(CqState { entries: VecDeque::new(), overflowed: false }),
        channel: ch,
        armed: AtomicBool::new(false),
        handle: AtomicU64::new(0),
    });
    let handle = st.clone();
    let p = Box::into_raw(Box::new(FCq { cq, st }));
    handle.handle.store(p as u64, Ordering::SeqCst);
    p as *mut ibv_cq
}

unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: cq came from create_cq and is freed once.
    drop(unsafe { Box::from_raw(cq as *mut FCq) });
    0
}

unsafe extern "C" fn create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: pd came from alloc_pd; attr is valid.
    let (dev, ctx, a) = unsafe { ((*(pd as *mut FPd)).dev, (*pd).context, &mut *attr) };
    if a.qp_type != IBV_QPT_RC || a.send_cq.is_null() || a.recv_cq.is_null() || a.cap.max_send_wr > 16384 {
        set_errno(EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the CQs came from create_cq.
    let (scq, rcq) = unsafe { ((*(a.send_cq as *mut FCq)).st.clone(), (*(a.recv_cq as *mut FCq)).st.clone()) };
    let mut f = lock(&global().fabric);
    f.next_qpn += 1;
    let qpn = f.next_qpn;
    let st = Arc::new(Qp {
        qpn,
        dev,
        pd: pd as usize,
        send_cq: scq,
        recv_cq: rcq,
        st: Mutex::new(QpState {
            state: IBV_QPS_RESET,
            dest_qpn: 0,
            access: 0,
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            posted: 0,
            retired: 0,
            max_send_wr: a.cap.max_send_wr.max(1),
            max_recv_wr: a.cap.max_recv_wr.max(1),
        }),
    });
    f.qps.insert(qpn, st.clone());
    // SAFETY: all-zero bytes are a valid ibv_qp.
    let mut qp: ibv_qp = unsafe { std::mem::zeroed() };
    qp.context = ctx;
    qp.pd = pd;
    qp.send_cq = a.send_cq;
    qp.recv_cq = a.recv_cq;
    qp.qp_num = qpn;
    qp.qp_type = IBV_QPT_RC;
    Box::into_raw(Box::new(FQp { qp, st })) as *mut ibv_qp
}

unsafe extern "C" fn modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    // SAFETY: qp came from create_qp; attr is valid.
    let (q, a) = unsafe { (&(*(qp as *mut FQp)).st, &*attr) };
    let mut s = lock(&q.st);
    if mask & IBV_QP_STATE == 0 {
        return EINVAL;
    }
    let ok = match (s.state, a.qp_state) {
        (_, IBV_QPS_ERR) | (_, IBV_QPS_RESET) => true,
        (IBV_QPS_RESET, IBV_QPS_INIT) => mask & IBV_QP_PORT != 0 && a.port_num == 1,
        (IBV_QPS_INIT, IBV_QPS_RTR) => {
            // RoCE needs a global route with a valid source GID, and a supported MTU.
            let need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
            mask & need == need
                && a.ah_attr.is_global == 1
                && fake_gid(a.ah_attr.grh.sgid_index as c_int).is_some()
                && (1..=MTU_1024).contains(&a.path_mtu)
        }
        (IBV_QPS_RTR, IBV_QPS_RTS) => mask & IBV_QP_SQ_PSN != 0,
        _ => false,
    };
    if !ok {
        return EINVAL;
    }
    if a.qp_state == IBV_QPS_INIT && mask & IBV_QP_ACCESS_FLAGS != 0 {
        s.access = a.qp_access_flags;
    }
    if a.qp_state == IBV_QPS_RTR {
        s.dest_qpn = a.dest_qp_num;
    }
    s.state = a.qp_state;
    0
}

unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: qp came from create_qp and is freed once.
    let b = unsafe { Box::from_raw(qp as *mut FQp) };
    lock(&global().fabric).qps.remove(&b.st.qpn);
    0
}

unsafe extern "C" fn wc_status_str(status: c_uint) -> *const c_char {
    let s: &'static [u8] = match status {
        IBV_WC_SUCCESS => b"success\0",
        IBV_WC_LOC_LEN_ERR => b"local length error\0",
        IBV_WC_LOC_PROT_ERR => b"local protection error\0",
        IBV_WC_WR_FLUSH_ERR => b"Work Request Flushed Error\0",
        IBV_WC_REM_INV_REQ_ERR => b"remote invalid request error\0",
        IBV_WC_REM_ACCESS_ERR => b"remote access error\0",
        IBV_WC_RETRY_EXC_ERR => b"transport retry counter exceeded\0",
        _ => b"unknown\0",
    };
    s.as_ptr() as *const c_char
}

unsafe extern "C" fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    // SAFETY: qp came from create_qp.
    let q = unsafe { &(*(qp as *mut FQp)).st };
    let mut s = lock(&q.st);
    let mut cur = wr;
    let mut rc = 0;
    let mut full = false;
    while !cur.is_null() {
        // SAFETY: cur is an element of the caller's valid list.
        let w = unsafe { &*cur };
        if s.state != IBV_QPS_RTS && s.state != IBV_QPS_ERR {
            rc = EINVAL;
        } else if s.posted - s.retired >= s.max_send_wr as u64 {
            rc = ENOMEM;
            full = true;
        } else if w.num_sge > 1 || w.num_sge < 0 {
            rc = EINVAL;
        }
        if rc != 0 {
            if !bad.is_null() {
                // SAFETY: bad is a valid out-pointer.
                unsafe { *bad = cur };
            }
            break;
        }
        let sge = if w.num_sge == 1 {
            // SAFETY: num_sge == 1: sg_list points to one valid SGE.
            Some(unsafe { *w.sg_list })
        } else {
            None
        };
        // SAFETY: the union is read as the member the opcode uses.
        let (remote_addr, rkey, add) = unsafe {
            if w.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD {
                (w.wr.atomic.remote_addr, w.wr.atomic.rkey, w.wr.atomic.compare_add)
            } else {
                (w.wr.rdma.remote_addr, w.wr.rdma.rkey, 0)
            }
        };
        let seq = s.posted;
        s.posted += 1;
        s.sq.push_back(Wr {
            wr_id: w.wr_id,
            seq,
            opcode: w.opcode,
            signaled: w.send_flags & IBV_SEND_SIGNALED != 0,
            sge,
            remote_addr,
            rkey,
            add,
            imm: w.imm_data,
            first_try: None,
        });
        cur = w.next;
    }
    drop(s);
    if full {
        lock(&global().fabric).stats.sq_full_refusals += 1;
    }
    kick();
    rc
}

unsafe extern "C" fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    // SAFETY: qp came from create_qp.
    let q = unsafe { &(*(qp as *mut FQp)).st };
    let mut s = lock(&q.st);
    let mut cur = wr;
    while !cur.is_null() {
        // SAFETY: cur is an element of the caller's valid list.
        let w = unsafe { &*cur };
        if s.state == IBV_QPS_RESET || s.rq.len() >= s.max_recv_wr as usize || w.num_sge != 0 {
            if !bad.is_null() {
                // SAFETY: bad is a valid out-pointer.
                unsafe { *bad = cur };
            }
            return if w.num_sge != 0 { EINVAL } else { ENOMEM };
        }
        s.rq.push_back(w.wr_id);
        cur = w.next;
    }
    drop(s);
    kick();
    0
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: cq came from create_cq.
    let c = unsafe { &(*(cq as *mut FCq)).st };
    let mut taken = Vec::new();
    {
        let mut s = lock(&c.st);
        if s.overflowed {
            return -ENODEV;
        }
        while taken.len() < n.max(0) as usize {
            match s.entries.pop_front() {
                Some(e) => taken.push(e),
                None => break,
            }
        }
    }
    for (i, (w, tag)) in taken.iter().enumerate() {
        // SAFETY: wc is valid for n entries and i < n.
        unsafe { *wc.add(i) = *w };
        if let Some((qp, seq)) = tag {
            let mut s = lock(&qp.st);
            s.retired = s.retired.max(seq + 1);
        }
    }
    taken.len() as c_int
}

/// The function table of the fake provider.
pub(crate) fn table() -> Verbs {
    let gid: GidTypeFn = gid_type;
    Verbs {
        path: "in-process test provider (mscclpp ib-fake)".into(),
        get_device_list,
        free_device_list,
        get_device_name,
        open_device,
        close_device,
        query_device,
        query_port,
        query_gid,
        alloc_pd,
        dealloc_pd,
        reg_mr,
        reg_dmabuf_mr: Some(reg_dmabuf_mr),
        dereg_mr,
        create_cq,
        destroy_cq,
        create_comp_channel,
        destroy_comp_channel,
        get_cq_event,
        ack_cq_events,
        create_qp,
        modify_qp,
        destroy_qp,
        wc_status_str,
        gid_type: gid,
        fake: true,
        _lib: None,
    }
}
