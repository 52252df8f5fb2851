//! The device header against the Rust side, without a GPU:
//! - compiled by the host C++ compiler (device code gated off), every size, alignment and offset
//!   of the handles equals the Rust `#[repr(C)]` one, and the header's host-callable
//!   `ProxyTrigger` constructors produce the same bits as the Rust encoders;
//! - compiled by NVRTC (with a kernel that calls every device method) to PTX for compute_90, and
//!   assembled by `ptxas` for sm_90 when it is available (that is what checks the inline PTX).
//!
//! Without g++ or NVRTC the tests print why and pass, except in CI (`CI` set), where they fail.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::ptx::{assemble_sm90, nvrtc_or_skip, ptxas, skip};
use mscclpp::device::handles::layout_table;
use mscclpp::device::trigger::ProxyTrigger;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mscclpp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Trigger constructor arguments: (type, dstId, dstOffset, srcId, srcOffset, bytes, semaphoreId).
const TRIGGER_CASES: &[(u64, u32, u64, u32, u64, u64, u32)] = &[
    (1, 0, 0, 0, 0, 0, 0),
    (1, 1, 2, 3, 4, 5, 6),
    (3, 511, 0xffff_ffff, 511, 0xffff_ffff, 0xffff_ffff, 1023),
    (7, 17, 0x1234_5678, 300, 0x9abc_def0, 4096, 512),
    (2, 0, 0, 0, 0, 0, 1),
    (4, 0, 0, 0, 0, 0, 1023),
    (5, 9, 64, 8, 128, 1 << 20, 77),
    (6, 0, 0, 0, 0, 0, 3),
    // Values wider than their fields: both sides mask.
    (15, 1023, 0x1_0000_0001, 513, 0x1_0000_0002, 0x1_0000_0003, 2047),
];
/// The fixed cases plus 256 pseudo-random ones over the whole range of every argument (wider than
/// the fields, so masking is compared too).
fn trigger_cases() -> Vec<(u64, u32, u64, u32, u64, u64, u32)> {
    let mut next = common::splitmix(0x9e37_79b9_7f4a_7c15);
    let mut v = TRIGGER_CASES.to_vec();
    for _ in 0..256 {
        let w = [next(), next(), next(), next()];
        v.push((
            w[0] & 0xf,
            (w[0] >> 8) as u32 & 0x3ff,
            w[1],
            (w[0] >> 20) as u32 & 0x3ff,
            w[2],
            w[3],
            (w[0] >> 32) as u32 & 0x7ff,
        ));
    }
    v
}

/// atomicAdd arguments: (dstId, dstOffset, value, semaphoreId).
const ATOMIC_CASES: &[(u32, u64, i64, u32)] = &[(0, 0, 0, 0), (7, 64, -3, 5), (511, 0xffff_ffff, i64::MIN, 1023)];

