//! The CPU interpreter: generated plans compute their collectives at every size, and
//! MSCCL++'s own plans (from a fetched repository; skipped when absent) compute theirs.

use mscclpp_executor::generate::{self, Algorithm};
use mscclpp_executor::sim::{Buffers, SimError, simulate, simulate_interleaved, simulate_launches};
use mscclpp_executor::{Plan, Protocol};

/// Rank r's input chunk c: distinct everywhere.
fn inputs(plan: &Plan) -> Vec<Vec<i64>> {
    plan.gpus
        .iter()
        .enumerate()
        .map(|(r, g)| (0..g.input_chunks as i64).map(|c| 1000 * (r as i64 + 1) + c).collect())
        .collect()
}

/// Checks `out` against what `plan.collective` must produce from `input`.
fn check(plan: &Plan, input: &[Vec<i64>], out: &Buffers) -> Result<(), String> {
    let n = plan.gpus.len();
    for (r, gpu) in plan.gpus.iter().enumerate() {
        let result = if plan.inplace && gpu.output_chunks == gpu.input_chunks { &out.input[r] } else { &out.output[r] };
        let want: Vec<i64> = match plan.collective.as_str() {
            "allreduce" => (0..gpu.input_chunks as usize).map(|c| (0..n).map(|q| input[q][c]).sum()).collect(),
            "allgather" => (0..n).flat_map(|q| input[q].iter().copied()).collect(),
            "reducescatter" => {
                let per = gpu.output_chunks as usize;
                (0..per).map(|c| (0..n).map(|q| input[q][r * per + c]).sum()).collect()
            }
            other => return Err(format!("no reference for {other}")),
        };
        let got = if plan.collective == "reducescatter" && plan.inplace {
            let per = gpu.output_chunks as usize;
            out.input[r][r * per..(r + 1) * per].to_vec()
        } else {
            result.clone()
        };
        if got != want {
            return Err(format!("{}: rank {r}: got {got:?}, want {want:?}", plan.name));
        }
    }
    Ok(())
}

#[test]
fn generated_plans_compute_their_collectives() {
    let mut n = 0;
    for ranks in 2..=8 {
        for plan in generate::all(ranks) {
            // In-place AllGather: the input is output chunk `rank`, seeded through the input.
            let input = inputs(&plan);
            let out = simulate(&plan, &input).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            check(&plan, &input, &out).unwrap();
            // Other interleavings give the same result: no races the ordering hides.
            for seed in 0..8 {
                let out = simulate_interleaved(&plan, &input, seed)
                    .unwrap_or_else(|e| panic!("{} seed {seed}: {e}", plan.name));
                check(&plan, &input, &out).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            }
            n += 1;
        }
    }
    // As in plans.rs: the one-hop plan is LL only.
    assert_eq!(n, 4 * 4 * 7 + 2 * 7 + 4 * 3);
}

/// The inputs of `launches` back-to-back launches: distinct in every launch.
fn launch_inputs(plan: &Plan, launches: usize) -> Vec<Vec<Vec<i64>>> {
    (0..launches as i64)
        .map(|l| inputs(plan).into_iter().map(|v| v.into_iter().map(|x| x + 100_000 * l).collect()).collect())
        .collect()
}

/// Launches of a plan back to back, ranks running ahead of each other into the next launch:
/// every launch of every generated plan computes its own inputs' collective (no buffer of one
/// launch is overwritten by the next while still in use), in many interleavings.
#[test]
fn back_to_back_launches_of_generated_plans_do_not_race() {
    for ranks in [2, 3, 4, 6, 8] {
        for plan in generate::all(ranks) {
            let ins = launch_inputs(&plan, 3);
            for seed in 0..24 {
                let outs =
                    simulate_launches(&plan, &ins, seed).unwrap_or_else(|e| panic!("{} seed {seed}: {e}", plan.name));
                for (l, out) in outs.iter().enumerate() {
                    check(&plan, &ins[l], out).unwrap_or_else(|e| panic!("launch {l} seed {seed}: {e}"));
                }
            }
        }
    }
}

/// The race the two scratch halves close in the two-node Simple plan (a rank's cross-node put
/// of the next launch lands in the other node's scratch before that node reduced it): with one
/// scratch buffer some interleaving computes a wrong result, with two none does.
#[test]
fn the_two_node_plan_needs_two_scratch_halves() {
    let good = generate::plan(Algorithm::HierarchicalAllReduce, 4, Protocol::Simple, false).unwrap();
    let mut bad = good.clone();
    bad.use_double_scratch_buffer = false;
    let ins = launch_inputs(&good, 3);
    let wrong = |plan: &Plan, seed: u64| {
        let outs = simulate_launches(plan, &ins, seed).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        outs.iter().enumerate().any(|(l, out)| check(plan, &ins[l], out).is_err())
    };
    let seeds = 0..400u64;
    let first_bad = seeds.clone().find(|&s| wrong(&bad, s));
    assert!(first_bad.is_some(), "no interleaving of 400 showed the race with one scratch buffer");
    assert!(!seeds.clone().any(|s| wrong(&good, s)), "a race with two scratch halves");
}

