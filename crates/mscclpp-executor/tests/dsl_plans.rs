//! Plans written by MSCCL++'s own DSL (its `python/mscclpp/language/tests` programs, run by
//! `plans/mscclpp_dsl_plans.sh` into a folder, none kept here): every one loads, or is refused
//! only for switch (NVLS) channels or for exceeding MSCCL++'s own per-operation arrays, and runs in the CPU interpreter without deadlock (but for single-operation demos whose
//! packets or signals nobody sends). The
//! collectives among them are checked against the reference. Skipped (prints SKIPPED) unless
//! `MSCCLPP_DSL_PLANS` names the folder.

use mscclpp_executor::sim::{SimError, simulate_interleaved};
use mscclpp_executor::{Plan, PlanError};

#[test]
fn mscclpp_dsl_plans_load_and_run() {
    let Ok(dir) = std::env::var("MSCCLPP_DSL_PLANS") else {
        println!("SKIPPED: set MSCCLPP_DSL_PLANS to a folder of plans (plans/mscclpp_dsl_plans.sh)");
        return;
    };
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let (mut loaded, mut switch, mut over, mut blocked, mut correct) = (0, 0, 0, 0, 0);
    let mut differs = Vec::new();
    for path in &files {
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let plan = match Plan::from_file(path) {
            Ok(plan) => plan,
            Err(PlanError::SwitchChannel { .. }) => {
                switch += 1;
                continue;
            }
            // Past MSCCL++'s own fixed arrays (its executor would write beyond them).
            Err(e @ PlanError::Invalid { .. }) if e.to_string().contains("MSCCL++ allows") => {
                println!("{name}: refused: {e}");
                over += 1;
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        loaded += 1;
        let input: Vec<Vec<i64>> = plan
            .gpus
            .iter()
            .enumerate()
            .map(|(r, g)| (0..g.input_chunks as i64).map(|c| 1000 * (r as i64 + 1) + c).collect())
            .collect();
        let out = match simulate_interleaved(&plan, &input, 1) {
            Ok(out) => out,
            // The DSL's single-operation demos (collective "test") may wait for packets or
            // signals nobody sends: on a GPU they would hang too.
            Err(e @ SimError::Deadlock(_)) if plan.collective == "test" => {
                println!("{name}: {e}");
                blocked += 1;
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        if let Some(ok) = collective_ok(&plan, &input, &out) {
            println!("{name}: {} {}", plan.collective, if ok { "correct" } else { "DIFFERS" });
            correct += usize::from(ok);
            differs.extend((!ok).then_some(name));
        }
    }
    println!(
        "{} plans: {loaded} loaded and ran, {switch} refused for switch channels, {over} past MSCCL++'s limits, \
         {blocked} single-op demos that block, {correct} collectives checked correct",
        files.len()
    );
    assert_eq!(loaded + switch + over, files.len());
    assert!(differs.is_empty(), "wrong results: {differs:?}");
}

/// Whether `out` is what an AllReduce, AllGather, AllToAll or (out of place) ReduceScatter must
/// produce; `None` for other programs.
fn collective_ok(plan: &Plan, input: &[Vec<i64>], out: &mscclpp_executor::sim::Buffers) -> Option<bool> {
    let n = plan.gpus.len();
    let ok = plan.gpus.iter().enumerate().all(|(r, g)| {
        let result = if plan.inplace && g.output_chunks == g.input_chunks { &out.input[r] } else { &out.output[r] };
        match plan.collective.as_str() {
            "allreduce" => (0..g.input_chunks as usize).all(|c| result[c] == (0..n).map(|q| input[q][c]).sum::<i64>()),
            "allgather" => *result == (0..n).flat_map(|q| input[q].iter().copied()).collect::<Vec<_>>(),
            "alltoall" => {
                let per = g.input_chunks as usize / n;
                (0..n).all(|q| (0..per).all(|c| result[q * per + c] == input[q][r * per + c]))
            }
            "reducescatter" if !plan.inplace => {
                let per = g.output_chunks as usize;
                (0..per).all(|c| out.output[r][c] == (0..n).map(|q| input[q][r * per + c]).sum::<i64>())
            }
            _ => true,
        }
    });
    let checked = matches!(plan.collective.as_str(), "allreduce" | "allgather" | "alltoall")
        || (plan.collective == "reducescatter" && !plan.inplace);
    checked.then_some(ok)
}
