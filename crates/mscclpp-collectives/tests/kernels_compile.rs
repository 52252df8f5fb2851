//! The collective kernels compile with NVRTC and assemble with ptxas for sm_90, with no GPU
//! (CI installs NVRTC and ptxas from pip wheels; elsewhere the test says SKIPPED).

/// The ptxas log line naming the entry whose report holds line `i` of `lines`.
fn entry_at<'a>(lines: &[&'a str], i: usize) -> &'a str {
    lines[..i].iter().rev().find(|l| l.contains("Compiling entry function")).copied().unwrap_or("?")
}

fn skip(test: &str, why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run in CI: {why}");
    println!("SKIPPED {test}: {why}");
}

#[test]
fn collective_kernels_compile_and_assemble_for_sm90() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    let test = "collective_kernels_compile_and_assemble_for_sm90";
    if let Err(e) = nvrtc_info() {
        return skip(test, e.message());
    }
    let opts = CompileOptions::default().arch("compute_90").name("collectives.cu");
    let t = std::time::Instant::now();
    let ptx = compile(&mscclpp_collectives::kernel_source(), &opts).unwrap_or_else(|e| panic!("{e}"));
    println!("NVRTC compiled {} collective kernels in {:?}", ptx.kernels().len(), t.elapsed());
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    assert_eq!(ptx.kernels().len(), 34, "{:?}", ptx.kernels());
    for k in ["allreduce_allpair_bf16", "allreduce_simple_f32", "reducescatter_packet_u32", "allgather_simple_any"] {
        assert!(ptx.kernels().iter().any(|n| n == k), "no kernel {k}");
    }
    // The orderings the protocol relies on are in the PTX.
    for insn in [
        "red.release.sys.global.add.u64",
        "ld.acquire.sys",
        "st.volatile.global.v4.u32",
        "%globaltimer",
        "cvt.rn.bf16.f32",
    ] {
        assert!(ptx.as_str().contains(insn), "no {insn} in the PTX");
    }
    // Every entry waits for its predecessor before anything else (programmatic dependent
    // launches, `pdl_enter`): an entry without it would race the kernel before it.
    for insn in ["griddepcontrol.wait", "griddepcontrol.launch_dependents"] {
        assert_eq!(ptx.as_str().matches(insn).count(), ptx.kernels().len(), "{insn} once per entry");
    }
    for entry in ptx.as_str().split(".entry ").skip(1) {
        let name = entry.split('(').next().unwrap_or("?");
        let wait = entry.find("griddepcontrol.wait").unwrap_or(usize::MAX);
        // Released only after its own wait: a rank then has at most two kernels on the GPU.
        let release = entry.find("griddepcontrol.launch_dependents").unwrap_or(0);
        assert!(release > wait, "{name}: launch_dependents before griddepcontrol.wait");
        for access in ["ld.global", "st.global", "ld.volatile", "st.volatile", "atom.", "red.", "ld.acquire", "call"] {
            if let Some(at) = entry.find(access) {
                assert!(at > wait, "{name}: {access} before griddepcontrol.wait");
            }
        }
    }
    let Some(log) = assemble_sm90(test, ptx.as_str()) else {
        return;
    };
    // No kernel spills more than a few words (spills cost every loop that touches them).
    let lines: Vec<&str> = log.lines().collect();
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.contains("spill")) {
        let fun = entry_at(&lines, i);
        let stores: u32 = line
            .split(',')
            .find(|f| f.contains("spill stores"))
            .and_then(|f| f.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX);
        assert!(stores <= 64, "{fun}: {line}");
    }
    // The staged kernels keep two 512-thread blocks per SM, so at most 64 registers a thread
    // (65 536 per SM): with more, the residency the selector sizes grids by halves. Equal rounds,
    // tried in session 23, took `allreduce_simple_bf16` to 92 and an H100's 256 MiB AllReduce
    // from 763 to 905 us.
    let mut staged = 0;
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.contains("Used ") && l.contains(" registers")) {
        let fun = entry_at(&lines, i);
        if !fun.contains("_simple_") {
            continue;
        }
        staged += 1;
        let regs: u32 = line
            .split("Used ")
            .nth(1)
            .and_then(|f| f.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX);
        assert!(regs <= 64, "{fun}: {line}");
    }
    assert_eq!(staged, 12, "register counts of the staged kernels not found in the ptxas log:\n{log}");
    // The kernels keep their arguments in the parameter space (`__grid_constant__`): a
    // local copy of the 700-byte block (indexed by peer) would show as a stack frame, and cost
    // a trip to memory before the first packet leaves.
    for (i, line) in lines.iter().enumerate().filter(|(_, l)| l.contains("stack frame")) {
        let fun = entry_at(&lines, i);
        let frame: u32 = line
            .split(':')
            .next_back()
            .and_then(|f| f.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(u32::MAX);
        // A few words of spill are allowed above; the argument block is 688 bytes.
        assert!(frame < 256, "{fun}: {line}");
    }
}