#[test]
fn header_layout_and_trigger_bits_match_rust() {
    let rows = layout_table();
    let mut c = String::from(
        "#include <cstdio>\n#include <cstddef>\n#include \"mscclpp_rs/device.cuh\"\nusing namespace mscclpp;\nint main(){\n",
    );
    for (s, f, _) in &rows {
        match *f {
            "sizeof" | "alignof" => c.push_str(&format!("printf(\"%zu\\n\", (size_t){f}({s}));\n")),
            _ => c.push_str(&format!("printf(\"%zu\\n\", offsetof({s}, {f}));\n")),
        }
    }
    let cases = trigger_cases();
    for (ty, dst, doff, src, soff, n, sem) in &cases {
        c.push_str(&format!(
            "{{ ProxyTrigger t({ty}ull, {dst}u, {doff}ull, {src}u, {soff}ull, {n}ull, {sem}u); \
             printf(\"%llu %llu\\n\", t.fst, t.snd); }}\n"
        ));
    }
    for (dst, doff, v, sem) in ATOMIC_CASES {
        c.push_str(&format!(
            "{{ ProxyTrigger t = ProxyTrigger::atomicAdd({dst}u, {doff}ull, (i64){}ull, {sem}u); \
             printf(\"%llu %llu\\n\", t.fst, t.snd); }}\n",
            *v as u64
        ));
    }
    c.push_str("printf(\"%u\\n\", ABI_VERSION);\nreturn 0;}\n");
    let dir = scratch("device-abi");
    let (src, exe) = (dir.join("abi.cpp"), dir.join("abi"));
    std::fs::write(&src, c).unwrap();
    let out = match Command::new("g++")
        .args(["-std=c++17", "-Wall", "-Werror", "-Wno-invalid-offsetof", "-I"])
        .arg(mscclpp::device::include_dir())
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
    {
        Ok(o) => o,
        Err(e) => return skip("header_layout_and_trigger_bits_match_rust", &format!("no g++ ({e})")),
    };
    assert!(out.status.success(), "g++ failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(run.stdout).unwrap();
    let mut lines = text.lines();
    let mut bad = Vec::new();
    for (s, f, ours) in &rows {
        let theirs: usize = lines.next().unwrap().parse().unwrap();
        if *ours != theirs {
            bad.push(format!("{s}.{f}: Rust {ours}, device.cuh {theirs}"));
        }
    }
    for &(ty, dst, doff, src, soff, n, sem) in &cases {
        let ours = ProxyTrigger::from_fields(ty, dst, doff as u32, src, soff as u32, n as u32, sem);
        let theirs = lines.next().unwrap();
        if format!("{} {}", ours.fst, ours.snd) != theirs {
            bad.push(format!("trigger {:?}: Rust {ours:?}, device.cuh {theirs}", (ty, dst, doff, src, soff, n, sem)));
        }
    }
    for &(dst, doff, v, sem) in ATOMIC_CASES {
        let ours = ProxyTrigger::atomic_add(sem, dst, doff as u32, v).unwrap();
        let theirs = lines.next().unwrap();
        if format!("{} {}", ours.fst, ours.snd) != theirs {
            bad.push(format!("atomicAdd {:?}: Rust {ours:?}, device.cuh {theirs}", (dst, doff, v, sem)));
        }
    }
    assert_eq!(lines.next().unwrap(), mscclpp::device::ABI_VERSION.to_string());
    assert!(lines.next().is_none());
    assert!(bad.is_empty(), "device.cuh and Rust disagree:\n{}", bad.join("\n"));
    println!(
        "checked {} sizes/offsets and {} triggers against device.cuh",
        rows.len(),
        cases.len() + ATOMIC_CASES.len()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The kernel that calls every device method of the header.
const API_KERNELS: &str = include_str!("kernels/device_api.cu");

#[test]
fn header_compiles_with_nvrtc_and_assembles_with_ptxas() {
    use mscclpp::device::compile::{CompileOptions, compile};
    let test = "header_compiles_with_nvrtc_and_assembles_with_ptxas";
    if !nvrtc_or_skip(test) {
        return;
    }
    let opts = CompileOptions::default().arch("compute_90").name("device_api.cu");
    let ptx = compile(API_KERNELS, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    assert_eq!(ptx.kernels(), ["fifo_api", "semaphore_api", "port_channel_api"]);
    assert_eq!(ptx.arch(), "compute_90");
    // The orderings the header promises appear as such in the PTX.
    for insn in [
        "st.global.release.sys.v2.u64",
        "st.global.relaxed.sys.v2.u64",
        "fence.acq_rel.sys",
        "atom.relaxed.gpu.add.u64",
        "atom.relaxed.gpu.cas.b64",
        "ld.acquire.sys.u64",
        "ld.relaxed.gpu.u64",
        "red.release.sys.global.add.u64",
        "red.relaxed.gpu.global.add.u64",
        "ld.acquire.gpu.u64",
        "red.release.gpu.global.max.u64",
        "nanosleep.u32",
        "%globaltimer",
        "trap;",
    ] {
        assert!(ptx.as_str().contains(insn), "no {insn} in the PTX");
    }
    let Some(ptxas) = ptxas() else {
        return skip(test, "NVRTC compiled the header, but no ptxas was found to assemble it (MSCCLPP_PTXAS)");
    };
    assemble_sm90(&ptxas, "device-ptx", &[("device_api", ptx.as_str())]);
}

#[test]
fn a_compile_error_carries_nvrtc_log() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    if let Err(e) = nvrtc_info() {
        return skip("a_compile_error_carries_nvrtc_log", e.message());
    }
    let src = "#include \"mscclpp_rs/device.cuh\"\nextern \"C\" __global__ void k(mscclpp::FifoDeviceHandle f) { f.no_such_method(); }\n";
    let e = compile(src, &CompileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), mscclpp::ErrorKind::InvalidUsage);
    assert!(e.message().contains("no_such_method"), "{e}");
}

/// A `FifoExclusiveProducer` cannot be copied (two copies would count the same positions).
#[test]
fn an_exclusive_producer_cannot_be_copied() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    if let Err(e) = nvrtc_info() {
        return skip("an_exclusive_producer_cannot_be_copied", e.message());
    }
    let src = "#include \"mscclpp_rs/device.cuh\"\n\
               extern \"C\" __global__ void k(mscclpp::FifoDeviceHandle f) {\n\
               mscclpp::FifoExclusiveProducer a(f);\n\
               mscclpp::FifoExclusiveProducer b = a;\n\
               b.push(mscclpp::ProxyTrigger(mscclpp::TriggerSync, 0, 0, 0, 0, 0, 0));\n}\n";
    let e = compile(src, &CompileOptions::default()).unwrap_err();
    assert_eq!(e.kind(), mscclpp::ErrorKind::InvalidUsage);
    assert!(e.message().contains("deleted"), "{e}");
}

/// On a GPU: a compiled kernel loads, launches on a public stream and writes device memory.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_compiled_kernel_runs() {
    use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
    let ctx = mscclpp::Context::new();
    let buf = mscclpp::DeviceBuffer::new(&ctx, 0, 16, mscclpp::TransportFlags::NONE).unwrap();
    let src = "#include \"mscclpp_rs/device.cuh\"\n\
               extern \"C\" __global__ void put(mscclpp::u64* p, mscclpp::u64 v) { p[0] = v; p[1] = mscclpp::ABI_VERSION; }\n";
    let ptx = compile(src, &CompileOptions::for_device(0)).unwrap();
    let m = KernelModule::load(0, &ptx).unwrap();
    assert!(m.function("nope").is_err());
    let k = m.function("put").unwrap();
    let s = mscclpp::gpu::Stream::new(0).unwrap();
    let (mut p, mut v) = (buf.device_ptr(), 0xfeed_u64);
    let mut args = [(&mut p as *mut u64).cast(), (&mut v as *mut u64).cast()];
    // SAFETY: the kernel takes (u64*, u64); p is a live 16-byte allocation kept until synchronize.
    unsafe { k.launch((1, 1, 1), (1, 1, 1), 0, &s, &mut args) }.unwrap();
    s.synchronize(std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(buf.read_u64(0).unwrap(), 0xfeed);
    assert_eq!(buf.read_u64(8).unwrap(), u64::from(mscclpp::device::ABI_VERSION));
}

/// Launches `kernel` with `args` (pointers to its parameters) and waits for it (bounded).
fn launch_and_wait(
    k: &mscclpp::device::compile::Kernel,
    grid: u32,
    block: u32,
    args: &mut [*mut std::ffi::c_void],
) -> mscclpp::Result<()> {
    let s = mscclpp::gpu::Stream::new(0)?;
    // SAFETY: every caller passes pointers to values of the kernel's parameter types, alive until
    // this function returns, and the memories they name outlive the synchronize below.
    unsafe { k.launch((grid, 1, 1), (block, 1, 1), 0, &s, args) }?;
    s.synchronize(std::time::Duration::from_secs(60))
}

/// `src` compiled with NVRTC for GPU 0, loaded, and its kernel `name`.
fn gpu_kernel(src: &str, name: &str) -> mscclpp::device::compile::Kernel {
    use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
    let ptx = compile(src, &CompileOptions::for_device(0)).unwrap_or_else(|e| panic!("{e}"));
    KernelModule::load(0, &ptx).unwrap().function(name).unwrap()
}

fn arg<T>(v: &mut T) -> *mut std::ffi::c_void {
    (v as *mut T).cast()
}

/// On a GPU: 1024 GPU threads push 8 triggers each through a 64-slot FIFO (128 laps) while the
/// host consumes; half use `push`, half `push_for`. Every trigger arrives once, in per-thread order.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_producers_push_through_a_small_fifo() {
    use mscclpp::device::fifo::Fifo;
    const THREADS: u64 = 1024;
    const ROUNDS: u64 = 8;
    let src = r#"#include "mscclpp_rs/device.cuh"
using namespace mscclpp;
extern "C" __global__ void produce(FifoDeviceHandle fifo, u64 rounds, u64* failures) {
  u64 id = blockIdx.x * blockDim.x + threadIdx.x;
  for (u64 r = 0; r < rounds; r++) {
    ProxyTrigger t;
    t.fst = id;
    t.snd = r;
    if (id % 2 == 0) {
      fifo.push(t);
    } else if (!fifo.push_for(t, 10000000000ull)) {
      atomicAdd(failures, 1ull);
      return;
    }
  }
}
"#;
    let ctx = mscclpp::Context::new();
    let fifo = Fifo::new(&ctx, 0, 64).unwrap();
    let failures = mscclpp::DeviceBuffer::new(&ctx, 0, 8, mscclpp::TransportFlags::NONE).unwrap();
    let k = gpu_kernel(src, "produce");
    let mut next = vec![0u64; THREADS as usize];
    std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let (mut h, mut rounds, mut f) = (fifo.device_handle(), ROUNDS, failures.device_ptr());
            launch_and_wait(&k, (THREADS / 128) as u32, 128, &mut [arg(&mut h), arg(&mut rounds), arg(&mut f)])
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut got = 0;
        while got < THREADS * ROUNDS && std::time::Instant::now() < deadline {
            if let Some(t) = fifo.poll() {
                fifo.pop();
                assert_eq!(t.snd, next[t.fst as usize], "thread {}: out of order or duplicated", t.fst);
                next[t.fst as usize] += 1;
                got += 1;
            }
        }
        producer.join().unwrap().unwrap();
    });
    assert_eq!(failures.read_u64(0).unwrap(), 0);
    assert_eq!(next, vec![ROUNDS; THREADS as usize]);
    assert_eq!(fifo.poll(), None);
}

