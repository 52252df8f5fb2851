//! The C API's own host cost per call, on CPU (no GPU needed): ranks as threads, each with a
//! communicator whose native collectives are a no-op (`InitArgs::noop_native`), so
//! `ncclAllReduce` does everything it does on a GPU (panic guard, handle lookup, argument
//! checks, group state, routing, route log, dispatch) except wrapping the stream and calling
//! `Collectives::all_reduce`. What this prints is what the library adds over calling the
//! collective directly, minus the stream wrap (`Stream::from_raw`, timed on the GPU by
//! `nccl_overhead`).
//!
//! ```text
//! cargo run --release -p mscclpp-nccl --example nccl_host_path -- [--ranks 2] [--calls 200000] [--reps 15]
//! ```
//! Prints ns per call (median over `--reps` batches of `--calls` calls), per rank, for
//! `ncclAllReduce` and for the error path (a NULL communicator), which must stay cheap too.

use std::ffi::c_void;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use mscclpp::TcpBootstrap;
use mscclpp_nccl::abi::*;
use mscclpp_nccl::comm::{Comm, Handle, InitArgs};
use mscclpp_nccl::exports::*;
use mscclpp_nccl::mem::HostMem;
use mscclpp_nccl::route::Settings;

fn arg(name: &str, default: usize) -> usize {
    let v: Vec<String> = std::env::args().collect();
    v.iter().position(|a| a == name).and_then(|i| v.get(i + 1)).and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() {
    let (ranks, calls, reps) = (arg("--ranks", 2).max(1), arg("--calls", 200_000).max(1), arg("--reps", 15).max(1));
    let id = match TcpBootstrap::create_unique_id() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("nccl_host_path: {e}");
            std::process::exit(1);
        }
    };
    let bar = Arc::new(Barrier::new(ranks));
    let rows: Vec<Result<(f64, f64), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..ranks)
            .map(|r| {
                let (id, bar) = (id.clone(), bar.clone());
                s.spawn(move || -> Result<(f64, f64), String> {
                    let mut a = InitArgs::new(r, ranks, id);
                    a.mem = Some(Arc::new(HostMem));
                    a.native = false;
                    a.noop_native = true;
                    a.settings = Settings::default();
                    let comm = Comm::init(a).map_err(|e| e.message)?;
                    let h = Handle::leak(Some(comm));
                    let (sb, rb) = (vec![0f32; 256], vec![0f32; 256]);
                    let (sp, rp) = (sb.as_ptr() as *const c_void, rb.as_ptr() as *mut c_void);
                    let stream = 0x1000 as cudaStream_t;
                    let mut ok = Vec::new();
                    let mut bad = Vec::new();
                    for rep in 0..reps + 1 {
                        bar.wait();
                        let t = Instant::now();
                        for _ in 0..calls {
                            // SAFETY: h is a live communicator; the no-op backend touches no buffer.
                            let rc = unsafe { ncclAllReduce(sp, rp, 256, ncclFloat32, ncclSum, h, stream) };
                            if rc != ncclSuccess {
                                return Err(format!("ncclAllReduce returned {rc}"));
                            }
                        }
                        let ns = t.elapsed().as_secs_f64() * 1e9 / calls as f64;
                        if rep > 0 {
                            ok.push(ns);
                        }
                    }
                    // The error path: a NULL communicator (formats and records a message).
                    let n = (calls / 20).max(1);
                    for rep in 0..reps + 1 {
                        let t = Instant::now();
                        for _ in 0..n {
                            // SAFETY: a NULL communicator is refused before anything is read.
                            let rc = unsafe {
                                ncclAllReduce(sp, rp, 256, ncclFloat32, ncclSum, std::ptr::null_mut(), stream)
                            };
                            if rc != ncclInvalidArgument {
                                return Err(format!("NULL communicator: got {rc}"));
                            }
                        }
                        if rep > 0 {
                            bad.push(t.elapsed().as_secs_f64() * 1e9 / n as f64);
                        }
                    }
                    bar.wait();
                    // SAFETY: our communicator, no work pending.
                    unsafe { ncclCommDestroy(h) };
                    Ok((median(ok), median(bad)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into()))).collect()
    });
    println!("ncclAllReduce host path (no-op native backend), {ranks} ranks as threads, {calls} calls x {reps} reps");
    println!("{:>5} | {:>14} | {:>18}", "rank", "ns/call", "NULL comm ns/call");
    let mut failed = false;
    for (r, row) in rows.iter().enumerate() {
        match row {
            Ok((ok, bad)) => println!("{r:>5} | {ok:>14.1} | {bad:>18.1}"),
            Err(e) => {
                eprintln!("rank {r}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
