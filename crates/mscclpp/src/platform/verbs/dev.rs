//! Owned verbs objects: an opened device with its protection domain, memory regions, completion
//! queues and RC queue pairs. Every object keeps the device alive (`Arc<IbDevice>`), so nothing is
//! destroyed after the PD or the device context it came from (MSCCL++'s MRs and QPs hold no
//! reference to their `IbCtx`).
//!
//! Every verbs call goes through [`super::result`], which holds the FFI `unsafe`; what is left
//! here is the few calls whose contract only an owner can keep: destroying an object (in `Drop`,
//! children first) and registering host memory (the caller keeps it valid).
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::abi::*;
use super::result::{self as r, CompChannel, Context, Cq, Mr, Pd, Qp};
use super::{DeviceList, Verbs, verbs};
use crate::error::{Error, ErrorKind, Result};

/// What the transport needs of a device's capabilities.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceCaps {
    pub(crate) atomics: bool,
    pub(crate) max_qp_wr: u32,
    pub(crate) max_cqe: u32,
    pub(crate) max_qp_rd_atom: u8,
    pub(crate) max_qp_init_rd_atom: u8,
    pub(crate) ports: u8,
}

/// An opened RDMA device and its protection domain.
pub(crate) struct IbDevice {
    pub(crate) v: &'static Verbs,
    pub(crate) name: String,
    ctx: Context,
    pd: Pd,
    pub(crate) caps: DeviceCaps,
}

impl fmt::Debug for IbDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IbDevice({})", self.name)
    }
}

impl Drop for IbDevice {
    fn drop(&mut self) {
        // SAFETY: every MR, CQ, channel and QP holds an Arc to this device, so all of them are
        // destroyed; the PD goes before its context, and neither handle is used again.
        let (pd, ctx) = unsafe { (r::dealloc_pd(&self.pd), r::close_device(&self.ctx)) };
        for e in [pd, ctx].into_iter().filter_map(|x| x.err()) {
            warn!(target: "mscclpp::ib", "closing {}: {e}", self.name);
        }
    }
}

/// The port and GID a queue pair uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PortInfo {
    pub(crate) port: u8,
    pub(crate) lid: u16,
    pub(crate) link_layer: u8,
    pub(crate) active_mtu: u32,
    pub(crate) gid_index: u8,
    pub(crate) gid: [u8; 16],
    pub(crate) max_msg_sz: u32,
}

impl PortInfo {
    /// Whether packets need a global route header (RoCE, or a GID-routed IB fabric).
    pub(crate) fn is_ethernet(&self) -> bool {
        self.link_layer == IBV_LINK_LAYER_ETHERNET
    }
}

/// Formats a GID as IPv6 text.
pub(crate) fn gid_text(g: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*g).to_string()
}

impl IbDevice {
    /// Opens the device called `name` and allocates its protection domain.
    pub(crate) fn open(name: &str) -> Result<Arc<IbDevice>> {
        let list = DeviceList::get()?;
        let v = verbs()?;
        let Some(opened) = r::open_device(&list, name) else {
            let names = list.names();
            return Err(Error::invalid_usage(format!(
                "RDMA device {name:?} does not exist (this machine has: {})",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            )));
        };
        drop(list);
        let ctx = opened.map_err(|e| e.on(format_args!("({name})")))?;
        let made = r::query_device(&ctx).and_then(|attr| Ok((attr, r::alloc_pd(&ctx)?)));
        let (attr, pd) = match made {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: nothing was made from ctx (alloc_pd is the only call that makes
                // anything, and it failed), and ctx is dropped unused right after.
                if let Err(c) = unsafe { r::close_device(&ctx) } {
                    warn!(target: "mscclpp::ib", "closing {name} after a failed open: {c}");
                }
                return Err(e.on(format_args!("({name})")));
            }
        };
        let caps = DeviceCaps {
            atomics: attr.atomic_cap != IBV_ATOMIC_NONE,
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_cqe: attr.max_cqe.max(1) as u32,
            max_qp_rd_atom: attr.max_qp_rd_atom.clamp(0, 255) as u8,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom.clamp(0, 255) as u8,
            ports: attr.phys_port_cnt,
        };
        info!(target: "mscclpp::ib", "opened RDMA device {name} ({caps:?})");
        Ok(Arc::new(IbDevice { v, name: name.to_string(), ctx, pd, caps }))
    }

    fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        r::query_port(&self.ctx, port).map_err(|e| e.on(format_args!("({} port {port})", self.name)))
    }

    fn query_gid(&self, port: u8, index: u32) -> Option<[u8; 16]> {
        r::query_gid(&self.ctx, port, index).ok().filter(|g| *g != [0; 16])
    }

    /// Chooses the port (the configured one, else the first active port with an IB or Ethernet
    /// link layer) and the GID (the configured index, else `MSCCLPP_IB_GID_INDEX`, else the RoCE
    /// v2 GID of the port's IPv4 address, then IPv6), logging why.
    pub(crate) fn choose_port(&self, port: Option<u8>, gid_index: Option<u32>) -> Result<PortInfo> {
        let candidates: Vec<u8> = match port {
            Some(p) => vec![p],
            None => (1..=self.caps.ports.max(1)).collect(),
        };
        let mut why = Vec::new();
        for p in candidates {
            let a = match self.query_port(p) {
                Ok(a) => a,
                Err(e) => {
                    why.push(format!("port {p}: {}", e.message()));
                    continue;
                }
            };
            if a.state != IBV_PORT_ACTIVE {
                why.push(format!("port {p} is not active (state {})", a.state));
                continue;
            }
            if a.link_layer != IBV_LINK_LAYER_ETHERNET && a.link_layer != IBV_LINK_LAYER_INFINIBAND && a.link_layer != 0
            {
                why.push(format!("port {p} has link layer {}", a.link_layer));
                continue;
            }
            let env_gid = crate::env::env().ok().and_then(|e| e.ib_gid_index);
            let ethernet = a.link_layer == IBV_LINK_LAYER_ETHERNET;
            let (gid_index, gid) = match gid_index.or(env_gid) {
                Some(i) => {
                    if i >= a.gid_tbl_len.max(0) as u32 || i > 255 {
                        return Err(Error::invalid_usage(format!(
                            "GID index {i} is out of range for {} port {p} (table of {})",
                            self.name, a.gid_tbl_len
                        )));
                    }
                    match self.query_gid(p, i) {
                        Some(g) => (i as u8, g),
                        None if !ethernet => (i as u8, [0; 16]),
                        None => {
                            return Err(Error::invalid_usage(format!(
                                "GID index {i} of {} port {p} is empty",
                                self.name
                            )));
                        }
                    }
                }
                None if ethernet => match self.auto_gid(p, a.gid_tbl_len.max(0) as u32) {
                    Some(x) => x,
                    None => {
                        why.push(format!("port {p} (RoCE) has no usable GID"));
                        continue;
                    }
                },
                None => (0, self.query_gid(p, 0).unwrap_or([0; 16])),
            };
            let info = PortInfo {
                port: p,
                lid: a.lid,
                link_layer: if ethernet { IBV_LINK_LAYER_ETHERNET } else { IBV_LINK_LAYER_INFINIBAND },
                active_mtu: a.active_mtu,
                gid_index,
                gid,
                max_msg_sz: a.max_msg_sz,
            };
            debug!(target: "mscclpp::ib", "{}: using port {p}, GID index {gid_index} ({})", self.name, gid_text(&gid));
            return Ok(info);
        }
        Err(Error::new(ErrorKind::Ib, format!("{} has no usable port: {}", self.name, why.join("; "))))
    }

    /// The RoCE v2 GID to use by default: an IPv4-mapped one first, then a global IPv6 one, then
    /// any RoCE v2 one; without RoCE v2, the first valid GID.
    fn auto_gid(&self, port: u8, len: u32) -> Option<(u8, [u8; 16])> {
        let mut all = Vec::new();
        for i in 0..len.min(256) {
            if let Some(g) = self.query_gid(port, i) {
                let t = (self.v.gid_type)(&self.name, port, i).unwrap_or_default();
                all.push((i as u8, g, t));
            }
        }
        let v2 = |t: &str| t.eq_ignore_ascii_case("RoCE v2");
        let ipv4 = |g: &[u8; 16]| g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff;
        let link_local = |g: &[u8; 16]| g[0] == 0xfe && (g[1] & 0xc0) == 0x80;
        let pick = all
            .iter()
            .find(|(_, g, t)| v2(t) && ipv4(g))
            .map(|x| (x, "the RoCE v2 GID of the port's IPv4 address"))
            .or_else(|| {
                all.iter()
                    .find(|(_, g, t)| v2(t) && !link_local(g))
                    .map(|x| (x, "the RoCE v2 GID of the port's IPv6 address (no IPv4 one)"))
            })
            .or_else(|| all.iter().find(|(_, _, t)| v2(t)).map(|x| (x, "a link-local RoCE v2 GID (no routable one)")))
            .or_else(|| all.first().map(|x| (x, "the first valid GID (the port has no RoCE v2 GID)")));
        let ((i, g, t), reason) = pick?;
        if !v2(t) {
            warn!(target: "mscclpp::ib", "{} port {port}: no RoCE v2 GID; using index {i} ({})", self.name, gid_text(g));
        } else {
            info!(target: "mscclpp::ib", "{} port {port}: GID index {i} ({}): {reason}; set MSCCLPP_IB_GID_INDEX to override", self.name, gid_text(g));
        }
        Some((*i, *g))
    }

    /// Registers `[addr, addr + len)` for local write and remote write, read and atomics.
    pub(crate) fn reg_mr(self: &Arc<Self>, addr: u64, len: u64) -> Result<IbMr> {
        let access =
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        // SAFETY: the range is memory the caller keeps valid while the MR lives (LocalRegion
        // drops its MRs before its memory).
        let mr = unsafe { r::reg_mr(&self.pd, addr, len as usize, access) }.map_err(|e| {
            let hint = if e.os_error() == Some(nix::errno::Errno::ENOMEM as c_int) {
                " (the locked-memory limit may be too low: raise `ulimit -l`)"
            } else {
                ""
            };
            e.on(format_args!(" of {len} bytes at {addr:#x} on {}{hint}", self.name))
        })?;
        let (lkey, rkey) = mr.keys();
        Ok(IbMr { dev: self.clone(), mr, addr, len, lkey, rkey })
    }

    /// Registers `len` bytes at `offset` of the dma-buf `fd` (GPU memory exported by the CUDA
    /// driver), seen by peers at address `iova`.
    pub(crate) fn reg_dmabuf_mr(self: &Arc<Self>, offset: u64, len: u64, iova: u64, fd: c_int) -> Result<IbMr> {
        if self.v.reg_dmabuf_mr.is_none() {
            return Err(Error::not_available(format!(
                "{} has no ibv_reg_dmabuf_mr (rdma-core 34 or later is needed)",
                self.v.path
            )));
        }
        let access =
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        let mr = r::reg_dmabuf_mr(&self.pd, offset, len as usize, iova, fd, access)
            .map_err(|e| e.on(format_args!(" of {len} bytes on {}", self.name)))?;
        let (lkey, rkey) = mr.keys();
        Ok(IbMr { dev: self.clone(), mr, addr: iova, len, lkey, rkey })
    }

    /// A completion queue of at least `cqe` entries; with `events`, it has a completion channel
    /// of its own, so a thread can sleep until it gets a completion ([`IbCq::wait_event`]).
    pub(crate) fn create_cq(self: &Arc<Self>, cqe: u32, events: bool) -> Result<IbCq> {
        let n = cqe.min(self.caps.max_cqe).max(1);
        let channel = if events {
            let ch = r::create_comp_channel(&self.ctx).map_err(|e| e.on(format_args!(" on {}", self.name)))?;
            Some(IbChannel { dev: self.clone(), ch })
        } else {
            None
        };
        // The IbCq keeps the channel and drops it after destroying the CQ.
        let cq = r::create_cq(&self.ctx, n as c_int, channel.as_ref().map(|c| &c.ch))
            .map_err(|e| e.on(format_args!("({n}) on {}", self.name)))?;
        let depth = cq.cqe().max(1) as u32;
        Ok(IbCq { dev: self.clone(), cq, depth, channel })
    }
}

