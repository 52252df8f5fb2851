//! Endpoints: one side of a future connection, and their serialized form.

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::Mutex;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::{get_device, put_device};
use crate::net::{get_addr, put_addr};
use crate::sync::lock;
use crate::transport::{Device, EndpointConfig, IbMode, Transport};
use crate::wire::{Reader, Writer};

const MAGIC: &[u8; 4] = b"MSEP";
/// 2: CUDA IPC endpoints carry the owner's pid and start time.
const VERSION: u16 = 2;

/// Default bound on queued operations of an Ethernet connection (see
/// [`Connection::max_write_queue_size`](crate::Connection::max_write_queue_size)). 2048 since
/// session 26 (1024 before): the sender asks for an acknowledgement at half of it, and fewer
/// acknowledgements mean fewer, larger landings of small GPU writes on the receiver.
pub const DEFAULT_ETHERNET_QUEUE: usize = 2048;

/// Transport-specific part of an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EndpointKind {
    /// Where the endpoint listens, and the secret a connecting peer must present.
    Ethernet { addr: SocketAddr, secret: [u8; 16] },
    /// CUDA IPC: the owner's pid and its start time (ticks since boot, `/proc/<pid>/stat`), so
    /// that a peer of the same pid namespace can watch it exit (a pidfd); pid 0 when unknown.
    CudaIpc { pid: u32, start_time: u64 },
    /// The queue pair to connect to, and how its owner signals.
    Ib { qp: crate::platform::verbs::dev::QpInfo, mode: IbMode },
}

/// The part of an endpoint that travels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EndpointDesc {
    pub(crate) transport: Transport,
    pub(crate) device: Device,
    pub(crate) host_hash: u64,
    pub(crate) process_hash: u64,
    pub(crate) max_write_queue_size: u32,
    pub(crate) kind: EndpointKind,
}

pub(crate) struct LocalEndpoint {
    pub(crate) context: Context,
    pub(crate) config: EndpointConfig,
    /// The Ethernet acceptor (accepting since creation); taken by the one connection made
    /// from this endpoint.
    pub(crate) acceptor: Mutex<Option<Arc<crate::conn::ethernet::Acceptor>>>,
    /// The IB queue pair (in INIT since creation); taken by the one connection made from it.
    pub(crate) ib_qp: Mutex<Option<crate::platform::verbs::dev::IbQp>>,
}

struct EndpointInner {
    desc: EndpointDesc,
    local: Option<LocalEndpoint>,
}

/// One side of a connection: created from an [`EndpointConfig`] by
/// [`Context::create_endpoint`], serialized to the peer, and turned into a
/// [`Connection`](crate::Connection) together with the peer's endpoint.
///
/// A local endpoint makes one connection (as in MSCCL++, where an IB endpoint owns one queue pair).
///
/// C++ MSCCL++: `Endpoint`.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<EndpointInner>,
}

impl PartialEq for Endpoint {
    fn eq(&self, o: &Self) -> bool {
        self.inner.desc == o.inner.desc
    }
}
impl Eq for Endpoint {}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Endpoint");
        d.field("transport", &self.inner.desc.transport).field("device", &self.inner.desc.device);
        if let EndpointKind::Ethernet { addr, .. } = &self.inner.desc.kind {
            d.field("addr", addr);
        }
        d.field("local", &self.inner.local.is_some()).finish()
    }
}