/// On a GPU: 1024 GPU threads push 130 triggers each through a 64-slot FIFO with `push_batch`,
/// in batches of 1 to 11 triggers (by thread), one thread in batches of 100 (more than the ring
/// holds), and a quarter of them with `push_batch_for`. The host consumes while they push: every
/// trigger arrives once, in per-thread order, and each batch at consecutive positions (no other
/// thread's trigger inside it).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_batched_pushes_arrive_whole_and_in_order() {
    use mscclpp::device::fifo::Fifo;
    const THREADS: u64 = 1024;
    const ROUNDS: u64 = 130;
    const BIG: u64 = 5;
    let batch_of = |id: u64| if id == BIG { 100 } else { 1 + id % 11 };
    let src = r#"#include "mscclpp_rs/device.cuh"
using namespace mscclpp;
extern "C" __global__ void produce(FifoDeviceHandle fifo, u64 rounds, u64* failures) {
  u64 id = blockIdx.x * blockDim.x + threadIdx.x;
  u64 b = id == 5 ? 100 : 1 + id % 11;
  ProxyTrigger ts[100];
  for (u64 r = 0; r < rounds; r += b) {
    u64 n = rounds - r < b ? rounds - r : b;
    for (u64 k = 0; k < n; k++) {
      ts[k].fst = id;
      ts[k].snd = (n << 32) | (r + k);
    }
    if (id % 4 != 3) {
      fifo.push_batch(ts, (u32)n);
    } else if (!fifo.push_batch_for(ts, (u32)n, 10000000000ull)) {
      atomicAdd(failures, 1ull);
      return;
    }
  }
}
"#;
    let ctx = mscclpp::Context::new();
    let fifo = Fifo::new(&ctx, 0, 64).unwrap();
    let failures = mscclpp::DeviceBuffer::new(&ctx, 0, 8, mscclpp::TransportFlags::NONE).unwrap();
    let k = gpu_kernel(src, "produce");
    let mut next = vec![0u64; THREADS as usize];
    // The batch being popped: (thread, triggers of it still to come).
    let mut open: Option<(u64, u64)> = None;
    let mut batches = 0u64;
    std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let (mut h, mut rounds, mut f) = (fifo.device_handle(), ROUNDS, failures.device_ptr());
            launch_and_wait(&k, (THREADS / 128) as u32, 128, &mut [arg(&mut h), arg(&mut rounds), arg(&mut f)])
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut got = 0;
        while got < THREADS * ROUNDS && std::time::Instant::now() < deadline {
            let Some(t) = fifo.poll() else { continue };
            fifo.pop();
            let (id, i, n) = (t.fst, t.snd & 0xffff_ffff, t.snd >> 32);
            assert!(id < THREADS, "trigger {t:?}: no such thread");
            assert_eq!(i, next[id as usize], "thread {id}: out of order or duplicated");
            let b = batch_of(id);
            assert_eq!(n, b.min(ROUNDS - i / b * b), "thread {id}, trigger {i}: wrong batch length");
            match open {
                Some((o, left)) => {
                    assert_eq!(o, id, "thread {id}'s trigger {i} inside thread {o}'s batch");
                    open = (left > 1).then_some((o, left - 1));
                }
                None => {
                    assert_eq!(i % b, 0, "thread {id}: trigger {i} does not start a batch");
                    batches += 1;
                    open = (n > 1).then_some((id, n - 1));
                }
            }
            next[id as usize] += 1;
            got += 1;
        }
        producer.join().unwrap().unwrap();
    });
    assert_eq!(failures.read_u64(0).unwrap(), 0, "a push_batch_for timed out");
    assert_eq!(next, vec![ROUNDS; THREADS as usize], "triggers missing");
    assert_eq!(open, None);
    assert_eq!(fifo.poll(), None);
    println!(
        "RESULT {} triggers in {batches} batches of 1-100 through 64 slots, each batch contiguous",
        THREADS * ROUNDS
    );
}