/// A registered memory region (deregistered on drop).
pub(crate) struct IbMr {
    dev: Arc<IbDevice>,
    mr: Mr,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

impl IbMr {
    /// The device the region is registered on.
    pub(crate) fn device(&self) -> &Arc<IbDevice> {
        &self.dev
    }
}

impl fmt::Debug for IbMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IbMr({} {:#x}+{} rkey {:#x})", self.dev.name, self.addr, self.len, self.rkey)
    }
}

impl Drop for IbMr {
    fn drop(&mut self) {
        // SAFETY: the handle is dropped unused right after; the PD is alive (self.dev).
        if let Err(e) = unsafe { r::dereg_mr(&self.mr) } {
            warn!(target: "mscclpp::ib", "{self:?}: {e}");
        }
    }
}

/// A completion channel (destroyed after its CQ: the `IbCq` owning it drops it last).
struct IbChannel {
    dev: Arc<IbDevice>,
    ch: CompChannel,
}

impl Drop for IbChannel {
    fn drop(&mut self) {
        // SAFETY: its CQ is destroyed (IbCq::drop runs before its fields drop), every event was
        // acknowledged as it was taken (IbCq::wait_event), and the handle is dropped unused.
        if let Err(e) = unsafe { r::destroy_comp_channel(&self.ch) } {
            warn!(target: "mscclpp::ib", "completion channel on {}: {e}", self.dev.name);
        }
    }
}

/// A completion queue (destroyed on drop, after the QPs using it).
pub(crate) struct IbCq {
    dev: Arc<IbDevice>,
    cq: Cq,
    pub(crate) depth: u32,
    channel: Option<IbChannel>,
}

impl IbCq {
    /// Takes up to `out.len()` completions; returns how many.
    #[inline]
    pub(crate) fn poll(&self, out: &mut [ibv_wc]) -> Result<usize> {
        r::poll_cq(&self.cq, out).map_err(|e| e.on(format_args!(" on {}", self.dev.name)))
    }
}

impl IbCq {
    /// Asks for an event on the next completion (`ibv_req_notify_cq`). Poll once more after
    /// arming: a completion that arrived just before does not raise one.
    pub(crate) fn arm(&self) -> Result<()> {
        r::req_notify_cq(&self.cq, false).map_err(|e| e.on(format_args!(" on {}", self.dev.name)))
    }

