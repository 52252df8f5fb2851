//! Staging GPU memory through pinned host buffers: the sender copies chunks of a GPU source to
//! the host while the previous chunk goes into the socket, and the receiver fills one pinned
//! buffer from the socket while the other is copied to the GPU.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::time::Duration;

use super::recv::RxSocket;
use crate::error::{Error, ErrorKind, Result};
use crate::platform::cuda::GpuRegion;
use crate::platform::hostmem::{IoPart, Region, send_vectored};

/// Bytes per staging chunk.
const STAGE_CHUNK: usize = 4 << 20;

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

/// Two pinned buffers, a stream and two events on one GPU: double buffering between the GPU's
/// copy engine and the socket.
pub(crate) struct Stager {
    stream: crate::platform::cuda::Stream,
    events: [crate::platform::cuda::Event; 2],
    stages: [Region; 2],
    /// Whether copies from or into buffer `k` were queued since it was last waited for.
    pending: [bool; 2],
    /// Whether `events[k]` was recorded after the last of those copies (gathered copies record
    /// it only when it is waited for: one driver call per wait, not per copy).
    marked: [bool; 2],
    /// Where the next gathered payload goes: the buffer, and the bytes of it already taken.
    /// Copies from or into a buffer are waited for before it is taken again from the start.
    cur: usize,
    fill: usize,
    /// The gathered copy not issued yet (see [`Run`]).
    run: Option<Run>,
    /// A copy was queued whose end can no longer be waited for (recording its event failed, or
    /// the stream did not drain): the buffers are kept allocated when the stager goes.
    untracked: bool,
}

/// A gathered copy not issued yet: a payload that continues it both on the GPU and in the
/// buffer extends it, so contiguous small writes cost one copy. It is issued before anything
/// waits for the buffer's copies, before a token, and when a payload does not continue it.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// Buffer and offset in it.
    k: usize,
    at: usize,
    /// GPU address and length, and the region it lies in (a run never crosses from one
    /// allocation into a neighbour that happens to follow it).
    gpu: u64,
    len: usize,
    region: (u64, usize),
    /// Host to GPU (receiving) or GPU to host (sending).
    to_gpu: bool,
}

pub(super) fn stager_for<'a>(map: &'a mut HashMap<u32, Stager>, g: &GpuRegion) -> Result<&'a mut Stager> {
    use std::collections::hash_map::Entry;
    match map.entry(g.dev.ordinal) {
        Entry::Occupied(e) => Ok(e.into_mut()),
        Entry::Vacant(v) => {
            let dev = &g.dev;
            Ok(v.insert(Stager {
                stream: crate::platform::cuda::Stream::new(dev)?,
                events: [crate::platform::cuda::Event::new(dev)?, crate::platform::cuda::Event::new(dev)?],
                stages: [
                    crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
                    crate::platform::cuda::PinnedAlloc::region(dev, STAGE_CHUNK)?,
                ],
                pending: [false; 2],
                marked: [false; 2],
                cur: 0,
                fill: 0,
                run: None,
                untracked: false,
            }))
        }
    }
}

/// Long enough for any one chunk's copy; a stuck GPU fails the connection instead of hanging it.
const STAGE_WAIT: Duration = Duration::from_secs(60);

impl Drop for Stager {
    fn drop(&mut self) {
        // A run not issued has no copy in flight.
        self.run = None;
        for k in 0..2 {
            let done = |st: &mut Stager| {
                !st.pending[k]
                    || ((st.marked[k] || st.mark(k).is_ok()) && matches!(st.events[k].wait(DROP_WAIT), Ok(true)))
            };
            if self.untracked || !done(self) {
                // A copy may still read or write this buffer: keep it allocated for good.
                std::mem::forget(self.stages[k].clone());
            }
        }
    }
}

impl Stager {
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
        if let Err(e) = self.stream.record(&self.events[k]) {
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
        Ok(())
    }

    /// Issues the open run's copy, if any.
    fn flush_run(&mut self) -> Result<()> {
        let Some(r) = self.run.take() else { return Ok(()) };
        let host = self.stages[r.k].as_mut_ptr().wrapping_add(r.at);
        if r.to_gpu {
            self.stream.copy_htod(r.gpu, host, r.len)?;
        } else {
            self.stream.copy_dtoh(host, r.gpu, r.len)?;
        }
        self.queued(r.k);
        Ok(())
    }

    /// Places `n` gathered bytes (`0 < n <= GATHER_MAX`) that go to or come from GPU address
    /// `gpu`: (buffer, offset). Extends the open run when they continue it on the GPU and in the
    /// buffer; else issues that run and opens another.
    fn place(&mut self, g: &GpuRegion, off: u64, n: usize, to_gpu: bool) -> Result<(usize, usize)> {
        let gpu = g.ptr + off;
        let region = (g.ptr, g.len);
        if let Some(r) = self.run.as_mut()
            && r.to_gpu == to_gpu
            && r.region == region
            && r.k == self.cur
            && r.gpu.checked_add(r.len as u64) == Some(gpu)
            && r.at + r.len == self.fill
            && self.fill + n <= STAGE_CHUNK
        {
            let at = self.fill;
            r.len += n;
            self.fill += n;
            return Ok((self.cur, at));
        }
        self.flush_run()?;
        let at = self.take(n)?;
        self.run = Some(Run { k: self.cur, at, gpu, len: n, region, to_gpu });
        Ok((self.cur, at))
    }

