//! `mscclpp-perf allreduce | allgather | reducescatter`: the collectives of
//! `mscclpp-collectives`, measured like nccl-tests measures NCCL's.
//!
//! `--ranks` ranks are threads of this process, all on GPU `--device`, each with its own
//! bootstrap, communicator, stream and [`Collectives`]. For each size (`-b` .. `-e` by `-f`,
//! bytes) each rank times `-n` calls between two [`TimingEvent`]s on its stream, after `-w`
//! untimed ones (with `--graph`: the `-n` calls captured into one CUDA graph, its launch timed
//! after an untimed one), three times; the time per call is the slowest rank's median GPU time
//! over `-n`. Out of
//! place, then in place (NCCL's layouts). nccl-tests' conventions:
//!
//! * size: the per-rank buffer of AllReduce, the output of AllGather, the input of
//!   ReduceScatter (the larger buffer); count: the per-rank count the call takes (AllReduce:
//!   size / element size; AllGather: send count = size / element size / ranks; ReduceScatter:
//!   receive count, the same). Sizes under one element per rank are skipped.
//! * algbw = size / time; busbw = algbw x 2(n-1)/n (AllReduce), algbw x (n-1)/n (AllGather,
//!   ReduceScatter).
//! * `--check`: after the timing, inputs of small integers (exact in every type), one call,
//!   every output element compared with a CPU reference; `#wrong` counts the elements that
//!   differ, summed over ranks, and any makes the run fail.
//!
//! With `--plan FILE` (no `--dry-run`) every rank runs that MSCCL++ execution plan through
//! `mscclpp-executor` instead (its world size must be the job's; its resources for each size are
//! built before that size is timed; only the placement the plan was written for, in place or
//! out of place, is timed and checked; sizes the plan cannot split are skipped).
//!
//! Each row also has the algorithm the selector chose (or `--algo`), the raw baseline (the
//! time of `cuMemcpyDtoDAsync` of `size` bytes on the same GPU, by rank 0 alone, wall time per
//! copy) and, with `--nccl PATH`, NCCL's time for the same calls in the same mode.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mscclpp::gpu::{DeviceBuffer, Stream, TimingEvent};
use mscclpp::{Bootstrap, Communicator, TransportFlags};
use mscclpp_collectives::{Algorithm, CallOptions, Collective, Collectives, Config, DataType, ReduceOp, Window};
use mscclpp_executor::{ExecutionPlan, Executor, ExecutorConfig, PacketType};

use crate::kern::{local_ranks, row};
use crate::lockstep::Lockstep;
use crate::nccl::{Comm, MULTI_RANK_ENV, Nccl, UniqueId};
use crate::{Args, TestKind};

/// Timings per row and placement, of which the median is reported.
const TIMED_RUNS: usize = 3;

/// The median of `v` (the upper one of an even count); NaN when empty.
fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f32::NAN)
}

/// `-n` when not given (nccl-tests' default).
pub const DEFAULT_ITERS: u64 = 20;
/// `-d` when not given.
pub const DEFAULT_DTYPE: DataType = DataType::Bf16;

/// The collective a test runs, if it is one.
pub fn collective(t: TestKind) -> Option<Collective> {
    match t {
        TestKind::Allreduce => Some(Collective::AllReduce),
        TestKind::Allgather => Some(Collective::AllGather),
        TestKind::Reducescatter => Some(Collective::ReduceScatter),
        _ => None,
    }
}

/// What a sweep runs, from the command line.
#[derive(Clone, Debug)]
pub struct Spec {
    pub coll: Collective,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub algo: Option<Algorithm>,
    /// `--algo zerocopy` (AllReduce): the buffers are registered once as windows and every call
    /// reads and writes every rank's buffers directly.
    pub zero_copy: bool,
    pub ranks: usize,
    pub device: u32,
    pub warmup: u64,
    pub iters: u64,
    pub graph: bool,
    pub check: bool,
    pub timeout: Duration,
    /// `--plan FILE` without `--dry-run`: the plan every rank runs instead of the collectives.
    pub plan: Option<ExecutionPlan>,
    /// The executor's kernel for `plan` (`MSCCLPP_EXECUTOR_KERNEL`, read once: a bad value warns
    /// once).
    pub exec_kernel: mscclpp_executor::KernelKind,
}

impl Spec {
    /// Parses and checks the collective flags (no GPU needed).
    pub fn from_args(args: &Args) -> Result<Spec, String> {
        let coll = collective(args.test).ok_or_else(|| format!("{} is not a collective test", args.test.name()))?;
        let dtype = match &args.dtype {
            Some(s) => s.parse::<DataType>().map_err(|x| format!("-d {s}: {}", x.message()))?,
            None => DEFAULT_DTYPE,
        };
        let op = match &args.op {
            Some(s) => s.parse::<ReduceOp>().map_err(|x| format!("-o {s}: {}", x.message()))?,
            None => ReduceOp::Sum,
        };
        let zero_copy = args.algo.as_deref().is_some_and(|a| {
            matches!(
                a.to_ascii_lowercase().as_str(),
                "zerocopy" | "zero_copy" | "rsag_zero_copy" | "default_allreduce_rsag_zero_copy"
            )
        });
        if zero_copy && coll != Collective::AllReduce {
            return Err(format!("--algo zerocopy serves allreduce only, not {coll}"));
        }
        let algo = match args.algo.as_ref().filter(|_| !zero_copy) {
            Some(s) => {
                let a = s.parse::<Algorithm>().map_err(|x| format!("--algo {s}: {}", x.message()))?;
                if !a.serves(coll) {
                    return Err(format!("--algo {a} does not implement {coll} (use packet or simple)"));
                }
                Some(a)
            }
            None => None,
        };
        let max = mscclpp_collectives::select::MAX_RANKS_SIMPLE;
        if !(2..=max).contains(&args.ranks) {
            return Err(format!("{}: --ranks {} must be 2 to {max}", coll.name(), args.ranks));
        }
        let plan = match (&args.plan, args.dry_run) {
            (Some(_), false) => {
                if args.algo.is_some() {
                    return Err("--plan runs the plan; --algo picks a built-in algorithm: give one of them".into());
                }
                if op != ReduceOp::Sum {
                    return Err(format!(
                        "--plan: the plan's operations carry their own reduction; the check assumes sum, not -o {op}"
                    ));
                }
                let p = crate::plan::load(args)?;
                // A --procs job's size comes from its launcher (checked in `Job::new`).
                if !args.procs && p.plan().gpus.len() != args.ranks {
                    return Err(format!(
                        "--plan {}: the plan is for {} ranks, not --ranks {}",
                        p.name(),
                        p.plan().gpus.len(),
                        args.ranks
                    ));
                }
                Some(p)
            }
            _ => None,
        };
        Ok(Spec {
            coll,
            dtype,
            op,
            algo,
            zero_copy,
            exec_kernel: if plan.is_some() { mscclpp_executor::KernelKind::from_env() } else { Default::default() },
            plan,
            ranks: args.ranks,
            device: args.device,
            warmup: args.warmup,
            iters: args.iters.unwrap_or(DEFAULT_ITERS).max(1),
            graph: args.graph,
            check: args.check,
            timeout: args.timeout(),
        })
    }

