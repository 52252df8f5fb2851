//! `--plan FILE --dry-run`: load and validate an MSCCL++ execution plan and print its summary
//! and its buffer sizes at the sweep's largest message (`-e`).

use mscclpp_executor::Plan;

use crate::{Args, TestKind, coll};

/// Loads `--plan`, checks that it is for the test's collective and prints its summary. Errors
/// name the JSON path of the offending field.
pub fn dry_run(args: &Args) -> Result<(), String> {
    if coll::collective(args.test).is_none() {
        return Err(format!(
            "--plan and --dry-run apply to the collective tests (allreduce, allgather, reducescatter), not {}",
            args.test.name()
        ));
    }
    let Some(path) = &args.plan else {
        return Err("--dry-run needs --plan FILE".into());
    };
    if !args.dry_run {
        return Err(format!(
            "{}: running execution plans is not implemented yet; --dry-run loads and validates the plan",
            path.display()
        ));
    }
    let plan = Plan::from_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let want = match args.test {
        TestKind::Allgather => "allgather",
        TestKind::Reducescatter => "reducescatter",
        _ => "allreduce",
    };
    if !plan.collective.eq_ignore_ascii_case(want) {
        return Err(format!("{}: the plan is for {:?}, not {want} (collective)", path.display(), plan.collective));
    }
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
