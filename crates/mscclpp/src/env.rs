//! The `MSCCLPP_*` environment variables, read once and parsed strictly.
//!
//! | variable | meaning |
//! |---|---|
//! | `MSCCLPP_HCA_DEVICES` | comma list; entry *k* names the RDMA device used for `IBk` |
//! | `MSCCLPP_IB_GID_INDEX` | GID index for IB/RoCE (default: automatic RoCE v2 choice) |
//! | `MSCCLPP_IBV_MODE` | `host` or `host-no-atomic` for endpoints whose IB mode is `Default` |
//! | `MSCCLPP_IBV_SO` | path of libibverbs to load |
//! | `MSCCLPP_SOCKET_IFNAME` | interface prefixes to use (`^` excludes, `=` asks an exact name) |
//! | `MSCCLPP_SOCKET_FAMILY` | `AF_INET` or `AF_INET6` |
//! | `MSCCLPP_HOSTID` | replaces hostname + boot id in the host identity |
//! | `MSCCLPP_ROOT_ADDR`, `MSCCLPP_ROOT_PORT` | the bootstrap root under a launcher, `[iface:]host:port` or a port with `MASTER_ADDR` (read by [`crate::launcher`]) |
//! | `MSCCLPP_LOG_LEVEL` | `NONE`, `ERROR`, `WARN`, `INFO`, `DEBUG`, `TRACE` (default `WARN`; NCCL's `VERSION` reads as `WARN`, `ABORT` as `ERROR`) |
//! | `MSCCLPP_LOG_SUBSYS` | comma list of `ENV,GPU,NET,CONN,IB,BOOTSTRAP,PROXY,ALL`; `^` inverts; MSCCL++/NCCL's `INIT` means `BOOTSTRAP`, `P2P` means `CONN`; other names (`EXEC`, `NCCL`, `GRAPH`, ...) are ignored with a warning |
//! | `MSCCLPP_LOG_FILE` | append log lines to this file instead of stderr; `%h`, `%p`, `%r` become host, pid, rank (`-` until the bootstrap sets it), `%%` a `%` |
//! | `MSCCLPP_DEBUG`, `MSCCLPP_DEBUG_SUBSYS` | deprecated MSCCL++ names of `MSCCLPP_LOG_LEVEL`, `MSCCLPP_LOG_SUBSYS` (read with a warning when the new name is unset) |
//! | `MSCCLPP_CUDAIPC_STREAM_PRIORITY` | `default` or `greatest`: the priority of the streams CUDA IPC connections (and so proxies) copy on; `greatest` was an experiment for programs whose streams share hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`): `mscclpp-perf device`'s hardware-queue probe found that it does not escape a shared queue (session 16, H100) |
//! | `MSCCLPP_CUDAIPC_KERNEL_COPY_MAX` | bytes: CUDA IPC copies of at most this size (and a token right after one) go through a one-block kernel, one driver call, instead of the copy engine; default 0 (off). Lower latency for small proxied puts, but the kernel needs a free SM: see [`EndpointConfig::cuda_ipc_kernel_copy_max`](crate::EndpointConfig::cuda_ipc_kernel_copy_max) |
//! | `MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US` | microseconds: with kernel copies on, the copy kernel stays this long on the GPU after each copy, polling pinned memory for the next, so a proxied copy needs no driver call; default 0 (off). See [`EndpointConfig::cuda_ipc_kernel_copy_linger`](crate::EndpointConfig::cuda_ipc_kernel_copy_linger) for its costs |
//! | `MSCCLPP_NVRTC_PATH` | `libnvrtc.so*` or its directory, for [`crate::device::compile`] (read when NVRTC first loads) |
//!
//! A value that does not parse is an error naming the variable, never a silent default.
//!
//! MSCCL++'s other variables ([`UNREAD_MSCCLPP_VARS`]: `MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM`,
//! `MSCCLPP_NPKIT_DUMP_DIR`, the NCCL fallback's, ...) are not read here; when any is set, the
//! first use of the environment logs one warning (target `mscclpp::env`) naming them and saying
//! they have no effect.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::transport::IbMode;

/// Address family forced by `MSCCLPP_SOCKET_FAMILY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SocketFamily {
    /// IPv4 only.
    Inet,
    /// IPv6 only.
    Inet6,
}