    /// The executor's element type (every type of the collectives has one).
    fn exec_dtype(&self) -> mscclpp_executor::DataType {
        match self.dtype {
            DataType::F32 => mscclpp_executor::DataType::Float32,
            DataType::F16 => mscclpp_executor::DataType::Float16,
            DataType::I32 => mscclpp_executor::DataType::Int32,
            DataType::U32 => mscclpp_executor::DataType::Uint32,
            _ => mscclpp_executor::DataType::Bfloat16,
        }
    }

    /// Whether `place` is timed: every placement for the collectives; with `--plan`, only the
    /// one the plan was written for.
    fn runs(&self, place: Place) -> bool {
        self.plan.as_ref().is_none_or(|p| p.plan().inplace == (place == Place::In))
    }

    fn opts(&self) -> CallOptions {
        self.algo.map(CallOptions::algorithm).unwrap_or_default()
    }

    /// busbw / algbw (nccl-tests).
    pub fn bus_factor(&self) -> f64 {
        let n = self.ranks as f64;
        match self.coll {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }

    /// The reduction column (`none` for AllGather, as nccl-tests prints).
    fn redop(&self) -> &'static str {
        if self.coll.reduces() { self.op.name() } else { "none" }
    }
}

/// One size of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    /// The size column: bytes of the larger buffer (nccl-tests' convention).
    pub bytes: u64,
    /// Elements the call takes (AllReduce: the buffer; AllGather: per rank sent; ReduceScatter:
    /// per rank received).
    pub count: usize,
    /// Bytes of each rank's input and output.
    pub in_bytes: u64,
    pub out_bytes: u64,
}

/// The sizes from `min` to `max` bytes by `factor`, as `coll` of `dtype` over `n` ranks counts
/// them; sizes under one element per rank are left out.
pub fn sizes(coll: Collective, dtype: DataType, n: usize, min: u64, max: u64, factor: u64) -> Vec<Size> {
    let (es, nr) = (dtype.size() as u64, n.max(1) as u64);
    let mut out: Vec<Size> = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        let size = match coll {
            Collective::AllReduce => {
                let c = s / es;
                Size { bytes: c * es, count: c as usize, in_bytes: c * es, out_bytes: c * es }
            }
            Collective::AllGather => {
                let c = s / es / nr;
                Size { bytes: c * es * nr, count: c as usize, in_bytes: c * es, out_bytes: c * es * nr }
            }
            _ => {
                let c = s / es / nr;
                Size { bytes: c * es * nr, count: c as usize, in_bytes: c * es * nr, out_bytes: c * es }
            }
        };
        if size.count > 0 && out.last().is_none_or(|l| l.count != size.count) {
            out.push(size);
        }
        match s.checked_mul(factor.max(2)) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Data and reference for --check.

/// Element `i` of rank `r`'s input: small integers, exact in every type, whose reductions over
/// up to 64 ranks stay exact (bf16 holds integers up to 256 exactly).
fn value(s: &Spec, r: usize, i: usize) -> i64 {
    if s.coll.reduces() && s.op == ReduceOp::Prod {
        // 1s, some 2s (about one rank in five per element) and, for signed types, some -1s.
        if (i + 2 * r).is_multiple_of(5) {
            2
        } else if s.dtype != DataType::U32 && (i + r) % 7 == 3 {
            -1
        } else {
            1
        }
    } else {
        let a = (256 / s.ranks.max(1) as i64).clamp(1, 8);
        let k = r * 7 + i * 3;
        if s.dtype == DataType::U32 { (k % (a as usize + 1)) as i64 } else { (k % (2 * a as usize + 1)) as i64 - a }
    }
}

/// The reduction of element `i` of every rank's input.
fn reduce(s: &Spec, i: usize) -> f64 {
    let n = s.ranks;
    let mut acc: i64 = match s.op {
        ReduceOp::Prod => 1,
        ReduceOp::Min => i64::MAX,
        ReduceOp::Max => i64::MIN,
        _ => 0,
    };
    for r in 0..n {
        let v = value(s, r, i);
        acc = match s.op {
            ReduceOp::Prod => acc * v,
            ReduceOp::Min => acc.min(v),
            ReduceOp::Max => acc.max(v),
            _ => acc + v,
        };
    }
    if s.op == ReduceOp::Avg {
        if s.dtype.is_float() { acc as f64 / n as f64 } else { (acc / n as i64) as f64 }
    } else {
        acc as f64
    }
}

/// What element `j` of `rank`'s output should be.
fn expected(s: &Spec, rank: usize, count: usize, j: usize) -> f64 {
    match s.coll {
        Collective::AllGather => value(s, j / count, j % count) as f64,
        Collective::ReduceScatter => reduce(s, rank * count + j),
        _ => reduce(s, j),
    }
}

fn f32_to_f16(f: f32) -> u16 {
    // Exact for the small integers written here (normal numbers, no rounding needed).
    if f == 0.0 {
        return if f.is_sign_negative() { 0x8000 } else { 0 };
    }
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let man = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp.clamp(0, 31) as u16) << 10) | man
}

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((h >> 10) & 0x1f) as i32;
    let man = (h & 0x3ff) as f64;
    sign * match exp {
        0 => man * 2f64.powi(-24),
        31 if man == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
    }
}

fn encode(d: DataType, v: i64, out: &mut Vec<u8>) {
    match d {
        DataType::F16 => out.extend(f32_to_f16(v as f32).to_le_bytes()),
        DataType::Bf16 => out.extend((((v as f32).to_bits() >> 16) as u16).to_le_bytes()),
        DataType::I32 => out.extend((v as i32).to_le_bytes()),
        DataType::U32 => out.extend((v as u32).to_le_bytes()),
        _ => out.extend((v as f32).to_le_bytes()),
    }
}

fn decode(d: DataType, b: &[u8]) -> f64 {
    let w2 = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    let w4 = |b: &[u8]| [b[0], b[1], b[2], b[3]];
    match d {
        DataType::F16 => f16_to_f64(w2(b)),
        DataType::Bf16 => f32::from_bits((w2(b) as u32) << 16) as f64,
        DataType::I32 => i32::from_le_bytes(w4(b)) as f64,
        DataType::U32 => u32::from_le_bytes(w4(b)) as f64,
        _ => f32::from_le_bytes(w4(b)) as f64,
    }
}