impl Endpoint {
    /// The transport.
    pub fn transport(&self) -> Transport {
        self.inner.desc.transport
    }
    /// The device the endpoint serves.
    pub fn device(&self) -> Device {
        self.inner.desc.device
    }
    /// The owner's host hash.
    pub fn host_hash(&self) -> u64 {
        self.inner.desc.host_hash
    }
    /// The owner's process hash.
    pub fn process_hash(&self) -> u64 {
        self.inner.desc.process_hash
    }
    /// The resolved write-queue bound.
    pub fn max_write_queue_size(&self) -> usize {
        self.inner.desc.max_write_queue_size as usize
    }
    /// The listening address of an Ethernet endpoint.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match &self.inner.desc.kind {
            EndpointKind::Ethernet { addr, .. } => Some(*addr),
            _ => None,
        }
    }
    /// Whether the endpoint was created in this process (not received).
    pub fn is_local(&self) -> bool {
        self.inner.local.is_some()
    }

    pub(crate) fn desc(&self) -> &EndpointDesc {
        &self.inner.desc
    }
    pub(crate) fn local(&self) -> Option<&LocalEndpoint> {
        self.inner.local.as_ref()
    }

    /// The owner's pid and start time, for a CUDA IPC endpoint that carries them.
    pub(crate) fn owner_process(&self) -> Option<(u32, u64)> {
        match self.inner.desc.kind {
            EndpointKind::CudaIpc { pid, start_time } if pid != 0 => Some((pid, start_time)),
            _ => None,
        }
    }

    #[cfg(test)]
    pub(crate) fn from_desc_for_test(desc: EndpointDesc) -> Endpoint {
        Endpoint { inner: Arc::new(EndpointInner { desc, local: None }) }
    }

    /// The serialized form, to send to the peer.
    pub fn serialize(&self) -> Vec<u8> {
        let d = &self.inner.desc;
        let mut w = Writer::new(MAGIC, VERSION);
        w.u8(d.transport as u8);
        put_device(&mut w, d.device);
        w.u64(d.host_hash);
        w.u64(d.process_hash);
        w.u32(d.max_write_queue_size);
        match &d.kind {
            EndpointKind::Ethernet { addr, secret } => {
                w.u8(1);
                put_addr(&mut w, addr);
                w.raw(secret);
            }
            EndpointKind::CudaIpc { pid, start_time } => {
                w.u8(2);
                w.u32(*pid);
                w.u64(*start_time);
            }
            EndpointKind::Ib { qp, mode } => {
                w.u8(3);
                w.u16(qp.lid);
                w.u32(qp.qpn);
                w.raw(&qp.gid);
                w.u8(qp.mtu);
                w.u8(qp.link_layer);
                w.u8(qp.rd_atomic);
                w.u8(match mode {
                    IbMode::HostNoAtomic => 2,
                    _ => 1,
                });
            }
        }
        w.finish()
    }

    /// Rebuilds a peer's endpoint from [`serialize`](Self::serialize)d bytes.
    ///
    /// # Errors
    /// `InvalidUsage` for any input that is not a well-formed serialized endpoint (never panics).
    pub fn deserialize(bytes: &[u8]) -> Result<Endpoint> {
        let mut r = Reader::new(bytes, "serialized Endpoint", MAGIC, VERSION)?;
        let t = r.u8()?;
        let transport = Transport::from_u8(t).ok_or_else(|| r.err(format!("unknown transport {t}")))?;
        let device = get_device(&mut r)?;
        let host_hash = r.u64()?;
        let process_hash = r.u64()?;
        let max_write_queue_size = r.u32()?;
        let kind = match r.u8()? {
            1 => EndpointKind::Ethernet { addr: get_addr(&mut r)?, secret: r.array()? },
            2 => EndpointKind::CudaIpc { pid: r.u32()?, start_time: r.u64()? },
            3 => {
                let qp = crate::platform::verbs::dev::QpInfo {
                    lid: r.u16()?,
                    qpn: r.u32()?,
                    gid: r.array()?,
                    mtu: r.u8()?,
                    link_layer: r.u8()?,
                    rd_atomic: r.u8()?,
                };
                let mode = match r.u8()? {
                    1 => IbMode::Host,
                    2 => IbMode::HostNoAtomic,
                    m => return Err(r.err(format!("unknown IB mode {m}"))),
                };
                EndpointKind::Ib { qp, mode }
            }
            k => return Err(r.err(format!("unknown endpoint kind {k}"))),
        };
        r.finish()?;
        let consistent = matches!(
            (&kind, transport),
            (EndpointKind::Ethernet { .. }, Transport::Ethernet) | (EndpointKind::CudaIpc { .. }, Transport::CudaIpc)
        ) || matches!(kind, EndpointKind::Ib { .. }) && transport.is_ib();
        if !consistent {
            return Err(Error::invalid_usage(format!(
                "malformed serialized Endpoint: transport {transport} with the wrong kind of details"
            )));
        }
        let desc = EndpointDesc { transport, device, host_hash, process_hash, max_write_queue_size, kind };
        Ok(Endpoint { inner: Arc::new(EndpointInner { desc, local: None }) })
    }
}

impl crate::wire::WireForm for Endpoint {
    const WHAT: &'static str = "serialized Endpoint";
    fn to_wire(&self) -> Vec<u8> {
        self.serialize()
    }
    fn from_wire(bytes: &[u8]) -> Result<Self> {
        Self::deserialize(bytes)
    }
}

