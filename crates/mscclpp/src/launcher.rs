//! Rank, size and bootstrap root from the environment a cluster launcher sets.
//!
//! A program started by `mpirun`, `srun` or `torchrun` learns its rank and the job's size from
//! the launcher's variables, and where rank 0 hosts the bootstrap root from `MASTER_ADDR` (or
//! [`ROOT_ADDR_VAR`]):
//!
//! ```no_run
//! # fn main() -> mscclpp::Result<()> {
//! use mscclpp::launcher::LaunchInfo;
//! let info = LaunchInfo::from_env()?.expect("not started by a launcher");
//! let bootstrap = info.bootstrap(std::time::Duration::from_secs(60))?;
//! # let _ = bootstrap; Ok(()) }
//! ```
//!
//! **Which launcher** (the first that matches; variables in the order read):
//!
//! | launcher | rank, size | local rank |
//! |---|---|---|
//! | torchrun | `RANK`, `WORLD_SIZE` with `TORCHELASTIC_RUN_ID` set | `LOCAL_RANK` |
//! | Open MPI | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | PMI (MPICH, Intel MPI) | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID` |
//! | Slurm (`srun`) | `SLURM_PROCID`, `SLURM_NTASKS` | `SLURM_LOCALID` |
//! | plain variables | `RANK`, `WORLD_SIZE` | `LOCAL_RANK` |
//!
//! torchrun comes first because a `torchrun` started by `srun` or `mpirun` also inherits their
//! variables, which then describe the agents, not the workers.
//!
//! **The root address** (`[iface:]host:port`, host names and IPv6 literals accepted):
//! 1. [`ROOT_ADDR_VAR`] (`MSCCLPP_ROOT_ADDR`) when set;
//! 2. otherwise `MASTER_ADDR` with the port [`ROOT_PORT_VAR`] (`MSCCLPP_ROOT_PORT`) when set, else
//!    **`MASTER_PORT + 1` under torchrun** (its agent's TCPStore already listens on
//!    `MASTER_PORT`), else `MASTER_PORT`.
//!
//! Rank 0 binds the root at that address, so it must be an address of rank 0's host.

use std::fmt;
use std::time::Duration;

use crate::bootstrap::TcpBootstrap;
use crate::error::{Error, Result};

/// Our own variable naming the bootstrap root, `[iface:]host:port`; it wins over `MASTER_ADDR`.
pub const ROOT_ADDR_VAR: &str = "MSCCLPP_ROOT_ADDR";
/// Our own variable naming the root's port (the host comes from `MASTER_ADDR`); it wins over the
/// `MASTER_PORT` rules.
pub const ROOT_PORT_VAR: &str = "MSCCLPP_ROOT_PORT";

/// The program that started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// `torchrun` (PyTorch elastic): `RANK`/`WORLD_SIZE` with `TORCHELASTIC_RUN_ID`.
    Torchrun,
    /// Open MPI's `mpirun`/`mpiexec`.
    OpenMpi,
    /// A PMI launcher: MPICH's or Intel MPI's `mpiexec`.
    Pmi,
    /// Slurm's `srun`.
    Slurm,
    /// `RANK`/`WORLD_SIZE` set by hand or by a script.
    Environment,
}

impl Launcher {
    /// The variables holding the rank and the size.
    pub fn rank_vars(self) -> (&'static str, &'static str) {
        match self {
            Launcher::Torchrun | Launcher::Environment => ("RANK", "WORLD_SIZE"),
            Launcher::OpenMpi => ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            Launcher::Pmi => ("PMI_RANK", "PMI_SIZE"),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS"),
        }
    }

    fn local_rank_var(self) -> &'static str {
        match self {
            Launcher::Torchrun | Launcher::Environment => "LOCAL_RANK",
            Launcher::OpenMpi => "OMPI_COMM_WORLD_LOCAL_RANK",
            Launcher::Pmi => "MPI_LOCALRANKID",
            Launcher::Slurm => "SLURM_LOCALID",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI (MPICH, Intel MPI)",
            Launcher::Slurm => "Slurm",
            Launcher::Environment => "RANK/WORLD_SIZE",
        })
    }
}

/// Where the bootstrap root listens, and which variables said so (`#[non_exhaustive]`: build one
/// with [`RootAddr::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RootAddr {
    /// `[iface:]host:port`, for [`TcpBootstrap::initialize_with_addr`].
    pub spec: String,
    /// The variables it came from, for messages (`MASTER_ADDR="node1" MASTER_PORT="29500" (+1 under torchrun)`).
    pub source: String,
}

/// What a launcher told this process (`#[non_exhaustive]`: read it from [`LaunchInfo::from_env`];
/// the fields may be changed, and more may come).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchInfo {
    /// Who started the process.
    pub launcher: Launcher,
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The rank among the ranks of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// The bootstrap root, when the variables name one.
    pub root: Option<RootAddr>,
}

