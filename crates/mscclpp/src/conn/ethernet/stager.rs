//! Staging GPU memory through pinned host buffers: the sender copies chunks of a GPU source to
//! the host while the previous chunk goes into the socket, and the receiver fills one pinned
//! buffer from the socket while the other is copied to the GPU.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::recv::RxSocket;
use crate::error::{Error, ErrorKind, Result};
use crate::platform::cuda::GpuRegion;
use crate::platform::hostmem::{IoPart, Region, send_vectored};

/// Bytes per staging chunk (two pinned buffers of it per stager, allocated at a connection's
/// first write from or into GPU memory on that GPU, per direction: 32 MiB for a connection that
/// moves GPU memory both ways). 8 MiB since session 26 (4 MiB before): room for 2 MiB landings
/// ([`LAND_BYTES`]).
const STAGE_CHUNK: usize = 8 << 20;

/// Payloads up to this size are gathered: several share one pinned buffer and one wait for the
/// GPU (the sender copies a batch's small writes to the host, waits once, sends them in one
/// `sendmsg`; the receiver queues their copies to the GPU and waits only before something must
/// see them landed). Larger ones go through the chunk pipeline.
pub(super) const GATHER_MAX: u64 = 1 << 20;

/// Gathered payloads start at multiples of this in a pinned buffer.
const GATHER_ALIGN: usize = 64;

/// How long dropping a stager waits for its copies; a buffer whose copy is still running then
/// is leaked rather than freed under the copy engine.
const DROP_WAIT: Duration = Duration::from_secs(5);

/// A staging failure: the socket's (the connection's end) or the GPU's.
pub(crate) enum StageError {
    Io(std::io::Error),
    Mscclpp(Error),
}

impl From<Error> for StageError {
    fn from(e: Error) -> Self {
        StageError::Mscclpp(e)
    }
}
impl From<std::io::Error> for StageError {
    fn from(e: std::io::Error) -> Self {
        StageError::Io(e)
    }
}

/// What a [`Stager`] asks of the GPU: copies and word updates queued on one stream, and an
/// event per buffer. [`Cuda`] is the real one; the tests have one that runs a queued copy only
/// when something waits for it (as late as a GPU may), to catch a buffer reused too early.
pub(crate) trait Engine {
    /// Queues a copy of `n` bytes from host `src` to GPU `dst`.
    fn copy_htod(&self, dst: u64, src: *const u8, n: usize) -> Result<()>;
    /// Queues a copy of `n` bytes from GPU `src` to host `dst`.
    fn copy_dtoh(&self, dst: *mut u8, src: u64, n: usize) -> Result<()>;
    /// Records event `k` after everything queued so far.
    fn record(&self, k: usize) -> Result<()>;
    /// Waits for event `k`'s last record: `Ok(false)` after `timeout`.
    fn wait(&self, k: usize, timeout: Duration) -> Result<bool>;
    /// Queues an atomic add to the GPU word at `addr`.
    fn atomic_add(&self, addr: u64, value: u64) -> Result<()>;
    /// Queues a store to the GPU word at `addr`; `Ok(false)` where the device cannot.
    fn write_value64(&self, addr: u64, value: u64) -> Result<bool>;
    /// Waits until everything queued has run: `Ok(false)` after `timeout`.
    fn wait_idle(&self, timeout: Duration) -> Result<bool>;
}

/// The real [`Engine`]: a CUDA stream and two events.
pub(crate) struct Cuda {
    stream: crate::platform::cuda::Stream,
    events: [crate::platform::cuda::Event; 2],
    /// Whether this stager's last copy went to the GPU (a receiver's) rather than from it (a
    /// sender's): which of [`STAGING_TIMES`]' wait counters its waits go to.
    to_gpu: std::cell::Cell<bool>,
}

/// Process-wide counts of the staging work on real GPUs, for benchmarks
/// ([`crate::bench::ethernet_staging_counts`]): receiver landings that issued copies, copies to
/// the GPU, copies from it, and the bytes of each (a gather reads the gaps between payloads
/// along, so the bytes from the GPU may exceed those sent).
pub(crate) static STAGING_COUNTS: [std::sync::atomic::AtomicU64; 8] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 8];
/// Receiver landings that issued copies.
pub(crate) const C_LANDINGS: usize = 0;
/// Copies to the GPU, and their bytes.
pub(crate) const C_HTOD: usize = 1;
pub(crate) const C_HTOD_BYTES: usize = 3;
/// Copies from the GPU, and their bytes.
pub(crate) const C_DTOH: usize = 2;
pub(crate) const C_DTOH_BYTES: usize = 4;
/// Acknowledgements asked for and received (every Ethernet connection, GPU memory or not; the
/// time between is [`T_ACK_WAIT`]).
pub(crate) const C_ACKS: usize = 5;
/// Tokens received for GPU words, and the rounds that applied them (one wait for the GPU each:
/// a receiver applies the tokens it finds already buffered behind one another in one round).
pub(crate) const C_TOKENS: usize = 6;
pub(crate) const C_TOKEN_ROUNDS: usize = 7;

fn count(i: usize) {
    count_n(i, 1);
}

pub(crate) fn count_n(i: usize, n: u64) {
    // Relaxed: statistics only.
    STAGING_COUNTS[i].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// Process-wide thread time of the staging work on real GPUs and around it, in nanoseconds
/// summed over threads, for benchmarks ([`crate::bench::ethernet_staging_counts`]): see the
/// `T_*` indexes.
pub(crate) static STAGING_TIMES: [std::sync::atomic::AtomicU64; 8] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 8];
/// Driver calls queueing work that moves data to the GPU (receivers' copies and tokens).
pub(crate) const T_TO_GPU_ISSUE: usize = 0;
/// Driver calls queueing copies from the GPU (senders' gathers and chunks).
pub(crate) const T_FROM_GPU_ISSUE: usize = 1;
/// Receivers waiting for their copies to the GPU.
pub(crate) const T_TO_GPU_WAIT: usize = 2;
/// Senders waiting for their copies from the GPU.
pub(crate) const T_FROM_GPU_WAIT: usize = 3;
/// Senders in `sendmsg` with staged GPU payloads.
pub(crate) const T_SEND: usize = 4;
/// Callers of `write` (a proxy, a host thread) waiting on a full write queue.
pub(crate) const T_QUEUE_FULL: usize = 5;
/// The acknowledgement loop: from sending a frame that asks for an acknowledgement to the
/// acknowledgement's arrival (summed over the asks, [`C_ACKS`]; not thread time).
pub(crate) const T_ACK_WAIT: usize = 6;
/// Receivers waiting for their rounds of token updates of GPU words (and the copies before).
pub(crate) const T_TOKEN_WAIT: usize = 7;

/// Adds the time since `t0` to `STAGING_TIMES[i]`.
pub(crate) fn timed(i: usize, t0: std::time::Instant) {
    let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    // Relaxed: statistics only.
    STAGING_TIMES[i].fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
}

/// Runs `f`, adding its time to `STAGING_TIMES[i]`.
fn time<T>(i: usize, f: impl FnOnce() -> T) -> T {
    let t0 = std::time::Instant::now();
    let r = f();
    timed(i, t0);
    r
}

impl Engine for Cuda {
    fn copy_htod(&self, dst: u64, src: *const u8, n: usize) -> Result<()> {
        count(C_HTOD);
        count_n(C_HTOD_BYTES, n as u64);
        self.to_gpu.set(true);
        time(T_TO_GPU_ISSUE, || self.stream.copy_htod(dst, src, n))
    }
    fn copy_dtoh(&self, dst: *mut u8, src: u64, n: usize) -> Result<()> {
        count(C_DTOH);
        count_n(C_DTOH_BYTES, n as u64);
        self.to_gpu.set(false);
        time(T_FROM_GPU_ISSUE, || self.stream.copy_dtoh(dst, src, n))
    }
    fn record(&self, k: usize) -> Result<()> {
        time(if self.to_gpu.get() { T_TO_GPU_ISSUE } else { T_FROM_GPU_ISSUE }, || self.stream.record(&self.events[k]))
    }
    fn wait(&self, k: usize, timeout: Duration) -> Result<bool> {
        time(if self.to_gpu.get() { T_TO_GPU_WAIT } else { T_FROM_GPU_WAIT }, || self.events[k].wait(timeout))
    }
    fn atomic_add(&self, addr: u64, value: u64) -> Result<()> {
        time(T_TO_GPU_ISSUE, || self.stream.atomic_add(addr, value))
    }
    fn write_value64(&self, addr: u64, value: u64) -> Result<bool> {
        time(T_TO_GPU_ISSUE, || self.stream.write_value64(addr, value))
    }
    fn wait_idle(&self, timeout: Duration) -> Result<bool> {
        self.stream.wait_idle(timeout)
    }
}