/// Assembles `ptx` for sm_90 (`mscclpp::device::compile::assemble`) and returns ptxas's report;
/// None (after saying SKIPPED) where no ptxas is found.
fn assemble_sm90(test: &str, ptx: &str) -> Option<String> {
    if mscclpp::device::compile::ptxas_path().is_none() {
        skip(test, "no ptxas (MSCCLPP_PTXAS)");
        return None;
    }
    Some(mscclpp::device::compile::assemble(ptx, "sm_90").unwrap_or_else(|e| panic!("{e}")))
}

/// The two-level kernels compile with NVRTC (no warnings) and assemble for sm_90.
#[test]
fn two_level_kernels_compile_and_assemble_for_sm90() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    let test = "two_level_kernels_compile_and_assemble_for_sm90";
    if let Err(e) = nvrtc_info() {
        return skip(test, e.message());
    }
    let opts = CompileOptions::default().arch("compute_90").name("hier.cu");
    let ptx = compile(&mscclpp_collectives::hier::kernel_source(), &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    let mut names = ptx.kernels().to_vec();
    names.sort();
    assert_eq!(
        names,
        [
            "hier_allgather_any",
            "hier_allreduce_bf16",
            "hier_allreduce_f16",
            "hier_allreduce_f32",
            "hier_allreduce_i32",
            "hier_allreduce_u32"
        ]
    );
    for insn in ["red.release.sys.global.add.u64", "ld.acquire.sys", "st.global.release.sys.v2.u64", "%globaltimer"] {
        assert!(ptx.as_str().contains(insn), "no {insn} in the PTX");
    }
    if let Some(log) = assemble_sm90(test, ptx.as_str()) {
        println!("{}", log.lines().filter(|l| l.contains("registers")).collect::<Vec<_>>().join("\n"));
    }
}

/// The point-to-point kernel compiles with NVRTC (no warnings), keeps its 2.7 KB argument block
/// in the parameter space, and assembles for sm_90.
#[test]
fn p2p_kernel_compiles_and_assembles_for_sm90() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    let test = "p2p_kernel_compiles_and_assembles_for_sm90";
    if let Err(e) = nvrtc_info() {
        return skip(test, e.message());
    }
    let opts = CompileOptions::default().arch("compute_90").name("p2p.cu");
    let ptx = compile(&mscclpp_collectives::p2p::source(), &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    assert_eq!(ptx.kernels(), ["p2p_group"]);
    for insn in ["st.release.sys.global.u64", "ld.acquire.sys", "ld.global.cv", "%globaltimer"] {
        assert!(ptx.as_str().contains(insn), "no {insn} in the PTX");
    }
    if let Some(log) = assemble_sm90(test, ptx.as_str()) {
        println!("{log}");
        for line in log.lines().filter(|l| l.contains("stack frame")) {
            let frame: u32 = line
                .split(':')
                .next_back()
                .and_then(|f| f.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(u32::MAX);
            assert!(frame < 256, "{line}");
        }
    }
}
