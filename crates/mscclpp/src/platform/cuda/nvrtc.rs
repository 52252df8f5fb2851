//! NVRTC (CUDA's run-time compiler), loaded at run time with `libloading` so neither the build nor
//! a program that never compiles kernels needs it. Where it is looked for, in order:
//! 1. `MSCCLPP_NVRTC_PATH`: a `libnvrtc.so*` file, or a directory holding one;
//! 2. `$CUDA_PATH/lib64`, `$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`;
//! 3. the `nvidia-cuda-nvrtc` pip wheel (`nvidia/cu13/lib`, `nvidia/cuda_nvrtc/lib`) under
//!    `$VIRTUAL_ENV`, `$PYTHONPATH`, `~/.local` and the system's Python package directories;
//! 4. the system loader (`libnvrtc.so`, `.13`, `.12`).
//!
//! The NVRTC symbols used are the stable C API (`nvrtcCreateProgram` etc., unchanged since CUDA 9).
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::{Error, ErrorKind, Result};

type Program = *mut c_void;
type Status = c_int;

struct Api {
    _lib: libloading::Library,
    /// `libnvrtc-builtins` from the same folder, loaded first (see [`builtins_beside`]).
    _builtins: Option<libloading::Library>,
    path: String,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Program) -> Status,
}

/// Directories and files to try, in order (see the module documentation).
pub(crate) fn candidates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("MSCCLPP_NVRTC_PATH") {
        dirs.push(PathBuf::from(p));
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(p) = std::env::var_os(var) {
            dirs.push(PathBuf::from(p).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut sites: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("PYTHONPATH") {
        sites.extend(std::env::split_paths(&p));
    }
    let mut lib_roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        lib_roots.push(PathBuf::from(v).join("lib"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        lib_roots.push(PathBuf::from(h).join(".local/lib"));
    }
    lib_roots.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    for root in lib_roots {
        let Ok(rd) = std::fs::read_dir(&root) else { continue };
        let mut pys: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("python3")))
            .collect();
        pys.sort();
        for py in pys.into_iter().rev() {
            sites.push(py.join("site-packages"));
            sites.push(py.join("dist-packages"));
        }
    }
    sites.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    for s in sites {
        dirs.push(s.join("nvidia/cu13/lib"));
        dirs.push(s.join("nvidia/cuda_nvrtc/lib"));
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| seen.insert(d.clone()));
    dirs
}

/// The `libnvrtc.so*` file in `dir` (or `dir` itself when it is such a file).
fn lib_in(dir: &Path) -> Option<PathBuf> {
    if dir.is_file() {
        return Some(dir.to_path_buf());
    }
    let mut libs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc.so") && !n.contains("builtins"))
        })
        .collect();
    // Prefer the plain name, then the shortest versioned one (the soname).
    libs.sort_by_key(|p| p.as_os_str().len());
    libs.into_iter().next()
}

/// NVRTC opens `libnvrtc-builtins.so.<major.minor>` by name when it compiles; from a folder
/// that is not on the loader's path (a pip wheel's, for NVRTC 13.0) it fails with "failed to
/// open libnvrtc-builtins". Loaded here first, by its full path, the library is already in the
/// process under that name and NVRTC's own open finds it.
fn builtins_beside(lib: &Path) -> Option<libloading::Library> {
    let dir = lib.parent()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so") && !n.contains(".alt."))
        })
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    // SAFETY: loading NVRTC's builtins library runs its initializers, which have no
    // preconditions; nothing is called through it here.
    found.into_iter().find_map(|p| unsafe { libloading::Library::new(&p) }.ok())
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    let mut found = None;
    let mut builtins = None;
    for dir in candidates() {
        if let Some(lib) = lib_in(&dir) {
            builtins = builtins_beside(&lib);
            // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
            match unsafe { libloading::Library::new(&lib) } {
                Ok(l) => {
                    found = Some((l, lib.display().to_string()));
                    break;
                }
                Err(e) => tried.push(format!("{} ({e})", lib.display())),
            }
        } else {
            tried.push(dir.display().to_string());
        }
    }
    if found.is_none() {
        for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
            // SAFETY: as above.
            if let Ok(l) = unsafe { libloading::Library::new(name) } {
                found = Some((l, name.to_string()));
                break;
            }
            tried.push(format!("{name} (system loader)"));
        }
    }
    let Some((lib, path)) = found else {
        return Err(format!(
            "NVRTC not found (looked in {}); set MSCCLPP_NVRTC_PATH to libnvrtc.so or its directory, or `pip install \
             nvidia-cuda-nvrtc`",
            tried.join(", ")
        ));
    };
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol is NVRTC's documented C function with the declared signature.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| format!("{path}: {}: {e}", $name))?
        };
    }
    Ok(Api {
        version: sym!("nvrtcVersion"),
        error_string: sym!("nvrtcGetErrorString"),
        create: sym!("nvrtcCreateProgram"),
        compile: sym!("nvrtcCompileProgram"),
        ptx_size: sym!("nvrtcGetPTXSize"),
        ptx: sym!("nvrtcGetPTX"),
        log_size: sym!("nvrtcGetProgramLogSize"),
        log: sym!("nvrtcGetProgramLog"),
        destroy: sym!("nvrtcDestroyProgram"),
        path,
        _lib: lib,
        _builtins: builtins,
    })
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|m| Error::new(ErrorKind::NotAvailable, m.clone()))
}