/// Two pinned buffers, a stream and two events on one GPU: double buffering between the GPU's
/// copy engine and the socket.
///
/// Small payloads cost one copy-engine call per copy (~4.5 us of driver time on the H100 and
/// H200 hosts, batched or not): payloads that many producers interleave are scattered, so the
/// stager sorts them by GPU address before copying. The sender copies each cluster of nearby
/// payloads (gaps up to [`GATHER_GAP`] read along) with one call; the receiver packs payloads
/// that are contiguous on the GPU next to each other in pinned memory (a host copy) and writes
/// each such group with one call, sorting only within epochs of payloads none of which
/// overlaps another (a later write to the same bytes lands later; one rewriting exactly the
/// bytes of an earlier one in its epoch replaces it).
pub(crate) struct Stager<E: Engine = Cuda> {
    eng: E,
    stages: [Region; 2],
    /// Whether copies from or into buffer `k` were queued since it was last waited for.
    pending: [bool; 2],
    /// Whether `events[k]` was recorded after the last of those copies (gathered copies record
    /// it only when it is waited for: one driver call per wait, not per copy).
    marked: [bool; 2],
    /// The buffer in use and the bytes of it already taken. Copies from or into a buffer are
    /// waited for before it is taken again from the start.
    cur: usize,
    fill: usize,
    /// Sender: the payloads gathered since the last settle, copied and laid out by
    /// [`gathered`](Self::gathered); and the room they may take in a buffer.
    picks: Vec<Pick>,
    want: usize,
    /// Receiver: payloads in the buffers whose copies to the GPU are not issued yet.
    landing: Vec<Landing>,
    /// Their bytes, counting a payload that rewrites exactly the bytes of one waiting (which
    /// replaces it when they land) once: the bytes `land` may have to pack.
    landing_bytes: usize,
    /// The waiting payloads' GPU starts and lengths, for that count.
    landing_at: HashMap<u64, usize>,
    /// How many waiting payloads did not continue the one received before them on the GPU: a
    /// stream written in order has few, producers rewriting slots out of order have many.
    landing_breaks: usize,
    /// When the oldest waiting payload arrived.
    landing_since: Option<Instant>,
    /// [`DEFER_MAX`] (the unit tests set their own).
    defer_max: Duration,
    /// A copy was queued whose end can no longer be waited for (recording its event failed, or
    /// the stream did not drain): the buffers are kept allocated when the stager goes.
    untracked: bool,
}

/// Payloads closer than this on the GPU are copied to the host with one call, the bytes between
/// them read along (reading costs less than a second call up to ~90 KB at PCIe speed). Under
/// load too: session 28, H100, `mscclpp-perf device --parts load-eth`, 132 producers putting
/// 4 KiB to 8 peers read 3.5x the bytes they sent and reached 0.65-0.71 of the host thread;
/// with 16 KiB gaps 1.7x and 0.28, with 4 KiB 1.1x and 0.10-0.11 (more calls cost more than
/// the bytes read along, even with 8 senders sharing the link).
const GATHER_GAP: u64 = 64 << 10;

/// The receiver issues its queued copies once this many payloads, or bytes, wait (since session
/// 27 the bytes of a payload that rewrites exactly the bytes of a waiting one are not counted
/// again: `land` replaces the earlier one, so they need no room to pack). 2 MiB holds
/// most slots of a ring that many producers rewrite (with 1 MiB, the proxy rows' 132 producers
/// x 256 slots of 512 B took 10 copies for 20,000 payloads in the unit model, against 1,204 with
/// 256 KiB; 4 KiB: 6,475 against 13,980). Session 26, H100, `mscclpp-perf device --parts
/// load-eth`, 132 producers, 4 KiB puts to 1 / 4 / 8 peers: 0.83 / 0.66 / 0.43 of the host
/// thread with 2 MiB (and 8 MiB buffers) against 0.63 / 0.31 / 0.26 with 1 MiB (4 MiB buffers),
/// the receiver's copies to the GPU 118 / 110 / 153 per 1000 writes against 299 / 318 / 288. The
/// price: 3 MiB of each 8 MiB buffer kept for packing.
const LAND_MAX: usize = 4096;
/// A receiver whose input runs dry defers the landing of at least this many waiting payloads
/// when more than a quarter of them did not continue the one before them on the GPU (see
/// [`Stager::issue_when_dry`]).
const DEFER_MIN: usize = 16;
/// How long the input must stay dry before deferred payloads land: the latest a burst of
/// scattered writes with nothing after it lands (a signal, a flush or a token lands them at
/// once). Session 28, H100, `mscclpp-perf device --parts load-eth`, 132 producers putting 4 KiB
/// to 8 peers: 0.37 of the host thread with 50 us (139 copies to the GPU per 1000 writes: a
/// receiver's input stays dry that long while the proxy waits on another peer's full queue, and
/// it lands a ring full of holes), 0.77 / 0.73 / 0.78 with 250 us / 1 ms / 10 ms (7 / 3 / 1
/// copies); to 4 peers 0.70 (50 copies) against 1.02 / 0.99 / 0.93.
pub(super) const DRY_GRACE: Duration = Duration::from_micros(250);
/// How long after the oldest of them arrived deferred payloads land, even while input keeps
/// coming (an acknowledgement, a token, a full buffer or [`LAND_MAX`] land them sooner).
const DEFER_MAX: Duration = Duration::from_millis(10);
const LAND_BYTES: usize = 2 << 20;
/// Room kept free at the end of each buffer for packing the waiting payloads (at most
/// `LAND_BYTES` plus one payload as `landing_bytes` counts them, packed without gaps; see
/// `land_epoch` for what a peer can make exceed it): received payloads use the rest.
const LAND_ROOM: usize = LAND_BYTES + GATHER_MAX as usize;

/// A payload to send (see [`Stager::gather`]): its GPU bytes, and where [`Stager::gathered`]
/// copied them in the current buffer.
#[derive(Clone, Copy, Debug)]
struct Pick {
    /// The registered GPU region (address, length) it lies in: copies never leave it.
    region: (u64, usize),
    gpu: u64,
    len: usize,
    at: usize,
}

/// A received payload in a buffer, its copy to the GPU not issued yet.
#[derive(Clone, Copy, Debug)]
struct Landing {
    k: usize,
    at: usize,
    gpu: u64,
    len: usize,
    region: (u64, usize),
}

pub(super) fn stager_for<'a>(map: &'a mut HashMap<u32, Stager>, g: &GpuRegion) -> Result<&'a mut Stager> {
    use std::collections::hash_map::Entry;
    match map.entry(g.dev.ordinal) {
        Entry::Occupied(e) => Ok(e.into_mut()),
        Entry::Vacant(v) => {
            let dev = &g.dev;
            let eng = Cuda {
                stream: crate::platform::cuda::Stream::new(dev)?,
                events: [crate::platform::cuda::Event::new(dev)?, crate::platform::cuda::Event::new(dev)?],
                to_gpu: std::cell::Cell::new(false),
            };
            let stages = [
                crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
                crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
            ];
            Ok(v.insert(Stager::with(eng, stages)))
        }
    }
}

/// Long enough for any one chunk's copy; a stuck GPU fails the connection instead of hanging it.
const STAGE_WAIT: Duration = Duration::from_secs(60);

impl<E: Engine> Drop for Stager<E> {
    fn drop(&mut self) {
        // Payloads whose copies were never issued have no copy in flight.
        self.landing.clear();
        for k in 0..2 {
            let done = |st: &mut Stager<E>| {
                !st.pending[k]
                    || ((st.marked[k] || st.mark(k).is_ok()) && matches!(st.eng.wait(k, DROP_WAIT), Ok(true)))
            };
            if self.untracked || !done(self) {
                // A copy may still read or write this buffer: keep it allocated for good.
                std::mem::forget(self.stages[k].clone());
            }
        }
    }
}

impl<E: Engine> Stager<E> {
    fn with(eng: E, stages: [Region; 2]) -> Stager<E> {
        Stager {
            eng,
            stages,
            pending: [false; 2],
            marked: [false; 2],
            cur: 0,
            fill: 0,
            picks: Vec::new(),
            want: 0,
            landing: Vec::new(),
            landing_bytes: 0,
            landing_at: HashMap::new(),
            landing_breaks: 0,
            landing_since: None,
            defer_max: DEFER_MAX,
            untracked: false,
        }
    }

    /// Marks the end of the copies just queued from or into buffer `k` (its event), so that a
    /// later wait covers them and nothing queued after (the pipeline's overlap).
    fn recorded(&mut self, k: usize) -> Result<()> {
        self.pending[k] = true;
        self.mark(k)
    }

