//! The context: per-process state that registrations, endpoints and connections share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::platform::cuda::GpuRegion;
use crate::platform::hostmem::Region;
use crate::sync::lock;
use crate::transport::{Device, Transport, TransportFlags};

pub(crate) struct ContextInner {
    /// Random per-context id, so that a memory names the context it belongs to.
    pub(crate) id: u64,
    next_region: AtomicU64,
    /// Live registrations by id. Weak: a registration leaves when its last handle goes.
    regions: Mutex<HashMap<u64, Weak<LocalRegion>>>,
    /// Threads blocked in `wait_tokens`.
    token_waiters: AtomicUsize,
    /// Bumped whenever a peer's operation changes a word of this context's memory.
    token_gen: Mutex<u64>,
    token_cond: Condvar,
    /// One non-blocking stream per GPU for CUDA IPC connections.
    cuda_streams: Mutex<Vec<Arc<crate::platform::cuda::Stream>>>,
    /// RDMA devices: names set by `set_ib_device`, choices made, devices opened.
    ib: Mutex<IbDevices>,
}

#[derive(Default)]
struct IbDevices {
    /// Per IB index, the name given to `Context::set_ib_device`.
    names: [Option<String>; 8],
    /// The device chosen for (IB index, GPU or host).
    chosen: HashMap<(usize, Option<u32>), String>,
    /// Opened devices by name (one context and PD per device, shared by every use).
    opened: HashMap<String, Arc<crate::platform::verbs::dev::IbDevice>>,
}

/// A new stream for CUDA IPC work on `dev` (a context's shared one, or a lingering connection's
/// own), of the priority `MSCCLPP_CUDAIPC_STREAM_PRIORITY` asks: `greatest` is an experiment (see
/// the hardware-queue probe of `mscclpp-perf device`) for programs whose streams share hardware
/// queues.
pub(crate) fn new_ipc_stream(dev: &Arc<crate::platform::cuda::GpuDevice>) -> Result<crate::platform::cuda::Stream> {
    if crate::env::env()?.cudaipc_greatest_priority == Some(true) {
        crate::platform::cuda::Stream::with_priority(dev, true)
    } else {
        crate::platform::cuda::Stream::new(dev)
    }
}

/// The CUDA IPC streams of this process's contexts (one per context and GPU), while they live.
static IPC_STREAMS: Mutex<Vec<(u32, std::sync::Weak<crate::platform::cuda::Stream>)>> = Mutex::new(Vec::new());

/// Says once, when a second live context of this process starts CUDA IPC work on the same GPU
/// (ranks as threads), that the driver's default of 8 hardware queues is too few for their
/// streams unless `CUDA_DEVICE_MAX_CONNECTIONS` raises it: a rank's launch can then wait behind a
/// peer's queued launches that wait for it, until a device wait times out (docs/design.md,
/// "Hardware queues and ranks as threads"). With `CUDA_DEVICE_MAX_CONNECTIONS=1` (Megatron-LM's
/// setting) it says so at the first context already: the connection stream then shares the one
/// queue with the kernels that wait for its copies.
fn warn_if_queues_shared(gpu: u32, stream: &Arc<crate::platform::cuda::Stream>) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let n = {
        let mut v = lock(&IPC_STREAMS);
        v.retain(|(_, w)| w.strong_count() > 0);
        v.push((gpu, Arc::downgrade(stream)));
        v.iter().filter(|(g, _)| *g == gpu).count()
    };
    if let Some(w) = shared_queue_warning(gpu, n, std::env::var(crate::platform::cuda::HW_QUEUES_VAR).ok().as_deref()) {
        WARNED.call_once(|| tracing::warn!(target: "mscclpp::gpu", "{w}"));
    }
}