/// Where NVRTC was loaded from and its version (major, minor).
pub(crate) fn info() -> Result<(String, (i32, i32))> {
    let a = api()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out pointers.
    let s = unsafe { (a.version)(&mut major, &mut minor) };
    check(a, "nvrtcVersion", s)?;
    Ok((a.path.clone(), (major, minor)))
}

fn check(a: &Api, call: &str, s: Status) -> Result<()> {
    if s == 0 {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static C string for any status.
    let text = unsafe { CStr::from_ptr((a.error_string)(s)) }.to_string_lossy().into_owned();
    Err(Error::new(ErrorKind::Cuda, format!("{call} failed: {text} ({s})")))
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid_usage(format!("{what} contains a NUL byte")))
}

/// Destroys the program on every path out of `compile`.
struct ProgramGuard<'a>(&'a Api, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        let _ = unsafe { (self.0.destroy)(&mut self.1) };
    }
}

/// Compiles `src` (named `name` in messages) with `headers` (`(include name, text)`) and
/// `options`; returns the PTX and the compile log. A failed compilation is an `InvalidUsage`
/// error carrying the log.
pub(crate) fn compile(name: &str, src: &str, headers: &[(&str, &str)], options: &[String]) -> Result<(String, String)> {
    let a = api()?;
    let c_src = cstring("the kernel source", src)?;
    let c_name = cstring("the program name", name)?;
    let c_hdr_text: Vec<CString> = headers.iter().map(|(_, t)| cstring("a header", t)).collect::<Result<_>>()?;
    let c_hdr_name: Vec<CString> = headers.iter().map(|(n, _)| cstring("a header name", n)).collect::<Result<_>>()?;
    let c_opts: Vec<CString> = options.iter().map(|o| cstring("a compile option", o)).collect::<Result<_>>()?;
    let hdr_text: Vec<*const c_char> = c_hdr_text.iter().map(|c| c.as_ptr()).collect();
    let hdr_name: Vec<*const c_char> = c_hdr_name.iter().map(|c| c.as_ptr()).collect();
    let opts: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: Program = std::ptr::null_mut();
    // SAFETY: every pointer is a NUL-terminated string alive for the call; the arrays hold
    // `headers.len()` entries each; NVRTC copies what it keeps.
    let s = unsafe {
        (a.create)(
            &mut prog,
            c_src.as_ptr(),
            c_name.as_ptr(),
            headers.len() as c_int,
            hdr_text.as_ptr(),
            hdr_name.as_ptr(),
        )
    };
    check(a, "nvrtcCreateProgram", s)?;
    let guard = ProgramGuard(a, prog);
    // SAFETY: a live program; `opts` holds options.len() valid C strings for the call.
    let status = unsafe { (a.compile)(guard.1, opts.len() as c_int, opts.as_ptr()) };
    let log = read(a, guard.1, a.log_size, a.log, "nvrtcGetProgramLog")?;
    if status != 0 {
        let e = check(a, "nvrtcCompileProgram", status).err().unwrap_or_else(|| Error::internal("nvrtc status"));
        return Err(Error::invalid_usage(format!("compiling {name} with NVRTC ({}): {}\n{log}", a.path, e.message())));
    }
    let ptx = read(a, guard.1, a.ptx_size, a.ptx, "nvrtcGetPTX")?;
    Ok((ptx, log))
}

type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type ReadFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;

/// Reads a program's PTX or log (a size call, then a copy into a buffer of that size).
fn read(a: &Api, prog: Program, size: SizeFn, get: ReadFn, call: &str) -> Result<String> {
    let mut n = 0usize;
    // SAFETY: a live program and a valid out pointer.
    check(a, call, unsafe { size(prog, &mut n) })?;
    let mut buf = vec![0u8; n.max(1)];
    // SAFETY: buf holds the n bytes (including the NUL) NVRTC writes.
    check(a, call, unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    buf.truncate(end);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