    /// Notes a copy just queued from or into buffer `k`; its event is recorded when `k` is
    /// waited for (and then covers everything queued on the stream by then).
    fn queued(&mut self, k: usize) {
        self.pending[k] = true;
        self.marked[k] = false;
    }

    /// Records `events[k]` after everything queued so far.
    fn mark(&mut self, k: usize) -> Result<()> {
        if let Err(e) = self.eng.record(k) {
            // The copies already queued can no longer be waited for (and the event's earlier
            // record must not pass for theirs).
            self.untracked = true;
            self.marked[k] = false;
            return Err(e);
        }
        self.marked[k] = true;
        Ok(())
    }

    /// Waits for every copy queued so far; the gathered buffers start empty again.
    pub(super) fn settle(&mut self) -> Result<()> {
        self.wait(0)?;
        self.wait(1)?;
        self.cur = 0;
        self.fill = 0;
        self.picks.clear();
        self.want = 0;
        Ok(())
    }

    /// Room for `n` received bytes (`n <= GATHER_MAX`) in buffer `self.cur` (keeping
    /// [`LAND_ROOM`] free for packing): their offset. Moves to the other buffer (after its
    /// copies) when this one is full.
    fn take(&mut self, n: usize) -> Result<usize> {
        let at = self.fill.next_multiple_of(GATHER_ALIGN);
        if at + n + LAND_ROOM <= STAGE_CHUNK {
            self.fill = at + n;
            return Ok(at);
        }
        // This buffer's copies end here (so that coming back to it waits for them alone, not
        // for what is queued on the other one by then).
        self.land()?;
        let here = self.cur;
        if self.pending[here] && !self.marked[here] {
            self.mark(here)?;
        }
        let k = 1 - here;
        self.wait(k)?;
        self.cur = k;
        self.fill = n;
        Ok(0)
    }

    /// Sender side: notes a small GPU payload (`len <= GATHER_MAX`) to send; its bytes are
    /// copied to the host by [`gathered`](Self::gathered) and read with [`part`](Self::part)
    /// and the returned number. Ask [`room_for`](Self::room_for) first (the caller sends what
    /// was gathered, then [`settle`](Self::settle)s, when it says no).
    pub(super) fn gather(&mut self, src: &GpuRegion, off: u64, len: u64) -> Result<usize> {
        src.check(off, len)?;
        self.gather_in((src.ptr, src.len), off, len)
    }

    /// [`gather`](Self::gather) from the GPU region (address, length), `off + len` checked.
    fn gather_in(&mut self, region: (u64, usize), off: u64, len: u64) -> Result<usize> {
        if !self.room_for(len) {
            return Err(Error::internal(format!(
                "a {len}-byte payload gathered past the staging buffer's {STAGE_CHUNK} bytes"
            )));
        }
        self.want += (len as usize).next_multiple_of(GATHER_ALIGN);
        self.picks.push(Pick { region, gpu: region.0 + off, len: len as usize, at: 0 });
        Ok(self.picks.len() - 1)
    }

    /// Whether `len` more gathered bytes fit in a buffer (else the caller sends what it
    /// gathered, then [`settle`](Self::settle)s, before gathering more).
    pub(super) fn room_for(&self, len: u64) -> bool {
        (self.want as u64).saturating_add(len.next_multiple_of(GATHER_ALIGN as u64)) <= STAGE_CHUNK as u64
    }

    /// Copies the gathered payloads to the host and waits for them; then
    /// [`part`](Self::part) reads them. The payloads are copied in GPU address order, each
    /// cluster of them (in one region, gaps up to [`GATHER_GAP`]) with one call.
    pub(super) fn gathered(&mut self) -> Result<()> {
        let mut order: Vec<usize> = (0..self.picks.len()).filter(|&i| self.picks[i].len > 0).collect();
        if order.is_empty() {
            return Ok(());
        }
        // Laid out from the start of the current buffer, once nothing uses it.
        let k = self.cur;
        self.wait(k)?;
        order.sort_by_key(|&i| (self.picks[i].region.0, self.picks[i].gpu));
        let align = |n: usize| n.next_multiple_of(GATHER_ALIGN);
        // What the picks not laid out yet may still need, each aligned (at most `want`, which
        // fits the buffer): a gap is read along only while they still fit after it.
        let mut left: usize = order.iter().map(|&i| align(self.picks[i].len)).sum();
        let mut fill = 0usize;
        let mut i = 0;
        while i < order.len() {
            let first = self.picks[order[i]];
            let (start, mut end) = (first.gpu, first.gpu + first.len as u64);
            left -= align(first.len);
            let at = align(fill);
            let mut j = i + 1;
            while j < order.len() {
                let p = self.picks[order[j]];
                let new_end = end.max(p.gpu + p.len as u64);
                if p.region != first.region
                    || p.gpu.saturating_sub(end) > GATHER_GAP
                    || align(at + (new_end - start) as usize) + (left - align(p.len)) > STAGE_CHUNK
                {
                    break;
                }
                end = new_end;
                left -= align(p.len);
                j += 1;
            }
            let span = (end - start) as usize;
            if at + span > STAGE_CHUNK {
                return Err(Error::internal(format!(
                    "gathered payloads overflow the staging buffer ({} bytes at {at})",
                    span
                )));
            }
            self.eng.copy_dtoh(self.stages[k].as_mut_ptr().wrapping_add(at), start, span)?;
            self.queued(k);
            for &q in &order[i..j] {
                self.picks[q].at = at + (self.picks[q].gpu - start) as usize;
            }
            fill = at + span;
            i = j;
        }
        self.fill = fill;
        self.wait(k)
    }

