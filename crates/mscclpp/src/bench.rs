//! Not public API: raw baselines, counters and waiting helpers that `mscclpp-perf` and this
//! crate's tests use. Hidden from the docs; it may change in any release.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::buffer::{Buffer, DeviceBuffer};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::memory::RegisteredMemory;
pub use crate::platform::cuda::ipc_mapped_count;
pub use crate::platform::cuda::queue_probe::{
    PROBE_MAX_LIMIT, ProbeStream, ProbeWrite, QueueProbe, queue_map_probe, queue_probe,
};
use crate::platform::cuda::{self, GpuDevice, PinnedAlloc, Stream};
use crate::platform::pidfd::PidFd;
// Through the crate's re-exports: where these types live inside the crate may change.
use crate::sync::{BackoffPolicy, Deadline, poll_until};
use crate::transport::TransportFlags;
use crate::{Host2DeviceSemaphore, Host2HostSemaphore, Semaphore};

/// Staging work of Ethernet connections with GPU memory, counted over the whole process since it
/// started (differences between two readings give one run's): receiver landings (each time
/// received small writes were queued to the GPU), copy-engine copies to the GPU (host to device,
/// the receivers' landings and large writes), and from it (the senders' gathers and chunks); and
/// the thread time spent issuing and waiting for them, sending staged payloads, and waiting on
/// full write queues (a profile of where a connection's time goes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EthernetStagingCounts {
    /// Receiver landings that queued copies.
    pub landings: u64,
    /// Host-to-device copies queued.
    pub htod: u64,
    /// Device-to-host copies queued.
    pub dtoh: u64,
    /// Bytes of the host-to-device copies.
    pub htod_bytes: u64,
    /// Bytes of the device-to-host copies: a sender's gather reads the gaps between nearby
    /// payloads along (one copy instead of several), so this may exceed the bytes it sends.
    pub dtoh_bytes: u64,
    /// Thread time (summed over threads) in driver calls queueing work to the GPU: the
    /// receivers' copies, events and tokens.
    pub to_gpu_issue: Duration,
    /// Thread time in driver calls queueing copies from the GPU: the senders' gathers, chunks
    /// and events.
    pub from_gpu_issue: Duration,
    /// Thread time receivers waited for their copies to the GPU to finish.
    pub to_gpu_wait: Duration,
    /// Thread time senders waited for their copies from the GPU to finish.
    pub from_gpu_wait: Duration,
    /// Thread time senders spent in `sendmsg` with staged GPU payloads.
    pub send: Duration,
    /// Thread time callers of `write` (a proxy thread, a host thread) waited on a full write
    /// queue.
    pub queue_full: Duration,
    /// Acknowledgements asked for and received, on every Ethernet connection (GPU memory or
    /// not): a sender asks once half its write-queue bound is unconfirmed, and with each flush.
    pub acks: u64,
    /// The acknowledgement loop, summed over `acks`: from sending the frame that asks to the
    /// acknowledgement's arrival (the receiver lands every write before it first). A full write
    /// queue waits on this loop.
    pub ack_wait: Duration,
    /// Tokens (signals, atomic adds) received for GPU words.
    pub gpu_tokens: u64,
    /// The rounds that applied them: each queues its tokens after the copies before them and
    /// waits once for the GPU. A receiver applies the tokens already buffered behind one another
    /// in one round (`gpu_tokens / token_rounds` is how many a round carried).
    pub token_rounds: u64,
    /// Thread time receivers waited for those rounds.
    pub token_wait: Duration,
}

