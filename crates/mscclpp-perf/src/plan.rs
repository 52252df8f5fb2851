//! `--plan FILE`: load and validate an MSCCL++ execution plan (for the collective tests, which
//! run it); with `--dry-run`, only print its summary and its buffer sizes at the sweep's largest
//! message (`-e`), with no GPU.

use mscclpp_executor::{ExecutionPlan, Plan};

use crate::{Args, TestKind, coll};

/// Loads and validates `--plan` and checks that it is for the test's collective. Errors name the
/// JSON path of the offending field.
pub fn load(args: &Args) -> Result<ExecutionPlan, String> {
    if coll::collective(args.test).is_none() {
        return Err(format!(
            "--plan and --dry-run apply to the collective tests (allreduce, allgather, reducescatter), not {}",
            args.test.name()
        ));
    }
    let Some(path) = &args.plan else {
        return Err("--dry-run needs --plan FILE".into());
    };
    let plan = Plan::from_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let want = match args.test {
        TestKind::Allgather => "allgather",
        TestKind::Reducescatter => "reducescatter",
        _ => "allreduce",
    };
    if !plan.collective.eq_ignore_ascii_case(want) {
        return Err(format!("{}: the plan is for {:?}, not {want} (collective)", path.display(), plan.collective));
    }
    Ok(ExecutionPlan::new(plan))
}

/// `--dry-run`: loads `--plan` (as [`load`]) and prints its summary.
pub fn dry_run(args: &Args) -> Result<(), String> {
    let loaded = load(args)?;
    let plan = loaded.plan();
    let path = args.plan.as_deref().unwrap_or(std::path::Path::new("-"));
    println!("# {}: valid execution plan (dry run: loaded and validated, not run)", path.display());
    println!("{}", plan.summary());
    // Buffer bytes at the largest size of the sweep (-e), sized as nccl-tests sizes them.
    let size = args.max_bytes;
    let ranks = plan.gpus.len() as u64;
    let (input, output) = match args.test {
        TestKind::Allgather => (size / ranks, size),
        TestKind::Reducescatter => (size, size / ranks),
        _ => (size, size),
    };
    let scratch: Vec<String> =
        (0..plan.gpus.len()).filter_map(|r| plan.scratch_bytes(r, input, output)).map(|b| b.to_string()).collect();
    println!("at -e {size} B: input {input} B, output {output} B, scratch per rank {} B", scratch.join(" "));
    if size < plan.min_message_size || size > plan.max_message_size {
        println!("# note: {size} B is outside the plan's message sizes");
    }
    Ok(())
}