    /// The bytes of gathered payload `pick` (after [`gathered`](Self::gathered)).
    pub(super) fn part(&self, pick: usize) -> Result<IoPart<'_>> {
        let p = self.picks.get(pick).ok_or_else(|| Error::internal(format!("no gathered payload {pick}")))?;
        self.stages[self.cur].part(p.at as u64, p.len as u64)
    }

    /// Issues the copies of the received payloads still waiting, in epochs: the longest run of
    /// them (in arrival order) in which no two overlap on the GPU, then the next (a later write
    /// to the same bytes must win, and epochs go in stream order). Within an epoch the payloads
    /// are sorted by GPU address, and each group contiguous on the GPU is written with one call
    /// (packed next to each other first where they are not already).
    fn land(&mut self) -> Result<()> {
        if self.landing.is_empty() {
            return Ok(());
        }
        count(C_LANDINGS);
        let v = std::mem::take(&mut self.landing);
        self.landing_bytes = 0;
        self.landing_at.clear();
        self.landing_breaks = 0;
        self.landing_since = None;
        // The epoch's live payloads: GPU start -> (end, index in `v`), in address order (as
        // `land_epoch` takes them). Their ranges are disjoint, so the one starting last before a
        // new range's end is the only one that can overlap it. A payload rewriting exactly the range of one in the epoch replaces it (the
        // earlier bytes would be overwritten before anything can be told they landed: no token
        // comes between); any other overlap ends the epoch.
        let mut seen: std::collections::BTreeMap<u64, (u64, usize)> = std::collections::BTreeMap::new();
        let mut live: Vec<Landing> = Vec::new();
        for (i, e) in v.iter().enumerate() {
            let (a, b) = (e.gpu, e.gpu + e.len as u64);
            match seen.range(..b).next_back() {
                Some((&start, &(end, _))) if start == a && end == b => {}
                Some((_, &(end, _))) if end > a => {
                    live.extend(seen.values().map(|&(_, j)| v[j]));
                    self.land_epoch(&live)?;
                    live.clear();
                    seen.clear();
                }
                _ => {}
            }
            seen.insert(a, (b, i));
        }
        live.extend(seen.values().map(|&(_, j)| v[j]));
        self.land_epoch(&live)
    }

    /// Issues the copies of `v`, payloads none of which overlaps another, sorted by GPU address
    /// (as `land` collects them).
    fn land_epoch(&mut self, v: &[Landing]) -> Result<()> {
        let mut i = 0;
        while i < v.len() {
            let first = v[i];
            let mut end = first.gpu + first.len as u64;
            // Whether the group also lies contiguous in one buffer, in this order.
            let mut in_place = true;
            let mut j = i + 1;
            while j < v.len() {
                let (prev, e) = (v[j - 1], v[j]);
                if e.region != first.region || e.gpu != end {
                    break;
                }
                in_place &= e.k == prev.k && e.at == prev.at + prev.len;
                end += e.len as u64;
                j += 1;
            }
            let group = &v[i..j];
            let total = (end - first.gpu) as usize;
            if in_place {
                self.eng.copy_htod(first.gpu, self.stages[first.k].as_mut_ptr().wrapping_add(first.at), total)?;
                self.queued(first.k);
            } else if self.fill + total > STAGE_CHUNK {
                // No room to pack them: one copy each, from where they are. `take` keeps
                // `LAND_ROOM` free, which holds every waiting payload's bytes as `landing_bytes`
                // counts them; a peer can pack more (rewrites of the exact bytes of a waiting
                // payload are counted once, but a partial overlap between them packs both): then
                // this costs copies, never correctness.
                for e in group {
                    self.eng.copy_htod(e.gpu, self.stages[e.k].as_mut_ptr().wrapping_add(e.at), e.len)?;
                    self.queued(e.k);
                }
            } else {
                // Packed at the end of the current buffer, right after what it holds (unaligned:
                // the room kept is exactly the bytes that may wait).
                let k = self.cur;
                let at = self.fill;
                let mut o = at;
                for e in group {
                    self.stages[k].copy_from(o as u64, &self.stages[e.k], e.at as u64, e.len)?;
                    o += e.len;
                }
                self.fill = o;
                self.eng.copy_htod(first.gpu, self.stages[k].as_mut_ptr().wrapping_add(at), total)?;
                self.queued(k);
            }
            i = j;
        }
        Ok(())
    }

    /// The receiver's input ran dry: issues the copies of the payloads waiting (without waiting
    /// for them), so that a write nothing follows (packets a kernel polls for, with no signal
    /// after them) lands too; unless they are many and mostly out of order, the oldest arrived
    /// less than [`DEFER_MAX`] ago, and `grace_over` is false (the receiver saw input less than
    /// [`DRY_GRACE`] ago). Then it returns true and issues nothing: the holes between them (slots
    /// that producers rewrite out of order and have not reached yet) may still fill, and one
    /// copy then covers what would have taken one per run.
    pub(super) fn issue_when_dry(&mut self, grace_over: bool) -> Result<bool> {
        let n = self.landing.len();
        if n == 0 {
            return Ok(false);
        }
        let young = self.landing_since.is_some_and(|t| t.elapsed() < self.defer_max);
        if !grace_over && young && n >= DEFER_MIN && self.landing_breaks * 4 > n {
            return Ok(true);
        }
        self.land()?;
        Ok(false)
    }

    pub(super) fn wait(&mut self, k: usize) -> Result<()> {
        self.land()?;
        if self.pending[k] {
            if !self.marked[k] {
                self.mark(k)?;
            }
            if !self.eng.wait(k, STAGE_WAIT)? {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("a GPU staging copy did not finish in {STAGE_WAIT:?}"),
                ));
            }
            self.pending[k] = false;
        }
        Ok(())
    }

    /// Sends `len` bytes of GPU memory from `off`: chunk i+1 is copied to the host while chunk i
    /// goes into the socket.
    pub(super) fn send(
        &mut self,
        out: &TcpStream,
        src: &GpuRegion,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), StageError> {
        src.check(off, len)?;
        self.settle()?;
        let chunks = len.div_ceil(STAGE_CHUNK as u64) as usize;
        let size = |i: usize| (len - (i * STAGE_CHUNK) as u64).min(STAGE_CHUNK as u64) as usize;
        let issue = |st: &mut Stager<E>, i: usize| -> Result<()> {
            let k = i % 2;
            st.wait(k)?;
            st.eng.copy_dtoh(st.stages[k].as_mut_ptr(), src.ptr + off + (i * STAGE_CHUNK) as u64, size(i))?;
            st.recorded(k)?;
            Ok(())
        };
        if chunks > 0 {
            issue(self, 0)?;
        }
        for i in 0..chunks {
            if i + 1 < chunks {
                issue(self, i + 1)?;
            }
            self.wait(i % 2)?;
            send_vectored(out, &[self.stages[i % 2].part(0, size(i) as u64)?])?;
        }
        Ok(())
    }

    /// Receives `len` bytes into GPU memory at `off`. A small payload (up to [`GATHER_MAX`])
    /// is read into the gather buffer and its copy queued: it has landed once
    /// [`settle`](Self::settle) or [`tokens_at`](Self::tokens_at) returns. A larger one goes through
    /// the chunk pipeline (the socket fills one pinned buffer while the other is copied to the
    /// GPU) and has landed when this returns.
    pub(super) fn recv(
        &mut self,
        rd: &mut BufReader<RxSocket>,
        dst: &GpuRegion,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), StageError> {
        dst.check(off, len)?;
        if len == 0 {
            return Ok(());
        }
        if len <= GATHER_MAX {
            let n = len as usize;
            return self.recv_small((dst.ptr, dst.len), off, n, |stage, at| {
                let b = rd.buffer().len().min(n);
                let mut read = stage.write(at, &rd.buffer()[..b]).map_err(StageError::from);
                rd.consume(b);
                if read.is_ok() && b < n {
                    read =
                        stage.recv_exact(at + b as u64, (n - b) as u64, &rd.get_ref().sock).map_err(StageError::from);
                }
                read
            });
        }
        self.settle()?;
        let mut done = 0u64;
        let mut i = 0usize;
        while done < len {
            let n = (len - done).min(STAGE_CHUNK as u64) as usize;
            let k = i % 2;
            self.wait(k)?;
            let b = rd.buffer().len().min(n);
            self.stages[k].write(0, &rd.buffer()[..b])?;
            rd.consume(b);
            if b < n {
                self.stages[k].recv_exact(b as u64, (n - b) as u64, &rd.get_ref().sock)?;
            }
            self.eng.copy_htod(dst.ptr + off + done, self.stages[k].as_mut_ptr(), n)?;
            self.recorded(k)?;
            done += n as u64;
            i += 1;
        }
        self.settle()?;
        Ok(())
    }

    /// A small payload (`0 < n <= GATHER_MAX`) for GPU region (address, length) at `off`:
    /// `fill(buffer, offset)` puts its `n` bytes there, and its copy is queued behind the
    /// earlier ones, waited for by `settle` (before an acknowledgement or anything else that
    /// must see it landed) or when its buffer is taken again. A payload `fill` could not
    /// complete is never copied.
    fn recv_small(
        &mut self,
        region: (u64, usize),
        off: u64,
        n: usize,
        fill: impl FnOnce(&Region, u64) -> std::result::Result<(), StageError>,
    ) -> std::result::Result<(), StageError> {
        let gpu = region.0 + off;
        // Right after the previous payload when it continues it on the GPU (the group is then
        // copied in place), else aligned.
        let (k, at) = match self.landing.last() {
            Some(l)
                if l.k == self.cur
                    && l.at + l.len == self.fill
                    && l.region == region
                    && l.gpu + l.len as u64 == gpu
                    && self.fill + n + LAND_ROOM <= STAGE_CHUNK =>
            {
                self.fill += n;
                (self.cur, self.fill - n)
            }
            _ => {
                let at = self.take(n)?;
                (self.cur, at)
            }
        };
        // A payload `fill` could not complete is never copied (its bytes are left unused).
        fill(&self.stages[k], at as u64)?;
        match self.landing.last() {
            None => self.landing_since = Some(Instant::now()),
            Some(l) if l.gpu + l.len as u64 != gpu => self.landing_breaks += 1,
            Some(_) => {}
        }
        self.landing.push(Landing { k, at, gpu, len: n, region });
        // A payload rewriting exactly the bytes of a waiting one replaces it when they land (in
        // `land`, unless a partial overlap between them starts a new epoch: then both are
        // packed, and a group that finds no room to pack lands unpacked, one copy each).
        if self.landing_at.insert(gpu, n) != Some(n) {
            self.landing_bytes += n;
        }
        if self.landing.len() >= LAND_MAX || self.landing_bytes >= LAND_BYTES {
            self.land()?;
        }
        Ok(())
    }

    /// Applies token updates `ops` to GPU words in order on the stream, after every copy queued
    /// on this stager, and waits once for all of them (and so for those copies too). Each
    /// address must lie in a GPU region, checked by the caller.
    pub(super) fn tokens_at(&mut self, ops: &[GpuToken]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        // The tokens go after every copy before them on the stream.
        self.land()?;
        count(C_TOKEN_ROUNDS);
        // Without stream memory operations, stores are copies from pinned slots: one 8-byte slot
        // each at the start of the first buffer, which nothing else uses once the stream is idle.
        let mut settled = false;
        for (i, op) in ops.iter().enumerate() {
            if op.add {
                self.eng.atomic_add(op.addr, op.value)?;
            } else if !self.eng.write_value64(op.addr, op.value)? {
                if !settled {
                    self.settle()?;
                    settled = true;
                }
                let slot = (i * 8) as u64;
                if slot + 8 > STAGE_CHUNK as u64 {
                    return Err(Error::internal(format!(
                        "{} token stores at once overflow the slot buffer",
                        ops.len()
                    )));
                }
                self.stages[0].write(slot, &op.value.to_le_bytes())?;
                self.eng.copy_htod(op.addr, self.stages[0].as_mut_ptr().wrapping_add(slot as usize), 8)?;
                // The slot is read by the copy: tracked as a copy from the first buffer.
                self.queued(0);
            }
        }
        // Bounded: the atomic is a one-thread kernel, which a GPU filled by kernels spinning for
        // this very token cannot schedule (notes 1.7); fail the connection then, never hang.
        let t0 = std::time::Instant::now();
        let idle = self.eng.wait_idle(STAGE_WAIT);
        timed(T_TOKEN_WAIT, t0);
        if !matches!(idle, Ok(true)) {
            // The pinned slots of the fallback copies may still be read.
            self.untracked = true;
        }
        if !idle? {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("a GPU token update did not finish in {STAGE_WAIT:?} (is the GPU full of waiting kernels?)"),
            ));
        }
        // The stream is idle: every copy before the tokens has landed.
        self.pending = [false; 2];
        self.cur = 0;
        self.fill = 0;
        Ok(())
    }
}

