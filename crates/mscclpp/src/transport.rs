//! Transports, transport sets, devices and endpoint configuration.

use std::fmt;
use std::ops::{BitAnd, BitAndAssign, BitOr, BitOrAssign, BitXor, BitXorAssign, Not};
use std::str::FromStr;

use crate::error::{Error, Result};

/// A way to move bytes between ranks.
///
/// C++ MSCCL++: `Transport`. The numeric values (`as u8`) match MSCCL++'s (`Unknown` is not a
/// variant here: an unset transport is `Option<Transport>::None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
#[non_exhaustive]
pub enum Transport {
    /// CUDA IPC: GPU memory of another process or GPU on the same host.
    CudaIpc = 1,
    /// InfiniBand/RoCE device 0 (see `MSCCLPP_HCA_DEVICES`).
    IB0 = 2,
    /// InfiniBand/RoCE device 1.
    IB1 = 3,
    /// InfiniBand/RoCE device 2.
    IB2 = 4,
    /// InfiniBand/RoCE device 3.
    IB3 = 5,
    /// InfiniBand/RoCE device 4.
    IB4 = 6,
    /// InfiniBand/RoCE device 5.
    IB5 = 7,
    /// InfiniBand/RoCE device 6.
    IB6 = 8,
    /// InfiniBand/RoCE device 7.
    IB7 = 9,
    /// TCP sockets, for any host, with or without a GPU.
    Ethernet = 10,
}

impl Transport {
    /// Every transport, in numeric order.
    pub const ALL: [Transport; 10] = [
        Transport::CudaIpc,
        Transport::IB0,
        Transport::IB1,
        Transport::IB2,
        Transport::IB3,
        Transport::IB4,
        Transport::IB5,
        Transport::IB6,
        Transport::IB7,
        Transport::Ethernet,
    ];

    /// The transport with MSCCL++'s numeric value `v`, if there is one.
    pub fn from_u8(v: u8) -> Option<Transport> {
        Transport::ALL.iter().copied().find(|t| *t as u8 == v)
    }

    /// `Some(n)` for `IBn`.
    pub fn ib_index(self) -> Option<usize> {
        let v = self as u8;
        (2..=9).contains(&v).then(|| (v - 2) as usize)
    }

    /// The `IBn` transport for `n` in `0..8`.
    pub fn ib(n: usize) -> Option<Transport> {
        (n < 8).then(|| Transport::ALL[1 + n])
    }

    /// Whether this is one of `IB0..IB7`.
    pub fn is_ib(self) -> bool {
        self.ib_index().is_some()
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::CudaIpc => f.write_str("IPC"),
            Transport::Ethernet => f.write_str("ETH"),
            t => write!(f, "IB{}", t.ib_index().unwrap_or(0)),
        }
    }
}

impl FromStr for Transport {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let l = s.trim().to_ascii_lowercase();
        match l.as_str() {
            "cuda-ipc" | "cudaipc" | "ipc" => Ok(Transport::CudaIpc),
            "ethernet" | "eth" | "tcp" => Ok(Transport::Ethernet),
            "ib" => Ok(Transport::IB0),
            _ => l.strip_prefix("ib").and_then(|n| n.parse::<usize>().ok()).and_then(Transport::ib).ok_or_else(|| {
                Error::invalid_usage(format!("unknown transport {s:?} (expected cuda-ipc, ethernet, ib or ib0..ib7)"))
            }),
        }
    }
}

/// A set of [`Transport`]s, as a bit set.
///
/// C++ MSCCL++: `TransportFlags`.
///
/// ```
/// use mscclpp::{Transport, TransportFlags};
/// let f = Transport::Ethernet | Transport::IB1;
/// assert!(f.has(Transport::IB1));
/// assert_eq!((f & TransportFlags::ALL_IB).count(), 1);
/// assert!(!(!f).has(Transport::Ethernet));
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TransportFlags(u16);

