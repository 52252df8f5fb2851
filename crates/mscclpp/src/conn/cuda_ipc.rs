//! The CUDA IPC transport: copies into a peer's GPU memory mapped into this process.
//!
//! Corrections to MSCCL++'s `CudaIpcConnection`:
//! * one non-blocking stream per context **and device** (MSCCL++ shares the first connection's);
//! * `update_and_sync` writes the token in stream order after the data, at `dst + offset` (MSCCL++
//!   adds the offset twice): by an 8-byte copy from a pinned slot that is not reused before a
//!   flush has proven the copy ran (measured on the H200: 5.45 us copy+sync against 5.84 us for
//!   `cuStreamWriteValue64`+sync), and by `cuStreamWriteValue64` when all slots are in use since
//!   the last flush; where stream memory operations are missing, slots are recycled by events;
//! * `atomic_add` runs on the same stream, so `flush` covers it;
//! * `flush(timeout)` polls an event, so the timeout holds, and returns CUDA errors as errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{ConnInner, Connection, ConnectionImpl};
use crate::conn::endpoint::Endpoint;
use crate::context::Context;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{Mem, RegisteredMemory};
use crate::platform::cuda::{Event, GpuDevice, Stream};
use crate::platform::hostmem::Region;
use crate::sync::lock;
use crate::transport::{Device, Transport};

/// Pinned slots holding token values until their copies run. Slots are handed out in order
/// from `next`; a completed flush that began after the last hand-out frees them all. In the
/// event mode (no stream memory operations) slot `i` is instead reused once the event recorded
/// behind its copy has passed.
struct SlotRing {
    slots: Region,
    events: Vec<Option<Event>>,
    next: usize,
    /// Set once slots are recycled by events; the flush-freed hand-out is then off.
    event_mode: bool,
}

impl SlotRing {
    fn new(dev: &Arc<GpuDevice>) -> Result<SlotRing> {
        Ok(SlotRing {
            slots: crate::platform::cuda::PinnedAlloc::region(dev, SLOTS * 8)?,
            events: (0..SLOTS).map(|_| None).collect(),
            next: 0,
            event_mode: false,
        })
    }
}

const SLOTS: usize = 256;

pub(crate) struct CudaIpcConnection {
    dev: Arc<GpuDevice>,
    stream: Arc<Stream>,
    failed: Mutex<Option<Error>>,
    /// Operations since the last completed flush.
    issued: AtomicU64,
    flushed: AtomicU64,
    ring: Mutex<Option<SlotRing>>,
    peer_desc: String,
    max_queue: usize,
}

impl CudaIpcConnection {
    fn check_failed(&self) -> Result<()> {
        match lock(&self.failed).as_ref() {
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }

    /// A CUDA error breaks the connection: keep it for every later call.
    fn record<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if e.kind() == ErrorKind::Cuda {
                lock(&self.failed).get_or_insert_with(|| e.duplicate());
            }
        }
        r
    }

    fn src_ptr(&self, src: &RegisteredMemory) -> Result<u64> {
        match src.local().map(|l| &l.mem) {
            Some(Mem::Gpu(g)) => Ok(g.ptr),
            _ => Err(Error::invalid_usage("the source of a CUDA IPC write must be local GPU memory")),
        }
    }

    /// Writes the token: from a free pinned slot, else by `cuStreamWriteValue64`, else from an
    /// event-recycled slot.
    fn write_token(&self, addr: u64, value: u64) -> Result<()> {
        {
            let mut g = lock(&self.ring);
            if g.is_none() {
                *g = Some(SlotRing::new(&self.dev)?);
            }
            if let Some(ring) = g.as_mut().filter(|r| r.next < SLOTS && !r.event_mode) {
                let i = ring.next;
                ring.next += 1;
                ring.slots.write((i * 8) as u64, &value.to_le_bytes())?;
                // The slot stays untouched until a flush that began after this hand-out completes.
                let p = ring.slots.as_mut_ptr().wrapping_add(i * 8);
                return self.stream.copy_htod(addr, p, 8);
            }
        }
        if self.stream.write_value64(addr, value)? {
            return Ok(());
        }
        self.token_by_event(addr, value)
    }

    /// Called when a flush that began with `handed_out` slots in use completed.
    fn free_slots(&self, handed_out: usize) {
        if let Some(r) = lock(&self.ring).as_mut() {
            if r.next == handed_out && !r.event_mode {
                r.next = 0;
            }
        }
    }

    fn token_by_event(&self, addr: u64, value: u64) -> Result<()> {
        let mut g = lock(&self.ring);
        if g.is_none() {
            *g = Some(SlotRing::new(&self.dev)?);
        }
        let Some(ring) = g.as_mut() else { return Err(Error::internal("slot ring missing")) };
        if !ring.event_mode {
            // Slots handed out since the last flush may still be read by pending copies.
            if !self.stream.wait_idle(Duration::from_secs(60))? {
                return Err(Error::new(ErrorKind::Timeout, "the stream did not drain in 60 s"));
            }
            ring.event_mode = true;
            ring.next = 0;
        }
        let i = ring.next;
        ring.next = (i + 1) % SLOTS;
        if let Some(ev) = &ring.events[i] {
            if !ev.wait(Duration::from_secs(60))? {
                return Err(Error::new(ErrorKind::Timeout, "a token slot's copy did not finish in 60 s"));
            }
        }
        ring.slots.write((i * 8) as u64, &value.to_le_bytes())?;
        // The slot's address stays valid while the ring (and its Region) lives.
        let p = ring.slots.as_mut_ptr().wrapping_add(i * 8);
        self.stream.copy_htod(addr, p, 8)?;
        let ev = match ring.events[i].take() {
            Some(e) => e,
            None => Event::new(&self.dev)?,
        };
        self.stream.record(&ev)?;
        ring.events[i] = Some(ev);
        Ok(())
    }
}

