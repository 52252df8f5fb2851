//! Compiling kernels at run time with NVRTC and launching them: for tests, benchmarks and users
//! without nvcc. No CUDA toolkit is needed to build; NVRTC is loaded when first used (where it is
//! looked for: `MSCCLPP_NVRTC_PATH`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`, the
//! `nvidia-cuda-nvrtc` pip wheel, then the system loader).
//!
//! ```no_run
//! use mscclpp::device::compile::{CompileOptions, KernelModule, compile};
//! let ptx = compile(
//!     r#"#include "mscclpp_rs/device.cuh"
//!        extern "C" __global__ void ping(mscclpp::PortChannelDeviceHandle ch) { ch.putWithSignal(0, 8); }"#,
//!     &CompileOptions::for_device(0),
//! )?;
//! let module = KernelModule::load(0, &ptx)?;
//! let ping = module.function("ping")?;
//! # Ok::<(), mscclpp::Error>(())
//! ```
//! Kernels are found by their PTX entry names, so declare them `extern "C"`.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::header::{DEVICE_HEADER, HEADER_NAME};
use crate::error::{Error, ErrorKind, Result};
use crate::platform::cuda::module::{self, Module};
use crate::platform::cuda::nvrtc;

pub use crate::platform::cuda::module::Kernel;

/// The architecture used when neither [`CompileOptions::arch`] nor a device says otherwise.
pub const DEFAULT_ARCH: &str = "compute_90";

/// How to compile.
///
/// Start from [`Default`] or [`for_device`](Self::for_device) and change what you need, with the
/// setters or the fields (the struct is `#[non_exhaustive]`: later versions may add options
/// without breaking your code).
///
/// ```
/// use mscclpp::device::compile::CompileOptions;
/// let o = CompileOptions::default().arch("compute_80").flag("-lineinfo").name("mine.cu");
/// assert_eq!(o.resolved_arch(), "compute_80");
/// assert_eq!((o.flags.as_slice(), o.name.as_deref()), (&["-lineinfo".to_string()][..], Some("mine.cu")));
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct CompileOptions {
    /// Virtual architecture (`compute_90`); `None`: the compute capability of
    /// [`device`](Self::device) if set and present, else [`DEFAULT_ARCH`].
    pub arch: Option<String>,
    /// The GPU the code is for (only used to choose the architecture).
    pub device: Option<u32>,
    /// Further NVRTC options (`-DNAME=1`, `-lineinfo`, ...). `-std=c++17` is passed first.
    pub flags: Vec<String>,
    /// The program's name in messages (default `kernel.cu`).
    pub name: Option<String>,
}

impl CompileOptions {
    /// Options for GPU `device`'s architecture.
    pub fn for_device(device: u32) -> CompileOptions {
        CompileOptions { device: Some(device), ..CompileOptions::default() }
    }

    /// Sets [`arch`](Self::arch) (`compute_90`).
    pub fn arch(mut self, arch: impl Into<String>) -> Self {
        self.arch = Some(arch.into());
        self
    }

    /// Sets [`device`](Self::device).
    pub fn device(mut self, device: u32) -> Self {
        self.device = Some(device);
        self
    }

    /// Appends one NVRTC option to [`flags`](Self::flags).
    pub fn flag(mut self, flag: impl Into<String>) -> Self {
        self.flags.push(flag.into());
        self
    }

    /// Sets [`name`](Self::name).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The architecture these options select.
    pub fn resolved_arch(&self) -> String {
        if let Some(a) = &self.arch {
            return a.clone();
        }
        match self.device.map(module::compute_capability) {
            Some(Ok((major, minor))) => format!("compute_{major}{minor}"),
            _ => DEFAULT_ARCH.to_string(),
        }
    }
}

/// PTX compiled by [`compile`], with its kernels' names.
#[derive(Clone, Debug)]
pub struct Ptx {
    text: String,
    kernels: Vec<String>,
    log: String,
    arch: String,
}

impl Ptx {
    /// The PTX text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
    /// The names of the kernels (`.entry` directives) in it.
    pub fn kernels(&self) -> &[String] {
        &self.kernels
    }
    /// NVRTC's log (warnings), possibly empty.
    pub fn log(&self) -> &str {
        &self.log
    }
    /// The architecture it was compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }
}

/// The names of the `.entry` directives of `ptx`.
fn entries(ptx: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in ptx.lines() {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == ".entry" {
                if let Some(name) = words.next() {
                    let name = name.split('(').next().unwrap_or(name);
                    out.push(name.to_string());
                }
                break;
            }
        }
    }
    out
}

/// Compiles CUDA source to PTX with NVRTC. `#include "mscclpp_rs/device.cuh"` works without an
/// include path: the header is handed to NVRTC.
///
/// # Errors
/// `NotAvailable` ("NVRTC not found (looked in ...)") without NVRTC; `InvalidUsage` with NVRTC's
/// log when the source does not compile.
pub fn compile(src: &str, opts: &CompileOptions) -> Result<Ptx> {
    let arch = opts.resolved_arch();
    let mut flags = vec!["-std=c++17".to_string(), format!("--gpu-architecture={arch}")];
    flags.extend(opts.flags.iter().cloned());
    let name = opts.name.as_deref().unwrap_or("kernel.cu");
    let (text, log) = nvrtc::compile(name, src, &[(HEADER_NAME, DEVICE_HEADER)], &flags)?;
    Ok(Ptx { kernels: entries(&text), text, log, arch })
}

