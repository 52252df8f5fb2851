//! The interpreter kernel compiles with NVRTC (no warnings; its generated structs' sizes are
//! checked there by static_asserts against Rust's) and assembles with ptxas for sm_90,
//! with no GPU (elsewhere than CI, without NVRTC the test says SKIPPED).

fn skip(test: &str, why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run in CI: {why}");
    println!("SKIPPED {test}: {why}");
}

#[test]
fn executor_kernel_compiles_and_assembles_for_sm90() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    let test = "executor_kernel_compiles_and_assembles_for_sm90";
    if let Err(e) = nvrtc_info() {
        return skip(test, e.message());
    }
    let opts = CompileOptions::default().arch("compute_90").name("executor.cu");
    let t = std::time::Instant::now();
    let ptx = compile(&mscclpp_executor::device::source(), &opts).unwrap_or_else(|e| panic!("{e}"));
    println!("NVRTC compiled the executor kernel in {:?}", t.elapsed());
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    let mut names = ptx.kernels().to_vec();
    names.sort();
    assert_eq!(names, ["mscclpp_exec_ll16", "mscclpp_exec_ll8"]);
    for insn in [
        "red.release.sys.global.add.u64",
        "ld.acquire.sys",
        "st.volatile.global.v4.u32",
        "st.volatile.global.v2.u32",
        "st.global.release.sys.v2.u64",
        "%globaltimer",
    ] {
        assert!(ptx.as_str().contains(insn), "no {insn} in the PTX");
    }
    if mscclpp::device::compile::ptxas_path().is_none() {
        return skip(test, "no ptxas (MSCCLPP_PTXAS)");
    }
    let log = mscclpp::device::compile::assemble(ptx.as_str(), "sm_90").unwrap_or_else(|e| panic!("{e}"));
    println!(
        "{}",
        log.lines().filter(|l| l.contains("registers") || l.contains("spill")).collect::<Vec<_>>().join("\n")
    );
}

/// The per-plan kernels of every generated plan shape compile with NVRTC without a warning and
/// assemble for sm_90 without spilling: each rank of each generated plan for 2 and 4 ranks (the
/// shapes repeat beyond), the one-hop splits, and MSCCL++-style plans with pipelines. Sources
/// that are equal compile once.
#[test]
fn per_plan_kernels_compile_for_every_generated_plan() {
    use mscclpp::device::compile::{CompileOptions, assemble, compile, nvrtc_info, ptxas_path};
    use mscclpp_executor::generate;
    use mscclpp_executor::lower::lower_unbound;
    // The default budget, whatever MSCCLPP_EXECUTOR_HELD_BUFFERS says in this environment.
    use mscclpp_executor::plan_kernel::{HELD_BUFFERS, source_held as source};
    let test = "per_plan_kernels_compile_for_every_generated_plan";
    if let Err(e) = nvrtc_info() {
        return skip(test, e.message());
    }
    let mut plans: Vec<mscclpp_executor::Plan> = Vec::new();
    for ranks in [2, 4] {
        plans.extend(generate::all(ranks));
    }
    plans.extend(generate::one_hop_allreduce(2, false, 1, 128));
    let mut sources = std::collections::BTreeMap::new();
    for plan in &plans {
        for rank in 0..plan.gpus.len() {
            let low = lower_unbound(plan, rank, 4096).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
            let src = source(&low.ops, &low.blocks, HELD_BUFFERS);
            sources.entry(src).or_insert_with(|| format!("{} rank {rank}", plan.name));
        }
    }
    // A pipeline (no generated plan has one): its body loops with a barrier after each operation.
    {
        use mscclpp_executor::OpKind;
        use mscclpp_executor::device::{DevOp, op_code};
        let op = |k: OpKind, ctype: u32, n_chan: u32, n_src: u32, n_dst: u32| DevOp {
            kind: op_code(k),
            ctype,
            n_chan,
            n_src,
            n_dst,
            ..DevOp::default()
        };
        let ops = vec![
            DevOp { n_body: 3, n_iter: 4, unit_size: 1024, ..op(OpKind::Pipeline, 0, 0, 0, 0) },
            op(OpKind::Put, 1, 1, 1, 1),
            op(OpKind::Signal, 1, 1, 0, 0),
            op(OpKind::Reduce, 0, 0, 3, 1),
            op(OpKind::Wait, 1, 1, 0, 0),
            op(OpKind::PutWithSignalAndFlush, 2, 1, 1, 1),
        ];
        let src = source(&ops, &[0, ops.len() as u32, 0, 2], HELD_BUFFERS);
        sources.entry(src).or_insert_with(|| "a pipeline block and a block of its first operations".into());
        // A block that starts with a pipeline whose body holds more than the budget (such a
        // pipeline held whole spilled: 68-424 bytes for 3-6 reductions of 5 buffers).
        let mut big = vec![DevOp { n_body: 6, n_iter: 4, unit_size: 1024, ..op(OpKind::Pipeline, 0, 0, 0, 0) }];
        big.extend((0..6).map(|_| op(OpKind::Reduce, 0, 0, 3, 2)));
        big.push(op(OpKind::Signal, 1, 1, 0, 0));
        let src = source(&big, &[0, big.len() as u32], HELD_BUFFERS);
        sources.entry(src).or_insert_with(|| "a block starting with a pipeline over the held budget".into());
    }
    // The one-hop plan with no operation held (`MSCCLPP_EXECUTOR_HELD_BUFFERS=0`: FixedOps only).
    if let Some(plan) = generate::one_hop_allreduce(2, false, 4, 256) {
        let low = lower_unbound(&plan, 0, 4096).unwrap_or_else(|e| panic!("{}: {e}", plan.name));
        let src = source(&low.ops, &low.blocks, 0);
        sources.entry(src).or_insert_with(|| format!("{} rank 0, no operation held", plan.name));
    }
    println!("{} plans, {} distinct per-plan kernels", plans.len(), sources.len());
    let opts = CompileOptions::default().arch("compute_90").name("executor_plan.cu");
    for (src, what) in &sources {
        let t = std::time::Instant::now();
        let ptx = compile(src, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(ptx.log().trim().is_empty(), "{what}: NVRTC warned:\n{}", ptx.log());
        let mut names = ptx.kernels().to_vec();
        names.sort();
        assert_eq!(names, ["mscclpp_exec_plan_ll16", "mscclpp_exec_plan_ll8"], "{what}");
        let compiled = t.elapsed();
        if ptxas_path().is_none() {
            println!("{what}: NVRTC {compiled:?}");
            continue;
        }
        let log = assemble(ptx.as_str(), "sm_90").unwrap_or_else(|e| panic!("{what}: {e}"));
        let regs: Vec<&str> = log.lines().filter(|l| l.contains("registers") || l.contains("spill")).collect();
        println!("{what}: NVRTC {compiled:?}; {}", regs.join(" | "));
        assert!(
            log.lines().filter(|l| l.contains("spill stores")).all(|l| l.contains(" 0 bytes spill stores")),
            "{what}: the per-plan kernel spills:\n{log}"
        );
    }
}
