//! Whether work on one stream can start while another stream of the same context has a kernel
//! spinning and a launch queued behind it: the hardware-queue false dependency of
//! `docs/design.md` ("Hardware queues and ranks as threads"), measured instead of assumed.
//!
//! The driver spreads a context's streams over `CUDA_DEVICE_MAX_CONNECTIONS` hardware queues
//! (8 unless set). Work in one queue starts in order, so when the proxy's connection stream
//! shares a queue with a stream whose kernel waits for the proxy's copy and has another launch
//! queued behind it, the copy cannot start until that kernel gives up. Megatron-LM runs with
//! `CUDA_DEVICE_MAX_CONNECTIONS=1`; whether a stream of another priority escapes the shared
//! queue decides whether the library can make its own streams immune.
//!
//! [`queue_probe`] sets that scene up on purpose: a one-thread kernel spins on a device word
//! (with its own time limit), a second launch waits behind it in its stream, and then a write of
//! the word is issued on another stream, as a kernel, a `cuStreamWriteValue64` (how the proxy
//! writes a token) or a `cuMemcpyDtoDAsync` (how it puts data). The spinner reports whether the
//! write arrived and after how long. Run it in processes started with different values of the
//! variable (it is read once, when CUDA starts): `mscclpp-perf device` does.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::time::Duration;

use super::module::Module;
use super::{GpuRegion, Stream, device};
use crate::error::{Error, ErrorKind, Result};

/// The probe's kernels (hand-written PTX: no NVRTC needed).
///
/// `mscclpp_probe_spin(flag, timeout_ns, out)`: one thread polls the 64-bit `flag` (volatile
/// loads) until it is nonzero or `timeout_ns` passed on `%globaltimer`; `out[0]` = 1 (seen) or
/// 2 (timed out), `out[1]` = nanoseconds waited. `mscclpp_probe_nop()`: nothing.
/// `mscclpp_probe_set(flag)`: stores 1 into `flag`.
pub(crate) const PROBE_PTX: &str = r#"//
// mscclpp: hardware-queue probe kernels
.version 7.0
.target sm_70
.address_size 64

.visible .entry mscclpp_probe_spin(
	.param .u64 p_flag,
	.param .u64 p_timeout,
	.param .u64 p_out
)
{
	.reg .pred 	%p<3>;
	.reg .b64 	%rd<12>;

	ld.param.u64 	%rd1, [p_flag];
	ld.param.u64 	%rd2, [p_timeout];
	ld.param.u64 	%rd3, [p_out];
	cvta.to.global.u64 	%rd4, %rd1;
	cvta.to.global.u64 	%rd5, %rd3;
	mov.u64 	%rd6, %globaltimer;
	mov.u64 	%rd10, 1;
$L_poll:
	ld.volatile.global.u64 	%rd7, [%rd4];
	mov.u64 	%rd8, %globaltimer;
	sub.u64 	%rd9, %rd8, %rd6;
	setp.ne.s64 	%p1, %rd7, 0;
	@%p1 bra 	$L_done;
	setp.gt.u64 	%p2, %rd9, %rd2;
	@!%p2 bra 	$L_poll;
	mov.u64 	%rd10, 2;
$L_done:
	st.global.u64 	[%rd5], %rd10;
	st.global.u64 	[%rd5+8], %rd9;
	ret;
}

.visible .entry mscclpp_probe_nop()
{
	ret;
}

.visible .entry mscclpp_probe_set(
	.param .u64 p_flag
)
{
	.reg .b64 	%rd<4>;

	ld.param.u64 	%rd1, [p_flag];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u64 	%rd3, 1;
	st.volatile.global.u64 	[%rd2], %rd3;
	ret;
}
"#;

const SPIN: &str = "mscclpp_probe_spin";
const NOP: &str = "mscclpp_probe_nop";
const SET: &str = "mscclpp_probe_set";
/// One block of one thread.
const ONE: ((u32, u32, u32), (u32, u32, u32)) = ((1, 1, 1), (1, 1, 1));

