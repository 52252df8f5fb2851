//! Writes every generated plan (see `mscclpp_executor::generate`) for 2..=8 ranks as JSON files
//! in MSCCL++'s schema, loadable by MSCCL++'s `ExecutionPlan` and by `mscclpp-perf ... --plan`,
//! and the one-hop AllReduce split several ways (`onehop_allreduce_N_ll_BxT_oop.json`: B thread
//! blocks of T threads; for timing against the built-in `allpair` kernel at different sizes).
//!
//! `cargo run -p mscclpp-executor --example write_plans -- DIR`

use std::process::ExitCode;

/// (thread blocks, threads per block) of the one-hop AllReduce plans written beside the others;
/// the built-in `allpair` kernel launches 1 x 128 at 1 KiB and 32 x 512 from 128 KiB up
/// (`mscclpp_collectives::select::shape`), so each size has a plan of its shape to compare with.
const ONE_HOP_SPLITS: [(usize, u32); 7] = [(1, 128), (1, 256), (2, 256), (4, 256), (8, 512), (16, 512), (32, 512)];

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: write_plans DIR");
        return ExitCode::from(2);
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("{}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    let mut n = 0;
    for ranks in 2..=8 {
        for plan in mscclpp_executor::generate::all(ranks) {
            let path = dir.join(format!("{}.json", plan.name));
            if let Err(e) = std::fs::write(&path, plan.to_json()) {
                eprintln!("{}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            n += 1;
        }
        for (blocks, threads) in ONE_HOP_SPLITS {
            let Some(plan) = mscclpp_executor::generate::one_hop_allreduce(ranks, false, blocks, threads) else {
                continue;
            };
            let path = dir.join(format!("{}.json", plan.name));
            if let Err(e) = std::fs::write(&path, plan.to_json()) {
                eprintln!("{}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            n += 1;
        }
    }
    println!("wrote {n} plans to {}", dir.display());
    ExitCode::SUCCESS
}
