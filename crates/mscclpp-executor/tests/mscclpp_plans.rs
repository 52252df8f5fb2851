//! MSCCL++'s own checked-in plans load unchanged (read from a fetched MSCCL++ repository; none
//! is copied here). Set `MSCCLPP_REPO` to a checkout or a bare git directory; by default the
//! mirror at `/work/.mirror/microsoft+mscclpp/repo`. Skipped (prints SKIPPED) when absent.

use std::path::{Path, PathBuf};
use std::process::Command;

use mscclpp_executor::{Plan, PlanError};

const PLANS: &[&str] = &[
    "test/execution-files/allreduce.json",
    "test/execution-files/allreduce_packet.json",
    "test/execution-files/allreduce_pipeline.json",
    "test/executor-tests/execution-plans/reduce.json",
    "test/executor-tests/execution-plans/reduce_nvls.json",
    "test/executor-tests/execution-plans/reduce_nvls_pipeline.json",
    "test/executor-tests/execution-plans/reduce_pack.json",
    "test/executor-tests/execution-plans/reduce_pack_tbg.json",
    "test/executor-tests/execution-plans/reduce_tbg.json",
    "test/executor-tests/execution-plans/transfer_pack.json",
    "test/executor-tests/execution-plans/transfer_pack_tbg.json",
];

fn repo() -> Option<PathBuf> {
    let p =
        PathBuf::from(std::env::var("MSCCLPP_REPO").unwrap_or_else(|_| "/work/.mirror/microsoft+mscclpp/repo".into()));
    p.exists().then_some(p)
}

/// The file's text from a work tree, or from a bare git directory's HEAD.
fn read(repo: &Path, path: &str) -> Option<String> {
    if let Ok(s) = std::fs::read_to_string(repo.join(path)) {
        return Some(s);
    }
    let out = Command::new("git").arg("--git-dir").arg(repo).args(["show", &format!("HEAD:{path}")]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn mscclpp_checked_in_plans_load_unchanged() {
    let Some(repo) = repo() else {
        println!("SKIPPED: no MSCCL++ repository (set MSCCLPP_REPO)");
        return;
    };
    let mut seen = 0;
    for path in PLANS {
        let Some(text) = read(&repo, path) else {
            println!("SKIPPED {path}: not in {}", repo.display());
            continue;
        };
        seen += 1;
        let res = Plan::from_json_str(&text);
        println!(
            "{path}: {}",
            match &res {
                Ok(p) => p.summary().to_string().replace('\n', "; "),
                Err(e) => e.to_string(),
            }
        );
        // Plans with switch (NVLS) channels are refused for that reason only; the rest load.
        let uses_switch = text.contains("\"switch\"");
        match res {
            Ok(plan) => {
                assert!(!uses_switch, "{path} uses switch channels but loaded");
                let again = Plan::from_json_str(&plan.to_json()).unwrap();
                assert_eq!(again, plan, "{path} does not round-trip");
            }
            Err(PlanError::SwitchChannel { path: at }) => {
                assert!(uses_switch, "{path}: switch error at {at} without switch channels");
                assert!(at.starts_with("gpus[0]"), "{path}: {at}");
            }
            Err(e) => panic!("{path}: {e}"),
        }
    }
    if seen == 0 {
        println!("SKIPPED: none of MSCCL++'s plans found in {}", repo.display());
    }
}

/// MSCCL++'s plans that load also lower for every rank and compile as per-plan kernels (NVRTC,
/// no warning): their thread-block groups, no-ops and operation mixes are shapes the generated
/// plans do not have. Skipped without the repository or without NVRTC (outside CI).
#[test]
fn mscclpp_checked_in_plans_compile_as_per_plan_kernels() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    use mscclpp_executor::lower::lower_unbound;
    let Some(repo) = repo() else {
        println!("SKIPPED: no MSCCL++ repository (set MSCCLPP_REPO)");
        return;
    };
    if let Err(e) = nvrtc_info() {
        assert!(std::env::var_os("CI").is_none(), "no NVRTC in CI: {}", e.message());
        println!("SKIPPED: {}", e.message());
        return;
    }
    let opts = CompileOptions::default().arch("compute_90").name("executor_plan.cu");
    let mut compiled = 0;
    for path in PLANS {
        let Some(Ok(plan)) = read(&repo, path).map(|t| Plan::from_json_str(&t)) else { continue };
        let mut sources = std::collections::BTreeSet::new();
        for rank in 0..plan.gpus.len() {
            // 16 KiB chunks: whole 16-byte units, as MSCCL++'s alignment asks.
            let low = lower_unbound(&plan, rank, 16 * 1024).unwrap_or_else(|e| panic!("{path} rank {rank}: {e}"));
            sources.insert(mscclpp_executor::plan_kernel::source(&low.ops, &low.blocks));
        }
        for src in &sources {
            let ptx = compile(src, &opts).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(ptx.log().trim().is_empty(), "{path}: NVRTC warned:\n{}", ptx.log());
            compiled += 1;
        }
        println!("{path}: {} per-plan kernel(s) compiled", sources.len());
    }
    println!("{compiled} per-plan kernels of MSCCL++'s plans compiled");
}