    /// Sleeps until the armed CQ raises an event or `timeout` passes; `Ok(true)` for an event
    /// (taken and acknowledged). A CQ without a channel sleeps `timeout` at most 50 us.
    pub(crate) fn wait_event(&self, timeout: Duration) -> Result<bool> {
        let Some(ch) = &self.channel else {
            std::thread::sleep(timeout.min(Duration::from_micros(50)));
            return Ok(false);
        };
        let mut fds = [nix::poll::PollFd::new(ch.ch.fd(), nix::poll::PollFlags::POLLIN)];
        let ms = timeout.as_millis().min(u16::MAX as u128) as u16;
        match nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)) {
            Ok(0) => return Ok(false),
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => return Ok(false),
            Err(e) => return Err(Error::io(format!("waiting for a completion event on {}", self.dev.name), e.into())),
        }
        // The channel's fd is readable, so this does not block.
        let cq = r::get_cq_event(&ch.ch).map_err(|e| e.on(format_args!(" on {}", self.dev.name)))?;
        if cq != self.cq.as_ptr() {
            return Err(Error::internal(format!(
                "a completion event on {} for a CQ that is not its own",
                self.dev.name
            )));
        }
        // One event taken, for this CQ (the channel's only one).
        r::ack_cq_events(&self.cq, 1);
        Ok(true)
    }
}

impl Drop for IbCq {
    fn drop(&mut self) {
        // SAFETY: the QP that used this CQ is destroyed (IbQp::drop runs before its CQ fields
        // drop), every event was acknowledged as it was taken (wait_event), and the handle is
        // dropped unused; its channel (a field) is destroyed after this.
        if let Err(e) = unsafe { r::destroy_cq(&self.cq) } {
            warn!(target: "mscclpp::ib", "completion queue on {}: {e}", self.dev.name);
        }
    }
}

/// The text of a work-completion status.
pub(crate) fn wc_status_text(v: &Verbs, status: u32) -> String {
    match r::wc_status_str(v, status) {
        Some(s) => format!("{} ({status})", s.to_string_lossy()),
        None => format!("status {status}"),
    }
}

