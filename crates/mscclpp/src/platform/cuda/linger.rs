//! The lingering copy kernel of CUDA IPC kernel copies (`cuda_ipc_kernel_copy_linger`): a
//! one-block kernel that does a copy (and its token), then stays on the GPU for a while polling
//! a mailbox in mapped pinned host memory for the next one. While it lingers, a copy costs the
//! proxy a few stores to host memory instead of a `cuLaunchKernel`. This module owns the
//! mailbox's memory, the kernel's PTX and its launch; the protocol is safe code in
//! `conn::linger`.
//!
//! Mailbox layout (64-bit words; byte offsets):
//!
//! | offset | word | written by |
//! |---|---|---|
//! | 0 | `posted`: the last job's sequence number | host |
//! | 8 | `stop`: the generation asked to leave | host |
//! | 64 | `done`: the last finished job's sequence number | kernel |
//! | 128 | `exiting`: the generation that stopped taking jobs | kernel |
//! | 256 + 64 i | job slot i (of [`SLOTS`]): generation, dst, src, len, token, value | host |
//!
//! Job `s` lives in slot `s % SLOTS`. The kernel of generation `g` takes job `s` only when
//! `posted >= s` (an acquire load) and the slot says `g`; it finishes jobs in order, writing
//! `done` after each (after the job's token). When idle past its limit, or told by `stop`, it
//! writes `exiting`, fences (sequentially consistent, system scope), reads `posted` once more and
//! finishes the jobs of its generation up to it before it returns. The host posts a job, fences
//! the same way and reads `exiting`: of the two, at least one sees the other's store (the
//! store-buffering pattern), so a job is either taken by the kernel or known to the host as
//! possibly missed.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use cudarc::driver::{result, sys};

use super::{Func, GpuDevice, Stream, cuda_err};
use crate::error::{Error, Result};
use crate::platform::hostmem::HostAlloc;

/// Job slots in a mailbox.
pub(crate) const SLOTS: u64 = 64;
/// Byte offsets of the mailbox's words.
pub(crate) const POSTED: usize = 0;
pub(crate) const STOP: usize = 8;
pub(crate) const DONE: usize = 64;
pub(crate) const EXITING: usize = 128;
pub(crate) const SLOT0: usize = 256;
pub(crate) const SLOT_BYTES: usize = 64;
const MAILBOX_BYTES: usize = SLOT0 + SLOTS as usize * SLOT_BYTES;

/// Threads of the kernel's one block.
pub(crate) const LINGER_THREADS: u32 = 256;

