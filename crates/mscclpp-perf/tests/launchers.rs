//! `mscclpp-perf` under Open MPI's `mpirun` with 4 ranks (the README's command line). Where
//! `mpirun` is missing the test says so and passes, except in CI (`MSCCLPP_TEST_LAUNCHERS=1`).

use std::process::Command;

#[test]
fn mpirun_runs_mscclpp_perf_with_four_ranks() {
    if !Command::new("mpirun").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let ci = std::env::var("MSCCLPP_TEST_LAUNCHERS").is_ok_and(|v| v == "1");
        assert!(!ci, "mpirun is not installed (MSCCLPP_TEST_LAUNCHERS=1 asks for it)");
        eprintln!("SKIPPED: mpirun (Open MPI, Debian openmpi-bin) is not installed");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut c = Command::new("mpirun");
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")));
    if root {
        c.arg("--allow-run-as-root");
    }
    let out = c
        .args(["--oversubscribe", "-np", "4", "-x", "MASTER_ADDR=localhost", "-x", &format!("MASTER_PORT={port}")])
        .arg(env!("CARGO_BIN_EXE_mscclpp-perf"))
        .args(["--max-bytes", "4K", "--iters", "10", "--warmup", "2", "--rounds", "1", "--timeout", "60"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let text = format!("{}\n--- stdout\n{stdout}\n--- stderr\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    // The last size's row (labelled "4 KiB" or, nccl-tests style, "4096").
    assert!(stdout.contains("4 ranks") && (stdout.contains("4 KiB") || stdout.contains("4096")), "{text}");
    println!("{text}");
}
