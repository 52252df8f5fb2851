//! What the NCCL C API adds over calling the collectives directly: ranks as threads of this
//! process on GPU 0, each with a communicator made by `ncclCommInitRank`. For every size it times
//!
//! - host: the cost of enqueuing one AllReduce, `ncclAllReduce` through the C API (the same code
//!   an `LD_PRELOAD`ed program reaches) against `Collectives::all_reduce` on the very
//!   `Collectives` that communicator owns (batches of `--calls` calls, median over `--reps`
//!   batches, each batch synchronized before the next so the launch queue never fills);
//! - graph: GPU time per call of `--calls` calls captured in one CUDA graph, both ways, replayed
//!   `--reps` times by every rank at once.
//!
//! ```text
//! cargo run --release -p mscclpp-nccl --example nccl_overhead -- [--ranks 2] [--calls 100] [--reps 20] [--sizes 1K,4K,64K,1M]
//! ```
//! Prints one table (rank 0). The issue's bound: host overhead <= 1 us per call, graph overhead ~0.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream, TimingEvent};
use mscclpp::{Result, TransportFlags};
use mscclpp_collectives::{CallOptions, DataType, ReduceOp};
use mscclpp_nccl::abi::*;
use mscclpp_nccl::comm::Handle;
use mscclpp_nccl::exports::*;

struct Args {
    ranks: usize,
    calls: usize,
    reps: usize,
    sizes: Vec<usize>,
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (n, m) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 1 << 10),
        'M' | 'm' => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    n.parse::<usize>().ok().map(|v| v * m)
}

fn args() -> std::result::Result<Args, String> {
    let mut a = Args { ranks: 2, calls: 100, reps: 20, sizes: vec![1 << 10, 4 << 10, 64 << 10, 1 << 20] };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        let num = || v.parse::<usize>().map_err(|e| format!("{k} {v}: {e}"));
        match k.as_str() {
            "--ranks" => a.ranks = num()?.max(1),
            "--calls" => a.calls = num()?.max(1),
            "--reps" => a.reps = num()?.max(1),
            "--sizes" => {
                a.sizes = v
                    .split(',')
                    .map(|s| parse_size(s).ok_or_else(|| format!("bad size {s}")))
                    .collect::<std::result::Result<_, _>>()?
            }
            _ => return Err(format!("unknown option {k}")),
        }
    }
    Ok(a)
}

