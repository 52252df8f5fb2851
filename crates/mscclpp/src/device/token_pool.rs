//! The token pool: semaphore tokens (8-byte counters in GPU memory) as slots of a few large
//! allocations, one pool per (context, GPU).
//!
//! Every GPU semaphore over CUDA IPC needs a token the peer maps. With one allocation per token,
//! a job with S semaphores to a peer makes that peer open S legacy IPC mappings
//! (`cuIpcOpenMemHandle`, each a driver call and a slice of address space). Slots of one
//! allocation share its IPC handle, and the mapping cache in `platform::cuda::ipc_open` opens an
//! allocation once per process: S semaphores cost the peer one mapping per chunk
//! ([`TOKENS_PER_CHUNK`] tokens, as MSCCL++'s `TokenPool`). Expected-count words (local only)
//! come from the same pool.
//!
//! A slot goes back to its chunk when the last clone of its `PoolToken` drops and is zeroed
//! when it is handed out again; a chunk is freed when its pool and all its tokens are gone.

use std::sync::{Arc, Mutex, Weak};

use crate::buffer::DeviceBuffer;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::{Transport, TransportFlags};

/// Tokens in one pool allocation (256 KiB), as MSCCL++'s `TokenPool`.
pub const TOKENS_PER_CHUNK: u32 = 32768;

/// Bytes of one token.
pub const TOKEN_BYTES: u64 = 8;

/// Which slots of one chunk are in use (no GPU involved): never-used slots are handed out in
/// order, then returned ones (most recently returned first). A slot is given back once; giving
/// back a free or unknown slot is refused.
#[derive(Debug)]
pub(crate) struct SlotAllocator {
    slots: u32,
    /// Slots below `next` have been handed out at least once.
    next: u32,
    /// Returned slots, to hand out again.
    free: Vec<u32>,
    /// One bit per slot: in use.
    used: Vec<u64>,
}

/// A slot handed out by [`SlotAllocator::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    /// The slot's index in its chunk.
    pub(crate) index: u32,
    /// Whether the slot was used before (its memory must be zeroed again).
    pub(crate) reused: bool,
}

impl SlotAllocator {
    pub(crate) fn new(slots: u32) -> SlotAllocator {
        SlotAllocator { slots, next: 0, free: Vec::new(), used: vec![0; slots.div_ceil(64) as usize] }
    }

    fn bit(&self, i: u32) -> bool {
        self.used[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
    fn set(&mut self, i: u32, on: bool) {
        let w = &mut self.used[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }

    /// A free slot, or `None` when all are in use.
    pub(crate) fn take(&mut self) -> Option<Slot> {
        let slot = if let Some(i) = self.free.pop() {
            Slot { index: i, reused: true }
        } else if self.next < self.slots {
            self.next += 1;
            Slot { index: self.next - 1, reused: false }
        } else {
            return None;
        };
        self.set(slot.index, true);
        Some(slot)
    }

    /// Returns `index` to the free slots; false (nothing changes) when it is not in use.
    pub(crate) fn give(&mut self, index: u32) -> bool {
        if index >= self.slots || !self.bit(index) {
            return false;
        }
        self.set(index, false);
        self.free.push(index);
        true
    }

    /// Slots in use.
    pub(crate) fn in_use(&self) -> u32 {
        self.next - self.free.len() as u32
    }
}

/// One allocation of the pool and its slots.
struct Chunk {
    buf: DeviceBuffer,
    slots: SlotAllocator,
}

/// The pool of one (context, GPU).
struct Pool {
    device: u32,
    chunk_slots: u32,
    chunks: Mutex<Vec<Chunk>>,
}

/// A token: an 8-byte slot of a pool allocation as a registered [`DeviceBuffer`] (registered for
/// CUDA IPC when asked, sharing the allocation's IPC handle). A cheap-clone handle; the slot goes
/// back to the pool when the last clone drops.
#[derive(Clone, Debug)]
pub(crate) struct PoolToken {
    buf: DeviceBuffer,
    _slot: Arc<SlotRef>,
}

struct SlotRef {
    pool: Arc<Pool>,
    chunk: usize,
    index: u32,
}

impl std::fmt::Debug for SlotRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU{} token chunk {} slot {}", self.pool.device, self.chunk, self.index)
    }
}

impl Drop for SlotRef {
    fn drop(&mut self) {
        if let Some(c) = lock(&self.pool.chunks).get_mut(self.chunk) {
            c.slots.give(self.index);
        }
    }
}

impl PoolToken {
    /// The token's buffer (8 bytes).
    pub(crate) fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }
    /// The token's device address.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.buf.device_ptr()
    }
}