impl ConnectionImpl for CudaIpcConnection {
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_off: u64,
        src: &RegisteredMemory,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        self.check_failed()?;
        let d = dst.gpu_ptr(&self.dev)?;
        let s = self.src_ptr(src)?;
        if len == 0 {
            return Ok(());
        }
        let r = self.stream.copy_dtod(d + dst_off, s + src_off, len);
        self.issued.fetch_add(1, Ordering::Relaxed);
        self.record(r)
    }

    fn update_and_sync(&self, dst: &RegisteredMemory, dst_off: u64, _old: u64, new: u64) -> Result<()> {
        self.check_failed()?;
        let addr = dst.gpu_ptr(&self.dev)? + dst_off;
        let r = self.write_token(addr, new);
        self.issued.fetch_add(1, Ordering::Relaxed);
        self.record(r)
    }

    fn atomic_add(&self, dst: &RegisteredMemory, dst_off: u64, value: i64) -> Result<()> {
        self.check_failed()?;
        let addr = dst.gpu_ptr(&self.dev)? + dst_off;
        let r = self.stream.atomic_add(addr, value as u64);
        self.issued.fetch_add(1, Ordering::Relaxed);
        self.record(r)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.check_failed()?;
        let target = self.issued.load(Ordering::Relaxed);
        let handed_out = lock(&self.ring).as_ref().map_or(0, |r| r.next);
        let r = self.stream.wait_idle(timeout);
        match self.record(r)? {
            true => {
                self.flushed.fetch_max(target, Ordering::Relaxed);
                self.free_slots(handed_out);
                Ok(())
            }
            false => {
                let left = target.saturating_sub(self.flushed.load(Ordering::Relaxed));
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{left} operations on GPU{}'s stream toward {} not finished after {timeout:?}",
                        self.dev.ordinal, self.peer_desc
                    ),
                )
                .with_outstanding(left))
            }
        }
    }

    fn failure(&self) -> Option<Error> {
        lock(&self.failed).as_ref().map(Error::duplicate)
    }

    fn max_write_queue_size(&self) -> usize {
        self.max_queue
    }

    fn outstanding(&self) -> u64 {
        self.issued.load(Ordering::Relaxed).saturating_sub(self.flushed.load(Ordering::Relaxed))
    }
}

/// Builds a CUDA IPC connection.
pub(crate) fn connect(ctx: &Context, local: &Endpoint, remote: &Endpoint, peer: Option<usize>) -> Result<Connection> {
    let Device::Gpu(ordinal) = local.device() else {
        return Err(Error::invalid_usage("a CUDA IPC connection needs a GPU as its local device"));
    };
    if remote.host_hash() != local.host_hash() {
        return Err(Error::invalid_usage("CUDA IPC connects ranks on one host; the peer is on another"));
    }
    let dev = crate::platform::cuda::device(ordinal)?;
    if remote.process_hash() == local.process_hash() {
        if let Device::Gpu(r) = remote.device() {
            // Same process, another GPU: the pointer path needs peer access.
            let rdev = crate::platform::cuda::device(r)?;
            dev.enable_peer_access(&rdev)?;
        }
    }
    let stream = ctx.inner().cuda_stream(&dev)?;
    let peer_desc = match peer {
        Some(p) => format!("rank {p}"),
        None => "the peer".to_string(),
    };
    let conn = CudaIpcConnection {
        dev,
        stream,
        failed: Mutex::new(None),
        issued: AtomicU64::new(0),
        flushed: AtomicU64::new(0),
        ring: Mutex::new(None),
        peer_desc: peer_desc.clone(),
        max_queue: local.max_write_queue_size(),
    };
    Ok(Connection::from_inner(ConnInner {
        imp: Box::new(conn),
        transport: Transport::CudaIpc,
        remote_transport: Transport::CudaIpc,
        device: local.device(),
        context: ctx.clone(),
        peer,
        peer_desc,
    }))
}