/// Whether `got` is `want`: exactly, except a float average (rounded, in the type).
fn close(s: &Spec, got: f64, want: f64) -> bool {
    if s.op == ReduceOp::Avg && s.coll.reduces() && s.dtype.is_float() {
        let tol = match s.dtype {
            DataType::F32 => 1e-5,
            DataType::F16 => 1e-2,
            _ => 6e-2,
        };
        (got - want).abs() <= tol * want.abs().max(1.0)
    } else {
        got == want
    }
}

// ---------------------------------------------------------------------------------------------
// The rank threads.

/// Out of place or in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Out,
    In,
}

/// One rank's state.
struct Rank<'a> {
    spec: &'a Spec,
    rank: usize,
    bs: Arc<dyn Bootstrap>,
    coll: Collectives,
    /// With `--plan`: the executor that runs it.
    exec: Option<Executor>,
    /// With `--algo zerocopy`: the (a -> b) and (a -> a) windows (dropped before `a` and `b`).
    windows: Option<(Window, Window)>,
    stream: Stream,
    /// Ranks as threads: every call and graph launch is issued in rounds (lockstep.rs says why).
    lockstep: Option<&'a Lockstep>,
    /// This rank's lockstep rounds so far.
    rounds: std::cell::Cell<u64>,
    /// Input (and in-place output) and out-of-place output, each as large as the largest size.
    a: DeviceBuffer,
    b: DeviceBuffer,
    start: TimingEvent,
    stop: TimingEvent,
}

