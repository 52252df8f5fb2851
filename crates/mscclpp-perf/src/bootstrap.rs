//! `mscclpp-perf bootstrap`: how the bootstrap scales with the number of ranks.
//!
//! For each job size in `--scale` (default 16, 64, 256, 512) the launcher starts that many
//! local processes with a `RootServer`; each rank times `initialize` and `all_gather` of 8 B
//! and 1 MiB, and prints one line the launcher collects. A row is printed as each job finishes.
//!
//! * `init` is from the moment the last rank called `initialize` to the moment the last rank
//!   had it return: the bootstrap's own latency, without the launcher's process start-up.
//! * `ag 8B` / `ag 1MiB` are the slowest rank's time for one `all_gather` (median of the
//!   repetitions), each started right after a `barrier`.
//!
//! Jobs whose 1 MiB all_gather would need more memory than half of `MemAvailable` (every rank
//! holds `n` MiB) skip that column.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use mscclpp::{Bootstrap, TcpBootstrap, UniqueId};

use crate::Args;

const ENV_RANK: &str = "MSCCLPP_PERF_BS_RANK";
const ENV_SIZE: &str = "MSCCLPP_PERF_BS_SIZE";
const ENV_ID: &str = "MSCCLPP_PERF_BS_ID";
const ENV_BIG: &str = "MSCCLPP_PERF_BS_BIG";
const SMALL_REPS: usize = 5;
const BIG_REPS: usize = 3;

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One rank: `BSPERF <start_us> <end_us> <ag8 ms,...> <ag1m ms,...>` on stdout.
fn rank_main(args: &Args, rank: usize, size: usize, id: &UniqueId, big: bool) -> Result<(), String> {
    let start = unix_us();
    let bs = TcpBootstrap::config(rank, size).timeout(args.timeout()).initialize(id).map_err(|e| e.to_string())?;
    let end = unix_us();
    let time = |len: usize, reps: usize| -> Result<Vec<f64>, String> {
        let data = vec![rank as u8; len];
        let mut out = Vec::new();
        for _ in 0..reps {
            bs.barrier().map_err(|e| e.to_string())?;
            let t = Instant::now();
            let all = bs.all_gather(&data).map_err(|e| e.to_string())?;
            out.push(t.elapsed().as_secs_f64() * 1e3);
            if all.len() != size
                || all.iter().enumerate().any(|(i, m)| m.len() != len || m.first().is_some_and(|b| *b != i as u8))
            {
                return Err(format!("rank {rank}: all_gather of {len} B returned wrong data"));
            }
        }
        Ok(out)
    };
    let small = time(8, SMALL_REPS)?;
    let large = if big { time(1 << 20, BIG_REPS)? } else { Vec::new() };
    bs.barrier().map_err(|e| e.to_string())?;
    let fmt = |v: &[f64]| {
        if v.is_empty() { "-".to_string() } else { v.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(",") }
    };
    println!("BSPERF {start} {end} {} {}", fmt(&small), fmt(&large));
    Ok(())
}

/// `MemAvailable` in bytes, if known.
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    l.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// One row of results.
struct Row {
    ranks: usize,
    init_ms: f64,
    ag8_ms: f64,
    ag1m_ms: Option<f64>,
    job_s: f64,
}