/// One update of a GPU word by a token: a store of `value`, or an add of it (wrapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GpuToken {
    pub(super) addr: u64,
    pub(super) value: u64,
    pub(super) add: bool,
}

impl GpuToken {
    /// `next` applied right after this update of the same word, as one update: adds sum
    /// (wrapping), a store then an add stores the sum, and a store replaces whatever came before.
    pub(super) fn then(self, next: GpuToken) -> GpuToken {
        debug_assert_eq!(self.addr, next.addr);
        if next.add {
            GpuToken { addr: self.addr, value: self.value.wrapping_add(next.value), add: self.add }
        } else {
            next
        }
    }
}

#[cfg(test)]
mod tests {
    //! The stager's bookkeeping against an engine that runs a queued copy only when something
    //! waits for it: a buffer reused before its copy ran, a wait that misses a copy, or a payload
    //! copied before its bytes are all there shows up as wrong bytes.

    use std::cell::RefCell;
    use std::sync::Arc;

    use super::*;
    use crate::platform::hostmem::HostAlloc;

    /// Fake GPU addresses start here.
    const BASE: u64 = 1 << 40;
    const GPU_LEN: usize = 24 << 20;

    enum Op {
        HtoD { dst: u64, src: usize, n: usize },
        DtoH { dst: usize, src: u64, n: usize },
        Word { addr: u64, value: u64, add: bool },
    }

    struct Lazy {
        gpu: RefCell<Vec<u8>>,
        stages: [Region; 2],
        queue: RefCell<Vec<Op>>,
        done: RefCell<usize>,
        marks: RefCell<[usize; 2]>,
        /// `Some(state)`: after each queued operation, run a random prefix of what is queued
        /// (a GPU may start a copy at once: one queued before its bytes were written is caught).
        early: RefCell<Option<u64>>,
        /// Whether `write_value64` works (else the stager's token falls back to a copy).
        memops: bool,
        /// A stuck GPU: waits run nothing and report a timeout.
        stuck: std::cell::Cell<bool>,
        /// Recording an event fails.
        record_fails: std::cell::Cell<bool>,
    }

    std::thread_local! {
        /// How `stager()` makes its engine: (random early runs with this seed, stream memory
        /// operations).
        static MODE: std::cell::Cell<(Option<u64>, bool)> = const { std::cell::Cell::new((None, true)) };
    }

    /// Runs `f` with engines made as `mode` says.
    fn with_mode(early: Option<u64>, memops: bool, f: impl FnOnce()) {
        MODE.with(|m| m.set((early, memops)));
        f();
        MODE.with(|m| m.set((None, true)));
    }

    impl Lazy {
        /// In early mode, runs a random prefix of the queue (in order, as a GPU would).
        fn progress(&self) {
            let upto = {
                let mut e = self.early.borrow_mut();
                let Some(st) = e.as_mut() else { return };
                *st ^= *st << 13;
                *st ^= *st >> 7;
                *st ^= *st << 17;
                let (done, len) = (*self.done.borrow(), self.queue.borrow().len());
                if *st % 3 != 0 {
                    return;
                }
                done + (*st >> 8) as usize % (len - done + 1)
            };
            self.run_to(upto);
        }

        /// The buffer holding host range [ptr, ptr + n), and the offset in it.
        fn host(&self, ptr: usize, n: usize) -> (&Region, u64) {
            self.stages
                .iter()
                .find(|r| ptr >= r.addr() && ptr + n <= r.addr() + STAGE_CHUNK)
                .map(|r| (r, (ptr - r.addr()) as u64))
                .expect("a copy outside the staging buffers")
        }

        fn run_to(&self, upto: usize) {
            let q = self.queue.borrow();
            let mut done = self.done.borrow_mut();
            let mut gpu = self.gpu.borrow_mut();
            while *done < upto {
                match q[*done] {
                    Op::HtoD { dst, src, n } => {
                        let (r, at) = self.host(src, n);
                        let g = (dst - BASE) as usize;
                        r.read(at, &mut gpu[g..g + n]).unwrap();
                    }
                    Op::DtoH { dst, src, n } => {
                        let (r, at) = self.host(dst, n);
                        let g = (src - BASE) as usize;
                        r.write(at, &gpu[g..g + n]).unwrap();
                    }
                    Op::Word { addr, value, add } => {
                        let g = (addr - BASE) as usize;
                        let old = u64::from_le_bytes(gpu[g..g + 8].try_into().unwrap());
                        let new = applied(old, GpuToken { addr, value, add });
                        gpu[g..g + 8].copy_from_slice(&new.to_le_bytes());
                    }
                }
                *done += 1;
            }
        }
    }

    impl Engine for Lazy {
        fn copy_htod(&self, dst: u64, src: *const u8, n: usize) -> Result<()> {
            self.queue.borrow_mut().push(Op::HtoD { dst, src: src as usize, n });
            self.progress();
            Ok(())
        }
        fn copy_dtoh(&self, dst: *mut u8, src: u64, n: usize) -> Result<()> {
            self.queue.borrow_mut().push(Op::DtoH { dst: dst as usize, src, n });
            self.progress();
            Ok(())
        }
        fn record(&self, k: usize) -> Result<()> {
            if self.record_fails.get() {
                return Err(Error::internal("cuEventRecord failed (injected)"));
            }
            self.marks.borrow_mut()[k] = self.queue.borrow().len();
            Ok(())
        }
        fn wait(&self, k: usize, _: Duration) -> Result<bool> {
            if self.stuck.get() {
                return Ok(false);
            }
            let m = self.marks.borrow()[k];
            self.run_to(m);
            Ok(true)
        }
        fn atomic_add(&self, addr: u64, value: u64) -> Result<()> {
            self.queue.borrow_mut().push(Op::Word { addr, value, add: true });
            self.progress();
            Ok(())
        }
        fn write_value64(&self, addr: u64, value: u64) -> Result<bool> {
            if !self.memops {
                return Ok(false);
            }
            self.queue.borrow_mut().push(Op::Word { addr, value, add: false });
            self.progress();
            Ok(true)
        }
        fn wait_idle(&self, _: Duration) -> Result<bool> {
            if self.stuck.get() {
                return Ok(false);
            }
            let n = self.queue.borrow().len();
            self.run_to(n);
            Ok(true)
        }
    }

    fn stager() -> Stager<Lazy> {
        stager_keeping().0
    }

    /// A stager, and its two buffers' allocations (to see whether dropping it freed them).
    fn stager_keeping() -> (Stager<Lazy>, [Arc<HostAlloc>; 2]) {
        let allocs =
            [Arc::new(HostAlloc::zeroed(STAGE_CHUNK).unwrap()), Arc::new(HostAlloc::zeroed(STAGE_CHUNK).unwrap())];
        let stages = [Region::owned(allocs[0].clone(), STAGE_CHUNK), Region::owned(allocs[1].clone(), STAGE_CHUNK)];
        let eng = Lazy {
            gpu: RefCell::new(vec![0; GPU_LEN]),
            stages: [stages[0].clone(), stages[1].clone()],
            queue: RefCell::new(Vec::new()),
            done: RefCell::new(0),
            marks: RefCell::new([0; 2]),
            early: RefCell::new(MODE.with(|m| m.get().0)),
            memops: MODE.with(|m| m.get().1),
            stuck: std::cell::Cell::new(false),
            record_fails: std::cell::Cell::new(false),
        };
        (Stager::with(eng, stages), allocs)
    }

    /// Whether each buffer's allocation is still held by something other than the test (a
    /// leaked region) once the stager is gone.
    fn kept(allocs: &[Arc<HostAlloc>; 2]) -> [bool; 2] {
        [Arc::strong_count(&allocs[0]) > 1, Arc::strong_count(&allocs[1]) > 1]
    }

