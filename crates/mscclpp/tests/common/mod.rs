//! Multi-process test harness: a test re-runs its own binary once per rank.
//!
//! ```ignore
//! #[test]
//! fn my_test() {
//!     if let Some(r) = Rank::from_env() { /* rank body */ return; }
//!     spawn_ranks("my_test", 2, &[]).assert_success();
//! }
//! ```
#![allow(dead_code)]

pub mod gpu;
pub mod harnesses;
pub mod ptx;
pub mod suite;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mscclpp::{
    Communicator, Connection, EndpointConfig, RegisteredMemory, RootServer, Semaphore, TcpBootstrap, UniqueId,
};

/// What a child rank knows about itself.
pub struct Rank {
    pub rank: usize,
    pub size: usize,
    pub id: UniqueId,
}

impl Rank {
    /// `Some` in a child process started by [`spawn_ranks`].
    pub fn from_env() -> Option<Rank> {
        let rank = std::env::var("MSCCLPP_TEST_RANK").ok()?.parse().ok()?;
        let size = std::env::var("MSCCLPP_TEST_SIZE").ok()?.parse().ok()?;
        let id = std::env::var("MSCCLPP_TEST_ID").ok()?.parse().ok()?;
        Some(Rank { rank, size, id })
    }

    /// Joins the job with a timeout.
    pub fn bootstrap(&self, timeout: Duration) -> TcpBootstrap {
        TcpBootstrap::config(self.rank, self.size).timeout(timeout).initialize(&self.id).expect("bootstrap initialize")
    }
}

/// The outputs of a job's ranks.
pub struct Job {
    pub outputs: Vec<(usize, Output)>,
    pub elapsed: Duration,
}