/// The process's [`EthernetStagingCounts`] so far.
pub fn ethernet_staging_counts() -> EthernetStagingCounts {
    use crate::conn::ethernet::stager::{
        C_ACKS, C_DTOH, C_DTOH_BYTES, C_HTOD, C_HTOD_BYTES, C_LANDINGS, C_TOKEN_ROUNDS, C_TOKENS, STAGING_COUNTS as C,
        STAGING_TIMES as T, T_ACK_WAIT, T_FROM_GPU_ISSUE, T_FROM_GPU_WAIT, T_QUEUE_FULL, T_SEND, T_TO_GPU_ISSUE,
        T_TO_GPU_WAIT, T_TOKEN_WAIT,
    };
    use std::sync::atomic::Ordering::Relaxed;
    let t = |i: usize| Duration::from_nanos(T[i].load(Relaxed));
    EthernetStagingCounts {
        landings: C[C_LANDINGS].load(Relaxed),
        htod: C[C_HTOD].load(Relaxed),
        dtoh: C[C_DTOH].load(Relaxed),
        htod_bytes: C[C_HTOD_BYTES].load(Relaxed),
        dtoh_bytes: C[C_DTOH_BYTES].load(Relaxed),
        to_gpu_issue: t(T_TO_GPU_ISSUE),
        from_gpu_issue: t(T_FROM_GPU_ISSUE),
        to_gpu_wait: t(T_TO_GPU_WAIT),
        from_gpu_wait: t(T_FROM_GPU_WAIT),
        send: t(T_SEND),
        queue_full: t(T_QUEUE_FULL),
        acks: C[C_ACKS].load(Relaxed),
        ack_wait: t(T_ACK_WAIT),
        gpu_tokens: C[C_TOKENS].load(Relaxed),
        token_rounds: C[C_TOKEN_ROUNDS].load(Relaxed),
        token_wait: t(T_TOKEN_WAIT),
    }
}

/// How CUDA IPC kernel copies went through lingering kernels
/// (`EndpointConfig::cuda_ipc_kernel_copy_linger`), counted over the process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LingerCounts {
    /// Lingering kernels launched (each with its first copy).
    pub launches: u64,
    /// Copies handed to a kernel already waiting (no driver call).
    pub posted: u64,
    /// Of those, copies the kernel may have missed because it was leaving as they were posted,
    /// then found not taken and launched again.
    pub relaunched: u64,
}

/// The process's [`LingerCounts`] so far.
pub fn linger_counts() -> LingerCounts {
    use crate::conn::linger::COUNTS as C;
    use std::sync::atomic::Ordering::Relaxed;
    LingerCounts { launches: C[0].load(Relaxed), posted: C[1].load(Relaxed), relaunched: C[2].load(Relaxed) }
}

/// Times `iters` rounds of plain copies of `size` bytes, one stream per (source, destination)
/// pair, all pairs at once (after `warmup` untimed rounds): `cuMemcpyDtoDAsync` where both
/// buffers are on one GPU, `cuMemcpyPeerAsync` between two GPUs. This is the raw copy-engine
/// baseline for CUDA IPC; two pairs in opposite directions give the bidirectional one.
pub fn baseline_copy(
    pairs: &[(&DeviceBuffer, &DeviceBuffer)],
    size: usize,
    warmup: u64,
    iters: u64,
) -> Result<Duration> {
    let mut streams = Vec::with_capacity(pairs.len());
    for (src, dst) in pairs {
        let (src, dst) = (src.region(), dst.region());
        src.check(0, size as u64)?;
        dst.check(0, size as u64)?;
        if src.dev.ordinal != dst.dev.ordinal {
            src.dev.enable_peer_access(&dst.dev)?;
        }
        streams.push(Stream::new(&src.dev)?);
    }
    let round = |n: u64| -> Result<()> {
        for _ in 0..n {
            for ((src, dst), s) in pairs.iter().zip(&streams) {
                let (src, dst) = (src.region(), dst.region());
                if src.dev.ordinal == dst.dev.ordinal {
                    s.copy_dtod(dst.ptr, src.ptr, size as u64)?;
                } else {
                    s.copy_peer(&dst.dev, dst.ptr, &src.dev, src.ptr, size)?;
                }
            }
        }
        streams.iter().try_for_each(|s| s.synchronize())
    };
    round(warmup)?;
    let t0 = Instant::now();
    round(iters)?;
    Ok(t0.elapsed())
}