/// What a peer needs to connect to a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QpInfo {
    pub(crate) lid: u16,
    pub(crate) qpn: u32,
    pub(crate) gid: [u8; 16],
    /// `ibv_mtu` value of the port's active MTU.
    pub(crate) mtu: u8,
    pub(crate) link_layer: u8,
    /// Responder resources for RDMA reads and atomics this side offers.
    pub(crate) rd_atomic: u8,
}

/// Settings of an RC queue pair.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QpLimits {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) cq_size: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
}

/// One send work request, as the transport describes it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SendOp {
    /// RDMA WRITE of `len` bytes from local `src` (key `lkey`) to remote `dst` (key `rkey`).
    Write { src: u64, lkey: u32, len: u32, dst: u64, rkey: u32 },
    /// 8-byte FETCH_AND_ADD of `add` at remote `dst`; the old value lands at local `src`.
    FetchAdd { src: u64, lkey: u32, dst: u64, rkey: u32, add: u64 },
    /// A zero-byte RDMA WRITE_WITH_IMM carrying `imm` (host order; sent in network order): it
    /// consumes one posted receive of the peer, after every earlier WR of the QP.
    Imm { dst: u64, rkey: u32, imm: u32 },
}

/// An RC queue pair with its send and receive CQs (destroyed on drop, QP first).
pub(crate) struct IbQp {
    pub(crate) dev: Arc<IbDevice>,
    qp: Qp,
    pub(crate) qpn: u32,
    pub(crate) port: PortInfo,
    pub(crate) send_cq: IbCq,
    /// Receives of write-with-immediate (HostNoAtomic mode).
    pub(crate) recv_cq: IbCq,
    /// The send-queue depth asked for (the provider may grant more).
    pub(crate) max_send_wr: u32,
    pub(crate) limits: QpLimits,
}

impl Drop for IbQp {
    fn drop(&mut self) {
        // SAFETY: the handle is dropped unused right after (its CQs, fields, drop after this
        // body).
        if let Err(e) = unsafe { r::destroy_qp(&self.qp) } {
            warn!(target: "mscclpp::ib", "{self:?}: {e}");
        }
    }
}

impl fmt::Debug for IbQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QP {} on {} port {}", self.qpn, self.dev.name, self.port.port)
    }
}