/// An interface filter in MSCCL++/NCCL syntax: `eth,ib` (prefixes), `^docker` (exclude
/// prefixes), `=eth0` (exact names).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IfnameFilter {
    /// Entries excluded rather than selected.
    pub exclude: bool,
    /// Names compared whole rather than as prefixes.
    pub exact: bool,
    /// The names or prefixes.
    pub names: Vec<String>,
}

impl IfnameFilter {
    /// Parses the syntax above.
    pub(crate) fn parse(s: &str) -> Result<IfnameFilter> {
        let mut rest = s.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names: Vec<String> = rest.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
        if names.is_empty() {
            return Err(Error::invalid_usage("empty interface list"));
        }
        Ok(IfnameFilter { exclude, exact, names })
    }

    /// Whether interface `name` passes the filter.
    pub(crate) fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| if self.exact { name == n } else { name.starts_with(n.as_str()) });
        hit != self.exclude
    }
}

/// Log verbosity from `MSCCLPP_LOG_LEVEL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum LogLevel {
    /// Nothing.
    None,
    /// Errors only.
    Error,
    /// Warnings and errors (the default).
    Warn,
    /// Informational messages.
    Info,
    /// Debug messages.
    Debug,
    /// Everything.
    Trace,
}

/// The parsed environment ([`env()`]; C++ MSCCL++: `Env`). `#[non_exhaustive]`: new variables
/// add fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Env {
    /// `MSCCLPP_HCA_DEVICES`.
    pub hca_devices: Option<Vec<String>>,
    /// `MSCCLPP_IB_GID_INDEX`.
    pub ib_gid_index: Option<u32>,
    /// `MSCCLPP_IBV_MODE`.
    pub ibv_mode: Option<IbMode>,
    /// `MSCCLPP_IBV_SO`.
    pub ibv_so: Option<PathBuf>,
    /// `MSCCLPP_SOCKET_IFNAME`.
    pub socket_ifname: Option<IfnameFilter>,
    /// `MSCCLPP_SOCKET_FAMILY`.
    pub socket_family: Option<SocketFamily>,
    /// `MSCCLPP_HOSTID`.
    pub host_id: Option<String>,
    /// `MSCCLPP_LOG_LEVEL`.
    pub log_level: Option<LogLevel>,
    /// `MSCCLPP_LOG_SUBSYS`: `(inverted, names)`.
    pub log_subsys: Option<(bool, Vec<String>)>,
    /// `MSCCLPP_LOG_FILE` (a pattern: `%h`, `%p`, `%r` not yet expanded).
    pub log_file: Option<PathBuf>,
    /// `MSCCLPP_CUDAIPC_STREAM_PRIORITY`: `Some(true)` for `greatest`, `Some(false)` for
    /// `default`.
    pub cudaipc_greatest_priority: Option<bool>,
    /// `MSCCLPP_CUDAIPC_KERNEL_COPY_MAX`: bytes (0: off).
    pub cudaipc_kernel_copy_max: Option<u64>,
    /// `MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US`: microseconds (0: off).
    pub cudaipc_kernel_copy_linger: Option<std::time::Duration>,
    /// Warnings about the log settings (deprecated names, subsystems this library does not have),
    /// printed once by `init_logging`.
    pub log_warnings: Vec<String>,
    /// The [`UNREAD_MSCCLPP_VARS`] that are set (to anything): they have no effect here.
    pub unread: Vec<String>,
}

/// Variables MSCCL++ reads (its `src/core/env.cpp`, and earlier releases') that this library
/// does not, each with what it does there: setting one has no effect here, which the first use
/// of the environment says once in the log.
pub const UNREAD_MSCCLPP_VARS: [(&str, &str); 15] = [
    ("MSCCLPP_DEBUG_FILE", "MSCCL++'s deprecated name of the log file: use MSCCLPP_LOG_FILE"),
    ("MSCCLPP_COMM_ID", "bootstrap root address for the NCCL interface"),
    ("MSCCLPP_CACHE_DIR", "cache of compiled execution plans"),
    ("MSCCLPP_NPKIT_DUMP_DIR", "NPKit profiling dumps"),
    ("MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM", "CUDA IPC copies on the default stream"),
    ("MSCCLPP_NCCL_LIB_PATH", "the NCCL library of the NCCL fallback"),
    ("MSCCLPP_ENABLE_NCCL_FALLBACK", "the NCCL fallback"),
    ("MSCCLPP_FORCE_NCCL_FALLBACK_OPERATION", "operations forced to the NCCL fallback"),
    ("MSCCLPP_NCCL_SYMMETRIC_MEMORY", "symmetric memory in the NCCL interface"),
    ("MSCCLPP_FORCE_DISABLE_NVLS", "turning NVLS (NVLink SHARP) off"),
    ("MSCCLPP_FORCE_DISABLE_GDR", "turning GDRCopy off"),
    ("MSCCLPP_EXECUTION_PLAN_DIR", "execution plans of the executor"),
    ("MSCCLPP_DISABLE_CHANNEL_CACHE", "the NCCL interface's channel cache"),
    ("MSCCLPP_NPKIT_FLAGS", "NPKit event selection"),
    ("MSCCLPP_ENABLE_TRACE", "tracing of the NCCL interface"),
];

