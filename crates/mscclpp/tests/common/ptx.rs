//! Compiling without a GPU: NVRTC and `ptxas` found (or the test skipped, except in CI), and PTX
//! assembled for sm_90.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether this runs in CI, where every tool the tests need is installed: a skip fails there.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// Says that `test` skipped and why (in CI: fails it instead).
pub fn skip(test: &str, why: &str) {
    assert!(!in_ci(), "{test} cannot run in CI: {why}");
    println!("SKIPPED {test}: {why}");
}

/// The path NVRTC was loaded from, after printing its version; `None`, after [`skip`], without it.
pub fn nvrtc_or_skip(test: &str) -> Option<String> {
    match mscclpp::device::compile::nvrtc_info() {
        Ok((path, version)) => {
            println!("NVRTC {}.{} from {path}", version.0, version.1);
            Some(path)
        }
        Err(e) => {
            skip(test, e.message());
            None
        }
    }
}

/// `ptxas` to assemble with: `MSCCLPP_PTXAS`, next to NVRTC (`../bin/ptxas`, as in the pip
/// wheels and the toolkit), `$CUDA_PATH/bin`, `/usr/local/cuda/bin`, else `PATH`.
pub fn ptxas(nvrtc_path: &str) -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("MSCCLPP_PTXAS") {
        c.push(PathBuf::from(p));
    }
    if let Some(dir) = Path::new(nvrtc_path).parent() {
        c.push(dir.join("../bin/ptxas"));
    }
    if let Some(p) = std::env::var_os("CUDA_PATH") {
        c.push(PathBuf::from(p).join("bin/ptxas"));
    }
    c.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    if let Some(found) = c.into_iter().find(|p| p.is_file()) {
        return Some(found);
    }
    Command::new("ptxas").arg("--version").output().ok().filter(|o| o.status.success()).map(|_| PathBuf::from("ptxas"))
}

/// Assembles each `(name, ptx)` for sm_90 with `ptxas` in a scratch directory (`tag` in its
/// name), asserting that each succeeds and writes a cubin; the directory goes afterwards.
pub fn assemble_sm90(ptxas: &Path, tag: &str, ptx: &[(&str, &str)]) {
    let dir = std::env::temp_dir().join(format!("mscclpp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in ptx {
        let (src, out) = (dir.join(format!("{name}.ptx")), dir.join(format!("{name}.cubin")));
        std::fs::write(&src, text).unwrap();
        let r = Command::new(ptxas).args(["-arch=sm_90", "-o"]).arg(&out).arg(&src).output().unwrap();
        assert!(r.status.success(), "{} failed on {name}:\n{}", ptxas.display(), String::from_utf8_lossy(&r.stderr));
        assert!(std::fs::metadata(&out).unwrap().len() > 0, "{name}: empty cubin");
    }
    println!("assembled {} for sm_90 with {}", ptx.iter().map(|p| p.0).collect::<Vec<_>>().join(", "), ptxas.display());
    std::fs::remove_dir_all(&dir).unwrap();
}