impl TransportFlags {
    /// The empty set.
    pub const NONE: TransportFlags = TransportFlags(0);
    /// `IB0..IB7`.
    pub const ALL_IB: TransportFlags = TransportFlags(0b11_1111_1100);
    /// Every transport.
    pub const ALL: TransportFlags = TransportFlags(0b111_1111_1110);

    /// The set holding only `t`.
    pub const fn of(t: Transport) -> TransportFlags {
        TransportFlags(1 << t as u8)
    }
    /// Whether `t` is in the set.
    pub fn has(self, t: Transport) -> bool {
        self.0 & (1 << t as u8) != 0
    }
    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// Whether the set holds every transport.
    pub fn is_all(self) -> bool {
        self == Self::ALL
    }
    /// How many transports the set holds.
    pub fn count(self) -> u32 {
        self.0.count_ones()
    }
    /// The transports in the set, in numeric order.
    pub fn iter(self) -> impl Iterator<Item = Transport> {
        Transport::ALL.into_iter().filter(move |t| self.has(*t))
    }
    /// The raw bits (bit `i` is the transport with value `i`).
    pub fn bits(self) -> u16 {
        self.0
    }
    /// The set with these bits, or `None` if a bit names no transport.
    pub fn from_bits(bits: u16) -> Option<TransportFlags> {
        (bits & !Self::ALL.0 == 0).then_some(TransportFlags(bits))
    }
}

impl fmt::Debug for TransportFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl fmt::Display for TransportFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.iter().map(|t| t.to_string()).collect();
        write!(f, "{{{}}}", names.join(","))
    }
}

impl From<Transport> for TransportFlags {
    fn from(t: Transport) -> Self {
        TransportFlags::of(t)
    }
}

impl FromIterator<Transport> for TransportFlags {
    fn from_iter<I: IntoIterator<Item = Transport>>(iter: I) -> Self {
        iter.into_iter().fold(TransportFlags::NONE, |a, t| a | t)
    }
}

macro_rules! flag_ops {
    ($tr:ident, $f:ident, $atr:ident, $af:ident, $op:tt) => {
        impl<T: Into<TransportFlags>> $tr<T> for TransportFlags {
            type Output = TransportFlags;
            fn $f(self, rhs: T) -> TransportFlags {
                TransportFlags(self.0 $op rhs.into().0)
            }
        }
        impl<T: Into<TransportFlags>> $tr<T> for Transport {
            type Output = TransportFlags;
            fn $f(self, rhs: T) -> TransportFlags {
                TransportFlags(TransportFlags::of(self).0 $op rhs.into().0)
            }
        }
        impl<T: Into<TransportFlags>> $atr<T> for TransportFlags {
            fn $af(&mut self, rhs: T) {
                self.0 = self.0 $op rhs.into().0;
            }
        }
    };
}
flag_ops!(BitOr, bitor, BitOrAssign, bitor_assign, |);
flag_ops!(BitAnd, bitand, BitAndAssign, bitand_assign, &);
flag_ops!(BitXor, bitxor, BitXorAssign, bitxor_assign, ^);

impl Not for TransportFlags {
    type Output = TransportFlags;
    fn not(self) -> TransportFlags {
        TransportFlags(!self.0 & Self::ALL.0)
    }
}

/// Where memory lives or which device a connection serves.
///
/// C++ MSCCL++: `Device` (with `DeviceType`). `#[non_exhaustive]`: other device kinds may come.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Gpu(u32),
}

impl Device {
    /// The CUDA ordinal of a GPU, `None` for host memory.
    ///
    /// ```
    /// use mscclpp::Device;
    /// assert_eq!((Device::Gpu(3).gpu_index(), Device::Cpu.gpu_index()), (Some(3), None));
    /// ```
    pub fn gpu_index(self) -> Option<u32> {
        match self {
            Device::Gpu(i) => Some(i),
            Device::Cpu => None,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("CPU"),
            Device::Gpu(i) => write!(f, "GPU{i}"),
        }
    }
}