/// On a GPU: `push_batch_for` reserves all of its slots or none: on a ring with 3 free slots a
/// batch of 4 times out and leaves `head` alone, a batch of 3 goes in; a batch larger than the
/// ring fails at once; empty batches push nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_push_batch_for_is_all_or_nothing() {
    use mscclpp::device::fifo::Fifo;
    let src = r#"#include "mscclpp_rs/device.cuh"
using namespace mscclpp;
extern "C" __global__ void batches(FifoDeviceHandle full, u64* out) {
  ProxyTrigger ts[9];
  for (int k = 0; k < 9; k++) { ts[k].fst = 100 + k; ts[k].snd = k; }
  u64 p = 77;
  out[0] = full.push_batch_for(ts, 5, 2000000, &p);      // true
  out[1] = p;                                            // 0
  out[2] = full.push_batch_for(ts + 5, 4, 2000000, &p);  // false: 3 free
  out[3] = *full.head;                                   // 5: nothing reserved
  out[4] = full.push_batch_for(ts + 5, 3, 2000000, &p);  // true
  out[5] = p;                                            // 5
  u64 t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  out[6] = full.push_batch_for(ts, 9, 600000000000ull, &p);  // false at once (9 > 8)
  u64 t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[7] = t1 - t0 < 1000000000ull;                      // 1: not after 600 s
  out[8] = full.push_batch_for(ts, 0, 1, &p);            // true
  out[9] = p;                                            // UINT64_MAX
  out[10] = full.push_batch(ts, 0);                      // UINT64_MAX
  out[11] = *full.head;                                  // 8
}
"#;
    let ctx = mscclpp::Context::new();
    let out = mscclpp::DeviceBuffer::new(&ctx, 0, 12 * 8, mscclpp::TransportFlags::NONE).unwrap();
    let full = Fifo::new(&ctx, 0, 8).unwrap();
    let k = gpu_kernel(src, "batches");
    let (mut fh, mut o) = (full.device_handle(), out.device_ptr());
    launch_and_wait(&k, 1, 1, &mut [arg(&mut fh), arg(&mut o)]).unwrap();
    let got: Vec<u64> = (0..12).map(|i| out.read_u64(8 * i).unwrap()).collect();
    assert_eq!(got, vec![1, 0, 0, 5, 1, 5, 0, 1, 1, u64::MAX, u64::MAX, 8]);
    for k in 0..8u64 {
        let t = full.poll().unwrap_or_else(|| panic!("slot {k} empty"));
        assert_eq!((t.fst, t.snd), (100 + k, k));
        full.pop();
    }
    assert_eq!(full.poll(), None);
}