/// The lingering copy kernel. Parameters: the mailbox's device address, the generation, the
/// first job's sequence number, the idle limit in ns, and the first job (dst, src, len, token
/// or 0, value). The copy is the put-token kernel's (the same text, `ptx_block_copy!`): 16-byte units
/// when both pointers are 16-byte aligned, bytes for the rest; the token after a block barrier,
/// by thread 0's `fence.acq_rel.sys` and relaxed system-scope store; then `done` by a release
/// store. Thread 0 alone polls the mailbox; the other threads wait at a (non-aligned) barrier
/// for the next job, which thread 0 hands them through shared memory.
pub(crate) const LINGER_PTX: &str = concat!(
    r#"//
// mscclpp: lingering copy kernel
.version 7.0
.target sm_70
.address_size 64

.visible .entry mscclpp_linger_copy(
	.param .u64 p_mb,
	.param .u64 p_gen,
	.param .u64 p_seq,
	.param .u64 p_idle,
	.param .u64 p_dst,
	.param .u64 p_src,
	.param .u64 p_len,
	.param .u64 p_token,
	.param .u64 p_value
)
{
	.reg .pred 	%p<8>;
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<40>;
	.shared .align 16 .b64 job[6];

	ld.param.u64 	%rd20, [p_mb];
	ld.param.u64 	%rd21, [p_gen];
	ld.param.u64 	%rd22, [p_seq];
	ld.param.u64 	%rd23, [p_idle];
	ld.param.u64 	%rd1, [p_dst];
	ld.param.u64 	%rd2, [p_src];
	ld.param.u64 	%rd3, [p_len];
	ld.param.u64 	%rd4, [p_token];
	ld.param.u64 	%rd5, [p_value];
	cvta.to.global.u64 	%rd20, %rd20;
	add.s64 	%rd25, %rd20, 64;
	add.s64 	%rd26, %rd20, 128;
	mov.u32 	%r1, %tid.x;
	mov.u32 	%r2, %ntid.x;
	cvt.u64.u32 	%rd7, %r2;
	// %rd24: while leaving, the last job to finish (0: not leaving).
	mov.u64 	%rd24, 0;
	mov.u64 	%rd39, 1;
JOB:
	cvta.to.global.u64 	%rd1, %rd1;
	cvta.to.global.u64 	%rd2, %rd2;
	cvt.u64.u32 	%rd6, %r1;
"#,
    super::ptx_block_copy!(),
    r#"COPIED:
	barrier.sync 	0;
	setp.ne.u32 	%p3, %r1, 0;
	@%p3 bra 	NEXT;
	setp.eq.u64 	%p3, %rd4, 0;
	@%p3 bra 	MARK;
	cvta.to.global.u64 	%rd4, %rd4;
	fence.acq_rel.sys;
	st.relaxed.sys.global.u64 	[%rd4], %rd5;
MARK:
	st.release.sys.global.u64 	[%rd25], %rd22;
	setp.ne.u64 	%p4, %rd24, 0;
	@%p4 bra 	DRAIN;
	mov.u64 	%rd27, %globaltimer;
POLL:
	ld.acquire.sys.global.v2.u64 	{%rd28, %rd29}, [%rd20];
	setp.gt.u64 	%p5, %rd28, %rd22;
	@%p5 bra 	TAKE;
	setp.eq.u64 	%p5, %rd29, %rd21;
	@%p5 bra 	LEAVE;
	mov.u64 	%rd30, %globaltimer;
	sub.s64 	%rd30, %rd30, %rd27;
	setp.lt.u64 	%p5, %rd30, %rd23;
	@%p5 bra 	POLL;
LEAVE:
	st.relaxed.sys.global.u64 	[%rd26], %rd21;
	fence.sc.sys;
	ld.acquire.sys.global.u64 	%rd24, [%rd20];
	max.u64 	%rd24, %rd24, %rd22;
DRAIN:
	setp.le.u64 	%p5, %rd24, %rd22;
	@%p5 bra 	STOP;
TAKE:
	add.s64 	%rd22, %rd22, 1;
	and.b64 	%rd31, %rd22, 63;
	shl.b64 	%rd31, %rd31, 6;
	add.s64 	%rd31, %rd31, %rd20;
	ld.relaxed.sys.global.v2.u64 	{%rd32, %rd33}, [%rd31+256];
	ld.relaxed.sys.global.v2.u64 	{%rd34, %rd35}, [%rd31+272];
	ld.relaxed.sys.global.v2.u64 	{%rd36, %rd37}, [%rd31+288];
	setp.ne.u64 	%p5, %rd32, %rd21;
	@%p5 bra 	STOP;
	st.shared.v2.u64 	[job], {%rd33, %rd34};
	st.shared.v2.u64 	[job+16], {%rd35, %rd36};
	st.shared.v2.u64 	[job+32], {%rd37, %rd39};
	bra.uni 	NEXT;
STOP:
	mov.u64 	%rd38, 0;
	st.shared.u64 	[job+40], %rd38;
NEXT:
	barrier.sync 	0;
	ld.shared.u64 	%rd38, [job+40];
	setp.eq.u64 	%p6, %rd38, 0;
	@%p6 bra 	EXIT;
	ld.shared.v2.u64 	{%rd1, %rd2}, [job];
	ld.shared.v2.u64 	{%rd3, %rd4}, [job+16];
	ld.shared.u64 	%rd5, [job+32];
	bra.uni 	JOB;
EXIT:
	ret;
}
"#
);
pub(crate) const LINGER_ENTRY: &str = "mscclpp_linger_copy";

/// The lingering copy kernel of one device ([`load_linger`], [`Stream::linger_copy`]).
#[derive(Clone, Copy)]
pub(crate) struct LingerKernel(&'static Func);

/// Loads the lingering copy kernel on `dev` now (not at the first copy, while a kernel that
/// waits for it may spin).
pub(crate) fn load_linger(dev: &Arc<GpuDevice>) -> Result<LingerKernel> {
    super::builtin_function(dev, LINGER_PTX, LINGER_ENTRY).map(LingerKernel)
}

/// One copy for the kernel: `len` bytes from `src` to `dst`, then (`token` not 0) `value`
/// written at `token`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Job {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
    pub(crate) token: u64,
    pub(crate) value: u64,
}

enum Owner {
    Gpu {
        ptr: *mut u8,
        dev: Arc<GpuDevice>,
    },
    #[cfg_attr(not(test), allow(dead_code))]
    Host {
        _alloc: HostAlloc,
    },
}

