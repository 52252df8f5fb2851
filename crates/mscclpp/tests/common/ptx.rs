//! Compiling without a GPU: NVRTC and `ptxas` found (or the test skipped, except in CI), and PTX
//! assembled for sm_90.

use std::path::{Path, PathBuf};

/// Whether this runs in CI, where every tool the tests need is installed: a skip fails there.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// Says that `test` skipped and why (in CI: fails it instead).
pub fn skip(test: &str, why: &str) {
    assert!(!in_ci(), "{test} cannot run in CI: {why}");
    println!("SKIPPED {test}: {why}");
}

/// Whether NVRTC is there (its path and version printed); false, after [`skip`], without it.
pub fn nvrtc_or_skip(test: &str) -> bool {
    match mscclpp::device::compile::nvrtc_info() {
        Ok((path, version)) => {
            println!("NVRTC {}.{} from {path}", version.0, version.1);
            true
        }
        Err(e) => {
            skip(test, e.message());
            false
        }
    }
}

/// `ptxas` to assemble with ([`mscclpp::device::compile::ptxas_path`]).
pub fn ptxas() -> Option<PathBuf> {
    mscclpp::device::compile::ptxas_path()
}

/// `test`'s check of a test file's kernels without a GPU: `source` compiles with NVRTC to
/// compute_90 without a warning, has every kernel of `kernels`, and assembles for sm_90 (skipped
/// without NVRTC or ptxas, except in CI; `tag` names the set in messages).
pub fn kernels_compile(test: &str, tag: &str, source: &str, kernels: &[&str]) {
    use mscclpp::device::compile::{CompileOptions, compile};
    if !nvrtc_or_skip(test) {
        return;
    }
    let ptx = compile(source, &CompileOptions::default().arch("compute_90")).unwrap_or_else(|x| panic!("{x}"));
    assert!(ptx.log().trim().is_empty(), "NVRTC warned:\n{}", ptx.log());
    for k in kernels {
        assert!(ptx.kernels().iter().any(|n| n == k), "{k} missing from {:?}", ptx.kernels());
    }
    match ptxas() {
        Some(ptxas) => assemble_sm90(&ptxas, tag, &[(tag, ptx.as_str())]),
        None => skip(&format!("{test} (ptxas)"), "no ptxas found"),
    }
}

/// Assembles each `(name, ptx)` for sm_90 ([`mscclpp::device::compile::assemble`]), asserting
/// that each succeeds and writes a cubin. `ptxas` is the one [`ptxas`] found; `tag` names the
/// set in the message.
pub fn assemble_sm90(ptxas: &Path, tag: &str, ptx: &[(&str, &str)]) {
    for (name, text) in ptx {
        if let Err(e) = mscclpp::device::compile::assemble(text, "sm_90") {
            panic!("{tag}: {name}: {e}");
        }
    }
    println!("assembled {} for sm_90 with {}", ptx.iter().map(|p| p.0).collect::<Vec<_>>().join(", "), ptxas.display());
}