    /// Dropping a stager whose copy is still running keeps that copy's buffer allocated (never
    /// freed under the copy engine); once the copies ran, both buffers are freed.
    #[test]
    fn dropping_with_a_copy_still_running_keeps_its_buffer() {
        for stuck in [true, false] {
            let (mut st, allocs) = stager_keeping();
            let mut model = vec![0u8; GPU_LEN];
            assert!(put(&mut st, &mut model, 64, 8, 1));
            assert!(!st.issue_when_dry(false).unwrap());
            st.eng.stuck.set(stuck);
            drop(st);
            assert_eq!(kept(&allocs), [stuck, false], "stuck: {stuck}");
        }
    }

    /// A copy that does not finish is a timeout that leaves its buffer pending (not reused),
    /// and a failed event record leaves both buffers kept when the stager goes.
    #[test]
    fn a_stuck_copy_times_out_and_a_failed_record_keeps_the_buffers() {
        let (mut st, allocs) = stager_keeping();
        let mut model = vec![0u8; GPU_LEN];
        assert!(put(&mut st, &mut model, 64, 8, 1));
        st.eng.stuck.set(true);
        let e = st.settle().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(st.pending[0], "a copy that did not finish left its buffer free");
        drop(st);
        assert_eq!(kept(&allocs), [true, false]);

        let (mut st, allocs) = stager_keeping();
        assert!(put(&mut st, &mut model, 64, 8, 2));
        st.eng.record_fails.set(true);
        assert!(st.settle().is_err());
        assert!(st.untracked);
        drop(st);
        assert_eq!(kept(&allocs), [true, true]);
    }

    /// The receiving and gathering tests again with an engine that may run any queued copy at
    /// once (several seeds), and once more without stream memory operations (tokens by copy).
    #[test]
    fn the_tests_hold_when_copies_run_early_or_tokens_are_copies() {
        let all = || {
            received_payloads_land_in_order_by_each_settle_and_token();
            interleaved_payloads_to_distinct_slots_land_with_few_copies();
            a_rewritten_ring_of_slots_lands_in_order_with_few_copies();
            drifting_producers_rewriting_a_ring_land_with_few_copies();
            packing_at_the_limit_fits_odd_sized_groups();
            a_reversed_run_larger_than_the_packing_room_lands();
            gathered_payloads_read_back_exactly();
            interleaved_payloads_gather_with_few_copies();
        };
        for seed in [1u64, 0x9e37_79b9, 0xdead_beef] {
            with_mode(Some(seed), true, all);
        }
        with_mode(None, false, all);
    }

    /// A word's value after update `t`, as the GPU applies it.
    fn applied(word: u64, t: GpuToken) -> u64 {
        if t.add { word.wrapping_add(t.value) } else { t.value }
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut r = Rng(seed | 1);
        (0..n).map(|_| r.next() as u8).collect()
    }

    /// The bytes of gathered payload `pick`, as `send_pieces` reads them.
    fn read_pick(st: &Stager<Lazy>, pick: usize) -> Vec<u8> {
        let p = st.picks[pick];
        let mut got = vec![0u8; p.len];
        st.stages[st.cur].read(p.at as u64, &mut got).unwrap();
        got
    }

    /// No copy from the GPU read across `boundary` (the start of the second of two regions
    /// back to back): a gathered cluster never runs from one allocation into the next.
    fn no_copy_crosses(st: &Stager<Lazy>, boundary: u64) {
        for op in st.eng.queue.borrow().iter() {
            if let Op::DtoH { src, n, .. } = *op {
                let (a, b) = (src, src + n as u64 - 1);
                assert_eq!(a < boundary, b < boundary, "a copy from {a:#x} to {b:#x} crossed regions");
            }
        }
    }

    /// Copies the engine was asked for so far.
    fn copies(st: &Stager<Lazy>) -> usize {
        st.eng.queue.borrow().iter().filter(|o| !matches!(o, Op::Word { .. })).count()
    }

    /// A payload size: mostly small, some up to `GATHER_MAX`.
    fn size(r: &mut Rng) -> usize {
        match r.next() % 20 {
            0 => GATHER_MAX as usize,
            1 => (r.next() % GATHER_MAX) as usize + 1,
            2..=5 => (r.next() % 65536) as usize + 1,
            _ => (r.next() % 4096) as usize + 1,
        }
    }

