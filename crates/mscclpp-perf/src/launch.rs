//! Starting ranks: locally (`--ranks N`), or under mpirun, srun or torchrun.

use std::process::{Command, Stdio};
use std::sync::Arc;

use mscclpp::launcher::{LaunchInfo, RootAddr};
use mscclpp::{Bootstrap, RootServer, TcpBootstrap, UniqueId};

use crate::Args;

const ENV_RANK: &str = "MSCCLPP_PERF_RANK";
const ENV_SIZE: &str = "MSCCLPP_PERF_SIZE";
const ENV_ID: &str = "MSCCLPP_PERF_ID";

type TraceGuard = Option<crate::trace::TraceGuard>;

/// Logging to stderr from `MSCCLPP_LOG_*`, and a Chrome trace when `MSCCLPP_TRACE_FILE` is set
/// (`crate::trace`: the rank as pid, wall-clock times, bounded by `MSCCLPP_TRACE_MAX_MIB`).
fn init_tracing(rank: usize) -> Result<TraceGuard, String> {
    let Some(path) = std::env::var_os("MSCCLPP_TRACE_FILE") else {
        // Without a trace file, the library's own opt-in logging setup.
        mscclpp::init_logging().map_err(|e| e.to_string())?;
        return Ok(None);
    };
    use tracing_subscriber::prelude::*;
    let mut path = std::path::PathBuf::from(path);
    if rank > 0 {
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "trace".into());
        path.set_file_name(format!("{stem}.rank{rank}.json"));
    }
    let (chrome, guard) = crate::trace::create(&path, rank)?;
    let spans = tracing_subscriber::filter::Targets::new().with_target("mscclpp", tracing::Level::TRACE);
    let logs = tracing_subscriber::EnvFilter::try_from_env("RUST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("mscclpp=warn"));
    tracing_subscriber::registry()
        .with(chrome.with_filter(spans))
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(logs))
        .try_init()
        .map_err(|e| e.to_string())?;
    Ok(Some(guard))
}

/// What one rank runs once its bootstrap is up (`p2p::run`, `procs::run_rank`): the arguments,
/// the bootstrap, and the interface for Ethernet (127.0.0.1 for local ranks unless
/// `--interface`; the bootstrap's choice under a launcher).
pub type RankMain = fn(&Args, Arc<dyn Bootstrap>, Option<String>) -> Result<(), String>;

/// Runs the job, `body` in each rank: as a child of the local launcher, as a rank of a cluster
/// launcher, or as the local launcher itself.
pub fn run(args: &Args, body: RankMain) -> Result<(), String> {
    if std::env::var_os("MSCCLPP_TRACE_FILE").is_some() {
        crate::trace::max_bytes()?;
    }
    let env = |k: &str| std::env::var(k).ok();
    if let (Some(r), Some(s), Some(id)) = (env(ENV_RANK), env(ENV_SIZE), env(ENV_ID)) {
        let rank: usize = r.parse().map_err(|_| format!("bad {ENV_RANK}"))?;
        let size: usize = s.parse().map_err(|_| format!("bad {ENV_SIZE}"))?;
        let id: UniqueId = id.parse().map_err(|e: mscclpp::Error| e.to_string())?;
        let _guard = init_tracing(rank)?;
        let bs = TcpBootstrap::config(rank, size).timeout(args.timeout()).initialize(&id).map_err(|e| e.to_string())?;
        let local_iface = args.interface.clone().or_else(|| Some("127.0.0.1".to_string()));
        return body(args, Arc::new(bs), local_iface);
    }
    if let Some(mut info) = LaunchInfo::from_env().map_err(|e| e.to_string())? {
        // --bootstrap wins over the launcher's variables (MSCCLPP_ROOT_ADDR, MASTER_ADDR/MASTER_PORT).
        if let Some(b) = &args.bootstrap {
            info.root = Some(RootAddr { spec: b.clone(), source: "--bootstrap".into() });
        }
        if let Err(e) = info.root() {
            return Err(format!("{e}; or pass --bootstrap host:port"));
        }
        let _guard = init_tracing(info.rank)?;
        let bs = info.bootstrap(args.timeout()).map_err(|e| e.to_string())?;
        if bs.size() < 2 {
            return Err(format!("the {} test needs at least 2 ranks", args.test.name()));
        }
        return body(args, Arc::new(bs), args.interface.clone());
    }
    launch_local(args)
}

/// Starts `n` copies of this program on this machine, each with `env(rank)` added to its
/// environment (and stdout captured when `capture`), behind a [`RootServer`] whose id goes in
/// `id_var`; waits for all of them. Returns each rank's output, or which ranks failed.
/// The one way both the `p2p` launcher and the `bootstrap` jobs start local ranks.
pub fn run_local_ranks(
    n: usize,
    timeout: std::time::Duration,
    id_var: &str,
    env: &dyn Fn(usize) -> Vec<(&'static str, String)>,
    capture: bool,
) -> Result<Vec<std::process::Output>, String> {
    let (root, id) = RootServer::start(n, timeout).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut children = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1)).env(id_var, id.to_string()).envs(env(r)).stdin(Stdio::null());
        if capture {
            cmd.stdout(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                // The ranks already started fail at the bootstrap's timeout; do not wait for it.
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {r} of {n}: {e}"));
            }
        }
    }
    let mut outs = Vec::new();
    let mut failed = Vec::new();
    for (r, c) in children {
        match c.wait_with_output() {
            Ok(o) if o.status.success() => outs.push(o),
            Ok(o) => failed.push(format!("rank {r} ({})", o.status)),
            Err(e) => failed.push(format!("rank {r} ({e})")),
        }
    }
    root.join();
    if failed.is_empty() { Ok(outs) } else { Err(format!("{n} ranks: failed: {}", failed.join(", "))) }
}

/// Starts `--ranks` copies of this program on this machine and waits for them.
fn launch_local(args: &Args) -> Result<(), String> {
    let n = args.ranks;
    run_local_ranks(n, args.timeout(), ENV_ID, &|r| vec![(ENV_RANK, r.to_string()), (ENV_SIZE, n.to_string())], false)
        .map(drop)
}
