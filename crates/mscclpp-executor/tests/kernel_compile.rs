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
