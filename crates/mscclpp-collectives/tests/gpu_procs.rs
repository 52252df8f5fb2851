//! Collectives between processes on one GPU (CUDA IPC between them): the test re-executes
//! itself as 2, 3 and 4 rank processes, each running a sweep of cases against the CPU
//! reference. Two processes on one GPU take turns on it unless the MPS daemon runs (then their
//! kernels run together); either way the results must be right. Marked
//! `#[ignore = "needs a CUDA GPU"]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mscclpp::gpu::{DeviceBuffer, Stream};
use mscclpp::{Bootstrap, Communicator, RootServer, TcpBootstrap, TransportFlags};
use mscclpp_collectives::{Collective, Collectives, Config};

mod common;
use common::{cases_for, coll_barrier, run_case};

const CHILD: &str = "child_rank_of_a_process_sweep";

/// The body of one rank process (does nothing unless started by `processes`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn child_rank_of_a_process_sweep() {
    let (Ok(rank), Ok(n), Ok(id)) =
        (std::env::var("COLL_RANK"), std::env::var("COLL_WORLD"), std::env::var("COLL_UNIQUE_ID"))
    else {
        return;
    };
    let (rank, n): (usize, usize) = (rank.parse().unwrap(), n.parse().unwrap());
    let bs = Arc::new(
        TcpBootstrap::config(rank, n).timeout(Duration::from_secs(120)).initialize(&id.parse().unwrap()).unwrap(),
    );
    let comm = Communicator::new(bs.clone());
    let coll = Collectives::new(&comm, Config::new(0).tune(false).timeout(Duration::from_secs(60))).unwrap();
    let stream = Stream::new(0).unwrap();
    // A lighter sweep than the threads' one (processes without MPS take ~5 ms turns).
    let cases: Vec<_> =
        cases_for(n).into_iter().enumerate().filter(|(i, c)| i % 4 == 0 || c.count > 1 << 20).map(|(_, c)| c).collect();
    let need = cases
        .iter()
        .map(|c| match c.coll {
            Collective::AllGather | Collective::ReduceScatter => c.count * n,
            _ => c.count,
        } * c.dtype.size())
        .max()
        .unwrap();
    let ctx = mscclpp::Context::new();
    let bufs = (
        DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
        DeviceBuffer::new(&ctx, 0, need, TransportFlags::NONE).unwrap(),
    );
    let t = Instant::now();
    let mut bad = Vec::new();
    for c in &cases {
        let (wrong, first) = run_case(rank, n, &coll, &stream, &bufs, c);
        if wrong > 0 {
            bad.push(format!("{c:?}: {wrong} wrong, {first:?}"));
        }
    }
    coll_barrier(&coll);
    bs.barrier().unwrap();
    println!("RESULT rank {rank} of {n} processes: {} cases in {:?}, {} wrong", cases.len(), t.elapsed(), bad.len());
    assert!(bad.is_empty(), "rank {rank}: {}", bad.join("\n"));
}

fn processes(n: usize) {
    let (root, id) = RootServer::start(n, Duration::from_secs(120)).unwrap();
    let me = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(&me)
                .args(["--ignored", "--exact", CHILD, "--nocapture", "--test-threads=1"])
                .env("COLL_RANK", r.to_string())
                .env("COLL_WORLD", n.to_string())
                .env("COLL_UNIQUE_ID", id.to_string())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut failed = Vec::new();
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        for line in text.lines().filter(|l| l.starts_with("RESULT") || l.contains("panicked") || l.contains("wrong,")) {
            println!("  {line}");
        }
        if !out.status.success() || !text.contains("RESULT rank") {
            failed.push(r);
        }
    }
    drop(root);
    assert!(failed.is_empty(), "rank processes {failed:?} failed");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_processes_sweep() {
    processes(2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn three_processes_sweep() {
    processes(3);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn four_processes_sweep() {
    processes(4);
}
