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

/// This process's rank, the job's size and its `UniqueId`, from the variables `rank_var`,
/// `size_var` and `id_var` that [`run_local_ranks`] sets; `None` when they are not all set (not a
/// rank the local launcher started).
pub fn local_rank(rank_var: &str, size_var: &str, id_var: &str) -> Result<Option<(usize, usize, UniqueId)>, String> {
    let env = |k: &str| std::env::var(k).ok();
    let (Some(r), Some(s), Some(id)) = (env(rank_var), env(size_var), env(id_var)) else { return Ok(None) };
    let rank: usize = r.parse().map_err(|_| format!("bad {rank_var}"))?;
    let size: usize = s.parse().map_err(|_| format!("bad {size_var}"))?;
    let id: UniqueId = id.parse().map_err(|e: mscclpp::Error| format!("bad {id_var}: {e}"))?;
    Ok(Some((rank, size, id)))
}

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
    if let Some((rank, size, id)) = local_rank(ENV_RANK, ENV_SIZE, ENV_ID)? {
        let _guard = init_tracing(rank)?;
        let bs = TcpBootstrap::config(rank, size).timeout(args.timeout()).initialize(&id).map_err(|e| e.to_string())?;
        let local_iface = args.interface.clone().or_else(|| Some("127.0.0.1".to_string()));
        return body(args, Arc::new(bs), local_iface);
    }
    if let Some(mut info) = LaunchInfo::from_env().map_err(|e| e.to_string())? {
        // --bootstrap wins over the launcher's variables (MSCCLPP_ROOT_ADDR, MASTER_ADDR/MASTER_PORT).
        if let Some(b) = &args.bootstrap {
            info.root = Some(RootAddr::new(b.clone(), "--bootstrap"));
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
/// Once a rank has ended (failed, or succeeded while others still run), the others get `timeout`
/// plus 5 s to end (their own waits are bounded by `timeout`), then are killed: a hung or
/// stopped rank cannot hang the launcher, even when no other rank fails because of it.
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
    let mut readers = Vec::new();
    for r in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1)).env(id_var, id.to_string()).envs(env(r)).stdin(Stdio::null());
        if capture {
            cmd.stdout(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut c) => {
                // Read the pipe on its own thread, so a rank never blocks on a full pipe while
                // this thread polls for exits.
                readers.push(c.stdout.take().map(|mut out| {
                    std::thread::spawn(move || {
                        let mut buf = Vec::new();
                        let _ = std::io::Read::read_to_end(&mut out, &mut buf);
                        buf
                    })
                }));
                children.push(c);
            }
            Err(e) => {
                // The ranks already started fail at the bootstrap's timeout; do not wait for it.
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {r} of {n}: {e}"));
            }
        }
    }
    let grace = timeout + std::time::Duration::from_secs(5);
    let mut status: Vec<Option<Result<std::process::ExitStatus, String>>> = (0..n).map(|_| None).collect();
    let mut any_failed = false;
    // The first rank to end, and when: a success starts the grace too (a rank stopped after the
    // others' last wait on it fails nobody), and a failure always comes with or after it.
    let mut first_end: Option<(std::time::Instant, usize)> = None;
    loop {
        let mut running = 0;
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    if !s.success() {
                        any_failed = true;
                    }
                    first_end.get_or_insert_with(|| (std::time::Instant::now(), r));
                    status[r] = Some(Ok(s));
                }
                Ok(None) => running += 1,
                Err(e) => {
                    any_failed = true;
                    first_end.get_or_insert_with(|| (std::time::Instant::now(), r));
                    let _ = c.kill();
                    let _ = c.wait();
                    status[r] = Some(Err(e.to_string()));
                }
            }
        }
        if running == 0 {
            break;
        }
        if let Some(why) = overdue(first_end, any_failed, grace) {
            for (r, c) in children.iter_mut().enumerate() {
                if status[r].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                    status[r] = Some(Err(format!("killed: still running {grace:?} after {why}")));
                }
            }
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let mut outs = Vec::new();
    let mut failed = Vec::new();
    for (r, (st, reader)) in status.into_iter().zip(readers).enumerate() {
        let stdout = reader.and_then(|h| h.join().ok()).unwrap_or_default();
        match st {
            Some(Ok(s)) if s.success() => outs.push(std::process::Output { status: s, stdout, stderr: Vec::new() }),
            Some(Ok(s)) => failed.push(format!("rank {r} ({s})")),
            Some(Err(e)) => failed.push(format!("rank {r} ({e})")),
            None => failed.push(format!("rank {r} (not waited for)")),
        }
    }
    // The root's thread ends once every rank joined, or at its own timeout.
    root.join();
    if failed.is_empty() { Ok(outs) } else { Err(format!("{n} ranks: failed: {}", failed.join(", "))) }
}

/// Why the ranks still running are to be killed now, if they are: `grace` has passed since the
/// first rank ended (`first_end`: when, and which), whether or not one failed.
fn overdue(
    first_end: Option<(std::time::Instant, usize)>,
    any_failed: bool,
    grace: std::time::Duration,
) -> Option<String> {
    let (t, r) = first_end?;
    if t.elapsed() <= grace {
        return None;
    }
    Some(if any_failed { "another rank failed".to_string() } else { format!("rank {r} finished") })
}

/// Starts `--ranks` copies of this program on this machine and waits for them.
fn launch_local(args: &Args) -> Result<(), String> {
    let n = args.ranks;
    run_local_ranks(n, args.timeout(), ENV_ID, &|r| vec![(ENV_RANK, r.to_string()), (ENV_SIZE, n.to_string())], false)
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::overdue;
    use std::time::{Duration, Instant};

    #[test]
    fn the_grace_starts_at_the_first_end_of_any_kind() {
        let grace = Duration::from_secs(30);
        let Some(long_ago) = Instant::now().checked_sub(Duration::from_secs(60)) else { return };
        assert_eq!(overdue(None, false, grace), None, "nobody ended: wait on");
        assert_eq!(overdue(Some((Instant::now(), 0)), true, grace), None, "within the grace");
        assert_eq!(overdue(Some((long_ago, 1)), true, grace).as_deref(), Some("another rank failed"));
        // A rank that succeeded while another is stopped: the stopped one is killed too.
        assert_eq!(overdue(Some((long_ago, 3)), false, grace).as_deref(), Some("rank 3 finished"));
    }
}
