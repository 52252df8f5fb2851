//! Writes every generated plan (see `mscclpp_executor::generate`) for 2..=8 ranks as JSON files
//! in MSCCL++'s schema, loadable by MSCCL++'s `ExecutionPlan` and by `mscclpp-perf ... --plan`.
//!
//! `cargo run -p mscclpp-executor --example write_plans -- DIR`

use std::process::ExitCode;

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
    }
    println!("wrote {n} plans to {}", dir.display());
    ExitCode::SUCCESS
}