/// The host cost of the driver calls a CUDA IPC put and signal can be made of, in microseconds
/// per call: each variant is issued `per_round` times back to back on one stream, `rounds`
/// times, with an untimed synchronize between rounds (so the queue never fills). `src` and `dst`
/// are device buffers of one GPU holding at least `bytes * batch` bytes. Returns `(what, us per
/// call)`; for a batch of copies also per copy. The batched copy (`cuMemcpyBatchAsync`) is left
/// out where the driver lacks it.
pub fn driver_call_costs(
    src: &DeviceBuffer,
    dst: &DeviceBuffer,
    bytes: usize,
    batch: usize,
    rounds: u32,
    per_round: u32,
) -> Result<Vec<(String, f64)>> {
    let (s, d) = (src.region(), dst.region());
    if s.dev.ordinal != d.dev.ordinal {
        return Err(Error::invalid_usage("driver_call_costs: both buffers must be on one GPU"));
    }
    let batch = batch.max(1);
    s.check(0, (bytes * batch) as u64)?;
    d.check(0, (bytes * batch) as u64)?;
    let stream = Stream::new(&s.dev)?;
    let n = bytes as u64;
    // `per_round` calls between synchronizations (so the queue never fills and blocks a call).
    let time = |per_round: u32, issue: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        issue()?;
        stream.synchronize()?;
        let mut total = Duration::ZERO;
        for _ in 0..rounds {
            let t0 = Instant::now();
            for _ in 0..per_round {
                issue()?;
            }
            total += t0.elapsed();
            stream.synchronize()?;
        }
        Ok(total.as_secs_f64() * 1e6 / f64::from(rounds.max(1) * per_round.max(1)))
    };
    let token = || -> Result<()> {
        match stream.write_value64(d.ptr, 1)? {
            true => Ok(()),
            false => Err(Error::new(crate::ErrorKind::NotAvailable, "cuStreamWriteValue64 is not supported here")),
        }
    };
    let mut out = vec![
        (format!("cuMemcpyDtoDAsync {bytes} B"), time(per_round, &mut || stream.copy_dtod(d.ptr, s.ptr, n))?),
        (format!("cuMemcpyAsync {bytes} B"), time(per_round, &mut || stream.copy_unified(d.ptr, s.ptr, n))?),
        ("cuStreamWriteValue64".to_string(), time(per_round, &mut || token())?),
        (
            format!("cuMemcpyDtoDAsync {bytes} B + cuStreamWriteValue64 (a putWithSignal)"),
            time(per_round, &mut || stream.copy_dtod(d.ptr, s.ptr, n).and_then(|_| token()))?,
        ),
    ];
    // The kernel that copies and then writes the token (CUDA IPC's kernel copies): one launch.
    // The token is the last aligned word of the destination, after the copied bytes.
    let words = (bytes * batch) as u64 & !7;
    if n.next_multiple_of(8) + 8 <= words {
        let k = cuda::load_put_token(&s.dev)?;
        let tok = d.ptr + words - 8;
        out.push((
            format!(
                "one kernel copying {bytes} B then writing a token (cuLaunchKernel, MSCCLPP_CUDAIPC_KERNEL_COPY_MAX)"
            ),
            time(per_round, &mut || stream.put_token(k, d.ptr, s.ptr, n, tok, 1))?,
        ));
    }
    if cuda::has_batch_copy() {
        // The arrays are built once, outside the timing.
        let mut dsts: Vec<u64> = (0..batch as u64).map(|i| d.ptr + i * n).collect();
        let mut srcs: Vec<u64> = (0..batch as u64).map(|i| s.ptr + i * n).collect();
        let mut sizes = vec![bytes; batch];
        let one = time(per_round, &mut || stream.copy_batch(&mut dsts[..1], &mut srcs[..1], &mut sizes[..1]))?;
        out.push((format!("cuMemcpyBatchAsync, 1 copy of {bytes} B"), one));
        // As many copies per round as the single calls above, in fewer calls.
        let calls = (per_round / batch as u32).max(1);
        let per_call = time(calls, &mut || stream.copy_batch(&mut dsts, &mut srcs, &mut sizes))?;
        out.push((format!("cuMemcpyBatchAsync, {batch} copies of {bytes} B, per call"), per_call));
        out.push((format!("cuMemcpyBatchAsync, {batch} copies of {bytes} B, per copy"), per_call / batch as f64));
    }
    Ok(out)
}