/// The warning of [`warn_if_queues_shared`] for `live` contexts on GPU `gpu` and the variable's
/// value: always with one queue; otherwise `None` when one context uses the GPU or the variable
/// gives the most queues.
fn shared_queue_warning(gpu: u32, live: usize, var: Option<&str>) -> Option<String> {
    use crate::platform::cuda::{HW_QUEUES_MAX, HW_QUEUES_VAR};
    let queues = var.and_then(|v| v.trim().parse::<u32>().ok());
    if queues == Some(1) {
        return Some(format!(
            "{HW_QUEUES_VAR}=1: every stream of this process on GPU{gpu} shares one hardware queue, so a CUDA IPC copy or token write of the proxy can wait behind a launch queued after a kernel that waits for it (a device timeout follows); raise {HW_QUEUES_VAR}, or queue no launch behind a kernel that waits on a PortChannel over CUDA IPC"
        ));
    }
    if live < 2 {
        return None;
    }
    if queues.is_some_and(|q| q >= HW_QUEUES_MAX) {
        return None;
    }
    Some(format!(
        "{live} ranks of this process use GPU{gpu} (ranks as threads) with {HW_QUEUES_VAR}={}: their streams share the GPU's hardware queues, so a rank's kernel can wait behind a peer's queued launches that wait for it (a device timeout follows); set {HW_QUEUES_VAR}={HW_QUEUES_MAX} before CUDA starts (mscclpp::gpu::use_all_hw_queues)",
        queues.map_or_else(|| var.map_or("unset (8)".to_string(), |v| format!("{v:?}")), |q| q.to_string())
    ))
}

impl ContextInner {
    pub(crate) fn next_region_id(&self) -> u64 {
        self.next_region.fetch_add(1, Ordering::Relaxed)
    }
    pub(crate) fn remember_region(&self, r: &Arc<LocalRegion>) {
        lock(&self.regions).insert(r.id, Arc::downgrade(r));
    }
    pub(crate) fn forget_region(&self, id: u64) {
        lock(&self.regions).remove(&id);
    }
    /// The live registration `id`, kept alive for as long as the caller holds the `Arc`.
    pub(crate) fn lookup_region(&self, id: u64) -> Option<Arc<LocalRegion>> {
        lock(&self.regions).get(&id).and_then(Weak::upgrade)
    }

    /// This context's CUDA IPC stream on `dev`, created on first use.
    pub(crate) fn cuda_stream(
        &self,
        dev: &Arc<crate::platform::cuda::GpuDevice>,
    ) -> Result<Arc<crate::platform::cuda::Stream>> {
        let mut v = lock(&self.cuda_streams);
        if let Some(s) = v.iter().find(|s| s.dev.ordinal == dev.ordinal) {
            return Ok(s.clone());
        }
        let s = Arc::new(new_ipc_stream(dev)?);
        v.push(s.clone());
        warn_if_queues_shared(dev.ordinal, &s);
        Ok(s)
    }

    /// The RDMA device of `IBn` (`t`) for memory or endpoints on `device`, opened on first use:
    /// the name given to `Context::set_ib_device`, else entry n of `MSCCLPP_HCA_DEVICES`, else for
    /// a GPU the n-th closest NIC by PCIe topology, else the n-th device.
    pub(crate) fn ib_device(&self, t: Transport, device: Device) -> Result<Arc<crate::platform::verbs::dev::IbDevice>> {
        let i = t.ib_index().ok_or_else(|| Error::internal(format!("{t} is not an IB transport")))?;
        let gpu = match device {
            Device::Gpu(g) => Some(g),
            Device::Cpu => None,
        };
        let mut st = lock(&self.ib);
        let name = match st.chosen.get(&(i, gpu)) {
            Some(n) => n.clone(),
            None => {
                let n = self.choose_ib_device(i, t, gpu, &st.names)?;
                st.chosen.insert((i, gpu), n.clone());
                n
            }
        };
        if let Some(d) = st.opened.get(&name) {
            return Ok(d.clone());
        }
        let d = crate::platform::verbs::dev::IbDevice::open(&name)
            .map_err(|e| e.during(format!("opening {name} for {t}")))?;
        st.opened.insert(name, d.clone());
        Ok(d)
    }