impl Rank<'_> {
    fn barrier(&self) -> Result<(), String> {
        self.bs.barrier().map_err(|x| format!("rank {}: {x}", self.rank))
    }

    /// Waits until every rank thread has issued as many calls as this one (no-op for processes),
    /// so that none queues its next launch before a peer queued the one they share.
    fn in_step(&self) -> Result<(), String> {
        let Some(ls) = self.lockstep else { return Ok(()) };
        let mut r = self.rounds.get();
        let res = ls.wait(self.rank, &mut r);
        self.rounds.set(r);
        res
    }

    /// Every rank's `mine` (f64s), in rank order.
    fn gather(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>, String> {
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all = self.bs.all_gather(&bytes).map_err(|x| format!("rank {}: {x}", self.rank))?;
        all.iter()
            .map(|b| {
                if b.len() != bytes.len() {
                    return Err(format!(
                        "rank {}: a peer sent {} bytes of results, not {}",
                        self.rank,
                        b.len(),
                        bytes.len()
                    ));
                }
                Ok(b.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
            })
            .collect()
    }

    /// The send and receive pointers of a call of `sz` (NCCL's in-place layouts).
    fn ptrs(&self, sz: &Size, place: Place) -> (u64, u64) {
        let (a, b) = (self.a.device_ptr(), self.b.device_ptr());
        let seg = (self.rank * sz.count * self.spec.dtype.size()) as u64;
        match (place, self.spec.coll) {
            (Place::Out, _) => (a, b),
            (Place::In, Collective::AllGather) => (a + seg, a),
            (Place::In, Collective::ReduceScatter) => (a, a + seg),
            (Place::In, _) => (a, a),
        }
    }

    /// Enqueues one call of ours.
    fn ours(&self, sz: &Size, place: Place) -> Result<(), String> {
        let (send, recv) = self.ptrs(sz, place);
        let s = self.spec;
        let opts = s.opts();
        if let (Some(ex), Some(plan)) = (&self.exec, &s.plan) {
            // SAFETY: the pointers are into `a`/`b`, which hold `in_bytes`/`out_bytes` there and
            // outlive the executor (declared before them in `Rank`, so dropped first) and the
            // synchronized stream.
            return unsafe {
                ex.execute(
                    self.rank,
                    send,
                    recv,
                    sz.in_bytes,
                    sz.out_bytes,
                    s.exec_dtype(),
                    plan,
                    &self.stream,
                    PacketType::LL16,
                )
            }
            .map_err(|x| format!("rank {}: {x}", self.rank));
        }
        if let Some((oop, ip)) = &self.windows {
            let w = if place == Place::Out { oop } else { ip };
            return self
                .coll
                .all_reduce_window(w, sz.count, s.dtype, s.op, &self.stream)
                .map_err(|x| format!("rank {}: {x}", self.rank));
        }
        // SAFETY: `a` and `b` hold the largest size's larger buffer (at least `in_bytes` and
        // `out_bytes` at the offsets `ptrs` gives) and live until the rank returns, after every
        // stream it used was synchronized; every rank makes the same calls in the same order.
        unsafe {
            match s.coll {
                Collective::AllGather => self.coll.all_gather(send, recv, sz.count, s.dtype, &self.stream, &opts),
                Collective::ReduceScatter => {
                    self.coll.reduce_scatter(send, recv, sz.count, s.dtype, s.op, &self.stream, &opts)
                }
                _ => self.coll.all_reduce(send, recv, sz.count, s.dtype, s.op, &self.stream, &opts),
            }
        }
        .map_err(|x| format!("rank {}: {x}", self.rank))
    }

    /// Waits for this rank's stream and checks our kernels' error word. The wait is twice
    /// `--timeout`, so that a kernel whose peer never arrives ends first (its waits are bounded
    /// by `--timeout`) and the error names that peer.
    fn sync_ours(&self) -> Result<(), String> {
        if let Some(ex) = &self.exec {
            return ex.synchronize(&self.stream, self.spec.timeout.saturating_mul(2)).map_err(|x| {
                // Where each channel's semaphore stands (issue 28's stalls: a launch that never
                // started, or signals that went elsewhere), printed with the failure.
                for line in ex.diagnostics() {
                    eprintln!("mscclpp-perf: diagnostics: {line}");
                }
                format!("rank {}: {x}", self.rank)
            });
        }
        self.coll
            .synchronize(&self.stream, self.spec.timeout.saturating_mul(2))
            .map_err(|x| format!("rank {}: {x}", self.rank))
    }

    /// Waits for this rank's stream after NCCL work. NCCL's kernels cannot be stopped: when they
    /// do not finish in time the process exits rather than wait on them (freeing memory would).
    fn sync_nccl(&self) -> Result<(), String> {
        match self.stream.synchronize(self.spec.timeout) {
            Ok(()) => Ok(()),
            Err(x) if x.kind() == mscclpp::ErrorKind::Timeout => {
                eprintln!(
                    "mscclpp-perf: rank {}: NCCL did not finish within --timeout {} s ({x}); exiting, as its kernels cannot be stopped",
                    self.rank,
                    self.spec.timeout.as_secs()
                );
                std::process::exit(1);
            }
            Err(x) => Err(format!("rank {}: after NCCL: {x}", self.rank)),
        }
    }

    /// Microseconds per call of `enqueue` (GPU time between two events around `-n` calls, or
    /// around the launch of a graph holding them, over `-n`), the median of [`TIMED_RUNS`] such
    /// timings (one descheduled host thread of one rank no longer makes a row). Every rank
    /// calls it together.
    fn measure(
        &self,
        enqueue: &dyn Fn() -> Result<(), String>,
        sync: &dyn Fn() -> Result<(), String>,
    ) -> Result<f64, String> {
        let s = self.spec;
        let ev = |x: mscclpp::Error| format!("rank {}: {x}", self.rank);
        self.barrier()?;
        if !s.graph {
            // In the GPU subsystem's debug log (beside the library's calls that serialize the
            // context's streams): when this rank's launches began and ended.
            tracing::debug!(target: "mscclpp::gpu", "rank {}: warmup launches begin", self.rank);
            // The warmup calls also line the ranks up on the GPU: the start event fires when
            // the last of them (which waits for every rank) is done.
            for _ in 0..s.warmup {
                self.in_step()?;
                enqueue()?;
            }
            tracing::debug!(target: "mscclpp::gpu", "rank {}: warmup launches issued", self.rank);
            let mut runs = Vec::with_capacity(TIMED_RUNS);
            for _ in 0..TIMED_RUNS {
                self.start.record(&self.stream).map_err(ev)?;
                for _ in 0..s.iters {
                    self.in_step()?;
                    enqueue()?;
                }
                self.stop.record(&self.stream).map_err(ev)?;
                sync()?;
                runs.push(self.stop.elapsed_ms_since(&self.start).map_err(ev)?);
            }
            Ok(median(runs) as f64 * 1e3 / s.iters as f64)
        } else {
            // Eager warmup (at least one call: NCCL connects on its first call, which a
            // capture should not hold), then the capture, one rank at a time: a global-mode
            // capture forbids some CUDA calls on the other threads meanwhile, and the others
            // wait in the bootstrap barrier (sockets only).
            for _ in 0..s.warmup.max(1) {
                self.in_step()?;
                enqueue()?;
            }
            sync()?;
            let mut graph = None;
            for r in 0..s.ranks {
                self.barrier()?;
                if r == self.rank {
                    self.stream.begin_capture().map_err(ev)?;
                    let mut res = Ok(());
                    for _ in 0..s.iters {
                        res = enqueue();
                        if res.is_err() {
                            break;
                        }
                    }
                    // Always end the capture, even after a failed call.
                    let g = self.stream.end_capture().map_err(ev);
                    res?;
                    graph = Some(g?);
                }
            }
            self.barrier()?;
            let graph = graph.ok_or_else(|| format!("rank {}: no graph was captured", self.rank))?;
            // An untimed launch first (uploads the graph; lines the ranks up on the GPU).
            self.in_step()?;
            graph.launch(&self.stream).map_err(ev)?;
            let mut runs = Vec::with_capacity(TIMED_RUNS);
            for _ in 0..TIMED_RUNS {
                self.start.record(&self.stream).map_err(ev)?;
                self.in_step()?;
                graph.launch(&self.stream).map_err(ev)?;
                self.stop.record(&self.stream).map_err(ev)?;
                sync()?;
                runs.push(self.stop.elapsed_ms_since(&self.start).map_err(ev)?);
            }
            Ok(median(runs) as f64 * 1e3 / s.iters as f64)
        }
    }

    /// Writes the check inputs, runs one call of ours, and counts the wrong output elements.
    ///
    /// Host copies (`write`, `fill`, `read`) are synchronous and may wait for the whole GPU:
    /// where ranks share one, a copy made while a peer's kernel still waits for this rank (its
    /// last timed call, or this check's) deadlocks until the kernel times out. So every copy
    /// sits between barriers that come after every rank synchronized its stream.
    fn check(&self, sz: &Size, place: Place) -> Result<u64, String> {
        let s = self.spec;
        let es = s.dtype.size();
        let x = |x: mscclpp::Error| format!("rank {}: check: {x}", self.rank);
        // Every rank is done with its timed calls (each synchronized its stream in `measure`)
        // before any rank writes.
        self.barrier()?;
        let in_elems = sz.in_bytes as usize / es;
        let mut input = Vec::with_capacity(sz.in_bytes as usize);
        for i in 0..in_elems {
            encode(s.dtype, value(s, self.rank, i), &mut input);
        }
        let seg = self.rank * sz.count * es;
        let (out_buf, out_off) = match (place, s.coll) {
            (Place::Out, _) => {
                self.a.write(0, &input).map_err(x)?;
                self.b.fill(0, sz.out_bytes as usize, 0xee).map_err(x)?;
                (&self.b, 0)
            }
            (Place::In, Collective::AllGather) => {
                self.a.fill(0, sz.out_bytes as usize, 0xee).map_err(x)?;
                self.a.write(seg, &input).map_err(x)?;
                (&self.a, 0)
            }
            (Place::In, Collective::ReduceScatter) => {
                self.a.write(0, &input).map_err(x)?;
                (&self.a, seg)
            }
            (Place::In, _) => {
                self.a.write(0, &input).map_err(x)?;
                (&self.a, 0)
            }
        };
        drop(input);
        self.barrier()?;
        self.ours(sz, place)?;
        self.sync_ours()?;
        // Every rank's check kernel is done before any rank reads (and, after the read, goes on
        // to a build of the next size, which opens with a barrier of its own).
        self.barrier()?;
        let mut out = vec![0u8; sz.out_bytes as usize];
        out_buf.read(out_off, &mut out).map_err(x)?;
        let mut wrong = 0u64;
        let mut first = Vec::new();
        for (j, c) in out.chunks_exact(es).enumerate() {
            let (got, want) = (decode(s.dtype, c), expected(s, self.rank, sz.count, j));
            if !close(s, got, want) {
                wrong += 1;
                if first.len() < 3 {
                    first.push(format!("[{j}] = {got}, want {want}"));
                }
            }
        }
        if wrong > 0 {
            eprintln!(
                "# rank {} {} {} B {}: {wrong} wrong, first {}",
                self.rank,
                s.coll,
                sz.bytes,
                if place == Place::Out { "out of place" } else { "in place" },
                first.join(", ")
            );
        }
        Ok(wrong)
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Per size, what each rank sends rank 0: times (µs; NaN = not measured), wrong counts, copy.
const OOP: usize = 0;
const IP: usize = 1;
const NCCL_OOP: usize = 2;
const NCCL_IP: usize = 3;
const WRONG_OOP: usize = 4;
const WRONG_IP: usize = 5;
const COPY: usize = 6;
const SKIP: usize = 7;
const FIELDS: usize = 8;

/// Everything the ranks of one sweep share: the flags, the sizes, the report's header fields,
/// NCCL when given. Built by every process of a `--procs` job, once by a threads job.
struct Job {
    spec: Spec,
    list: Vec<Size>,
    /// The largest buffer any size needs (bytes).
    cap: usize,
    report: Report,
    json: Option<PathBuf>,
    plot: Option<PathBuf>,
    nccl: Option<Nccl>,
    /// Ranks as threads: the lockstep their calls are issued in (`None` for processes).
    lockstep: Option<Lockstep>,
}

impl Job {
    /// `ranks`: the job's size (`--ranks`, or the launcher's); `print`: whether this process
    /// prints the header (rank 0, or the one process of a threads job).
    fn new(args: &Args, env_set_here: bool, ranks: usize, procs: bool, print: bool) -> Result<Job, String> {
        let mut spec = Spec::from_args(args)?;
        spec.ranks = ranks;
        if let Some(p) = &spec.plan
            && p.plan().gpus.len() != ranks
        {
            return Err(format!(
                "--plan {}: the plan is for {} ranks, the job has {ranks} (--ranks or the launcher's)",
                p.name(),
                p.plan().gpus.len()
            ));
        }
        let s = &spec;
        let say = |l: String| {
            if print {
                row(l)
            }
        };
        // NCCL first (its environment variable was set by `main`, before any thread started).
        let nccl: Option<Nccl> = match &args.nccl {
            None => None,
            Some(path) => match Nccl::load(path) {
                Err(x) => {
                    say(format!("# nccl: {x}; continuing without the NCCL column"));
                    None
                }
                Ok(lib) => {
                    let env = std::env::var(MULTI_RANK_ENV).unwrap_or_default();
                    let by = if env_set_here { "set by mscclpp-perf" } else { "from the environment" };
                    say(format!("# nccl: {MULTI_RANK_ENV}={env} ({by}; several ranks share GPU{})", s.device));
                    Some(lib)
                }
            },
        };
        let nccl_version = nccl.as_ref().and_then(|l| l.version()).map(Nccl::version_string);
        if let Some(l) = &nccl {
            say(format!("# nccl: {} (version {})", l.path, nccl_version.as_deref().unwrap_or("unknown")));
            if l.version().is_some_and(|v| v < 23000) {
                say("# nccl: versions before 2.30 refuse several ranks on one GPU; trying anyway".into());
            }
        }
        let list = sizes(s.coll, s.dtype, s.ranks, args.min_bytes, args.max_bytes, args.step_factor);
        if list.is_empty() {
            return Err(format!(
                "no size from -b {} to -e {} holds one {} element per rank ({} ranks)",
                args.min_bytes, args.max_bytes, s.dtype, s.ranks
            ));
        }
        let cap = list.iter().map(|z| z.bytes).max().unwrap_or(0).max(256) as usize;
        let device_name = mscclpp::gpu::device_name(s.device).unwrap_or_else(|_| format!("GPU{}", s.device));
        let report = Report {
            version: env!("CARGO_PKG_VERSION").into(),
            test: s.coll.name().into(),
            ranks: s.ranks,
            device: s.device,
            device_name: device_name.clone(),
            dtype: s.dtype.name().into(),
            redop: s.redop().into(),
            warmup: s.warmup,
            iters: s.iters,
            graph: s.graph,
            check: s.check,
            algo: match &s.plan {
                Some(p) => Some(format!("plan {}", p.name())),
                None => s.algo.map(|a| a.name().to_string()),
            },
            nccl: nccl.as_ref().map(|l| l.path.clone()),
            nccl_version,
            records: Vec::new(),
        };
        say(format!(
            "# mscclpp-perf {}: {} ranks ({}) on GPU{} ({device_name}), {}, {}, warmup {}, iters {}, {}{}",
            s.coll,
            s.ranks,
            if procs { "processes" } else { "threads of one process" },
            s.device,
            s.dtype,
            s.redop(),
            s.warmup,
            s.iters,
            if s.graph { "graph (the -n calls in one CUDA graph)" } else { "eager" },
            if s.check { ", check" } else { "" }
        ));
        say(format!(
            "# time: GPU time per call, slowest rank; algbw = size / time; busbw = algbw x {}; algo: {}; copy: cuMemcpyDtoDAsync of size bytes on GPU{} (wall time per copy)",
            if s.coll == Collective::AllReduce { "2(n-1)/n" } else { "(n-1)/n" },
            match &s.plan {
                Some(p) => format!(
                    "execution plan {} ({}; only {} is run; {} kernel, MSCCLPP_EXECUTOR_KERNEL)",
                    p.name(),
                    if p.plan().inplace { "in place" } else { "out of place" },
                    if p.plan().inplace { "in place" } else { "out of place" },
                    match s.exec_kernel {
                        mscclpp_executor::KernelKind::PerPlan => "per-plan",
                        _ => "interpreter",
                    }
                ),
                None => s.algo.map_or("the selector's choice".to_string(), |a| format!("--algo {a}")),
            },
            s.device
        ));
        if let (false, Some(q)) = (procs, crate::queues::setting()) {
            say(format!("# hardware queues: {q}"));
        }
        if !procs && ranks > 1 {
            say("# ranks as threads: each call and graph launch is issued in lockstep rounds (no rank queues its next before every rank queued the current one; eager times at small sizes include it)".to_string());
        }
        for l in columns(s, nccl.is_some()) {
            say(l);
        }

        let lockstep = (!procs && ranks > 1).then(|| Lockstep::new(ranks, spec.timeout));
        Ok(Job { spec, list, cap, report, json: args.json.clone(), plot: args.plot.clone(), nccl, lockstep })
    }

    /// The rows are done: the JSON and the plot (rank 0), and the verdict of `--check`.
    fn finish(mut self, records: Vec<Record>, wrong: u64, has_nccl: bool) -> Result<(), String> {
        self.report.records = records;
        if !has_nccl {
            self.report.nccl = None;
            self.report.nccl_version = None;
        }
        if let Some(p) = &self.json {
            self.report.write_json(p)?;
        }
        if let Some(p) = &self.plot {
            write_svg(&self.report, p)?;
        }
        if wrong > 0 {
            return Err(format!(
                "{} {}: {wrong} wrong elements (see the #wrong column)",
                self.spec.coll, self.spec.dtype
            ));
        }
        Ok(())
    }
}

/// Runs the sweep with `--ranks` ranks as threads of this process: rows on stdout as each size
/// finishes, `--json` rewritten after each row, `--plot` at the end. Fails when a check found
/// wrong elements.
/// `env_set_here`: whether `main` set `NCCL_MULTI_RANK_GPU_ENABLE` ([`crate::nccl::prepare_env`]).
pub fn run(args: &Args, env_set_here: bool) -> Result<(), String> {
    let job = Job::new(args, env_set_here, args.ranks, false, true)?;
    let id = match &job.nccl {
        None => None,
        Some(l) => match l.unique_id() {
            Ok(id) => Some(id),
            Err(x) => {
                row(format!("# nccl: {x}; continuing without the NCCL column"));
                None
            }
        },
    };
    let j = &job;
    let results = local_ranks(j.spec.ranks, j.spec.timeout, |rank, bs| rank_main(j, rank, bs, id))?;
    let (records, wrong, has_nccl) = results.into_iter().next().unwrap_or_default();
    job.finish(records, wrong, has_nccl)
}

/// One rank of a `--procs` job (a process started by the local launcher, mpirun, srun or
/// torchrun; all on GPU `--device`): the same sweep, rank 0 prints. With `--nccl`, rank 0's
/// NCCL id reaches the others through the bootstrap; NCCL is used only when every rank loaded it.
pub fn run_rank(args: &Args, bs: Arc<dyn Bootstrap>, _iface: Option<String>) -> Result<(), String> {
    let env_set_here = args.nccl.is_some() && std::env::var(MULTI_RANK_ENV).is_ok();
    let rank = bs.rank();
    let job = Job::new(args, env_set_here, bs.size(), true, rank == 0)?;
    let x = |e: mscclpp::Error| format!("rank {rank}: {e}");
    let id = match &job.nccl {
        Some(l) if rank == 0 => match l.unique_id() {
            Ok(id) => Some(id),
            Err(m) => {
                row(format!("# nccl: {m}; continuing without the NCCL column"));
                None
            }
        },
        _ => None,
    };
    // Rank 0's id (empty when it has none), and whether every rank loaded the library.
    let payload = match (&job.nccl, &id) {
        (None, _) => vec![0u8],
        (Some(_), None) => vec![1u8],
        (Some(_), Some(id)) => std::iter::once(1u8).chain(id.to_bytes()).collect(),
    };
    let all = bs.all_gather(&payload).map_err(x)?;
    let everyone = all.iter().all(|p| p.first() == Some(&1));
    let id = match all.first() {
        Some(p) if everyone && p.len() == 1 + UniqueId::BYTES => UniqueId::from_bytes(&p[1..]),
        _ => None,
    };
    if job.nccl.is_some() && id.is_none() && rank == 0 {
        row("# nccl: not every rank could load it; continuing without the NCCL column".into());
    }
    let (records, wrong, has_nccl) = rank_main(&job, rank, bs.clone(), id)?;
    if rank != 0 {
        return Ok(());
    }
    job.finish(records, wrong, has_nccl)
}

/// The sweep of one rank: its communicator, collectives, buffers; every size out of place and
/// in place, ours and NCCL's (when `nccl_id`); rank 0 gathers and prints the rows. Returns rank
/// 0's records (empty elsewhere), the wrong elements over all ranks and whether NCCL ran.
fn rank_main(
    job: &Job,
    rank: usize,
    bs: Arc<dyn Bootstrap>,
    nccl_id: Option<UniqueId>,
) -> Result<(Vec<Record>, u64, bool), String> {
    let s = &job.spec;
    let (list, cap, json) = (&job.list, job.cap, &job.json);
    let report_ref = &job.report;
    let nccl_ref = job.nccl.as_ref().zip(nccl_id);
    let comm = Communicator::new(bs.clone());
    let x = |x: mscclpp::Error| format!("rank {rank}: {x}");
    let t0 = std::time::Instant::now();
    let step = |what: String| crate::watch::set(rank, what);
    step("setup: Collectives::new (connections, tuning)".into());
    // A plan run times the executor: the built-in algorithms' setup-time tuning would only
    // cost time (and run kernels that have nothing to do with the plan).
    let config = Config::new(s.device).timeout(s.timeout);
    let config = if s.plan.is_some() { config.tune(false) } else { config };
    let coll = Collectives::new(&comm, config).map_err(x)?;
    step("setup: buffers, events, executor".into());
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let stream = Stream::new(s.device).map_err(x)?;
    let a = DeviceBuffer::new(comm.context(), s.device, cap, TransportFlags::NONE).map_err(x)?;
    let b = DeviceBuffer::new(comm.context(), s.device, cap, TransportFlags::NONE).map_err(x)?;
    let (start, stop) = (TimingEvent::new(s.device).map_err(x)?, TimingEvent::new(s.device).map_err(x)?);
    let windows = if s.zero_copy {
        // SAFETY: `a` and `b` live as long as `me`, which owns them and the windows (declared
        // before them, so dropped first), and every stream is synchronized before.
        Some(unsafe {
            (
                coll.register_window(a.device_ptr(), b.device_ptr(), cap).map_err(x)?,
                coll.register_window(a.device_ptr(), a.device_ptr(), cap).map_err(x)?,
            )
        })
    } else {
        None
    };
    let exec = s
        .plan
        .as_ref()
        .map(|_| Executor::new(&comm, ExecutorConfig::new(s.device).timeout(s.timeout).kernel(s.exec_kernel)));
    let me = Rank {
        spec: s,
        rank,
        bs: bs.clone(),
        coll,
        exec,
        stream,
        lockstep: job.lockstep.as_ref(),
        rounds: Default::default(),
        a,
        b,
        start,
        stop,
        windows,
    };
    // When this rank stops (an error, a panic, or the end), the lockstep ends for every rank: a
    // rank that failed releases the others before `me` drops (its proxy and memory go, which
    // can wait for the peers' kernels until their device timeout). On success every rank is
    // past its last round by then (each size ends with a gather of every rank).
    struct EndTurns<'a>(Option<&'a Lockstep>);
    impl Drop for EndTurns<'_> {
        fn drop(&mut self) {
            if let Some(l) = self.0 {
                l.break_off();
            }
        }
    }
    let _end_turns = EndTurns(job.lockstep.as_ref());
    // Setup time (the slowest rank's), tuning included: the bound is 5 s for 15 sizes.
    let setups = me.gather(&[setup_ms])?;
    if rank == 0 {
        let slowest = setups.iter().map(|v| v[0]).fold(0.0, f64::max);
        let tuned = me.coll.tuning().map_or(0, |t| t.entries.len());
        let tuning = me.coll.tuning_time().map(|d| d.as_secs_f64() * 1e3);
        row(format!(
            "# setup: Collectives::new took {slowest:.0} ms (slowest rank){}",
            match tuning {
                Some(t) if tuned > 0 => format!(", of which tuning {tuned} AllReduce sizes {t:.0} ms (rank 0)"),
                _ => String::new(),
            }
        ));
    }

    // NCCL: every rank calls ncclCommInitRank at once (it returns when all have).
    let mut comm_nccl: Option<Comm<'_>> = None;
    if let Some((lib, id)) = nccl_ref {
        step("setup: NCCL communicator".into());
        me.gather(&[1.0])?; // every rank got here: none will be missing from the init
        // Binds GPU `device`'s primary context on this thread (NCCL uses the current one).
        let _bind = TimingEvent::new(s.device).map_err(x)?;
        let res = lib.init_rank(s.ranks, id, rank);
        let msgs = bs.all_gather(res.as_ref().err().map_or("", |m| m.as_str()).as_bytes()).map_err(x)?;
        let first = msgs.iter().find(|m| !m.is_empty()).map(|m| String::from_utf8_lossy(m).into_owned());
        match first {
            None => comm_nccl = res.ok(),
            Some(m) => {
                if rank == 0 {
                    row(format!("# nccl: {m}; continuing without the NCCL column"));
                }
                // A communicator of a rank that succeeded is left alone (not destroyed:
                // its peers never joined).
            }
        }
    }
    let has_nccl = comm_nccl.is_some();

    let mut records = Vec::new();
    let mut wrong_total = 0u64;
    for sz in list {
        step(format!("{} B: planning", sz.bytes));
        let mut mine = [f64::NAN; FIELDS];
        // The plan is the same on every rank; a size no algorithm can serve (an --algo
        // whose scratch is too small) is skipped on all of them.
        let nbytes = (sz.count * s.dtype.size()) as u64;
        // (algorithm, blocks, threads) of the row.
        let plan: Result<(String, u32, u32), String> = match &s.plan {
            Some(p) => mscclpp_executor::lower::Layout::new(p.plan(), rank, sz.in_bytes, sz.out_bytes)
                .map(|_| {
                    let g = &p.plan().gpus;
                    let blocks = g.get(rank).map_or(0, |g| g.threadblocks.len()) as u32;
                    (p.name().to_string(), blocks, p.plan().num_threads_per_block)
                })
                .map_err(|e| format!("the plan cannot run it: {e}")),
            None => me
                .coll
                .plan(s.coll, nbytes, &s.opts())
                .map(|p| (p.algorithm.name().to_string(), p.blocks, p.threads))
                .map_err(|e| e.to_string()),
        };
        mine[SKIP] = if plan.is_ok() { 0.0 } else { 1.0 };
        let skip = me.gather(&mine[SKIP..SKIP + 1])?.iter().any(|v| v[0] != 0.0);
        let plan = match plan {
            Ok(p) if !skip => p,
            other => {
                if rank == 0 {
                    let why = other.err().unwrap_or_else(|| "another rank cannot plan this call".to_string());
                    row(format!("# {} B: skipped: {why}", sz.bytes));
                }
                continue;
            }
        };
        for (place, t, tn, w) in [(Place::Out, OOP, NCCL_OOP, WRONG_OOP), (Place::In, IP, NCCL_IP, WRONG_IP)] {
            if !s.runs(place) {
                continue;
            }
            let where_ = if place == Place::In { "in place" } else { "out of place" };
            let at = |what: &str| step(format!("{} B {where_}: {what}", sz.bytes));
            if let (Some(ex), Some(p)) = (&me.exec, &s.plan) {
                at("executor build (connections, kernel)");
                // The plan's resources for these buffers (collective), before anything is timed.
                // A build allocates and copies synchronously (either may wait for the whole
                // GPU): every rank has synchronized its stream by now (the last timed run and
                // the check each end with a synchronize), and the build opens with a barrier,
                // so no rank builds while a peer's kernel may still wait for it.
                let (send, recv) = me.ptrs(sz, place);
                // SAFETY: as in `Rank::ours`.
                unsafe { ex.prepare(rank, send, recv, sz.in_bytes, sz.out_bytes, p) }
                    .map_err(|e| format!("rank {rank}: {e}"))?;
            }
            at("our warmup and timed runs");
            mine[t] = me.measure(&|| me.ours(sz, place), &|| me.sync_ours())?;
            if let Some(c) = &comm_nccl {
                let (send, recv) = me.ptrs(sz, place);
                let raw = me.stream.as_raw();
                let call = || {
                    // SAFETY: as for ours (`Rank::ours`): the pointers are into `a`/`b`,
                    // which hold these bytes and outlive the synchronized stream.
                    unsafe { c.call(s.coll, send, recv, sz.count, s.dtype, s.op, raw) }
                        .map_err(|m| format!("rank {rank}: {m}"))
                };
                at("NCCL's warmup and timed runs");
                mine[tn] = me.measure(&call, &|| me.sync_nccl())?;
            }
            if s.check {
                at("check against the reference");
                let n = me.check(sz, place)?;
                mine[w] = n as f64;
            }
        }
        // Rank 0's copy baseline creates streams and copies: only once every rank's kernels of
        // this size are done (each rank synchronized its stream).
        step(format!("{} B: barrier, then rank 0's copy baseline", sz.bytes));
        me.barrier()?;
        if rank == 0 {
            let d =
                mscclpp::bench::baseline_copy(&[(&me.a, &me.b)], sz.bytes as usize, s.warmup, s.iters).map_err(x)?;
            mine[COPY] = d.as_secs_f64() * 1e6 / s.iters as f64;
        }
        step(format!("{} B: gathering the row", sz.bytes));
        let all = me.gather(&mine)?;
        if rank != 0 {
            continue;
        }
        let max = |i: usize| all.iter().map(|v| v[i]).fold(f64::NAN, f64::max);
        let sum = |i: usize| all.iter().map(|v| v[i]).filter(|v| v.is_finite()).sum::<f64>() as u64;
        let gbps = |us: f64| sz.bytes as f64 / (us * 1e3);
        let place = |t: usize, tn: usize, w: usize| {
            let time = max(t);
            let nt = max(tn);
            Placement {
                time_us: time,
                algbw_gbps: gbps(time),
                busbw_gbps: gbps(time) * s.bus_factor(),
                wrong: s.check.then(|| sum(w)),
                nccl_time_us: has_nccl.then_some(nt),
                nccl_busbw_gbps: has_nccl.then(|| gbps(nt) * s.bus_factor()),
            }
        };
        let rec = Record {
            size: sz.bytes,
            count: sz.count,
            algorithm: if s.zero_copy { "zerocopy".into() } else { plan.0 },
            blocks: plan.1,
            threads: plan.2,
            out_of_place: place(OOP, NCCL_OOP, WRONG_OOP),
            in_place: place(IP, NCCL_IP, WRONG_IP),
            copy_us: all[0][COPY],
            copy_gbps: gbps(all[0][COPY]),
        };
        wrong_total += rec.out_of_place.wrong.unwrap_or(0) + rec.in_place.wrong.unwrap_or(0);
        row(row_text(s, &rec, has_nccl));
        records.push(rec);
        if let Some(p) = &json {
            // Rewritten after every row: a run that fails later keeps what it measured.
            let mut partial = report_ref.clone();
            partial.records = records.clone();
            if !has_nccl {
                (partial.nccl, partial.nccl_version) = (None, None);
            }
            partial.write_json(p).map_err(|m| format!("rank 0: {m}"))?;
        }
    }
    step("closing barrier".into());
    me.barrier()?;
    if let Some(c) = comm_nccl {
        // Every rank is done and its stream synchronized.
        c.destroy().map_err(|m| format!("rank {rank}: {m}"))?;
    }
    Ok((records, wrong_total, has_nccl))
}

mod report;
pub use report::{Placement, Record, Report};
use report::{columns, row_text, write_svg};

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(coll: Collective, dtype: DataType, op: ReduceOp, ranks: usize) -> Spec {
        Spec {
            coll,
            dtype,
            op,
            algo: None,
            zero_copy: false,
            ranks,
            device: 0,
            warmup: 1,
            iters: 1,
            graph: false,
            check: true,
            timeout: Duration::from_secs(1),
            plan: None,
            exec_kernel: Default::default(),
        }
    }

    #[test]
    fn the_median_ignores_one_outlier() {
        assert_eq!(median(vec![3.0, 61.0, 3.1]), 3.1);
        assert_eq!(median(vec![2.0]), 2.0);
        assert!(median(vec![]).is_nan());
    }

    #[test]
    fn sizes_follow_nccl_tests() {
        let ar = sizes(Collective::AllReduce, DataType::Bf16, 2, 8, 64, 2);
        assert_eq!(ar.iter().map(|z| (z.bytes, z.count)).collect::<Vec<_>>(), [(8, 4), (16, 8), (32, 16), (64, 32)]);
        // AllGather: size is the output; 8 B of f32 over 4 ranks is under one element each.
        let ag = sizes(Collective::AllGather, DataType::F32, 4, 8, 64, 2);
        assert_eq!(ag.iter().map(|z| (z.bytes, z.count)).collect::<Vec<_>>(), [(16, 1), (32, 2), (64, 4)]);
        assert_eq!((ag[2].in_bytes, ag[2].out_bytes), (16, 64));
        let rs = sizes(Collective::ReduceScatter, DataType::F32, 4, 64, 64, 2);
        assert_eq!((rs[0].bytes, rs[0].count, rs[0].in_bytes, rs[0].out_bytes), (64, 4, 64, 16));
        // 3 ranks: the size shown is what the call moves.
        let ag3 = sizes(Collective::AllGather, DataType::F32, 3, 64, 64, 2);
        assert_eq!((ag3[0].bytes, ag3[0].count), (60, 5));
        assert_eq!(sizes(Collective::AllReduce, DataType::F32, 2, 1 << 30, 1 << 30, 2)[0].count, 1 << 28);
        assert!(sizes(Collective::AllGather, DataType::F32, 8, 8, 16, 2).is_empty());
    }

    #[test]
    fn bus_factors() {
        assert_eq!(spec(Collective::AllReduce, DataType::F32, ReduceOp::Sum, 2).bus_factor(), 1.0);
        assert_eq!(spec(Collective::AllReduce, DataType::F32, ReduceOp::Sum, 8).bus_factor(), 1.75);
        assert_eq!(spec(Collective::AllGather, DataType::F32, ReduceOp::Sum, 4).bus_factor(), 0.75);
        assert_eq!(spec(Collective::ReduceScatter, DataType::F32, ReduceOp::Sum, 2).bus_factor(), 0.5);
    }

    #[test]
    fn inputs_and_references_are_exact() {
        for d in DataType::ALL {
            for v in [-8i64, -1, 0, 1, 2, 7, 8, 255] {
                if d == DataType::U32 && v < 0 {
                    continue;
                }
                let mut b = Vec::new();
                encode(d, v, &mut b);
                assert_eq!(b.len(), d.size());
                assert_eq!(decode(d, &b), v as f64, "{d} {v}");
            }
        }
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0x0001), 2f64.powi(-24));
        assert!(f16_to_f64(0x7e00).is_nan());
        assert_eq!(decode(DataType::Bf16, &[0x80, 0x43]), 256.0);
        // Every reference of every op stays where bf16 is exact, up to 64 ranks.
        for n in [2, 3, 8, 64] {
            for op in ReduceOp::ALL {
                for d in [DataType::Bf16, DataType::U32, DataType::I32] {
                    let s = spec(Collective::AllReduce, d, op, n);
                    for i in 0..200 {
                        let want = reduce(&s, i);
                        assert!(
                            want.abs() <= 256.0 || (op == ReduceOp::Prod && want.abs() <= 8192.0),
                            "{n} {op} {i}: {want}"
                        );
                        if d == DataType::U32 {
                            assert!((0..n).all(|r| value(&s, r, i) >= 0));
                        }
                    }
                }
            }
        }
        let s = spec(Collective::AllReduce, DataType::I32, ReduceOp::Avg, 2);
        // Integer average truncates toward zero, as C does.
        assert_eq!(reduce(&s, 0), ((value(&s, 0, 0) + value(&s, 1, 0)) / 2) as f64);
        let s = spec(Collective::AllGather, DataType::F32, ReduceOp::Sum, 3);
        assert_eq!(expected(&s, 1, 4, 9), value(&s, 2, 1) as f64);
        let s = spec(Collective::ReduceScatter, DataType::F32, ReduceOp::Max, 3);
        assert_eq!(expected(&s, 2, 4, 1), reduce(&s, 9));
        assert!(close(&spec(Collective::AllReduce, DataType::Bf16, ReduceOp::Avg, 3), 0.33, 1.0 / 3.0));
        assert!(!close(&spec(Collective::AllReduce, DataType::Bf16, ReduceOp::Sum, 3), f64::NAN, 1.0));
    }

    #[test]
    fn rows_line_up_with_the_columns() {
        for nccl in [false, true] {
            let mut s = spec(Collective::AllReduce, DataType::Bf16, ReduceOp::Sum, 2);
            for check in [false, true] {
                s.check = check;
                let p = Placement {
                    time_us: 12.5,
                    algbw_gbps: 1.0,
                    busbw_gbps: 1.0,
                    wrong: check.then_some(0),
                    nccl_time_us: nccl.then_some(10.0),
                    nccl_busbw_gbps: nccl.then_some(1.0),
                };
                let r = Record {
                    size: 1 << 30,
                    count: 1 << 29,
                    algorithm: "allpair".into(),
                    blocks: 1,
                    threads: 512,
                    out_of_place: p.clone(),
                    in_place: p,
                    copy_us: 1.0,
                    copy_gbps: 1.0,
                };
                let cols = columns(&s, nccl);
                assert_eq!(cols[1].len(), row_text(&s, &r, nccl).len(), "{cols:?}");
            }
        }
    }
}