/// How an IB connection signals semaphores.
///
/// C++ MSCCL++: `EndpointConfig::Ib::Mode`. `#[non_exhaustive]`: other modes may come.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IbMode {
    /// `MSCCLPP_IBV_MODE` decides; `Host` when it is unset.
    #[default]
    Default,
    /// RDMA atomics (FETCH_AND_ADD) carry semaphore tokens.
    Host,
    /// RDMA WRITE_WITH_IMM carries tokens, for NICs without atomics.
    HostNoAtomic,
}

impl FromStr for IbMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "default" => Ok(IbMode::Default),
            "host" => Ok(IbMode::Host),
            "host-no-atomic" | "host_no_atomic" | "hostnoatomic" => Ok(IbMode::HostNoAtomic),
            _ => Err(Error::invalid_usage(format!("unknown IB mode {s:?} (expected host, host-no-atomic or default)"))),
        }
    }
}

/// InfiniBand part of an [`EndpointConfig`], with MSCCL++'s defaults.
///
/// Start from [`Default`] and change what you need, with the setters or the fields (the struct is
/// `#[non_exhaustive]`: later versions may add settings without breaking your code).
///
/// ```
/// use mscclpp::{IbConfig, IbMode};
/// let ib = IbConfig::default().mode(IbMode::HostNoAtomic).max_cq_size(256);
/// assert_eq!((ib.mode, ib.max_cq_size, ib.max_send_wr), (IbMode::HostNoAtomic, 256, 8192));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IbConfig {
    /// Port number; `None` picks the first active port.
    pub port: Option<u8>,
    /// GID index; `None` takes `MSCCLPP_IB_GID_INDEX` or picks the RoCE v2 GID automatically.
    pub gid_index: Option<u32>,
    /// Send completion-queue depth (1024). Also the default write-queue bound of IB connections.
    pub max_cq_size: u32,
    /// Completions taken per poll (256).
    pub max_cq_poll_num: u32,
    /// Send work requests the queue pair holds (8192).
    pub max_send_wr: u32,
    /// Receive work requests kept posted in `HostNoAtomic` mode (16).
    pub max_recv_wr: u32,
    /// Work requests posted per `ibv_post_send` (64).
    pub max_wr_per_send: u32,
    /// Signalling mode.
    pub mode: IbMode,
    /// Local ACK timeout exponent: a lost packet is resent after 4.096 us * 2^timeout (18:
    /// about 1.07 s). With `retry_cnt` it bounds how long a dead peer goes unnoticed.
    pub timeout: u8,
    /// Resends before a work request fails with "retry counter exceeded" (6; at most 7). The
    /// default is 6, not NCCL's 7: soft-RoCE (`rdma_rxe`) treats 7 as "retry forever", which
    /// would turn a dead peer into a timeout instead of an error.
    pub retry_cnt: u8,
}

impl Default for IbConfig {
    fn default() -> Self {
        IbConfig {
            port: None,
            gid_index: None,
            max_cq_size: 1024,
            max_cq_poll_num: 256,
            max_send_wr: 8192,
            max_recv_wr: 16,
            max_wr_per_send: 64,
            mode: IbMode::Default,
            timeout: 18,
            retry_cnt: 6,
        }
    }
}

impl IbConfig {
    /// Sets the port number (the default picks the first active port).
    pub fn port(mut self, v: u8) -> Self {
        self.port = Some(v);
        self
    }
    /// Sets the GID index (the default takes `MSCCLPP_IB_GID_INDEX` or picks the RoCE v2 GID).
    pub fn gid_index(mut self, v: u32) -> Self {
        self.gid_index = Some(v);
        self
    }
    /// Sets the send completion-queue depth.
    pub fn max_cq_size(mut self, v: u32) -> Self {
        self.max_cq_size = v;
        self
    }
    /// Sets how many completions one poll takes.
    pub fn max_cq_poll_num(mut self, v: u32) -> Self {
        self.max_cq_poll_num = v;
        self
    }
    /// Sets how many send work requests the queue pair holds.
    pub fn max_send_wr(mut self, v: u32) -> Self {
        self.max_send_wr = v;
        self
    }
    /// Sets how many receive work requests stay posted in `HostNoAtomic` mode.
    pub fn max_recv_wr(mut self, v: u32) -> Self {
        self.max_recv_wr = v;
        self
    }
    /// Sets how many work requests one `ibv_post_send` posts.
    pub fn max_wr_per_send(mut self, v: u32) -> Self {
        self.max_wr_per_send = v;
        self
    }
    /// Sets the signalling mode.
    pub fn mode(mut self, v: IbMode) -> Self {
        self.mode = v;
        self
    }
    /// Sets the local ACK timeout exponent.
    pub fn timeout(mut self, v: u8) -> Self {
        self.timeout = v;
        self
    }
    /// Sets the resend count (at most 7).
    pub fn retry_cnt(mut self, v: u8) -> Self {
        self.retry_cnt = v;
        self
    }
}

