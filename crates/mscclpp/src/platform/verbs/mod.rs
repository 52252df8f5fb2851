//! libibverbs, loaded at run time with `libloading` from `MSCCLPP_IBV_SO`, `libibverbs.so.1` or
//! `libibverbs.so`, so the crate builds with `cargo` alone (as NCCL does). A missing library or
//! symbol is a `NotAvailable` error listing what was tried, never a panic. `post_send`,
//! `post_recv` and `poll_cq` are `static inline` in `verbs.h`; they are called through the
//! context's ops table ([`abi::ibv_context_ops`]), with no symbol lookup on the data path.
#![allow(unsafe_code)]

pub(crate) mod abi;
pub(crate) mod dev;
#[cfg(feature = "ib-fake")]
pub(crate) mod fake;
pub(crate) mod result;

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use abi::*;

use crate::error::{Error, ErrorKind, Result};

type FnGetDeviceList = unsafe extern "C" fn(num: *mut c_int) -> *mut *mut ibv_device;
type FnFreeDeviceList = unsafe extern "C" fn(list: *mut *mut ibv_device);
type FnGetDeviceName = unsafe extern "C" fn(dev: *mut ibv_device) -> *const c_char;
type FnOpenDevice = unsafe extern "C" fn(dev: *mut ibv_device) -> *mut ibv_context;
type FnCloseDevice = unsafe extern "C" fn(ctx: *mut ibv_context) -> c_int;
type FnQueryDevice = unsafe extern "C" fn(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int;
type FnQueryPort = unsafe extern "C" fn(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int;
type FnQueryGid = unsafe extern "C" fn(ctx: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
type FnAllocPd = unsafe extern "C" fn(ctx: *mut ibv_context) -> *mut ibv_pd;
type FnDeallocPd = unsafe extern "C" fn(pd: *mut ibv_pd) -> c_int;
type FnRegMr =
    unsafe extern "C" fn(pd: *mut ibv_pd, addr: *mut std::ffi::c_void, len: usize, access: c_int) -> *mut ibv_mr;
type FnRegDmabufMr =
    unsafe extern "C" fn(pd: *mut ibv_pd, offset: u64, len: usize, iova: u64, fd: c_int, access: c_int) -> *mut ibv_mr;
type FnDeregMr = unsafe extern "C" fn(mr: *mut ibv_mr) -> c_int;
type FnCreateCq = unsafe extern "C" fn(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut std::ffi::c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq;
type FnDestroyCq = unsafe extern "C" fn(cq: *mut ibv_cq) -> c_int;
type FnCreateCompChannel = unsafe extern "C" fn(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
type FnDestroyCompChannel = unsafe extern "C" fn(ch: *mut ibv_comp_channel) -> c_int;
type FnGetCqEvent = unsafe extern "C" fn(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut std::ffi::c_void,
) -> c_int;
type FnAckCqEvents = unsafe extern "C" fn(cq: *mut ibv_cq, n: std::ffi::c_uint);
type FnCreateQp = unsafe extern "C" fn(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
type FnModifyQp = unsafe extern "C" fn(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int;
type FnDestroyQp = unsafe extern "C" fn(qp: *mut ibv_qp) -> c_int;
type FnWcStatusStr = unsafe extern "C" fn(status: std::ffi::c_uint) -> *const c_char;

/// How a provider reports a GID's type (`"RoCE v2"`, `"IB/RoCE v1"`): `(device, port, index)`.
pub(crate) type GidTypeFn = fn(&str, u8, u32) -> Option<String>;

/// The loaded library and its symbols (or the in-process test provider's look-alikes).
pub(crate) struct Verbs {
    pub(crate) path: String,
    pub(crate) get_device_list: FnGetDeviceList,
    pub(crate) free_device_list: FnFreeDeviceList,
    pub(crate) get_device_name: FnGetDeviceName,
    pub(crate) open_device: FnOpenDevice,
    pub(crate) close_device: FnCloseDevice,
    pub(crate) query_device: FnQueryDevice,
    pub(crate) query_port: FnQueryPort,
    pub(crate) query_gid: FnQueryGid,
    pub(crate) alloc_pd: FnAllocPd,
    pub(crate) dealloc_pd: FnDeallocPd,
    pub(crate) reg_mr: FnRegMr,
    /// IBVERBS_1.12 and later only (GPU memory over RDMA).
    pub(crate) reg_dmabuf_mr: Option<FnRegDmabufMr>,
    pub(crate) dereg_mr: FnDeregMr,
    pub(crate) create_cq: FnCreateCq,
    pub(crate) destroy_cq: FnDestroyCq,
    pub(crate) create_comp_channel: FnCreateCompChannel,
    pub(crate) destroy_comp_channel: FnDestroyCompChannel,
    pub(crate) get_cq_event: FnGetCqEvent,
    pub(crate) ack_cq_events: FnAckCqEvents,
    pub(crate) create_qp: FnCreateQp,
    pub(crate) modify_qp: FnModifyQp,
    pub(crate) destroy_qp: FnDestroyQp,
    pub(crate) wc_status_str: FnWcStatusStr,
    /// GID types: sysfs for the real library, a table for the test provider.
    pub(crate) gid_type: GidTypeFn,
    /// Whether this is the in-process test provider.
    #[cfg_attr(not(feature = "ib-fake"), allow(dead_code))]
    pub(crate) fake: bool,
    pub(crate) _lib: Option<libloading::Library>,
}

/// A GID's type from sysfs (`/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<i>`).
fn sysfs_gid_type(dev: &str, port: u8, index: u32) -> Option<String> {
    let p = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// The library names tried, in order.
fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(e) = crate::env::env()
        && let Some(p) = &e.ibv_so
    {
        v.push(p.display().to_string());
    }
    v.push("libibverbs.so.1".into());
    v.push("libibverbs.so".into());
    v
}

/// Loads the first of `names` that opens and has every required symbol.
pub(crate) fn load(names: &[String]) -> Result<Verbs> {
    let mut why = Vec::new();
    for name in names {
        // SAFETY: loading libibverbs runs its constructors, which only register providers.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(l) => l,
            Err(e) => {
                why.push(format!("{name}: {e}"));
                continue;
            }
        };
        match symbols(lib, name) {
            Ok(v) => return Ok(v),
            Err(e) => why.push(format!("{name}: {e}")),
        }
    }
    Err(Error::not_available(format!(
        "no IB transport: libibverbs could not be loaded (set MSCCLPP_IBV_SO or install rdma-core); tried {}",
        why.join("; ")
    )))
}

fn symbols(lib: libloading::Library, name: &str) -> std::result::Result<Verbs, String> {
    macro_rules! sym {
        ($s:literal) => {
            // SAFETY: the symbol's type is the one declared in verbs.h for this name (see the
            // type aliases above); the copied function pointer lives as long as `_lib`, which the
            // returned Verbs owns.
            unsafe { lib.get::<_>(concat!($s, "\0").as_bytes()).map(|s| *s).map_err(|e| format!("{}: {e}", $s))? }
        };
    }
    macro_rules! opt_sym {
        ($s:literal) => {
            // SAFETY: as for `sym!`.
            unsafe { lib.get::<_>(concat!($s, "\0").as_bytes()).map(|s| *s).ok() }
        };
    }
    Ok(Verbs {
        path: name.to_string(),
        get_device_list: sym!("ibv_get_device_list"),
        free_device_list: sym!("ibv_free_device_list"),
        get_device_name: sym!("ibv_get_device_name"),
        open_device: sym!("ibv_open_device"),
        close_device: sym!("ibv_close_device"),
        query_device: sym!("ibv_query_device"),
        query_port: sym!("ibv_query_port"),
        query_gid: sym!("ibv_query_gid"),
        alloc_pd: sym!("ibv_alloc_pd"),
        dealloc_pd: sym!("ibv_dealloc_pd"),
        reg_mr: sym!("ibv_reg_mr"),
        reg_dmabuf_mr: opt_sym!("ibv_reg_dmabuf_mr"),
        dereg_mr: sym!("ibv_dereg_mr"),
        create_cq: sym!("ibv_create_cq"),
        destroy_cq: sym!("ibv_destroy_cq"),
        create_comp_channel: sym!("ibv_create_comp_channel"),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
        get_cq_event: sym!("ibv_get_cq_event"),
        ack_cq_events: sym!("ibv_ack_cq_events"),
        create_qp: sym!("ibv_create_qp"),
        modify_qp: sym!("ibv_modify_qp"),
        destroy_qp: sym!("ibv_destroy_qp"),
        wc_status_str: sym!("ibv_wc_status_str"),
        gid_type: sysfs_gid_type,
        fake: false,
        _lib: Some(lib),
    })
}

type Loaded = std::result::Result<Verbs, (ErrorKind, String)>;
static VERBS: OnceLock<Loaded> = OnceLock::new();

/// libibverbs, loaded once per process (or the test provider, when it was installed first).
pub(crate) fn verbs() -> Result<&'static Verbs> {
    VERBS
        .get_or_init(|| load(&candidates()).map_err(|e| (e.kind(), e.message().to_string())))
        .as_ref()
        .map_err(|(k, m)| Error::new(*k, m.clone()))
}

/// Makes `v` the process's verbs provider; only possible before the first use of IB.
#[cfg(feature = "ib-fake")]
pub(crate) fn install(v: Verbs) -> Result<()> {
    let _ = VERBS.set(Ok(v));
    match VERBS.get() {
        Some(Ok(v)) if v.fake => Ok(()),
        _ => Err(Error::invalid_usage(
            "the IB test provider must be installed before the first use of IB in this process",
        )),
    }
}

/// The RDMA devices of this machine with their names, in enumeration order (freed on drop).
pub(crate) struct DeviceList {
    v: &'static Verbs,
    list: *mut *mut ibv_device,
    devs: Vec<(*mut ibv_device, String)>,
}

impl DeviceList {
    /// Lists the devices.
    ///
    /// # Errors
    /// `NotAvailable` when libibverbs cannot be loaded or the kernel has no RDMA support.
    pub(crate) fn get() -> Result<DeviceList> {
        Self::of(verbs()?)
    }

    /// Lists the devices of the library `v` (a test passes the in-process provider's table).
    pub(crate) fn of(v: &'static Verbs) -> Result<DeviceList> {
        let mut n: c_int = 0;
        // SAFETY: n is a valid out-pointer; the list is freed in Drop with ibv_free_device_list.
        let list = unsafe { (v.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::not_available(format!(
                "no IB transport: ibv_get_device_list found no RDMA devices ({}; libibverbs from {})",
                std::io::Error::last_os_error(),
                v.path
            )));
        }
        let mut me = DeviceList { v, list, devs: Vec::with_capacity(n.max(0) as usize) };
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds n valid device pointers (verbs.h contract).
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is a valid device; the name is a NUL-terminated string owned by it.
            let name = unsafe { (v.get_device_name)(dev) };
            if !name.is_null() {
                // SAFETY: non-null, NUL-terminated, valid while the list is.
                me.devs.push((dev, unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()));
            }
        }
        Ok(me)
    }

    /// The device names.
    pub(crate) fn names(&self) -> Vec<String> {
        self.devs.iter().map(|(_, n)| n.clone()).collect()
    }

    /// The device called `name` (valid while the list lives).
    pub(crate) fn find(&self, name: &str) -> Option<*mut ibv_device> {
        self.devs.iter().find(|(_, n)| n == name).map(|(d, _)| *d)
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: list came from ibv_get_device_list and is freed once; contexts opened from its
        // devices do not depend on it.
        unsafe { (self.v.free_device_list)(self.list) };
    }
}

/// The names of the RDMA devices this machine has (`mlx5_0`, `rxe0`, ...), in enumeration order.
///
/// # Errors
/// `NotAvailable` when libibverbs cannot be loaded or the kernel has no RDMA support.
pub fn devices() -> Result<Vec<String>> {
    Ok(DeviceList::get()?.names())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_clear_error() {
        let e = load(&["/nonexistent/libibverbs.so.1".to_string(), "libno-such-verbs.so".to_string()]).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::NotAvailable);
        let s = e.to_string();
        assert!(
            s.contains("no IB transport")
                && s.contains("/nonexistent/libibverbs.so.1")
                && s.contains("libno-such-verbs.so"),
            "{s}"
        );
    }

    #[test]
    fn system_library_loads_where_installed() {
        match verbs() {
            Ok(v) => println!("libibverbs loaded from {}", v.path),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::NotAvailable, "{e}");
                assert!(std::env::var("CI").is_err(), "CI installs libibverbs, so it must load there: {e}");
                return;
            }
        }
        // No RDMA device is a clear NotAvailable, never a panic.
        match devices() {
            Ok(d) => println!("RDMA devices: {d:?}"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::NotAvailable, "{e}");
                assert!(e.to_string().contains("no IB transport"), "{e}");
            }
        }
    }

    /// Every declared struct's size and field offsets against the system's rdma-core header,
    /// compiled by gcc. Without the header it says so, and fails only under CI (which installs it).
    #[test]
    fn abi_matches_the_system_header() {
        let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
        if !header.exists() {
            assert!(std::env::var("CI").is_err(), "CI must install libibverbs-dev for this test");
            println!(
                "SKIPPED abi_matches_the_system_header: {} is absent (apt install libibverbs-dev)",
                header.display()
            );
            return;
        }
        let rows = layout_table();
        let mut c =
            String::from("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void){\n");
        for (s, f, _) in &rows {
            let ty = if *s == "ibv_gid" { format!("union {s}") } else { format!("struct {s}") };
            let field = match (*s, *f) {
                ("ibv_send_wr", "qp_type_xrc_remote_srqn") => "qp_type".to_string(),
                ("ibv_send_wr", "bind_mw_or_tso") => "bind_mw".to_string(),
                _ => f.to_string(),
            };
            if *f == "sizeof" {
                c.push_str(&format!("printf(\"{s} sizeof %zu\\n\", sizeof({ty}));\n"));
            } else {
                c.push_str(&format!("printf(\"{s} {f} %zu\\n\", offsetof({ty}, {field}));\n"));
            }
        }
        c.push_str("return 0;}\n");
        let dir = std::env::temp_dir().join(format!("mscclpp-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("abi.c");
        let exe = dir.join("abi");
        std::fs::write(&src, c).unwrap();
        let out = match std::process::Command::new("gcc").arg("-std=gnu11").arg(&src).arg("-o").arg(&exe).output() {
            Ok(o) => o,
            Err(e) => {
                assert!(std::env::var("CI").is_err(), "CI must have gcc for this test: {e}");
                println!("SKIPPED abi_matches_the_system_header: no gcc ({e})");
                return;
            }
        };
        assert!(out.status.success(), "gcc failed: {}", String::from_utf8_lossy(&out.stderr));
        let run = std::process::Command::new(&exe).output().unwrap();
        let text = String::from_utf8(run.stdout).unwrap();
        let mut bad = Vec::new();
        for ((s, f, ours), line) in rows.iter().zip(text.lines()) {
            let theirs: usize = line.rsplit(' ').next().unwrap().parse().unwrap();
            // Structs the library fills may be larger here (room for newer rdma-core fields).
            let ok = if *s == "ibv_port_attr" && *f == "sizeof" { *ours >= theirs } else { *ours == theirs };
            if !ok {
                bad.push(format!("{s}.{f}: ours {ours}, verbs.h {theirs}"));
            }
        }
        assert_eq!(text.lines().count(), rows.len());
        assert!(bad.is_empty(), "ABI mismatches:\n{}", bad.join("\n"));
        println!("checked {} sizes and offsets against {}", rows.len(), header.display());
    }
}
