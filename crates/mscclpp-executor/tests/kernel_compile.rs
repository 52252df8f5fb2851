//! The interpreter kernel compiles with NVRTC (no warnings; its generated structs' layouts are
//! checked there by static_asserts against Rust's offsets) and assembles with ptxas for sm_90,
//! with no GPU (elsewhere than CI, without NVRTC the test says SKIPPED).

use std::path::PathBuf;
use std::process::Command;

fn skip(test: &str, why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run in CI: {why}");
    println!("SKIPPED {test}: {why}");
}

fn ptxas(nvrtc_path: &str) -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("MSCCLPP_PTXAS") {
        c.push(PathBuf::from(p));
    }
    if let Some(dir) = std::path::Path::new(nvrtc_path).parent() {
        c.push(dir.join("../bin/ptxas"));
    }
    c.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    c.into_iter().find(|p| p.is_file())
}

#[test]
fn executor_kernel_compiles_and_assembles_for_sm90() {
    use mscclpp::device::compile::{CompileOptions, compile, nvrtc_info};
    let test = "executor_kernel_compiles_and_assembles_for_sm90";
    let (path, _) = match nvrtc_info() {
        Ok(i) => i,
        Err(e) => return skip(test, e.message()),
    };
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
    let Some(ptxas) = ptxas(&path) else {
        return skip(test, "no ptxas (MSCCLPP_PTXAS)");
    };
    let dir = std::env::temp_dir().join(format!("mscclpp-exec-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, out) = (dir.join("exec.ptx"), dir.join("exec.cubin"));
    std::fs::write(&src, ptx.as_str()).unwrap();
    let r = Command::new(&ptxas).args(["-arch=sm_90", "-v", "-o"]).arg(&out).arg(&src).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let log = String::from_utf8_lossy(&r.stderr).into_owned();
    assert!(r.status.success(), "ptxas failed:\n{log}");
    println!(
        "{}",
        log.lines().filter(|l| l.contains("registers") || l.contains("spill")).collect::<Vec<_>>().join("\n")
    );
}