/// The subsystem names `MSCCLPP_LOG_SUBSYS` accepts.
pub(crate) const LOG_SUBSYSTEMS: [&str; 7] = ["ENV", "GPU", "NET", "CONN", "IB", "BOOTSTRAP", "PROXY"];

/// MSCCL++ and NCCL subsystem names that have a counterpart here, and that counterpart.
pub const LOG_SUBSYSTEM_ALIASES: [(&str, &str); 2] = [("INIT", "BOOTSTRAP"), ("P2P", "CONN")];

fn parse_level(var: &str, v: &str) -> Result<LogLevel> {
    Ok(match v.trim().to_ascii_uppercase().as_str() {
        "NONE" | "OFF" => LogLevel::None,
        "ERROR" | "ABORT" => LogLevel::Error,
        "WARN" | "WARNING" | "VERSION" => LogLevel::Warn,
        "INFO" => LogLevel::Info,
        "DEBUG" => LogLevel::Debug,
        "TRACE" => LogLevel::Trace,
        _ => return Err(bad(var, v, "expected NONE, ERROR, WARN, INFO, DEBUG or TRACE")),
    })
}

/// `(inverted, our names)` and the names with no counterpart here.
fn parse_subsys(v: &str) -> ((bool, Vec<String>), Vec<String>) {
    let t = v.trim();
    let (inv, body) = match t.strip_prefix('^') {
        Some(b) => (true, b),
        None => (false, t),
    };
    let (mut names, mut ignored) = (Vec::new(), Vec::new());
    for n in body.split(',').map(|s| s.trim().to_ascii_uppercase()).filter(|n| !n.is_empty()) {
        let ours = if n == "ALL" || LOG_SUBSYSTEMS.contains(&n.as_str()) {
            Some(n.clone())
        } else {
            LOG_SUBSYSTEM_ALIASES.iter().find(|(a, _)| *a == n).map(|(_, o)| o.to_string())
        };
        match ours {
            Some(o) if !names.contains(&o) => names.push(o),
            Some(_) => {}
            None if !ignored.contains(&n) => ignored.push(n),
            None => {}
        }
    }
    ((inv, names), ignored)
}

fn bad(var: &str, value: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid_usage(format!("environment variable {var}={value:?} is not valid: {why}"))
        .during("reading the environment")
}

