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
use crate::platform::hostmem::{Region, send_vectored};

/// Bytes per staging chunk.
const STAGE_CHUNK: usize = 4 << 20;

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
    /// Whether `events[k]` was recorded since stage `k` was last waited for.
    pending: [bool; 2],
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
            }))
        }
    }
}

/// Long enough for any one chunk's copy; a stuck GPU fails the connection instead of hanging it.
const STAGE_WAIT: Duration = Duration::from_secs(60);

impl Stager {
    pub(super) fn wait(&mut self, k: usize) -> Result<()> {
        if self.pending[k] {
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
        let chunks = len.div_ceil(STAGE_CHUNK as u64) as usize;
        let size = |i: usize| (len - (i * STAGE_CHUNK) as u64).min(STAGE_CHUNK as u64) as usize;
        let issue = |st: &mut Stager, i: usize| -> Result<()> {
            let k = i % 2;
            st.wait(k)?;
            st.stream.copy_dtoh(st.stages[k].as_mut_ptr(), src.ptr + off + (i * STAGE_CHUNK) as u64, size(i))?;
            st.stream.record(&st.events[k])?;
            st.pending[k] = true;
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

    /// Receives `len` bytes into GPU memory at `off`: the socket fills one pinned buffer while
    /// the other is copied to the GPU. Returns once the data is in GPU memory.
    pub(super) fn recv(
        &mut self,
        rd: &mut BufReader<RxSocket>,
        dst: &GpuRegion,
        off: u64,
        len: u64,
    ) -> std::result::Result<(), StageError> {
        dst.check(off, len)?;
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
            self.stream.record(&self.events[k])?;
            self.pending[k] = true;
            done += n as u64;
            i += 1;
        }
        self.wait(0)?;
        self.wait(1)?;
        Ok(())
    }

    /// Sets or adds to a GPU word in stream order and waits for it.
    pub(super) fn token(&mut self, dst: &GpuRegion, off: u64, value: u64, add: bool) -> Result<()> {
        dst.check(off, 8)?;
        let addr = dst.ptr + off;
        if add {
            self.stream.atomic_add(addr, value)?;
        } else if !self.stream.write_value64(addr, value)? {
            // No stream memory operations on this device: copy from a pinned slot, then wait.
            self.wait(0)?;
            self.stages[0].write(0, &value.to_le_bytes())?;
            self.stream.copy_htod(addr, self.stages[0].as_mut_ptr(), 8)?;
        }
        // Bounded: the atomic is a one-thread kernel, which a GPU filled by kernels spinning for
        // this very token cannot schedule (notes 1.7); fail the connection then, never hang.
        if !self.stream.wait_idle(STAGE_WAIT)? {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("a GPU token update did not finish in {STAGE_WAIT:?} (is the GPU full of waiting kernels?)"),
            ));
        }
        Ok(())
    }
}