/// Ethernet part of an [`EndpointConfig`].
///
/// Start from [`Default`] and change what you need (the struct is `#[non_exhaustive]`).
///
/// ```
/// use mscclpp::EthernetConfig;
/// let eth = EthernetConfig::default().interface("127.0.0.1").port(0);
/// assert_eq!(eth.interface.as_deref(), Some("127.0.0.1"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EthernetConfig {
    /// Where to listen: an interface name (`"eth0"`), an IP address, or `None` to choose as the
    /// bootstrap does (`MSCCLPP_SOCKET_IFNAME`, then any non-loopback interface, loopback last).
    pub interface: Option<String>,
    /// Listening port; 0 (the default) takes any free port.
    pub port: u16,
    /// How long `connect` waits for the peer (both directions), how long a `write` waits on a
    /// full queue without any progress, and how long a send waits for a peer that takes no byte
    /// (its socket full: the peer stopped or stuck; at least 1 s) before failing with `Timeout`
    /// naming the peer (default 30 s). MSCCL++'s Ethernet connection sends with no limit.
    /// `Duration::MAX` (or any limit too far to be a point in time) means no limit.
    pub connect_timeout: std::time::Duration,
}

impl Default for EthernetConfig {
    fn default() -> Self {
        EthernetConfig { interface: None, port: 0, connect_timeout: std::time::Duration::from_secs(30) }
    }
}

impl EthernetConfig {
    /// Sets where to listen: an interface name or an IP address.
    pub fn interface(mut self, iface: impl Into<String>) -> Self {
        self.interface = Some(iface.into());
        self
    }
    /// Sets the listening port (0: any free port).
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
    /// Sets how long `connect` waits for the peer, a `write` on a full queue without progress,
    /// and a send the peer takes nothing of (see the field of the same name; `Duration::MAX`:
    /// no limit).
    pub fn connect_timeout(mut self, t: std::time::Duration) -> Self {
        self.connect_timeout = t;
        self
    }
}