/// A pool's key: (context id, GPU).
type PoolKey = (u64, u32);

/// Live pools by key; weak, so a pool goes with its last token.
static POOLS: Mutex<Vec<(PoolKey, Weak<Pool>)>> = Mutex::new(Vec::new());

fn pool_for(ctx: &Context, device: u32, chunk_slots: u32) -> Arc<Pool> {
    let key = (ctx.inner().id, device);
    let mut pools = lock(&POOLS);
    pools.retain(|(_, w)| w.strong_count() > 0);
    if let Some(p) = pools.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
        return p;
    }
    let p = Arc::new(Pool { device, chunk_slots, chunks: Mutex::new(Vec::new()) });
    pools.push((key, Arc::downgrade(&p)));
    p
}

/// A zeroed token on GPU `device` from `ctx`'s pool, registered for `transports` (only CUDA IPC
/// or nothing: a slot shares its allocation's IPC export).
///
/// # Errors
/// `InvalidUsage` for other transports; CUDA errors allocating a chunk or zeroing a reused slot.
pub(crate) fn take(ctx: &Context, device: u32, transports: TransportFlags) -> Result<PoolToken> {
    take_from(pool_for(ctx, device, TOKENS_PER_CHUNK), ctx, transports)
}

fn take_from(pool: Arc<Pool>, ctx: &Context, transports: TransportFlags) -> Result<PoolToken> {
    if transports != TransportFlags::NONE && transports != TransportFlags::from(Transport::CudaIpc) {
        return Err(Error::invalid_usage(format!(
            "token pool: tokens are registered for CUDA IPC or nothing, not {transports:?}"
        )));
    }
    let mut chunks = lock(&pool.chunks);
    let found = chunks.iter_mut().enumerate().find_map(|(i, c)| c.slots.take().map(|s| (i, s)));
    let (ci, slot) = match found {
        Some(f) => f,
        None => {
            let len = pool.chunk_slots as usize * TOKEN_BYTES as usize;
            let buf = DeviceBuffer::new(ctx, pool.device, len, Transport::CudaIpc.into())
                .map_err(|e| e.during(format!("allocating a token-pool chunk on GPU {}", pool.device)))?;
            let mut slots = SlotAllocator::new(pool.chunk_slots);
            let s = slots.take().ok_or_else(|| Error::invalid_usage("token pool: a chunk with no slots"))?;
            chunks.push(Chunk { buf, slots });
            (chunks.len() - 1, s)
        }
    };
    let chunk = &mut chunks[ci];
    let made = (|| {
        let off = u64::from(slot.index) * TOKEN_BYTES;
        let region = chunk.buf.region().sub(off, TOKEN_BYTES as usize)?;
        let ipc = if transports.has(Transport::CudaIpc) {
            let mut i = chunk.buf.memory().desc().cuda_ipc.clone().ok_or_else(|| {
                Error::invalid_usage("token pool: the chunk was registered for CUDA IPC but carries no export")
            })?;
            i.offset += off;
            Some(i)
        } else {
            None
        };
        let buf = DeviceBuffer::from_region(ctx, region, transports, ipc)?;
        if slot.reused {
            buf.fill(0, TOKEN_BYTES as usize, 0)?;
        }
        Ok(buf)
    })();
    match made {
        Ok(buf) => {
            drop(chunks);
            Ok(PoolToken { buf, _slot: Arc::new(SlotRef { pool, chunk: ci, index: slot.index }) })
        }
        Err(e) => {
            chunk.slots.give(slot.index);
            Err(e)
        }
    }
}