/// How the probe's word is written from the other stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeWrite {
    /// A one-thread kernel stores it.
    Kernel,
    /// `cuStreamWriteValue64` (how the proxy writes a semaphore token over CUDA IPC).
    WriteValue,
    /// `cuMemcpyDtoDAsync` of 8 bytes (how the proxy puts data over CUDA IPC).
    Copy,
}

impl std::fmt::Display for ProbeWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProbeWrite::Kernel => "kernel",
            ProbeWrite::WriteValue => "cuStreamWriteValue64",
            ProbeWrite::Copy => "cuMemcpyDtoDAsync",
        })
    }
}

/// The writing stream of a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeStream {
    /// `cuStreamCreate` (default priority), as the library's connection streams are made.
    Default,
    /// `cuStreamCreateWithPriority` with the device's greatest priority.
    Greatest,
    /// `cuStreamCreateWithPriority` with the device's least priority (equal to the default on
    /// current GPUs, whose default is the least).
    Least,
}

impl std::fmt::Display for ProbeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProbeStream::Default => "default-priority stream",
            ProbeStream::Greatest => "greatest-priority stream",
            ProbeStream::Least => "least-priority stream",
        })
    }
}

/// What one probe saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueProbe {
    /// The write reached the spinning kernel before its time limit.
    pub arrived: bool,
    /// How long the spinning kernel waited in all (GPU clock): until the write arrived or its
    /// limit passed; it includes the head start the spinner gets before the write is issued.
    pub waited: Duration,
    /// From issuing the write to the waiting stream's completion (host clock, polled): how late
    /// the write arrived, as an upper bound.
    pub after_issue: Duration,
}

/// The longest limit [`queue_probe`] takes.
pub const PROBE_MAX_LIMIT: Duration = Duration::from_secs(60);
/// The spinner's head start before the write is issued.
const HEAD_START: Duration = Duration::from_millis(5);
/// How long past its limit the probe waits for its kernels before giving up on them.
const SETTLE: Duration = Duration::from_secs(10);

/// Runs one probe on GPU `ordinal`: a one-thread kernel spins on a device word, with (`queued`)
/// or without a second launch queued behind it in its stream (the case that blocks a shared
/// hardware queue), and waits up to `limit` for the word, which is written as `write` on a
/// stream made as `stream`. Run it in processes started with different
/// `CUDA_DEVICE_MAX_CONNECTIONS` (read once, when CUDA starts): `mscclpp-perf device` does.
///
/// # Errors
/// `InvalidUsage` for a limit above [`PROBE_MAX_LIMIT`]; `NotAvailable` without a driver or
/// where stream memory operations are unsupported (for `WriteValue`); `Cuda` when a call
/// fails; `Timeout` when the kernels have not finished 10 s after the limit (their memory, module
/// and streams are then left allocated rather than freed under them).
pub fn queue_probe(
    ordinal: u32,
    write: ProbeWrite,
    stream: ProbeStream,
    queued: bool,
    limit: Duration,
) -> Result<QueueProbe> {
    check_limit(limit)?;
    let kit = Kit::new(ordinal)?;
    let waiter = Stream::new(&kit.dev)?;
    let writer = match stream {
        ProbeStream::Default => Stream::new(&kit.dev)?,
        ProbeStream::Greatest => Stream::with_priority(&kit.dev, true)?,
        ProbeStream::Least => Stream::with_priority(&kit.dev, false)?,
    };
    match kit.probe(&waiter, &writer, write, queued, limit) {
        Ok(p) => Ok(p),
        Err((e, false)) => Err(e),
        Err((e, true)) => {
            // A kernel may still run: leave what it uses allocated rather than free it under it.
            std::mem::forget((kit, waiter, writer));
            Err(e)
        }
    }
}