/// [`Context::create_endpoint`](crate::Context::create_endpoint)'s body.
pub(crate) fn create_endpoint(ctx: &Context, config: &EndpointConfig) -> Result<Endpoint> {
    let op = format!("creating a {} endpoint", config.transport);
    let mut ib_qp = None;
    let (kind, queue) = match config.transport {
        Transport::Ethernet => {
            let ip = match &config.ethernet.interface {
                Some(spec) => crate::net::resolve_interface(spec)?,
                None => crate::net::find_interfaces()?[0].addr,
            };
            let listener = TcpListener::bind((ip, config.ethernet.port))
                .map_err(|e| Error::io(format!("binding {ip}:{}", config.ethernet.port), e))?;
            let addr = listener.local_addr().map_err(|e| Error::io("reading the listening address", e))?;
            let mut secret = [0u8; 16];
            crate::identity::os_random(&mut secret)?;
            let queue = write_queue_size(config, DEFAULT_ETHERNET_QUEUE).map_err(|e| e.during(op.clone()))?;
            let acceptor = crate::conn::ethernet::Acceptor::start(listener, secret, ctx.inner().id)?;
            (EndpointKind::Ethernet { addr, secret }, (queue, Some(Arc::new(acceptor))))
        }
        Transport::CudaIpc => {
            let Device::Gpu(d) = config.device else {
                return Err(Error::invalid_usage("a CUDA IPC endpoint needs a GPU device (Device::Gpu)").during(op));
            };
            crate::platform::cuda::device(d).map_err(|e| e.during(op.clone()))?;
            let pid = std::process::id();
            let start_time = crate::platform::pidfd::start_time(pid).unwrap_or(0);
            let kind = EndpointKind::CudaIpc { pid, start_time };
            (kind, (config.max_write_queue_size.unwrap_or(DEFAULT_ETHERNET_QUEUE), None))
        }
        t => {
            let (kind, qp, queue) = create_ib(ctx, config, t).map_err(|e| e.during(op.clone()))?;
            ib_qp = Some(qp);
            (kind, (queue, None))
        }
    };
    let (queue, acceptor) = queue;
    let desc = EndpointDesc {
        transport: config.transport,
        device: config.device,
        host_hash: crate::identity::host_hash(),
        process_hash: crate::identity::process_hash(),
        max_write_queue_size: queue as u32,
        kind,
    };
    let local = LocalEndpoint {
        context: ctx.clone(),
        config: config.clone(),
        acceptor: Mutex::new(acceptor),
        ib_qp: Mutex::new(ib_qp),
    };
    Ok(Endpoint { inner: Arc::new(EndpointInner { desc, local: Some(local) }) })
}

/// The configured write-queue bound, or `default`; it must fit the serialized form (1..2^32).
fn write_queue_size(config: &EndpointConfig, default: usize) -> Result<usize> {
    let queue = config.max_write_queue_size.unwrap_or(default);
    if queue == 0 || queue > u32::MAX as usize {
        return Err(Error::invalid_usage(format!("max_write_queue_size {queue} must be in 1..2^32")));
    }
    Ok(queue)
}

/// The IB part of `create_endpoint`: mode, device, port and GID, and a QP in INIT.
fn create_ib(
    ctx: &Context,
    config: &EndpointConfig,
    t: Transport,
) -> Result<(EndpointKind, crate::platform::verbs::dev::IbQp, usize)> {
    let ib = &config.ib;
    let mode = match ib.mode {
        IbMode::Default => crate::env::env()?.ibv_mode.filter(|m| *m != IbMode::Default).unwrap_or(IbMode::Host),
        m => m,
    };
    let dev = ctx.inner().ib_device(t, config.device)?;
    let mode = if mode == IbMode::Host && !dev.caps.atomics {
        tracing::warn!(
            target: "mscclpp::ib",
            "{} has no RDMA atomics: {t} endpoints use HostNoAtomic mode (signals by write-with-immediate)",
            dev.name
        );
        IbMode::HostNoAtomic
    } else {
        mode
    };
    if ib.max_cq_size == 0 || ib.max_send_wr == 0 || ib.max_wr_per_send == 0 || ib.max_cq_poll_num == 0 {
        return Err(Error::invalid_usage(format!(
            "IB limits must be positive (max_cq_size {}, max_send_wr {}, max_wr_per_send {}, max_cq_poll_num {})",
            ib.max_cq_size, ib.max_send_wr, ib.max_wr_per_send, ib.max_cq_poll_num
        )));
    }
    let queue = write_queue_size(config, ib.max_cq_size as usize)?;
    let port = dev.choose_port(ib.port, ib.gid_index)?;
    let limits = crate::platform::verbs::dev::QpLimits {
        max_send_wr: ib.max_send_wr,
        max_recv_wr: ib.max_recv_wr,
        cq_size: ib.max_cq_size,
        timeout: ib.timeout,
        retry_cnt: ib.retry_cnt,
    };
    let qp = crate::platform::verbs::dev::IbQp::create(&dev, port, limits, mode == IbMode::Host)?;
    Ok((EndpointKind::Ib { qp: qp.info(), mode }, qp, queue))
}