    /// Receiving: payloads (overlapping, some contiguous, some cut short) land in order, all
    /// of them by each settle and each token, none of a cut one ever.
    #[test]
    fn received_payloads_land_in_order_by_each_settle_and_token() {
        let mut st = stager();
        let region = (BASE, GPU_LEN - 4096);
        let tokens = [BASE + (GPU_LEN - 64) as u64, BASE + (GPU_LEN - 32) as u64];
        let mut words = [0u64; 2];
        let mut rounds = 0;
        let mut model = vec![0u8; GPU_LEN];
        let mut rng = Rng(0x1234_5678);
        let mut lazy_seen = false;
        let mut next_off = 0usize;
        for i in 0..3000u64 {
            let n = size(&mut rng);
            // One in three continues the previous payload on the GPU.
            let off = if rng.next().is_multiple_of(3) && next_off + n <= region.1 {
                next_off
            } else {
                (rng.next() as usize) % (region.1 - n)
            };
            let data = bytes(i, n);
            let cut = rng.next().is_multiple_of(25);
            // After a cut payload, the next one may continue where the cut one began (where the
            // run it was taken out of now ends).
            next_off = if cut { off } else { off + n };
            let r = st.recv_small(region, off as u64, n, |stage, at| {
                let half = n / 2;
                stage.write(at, &data[..half]).map_err(StageError::from)?;
                if cut {
                    return Err(StageError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                stage.write(at + half as u64, &data[half..]).map_err(StageError::from)
            });
            assert_eq!(r.is_err(), cut);
            if !cut {
                model[off..off + n].copy_from_slice(&data);
                if st.eng.gpu.borrow()[off..off + n] != data[..] {
                    lazy_seen = true;
                }
            }
            match rng.next() % 40 {
                0 => {
                    st.settle().unwrap();
                    assert!(st.eng.gpu.borrow()[..region.1] == model[..region.1], "after settle at payload {i}");
                }
                1 => {
                    // A round of one to four updates of two words, adds and stores mixed (a
                    // store, without stream memory operations, is a copy from a pinned slot).
                    let ops: Vec<GpuToken> = (0..1 + rng.next() % 4)
                        .map(|_| {
                            let w = (rng.next() % 2) as usize;
                            GpuToken { addr: tokens[w], value: rng.next() % 1000, add: rng.next().is_multiple_of(2) }
                        })
                        .collect();
                    for &op in &ops {
                        let w = usize::from(op.addr == tokens[1]);
                        words[w] = applied(words[w], op);
                    }
                    st.tokens_at(&ops).unwrap();
                    assert!(st.eng.gpu.borrow()[..region.1] == model[..region.1], "after tokens at payload {i}");
                    for (w, &want) in words.iter().enumerate() {
                        let g = (tokens[w] - BASE) as usize;
                        let got = u64::from_le_bytes(st.eng.gpu.borrow()[g..g + 8].try_into().unwrap());
                        assert_eq!(got, want, "token word {w} after the round at payload {i} ({ops:?})");
                    }
                    rounds += 1;
                }
                _ => {}
            }
        }
        st.settle().unwrap();
        assert!(st.eng.gpu.borrow()[..region.1] == model[..region.1]);
        assert!(lazy_seen, "the engine never held a copy back: the test would catch nothing");
        assert!(rounds > 20, "only {rounds} rounds of token updates");
    }

    /// An update merged from consecutive ones of one word leaves the word as they would in turn.
    #[test]
    fn merged_token_updates_equal_the_updates_in_turn() {
        let mut r = Rng(0x70c3);
        for _ in 0..2000 {
            let ops: Vec<GpuToken> = (0..1 + r.next() % 6)
                .map(|_| GpuToken { addr: 64, value: r.next(), add: r.next().is_multiple_of(2) })
                .collect();
            let start = r.next();
            let in_turn = ops.iter().fold(start, |w, &o| applied(w, o));
            let merged = ops[1..].iter().fold(ops[0], |m, &o| m.then(o));
            assert_eq!(applied(start, merged), in_turn, "{ops:?} from {start}");
        }
    }

    /// Sending: payloads gathered as `send_batch` does (until a buffer has no room, then what
    /// was gathered is read and the stager settles) read back exactly, contiguous ones sharing
    /// copies; the run never crosses into the next region.
    #[test]
    fn gathered_payloads_read_back_exactly() {
        let mut st = stager();
        let src = bytes(99, GPU_LEN);
        st.eng.gpu.borrow_mut().copy_from_slice(&src);
        // Two regions back to back: a run must not cross from one into the other.
        let regions = [(BASE, GPU_LEN / 2), (BASE + (GPU_LEN / 2) as u64, GPU_LEN / 2)];
        let mut rng = Rng(0xfeed);
        let mut pieces: Vec<(usize, usize, usize)> = Vec::new(); // (pick, gpu offset, len)
        let mut next = (0usize, 0u64);
        let mut copies_before = 0;
        let check = |st: &mut Stager<Lazy>, pieces: &mut Vec<(usize, usize, usize)>| {
            st.gathered().unwrap();
            for &(pick, g, n) in pieces.iter() {
                assert_eq!(
                    read_pick(st, pick),
                    src[g..g + n],
                    "a gathered {n}-byte payload from {g:#x} read back wrong"
                );
            }
            pieces.clear();
            st.settle().unwrap();
        };
        for _ in 0..4000 {
            let n = size(&mut rng);
            let (ri, off) = if rng.next().is_multiple_of(2) && next.1 as usize + n <= regions[next.0].1 {
                next
            } else if rng.next().is_multiple_of(20) {
                // Ends the first region: the next payload may begin the second, right after it.
                (0, (regions[0].1 - n) as u64)
            } else {
                let ri = (rng.next() % 2) as usize;
                (ri, rng.next() % (regions[ri].1 - n) as u64)
            };
            next = if ri == 0 && off as usize + n == regions[0].1 { (1, 0) } else { (ri, off + n as u64) };
            if !st.room_for(n as u64) {
                check(&mut st, &mut pieces);
            }
            let pick = st.gather_in(regions[ri], off, n as u64).unwrap();
            let g = (regions[ri].0 - BASE) as usize + off as usize;
            pieces.push((pick, g, n));
            if rng.next().is_multiple_of(30) {
                check(&mut st, &mut pieces);
            }
            copies_before += 1;
        }
        check(&mut st, &mut pieces);
        let copies = st.eng.queue.borrow().len();
        assert!(
            copies < copies_before,
            "contiguous payloads never shared a copy ({copies} copies for {copies_before})"
        );
        no_copy_crosses(&st, regions[1].0);
    }

    /// Receiving as many producers interleave: payloads to distinct slots arrive in a shuffled
    /// order; they land exactly by each settle and token, and most share copies (packed in
    /// pinned memory by GPU address).
    #[test]
    fn interleaved_payloads_to_distinct_slots_land_with_few_copies() {
        let mut st = stager();
        let region = (BASE, GPU_LEN - 4096);
        let token = BASE + (GPU_LEN - 64) as u64;
        let mut model = vec![0u8; GPU_LEN];
        let mut rng = Rng(0x5eed);
        let mut received = 0usize;
        for round in 0..40u64 {
            let size = [8usize, 64, 512, 4096][(round % 4) as usize];
            // 300 slots of one size, in an order shuffled within windows of 32 (as 32
            // producers' pushes interleave), some rounds leaving every fifth slot out.
            let base = (rng.next() as usize % (region.1 / 2)) / size * size;
            let mut slots: Vec<usize> = (0..300).filter(|i| round % 3 != 0 || i % 5 != 0).collect();
            for w in slots.chunks_mut(32) {
                for i in (1..w.len()).rev() {
                    w.swap(i, rng.next() as usize % (i + 1));
                }
            }
            for (j, slot) in slots.into_iter().enumerate() {
                let off = base + slot * size;
                assert!(
                    put(&mut st, &mut model, off, size, round * 1000 + j as u64),
                    "round {round}: payload {j} refused"
                );
                received += 1;
            }
            if round % 2 == 0 {
                st.settle().unwrap();
            } else {
                st.tokens_at(&[GpuToken { addr: token, value: 1, add: true }]).unwrap();
            }
            assert!(landed_as(&st, &model), "round {round}");
        }
        let n = copies(&st);
        assert!(n * 10 < received, "{n} copies for {received} payloads: the interleaved ones were not grouped");
    }

    /// Sending as many producers interleave: shuffled slots, some a little apart, read back
    /// exactly, with few copies, none leaving its region.
    #[test]
    fn interleaved_payloads_gather_with_few_copies() {
        let mut st = stager();
        let src = bytes(7, GPU_LEN);
        st.eng.gpu.borrow_mut().copy_from_slice(&src);
        let regions = [(BASE, GPU_LEN / 2), (BASE + (GPU_LEN / 2) as u64, GPU_LEN / 2)];
        let mut rng = Rng(0xabc);
        let mut gathered = 0usize;
        for round in 0..30u64 {
            let size = [8usize, 100, 4096][(round % 3) as usize];
            // Every other round the slots are spread out (gaps smaller than GATHER_GAP); the
            // last round's slots run up to the end of the first region.
            let stride = if round % 2 == 0 { size } else { size + 4000 };
            let ri = (round % 2) as usize;
            let count = 200usize.min(regions[ri].1 / stride);
            let base = if round == 29 {
                regions[0].1 - count * stride
            } else {
                rng.next() as usize % (regions[ri].1 - count * stride)
            };
            let ri = if round == 29 { 0 } else { ri };
            let mut slots: Vec<usize> = (0..count).collect();
            for i in (1..slots.len()).rev() {
                slots.swap(i, rng.next() as usize % (i + 1));
            }
            let mut pieces = Vec::new();
            for slot in slots {
                let off = base + slot * stride;
                assert!(st.room_for(size as u64));
                let pick = st.gather_in(regions[ri], off as u64, size as u64).unwrap();
                pieces.push((pick, (regions[ri].0 - BASE) as usize + off, size));
                gathered += 1;
            }
            st.gathered().unwrap();
            for (pick, g, n) in pieces {
                assert_eq!(read_pick(&st, pick), src[g..g + n], "round {round}: payload at {g:#x}");
            }
            st.settle().unwrap();
        }
        let n = copies(&st);
        assert!(n * 20 < gathered, "{n} copies for {gathered} payloads");
        no_copy_crosses(&st, regions[1].0);
    }

    /// Receiving a ring of slots rewritten over and over (as `mscclpp-perf`'s proxy rows do:
    /// 132 producers, 256 slots): every value lands, the last write to a slot wins, and epochs
    /// of distinct slots still share copies.
    #[test]
    fn a_rewritten_ring_of_slots_lands_in_order_with_few_copies() {
        let mut st = stager();
        let token = BASE + (GPU_LEN - 64) as u64;
        let mut model = vec![0u8; GPU_LEN];
        let mut rng = Rng(0x7a11);
        let (producers, slots, size) = (132u64, 256u64, 8usize);
        let mut received = 0usize;
        for round in 0..30u64 {
            // Trigger i = k * producers + p goes to slot i % slots; the producers' pushes arrive
            // a little out of order (each window of 8 shuffled).
            let mut order: Vec<u64> = (0..producers * 20).map(|j| round * producers * 20 + j).collect();
            for w in order.chunks_mut(8) {
                for i in (1..w.len()).rev() {
                    w.swap(i, rng.next() as usize % (i + 1));
                }
            }
            for i in order {
                let off = ((i % slots) as usize) * size;
                assert!(put(&mut st, &mut model, off, size, i), "trigger {i} refused");
                received += 1;
            }
            if round % 2 == 0 {
                st.settle().unwrap();
            } else {
                st.tokens_at(&[GpuToken { addr: token, value: round, add: false }]).unwrap();
            }
            assert!(landed_as(&st, &model), "round {round}");
        }
        let n = copies(&st);
        assert!(n * 8 < received, "{n} copies for {received} payloads");
    }

    /// Receiving as 132 single-thread producers push into a ring of 256 slots, each producer at
    /// its own pace (a random one pushes next): slots are rewritten within one batch, exactly;
    /// the last write of each wins, and the batch still lands with few copies.
    #[test]
    fn drifting_producers_rewriting_a_ring_land_with_few_copies() {
        let (n, received) = land_drifting_producers(8, 20);
        assert!(n * 40 < received, "{n} copies for {received} payloads");
    }

    /// The same with larger payloads (the proxy rows' 512 B and 4 KiB): a landing epoch holds
    /// enough of them (`LAND_BYTES`) that most slots of the ring are in it, so the copies stay
    /// far fewer than the payloads.
    #[test]
    fn drifting_producers_with_larger_payloads_land_with_few_copies() {
        for (size, most) in [(512usize, 100usize), (4096, 400)] {
            let (n, received) = land_drifting_producers(size, 10);
            assert!(n <= most, "{size} B: {n} copies for {received} payloads");
        }
    }

    /// `rounds` batches of 2000 payloads of `size` bytes from 132 producers at random paces
    /// into a ring of 256 slots, each batch ended by a token and checked landed exactly:
    /// (copies, payloads).
    fn land_drifting_producers(size: usize, rounds: u64) -> (usize, usize) {
        let mut st = stager();
        let token = BASE + (GPU_LEN - 64) as u64;
        let mut model = vec![0u8; GPU_LEN];
        let mut rng = Rng(0xd71f7);
        let (producers, slots) = (132usize, 256usize);
        let mut k = vec![0usize; producers];
        let mut received = 0usize;
        for round in 0..rounds {
            for _ in 0..2000 {
                let p = rng.next() as usize % producers;
                let i = k[p] * producers + p;
                k[p] += 1;
                assert!(put(&mut st, &mut model, (i % slots) * size, size, round << 32 | i as u64));
                received += 1;
            }
            st.tokens_at(&[GpuToken { addr: token, value: 1, add: true }]).unwrap();
            assert!(landed_as(&st, &model), "{size} B, round {round}");
        }
        (copies(&st), received)
    }

    /// Receives `n` bytes for GPU offset `off` into the model too.
    fn put(st: &mut Stager<Lazy>, model: &mut [u8], off: usize, n: usize, seed: u64) -> bool {
        let data = bytes(seed, n);
        model[off..off + n].copy_from_slice(&data);
        let region = (BASE, GPU_LEN - 4096);
        st.recv_small(region, off as u64, n, |stage, at| stage.write(at, &data).map_err(StageError::from)).is_ok()
    }

    fn landed_as(st: &Stager<Lazy>, model: &[u8]) -> bool {
        st.eng.gpu.borrow()[..GPU_LEN - 4096] == model[..GPU_LEN - 4096]
    }

    /// Packed groups whose sizes are not multiples of the alignment, right at the room's limit,
    /// still fit (each group aligned, they did not: a legal sequence failed the connection).
    #[test]
    fn packing_at_the_limit_fits_odd_sized_groups() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        assert!(put(&mut st, &mut model, 16 << 20, 1 << 20, 1));
        assert!(put(&mut st, &mut model, 18 << 20, 523968, 2));
        let y = 8usize << 20;
        assert!(put(&mut st, &mut model, y + (1 << 20), 262137, 3));
        for (off, seed) in [(101, 4), (100, 5), (301, 6), (300, 7)] {
            assert!(put(&mut st, &mut model, off, 1, seed));
        }
        assert!(put(&mut st, &mut model, y, 1 << 20, 8), "a legal payload refused");
        st.settle().unwrap();
        assert!(landed_as(&st, &model));
    }

    /// The largest group that may wait (a payload just under the byte limit, then one of
    /// `GATHER_MAX` before it on the GPU) is packed with the buffer filled to its limit.
    #[test]
    fn the_largest_packed_group_fits() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        let limit = STAGE_CHUNK - LAND_ROOM;
        let y = 8usize << 20;
        // The group's two payloads, then fillers before them up to the limit (as much as fits).
        let group = (LAND_BYTES - 1).next_multiple_of(GATHER_ALIGN) + (1 << 20);
        let mut fill = limit.saturating_sub(group);
        for (k, at) in [16usize << 20, 18 << 20].into_iter().enumerate() {
            let n = fill.min(1 << 20);
            if n > 0 {
                assert!(put(&mut st, &mut model, at, n, k as u64 + 1));
            }
            fill -= n;
        }
        assert!(put(&mut st, &mut model, y + (1 << 20), LAND_BYTES - 1, 3));
        assert!(put(&mut st, &mut model, y, 1 << 20, 4));
        st.settle().unwrap();
        assert!(landed_as(&st, &model));
    }