/// Which streams share the waiting stream's hardware queue: a waiting stream is made, then
/// `count` more one after another, and a `cuStreamWriteValue64` from each (how the proxy writes
/// a token) is probed behind a spinner on the waiting stream with a launch queued after it.
/// Entry `i` of the result is true when stream `i` (0 = the first made after the waiting one)
/// was blocked. With `keep`, every stream stays alive until the end; without, each is destroyed
/// after its probe, before the next is made (whether the driver hands a freed queue out again).
/// Run it in a process started with the `CUDA_DEVICE_MAX_CONNECTIONS` to map; streams made
/// earlier in the process do not matter (only the order from the waiting stream on).
///
/// # Errors
/// As [`queue_probe`] (`NotAvailable` where stream memory operations are unsupported).
pub fn queue_map_probe(ordinal: u32, count: usize, keep: bool, limit: Duration) -> Result<Vec<bool>> {
    check_limit(limit)?;
    let kit = Kit::new(ordinal)?;
    let waiter = Stream::new(&kit.dev)?;
    let mut kept = Vec::new();
    let mut blocked = Vec::with_capacity(count);
    for _ in 0..count {
        let writer = Stream::new(&kit.dev)?;
        match kit.probe(&waiter, &writer, ProbeWrite::WriteValue, true, limit) {
            Ok(p) => blocked.push(!p.arrived),
            Err((e, false)) => return Err(e),
            Err((e, true)) => {
                std::mem::forget((kit, waiter, writer, kept));
                return Err(e);
            }
        }
        if keep {
            kept.push(writer);
        }
    }
    Ok(blocked)
}

fn check_limit(limit: Duration) -> Result<()> {
    if limit > PROBE_MAX_LIMIT {
        return Err(Error::invalid_usage(format!(
            "queue_probe: a limit of {limit:?} is above the {PROBE_MAX_LIMIT:?} it takes"
        )));
    }
    Ok(())
}

/// The probe's kernels (each keeps the module loaded) and device words: word 0 the flag, word 1
/// the 1 a copy reads, words 2-3 the spinner's report.
struct Kit {
    dev: std::sync::Arc<super::GpuDevice>,
    mem: GpuRegion,
    spin: super::module::Kernel,
    nop: super::module::Kernel,
    set: super::module::Kernel,
}

impl Kit {
    fn new(ordinal: u32) -> Result<Kit> {
        let dev = device(ordinal)?;
        let module = Module::load(ordinal, PROBE_PTX, &[SPIN.to_string(), NOP.to_string(), SET.to_string()])?;
        let kernel = |name: &str| {
            module.function(name).ok_or_else(|| Error::internal(format!("the probe module has no {name}")))
        };
        let (spin, nop, set) = (kernel(SPIN)?, kernel(NOP)?, kernel(SET)?);
        let mem = GpuRegion::alloc(&dev, 32)?;
        mem.write(8, &1u64.to_le_bytes())?;
        Ok(Kit { dev, mem, spin, nop, set })
    }