/// How many tokens of `ctx`'s pool on GPU `device` are in use and how many chunks it has (for
/// tests and diagnostics).
pub fn pool_usage(ctx: &Context, device: u32) -> (u32, usize) {
    let key = (ctx.inner().id, device);
    let pools = lock(&POOLS);
    match pools.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
        Some(p) => {
            let chunks = lock(&p.chunks);
            (chunks.iter().map(|c| c.slots.in_use()).sum(), chunks.len())
        }
        None => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_handed_out_in_order_then_reused() {
        let mut a = SlotAllocator::new(4);
        let got: Vec<_> = (0..4).map(|_| a.take().unwrap()).collect();
        assert_eq!(got.iter().map(|s| s.index).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert!(got.iter().all(|s| !s.reused));
        assert_eq!(a.take(), None, "a full chunk hands out nothing");
        assert_eq!(a.in_use(), 4);
        assert!(a.give(2));
        assert!(a.give(0));
        assert_eq!(a.in_use(), 2);
        assert_eq!(a.take(), Some(Slot { index: 0, reused: true }));
        assert_eq!(a.take(), Some(Slot { index: 2, reused: true }));
        assert_eq!(a.take(), None);
    }

    #[test]
    fn a_slot_is_given_back_once() {
        let mut a = SlotAllocator::new(70);
        let s = a.take().unwrap();
        assert!(a.give(s.index));
        assert!(!a.give(s.index), "double give");
        assert!(!a.give(69), "never handed out");
        assert!(!a.give(70), "out of range");
        assert_eq!(a.in_use(), 0);
        // 70 slots span two bitmap words: all can be taken, each once.
        let mut seen = std::collections::HashSet::new();
        while let Some(s) = a.take() {
            assert!(seen.insert(s.index), "slot {} handed out twice", s.index);
        }
        assert_eq!(seen.len(), 70);
        assert_eq!(a.in_use(), 70);
    }

    /// Random take/give sequences against a model: no slot is ever held twice, counts agree.
    #[test]
    fn random_take_and_give_match_a_model() {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut a = SlotAllocator::new(100);
        let mut held: Vec<u32> = Vec::new();
        for _ in 0..20_000 {
            if rnd() % 3 != 0 {
                match a.take() {
                    Some(s) => {
                        assert!(!held.contains(&s.index));
                        held.push(s.index);
                    }
                    None => assert_eq!(held.len(), 100),
                }
            } else if !held.is_empty() {
                let i = held.swap_remove((rnd() % held.len() as u64) as usize);
                assert!(a.give(i));
            }
            assert_eq!(a.in_use() as usize, held.len());
        }
    }

    #[test]
    fn tokens_refuse_other_transports() {
        let ctx = Context::new();
        let pool = Arc::new(Pool { device: 0, chunk_slots: 4, chunks: Mutex::new(Vec::new()) });
        let e = take_from(pool, &ctx, Transport::Ethernet.into()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidUsage);
    }

    /// On a GPU: two small chunks' worth of tokens; slots of one chunk share its IPC handle with
    /// offsets; a dropped token's slot is reused zeroed; usage counts follow.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_tokens_share_chunks_and_are_zeroed_on_reuse() {
        let ctx = Context::new();
        let pool = Arc::new(Pool { device: 0, chunk_slots: 4, chunks: Mutex::new(Vec::new()) });
        let ipc = TransportFlags::from(Transport::CudaIpc);
        let toks: Vec<_> = (0..6).map(|_| take_from(pool.clone(), &ctx, ipc).unwrap()).collect();
        assert_eq!(lock(&pool.chunks).len(), 2);
        let d0 = toks[0].buffer().memory().desc().cuda_ipc.clone().unwrap();
        let d3 = toks[3].buffer().memory().desc().cuda_ipc.clone().unwrap();
        assert_eq!(d0.handle, d3.handle, "slots of one chunk share its IPC handle");
        assert_eq!(d3.offset - d0.offset, 3 * TOKEN_BYTES);
        assert_eq!(toks[1].device_ptr() - toks[0].device_ptr(), TOKEN_BYTES);
        toks[2].buffer().write(0, &7u64.to_le_bytes()).unwrap();
        let mut toks = toks;
        let freed = toks.remove(2);
        let freed_ptr = freed.device_ptr();
        drop(freed);
        let again = take_from(pool.clone(), &ctx, TransportFlags::NONE).unwrap();
        assert_eq!(again.device_ptr(), freed_ptr, "the slot given back is reused");
        assert_eq!(again.buffer().read_u64(0).unwrap(), 0, "a reused slot is zeroed");
        drop(toks);
        let used: u32 = lock(&pool.chunks).iter().map(|c| c.slots.in_use()).sum();
        assert_eq!(used, 1);
    }
}