    /// A one-byte overlap keeps arrival order (the later write wins its byte).
    #[test]
    fn a_one_byte_overlap_keeps_arrival_order() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        assert!(put(&mut st, &mut model, 4096 + 7, 8, 1));
        assert!(put(&mut st, &mut model, 4096, 8, 2));
        st.settle().unwrap();
        assert!(landed_as(&st, &model));
    }

    /// A contiguous run arriving last-first, larger than the room kept for packing: the byte
    /// and count limits land it in parts, every byte right.
    #[test]
    fn a_reversed_run_larger_than_the_packing_room_lands() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        for i in 0..44u64 {
            let off = (8 << 20) - (i as usize + 1) * (64 << 10);
            assert!(put(&mut st, &mut model, off, 64 << 10, i), "payload {i}");
        }
        st.settle().unwrap();
        assert!(landed_as(&st, &model));
    }

    /// Gathering payloads of an odd size, each its own region, until the buffer is full.
    #[test]
    fn gathering_odd_sizes_until_the_buffer_is_full() {
        let mut st = stager();
        let src = bytes(5, GPU_LEN);
        st.eng.gpu.borrow_mut().copy_from_slice(&src);
        let mut pieces = Vec::new();
        let mut off = 0u64;
        while st.room_for(65) {
            pieces.push((st.gather_in((BASE + off, 65), 0, 65).unwrap(), off as usize));
            off += 65;
        }
        st.gathered().unwrap();
        for (p, g) in pieces {
            assert_eq!(read_pick(&st, p), src[g..g + 65]);
        }
    }

    /// A lone small write is queued to the GPU by `issue_when_dry` (the receiver's call when its
    /// input runs dry), with nothing after it.
    #[test]
    fn issue_queues_a_lone_small_write() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        assert!(put(&mut st, &mut model, 0, 8, 1));
        assert_eq!(copies(&st), 0);
        assert!(!st.issue_when_dry(false).unwrap());
        assert_eq!(copies(&st), 1);
        st.eng.wait_idle(Duration::ZERO).unwrap();
        assert!(landed_as(&st, &model));
    }

    /// When the input runs dry, many payloads mostly out of order wait (the holes between them
    /// may fill) until the input has stayed dry for the grace, then land exactly; as many in
    /// order, or fewer than `DEFER_MIN`, land at once.
    #[test]
    fn many_out_of_order_payloads_wait_out_the_dry_grace_in_order_ones_do_not() {
        let mut rng = Rng(0xd2e);
        // Out of order: every other slot of 64, backwards (however slowly this machine runs).
        let mut st = stager();
        st.defer_max = Duration::MAX;
        let mut model = vec![0u8; GPU_LEN];
        for i in (0..32usize).rev() {
            assert!(put(&mut st, &mut model, i * 2 * 64, 64, rng.next()));
        }
        assert!(st.issue_when_dry(false).unwrap(), "32 payloads out of order did not wait");
        assert_eq!(copies(&st), 0);
        assert!(!st.issue_when_dry(true).unwrap());
        assert_eq!(copies(&st), 32);
        st.eng.wait_idle(Duration::ZERO).unwrap();
        assert!(landed_as(&st, &model));
        // In order: one run, one copy, at once.
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        for i in 0..32usize {
            assert!(put(&mut st, &mut model, i * 64, 64, rng.next()));
        }
        assert!(!st.issue_when_dry(false).unwrap());
        assert_eq!(copies(&st), 1);
        // Out of order but fewer than DEFER_MIN: at once.
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        for i in (0..DEFER_MIN - 1).rev() {
            assert!(put(&mut st, &mut model, i * 2 * 64, 64, rng.next()));
        }
        assert!(!st.issue_when_dry(false).unwrap());
        assert_eq!(copies(&st), DEFER_MIN - 1);
        st.eng.wait_idle(Duration::ZERO).unwrap();
        assert!(landed_as(&st, &model));
    }

    /// Deferred payloads land once the oldest of them has waited `DEFER_MAX`, even while input
    /// keeps coming (the grace never runs out): here a limit of zero, so at once.
    #[test]
    fn deferred_payloads_land_after_defer_max_while_input_keeps_coming() {
        let mut st = stager();
        st.defer_max = Duration::ZERO;
        let mut model = vec![0u8; GPU_LEN];
        for i in (0..32usize).rev() {
            assert!(put(&mut st, &mut model, i * 2 * 64, 64, i as u64));
        }
        assert!(!st.issue_when_dry(false).unwrap(), "deferred past DEFER_MAX");
        assert_eq!(copies(&st), 32);
        st.eng.wait_idle(Duration::ZERO).unwrap();
        assert!(landed_as(&st, &model));
    }

    /// Exact rewrites of waiting payloads do not count toward `LAND_BYTES`: 1,000 writes of
    /// 4 KiB into a ring of 256 slots (4 MiB received, 1 MiB distinct) wait for one landing.
    #[test]
    fn exact_rewrites_do_not_count_toward_the_landing_bytes() {
        let mut st = stager();
        let mut model = vec![0u8; GPU_LEN];
        let mut rng = Rng(0x4e11);
        for i in 0..1000u64 {
            let slot = (rng.next() % 256) as usize;
            assert!(put(&mut st, &mut model, slot * 4096, 4096, i));
        }
        assert_eq!(copies(&st), 0, "a landing before the buffer filled");
        st.settle().unwrap();
        assert!(landed_as(&st, &model));
        assert!(copies(&st) <= 256, "{} copies", copies(&st));
    }
}