impl Job {
    pub fn assert_success(&self) {
        let mut bad = Vec::new();
        for (r, o) in &self.outputs {
            if !o.status.success() {
                bad.push(format!(
                    "rank {r} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
                    o.status,
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    /// Asserts that rank `rank` succeeded (the others may have been killed or stopped on
    /// purpose), with its output when it did not; returns its stdout.
    pub fn assert_rank_success(&self, rank: usize) -> String {
        let Some((_, o)) = self.outputs.iter().find(|(r, _)| *r == rank) else { panic!("no rank {rank} in the job") };
        let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "rank {rank} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}", o.status);
        stdout.into_owned()
    }

    /// Prints every rank's `RESULT` lines, so that the runner's summary shows them (a test's
    /// first line of output follows libtest's "test NAME ... " on the same line).
    pub fn relay_results(&self) {
        for (r, _) in &self.outputs {
            for l in self.stdout(*r).lines().filter_map(|l| l.find("RESULT").map(|i| &l[i..])) {
                println!("rank {r}: {l}");
            }
        }
    }

    /// A rank's stdout.
    pub fn stdout(&self, rank: usize) -> String {
        self.outputs
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, o)| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }
}

/// Starts `ranks` (a subset of `0..size`) of test `name`, with a root for `size` ranks in this
/// process, and waits for all of them (killing any that outlive `limit`).
pub fn spawn_some(
    name: &str,
    size: usize,
    ranks: &[usize],
    root_timeout: Duration,
    env: &[(&str, String)],
    limit: Duration,
) -> Job {
    spawn_limited(name, size, ranks, root_timeout, env, limit, None)
}

/// [`spawn_some`], with each rank's open-file limit (soft and hard) set to `nofile` before it
/// starts (through `sh -c 'ulimit -n N; exec ...'`), as a cluster's default 1,024 would.
pub fn spawn_limited(
    name: &str,
    size: usize,
    ranks: &[usize],
    root_timeout: Duration,
    env: &[(&str, String)],
    limit: Duration,
    nofile: Option<u64>,
) -> Job {
    let (root, id) = RootServer::start(size, root_timeout).expect("root server");
    let start = Instant::now();
    let exe = std::env::current_exe().expect("current_exe");
    let mut children: Vec<(usize, Child)> = ranks
        .iter()
        .map(|&r| {
            let mut c = match nofile {
                Some(n) => {
                    let mut c = Command::new("sh");
                    c.arg("-c").arg(format!("ulimit -n {n} && exec \"$0\" \"$@\"")).arg(&exe);
                    c
                }
                None => Command::new(&exe),
            };
            c.args(["--exact", name, "--nocapture", "--test-threads=1", "--include-ignored"])
                .env("MSCCLPP_TEST_RANK", r.to_string())
                .env("MSCCLPP_TEST_SIZE", size.to_string())
                .env("MSCCLPP_TEST_ID", id.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                c.env(k, v);
            }
            (r, c.spawn().expect("spawn rank"))
        })
        .collect();
    // Wait with a limit, draining pipes on threads so a chatty child cannot block.
    let mut outputs = Vec::new();
    let deadline = start + limit;
    let mut waiters = Vec::new();
    for (r, mut ch) in children.drain(..) {
        let pid = ch.id();
        let out = ch.stdout.take();
        let err = ch.stderr.take();
        let so = std::thread::spawn(move || read_all(out));
        let se = std::thread::spawn(move || read_all(err));
        waiters.push((r, pid, ch, so, se));
    }
    for (r, _pid, mut ch, so, se) in waiters {
        let left = deadline.saturating_duration_since(Instant::now());
        let status = match mscclpp::bench::wait_exit(&mut ch, left).expect("wait for a rank") {
            Some(s) => s,
            None => {
                let _ = ch.kill();
                ch.wait().expect("wait")
            }
        };
        let stdout = so.join().unwrap_or_default();
        let stderr = se.join().unwrap_or_default();
        outputs.push((r, Output { status, stdout, stderr }));
    }
    drop(root);
    Job { outputs, elapsed: start.elapsed() }
}

fn read_all<R: std::io::Read>(r: Option<R>) -> Vec<u8> {
    let mut v = Vec::new();
    if let Some(mut r) = r {
        let _ = r.read_to_end(&mut v);
    }
    v
}

/// Kills this process with SIGKILL, as a crashed rank dies: no destructors run and no socket says
/// goodbye. SIGKILL cannot be blocked, so it is delivered before `kill(2)` returns.
pub fn die() -> ! {
    // SAFETY: kill(2) takes a pid and a signal number; no memory is passed.
    unsafe { nix::libc::kill(nix::libc::getpid(), nix::libc::SIGKILL) };
    unreachable!("SIGKILL sent to this process did not end it")
}

/// Waits until `ready` holds, failing the test after `limit` with `what` (for conditions with
/// nothing to block on: counters, tokens, `/proc` files; polled with the library's backoff).
pub fn wait_until(what: &str, limit: Duration, ready: impl FnMut() -> bool) {
    assert!(mscclpp::bench::wait_until(limit, ready), "{what}: not within {limit:?}");
}

/// This rank's links to every other rank of `n`, indexed by peer (`None` at this rank).
pub struct Links<S> {
    pub conns: Vec<Option<Connection>>,
    pub remote: Vec<Option<RegisteredMemory>>,
    pub sems: Vec<Option<S>>,
}

/// Joins every pair: a connection over `cfg` to each peer, `local` sent to each and each peer's
/// memory received, and a semaphore on each connection, made by `sem`. Issues every exchange
/// before waiting on any (the peers do the same).
pub fn connect_all<S>(
    comm: &Communicator,
    rank: usize,
    n: usize,
    cfg: &EndpointConfig,
    local: &RegisteredMemory,
    sem: impl Fn(Semaphore) -> S,
) -> Links<S> {
    let peers: Vec<usize> = (0..n).filter(|p| *p != rank).collect();
    let pc: Vec<_> = peers.iter().map(|&p| (p, comm.connect(cfg, p, 0).unwrap())).collect();
    for &p in &peers {
        comm.send_memory(local, p, 1).unwrap();
    }
    let pm: Vec<_> = peers.iter().map(|&p| (p, comm.recv_memory(p, 1).unwrap())).collect();
    let mut conns: Vec<Option<Connection>> = (0..n).map(|_| None).collect();
    for (p, c) in pc {
        conns[p] = Some(c.wait().unwrap_or_else(|e| panic!("rank {rank}: connection to rank {p}: {e}")));
    }
    let mut remote: Vec<Option<RegisteredMemory>> = vec![None; n];
    for (p, m) in pm {
        remote[p] = Some(m.wait().unwrap());
    }
    let ps: Vec<_> =
        peers.iter().map(|&p| (p, comm.build_semaphore(conns[p].as_ref().unwrap(), p, 2).unwrap())).collect();
    let mut sems: Vec<Option<S>> = (0..n).map(|_| None).collect();
    for (p, s) in ps {
        sems[p] = Some(sem(s.wait().unwrap()));
    }
    Links { conns, remote, sems }
}

/// Starts all `size` ranks of test `name`.
pub fn spawn_ranks(name: &str, size: usize, env: &[(&str, String)]) -> Job {
    let all: Vec<usize> = (0..size).collect();
    spawn_some(name, size, &all, Duration::from_secs(60), env, Duration::from_secs(240))
}

/// A splitmix64 stream starting after `seed`: deterministic, well-spread 64-bit values.
pub fn splitmix(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A deterministic byte pattern for (seed, index).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
