//! Real launchers start a 4-rank job of this test binary: Open MPI's `mpirun`, Slurm's `srun` (on
//! a one-machine cluster the test starts: `slurmctld` and `slurmd` with `auth/none`), and a
//! torchrun-shaped launch whose agent store already holds `MASTER_PORT` (the real `torchrun` runs
//! on the GPU machine: `scripts/torchrun-check.sh`). Each rank reads its rank and root from the
//! launcher's variables and exchanges data with every other rank over Ethernet.
//!
//! Where `mpirun` or Slurm is missing the test says so and passes, except in CI
//! (`MSCCLPP_TEST_LAUNCHERS=1`, which `.ci/run` sets after installing them).

mod common;
#[path = "common/launched.rs"]
mod launched;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use launched::{CHILD_VAR, all_pairs_exchange, child, free_port, have, mesh, test_args, unavailable};
use mscclpp::launcher::Launcher;

const T: Duration = Duration::from_secs(60);

/// The rank body every launcher starts.
fn rank_body(name: &str, want: Launcher) -> bool {
    let Some(info) = child(name) else { return false };
    assert_eq!(info.launcher, want, "launcher recognised");
    assert!(info.local_rank.is_some(), "{want} gives a local rank");
    let m = mesh(&info, 1 << 16, T);
    println!("{} ({want}, local rank {:?})", all_pairs_exchange(&m, 1 << 16, T), info.local_rank);
    true
}

/// Waits for `child` at most `limit`, killing it after.
fn wait_limited(mut c: Child, limit: Duration) -> Output {
    mscclpp::bench::wait_exit(&mut c, limit).unwrap();
    let _ = c.kill();
    c.wait_with_output().unwrap()
}

fn assert_four_ranks_ok(out: &Output, who: &str) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let text =
        format!("{who}: {}\n--- stdout\n{stdout}\n--- stderr\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    for r in 0..4 {
        assert!(stdout.contains(&format!("rank {r} of 4: exchanged 65536 B with 3 peers, all exact")), "{text}");
    }
    println!("{text}");
}

#[test]
fn mpirun_starts_four_ranks() {
    const NAME: &str = "mpirun_starts_four_ranks";
    if rank_body(NAME, Launcher::OpenMpi) {
        return;
    }
    if !have("mpirun", "--version") {
        return unavailable("mpirun (Open MPI, Debian openmpi-bin) is not installed");
    }
    let mut c = Command::new("mpirun");
    if launched::is_root() {
        c.arg("--allow-run-as-root");
    }
    // --oversubscribe: 4 ranks on a machine with fewer cores.
    c.args(["--oversubscribe", "-np", "4", "-x", "MASTER_ADDR=localhost"])
        .args(["-x", &format!("MASTER_PORT={}", free_port()), "-x", &format!("{CHILD_VAR}={NAME}")])
        .arg(std::env::current_exe().unwrap())
        .args(test_args(NAME));
    let out =
        wait_limited(c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(), T * 2);
    assert_four_ranks_ok(&out, "mpirun");
}

/// A one-machine Slurm cluster in a temporary directory, stopped on drop.
struct Slurm {
    dir: std::path::PathBuf,
    daemons: Vec<Child>,
}