/// Everything needed to create an [`Endpoint`](crate::Endpoint).
///
/// Build it with [`new`](Self::new) and the setters (the struct is `#[non_exhaustive]`: later
/// versions may add settings without breaking your code; the fields stay public to read and
/// assign).
///
/// C++ MSCCL++: `EndpointConfig`.
///
/// ```
/// use mscclpp::{Device, EndpointConfig, IbConfig, IbMode, Transport};
/// let cfg = EndpointConfig::new(Transport::Ethernet).device(Device::Cpu).max_write_queue_size(64);
/// assert_eq!(cfg.ib.max_cq_size, 1024);
/// let ib = EndpointConfig::new(Transport::IB0).ib(IbConfig::default().mode(IbMode::HostNoAtomic));
/// assert_eq!(ib.ib.mode, IbMode::HostNoAtomic);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointConfig {
    /// The transport.
    pub transport: Transport,
    /// The device whose memory the connection moves.
    pub device: Device,
    /// The most operations a connection keeps in flight before `write` waits; `None` takes the
    /// transport's default.
    pub max_write_queue_size: Option<usize>,
    /// IB settings.
    pub ib: IbConfig,
    /// Ethernet settings.
    pub ethernet: EthernetConfig,
    /// CUDA IPC: copies of at most this many bytes, and the token written right after one,
    /// go through a one-block kernel (one `cuLaunchKernel`) instead of the copy engine
    /// (`cuMemcpyDtoDAsync`, then `cuStreamWriteValue64`); 0 turns it off. `None` takes
    /// `MSCCLPP_CUDAIPC_KERNEL_COPY_MAX`, else 0: **off by default**.
    ///
    /// It cuts the host's cost of a small proxied `putWithSignal` (the proxy's driver calls are
    /// most of a PortChannel round trip over CUDA IPC; `docs/performance.md` has the figures),
    /// but the copy then needs a free SM on the sending GPU: while kernels occupy every SM and
    /// wait for the copy (a grid sized to fill the GPU, or ranks that share it), it never runs
    /// and the waits end in their timeouts. And where ranks are processes sharing one GPU
    /// without MPS, each copy waits for its process's turn on the GPU (milliseconds). Set it only
    /// where the GPU keeps room for one block and the sending process has the GPU to itself or
    /// runs under MPS. MSCCL++ has no such mode (its proxy always uses the copy engine).
    pub cuda_ipc_kernel_copy_max: Option<u64>,
    /// CUDA IPC kernel copies only (`cuda_ipc_kernel_copy_max` above 0): how long the copy
    /// kernel stays on the GPU after a copy joined to its signal (a proxied `putWithSignal`),
    /// waiting for the next copy. While it waits, the proxy hands it a copy (and its signal)
    /// with a few stores to pinned host memory that the kernel polls, instead of a
    /// `cuLaunchKernel`: a PortChannel hop then costs no driver call at all (the 4-byte
    /// ping-pong over CUDA IPC took 15.7-17.2 us on an H100 where the copy engine took
    /// 24.3-28.8). Lone copies go to a kernel that is waiting, but never start one (a host
    /// thread's write, then signal, would start a kernel only to stop it). `None` takes `MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US`, else zero: **off by
    /// default** (every kernel copy is its own launch).
    ///
    /// The price, on top of kernel copies' own: while it waits the kernel holds one block of
    /// 256 threads on one SM and polls host memory across PCIe, and it is work on the
    /// connection's stream (each lingering connection gets a stream of its own), so a
    /// `cudaDeviceSynchronize` or `cuCtxSynchronize` in the program returns only once it left:
    /// up to this long after the last copy. Synchronous copies elsewhere in the process can
    /// wait for it too: host threads that polled a token with 8-byte `cuMemcpyDtoH` calls
    /// while the other side's kernel lingered saw round trips of 0.37-4.8 ms against 0.06. Anything else the connection enqueues (a copy
    /// above the limit, a signal alone, an atomic add) first tells it to leave (microseconds).
    /// Without MPS, a lingering kernel keeps the GPU in its process's time slices: other
    /// processes' kernels wait. Suited to a latency-bound proxy on a GPU with room to spare,
    /// with tens to hundreds of microseconds; every wait stays bounded (the kernel leaves when
    /// idle whatever the host does, and never stays longer than a second after its last copy,
    /// whatever this asks). MSCCL++ has no such mode.
    pub cuda_ipc_kernel_copy_linger: Option<std::time::Duration>,
}