impl Env {
    /// Reads the variables through `lookup` (the process environment in [`env()`]).
    pub(crate) fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Env> {
        let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
        let mut env = Env::default();
        if let Some(v) = get("MSCCLPP_HCA_DEVICES") {
            let list: Vec<String> = v.split(',').map(|s| s.trim().to_string()).collect();
            if list.iter().any(|s| s.is_empty()) {
                return Err(bad("MSCCLPP_HCA_DEVICES", &v, "an entry is empty"));
            }
            env.hca_devices = Some(list);
        }
        if let Some(v) = get("MSCCLPP_IB_GID_INDEX") {
            env.ib_gid_index = Some(v.trim().parse().map_err(|e| bad("MSCCLPP_IB_GID_INDEX", &v, e))?);
        }
        if let Some(v) = get("MSCCLPP_IBV_MODE") {
            env.ibv_mode = Some(v.parse().map_err(|e: Error| bad("MSCCLPP_IBV_MODE", &v, e.message().to_string()))?);
        }
        env.ibv_so = get("MSCCLPP_IBV_SO").map(PathBuf::from);
        if let Some(v) = get("MSCCLPP_SOCKET_IFNAME") {
            env.socket_ifname =
                Some(IfnameFilter::parse(&v).map_err(|e| bad("MSCCLPP_SOCKET_IFNAME", &v, e.message().to_string()))?);
        }
        if let Some(v) = get("MSCCLPP_SOCKET_FAMILY") {
            env.socket_family = Some(match v.trim().to_ascii_uppercase().as_str() {
                "AF_INET" | "INET" | "IPV4" => SocketFamily::Inet,
                "AF_INET6" | "INET6" | "IPV6" => SocketFamily::Inet6,
                _ => return Err(bad("MSCCLPP_SOCKET_FAMILY", &v, "expected AF_INET or AF_INET6")),
            });
        }
        env.host_id = get("MSCCLPP_HOSTID");
        if let Some(v) = get("MSCCLPP_CUDAIPC_STREAM_PRIORITY") {
            env.cudaipc_greatest_priority = Some(match v.trim().to_ascii_lowercase().as_str() {
                "greatest" | "high" => true,
                "default" => false,
                _ => return Err(bad("MSCCLPP_CUDAIPC_STREAM_PRIORITY", &v, "expected default or greatest")),
            });
        }
        if let Some(v) = get("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX") {
            env.cudaipc_kernel_copy_max =
                Some(v.trim().parse().map_err(|e| bad("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", &v, e))?);
        }
        if let Some(v) = get("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US") {
            let us: u64 = v.trim().parse().map_err(|e| bad("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US", &v, e))?;
            env.cudaipc_kernel_copy_linger = Some(std::time::Duration::from_micros(us));
        }
        let deprecated = |new: &str, old: &str, warnings: &mut Vec<String>| match (get(new), get(old)) {
            (Some(v), Some(_)) => {
                warnings.push(format!("{old} is deprecated and ignored: {new} is set and wins"));
                Some((new.to_string(), v))
            }
            (Some(v), None) => Some((new.to_string(), v)),
            (None, Some(v)) => {
                warnings.push(format!("{old} is deprecated: use {new} (read {old}={v:?} as {new})"));
                Some((old.to_string(), v))
            }
            (None, None) => None,
        };
        let mut warnings = Vec::new();
        if let Some((var, v)) = deprecated("MSCCLPP_LOG_LEVEL", "MSCCLPP_DEBUG", &mut warnings) {
            env.log_level = Some(parse_level(&var, &v)?);
        }
        if let Some((var, v)) = deprecated("MSCCLPP_LOG_SUBSYS", "MSCCLPP_DEBUG_SUBSYS", &mut warnings) {
            let (sel, ignored) = parse_subsys(&v);
            if !ignored.is_empty() {
                warnings.push(format!(
                    "{var}: subsystem(s) {} have no counterpart in this library and are ignored (known: {}, ALL; \
                     {})",
                    ignored.join(", "),
                    LOG_SUBSYSTEMS.join(", "),
                    LOG_SUBSYSTEM_ALIASES.iter().map(|(a, o)| format!("{a} means {o}")).collect::<Vec<_>>().join(", ")
                ));
            }
            env.log_subsys = Some(sel);
        }
        env.log_warnings = warnings;
        env.log_file = get("MSCCLPP_LOG_FILE").map(PathBuf::from);
        env.unread =
            UNREAD_MSCCLPP_VARS.iter().filter(|(k, _)| lookup(k).is_some()).map(|(k, _)| k.to_string()).collect();
        Ok(env)
    }

    /// The warning about [`Env::unread`], if any is set.
    pub(crate) fn unread_warning(&self) -> Option<String> {
        let elsewhere = crate::sync::lock(&READ_ELSEWHERE);
        let unread: Vec<&String> = self.unread.iter().filter(|k| !elsewhere.contains(&k.as_str())).collect();
        if unread.is_empty() {
            return None;
        }
        let what: Vec<String> = unread
            .iter()
            .map(|k| {
                let why = UNREAD_MSCCLPP_VARS.iter().find(|(n, _)| n == k).map_or("", |(_, w)| w);
                format!("{k} ({why})")
            })
            .collect();
        Some(format!(
            "MSCCL++ environment variable(s) set that this library does not read; they have no effect here: {}",
            what.join(", ")
        ))
    }
}