fn run_job(args: &Args, n: usize) -> Result<Row, String> {
    let big = mem_available().is_none_or(|m| (n as u64) * (n as u64) * (1 << 20) <= m / 2);
    let t0 = Instant::now();
    let big_flag = if big { "1" } else { "0" };
    let outs = crate::launch::run_local_ranks(
        n,
        args.timeout(),
        ENV_ID,
        &|r| vec![(ENV_RANK, r.to_string()), (ENV_SIZE, n.to_string()), (ENV_BIG, big_flag.to_string())],
        true,
    )?;
    let mut lines = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        let s = String::from_utf8_lossy(&o.stdout);
        match s.lines().find(|l| l.starts_with("BSPERF ")) {
            Some(l) => lines.push(l.to_string()),
            None => return Err(format!("{n} ranks: rank {r} printed no result")),
        }
    }
    let mut last_start = 0u64;
    let mut last_end = 0u64;
    let mut small: Vec<Vec<f64>> = Vec::new();
    let mut large: Vec<Vec<f64>> = Vec::new();
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).ok_or_else(|| format!("bad line {l:?}"));
        last_start = last_start.max(num(1)?);
        last_end = last_end.max(num(2)?);
        let list = |i: usize| -> Vec<f64> {
            f.get(i).map(|x| x.split(',').filter_map(|v| v.parse().ok()).collect()).unwrap_or_default()
        };
        small.push(list(3));
        large.push(list(4));
    }
    // per repetition, the slowest rank; then the median over repetitions
    let slowest = |per_rank: &[Vec<f64>]| -> Option<f64> {
        let reps = per_rank.iter().map(|v| v.len()).min().unwrap_or(0);
        (reps > 0).then(|| median((0..reps).map(|i| per_rank.iter().map(|v| v[i]).fold(0.0, f64::max)).collect()))
    };
    Ok(Row {
        ranks: n,
        init_ms: last_end.saturating_sub(last_start) as f64 / 1e3,
        ag8_ms: slowest(&small).unwrap_or(f64::NAN),
        ag1m_ms: slowest(&large),
        job_s: t0.elapsed().as_secs_f64(),
    })
}

/// Runs the scaling benchmark (or, in a child, one rank of it).
pub fn run(args: &Args) -> Result<(), String> {
    if let Some((rank, size, id)) = crate::launch::local_rank(ENV_RANK, ENV_SIZE, ENV_ID)? {
        return rank_main(args, rank, size, &id, std::env::var(ENV_BIG).ok().as_deref() == Some("1"));
    }
    println!(
        "# mscclpp-perf bootstrap: local processes on {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{:>6} {:>12} {:>12} {:>14} {:>10}", "ranks", "init ms", "ag 8B ms", "ag 1MiB ms", "job s");
    let mut rows = Vec::new();
    for &n in &args.scale {
        let row = run_job(args, n)?;
        let big = row.ag1m_ms.map_or_else(|| "skipped".to_string(), |v| format!("{v:.2}"));
        println!("{:>6} {:>12.2} {:>12.3} {:>14} {:>10.2}", row.ranks, row.init_ms, row.ag8_ms, big, row.job_s);
        rows.push(row);
    }
    if let Some(path) = &args.json {
        let body: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"test\":\"bootstrap\",\"ranks\":{},\"init_ms\":{:.3},\"all_gather_8b_ms\":{:.4},\"all_gather_1mib_ms\":{},\"job_s\":{:.3}}}",
                    r.ranks,
                    r.init_ms,
                    r.ag8_ms,
                    r.ag1m_ms.map_or("null".to_string(), |v| format!("{v:.3}")),
                    r.job_s
                )
            })
            .collect();
        std::fs::write(path, body.join("\n") + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        write_svg(&rows, path)?;
    }
    Ok(())
}

/// Draws the three times against the job size, log-log, in milliseconds.
fn write_svg(rows: &[Row], path: &std::path::Path) -> Result<(), String> {
    use crate::report::{Panel, Series, draw_svg};
    use plotters::style::{BLUE, GREEN, RED};
    let pts = |f: &dyn Fn(&Row) -> Option<f64>| rows.iter().filter_map(|r| f(r).map(|v| (r.ranks as f64, v))).collect();
    let panel = Panel {
        x_desc: "ranks (local processes)".into(),
        y_desc: "time, ms (slowest rank)".into(),
        x_label: &|x| format!("{x:.0}"),
        series: vec![
            Series { name: "initialize".into(), color: BLUE, points: pts(&|r| Some(r.init_ms)) },
            Series { name: "all_gather 8 B".into(), color: RED, points: pts(&|r| Some(r.ag8_ms)) },
            Series { name: "all_gather 1 MiB".into(), color: GREEN, points: pts(&|r| r.ag1m_ms) },
        ],
    };
    draw_svg(path, "mscclpp-perf bootstrap: time against ranks", &[panel])
}