impl Slurm {
    fn start() -> Result<Slurm, String> {
        let dir = std::env::temp_dir().join(format!("mscclpp-slurm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["state", "spool"] {
            std::fs::create_dir_all(dir.join(d)).map_err(|e| e.to_string())?;
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|e| e.to_string())?.trim().to_string();
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let d = dir.display();
        let conf = format!(
            "ClusterName=mscclpp\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={}\nSlurmdPort={}\n\
             AuthType=auth/none\nCredType=cred/none\nSlurmUser=root\nSlurmdUser=root\n\
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/ctld.pid\n\
             SlurmdPidFile={d}/d.pid\nSlurmctldLogFile={d}/ctld.log\nSlurmdLogFile={d}/d.log\n\
             ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nSelectType=select/cons_tres\n\
             SelectTypeParameters=CR_CPU\nMpiDefault=none\nReturnToService=2\nSchedulerType=sched/builtin\n\
             JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8\n",
            free_port(),
            free_port()
        );
        std::fs::write(dir.join("slurm.conf"), conf).map_err(|e| e.to_string())?;
        let mut s = Slurm { dir, daemons: Vec::new() };
        for daemon in ["slurmctld", "slurmd"] {
            let c = Command::new(daemon)
                .args(["-D", "-f"])
                .arg(s.conf())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("{daemon}: {e}"))?;
            s.daemons.push(c);
        }
        // Ready when the node is idle (bounded wait). Slurm has no event to block on, and each
        // look runs `sinfo` (a process and a round trip to slurmctld), so this polls its state
        // every 200 ms: the interval sets how soon the test sees it, never whether it passes.
        let start = Instant::now();
        loop {
            let o = Command::new("sinfo").args(["-h", "-o", "%t"]).env("SLURM_CONF", s.conf()).output();
            if o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle") {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                // The logs go with the directory when `s` drops: put their ends in the error.
                let tail = |f: &str| {
                    let t = std::fs::read_to_string(s.dir.join(f)).unwrap_or_default();
                    let lines: Vec<&str> = t.lines().collect();
                    lines[lines.len().saturating_sub(8)..].join("\n")
                };
                return Err(format!(
                    "the Slurm node is not idle after 60 s\n--- slurmctld:\n{}\n--- slurmd:\n{}",
                    tail("ctld.log"),
                    tail("d.log")
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn conf(&self) -> std::path::PathBuf {
        self.dir.join("slurm.conf")
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for c in &mut self.daemons {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn srun_starts_four_ranks() {
    const NAME: &str = "srun_starts_four_ranks";
    if rank_body(NAME, Launcher::Slurm) {
        return;
    }
    if !have("slurmd", "-V") || !have("slurmctld", "-V") {
        return unavailable("Slurm (Debian slurm-wlm) is not installed");
    }
    // One retry: the daemons' ports come from free_port(), which another test may take first.
    let slurm = Slurm::start().or_else(|e| {
        eprintln!("first Slurm start failed, retrying: {e}");
        Slurm::start()
    });
    let slurm = slurm.unwrap();
    let out = wait_limited(
        Command::new("srun")
            .args(["-n", "4", "--overcommit", "--export=ALL"])
            .arg(std::env::current_exe().unwrap())
            .args(test_args(NAME))
            .env("SLURM_CONF", slurm.conf())
            .env("MASTER_ADDR", "localhost")
            .env("MASTER_PORT", free_port().to_string())
            .env(CHILD_VAR, NAME)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        T * 2,
    );
    assert_four_ranks_ok(&out, "srun");
}

/// What torchrun does to a worker, without torch: its agent's store listens on `MASTER_PORT`
/// (here a listener that accepts and never answers), and the workers get `TORCHELASTIC_RUN_ID`,
/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and `MASTER_ADDR=localhost`. The root goes to
/// `MASTER_PORT + 1`; nothing clashes.
#[test]
fn torchrun_shaped_launch_leaves_master_port_to_the_store() {
    const NAME: &str = "torchrun_shaped_launch_leaves_master_port_to_the_store";
    if rank_body(NAME, Launcher::Torchrun) {
        return;
    }
    // The store's port, and the one above it free (retry a few times if someone holds it).
    let (store, port) = (0..20)
        .find_map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").ok()?;
            let p = l.local_addr().ok()?.port();
            std::net::TcpListener::bind(("127.0.0.1", p.checked_add(1)?)).ok()?;
            Some((l, p))
        })
        .expect("two adjacent free ports");
    let kids: Vec<Child> = (0..4)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(test_args(NAME))
                .env(CHILD_VAR, NAME)
                .env("TORCHELASTIC_RUN_ID", "mscclpp-test")
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "4")
                .env("LOCAL_WORLD_SIZE", "4")
                .env("MASTER_ADDR", "localhost")
                .env("MASTER_PORT", port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = kids.into_iter().map(|c| wait_limited(c, T * 2)).collect();
    drop(store);
    let mut all = Output { status: outs[0].status, stdout: Vec::new(), stderr: Vec::new() };
    for o in &outs {
        all.stdout.extend_from_slice(&o.stdout);
        all.stderr.extend_from_slice(&o.stderr);
        if !o.status.success() {
            all.status = o.status;
        }
    }
    assert_four_ranks_ok(&all, "torchrun-shaped launch");
}