impl RootAddr {
    /// A root at `spec` (`[iface:]host:port`), saying in messages that it came from `source`
    /// (a variable, a command-line option).
    pub fn new(spec: impl Into<String>, source: impl Into<String>) -> RootAddr {
        RootAddr { spec: spec.into(), source: source.into() }
    }
}

impl LaunchInfo {
    /// Reads the process environment; `Ok(None)` when no launcher's variables are set.
    pub fn from_env() -> Result<Option<LaunchInfo>> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) with the variables looked up by `get` (for tests and for
    /// programs that pass environments around).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<LaunchInfo>> {
        let torchrun = get("TORCHELASTIC_RUN_ID").is_some();
        let order: &[Launcher] = if torchrun {
            &[Launcher::Torchrun]
        } else {
            &[Launcher::OpenMpi, Launcher::Pmi, Launcher::Slurm, Launcher::Environment]
        };
        for &launcher in order {
            let (rv, sv) = launcher.rank_vars();
            let (Some(r), Some(s)) = (get(rv), get(sv)) else { continue };
            let rank = parse_num(rv, &r)?;
            let size = parse_num(sv, &s)?;
            if size == 0 || rank >= size {
                return Err(Error::invalid_usage(format!(
                    "{launcher} variables {rv}={rank} and {sv}={size}: the rank must be below the size"
                )));
            }
            let lv = launcher.local_rank_var();
            let local_rank = get(lv).map(|v| parse_num(lv, &v)).transpose()?;
            let root = root_addr(launcher, get)?;
            return Ok(Some(LaunchInfo { launcher, rank, size, local_rank, root }));
        }
        if torchrun {
            return Err(Error::invalid_usage(
                "TORCHELASTIC_RUN_ID is set (torchrun) but RANK or WORLD_SIZE is not".to_string(),
            ));
        }
        Ok(None)
    }

    /// The root address, or an error saying which variables to set.
    pub fn root(&self) -> Result<&RootAddr> {
        self.root.as_ref().ok_or_else(|| {
            Error::invalid_usage(format!(
                "started by {} as rank {} of {}, but no bootstrap root address: set {ROOT_ADDR_VAR}=host:port, \
                 or MASTER_ADDR and MASTER_PORT (all ranks the same; rank 0 listens there)",
                self.launcher, self.rank, self.size
            ))
        })
    }

    /// Joins the job through the root address (rank 0 hosts the root), waiting up to `timeout`
    /// for each bootstrap step (`Duration::MAX`: no limit). Errors name the variables the
    /// address came from.
    pub fn bootstrap(&self, timeout: Duration) -> Result<TcpBootstrap> {
        let root = self.root()?;
        crate::net::parse_addr_spec(&root.spec).map_err(|e| {
            Error::new(e.kind(), format!("bad bootstrap root address from {}: {}", root.source, e.message()))
        })?;
        TcpBootstrap::config(self.rank, self.size)
            .timeout(timeout)
            .initialize_with_addr(&root.spec)
            .map_err(|e| e.with_note(format!("the root address {} came from {}", root.spec, root.source)))
    }
}

fn parse_num(var: &str, v: &str) -> Result<usize> {
    v.trim().parse().map_err(|_| Error::invalid_usage(format!("{var}={v:?} is not a non-negative integer")))
}

/// The root address by the rules in the module documentation; `None` when nothing names one.
fn root_addr(launcher: Launcher, get: &dyn Fn(&str) -> Option<String>) -> Result<Option<RootAddr>> {
    if let Some(spec) = get(ROOT_ADDR_VAR).filter(|s| !s.trim().is_empty()) {
        let source = format!("{ROOT_ADDR_VAR}={spec:?}");
        return Ok(Some(RootAddr { spec: spec.trim().to_string(), source }));
    }
    let Some(addr) = get("MASTER_ADDR").filter(|s| !s.trim().is_empty()) else {
        return Ok(None);
    };
    let (port, source) = if let Some(p) = get(ROOT_PORT_VAR) {
        (parse_port(ROOT_PORT_VAR, &p)?, format!("MASTER_ADDR={addr:?} {ROOT_PORT_VAR}={p:?}"))
    } else if let Some(p) = get("MASTER_PORT") {
        let port = parse_port("MASTER_PORT", &p)?;
        if launcher == Launcher::Torchrun {
            let next = port.checked_add(1).ok_or_else(|| {
                Error::invalid_usage(format!(
                    "MASTER_PORT={p:?} under torchrun: the root would listen on MASTER_PORT + 1, which is past 65535; \
                     set {ROOT_PORT_VAR}"
                ))
            })?;
            (next, format!("MASTER_ADDR={addr:?} MASTER_PORT={p:?} (+1 under torchrun)"))
        } else {
            (port, format!("MASTER_ADDR={addr:?} MASTER_PORT={p:?}"))
        }
    } else {
        return Err(Error::invalid_usage(format!(
            "MASTER_ADDR={addr:?} is set but neither MASTER_PORT nor {ROOT_PORT_VAR} is"
        )));
    };
    Ok(Some(RootAddr { spec: host_port(&addr, port), source }))
}