impl IbQp {
    /// Creates an RC QP on `port` and moves it to INIT with remote write and read access, and
    /// remote atomics with `atomics`.
    pub(crate) fn create(dev: &Arc<IbDevice>, port: PortInfo, limits: QpLimits, atomics: bool) -> Result<IbQp> {
        let send_cq = dev.create_cq(limits.cq_size, false)?;
        // Only a HostNoAtomic receive thread sleeps on the receive CQ.
        let recv_cq = dev.create_cq(limits.max_recv_wr.max(1), !atomics)?;
        let want_send = limits.max_send_wr.min(dev.caps.max_qp_wr).max(1);
        let cap = ibv_qp_cap {
            max_send_wr: want_send,
            max_recv_wr: limits.max_recv_wr.min(dev.caps.max_qp_wr).max(1),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        // The IbQp keeps both CQs and destroys the QP before them.
        let qp = r::create_qp(&dev.pd, &send_cq.cq, &recv_cq.cq, cap)
            .map_err(|e| e.on(format_args!(" (RC, {want_send} send WRs) on {}", dev.name)))?;
        let qpn = qp.num();
        let me = IbQp { dev: dev.clone(), qp, qpn, port, send_cq, recv_cq, max_send_wr: want_send, limits };
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_INIT, ..Default::default() };
        a.pkey_index = 0;
        a.port_num = port.port;
        a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        if atomics {
            a.qp_access_flags |= IBV_ACCESS_REMOTE_ATOMIC;
        }
        me.modify(&mut a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT")?;
        Ok(me)
    }

    fn modify(&self, a: &mut ibv_qp_attr, mask: c_int, to: &str) -> Result<()> {
        r::modify_qp(&self.qp, a, mask).map_err(|e| e.on(format_args!("({to}) on {self:?}")))
    }

    /// This QP as a peer needs it.
    pub(crate) fn info(&self) -> QpInfo {
        QpInfo {
            lid: self.port.lid,
            qpn: self.qpn,
            gid: self.port.gid,
            mtu: self.port.active_mtu.min(255) as u8,
            link_layer: self.port.link_layer,
            rd_atomic: self.dev.caps.max_qp_rd_atom.min(16),
        }
    }

    /// INIT -> RTR -> RTS against `remote`, with the smaller of the two MTUs.
    pub(crate) fn connect(&self, remote: &QpInfo) -> Result<()> {
        let mtu = (self.port.active_mtu.min(255) as u8).min(remote.mtu).max(1);
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_RTR, ..Default::default() };
        a.path_mtu = mtu as u32;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = 0;
        a.max_dest_rd_atomic = self.dev.caps.max_qp_rd_atom.min(16);
        a.min_rnr_timer = 0x12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = self.port.port;
        if self.port.is_ethernet() || remote.gid != [0; 16] && remote.lid == 0 {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = self.port.gid_index;
            a.ah_attr.grh.hop_limit = 255;
        }
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_RTS, ..Default::default() };
        a.timeout = self.limits.timeout;
        a.retry_cnt = self.limits.retry_cnt.min(7);
        a.rnr_retry = 7;
        a.sq_psn = 0;
        a.max_rd_atomic = self.dev.caps.max_qp_init_rd_atom.min(16).min(remote.rd_atomic);
        self.modify(
            &mut a,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Posts `ops` as one linked list: WR `i` gets `wr_id = first_seq + i`, and only the last is
    /// signalled. The NIC checks every key and range against its MRs (a bad one is an error
    /// completion, never a stray access).
    pub(crate) fn post_batch(&self, ops: &[SendOp], first_seq: u64) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ibv_sge> = Vec::with_capacity(ops.len());
        let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let mut num_sge = 1;
            let mut imm_data = 0;
            let (opcode, sge, wr) = match *op {
                SendOp::Write { src, lkey, len, dst, rkey } => (
                    IBV_WR_RDMA_WRITE,
                    ibv_sge { addr: src, length: len, lkey },
                    ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr: dst, rkey } },
                ),
                SendOp::FetchAdd { src, lkey, dst, rkey, add } => (
                    IBV_WR_ATOMIC_FETCH_AND_ADD,
                    ibv_sge { addr: src, length: 8, lkey },
                    ibv_send_wr_wr { atomic: ibv_send_wr_atomic { remote_addr: dst, compare_add: add, swap: 0, rkey } },
                ),
                SendOp::Imm { dst, rkey, imm } => {
                    num_sge = 0;
                    imm_data = imm.to_be();
                    (
                        IBV_WR_RDMA_WRITE_WITH_IMM,
                        ibv_sge::default(),
                        ibv_send_wr_wr { rdma: ibv_send_wr_rdma { remote_addr: dst, rkey } },
                    )
                }
            };
            sges.push(sge);
            wrs.push(ibv_send_wr {
                wr_id: first_seq + i as u64,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge,
                opcode,
                send_flags: if i + 1 == ops.len() { IBV_SEND_SIGNALED } else { 0 },
                imm_data,
                wr,
                qp_type_xrc_remote_srqn: 0,
                bind_mw_or_tso: [0; 6],
            });
        }
        // result::post_send links the list (next, sg_list) and checks opcodes and flags.
        r::post_send(&self.qp, &mut wrs, &mut sges).map_err(|e| e.on(format_args!(" on {self:?}")))
    }

    /// Takes up to `out.len()` receive completions.
    pub(crate) fn poll_recv(&self, out: &mut [ibv_wc]) -> Result<usize> {
        self.recv_cq.poll(out)
    }

    /// Asks for an event on the receive CQ's next completion (poll again before sleeping).
    pub(crate) fn arm_recv(&self) -> Result<()> {
        self.recv_cq.arm()
    }

    /// Sleeps until the armed receive CQ raises an event or `timeout` passes.
    pub(crate) fn wait_recv(&self, timeout: Duration) -> Result<()> {
        self.recv_cq.wait_event(timeout).map(|_| ())
    }

    /// Posts one receive without scatter entries (for write-with-immediate).
    pub(crate) fn post_recv_empty(&self, wr_id: u64) -> Result<()> {
        r::post_recv(&self.qp, wr_id, None).map_err(|e| e.on(format_args!(" on {self:?}")))
    }
}