    fn choose_ib_device(
        &self,
        i: usize,
        t: Transport,
        gpu: Option<u32>,
        names: &[Option<String>; 8],
    ) -> Result<String> {
        if let Some(n) = &names[i] {
            return Ok(n.clone());
        }
        if let Some(list) = crate::env::env()?.hca_devices.as_ref() {
            return list.get(i).cloned().ok_or_else(|| {
                Error::invalid_usage(format!(
                    "{t}: MSCCLPP_HCA_DEVICES names {} device(s) ({}), none for {t}",
                    list.len(),
                    list.join(",")
                ))
            });
        }
        let all = crate::platform::verbs::devices()?;
        let missing = || {
            Error::not_available(format!(
                "no IB transport {t}: this machine has {} RDMA device(s) ({})",
                all.len(),
                all.join(", ")
            ))
        };
        let Some(g) = gpu else {
            return all.get(i).cloned().ok_or_else(missing);
        };
        let bus = crate::platform::cuda::pci_bus_id(g)?;
        let ranked = crate::platform::topo::rank_nics(std::path::Path::new("/sys"), &bus, &all);
        let pick = ranked.get(i).ok_or_else(missing)?;
        tracing::info!(
            target: "mscclpp::ib",
            "{t} for GPU{g}: {} ({}; order: {}); set MSCCLPP_HCA_DEVICES to choose",
            pick.name,
            pick.why,
            ranked.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")
        );
        Ok(pick.name.clone())
    }

    /// Tells waiters that a peer changed a token word (transports call this after applying
    /// token updates and atomics). Cheap when nobody waits.
    pub(crate) fn notify_tokens(&self) {
        // SeqCst pairs with the SeqCst increment in `wait_tokens`: either the waiter sees the
        // new token value after registering, or we see the waiter and wake it.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.token_waiters.load(Ordering::SeqCst) > 0 {
            *lock(&self.token_gen) += 1;
            self.token_cond.notify_all();
        }
    }

    /// Blocks until `ready()` is true or `limit` passes, woken by `notify_tokens`.
    /// Returns the final value of `ready()`.
    pub(crate) fn wait_tokens(&self, limit: Duration, ready: &mut dyn FnMut() -> bool) -> bool {
        self.token_waiters.fetch_add(1, Ordering::SeqCst);
        let mut g = lock(&self.token_gen);
        let ok = ready() || {
            let seen = *g;
            let (g2, _) =
                self.token_cond.wait_timeout_while(g, limit, |g| *g == seen).unwrap_or_else(|p| p.into_inner());
            g = g2;
            ready()
        };
        drop(g);
        self.token_waiters.fetch_sub(1, Ordering::SeqCst);
        ok
    }
}

/// Where a local registration's bytes are.
#[derive(Clone, Debug)]
pub(crate) enum Mem {
    Host(Region),
    Gpu(GpuRegion),
}

impl Mem {
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Mem::Host(r) => r.addr() as u64,
            Mem::Gpu(g) => g.ptr,
        }
    }
    pub(crate) fn len(&self) -> u64 {
        match self {
            Mem::Host(r) => r.len() as u64,
            Mem::Gpu(g) => g.len as u64,
        }
    }
}

/// A registered region of the local context, kept in the context's table while it lives.
pub(crate) struct LocalRegion {
    /// IB memory regions by IB index. Declared first: fields drop in order, so the MRs are
    /// deregistered before the memory they cover can go.
    pub(crate) ib_mrs: [Option<Arc<crate::platform::verbs::dev::IbMr>>; 8],
    pub(crate) mem: Mem,
    pub(crate) id: u64,
    pub(crate) transports: TransportFlags,
    pub(crate) ctx: Weak<ContextInner>,
}

impl std::fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalRegion(#{} {:?} {})", self.id, self.mem, self.transports)
    }
}

impl Drop for LocalRegion {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx.upgrade() {
            ctx.forget_region(self.id);
        }
    }
}

/// Per-process communication state: the table of registered memory (the Ethernet receiver checks
/// every incoming write against it), and later CUDA streams and IB device contexts.
///
/// A cheap-clone handle; registrations and connections keep it alive.
///
/// C++ MSCCL++: `Context`.
///
/// Its methods are in three `impl` blocks, one per layer, since each layer only uses the ones
/// below it: here the context's own state ([`new`](Self::new), [`set_ib_device`](Self::set_ib_device),
/// [`registered_count`](Self::registered_count)); in `memory.rs` registration
/// ([`register_host`](Self::register_host), [`register_device`](Self::register_device) and, with
/// the `cudarc-slice` feature, `register_cuda_slice`); in `conn/mod.rs` endpoints and
/// connections ([`create_endpoint`](Self::create_endpoint), [`connect`](Self::connect)).
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context({:#x})", self.inner.id)
    }
}