impl EndpointConfig {
    /// A config for `transport` with every default (CPU device).
    pub fn new(transport: Transport) -> Self {
        EndpointConfig {
            transport,
            device: Device::Cpu,
            max_write_queue_size: None,
            ib: IbConfig::default(),
            ethernet: EthernetConfig::default(),
            cuda_ipc_kernel_copy_max: None,
            cuda_ipc_kernel_copy_linger: None,
        }
    }
    /// Sets the device.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
    /// Sets the write-queue bound.
    pub fn max_write_queue_size(mut self, n: usize) -> Self {
        self.max_write_queue_size = Some(n);
        self
    }
    /// Sets the Ethernet interface (a name or an IP address).
    pub fn ethernet_interface(mut self, iface: impl Into<String>) -> Self {
        self.ethernet.interface = Some(iface.into());
        self
    }
    /// Sets the IB settings.
    pub fn ib(mut self, ib: IbConfig) -> Self {
        self.ib = ib;
        self
    }
    /// Sets the Ethernet settings.
    pub fn ethernet(mut self, ethernet: EthernetConfig) -> Self {
        self.ethernet = ethernet;
        self
    }
    /// Sets [`cuda_ipc_kernel_copy_max`](Self::cuda_ipc_kernel_copy_max) (0: off).
    pub fn cuda_ipc_kernel_copy_max(mut self, bytes: u64) -> Self {
        self.cuda_ipc_kernel_copy_max = Some(bytes);
        self
    }
    /// Sets [`cuda_ipc_kernel_copy_linger`](Self::cuda_ipc_kernel_copy_linger) (zero: off).
    ///
    /// ```
    /// use mscclpp::{EndpointConfig, Transport};
    /// use std::time::Duration;
    /// let cfg = EndpointConfig::new(Transport::CudaIpc)
    ///     .cuda_ipc_kernel_copy_max(4096)
    ///     .cuda_ipc_kernel_copy_linger(Duration::from_micros(200));
    /// assert_eq!(cfg.cuda_ipc_kernel_copy_linger, Some(Duration::from_micros(200)));
    /// ```
    pub fn cuda_ipc_kernel_copy_linger(mut self, idle: std::time::Duration) -> Self {
        self.cuda_ipc_kernel_copy_linger = Some(idle);
        self
    }
}

impl Default for EndpointConfig {
    /// An Ethernet config (the transport every machine has) with every default.
    fn default() -> Self {
        EndpointConfig::new(Transport::Ethernet)
    }
}

impl From<Transport> for EndpointConfig {
    fn from(t: Transport) -> Self {
        EndpointConfig::new(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_set_operations() {
        let a = Transport::IB0 | Transport::IB3;
        let b = TransportFlags::from(Transport::IB3) | Transport::Ethernet;
        assert_eq!((a & b).iter().collect::<Vec<_>>(), vec![Transport::IB3]);
        assert_eq!((a ^ b).count(), 2);
        assert_eq!(TransportFlags::ALL_IB.count(), 8);
        assert_eq!(TransportFlags::ALL.count(), 10);
        assert!((!TransportFlags::ALL).is_empty());
        assert!(TransportFlags::ALL.is_all());
        let mut c = TransportFlags::NONE;
        c |= Transport::CudaIpc;
        c ^= Transport::CudaIpc;
        assert!(c.is_empty());
        assert_eq!(TransportFlags::from_bits(1), None);
        assert_eq!(TransportFlags::from_bits(a.bits()), Some(a));
        assert_eq!(a.to_string(), "{IB0,IB3}");
    }

    #[test]
    fn transport_names_parse_and_print() {
        for t in Transport::ALL {
            assert_eq!(Transport::from_u8(t as u8), Some(t));
            assert_eq!(t.to_string().parse::<Transport>().unwrap(), t);
        }
        assert_eq!(Transport::from_u8(0), None);
        assert_eq!(Transport::from_u8(11), None);
        assert_eq!("cuda-ipc".parse::<Transport>().unwrap(), Transport::CudaIpc);
        assert!("ib8".parse::<Transport>().is_err());
        assert_eq!(Transport::IB5.ib_index(), Some(5));
        assert_eq!(Transport::ib(7), Some(Transport::IB7));
        assert_eq!(Transport::ib(8), None);
    }

    #[test]
    fn defaults_match_mscclpp() {
        let c = IbConfig::default();
        assert_eq!(
            (c.max_cq_size, c.max_cq_poll_num, c.max_send_wr, c.max_recv_wr, c.max_wr_per_send),
            (1024, 256, 8192, 16, 64)
        );
        assert_eq!(c.mode, IbMode::Default);
        assert_eq!("host-no-atomic".parse::<IbMode>().unwrap(), IbMode::HostNoAtomic);
        assert!("atomic".parse::<IbMode>().is_err());
    }
}