/// A mailbox: mapped pinned memory of a GPU's context (or, for the CPU tests of the protocol,
/// plain host memory), zeroed; every word is reached through an atomic.
pub(crate) struct Mailbox {
    base: *const u8,
    dev_addr: u64,
    owner: Owner,
}

// SAFETY: the memory is owned by `owner` for the Mailbox's lifetime and only ever reached
// through shared references to atomics, which any thread may use.
unsafe impl Send for Mailbox {}
// SAFETY: as above.
unsafe impl Sync for Mailbox {}

impl Mailbox {
    /// A zeroed mailbox in mapped pinned memory of `dev`'s context.
    pub(crate) fn gpu(dev: &Arc<GpuDevice>) -> Result<Mailbox> {
        let len = MAILBOX_BYTES;
        let addr = super::near_gpu(dev, || {
            dev.bind()?;
            super::serializing(|| format!("cuMemHostAlloc(copy mailbox, {len})"), dev.ordinal, None);
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
            // SAFETY: a plain allocation, owned by the Mailbox below and freed once in its Drop.
            let p = unsafe { result::malloc_host(len, flags) }
                .map_err(|e| cuda_err(&format!("cuMemHostAlloc(copy mailbox, {len} bytes, mapped)"), e))?
                .cast::<u8>();
            // SAFETY: [p, p+len) was just allocated and nothing else refers to it yet.
            unsafe { std::ptr::write_bytes(p, 0, len) };
            Ok(p as usize)
        })?;
        let p = addr as *mut u8;
        let mut mb = Mailbox { base: p, dev_addr: 0, owner: Owner::Gpu { ptr: p, dev: dev.clone() } };
        dev.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: p is a live mapped allocation of the bound context; base is a valid out pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut base, p.cast(), 0) };
        r.result().map_err(|e| cuda_err("cuMemHostGetDevicePointer(copy mailbox)", e))?;
        mb.dev_addr = base;
        Ok(mb)
    }

    /// A zeroed mailbox in plain host memory (for tests of the protocol without a GPU).
    #[cfg(test)]
    pub(crate) fn host() -> Result<Mailbox> {
        let alloc = HostAlloc::zeroed(MAILBOX_BYTES)?;
        let p = alloc.as_ptr();
        Ok(Mailbox { base: p, dev_addr: p as u64, owner: Owner::Host { _alloc: alloc } })
    }

    /// The word at byte offset `off` (a multiple of 8 inside the mailbox).
    pub(crate) fn word(&self, off: usize) -> Result<&AtomicU64> {
        if !off.is_multiple_of(8) || off + 8 > MAILBOX_BYTES {
            return Err(Error::internal(format!("mailbox word at {off}")));
        }
        // SAFETY: off is 8-byte aligned inside the page-aligned allocation of MAILBOX_BYTES,
        // valid while self (its owner) lives; every access to it from this crate is atomic (the
        // kernel's are PCIe reads and writes of whole aligned words).
        Ok(unsafe { &*self.base.add(off).cast::<AtomicU64>() })
    }

    /// The address the kernel uses.
    pub(crate) fn dev_addr(&self) -> u64 {
        self.dev_addr
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        if let Owner::Gpu { ptr, dev } = &self.owner
            && dev.bind().is_ok()
        {
            super::serializing(|| "cuMemFreeHost (copy mailbox)".into(), dev.ordinal, None);
            // SAFETY: ptr came from cuMemHostAlloc and is freed once; its owner keeps it until
            // no kernel can read it (a kernel that may still run leaks the mailbox instead).
            if let Err(e) = unsafe { result::free_host(ptr.cast()) } {
                tracing::warn!(target: "mscclpp::gpu", "cuMemFreeHost (copy mailbox): {e}");
            }
        }
    }
}