/// The environment as read, without the warning about unread variables.
pub(crate) fn env_quiet() -> Result<&'static Env> {
    static ENV: OnceLock<Result<Env>> = OnceLock::new();
    ENV.get_or_init(|| Env::from_lookup(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned())))
        .as_ref()
        .map_err(Error::duplicate)
}

/// Names of [`UNREAD_MSCCLPP_VARS`] that a library built on this one reads (the NCCL-compatible
/// library reads the NCCL fallback's): the warning leaves them out.
static READ_ELSEWHERE: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// Says that a library built on this one (in this process) reads `names`, so the warning about
/// MSCCL++ variables that have no effect leaves them out. Call it before the first use of the
/// environment (the warning is given once).
pub fn read_elsewhere(names: &[&'static str]) {
    let mut v = crate::sync::lock(&READ_ELSEWHERE);
    for n in names {
        if !v.contains(n) {
            v.push(n);
        }
    }
}

/// Logs the warning about [`Env::unread`] once per process (`init_logging` calls it after
/// installing its subscriber, so the warning is not lost when that is the first use).
pub(crate) fn warn_unread_once(env: &Env) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if let Some(w) = env.unread_warning() {
        WARNED.call_once(|| tracing::warn!(target: "mscclpp::env", "{w}"));
    }
}