    /// One probe on these streams (the flag is cleared first). `Err((e, true))` when the
    /// kernels may still run: the caller must then leak the kit and both streams.
    fn probe(
        &self,
        waiter: &Stream,
        writer: &Stream,
        write: ProbeWrite,
        queued: bool,
        limit: Duration,
    ) -> std::result::Result<QueueProbe, (Error, bool)> {
        let (flag, one, out) = (self.mem.ptr, self.mem.ptr + 8, self.mem.ptr + 16);
        // Both streams are idle here (a probe returns only once they are): plain writes.
        self.mem.write(0, &0u64.to_le_bytes()).map_err(|e| (e, false))?;
        self.mem.write(16, &[0u8; 16]).map_err(|e| (e, false))?;
        if write == ProbeWrite::WriteValue {
            // Before anything spins: whether the GPU takes stream memory operations at all (this
            // writes the 0 the flag already holds).
            let unsupported =
                || Error::new(ErrorKind::NotAvailable, "cuStreamWriteValue64 is not supported on this GPU");
            if !writer.write_value64(flag, 0).map_err(|e| (e, false))? {
                return Err((unsupported(), false));
            }
            writer.synchronize().map_err(|e| (e, false))?;
        }
        let limit_ns = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
        // From the spinner's launch on, nothing is freed before both streams are idle: every
        // outcome goes through the bounded wait after this block.
        let issued = (|| -> Result<std::time::Instant> {
            let (mut f, mut t, mut o) = (flag, limit_ns, out);
            // SAFETY: the spinner takes (u64 pointer, u64, u64 pointer) and the nop nothing; the
            // pointers are words of `mem`, which outlives both streams' work (the wait below, or
            // leaked with the kit and the streams when the kernels do not finish).
            unsafe {
                self.spin.launch_on(
                    ONE,
                    waiter,
                    &mut [
                        (&mut f as *mut u64).cast::<c_void>(),
                        (&mut t as *mut u64).cast(),
                        (&mut o as *mut u64).cast(),
                    ],
                )?;
                if queued {
                    self.nop.launch_on(ONE, waiter, &mut [])?;
                }
            }
            // The spinner starts before the write is issued (it would wait in order anyway).
            std::thread::sleep(HEAD_START);
            let at = std::time::Instant::now();
            match write {
                ProbeWrite::Kernel => {
                    let mut f = flag;
                    // SAFETY: `set` takes one u64 pointer, a word of `mem` (kept alive as above).
                    unsafe { self.set.launch_on(ONE, writer, &mut [(&mut f as *mut u64).cast::<c_void>()])? };
                }
                ProbeWrite::WriteValue => {
                    if !writer.write_value64(flag, 1)? {
                        return Err(Error::new(
                            ErrorKind::NotAvailable,
                            "cuStreamWriteValue64 is not supported on this GPU",
                        ));
                    }
                }
                ProbeWrite::Copy => writer.copy_dtod(flag, one, 8)?,
            }
            Ok(at)
        })();
        let bound = limit + SETTLE;
        let waiter_idle = waiter.wait_idle(bound);
        let after_issue = issued.as_ref().map(std::time::Instant::elapsed).unwrap_or_default();
        let idle = waiter_idle.and_then(|w| Ok(w && writer.wait_idle(bound)?));
        if !matches!(idle, Ok(true)) {
            let e = match idle {
                Err(e) => e,
                _ => Error::new(
                    ErrorKind::Timeout,
                    format!("the queue probe's kernels had not finished {bound:?} after the probe started"),
                ),
            };
            return Err((
                match issued {
                    Err(first) => first.with_note(format!("then: {e}")),
                    Ok(_) => e,
                },
                true,
            ));
        }
        issued.map_err(|e| (e, false))?;
        let mut report = [0u8; 16];
        self.mem.read(16, &mut report).map_err(|e| (e, false))?;
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&report[i * 8..i * 8 + 8]);
            u64::from_le_bytes(b)
        };
        match word(0) {
            1 | 2 => Ok(QueueProbe { arrived: word(0) == 1, waited: Duration::from_nanos(word(1)), after_issue }),
            other => Err((Error::internal(format!("the queue probe's spinner reported {other}")), false)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_ptx_declares_its_three_entries() {
        for name in [SPIN, NOP, SET] {
            assert_eq!(PROBE_PTX.matches(&format!(".entry {name}(")).count(), 1, "{name}");
        }
        assert_eq!(PROBE_PTX.matches('{').count(), PROBE_PTX.matches('}').count());
        assert!(PROBE_PTX.is_ascii() && !PROBE_PTX.contains('\0'));
    }

    #[test]
    fn a_limit_past_the_maximum_is_refused_before_any_gpu_work() {
        let e = queue_probe(0, ProbeWrite::Copy, ProbeStream::Default, true, Duration::MAX).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    }

    #[test]
    fn a_map_limit_past_the_maximum_is_refused_before_any_gpu_work() {
        let e = queue_map_probe(0, 4, true, Duration::MAX).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    }

    #[test]
    fn names_read_as_rows() {
        assert_eq!(ProbeWrite::WriteValue.to_string(), "cuStreamWriteValue64");
        assert_eq!(ProbeStream::Greatest.to_string(), "greatest-priority stream");
    }
}