/// Per size: (host us/call C API, host us/call direct, graph us/call C API, graph us/call direct).
type Row = (usize, f64, f64, f64, f64);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn rank_main(rank: usize, a: &Args, id: ncclUniqueId, bar: &Barrier) -> Result<Vec<Row>> {
    let err = |m: String| mscclpp::Error::internal(m);
    mscclpp_nccl::mem::bind(0).map_err(|e| err(e.message))?;
    let mut h: ncclComm_t = null_mut();
    // SAFETY: a valid out pointer and an id from ncclGetUniqueId.
    let rc = unsafe { ncclCommInitRank(&mut h, a.ranks as c_int, id, rank as c_int) };
    if rc != ncclSuccess {
        return Err(err(format!("rank {rank}: ncclCommInitRank returned {rc}")));
    }
    // SAFETY: h is the communicator ncclCommInitRank just returned.
    let comm = unsafe { Handle::from_ptr(h, "bench") }.and_then(|x| x.get("bench")).map_err(|e| err(e.message))?;
    let coll = comm.native.as_ref().map_err(|e| err(e.clone()))?;
    let stream = Stream::new(0)?;
    let raw = stream.as_raw() as cudaStream_t;
    let max = a.sizes.iter().copied().max().unwrap_or(4);
    let (sb, rb) = (
        DeviceBuffer::new(comm.comm.context(), 0, max, TransportFlags::NONE)?,
        DeviceBuffer::new(comm.comm.context(), 0, max, TransportFlags::NONE)?,
    );
    sb.fill(0, max, 1)?;
    let wait = Duration::from_secs(60);
    let opts = CallOptions::default();
    let (s, r) = (sb.device_ptr(), rb.device_ptr());
    let nccl = |count: usize| -> Result<()> {
        // SAFETY: both buffers hold `max` >= count * 4 bytes and outlive the stream's work.
        let rc = unsafe { ncclAllReduce(s as *const c_void, r as *mut c_void, count, ncclFloat32, ncclSum, h, raw) };
        if rc == ncclSuccess { Ok(()) } else { Err(err(format!("ncclAllReduce returned {rc}"))) }
    };
    let direct = |count: usize| -> Result<()> {
        // SAFETY: as above.
        unsafe { coll.all_reduce(s, r, count, DataType::F32, ReduceOp::Sum, &stream, &opts) }
    };
    let mut rows = Vec::new();
    for &size in &a.sizes {
        let count = (size / 4).max(1);
        // Warm up both ways (first calls pick plans, tune tables, page in code).
        for _ in 0..10 {
            nccl(count)?;
            direct(count)?;
        }
        stream.synchronize(wait)?;
        let mut host = [Vec::new(), Vec::new()];
        for _ in 0..a.reps {
            for (way, v) in host.iter_mut().enumerate() {
                bar.wait();
                let t = Instant::now();
                for _ in 0..a.calls {
                    if way == 0 { nccl(count)? } else { direct(count)? }
                }
                v.push(t.elapsed().as_secs_f64() * 1e6 / a.calls as f64);
                stream.synchronize(wait)?;
            }
        }
        let mut graph_us = [0.0f64; 2];
        for (way, g_us) in graph_us.iter_mut().enumerate() {
            bar.wait();
            stream.begin_capture()?;
            let mut cap = Ok(());
            for _ in 0..a.calls {
                cap = cap.and_then(|_| if way == 0 { nccl(count) } else { direct(count) });
            }
            let graph = stream.end_capture()?;
            cap?;
            graph.launch(&stream)?; // warm-up replay
            stream.synchronize(wait)?;
            let (t0, t1) = (TimingEvent::new(0)?, TimingEvent::new(0)?);
            bar.wait();
            t0.record(&stream)?;
            for _ in 0..a.reps {
                graph.launch(&stream)?;
            }
            t1.record(&stream)?;
            stream.synchronize(wait)?;
            *g_us = t1.elapsed_ms_since(&t0)? as f64 * 1e3 / (a.reps * a.calls) as f64;
        }
        coll.check()?;
        let [hn, hd] = host;
        rows.push((size, median(hn), median(hd), graph_us[0], graph_us[1]));
    }
    bar.wait();
    // SAFETY: our communicator; its work is done.
    unsafe { ncclCommDestroy(h) };
    Ok(rows)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nccl_overhead: {e}");
            std::process::exit(2);
        }
    };
    let mut id = ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: a valid out pointer.
    if unsafe { ncclGetUniqueId(&mut id) } != ncclSuccess {
        eprintln!("nccl_overhead: ncclGetUniqueId failed");
        std::process::exit(1);
    }
    let bar = Arc::new(Barrier::new(a.ranks));
    let results: Vec<Result<Vec<Row>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..a.ranks)
            .map(|rank| {
                let (a, bar) = (&a, bar.clone());
                s.spawn(move || rank_main(rank, a, id, &bar))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(mscclpp::Error::internal("a rank panicked")))).collect()
    });
    let mut failed = false;
    for (r, res) in results.iter().enumerate() {
        if let Err(e) = res {
            eprintln!("rank {r}: {e}");
            failed = true;
        }
    }
    if failed {
        std::process::exit(1);
    }
    println!(
        "AllReduce f32 sum, {} ranks as threads on GPU 0, {} calls x {} reps (rank 0; us per call)",
        a.ranks, a.calls, a.reps
    );
    println!(
        "{:>9} | {:>12} {:>12} {:>9} | {:>12} {:>12} {:>9}",
        "bytes", "host C API", "host direct", "overhead", "graph C API", "graph direct", "overhead"
    );
    if let Some(Ok(rows)) = results.first() {
        for (size, hn, hd, gn, gd) in rows {
            println!("{size:>9} | {hn:>12.3} {hd:>12.3} {:>+9.3} | {gn:>12.3} {gd:>12.3} {:>+9.3}", hn - hd, gn - gd);
        }
    }
}
