//! `mscclpp-perf <collective> --plan FILE --dry-run`: loads and validates an MSCCL++ execution
//! plan and prints its summary, with no GPU; an invalid plan fails with the JSON path.

use std::process::Command;

use mscclpp_executor::Protocol;
use mscclpp_executor::generate::{self, Algorithm};

fn perf() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mscclpp-perf"))
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mscclpp-perf-plan-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn run(args: &[&str], plan: &std::path::Path) -> (bool, String, String) {
    let out = perf().args(args).arg("--plan").arg(plan).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn dry_run_prints_the_summary_of_generated_plans() {
    for (test, algo, proto) in [
        ("allreduce", Algorithm::HierarchicalAllReduce, Protocol::Simple),
        ("allreduce", Algorithm::RingAllReduce, Protocol::LL),
        ("allgather", Algorithm::AllGather, Protocol::LL),
        ("reducescatter", Algorithm::ReduceScatter, Protocol::Simple),
    ] {
        let plan = generate::plan(algo, 4, proto, false).unwrap();
        let path = tmp(&format!("{}.json", plan.name));
        std::fs::write(&path, plan.to_json()).unwrap();
        let (ok, stdout, stderr) = run(&[test, "--dry-run"], &path);
        assert!(ok, "{test} {}: {stdout}\n{stderr}", plan.name);
        assert!(stdout.contains("valid execution plan") && stdout.contains("ranks: 4"), "{stdout}");
        assert!(stdout.contains(&format!("plan: {} ({test}", plan.name)), "{stdout}");
        let tbs = plan.gpus.iter().map(|g| g.threadblocks.len().to_string()).collect::<Vec<_>>().join(" ");
        assert!(stdout.contains(&format!("thread blocks per rank: {tbs}")), "{stdout}");
        if (test, proto) == ("allreduce", Protocol::LL) {
            // The ring at 1 MiB: 4 chunks of 256 KiB, 8 scratch chunks, twice for packets, twice
            // again for the double scratch buffer the generated LL plans use.
            let (ok, stdout, _) = run(&[test, "--dry-run", "-e", "1M"], &path);
            assert!(ok && stdout.contains("scratch per rank 8388608 8388608 8388608 8388608 B"), "{stdout}");
        }
        if algo == Algorithm::HierarchicalAllReduce {
            assert!(stdout.contains("port 4") && stdout.contains("pwsf 4"), "{stdout}");
        }
    }
}

#[test]
fn invalid_plans_fail_with_the_json_path() {
    let plan = generate::plan(Algorithm::AllPairAllReduce, 3, Protocol::Simple, true).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    v["gpus"][2]["threadblocks"][1]["ops"][0]["src_buff"][0]["index"] = 7.into();
    let bad = tmp("bad.json");
    std::fs::write(&bad, v.to_string()).unwrap();
    let (ok, stdout, stderr) = run(&["allreduce", "--dry-run"], &bad);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("gpus[2].threadblocks[1].ops[0].src_buff[0].index"), "{stderr}");

    std::fs::write(&bad, "{\"name\": ").unwrap();
    let (ok, _, stderr) = run(&["allgather", "--dry-run"], &bad);
    assert!(!ok && stderr.contains("not JSON"), "{stderr}");

    let (ok, _, stderr) = run(&["allreduce", "--dry-run"], &tmp("missing.json"));
    assert!(!ok && stderr.contains("cannot read plan"), "{stderr}");

    // A valid plan for another collective is refused; so is running a plan (no --dry-run) with
    // another world size, another reduction or an --algo, and --plan with a test that is not
    // a collective — all before any GPU is touched.
    let good = tmp("good.json");
    std::fs::write(&good, plan.to_json()).unwrap();
    let (ok, _, stderr) = run(&["allgather", "--dry-run"], &good);
    assert!(!ok && stderr.contains("not allgather"), "{stderr}");
    let (ok, _, stderr) = run(&["allreduce", "--ranks", "2"], &good);
    assert!(!ok && stderr.contains("the plan is for 3 ranks, not --ranks 2"), "{stderr}");
    let (ok, _, stderr) = run(&["allreduce", "--ranks", "3", "-o", "max"], &good);
    assert!(!ok && stderr.contains("own reduction"), "{stderr}");
    let (ok, _, stderr) = run(&["allreduce", "--ranks", "3", "--algo", "packet"], &good);
    assert!(!ok && stderr.contains("--algo"), "{stderr}");
    let (ok, _, stderr) = run(&["p2p", "--dry-run"], &good);
    assert!(!ok && stderr.contains("collective tests"), "{stderr}");
    let (ok, _, stderr) = run(&["p2p"], &good);
    assert!(!ok && stderr.contains("collective tests"), "{stderr}");
}