    /// Takes back the `n` bytes [`place`](Self::place) placed last (a payload that did not
    /// arrive whole).
    fn unplace(&mut self, n: usize) {
        if let Some(r) = self.run.as_mut() {
            r.len = r.len.saturating_sub(n);
            if r.len == 0 {
                self.run = None;
            }
        }
    }

    /// Room for `n` gathered bytes (`n <= STAGE_CHUNK`): their offset in buffer `self.cur`.
    /// Moves to the other buffer (after its copies) when this one is full.
    fn take(&mut self, n: usize) -> Result<usize> {
        let at = self.fill.next_multiple_of(GATHER_ALIGN);
        if at + n <= STAGE_CHUNK {
            self.fill = at + n;
            return Ok(at);
        }
        // This buffer's copies end here (so that coming back to it waits for them alone, not
        // for what is queued on the other one by then).
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

    /// Sender side: queues the copy of a small GPU payload (`len <= GATHER_MAX`) into the
    /// gather buffer and returns where it will be (buffer, offset). Every gathered payload is
    /// read only after [`gathered`](Self::gathered) waited for the copies, and the buffer is
    /// not taken again before that (the caller sends what was gathered first: see
    /// [`room_for`](Self::room_for)).
    pub(super) fn gather(&mut self, src: &GpuRegion, off: u64, len: u64) -> Result<(usize, usize)> {
        src.check(off, len)?;
        if len == 0 {
            return Ok((self.cur, 0));
        }
        self.place(src, off, len as usize, false)
    }

    /// Whether `len` more gathered bytes fit in the current buffer (else the caller sends
    /// what it gathered, then [`settle`](Self::settle)s, before gathering more).
    pub(super) fn room_for(&self, len: u64) -> bool {
        self.fill.next_multiple_of(GATHER_ALIGN) as u64 + len <= STAGE_CHUNK as u64
    }

    /// Waits for the gathered copies; then `part(k, at, len)` reads them.
    pub(super) fn gathered(&mut self) -> Result<()> {
        self.wait(0)?;
        self.wait(1)
    }

    /// The gathered bytes at (`k`, `at`).
    pub(super) fn part(&self, k: usize, at: usize, len: u64) -> Result<IoPart<'_>> {
        self.stages[k].part(at as u64, len)
    }

    pub(super) fn wait(&mut self, k: usize) -> Result<()> {
        self.flush_run()?;
        if self.pending[k] {
            if !self.marked[k] {
                self.mark(k)?;
            }
            if !self.events[k].wait(STAGE_WAIT)? {
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
        let issue = |st: &mut Stager, i: usize| -> Result<()> {
            let k = i % 2;
            st.wait(k)?;
            st.stream.copy_dtoh(st.stages[k].as_mut_ptr(), src.ptr + off + (i * STAGE_CHUNK) as u64, size(i))?;
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
    /// [`settle`](Self::settle) or [`token`](Self::token) returns. A larger one goes through
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
            // Queued behind the earlier ones; waited for by `settle` (before an acknowledgement
            // or anything else that must see it landed) or when its buffer is taken again.
            let n = len as usize;
            let (k, at) = self.place(dst, off, n, true)?;
            let b = rd.buffer().len().min(n);
            let mut read = self.stages[k].write(at as u64, &rd.buffer()[..b]).map_err(StageError::from);
            rd.consume(b);
            if read.is_ok() && b < n {
                read = self.stages[k]
                    .recv_exact((at + b) as u64, (n - b) as u64, &rd.get_ref().sock)
                    .map_err(StageError::from);
            }
            if read.is_err() {
                // Not all of it arrived: it must never be copied to the GPU.
                self.unplace(n);
            }
            return read;
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
            self.stream.copy_htod(dst.ptr + off + done, self.stages[k].as_mut_ptr(), n)?;
            self.recorded(k)?;
            done += n as u64;
            i += 1;
        }
        self.settle()?;
        Ok(())
    }

    /// Sets or adds to a GPU word in stream order (after every copy queued on this stager) and
    /// waits for it, and so for those copies too.
    pub(super) fn token(&mut self, dst: &GpuRegion, off: u64, value: u64, add: bool) -> Result<()> {
        dst.check(off, 8)?;
        // The token goes after every copy before it on the stream.
        self.flush_run()?;
        let addr = dst.ptr + off;
        if add {
            self.stream.atomic_add(addr, value)?;
        } else if !self.stream.write_value64(addr, value)? {
            // No stream memory operations on this device: copy from a pinned slot, then wait.
            self.settle()?;
            self.stages[0].write(0, &value.to_le_bytes())?;
            self.stream.copy_htod(addr, self.stages[0].as_mut_ptr(), 8)?;
        }
        // Bounded: the atomic is a one-thread kernel, which a GPU filled by kernels spinning for
        // this very token cannot schedule (notes 1.7); fail the connection then, never hang.
        let idle = self.stream.wait_idle(STAGE_WAIT);
        if !matches!(idle, Ok(true)) {
            // The pinned slot of the fallback copy may still be read.
            self.untracked = true;
        }
        if !idle? {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("a GPU token update did not finish in {STAGE_WAIT:?} (is the GPU full of waiting kernels?)"),
            ));
        }
        // The stream is idle: every copy before the token has landed.
        self.pending = [false; 2];
        self.cur = 0;
        self.fill = 0;
        Ok(())
    }
}