impl Default for Context {
    fn default() -> Self {
        Self::new()
    }
}

impl Context {
    /// A new, empty context.
    pub fn new() -> Context {
        // A context id only needs to differ between contexts; fall back to the address-based
        // value if the OS random source fails.
        let id = crate::identity::random_u64().unwrap_or_else(|_| {
            crate::identity::fnv1a64(&[&std::process::id().to_le_bytes(), &now_nanos().to_le_bytes()])
        });
        Context {
            inner: Arc::new(ContextInner {
                id,
                next_region: AtomicU64::new(1),
                regions: Mutex::new(HashMap::new()),
                token_waiters: AtomicUsize::new(0),
                token_gen: Mutex::new(0),
                token_cond: Condvar::new(),
                cuda_streams: Mutex::new(Vec::new()),
                ib: Mutex::new(IbDevices::default()),
            }),
        }
    }

    pub(crate) fn inner(&self) -> &Arc<ContextInner> {
        &self.inner
    }

    /// Uses the RDMA device `name` (`mlx5_0`, `rxe0`, ...) for the IB transport `t` of this
    /// context, instead of `MSCCLPP_HCA_DEVICES` or enumeration order. Call it before the first
    /// registration or endpoint of `t`.
    ///
    /// # Errors
    /// `InvalidUsage` when `t` is not an IB transport or already uses another device.
    pub fn set_ib_device(&self, t: Transport, name: &str) -> Result<()> {
        let i = t.ib_index().ok_or_else(|| Error::invalid_usage(format!("{t} is not an IB transport")))?;
        let mut st = lock(&self.inner.ib);
        if let Some((_, used)) = st.chosen.iter().find(|((j, _), n)| *j == i && n.as_str() != name) {
            return Err(Error::invalid_usage(format!("{t} of this context already uses {used}")));
        }
        st.names[i] = Some(name.to_string());
        Ok(())
    }

    /// How many registrations of this context are alive.
    pub fn registered_count(&self) -> usize {
        lock(&self.inner.regions).values().filter(|w| w.strong_count() > 0).count()
    }
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_as_threads_are_warned_about_shared_hardware_queues() {
        assert_eq!(shared_queue_warning(0, 1, None), None);
        assert_eq!(shared_queue_warning(0, 4, Some("32")), None);
        let w = shared_queue_warning(1, 4, None).unwrap();
        assert!(w.contains("4 ranks of this process use GPU1") && w.contains("unset (8)"), "{w}");
        assert!(shared_queue_warning(0, 2, Some("8")).unwrap().contains("CUDA_DEVICE_MAX_CONNECTIONS=8"));
        assert!(shared_queue_warning(0, 2, Some("lots")).unwrap().contains("\"lots\""));
        // One queue: said for the first context already.
        let one = shared_queue_warning(2, 1, Some(" 1")).unwrap();
        assert!(
            one.contains("CUDA_DEVICE_MAX_CONNECTIONS=1") && one.contains("GPU2 shares one hardware queue"),
            "{one}"
        );
        assert_eq!(shared_queue_warning(0, 1, Some("2")), None);
    }

    #[test]
    #[allow(unsafe_code)]
    fn register_caller_memory() {
        let ctx = Context::new();
        let mut v = vec![0u8; 32];
        // SAFETY: v outlives m (dropped first below) and is not borrowed while m lives.
        let m = unsafe { ctx.register_host(v.as_mut_ptr(), v.len(), Transport::Ethernet.into()) }.unwrap();
        assert_eq!(m.len(), 32);
        assert_eq!(ctx.registered_count(), 1);
        drop(m);
        assert_eq!(ctx.registered_count(), 0);
        // SAFETY: the call fails before using the pointer.
        assert!(unsafe { ctx.register_host(std::ptr::null_mut(), 8, TransportFlags::NONE) }.is_err());
        drop(v);
    }
}
