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

/// Runs the job: as a child of the local launcher, as a rank of a cluster launcher, or as the
/// local launcher itself.
pub fn run(args: &Args) -> Result<(), String> {
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
        return crate::p2p::run(args, Arc::new(bs), local_iface);
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
            return Err("the p2p test needs at least 2 ranks".into());
        }
        return crate::p2p::run(args, Arc::new(bs), args.interface.clone());
    }
    launch_local(args)
}

/// Starts `--ranks` copies of this program on this machine and waits for them.
fn launch_local(args: &Args) -> Result<(), String> {
    let n = args.ranks;
    let (root, id) = RootServer::start(n, args.timeout()).map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut children = Vec::new();
    for r in 0..n {
        let child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(ENV_RANK, r.to_string())
            .env(ENV_SIZE, n.to_string())
            .env(ENV_ID, id.to_string())
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting rank {r}: {e}"))?;
        children.push((r, child));
    }
    let mut failed = Vec::new();
    for (r, mut c) in children {
        match c.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("rank {r} ({s})")),
            Err(e) => failed.push(format!("rank {r} ({e})")),
        }
    }
    root.join();
    if failed.is_empty() { Ok(()) } else { Err(format!("failed: {}", failed.join(", "))) }
}
