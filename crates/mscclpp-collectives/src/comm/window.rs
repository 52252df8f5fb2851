//! The zero-copy AllReduce: user buffers registered once with every rank ([`Window`]) and read
//! and written directly by the kernel.
#![allow(unsafe_code)]

use mscclpp::gpu::{DeviceBuffer, Stream, check_device_range};
use mscclpp::{Error, MemoryChannel, Result, Transport, TransportFlags};

use super::Collectives;
use crate::kernels::{self, CollArgs};
use crate::select::{self, MAX_RANKS_SIMPLE, Plan};
use crate::types::{Algorithm, Collective, DataType, ReduceOp};

/// User buffers registered with every rank for the zero-copy AllReduce
/// ([`Collectives::register_window`]): every rank's send and receive buffers mapped into every
/// other rank, so the kernel reads peers' inputs and writes peers' outputs directly (each byte
/// read once and written once per rank, no staging). Keep it (and the buffers) alive while
/// calls that use it may run.
pub struct Window {
    /// The [`Collectives`] that registered it (its tables are sized for that one's ranks).
    owner: u64,
    send: u64,
    recv: u64,
    len: u64,
    send_table: DeviceBuffer,
    recv_table: DeviceBuffer,
    _keep: Vec<MemoryChannel>,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Window(send {:#x}, recv {:#x}, {} bytes)", self.send, self.recv, self.len)
    }
}

impl std::fmt::Debug for Collectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Collectives(rank {} of {}, GPU{}, scratch {} bytes)",
            self.rank, self.nranks, self.device, self.layout.total
        )
    }
}