impl LocalEndpoint {
    pub(crate) fn take_ib_qp(&self) -> Option<crate::platform::verbs::dev::IbQp> {
        lock(&self.ib_qp).take()
    }

    pub(crate) fn take_acceptor(&self) -> Option<Arc<crate::conn::ethernet::Acceptor>> {
        lock(&self.acceptor).take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any valid endpoint description: every kind (Ethernet over IPv4 and IPv6, CUDA IPC, IB on
    /// each of the 8 ports in both signalling modes), host or GPU.
    fn arb_desc() -> impl Strategy<Value = EndpointDesc> {
        let ethernet = (any::<std::net::IpAddr>(), any::<u16>(), any::<[u8; 16]>()).prop_map(|(ip, port, secret)| {
            (Transport::Ethernet, EndpointKind::Ethernet { addr: SocketAddr::new(ip, port), secret })
        });
        let ib = (0usize..8, any::<u16>(), any::<u32>(), any::<[u8; 16]>(), any::<[u8; 3]>(), any::<bool>()).prop_map(
            |(n, lid, qpn, gid, m, no_atomic)| {
                let qp =
                    crate::platform::verbs::dev::QpInfo { lid, qpn, gid, mtu: m[0], link_layer: m[1], rd_atomic: m[2] };
                let mode = if no_atomic { IbMode::HostNoAtomic } else { IbMode::Host };
                (Transport::ib(n).unwrap_or(Transport::IB0), EndpointKind::Ib { qp, mode })
            },
        );
        let ipc = (any::<u32>(), any::<u64>())
            .prop_map(|(pid, start_time)| (Transport::CudaIpc, EndpointKind::CudaIpc { pid, start_time }));
        let kind = prop_oneof![ethernet, ipc, ib];
        (kind, any::<Option<u32>>(), any::<[u64; 2]>(), any::<u32>()).prop_map(|((transport, kind), gpu, h, q)| {
            EndpointDesc {
                transport,
                device: gpu.map(Device::Gpu).unwrap_or(Device::Cpu),
                host_hash: h[0],
                process_hash: h[1],
                max_write_queue_size: q,
                kind,
            }
        })
    }

    fn from_desc(desc: EndpointDesc) -> Endpoint {
        Endpoint { inner: Arc::new(EndpointInner { desc, local: None }) }
    }

    proptest! {
        #[test]
        fn wire_form(desc in arb_desc(), junk in proptest::collection::vec(any::<u8>(), 0..200)) {
            let e = from_desc(desc);
            crate::wire::check::check_value(&e);
            prop_assert_eq!(Endpoint::deserialize(&e.serialize()).unwrap(), e);
            crate::wire::check::check_bytes::<Endpoint>(&junk);
            let mut framed = b"MSEP\x02\x00".to_vec();
            framed.extend_from_slice(&junk);
            crate::wire::check::check_bytes::<Endpoint>(&framed);
        }
    }

    #[test]
    fn transport_and_kind_must_agree() {
        let e = from_desc(EndpointDesc {
            transport: Transport::CudaIpc,
            device: Device::Cpu,
            host_hash: 1,
            process_hash: 2,
            max_write_queue_size: 3,
            kind: EndpointKind::CudaIpc { pid: 4, start_time: 5 },
        });
        let mut b = e.serialize();
        b[6] = Transport::Ethernet as u8;
        assert!(Endpoint::deserialize(&b).unwrap_err().to_string().contains("wrong kind of details"));
    }

    #[test]
    fn ethernet_endpoint_listens() {
        let ctx = Context::new();
        let ep =
            ctx.create_endpoint(&EndpointConfig::new(Transport::Ethernet).ethernet_interface("127.0.0.1")).unwrap();
        let addr = ep.socket_addr().unwrap();
        assert!(addr.ip().is_loopback() && addr.port() != 0);
        assert_eq!(ep.max_write_queue_size(), DEFAULT_ETHERNET_QUEUE);
        std::net::TcpStream::connect(addr).unwrap();
        let back = Endpoint::deserialize(&ep.serialize()).unwrap();
        assert_eq!(back, ep);
        assert!(!back.is_local());
        assert!(ctx.create_endpoint(&EndpointConfig::new(Transport::Ethernet).ethernet_interface("nope0")).is_err());
    }
}