/// Where NVRTC was found and its version `(major, minor)`.
///
/// # Errors
/// `NotAvailable` when it is not found.
pub fn nvrtc_info() -> Result<(String, (i32, i32))> {
    nvrtc::info()
}

/// `ptxas`, to see what NVRTC's PTX assembles to (registers, stack, spills) without a GPU:
/// `MSCCLPP_PTXAS`, next to the NVRTC in use (`../bin/ptxas`, as in the pip wheels and the
/// toolkit), `$CUDA_PATH/bin`, `/usr/local/cuda/bin`, else `ptxas` on `PATH`; `None` without one.
pub fn ptxas_path() -> Option<PathBuf> {
    let mut c: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("MSCCLPP_PTXAS") {
        c.push(PathBuf::from(p));
    }
    if let Some(dir) = nvrtc_info().ok().and_then(|(p, _)| Path::new(&p).parent().map(Path::to_path_buf)) {
        c.push(dir.join("../bin/ptxas"));
    }
    if let Some(p) = std::env::var_os("CUDA_PATH") {
        c.push(PathBuf::from(p).join("bin/ptxas"));
    }
    c.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    if let Some(found) = c.into_iter().find(|p| p.is_file()) {
        return Some(found);
    }
    let on_path = Command::new("ptxas").arg("--version").output().is_ok_and(|o| o.status.success());
    on_path.then(|| PathBuf::from("ptxas"))
}

/// Assembles `ptx` for `sm` (`"sm_90"`) with `ptxas -v` (found by [`ptxas_path`]) in a scratch
/// folder and returns ptxas's report: per entry, its registers, stack frame and spills.
///
/// # Errors
/// `NotAvailable` without ptxas; `InvalidUsage` with ptxas's messages when it refuses the PTX or
/// writes no code; `Io` for the scratch files.
pub fn assemble(ptx: &str, sm: &str) -> Result<String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let ptxas = ptxas_path().ok_or_else(|| {
        Error::new(ErrorKind::NotAvailable, "no ptxas found (MSCCLPP_PTXAS, next to NVRTC, $CUDA_PATH, PATH)")
    })?;
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("mscclpp-ptxas-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let (src, out) = (dir.join("k.ptx"), dir.join("k.cubin"));
    let run = || -> Result<String> {
        std::fs::write(&src, ptx).map_err(|e| Error::io(format!("writing {}", src.display()), e))?;
        let r = Command::new(&ptxas)
            .args([format!("-arch={sm}").as_str(), "-v", "-o"])
            .arg(&out)
            .arg(&src)
            .output()
            .map_err(|e| Error::io(format!("running {}", ptxas.display()), e))?;
        let report = String::from_utf8_lossy(&r.stderr).into_owned();
        let wrote = std::fs::metadata(&out).is_ok_and(|m| m.len() > 0);
        if !r.status.success() || !wrote {
            return Err(Error::invalid_usage(format!("{} for {sm} failed:\n{report}", ptxas.display())));
        }
        Ok(report)
    };
    let res = run();
    // Best effort: a leftover scratch folder is harmless.
    let _ = std::fs::remove_dir_all(&dir);
    res
}

/// A PTX module loaded on one GPU, every kernel resolved at load (nothing loads lazily later).
#[derive(Debug, Clone)]
pub struct KernelModule {
    module: Arc<Module>,
}

impl KernelModule {
    /// Loads `ptx` on GPU `device`.
    ///
    /// # Errors
    /// `NotAvailable` without a CUDA driver; `InvalidUsage` for a missing GPU; `Cuda` when the
    /// driver refuses the PTX (for example, an architecture newer than the GPU).
    pub fn load(device: u32, ptx: &Ptx) -> Result<KernelModule> {
        Ok(KernelModule { module: Module::load(device, &ptx.text, &ptx.kernels)? })
    }

    /// The GPU it is loaded on.
    pub fn device(&self) -> u32 {
        self.module.device()
    }

    /// The kernel `name` (its PTX entry name: declare kernels `extern "C"`).
    ///
    /// # Errors
    /// `InvalidUsage` naming the kernels there are when there is no such kernel.
    pub fn function(&self, name: &str) -> Result<Kernel> {
        self.module
            .function(name)
            .ok_or_else(|| Error::invalid_usage(format!("no kernel named {name:?} in {:?}", self.module)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_found_in_ptx() {
        let ptx = ".visible .entry fifo_api(\n\t.param .u64 a\n)\n{\n}\n.entry other( .param .u32 b)\n.func helper(\n";
        assert_eq!(entries(ptx), vec!["fifo_api".to_string(), "other".to_string()]);
    }

    #[test]
    fn an_explicit_arch_wins() {
        let o = CompileOptions { arch: Some("compute_80".into()), device: Some(0), ..Default::default() };
        assert_eq!(o.resolved_arch(), "compute_80");
        assert_eq!(CompileOptions::default().resolved_arch(), DEFAULT_ARCH);
    }
}