/// Times `iters` plain 8-byte host-to-device copies from pinned memory, each followed by a stream
/// synchronize: the raw small-operation latency baseline. Returns the time per operation.
pub fn baseline_h2d_8b(dst: &DeviceBuffer, warmup: u64, iters: u64) -> Result<Duration> {
    let r = dst.region();
    r.check(0, 8)?;
    h2d_8b(&r.dev, r.ptr, warmup, iters)
}

/// As [`baseline_h2d_8b`], into GPU memory registered by any process of this host (a peer's
/// memory is mapped through CUDA IPC, as a CUDA IPC connection would map it), from GPU `device`.
pub fn baseline_h2d_8b_into(dst: &RegisteredMemory, device: u32, warmup: u64, iters: u64) -> Result<Duration> {
    dst.check_bounds(0, 8)?;
    let dev = cuda::device(device)?;
    let p = dst.gpu_ptr(&dev)?;
    h2d_8b(&dev, p, warmup, iters)
}

fn h2d_8b(dev: &Arc<GpuDevice>, dst: u64, warmup: u64, iters: u64) -> Result<Duration> {
    let s = Stream::new(dev)?;
    let slot = PinnedAlloc::region(dev, 8)?;
    let mut t0 = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            t0 = Instant::now();
        }
        slot.write(0, &i.to_le_bytes())?;
        s.copy_htod(dst, slot.as_mut_ptr(), 8)?;
        s.synchronize()?;
    }
    Ok(t0.elapsed() / iters.max(1) as u32)
}

/// As [`baseline_copy`] between a local buffer and a peer process's GPU memory mapped here
/// through CUDA IPC (as a CUDA IPC connection maps it): `cuMemcpyDtoDAsync` on the mapped
/// pointer, `local` -> `remote` when `to_remote`, else `remote` -> `local`. With `sync_each`,
/// each copy is followed by a stream synchronize (the copy's latency); otherwise the copies are
/// queued and synchronized once.
pub fn baseline_copy_remote(
    local: &DeviceBuffer,
    remote: &RegisteredMemory,
    to_remote: bool,
    size: usize,
    warmup: u64,
    iters: u64,
    sync_each: bool,
) -> Result<Duration> {
    let l = local.region();
    l.check(0, size as u64)?;
    remote.check_bounds(0, size as u64)?;
    let r = remote.gpu_ptr(&l.dev)?;
    let (dst, src) = if to_remote { (r, l.ptr) } else { (l.ptr, r) };
    let s = Stream::new(&l.dev)?;
    let round = |n: u64| -> Result<()> {
        for _ in 0..n {
            s.copy_dtod(dst, src, size as u64)?;
            if sync_each {
                s.synchronize()?;
            }
        }
        s.synchronize()
    };
    round(warmup)?;
    let t0 = Instant::now();
    round(iters)?;
    Ok(t0.elapsed())
}