impl Stream {
    /// Launches the lingering copy kernel of generation `generation` on this stream with its first
    /// job, `seq`, and the idle limit `idle_ns`.
    pub(crate) fn linger_copy(
        &self,
        k: LingerKernel,
        mailbox: u64,
        generation: u64,
        seq: u64,
        idle_ns: u64,
        job: Job,
    ) -> Result<()> {
        self.dev.bind()?;
        let mut v = [mailbox, generation, seq, idle_ns, job.dst, job.src, job.len, job.token, job.value];
        let mut params: Vec<*mut std::ffi::c_void> = v.iter_mut().map(|p| (p as *mut u64).cast()).collect();
        // SAFETY: k.0 is the PTX entry taking nine u64 parameters (a mailbox address, four
        // numbers, two byte ranges' addresses and length, a word's address or 0, a value), loaded
        // in this device's primary context; params point to nine u64s that live until
        // cuLaunchKernel returns (it copies them); callers pass ranges checked against live
        // allocations, an aligned word, and a mailbox they keep alive while the kernel may run.
        unsafe { result::launch_kernel(k.0.0, (1, 1, 1), (LINGER_THREADS, 1, 1), 0, self.raw, &mut params) }
            .map_err(|e| cuda_err("cuLaunchKernel(mscclpp_linger_copy)", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linger_ptx_is_well_formed_and_matches_the_mailbox_layout() {
        let p = LINGER_PTX;
        assert!(p.contains(".version 7.0") && p.contains(".target sm_70") && p.contains(".address_size 64"));
        assert_eq!(p.matches(".entry").count(), 1);
        assert!(p.contains(&format!(".entry {LINGER_ENTRY}(")));
        let params: Vec<&str> = p.lines().filter(|l| l.trim_start().starts_with(".param .u64")).collect();
        let names = ["p_mb", "p_gen", "p_seq", "p_idle", "p_dst", "p_src", "p_len", "p_token", "p_value"];
        assert_eq!(params.len(), names.len(), "{params:?}");
        for (i, name) in names.iter().enumerate() {
            assert!(params[i].contains(name), "parameter {i} is {:?}", params[i]);
        }
        // The mailbox, word by word, as this module lays it out: `posted` and `stop` read
        // together by one 16-byte load at the base, `done` and `exiting` where the host reads
        // them, slots of SLOT_BYTES from SLOT0 indexed by the job number modulo SLOTS, and the
        // six fields of a slot in the order `Linger::write_slot` stores them.
        assert_eq!((POSTED, STOP), (0, 8));
        assert!(p.contains("ld.acquire.sys.global.v2.u64 \t{%rd28, %rd29}, [%rd20];"));
        assert!(p.contains(&format!("add.s64 \t%rd25, %rd20, {DONE};")));
        assert!(p.contains(&format!("add.s64 \t%rd26, %rd20, {EXITING};")));
        assert!(p.contains(&format!("and.b64 \t%rd31, %rd22, {};", SLOTS - 1)) && SLOTS.is_power_of_two());
        assert!(p.contains(&format!("shl.b64 \t%rd31, %rd31, {};", SLOT_BYTES.trailing_zeros())));
        assert!(SLOT_BYTES.is_power_of_two() && SLOT_BYTES >= 48);
        for (off, regs) in [(0, "{%rd32, %rd33}"), (16, "{%rd34, %rd35}"), (32, "{%rd36, %rd37}")] {
            assert!(p.contains(&format!("ld.relaxed.sys.global.v2.u64 \t{regs}, [%rd31+{}];", SLOT0 + off)));
        }
        // Generation, then dst, src, len, token, value into shared memory in the order read back.
        assert!(p.contains("setp.ne.u64 \t%p5, %rd32, %rd21;"));
        assert!(p.contains("st.shared.v2.u64 \t[job], {%rd33, %rd34};"));
        assert!(p.contains("ld.shared.v2.u64 \t{%rd1, %rd2}, [job];"));
        // Orderings: the token after the block barrier and its fence; `done` released after the
        // token; `exiting`, then the SC fence, then the last read of `posted`.
        let at = |needle: &str| p.find(needle).unwrap_or_else(|| panic!("no {needle}"));
        assert!(
            at("COPIED:") < at("fence.acq_rel.sys")
                && at("fence.acq_rel.sys") < at("st.relaxed.sys.global.u64 \t[%rd4]")
        );
        assert!(at("st.relaxed.sys.global.u64 \t[%rd4]") < at("st.release.sys.global.u64 \t[%rd25], %rd22;"));
        assert!(at("st.relaxed.sys.global.u64 \t[%rd26], %rd21;") < at("fence.sc.sys"));
        assert!(at("fence.sc.sys") < at("ld.acquire.sys.global.u64 \t%rd24, [%rd20];"));
        // Barriers the divergent thread 0 reaches by another path are the non-aligned form.
        assert!(!p.contains("bar.sync") && p.matches("barrier.sync \t0;").count() == 2);
        assert_eq!(p.matches('{').count(), p.matches('}').count());
        assert!(p.is_ascii() && !p.contains('\0'));
        assert_eq!(crate::identity::fnv1a64(&[p.as_bytes()]), LINGER_HASH, "PTX text changed");
    }
    const LINGER_HASH: u64 = 10954771990426826544;
}