/// On a GPU: the time-limited waits return false instead of hanging or trapping: an unsignalled
/// semaphore (its expected count restored), a full FIFO (nothing reserved), a PortChannel whose
/// proxy published an error, and a flush abandoned with UINT64_MAX.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_time_limited_waits_return_false() {
    use mscclpp::device::fifo::Fifo;
    use mscclpp::device::handles::{BasePortChannelDeviceHandle, Host2DeviceSemaphoreDeviceHandle};
    let src = r#"#include "mscclpp_rs/device.cuh"
using namespace mscclpp;
extern "C" __global__ void timed(Host2DeviceSemaphoreDeviceHandle sem, FifoDeviceHandle full,
                                 BasePortChannelDeviceHandle ch, u64* out) {
  out[0] = sem.wait_for(2000000);               // no signal: false
  out[1] = *sem.expectedInboundToken;           // restored: 0
  atomicAdd(sem.inboundToken, 1ull);            // a signal
  out[2] = sem.wait_for(2000000);               // true
  for (int i = 0; i < full.size; i++) full.push(ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, 1));
  out[3] = full.push_for(ProxyTrigger(TriggerFlag, 0, 0, 0, 0, 0, 1), 2000000, nullptr);  // false
  out[4] = *full.head;                          // size: nothing reserved
  out[5] = ch.fifo_.proxy_error();              // 7, set by the host
  out[6] = ch.wait_for(600000000000ull);        // false at once (proxy error), not after 600 s
  out[7] = ch.flush_for(600000000000ull);       // false: flushDonePos is UINT64_MAX
}
"#;
    let ctx = mscclpp::Context::new();
    let buf = |n| mscclpp::DeviceBuffer::new(&ctx, 0, n, mscclpp::TransportFlags::NONE).unwrap();
    let (token, expected, done, out) = (buf(8), buf(8), buf(8), buf(64));
    done.write(0, &u64::MAX.to_ne_bytes()).unwrap();
    let full = Fifo::new(&ctx, 0, 4).unwrap();
    let chf = Fifo::new(&ctx, 0, 4).unwrap();
    chf.set_proxy_error(7);
    let mut sem = Host2DeviceSemaphoreDeviceHandle {
        inbound_token: token.device_ptr(),
        expected_inbound_token: expected.device_ptr(),
    };
    let ch_sem = buf(16);
    let mut ch = BasePortChannelDeviceHandle {
        semaphore_id: 1,
        _pad: 0,
        semaphore: Host2DeviceSemaphoreDeviceHandle {
            inbound_token: ch_sem.device_ptr(),
            expected_inbound_token: ch_sem.device_ptr() + 8,
        },
        fifo: chf.device_handle(),
        flush_done_pos: done.device_ptr(),
    };
    let (mut fh, mut o) = (full.device_handle(), out.device_ptr());
    let k = gpu_kernel(src, "timed");
    launch_and_wait(&k, 1, 1, &mut [arg(&mut sem), arg(&mut fh), arg(&mut ch), arg(&mut o)]).unwrap();
    let got: Vec<u64> = (0..8).map(|i| out.read_u64(8 * i).unwrap()).collect();
    assert_eq!(got, vec![0, 0, 1, 0, 4, 7, 0, 0]);
    // The full FIFO holds exactly its four pushes; the channel's FIFO got the flush's Sync.
    for _ in 0..4 {
        assert!(full.poll().is_some());
        full.pop();
    }
    assert_eq!(full.poll(), None);
    let sync = chf.poll().unwrap();
    assert_eq!(
        mscclpp::device::decode(sync).unwrap(),
        mscclpp::device::Request::Ops { sem_id: 1, put: None, signal: false, flush: true }
    );
}