/// Waits up to `limit` for `child` to exit, woken by the exit itself (a pidfd), not by a poll
/// interval; `Ok(None)` when it still runs at the limit (the caller decides whether to kill it).
/// Before Linux 5.3 (no `pidfd_open`) it checks every 10 ms instead.
///
/// # Errors
/// `System` when waiting for the child fails.
pub fn wait_exit(child: &mut std::process::Child, limit: Duration) -> Result<Option<std::process::ExitStatus>> {
    let deadline = Deadline::after(limit);
    // The child is ours and not yet reaped, so its pid names it until `try_wait` reaps it.
    let pidfd = PidFd::open(child.id(), None).ok();
    loop {
        if let Some(s) = child.try_wait().map_err(|e| Error::io(format!("waiting for process {}", child.id()), e))? {
            return Ok(Some(s));
        }
        if deadline.expired() {
            return Ok(None);
        }
        match &pidfd {
            Some(p) => {
                p.wait_exit(deadline.remaining())?;
            }
            None => std::thread::sleep(deadline.remaining().min(Duration::from_millis(10))),
        }
    }
}

/// Polls `ready` until it holds (`true`) or `limit` passes (`false`), backing off as the
/// library's own waits do (spin, then yield, then sleeps of up to 1 ms): for a condition that has
/// no notification to block on, such as a counter or a file in `/proc`.
pub fn wait_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    poll_until(limit, BackoffPolicy::FAST, || Ok::<bool, std::convert::Infallible>(ready())).unwrap_or(false)
}

/// Which memory buffers and semaphore tokens live in: `mscclpp-perf --memory` and the connection
/// test suite's harnesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// Host buffers ([`Buffer`]) and [`Host2HostSemaphore`]s.
    Host,
    /// GPU buffers ([`DeviceBuffer`]) and [`Host2DeviceSemaphore`]s.
    Gpu,
}

impl Memory {
    /// A buffer of `len` zero bytes in this memory (on GPU `device`; ignored for host memory),
    /// registered for `transports`.
    ///
    /// # Errors
    /// As [`Buffer::new`] and [`DeviceBuffer::new`].
    pub fn alloc(self, ctx: &Context, device: u32, len: usize, transports: TransportFlags) -> Result<Mem> {
        Ok(match self {
            Memory::Host => Mem::Host(Buffer::new(ctx, len, transports)?),
            Memory::Gpu => Mem::Gpu(DeviceBuffer::new(ctx, device, len, transports)?),
        })
    }

    /// The semaphore whose token lives in this memory.
    ///
    /// # Errors
    /// As [`Host2HostSemaphore::new`] and [`Host2DeviceSemaphore::new`].
    pub fn semaphore(self, sem: Semaphore) -> Result<Sem> {
        Ok(match self {
            Memory::Host => Sem::Host(Host2HostSemaphore::new(sem)?),
            Memory::Gpu => Sem::Gpu(Host2DeviceSemaphore::new(sem)?),
        })
    }
}

/// A buffer in host or GPU memory, one API over both.
#[derive(Clone)]
pub enum Mem {
    Host(Buffer),
    Gpu(DeviceBuffer),
}

impl Mem {
    /// The registration.
    pub fn memory(&self) -> &RegisteredMemory {
        match self {
            Mem::Host(b) => b.memory(),
            Mem::Gpu(b) => b.memory(),
        }
    }

    /// Copies `data` in at `off`.
    ///
    /// # Errors
    /// `InvalidUsage` out of bounds; a CUDA error for GPU memory.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<()> {
        match self {
            Mem::Host(b) => b.write(off, data),
            Mem::Gpu(b) => b.write(off, data),
        }
    }

    /// Copies `out.len()` bytes out from `off`.
    ///
    /// # Errors
    /// `InvalidUsage` out of bounds; a CUDA error for GPU memory.
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<()> {
        match self {
            Mem::Host(b) => b.read(off, out),
            Mem::Gpu(b) => b.read(off, out),
        }
    }

    /// Sets `len` bytes from `off` to `byte`.
    ///
    /// # Errors
    /// `InvalidUsage` out of bounds; a CUDA error for GPU memory.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> Result<()> {
        match self {
            Mem::Host(b) => b.fill(off, len, byte),
            Mem::Gpu(b) => b.fill(off, len, byte),
        }
    }

    /// A copy of the whole buffer.
    ///
    /// # Errors
    /// A CUDA error for GPU memory.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        match self {
            Mem::Host(b) => Ok(b.to_vec()),
            Mem::Gpu(b) => b.to_vec(),
        }
    }

    /// The 8-byte word at `off`, read once (host memory: an acquire load).
    ///
    /// # Errors
    /// `InvalidUsage` out of bounds or unaligned; a CUDA error for GPU memory.
    pub fn read_u64(&self, off: usize) -> Result<u64> {
        match self {
            Mem::Host(b) => Ok(b.atomic_u64(off)?.load(std::sync::atomic::Ordering::Acquire)),
            Mem::Gpu(b) => b.read_u64(off),
        }
    }

    /// The host word at `off`, for CPU atomics.
    ///
    /// # Errors
    /// `InvalidUsage` for GPU memory, out of bounds or unaligned.
    pub fn atomic_u64(&self, off: usize) -> Result<&std::sync::atomic::AtomicU64> {
        match self {
            Mem::Host(b) => b.atomic_u64(off),
            Mem::Gpu(_) => Err(Error::invalid_usage("CPU atomics need host memory, not GPU memory")),
        }
    }
}