impl Collectives {
    /// Registers `send` and `recv` (device pointers of this rank's GPU, `len` bytes each; equal
    /// for in place) with every rank for the zero-copy AllReduce ([`all_reduce_window`](Self::all_reduce_window)).
    /// A collective call (every rank registers its own pair at the same time); the driver checks
    /// both ranges; memory must be shareable through CUDA IPC (`cudaMalloc`/`cuMemAlloc`, or
    /// `cuMemCreate` with a POSIX descriptor handle; not pool memory).
    ///
    /// # Errors
    /// `InvalidUsage` for pointers the driver does not know on this GPU, or memory CUDA IPC cannot
    /// share; bootstrap errors naming the peer.
    ///
    /// # Safety
    /// Both ranges stay allocated while the returned window (or a graph that captured a call
    /// using it) lives.
    pub unsafe fn register_window(&self, send: u64, recv: u64, len: usize) -> Result<Window> {
        let what = |s: &str| format!("registering a zero-copy window ({s}, rank {})", self.rank);
        let ctx = self.comm.context();
        // What this rank checks and registers alone, then agreed: a rank whose buffers do not
        // pass fails every rank at once, named, instead of leaving them waiting for its buffers.
        let local = (|| -> Result<_> {
            for (ptr, name) in [(send, "send"), (recv, "receive")] {
                let g = check_device_range(ptr, len as u64, name).map_err(|e| e.during(what(name)))?;
                if g != self.device {
                    return Err(Error::invalid_usage(format!(
                        "{}: the buffer is on GPU{g}, the collectives on GPU{}",
                        what(name),
                        self.device
                    )));
                }
            }
            // SAFETY: the caller keeps both ranges allocated while the window lives.
            Ok(unsafe {
                [
                    ctx.register_device(send, len, Transport::CudaIpc.into()).map_err(|e| e.during(what("send")))?,
                    ctx.register_device(recv, len, Transport::CudaIpc.into()).map_err(|e| e.during(what("receive")))?,
                ]
            })
        })();
        let (mine, lens) = self.comm.all_gather_outcome(
            local,
            |_| (len as u64).to_le_bytes().to_vec(),
            "registering a zero-copy window: checking every rank's buffers",
        )?;
        for (p, l) in lens.iter().enumerate() {
            if l.as_slice() != (len as u64).to_le_bytes() {
                let theirs = l.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0);
                return Err(Error::invalid_usage(format!(
                    "{}: rank {p} registers {theirs} bytes, this rank {len}",
                    what("sizes")
                ))
                .with_peer(p));
            }
        }
        // The pairwise part; a rank that fails in it says so at the closing exchange, so that
        // every rank fails at once, named.
        let tag = 0x00c0_11ed;
        let paired = (|| -> Result<_> {
            let mut pending = Vec::new();
            for (p, _) in &self.peer_sems {
                for m in &mine {
                    self.comm.send_memory(m, *p, tag).map_err(|e| e.with_peer(*p))?;
                }
                pending.push((
                    self.comm.recv_memory(*p, tag).map_err(|e| e.with_peer(*p))?,
                    self.comm.recv_memory(*p, tag).map_err(|e| e.with_peer(*p))?,
                ));
            }
            let mut send_tab = vec![0u64; self.nranks];
            let mut recv_tab = vec![0u64; self.nranks];
            send_tab[self.rank] = send;
            recv_tab[self.rank] = recv;
            let mut keep = Vec::new();
            for ((p, sem), (ps, pr)) in self.peer_sems.iter().zip(pending) {
                let (ps, pr) = (ps.wait().map_err(|e| e.with_peer(*p))?, pr.wait().map_err(|e| e.with_peer(*p))?);
                for (m, name) in [(&ps, "send"), (&pr, "receive")] {
                    if m.len() != len as u64 {
                        return Err(Error::invalid_usage(format!(
                            "{}: rank {p}'s {name} buffer has {} bytes, this rank's {len}",
                            what("sizes"),
                            m.len()
                        ))
                        .with_peer(*p));
                    }
                }
                let cs = MemoryChannel::new(sem.clone(), &ps, &mine[0], None)
                    .map_err(|e| e.during(what("mapping")).with_peer(*p))?;
                let cr = MemoryChannel::new(sem.clone(), &pr, &mine[1], None)
                    .map_err(|e| e.during(what("mapping")).with_peer(*p))?;
                send_tab[*p] = cs.device_handle().dst;
                recv_tab[*p] = cr.device_handle().dst;
                keep.push(cs);
                keep.push(cr);
            }
            let table = |t: &[u64]| -> Result<DeviceBuffer> {
                let b = DeviceBuffer::new(ctx, self.device, self.nranks * 8, TransportFlags::NONE)?;
                b.write(0, &t.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>())?;
                Ok(b)
            };
            Ok(Window {
                owner: self.id,
                send,
                recv,
                len: len as u64,
                send_table: table(&send_tab)?,
                recv_table: table(&recv_tab)?,
                _keep: keep,
            })
        })();
        // Nobody calls with the window before every rank has mapped every peer's buffers.
        let (w, _) = self.comm.all_gather_outcome(paired, |_| Vec::new(), "registering a zero-copy window")?;
        Ok(w)
    }

    /// AllReduce of `count` elements from the window's send buffers into its receive buffers,
    /// reading and writing every rank's buffers directly (no staging): half the memory traffic of
    /// the staged algorithm for large messages. Every rank calls it with its own window of the
    /// same registration.
    ///
    /// # Errors
    /// `InvalidUsage` when `count` elements do not fit the window; the errors of
    /// [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_window(
        &self,
        w: &Window,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &Stream,
    ) -> Result<()> {
        let nbytes = super::byte_len(count, dtype, 1)?;
        let what = || format!("zero-copy allreduce ({dtype} of {nbytes} bytes, rank {} of {})", self.rank, self.nranks);
        self.check().map_err(|e| e.during(what()))?;
        if nbytes == 0 {
            return Ok(());
        }
        if w.owner != self.id {
            return Err(Error::invalid_usage(format!(
                "{}: the window was registered by another Collectives object (its tables fit that one's ranks)",
                what()
            )));
        }
        if nbytes > w.len {
            return Err(Error::invalid_usage(format!("{}: the window holds {} bytes", what(), w.len)));
        }
        let es = dtype.size() as u64;
        if !w.send.is_multiple_of(es) || !w.recv.is_multiple_of(es) {
            return Err(Error::invalid_usage(format!(
                "{}: the window's buffers ({:#x}, {:#x}) are not aligned to its {es}-byte elements",
                what(),
                w.send,
                w.recv
            )));
        }
        if stream.device() != self.device {
            return Err(Error::invalid_usage(format!("{}: the stream is on GPU{}", what(), stream.device())));
        }
        if self.nranks > MAX_RANKS_SIMPLE {
            return Err(Error::invalid_usage(format!("{}: at most {MAX_RANKS_SIMPLE} ranks", what())));
        }
        let (blocks, threads) =
            select::shape(Collective::AllReduce, Algorithm::Simple, nbytes, &self.layout, self.limits.max_blocks);
        let plan = Plan { algorithm: Algorithm::Simple, blocks, threads };
        let sig = select::signature(Collective::AllReduce, &plan, Some(dtype), Some(op), false, nbytes, usize::MAX);
        let args = CollArgs {
            input: w.send_table.device_ptr(),
            output: w.recv_table.device_ptr(),
            nbytes,
            sig,
            op: op.code(),
            ..self.base_args()
        };
        let k = self.kernels.get_zero_copy(dtype)?;
        // SAFETY: the window's tables point to every rank's registered buffers, which the
        // window's contract keeps allocated; nbytes fits them (checked above).
        unsafe { kernels::launch(k, blocks, threads, stream, &args, self.programmatic_blocks) }
            .map_err(|e| e.during(what()))
    }
}