#[test]
fn a_broken_schedule_is_caught() {
    // Drop rank 1's signals in a ring: its successor waits forever.
    let mut plan = generate::plan(Algorithm::RingAllReduce, 3, Protocol::Simple, true).unwrap();
    plan.gpus[1].threadblocks[0].ops.retain(|o| o.kind != mscclpp_executor::OpKind::Signal);
    let e = simulate(&plan, &inputs(&plan)).unwrap_err();
    assert!(matches!(&e, SimError::Deadlock(m) if m.contains("gpus[2].threadblocks[0] at wait")), "{e}");

    // Point a put at the wrong chunk: the result is wrong.
    let mut plan = generate::plan(Algorithm::AllGather, 4, Protocol::Simple, false).unwrap();
    let put = plan.gpus[2].threadblocks[1].ops.iter_mut().find(|o| o.kind == mscclpp_executor::OpKind::Put).unwrap();
    put.dst_buff[0].index = 3;
    let input = inputs(&plan);
    let out = simulate(&plan, &input).unwrap();
    assert!(check(&plan, &input, &out).is_err());

    // Drop the barrier before rank 1's reduction: it may read scratch slots whose puts (waited
    // for by the other blocks) have not landed; some interleaving shows it.
    let mut plan = generate::plan(Algorithm::AllPairAllReduce, 4, Protocol::Simple, true).unwrap();
    let ops = &mut plan.gpus[1].threadblocks[0].ops;
    let first_barrier = ops.iter().position(|o| o.kind == mscclpp_executor::OpKind::Barrier).unwrap();
    ops.remove(first_barrier);
    for tb in &mut plan.gpus[1].threadblocks[1..] {
        tb.ops.retain(|o| o.barrier_id != Some(0));
    }
    let input = inputs(&plan);
    let wrong = (0..64).filter(|&seed| {
        simulate_interleaved(&plan, &input, seed).map_or(true, |out| check(&plan, &input, &out).is_err())
    });
    assert!(wrong.count() > 0, "no interleaving exposed the missing barrier");

    // Buffers too large to model one value per chunk are refused, not allocated.
    let mut plan = generate::plan(Algorithm::AllGather, 2, Protocol::Simple, true).unwrap();
    plan.gpus[0].scratch_chunks = u64::MAX;
    assert!(matches!(simulate(&plan, &[]), Err(SimError::TooLarge(_))));

    // A hand-built invalid plan is refused, not a panic.
    let mut plan = generate::plan(Algorithm::AllGather, 2, Protocol::LL, true).unwrap();
    plan.gpus[0].remote_buffers.clear();
    assert!(matches!(simulate(&plan, &[]), Err(SimError::Invalid(_))));
}

#[test]
fn mscclpp_plans_compute_their_collectives() {
    let repo = std::env::var("MSCCLPP_REPO").unwrap_or_else(|_| "/work/.mirror/microsoft+mscclpp/repo".into());
    if !std::path::Path::new(&repo).exists() {
        println!("SKIPPED: no MSCCL++ repository (set MSCCLPP_REPO)");
        return;
    }
    let mut ran = 0;
    for path in [
        "test/execution-files/allreduce.json",
        "test/execution-files/allreduce_packet.json",
        "test/executor-tests/execution-plans/reduce.json",
        "test/executor-tests/execution-plans/reduce_pack.json",
        "test/executor-tests/execution-plans/reduce_pack_tbg.json",
        "test/executor-tests/execution-plans/reduce_tbg.json",
        "test/executor-tests/execution-plans/transfer_pack.json",
        "test/executor-tests/execution-plans/transfer_pack_tbg.json",
    ] {
        let text = std::fs::read_to_string(std::path::Path::new(&repo).join(path)).ok().or_else(|| {
            let out = std::process::Command::new("git")
                .args(["--git-dir", &repo, "show", &format!("HEAD:{path}")])
                .output()
                .ok()?;
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        });
        let Some(text) = text else {
            println!("SKIPPED {path}");
            continue;
        };
        let plan = Plan::from_json_str(&text).unwrap();
        let input = inputs(&plan);
        let out = simulate(&plan, &input).unwrap_or_else(|e| panic!("{path}: {e}"));
        check(&plan, &input, &out).unwrap_or_else(|e| panic!("{path}: {e}"));
        for seed in 0..16 {
            let out = simulate_interleaved(&plan, &input, seed).unwrap_or_else(|e| panic!("{path} seed {seed}: {e}"));
            check(&plan, &input, &out).unwrap_or_else(|e| panic!("{path} seed {seed}: {e}"));
        }
        println!("{path}: computes {}", plan.collective);
        ran += 1;
    }
    println!("{ran} MSCCL++ plans checked");
}