/// The process's `MSCCLPP_*` settings, read on first use and kept.
///
/// # Errors
/// `InvalidUsage` naming the variable whose value does not parse (the same error every call).
pub fn env() -> Result<&'static Env> {
    let e = env_quiet()?;
    warn_unread_once(e);
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> Result<Env> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Env::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn empty_environment_is_all_defaults() {
        assert_eq!(parse(&[]).unwrap(), Env::default());
    }

    #[test]
    fn values_parse() {
        let e = parse(&[
            ("MSCCLPP_HCA_DEVICES", "mlx5_0, mlx5_1"),
            ("MSCCLPP_IB_GID_INDEX", "3"),
            ("MSCCLPP_IBV_MODE", "host-no-atomic"),
            ("MSCCLPP_SOCKET_IFNAME", "^docker,lo"),
            ("MSCCLPP_SOCKET_FAMILY", "AF_INET6"),
            ("MSCCLPP_LOG_LEVEL", "info"),
            ("MSCCLPP_LOG_SUBSYS", "^net,ib"),
            ("MSCCLPP_CUDAIPC_STREAM_PRIORITY", "Greatest"),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", " 4096 "),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US", "250"),
        ])
        .unwrap();
        assert_eq!(e.cudaipc_kernel_copy_linger, Some(std::time::Duration::from_micros(250)));
        assert_eq!(e.cudaipc_greatest_priority, Some(true));
        assert_eq!(e.cudaipc_kernel_copy_max, Some(4096));
        assert_eq!(e.hca_devices.unwrap(), vec!["mlx5_0", "mlx5_1"]);
        assert_eq!(e.ib_gid_index, Some(3));
        assert_eq!(e.ibv_mode, Some(IbMode::HostNoAtomic));
        let f = e.socket_ifname.unwrap();
        assert!(f.matches("eth0") && !f.matches("docker0") && !f.matches("lo"));
        assert_eq!(e.socket_family, Some(SocketFamily::Inet6));
        assert_eq!(e.log_level, Some(LogLevel::Info));
        assert_eq!(e.log_subsys, Some((true, vec!["NET".to_string(), "IB".to_string()])));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (k, v) in [
            ("MSCCLPP_IB_GID_INDEX", "three"),
            ("MSCCLPP_IB_GID_INDEX", "-1"),
            ("MSCCLPP_IBV_MODE", "atomic"),
            ("MSCCLPP_SOCKET_FAMILY", "AF_UNIX"),
            ("MSCCLPP_LOG_LEVEL", "LOUD"),
            ("MSCCLPP_HCA_DEVICES", "mlx5_0,,mlx5_1"),
            ("MSCCLPP_CUDAIPC_STREAM_PRIORITY", "urgent"),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", "64K"),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_MAX", "-1"),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US", "1ms"),
            ("MSCCLPP_CUDAIPC_KERNEL_COPY_LINGER_US", "-5"),
        ] {
            let err = parse(&[(k, v)]).unwrap_err();
            assert!(err.to_string().contains(k), "{err}");
            assert_eq!(err.kind(), crate::ErrorKind::InvalidUsage);
        }
    }

    #[test]
    fn msccl_subsystem_names_are_mapped_or_ignored_with_a_warning() {
        let e = parse(&[("MSCCLPP_LOG_SUBSYS", "exec,NET,NCCL,init,P2P,conn,EXEC")]).unwrap();
        assert_eq!(e.log_subsys, Some((false, vec!["NET".to_string(), "BOOTSTRAP".to_string(), "CONN".to_string()])));
        assert_eq!(e.log_warnings.len(), 1, "{:?}", e.log_warnings);
        assert!(e.log_warnings[0].contains("EXEC, NCCL have no counterpart"), "{:?}", e.log_warnings);
        let e = parse(&[("MSCCLPP_LOG_SUBSYS", "ALL")]).unwrap();
        assert!(e.log_warnings.is_empty());
        let e = parse(&[("MSCCLPP_LOG_SUBSYS", "^GRAPH")]).unwrap();
        assert_eq!(e.log_subsys, Some((true, vec![])));
    }

    #[test]
    fn deprecated_debug_names_are_read_with_a_warning() {
        let e = parse(&[("MSCCLPP_DEBUG", "INFO"), ("MSCCLPP_DEBUG_SUBSYS", "NET")]).unwrap();
        assert_eq!(e.log_level, Some(LogLevel::Info));
        assert_eq!(e.log_subsys, Some((false, vec!["NET".to_string()])));
        assert_eq!(e.log_warnings.len(), 2);
        assert!(
            e.log_warnings[0].contains("MSCCLPP_DEBUG is deprecated: use MSCCLPP_LOG_LEVEL"),
            "{:?}",
            e.log_warnings
        );
        // the new name wins
        let e = parse(&[("MSCCLPP_DEBUG", "TRACE"), ("MSCCLPP_LOG_LEVEL", "error")]).unwrap();
        assert_eq!(e.log_level, Some(LogLevel::Error));
        assert!(e.log_warnings[0].contains("ignored"), "{:?}", e.log_warnings);
        // NCCL's level names
        assert_eq!(parse(&[("MSCCLPP_DEBUG", "VERSION")]).unwrap().log_level, Some(LogLevel::Warn));
        // a bad value names the variable it came from
        let err = parse(&[("MSCCLPP_DEBUG", "LOUD")]).unwrap_err();
        assert!(err.to_string().contains("MSCCLPP_DEBUG="), "{err}");
    }

    #[test]
    fn unread_msccl_variables_are_named_in_one_warning() {
        let e = parse(&[
            ("MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM", "1"),
            ("MSCCLPP_LOG_LEVEL", "info"),
            ("MSCCLPP_NPKIT_DUMP_DIR", "/tmp/npkit"),
            ("MSCCLPP_FORCE_DISABLE_NVLS", ""),
            ("MSCCLPP_SOMETHING_ELSE", "1"),
        ])
        .unwrap();
        assert_eq!(
            e.unread,
            vec!["MSCCLPP_NPKIT_DUMP_DIR", "MSCCLPP_CUDAIPC_USE_DEFAULT_STREAM", "MSCCLPP_FORCE_DISABLE_NVLS"]
        );
        let w = e.unread_warning().unwrap();
        assert!(w.contains("no effect here"), "{w}");
        for k in &e.unread {
            assert!(w.contains(k.as_str()), "{w}");
        }
        assert!(!w.contains("MSCCLPP_LOG_LEVEL") && !w.contains("MSCCLPP_SOMETHING_ELSE"), "{w}");
        // Nothing unread set: no warning.
        assert_eq!(parse(&[("MSCCLPP_HOSTID", "h")]).unwrap().unread_warning(), None);
        // None of them is one this library reads (their values change nothing else).
        let all: Vec<(&str, &str)> = UNREAD_MSCCLPP_VARS.iter().map(|(k, _)| (*k, "not a value")).collect();
        let e = parse(&all).unwrap();
        assert_eq!(e.unread.len(), UNREAD_MSCCLPP_VARS.len());
        assert_eq!(Env { unread: Vec::new(), ..e }, Env::default());
    }

    #[test]
    fn ifname_exact_and_prefix() {
        let f = IfnameFilter::parse("=eth0").unwrap();
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfnameFilter::parse("eth").unwrap();
        assert!(f.matches("eth01") && !f.matches("ib0"));
        assert!(IfnameFilter::parse("^").is_err());
    }
}