/// A host-to-host or host-to-device semaphore, one API over both.
pub enum Sem {
    Host(Host2HostSemaphore),
    Gpu(Host2DeviceSemaphore),
}

impl Sem {
    /// Signals the peer.
    ///
    /// # Errors
    /// As the semaphore's `signal`.
    pub fn signal(&self) -> Result<()> {
        match self {
            Sem::Host(s) => s.signal(),
            Sem::Gpu(s) => s.signal(),
        }
    }

    /// Waits (host side) for the peer's next signal, at most `timeout`.
    ///
    /// # Errors
    /// `Timeout` naming the peer, or the connection's failure.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        match self {
            Sem::Host(s) => s.wait(timeout),
            Sem::Gpu(s) => s.wait(timeout),
        }
    }

    /// The host-to-host semaphore, if this is one.
    pub fn host(&self) -> Option<&Host2HostSemaphore> {
        match self {
            Sem::Host(s) => Some(s),
            Sem::Gpu(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    /// Assembles `ptx` for sm_90 (with ptxas, found as `mscclpp::device::compile` finds it;
    /// skipped without one) and checks that ptxas compiled each of `entries`.
    fn assembles_for_sm_90(ptx: &str, entries: &[&str]) {
        match crate::device::compile::assemble(ptx, "sm_90") {
            Ok(report) => {
                for name in entries {
                    assert!(report.contains(name), "ptxas compiled no {name}:\n{report}");
                }
            }
            Err(e) if e.kind() == crate::ErrorKind::NotAvailable => eprintln!("skipped: {e}"),
            Err(e) => panic!("{e}"),
        }
    }

    /// The hardware-queue probe's hand-written PTX assembles for sm_90. Here rather than next
    /// to the PTX: the platform layer does not reach up to the device compiler.
    #[test]
    fn the_queue_probe_ptx_assembles_for_sm_90() {
        use crate::platform::cuda::queue_probe::PROBE_PTX;
        assembles_for_sm_90(PROBE_PTX, &["mscclpp_probe_spin", "mscclpp_probe_nop", "mscclpp_probe_set"]);
    }

    /// The same for the lingering copy kernel's PTX (`platform::cuda::linger::LINGER_PTX`).
    #[test]
    fn the_linger_ptx_assembles_for_sm_90() {
        use crate::platform::cuda::linger::{LINGER_ENTRY, LINGER_PTX};
        assembles_for_sm_90(LINGER_PTX, &[LINGER_ENTRY]);
    }

    /// The same for the CUDA IPC kernel copies' PTX (`platform::cuda::PUT_TOKEN_PTX`).
    #[test]
    fn the_put_token_ptx_assembles_for_sm_90() {
        use crate::platform::cuda::{PUT_TOKEN_ENTRY, PUT_TOKEN_PTX};
        assembles_for_sm_90(PUT_TOKEN_PTX, &[PUT_TOKEN_ENTRY]);
    }
}