fn parse_port(var: &str, v: &str) -> Result<u16> {
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(Error::invalid_usage(format!("{var}={v:?} is not a port (1-65535)"))),
    }
}

/// `host` and `port` as one spec; a bare IPv6 literal gets its brackets.
fn host_port(host: &str, port: u16) -> String {
    let h = host.trim();
    if h.contains(':') && !h.starts_with('[') { format!("[{h}]:{port}") } else { format!("{h}:{port}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::collections::HashMap;

    fn info(pairs: &[(&str, &str)]) -> Result<Option<LaunchInfo>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchInfo::from_vars(&|k| m.get(k).cloned())
    }

    #[test]
    fn no_launcher_is_none() {
        assert_eq!(info(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]).unwrap(), None);
    }

    #[test]
    fn each_launcher_is_recognised_with_its_local_rank() {
        let i =
            info(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1")])
                .unwrap()
                .unwrap();
        assert_eq!((i.launcher, i.rank, i.size, i.local_rank), (Launcher::OpenMpi, 1, 4, Some(1)));
        assert_eq!(i.root, None);
        let i = info(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "0")]).unwrap().unwrap();
        assert_eq!((i.launcher, i.rank, i.size, i.local_rank), (Launcher::Slurm, 3, 8, Some(0)));
        let i = info(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]).unwrap().unwrap();
        assert_eq!((i.launcher, i.local_rank), (Launcher::Pmi, None));
        let i = info(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap().unwrap();
        assert_eq!(i.launcher, Launcher::Environment);
    }

    #[test]
    fn torchrun_wins_over_the_launcher_that_started_it() {
        // `srun torchrun ...`: Slurm's variables describe the agent, torchrun's the worker.
        let i = info(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((i.launcher, i.rank, i.size, i.local_rank), (Launcher::Torchrun, 5, 8, Some(1)));
        let e = info(&[("TORCHELASTIC_RUN_ID", "job"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).unwrap_err();
        assert!(e.to_string().contains("RANK"), "{e}");
    }

    #[test]
    fn root_port_rules() {
        let torch = [("TORCHELASTIC_RUN_ID", "x"), ("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "node1")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = torch.to_vec();
            v.extend_from_slice(extra);
            info(&v).unwrap().unwrap().root.unwrap()
        };
        let r = with(&[("MASTER_PORT", "29500")]);
        assert_eq!(r.spec, "node1:29501", "torchrun: MASTER_PORT + 1");
        assert!(r.source.contains("MASTER_PORT=\"29500\"") && r.source.contains("+1"), "{}", r.source);
        assert_eq!(with(&[("MASTER_PORT", "29500"), (ROOT_PORT_VAR, "4000")]).spec, "node1:4000");
        assert_eq!(with(&[("MASTER_PORT", "29500"), (ROOT_ADDR_VAR, "eth0:10.0.0.1:7")]).spec, "eth0:10.0.0.1:7");
        let e = info(&[torch.as_slice(), &[("MASTER_PORT", "65535")]].concat()).unwrap_err();
        assert!(e.to_string().contains(ROOT_PORT_VAR), "{e}");
        // Other launchers: MASTER_PORT itself; IPv6 literals get brackets.
        let r = info(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("MASTER_PORT", "99"),
        ])
        .unwrap()
        .unwrap()
        .root
        .unwrap();
        assert_eq!(r.spec, "[::1]:99");
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (pairs, var) in [
            (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (vec![("PMI_RANK", "5"), ("PMI_SIZE", "2")], "PMI_RANK"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "0")], "MASTER_PORT"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")], "MASTER_PORT"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")], "LOCAL_RANK"),
        ] {
            let e = info(&pairs).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidUsage);
            assert!(e.to_string().contains(var), "{e}");
        }
        let i = info(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap().unwrap();
        let e = i.root().unwrap_err();
        assert!(e.to_string().contains(ROOT_ADDR_VAR) && e.to_string().contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn a_name_that_does_not_resolve_names_its_variables() {
        let i =
            info(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "no-such-host.invalid"), ("MASTER_PORT", "9")])
                .unwrap()
                .unwrap();
        let e = i.bootstrap(Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR=\"no-such-host.invalid\""), "{e}");
    }

    #[test]
    fn a_root_that_does_not_answer_is_a_timeout_naming_the_variables() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
        let i = info(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)])
            .unwrap()
            .unwrap();
        let e = i.bootstrap(Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains(&format!("came from MASTER_ADDR=\"127.0.0.1\" MASTER_PORT=\"{port}\"")), "{e}");
    }
}
