//! `--plan FILE --dry-run`: load and validate an MSCCL++ execution plan and print its summary.

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
    Ok(())
}
