//! `mscclpp-perf`: measures mscclpp transports against the raw baseline of the same machine, in
//! the same run, between the same processes.
//!
//! With no flags it starts two local ranks and runs the `p2p` test over Ethernet (TCP) with host
//! memory, from 8 B to 256 MiB, next to a plain TCP socket between the same two processes.
//!
//! `allreduce`, `allgather` and `reducescatter` run `mscclpp-collectives` like nccl-tests runs
//! NCCL (ranks as threads of one process on one GPU), optionally next to NCCL (`--nccl PATH`).
//! With `--plan FILE` they run an MSCCL++ execution plan (the JSON its DSL writes) through
//! `mscclpp-executor` instead of the built-in algorithms; with `--dry-run` as well they only load
//! and validate it and print its summary, with no GPU.

mod bootstrap;
mod coll;
mod device;
mod kern;
mod launch;
mod lockstep;
mod memchan;
mod nccl;
mod p2p;
mod plan;
mod procs;
mod proxyload;
mod queues;
mod report;
mod stages;
mod trace;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, ValueEnum};
use mscclpp::bench::Memory;

/// Which test to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TestKind {
    /// Rank 0 writes to rank 1 and signals: one-way bandwidth and write+signal round trip.
    P2p,
    /// Bootstrap scaling: initialize and all_gather (8 B, 1 MiB per rank) at each `--scale`
    /// job size, as local processes.
    Bootstrap,
    /// Kernels that communicate (one process, two ranks on `--device`): FIFO latency, proxy
    /// throughput, PortChannel ping-pong and bandwidth (up to `--max-bytes`, at most 1 GiB);
    /// MemoryChannel: device semaphore ping-pong, put bandwidth, LL16 packets. With `--procs`:
    /// between two processes, rank r on GPU (`--device` + r) mod count, over CUDA IPC.
    Device,
    /// mscclpp-collectives AllReduce, nccl-tests style: `--ranks` ranks as threads of this
    /// process on GPU `--device`; size = the per-rank buffer. Columns: size, count, type, redop,
    /// then out of place and in place: time (us), algbw, busbw (GB/s) [#wrong with --check]
    /// [NCCL's time with --nccl]; the algorithm chosen; cuMemcpyDtoDAsync of the same bytes.
    Allreduce,
    /// As allreduce, AllGather: size = the output (count = size / element / ranks per rank).
    Allgather,
    /// As allreduce, ReduceScatter: size = the input (count = size / element / ranks per rank).
    Reducescatter,
}

/// A part of the `device` test (`--parts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DevicePart {
    /// FIFO push -> host pop latency.
    Fifo,
    /// No-op proxy throughput, PortChannel ping-pong and its stages, bandwidth, MemoryChannel.
    Channels,
    /// Whether the proxy's writes escape a hardware queue shared with a waiting kernel.
    Queues,
    /// The proxy under load over CUDA IPC.
    LoadIpc,
    /// The proxy under load over Ethernet.
    LoadEth,
}

impl TestKind {
    /// The name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            TestKind::P2p => "p2p",
            TestKind::Bootstrap => "bootstrap",
            TestKind::Device => "device",
            TestKind::Allreduce => "allreduce",
            TestKind::Allgather => "allgather",
            TestKind::Reducescatter => "reducescatter",
        }
    }
}

/// Measures mscclpp transports against the raw baseline of the same machine.
#[derive(Clone, Debug, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// Test to run.
    #[arg(value_enum, default_value = "p2p")]
    pub test: TestKind,
    /// Local ranks to start (ignored under mpirun/srun/torchrun, which set the ranks). The
    /// collectives: ranks as threads of this process, all on GPU `--device` (2 to 64).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Transport: ethernet, cuda-ipc or ib (IB0: an RDMA NIC or soft-RoCE).
    #[arg(long, default_value = "ethernet")]
    pub transport: String,
    /// First GPU to use with --memory gpu (rank r uses device + r, modulo the device count).
    #[arg(long, default_value_t = 0)]
    pub device: u32,
    /// Memory of the buffers: host, or gpu (`cuMemAlloc`, on --device; rank r uses device + r,
    /// modulo the count).
    #[arg(long, default_value = "host", value_parser = parse_memory())]
    pub memory: Memory,
    /// Smallest message (bytes; K, M, G suffixes allowed).
    #[arg(short = 'b', long, default_value = "8", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest message (bytes; K, M, G suffixes allowed).
    #[arg(short = 'e', long, default_value = "256M", value_parser = parse_size)]
    pub max_bytes: u64,
    /// device: how long the proxy load rows' proxy lets owed signals wait for more triggers
    /// while its FIFO keeps delivering (microseconds; `ProxyConfig::signal_coalesce`, the
    /// library's default when not given; 0 pays them after every batch).
    #[arg(long, value_parser = parse_micros)]
    pub signal_coalesce: Option<f64>,
    /// device: the least time between two rounds of token writes the proxy load rows' proxy
    /// starts when its FIFO runs dry (microseconds; `ProxyConfig::signal_pay_interval`, the
    /// library's default when not given; 0 pays at every dry step).
    #[arg(long, value_parser = parse_micros)]
    pub signal_pay_interval: Option<f64>,
    /// device: how long the proxy load rows' proxy lets owed signals of a backlogged Ethernet
    /// connection wait at most, counted from the first of them (microseconds; `ProxyConfig::signal_backlog_hold`, the library's default
    /// when not given; 0 turns the hold off).
    #[arg(long, value_parser = parse_micros)]
    pub signal_backlog_hold: Option<f64>,
    /// device: which parts to run (comma-separated; default all): `fifo` (push -> pop),
    /// `channels` (no-op proxy throughput, PortChannel ping-pong and its stages, bandwidth,
    /// MemoryChannel), `queues` (the hardware-queue probe), `load-ipc` and `load-eth` (the proxy
    /// under load over CUDA IPC, over Ethernet).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub parts: Option<Vec<DevicePart>>,
    /// Multiplication factor between sizes (at least 2).
    #[arg(short = 'f', long, default_value_t = 2)]
    pub step_factor: u64,
    /// Timed iterations per size (default: enough to move about 512 MiB, 10 to 2000; the
    /// collectives: 20); at least 1.
    #[arg(short = 'n', long)]
    pub iters: Option<u64>,
    /// Measurements per size, ours and the baseline alternating; the table shows medians, the
    /// JSON min/median/max. At least 1.
    #[arg(long, default_value_t = 3)]
    pub rounds: u64,
    /// Untimed iterations before each measurement.
    #[arg(short = 'w', long, default_value_t = 5)]
    pub warmup: u64,
    /// Check the data each receiver got and add a `#wrong` column (`-c`, `-c 1`; `-c 0` is off).
    /// The collectives: one more call per size on integer-valued data, every element compared
    /// with a CPU reference; any wrong element fails the run.
    #[arg(short = 'c', long, num_args = 0..=1, default_value = "0", default_missing_value = "1",
          value_parser = parse_flag)]
    pub check: bool,
    /// Interface or IP address for Ethernet and the TCP baseline (default 127.0.0.1 for local
    /// ranks; the bootstrap's choice under a launcher).
    #[arg(long)]
    pub interface: Option<String>,
    /// Root address `[iface:]host:port` under a launcher (default: `mscclpp::launcher`'s rule,
    /// MASTER_ADDR with MASTER_PORT, + 1 under torchrun); host is a name, an IPv4 address or a
    /// bracketed IPv6 address.
    #[arg(long)]
    pub bootstrap: Option<String>,
    /// RDMA device for --transport ib (default: MSCCLPP_HCA_DEVICES, else the first device).
    #[arg(long)]
    pub ib_device: Option<String>,
    /// GID index for --transport ib (default: MSCCLPP_IB_GID_INDEX, else the RoCE v2 GID of the
    /// port's IPv4 address).
    #[arg(long)]
    pub gid_index: Option<u32>,
    /// With 2 ranks, both write to each other at once (bandwidth is per direction); with more,
    /// the ring has every rank write anyway.
    #[arg(long)]
    pub bidirectional: bool,
    /// Write the run (metadata and one record per size) to this JSON file; checked before the run.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the results as an SVG file, `.svg` only, checked before the run (p2p: bandwidth and
    /// round trip against size, ours and the baseline; bootstrap: times against ranks).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Seconds any single wait may take before the run fails.
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Job sizes for the `bootstrap` test, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256,512")]
    pub scale: Vec<usize>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// `device` between two processes (started like p2p's ranks, or by mpirun/srun/torchrun),
    /// rank r on GPU (`--device` + r) mod count, over CUDA IPC: semaphore and raw flag
    /// ping-pong, MemoryChannel put/get bandwidth (uni- and bidirectional) from `-b` (at least
    /// 1 KiB) to `--max-bytes` (at most 1 GiB) by `-f`, LL16/LL8 packets, PortChannel ping-pong
    /// and bandwidth, each next to the copy engine. `-n` sets every loop's iterations (a quick
    /// check), `--rounds` the rounds, `--json` the output file. With a collective
    /// (allreduce, allgather, reducescatter): its ranks are processes (`--ranks` local ones, or
    /// those of mpirun/srun/torchrun), all on GPU `--device`; start the MPS daemon first so that
    /// their kernels run at the same time.
    #[arg(long)]
    pub procs: bool,
    /// Collectives: element type, f32, f16, bf16, i32 or u32 (default bf16).
    #[arg(short = 'd', long)]
    pub dtype: Option<String>,
    /// Collectives: reduction, sum, prod, min, max or avg (default sum; AllGather has none).
    #[arg(short = 'o', long)]
    pub op: Option<String>,
    /// Collectives: capture the `-n` calls of each measurement into one CUDA graph and time its
    /// launch (default: eager calls).
    #[arg(long)]
    pub graph: bool,
    /// Collectives: run this algorithm (allpair (AllReduce only), packet, simple, or zerocopy
    /// (AllReduce on buffers registered once as windows)) instead of the selector's choice;
    /// sizes it cannot serve are skipped.
    #[arg(long)]
    pub algo: Option<String>,
    /// Collectives: also run the sweep through this NCCL library (libnccl.so.2, 2.30 or newer
    /// for several ranks on one GPU), in the same mode, and print its time next to ours. Sets
    /// NCCL_MULTI_RANK_GPU_ENABLE=1 when it is not set. If it cannot be loaded or initialized,
    /// the run goes on without it.
    #[arg(long)]
    pub nccl: Option<PathBuf>,
    /// Collectives: time this MSCCL++ execution plan (the JSON its DSL writes) for this
    /// collective instead of the built-in algorithms; its world size must be --ranks. Only the
    /// placement it was written for (in place or out of place) runs; --check checks it.
    #[arg(long)]
    pub plan: Option<PathBuf>,
    /// With --plan: load and validate the plan and print its summary (ranks, thread blocks,
    /// operations, channels, buffers); needs no GPU. Exits non-zero on an invalid plan.
    #[arg(long)]
    pub dry_run: bool,
    /// Internal: run the hardware-queue probe in this process and print its lines (`device`
    /// starts such children with `CUDA_DEVICE_MAX_CONNECTIONS` set; see queues.rs).
    #[arg(long = "queue-probe", hide = true)]
    pub queue_probe: bool,
}

impl Args {
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout.max(1))
    }
}

/// Parses `--memory`: host or gpu (the help lists them).
fn parse_memory() -> impl TypedValueParser<Value = Memory> {
    PossibleValuesParser::new(["host", "gpu"]).map(|s| if s == "gpu" { Memory::Gpu } else { Memory::Host })
}

/// Parses `-c`'s value: 1/0, true/false, yes/no.
pub fn parse_flag(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(format!("{s:?} is not 0 or 1")),
    }
}

/// Checks that `path` can be written (its folder exists and takes a file) and, for `--plot`,
/// that it names an SVG file, so that a typo fails before the sweep and not after it.
fn check_output(flag: &str, path: &std::path::Path, ext: Option<&str>) -> Result<(), String> {
    if let Some(want) = ext {
        let got = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
        if got.as_deref() != Some(want) {
            return Err(format!("{flag} {}: the plot is an SVG file, name it *.{want}", path.display()));
        }
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return Err(format!("{flag} {}: folder {} does not exist", path.display(), dir.display()));
    }
    if path.is_dir() {
        return Err(format!("{flag} {}: is a folder", path.display()));
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map(drop)
        .map_err(|e| format!("{flag} {}: cannot write there: {e}", path.display()))
}

/// Parses `4096`, `64K`, `1M`, `1G` (powers of two).
pub fn parse_micros(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(us) if us.is_finite() && (0.0..=1e6).contains(&us) => Ok(us),
        _ => Err(format!("{v:?} is not a number of microseconds from 0 to 1000000")),
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1u64 << 20),
        Some('G') => (&t[..t.len() - 1], 1u64 << 30),
        _ => (t, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("{s:?} is not a size like 4096, 64K, 1M or 1G"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

impl Args {
    /// Whether the transport is CUDA IPC (checked by `check`).
    pub fn cuda_ipc(&self) -> bool {
        matches!(self.transport.to_ascii_lowercase().as_str(), "cuda-ipc" | "cudaipc" | "ipc")
    }
    /// Whether the transport is IB.
    pub fn ib(&self) -> bool {
        matches!(self.transport.to_ascii_lowercase().as_str(), "ib" | "ib0" | "rdma" | "roce")
    }
}

fn check(args: &Args) -> Result<(), String> {
    if args.plan.is_some() && coll::collective(args.test).is_none() {
        return Err(format!(
            "--plan applies to the collective tests (allreduce, allgather, reducescatter), not {}",
            args.test.name()
        ));
    }
    match args.transport.to_ascii_lowercase().as_str() {
        "ethernet" | "eth" | "tcp" | "cuda-ipc" | "cudaipc" | "ipc" | "ib" | "ib0" | "rdma" | "roce" => {}
        t => return Err(format!("unknown --transport {t:?} (expected ethernet, cuda-ipc or ib)")),
    }
    if args.cuda_ipc() && args.memory != Memory::Gpu {
        return Err("--transport cuda-ipc moves GPU memory: add --memory gpu".into());
    }
    if !args.ib() && (args.ib_device.is_some() || args.gid_index.is_some()) {
        return Err("--ib-device and --gid-index apply to --transport ib".into());
    }
    if args.ib() {
        let devs = mscclpp::ib::devices().map_err(|e| format!("--transport ib: {e}"))?;
        if let Some(d) = &args.ib_device
            && !devs.contains(d)
        {
            return Err(format!("--ib-device {d}: no such RDMA device (this machine has: {})", devs.join(", ")));
        }
    }
    if args.memory == Memory::Gpu {
        mscclpp::gpu::device_count().map_err(|e| format!("--memory gpu: {e}"))?;
    }
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        return Err(format!(
            "--min-bytes {} must be at least 1 and at most --max-bytes {}",
            args.min_bytes, args.max_bytes
        ));
    }
    if args.iters == Some(0) {
        return Err("--iters (-n) must be at least 1".into());
    }
    if args.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    if args.step_factor < 2 {
        return Err(format!("--step-factor (-f) {} must be at least 2", args.step_factor));
    }
    if let Some(p) = &args.json {
        check_output("--json", p, None)?;
    }
    if let Some(p) = &args.plot {
        check_output("--plot", p, Some("svg"))?;
    }
    if coll::collective(args.test).is_none() {
        let given = [
            (args.dtype.is_some(), "-d/--dtype"),
            (args.op.is_some(), "-o/--op"),
            (args.graph, "--graph"),
            (args.algo.is_some(), "--algo"),
            (args.nccl.is_some(), "--nccl"),
        ];
        if let Some((_, flag)) = given.iter().find(|g| g.0) {
            return Err(format!("{flag} applies to the collective tests (allreduce, allgather, reducescatter)"));
        }
    }
    if args.procs && args.test != TestKind::Device && coll::collective(args.test).is_none() {
        return Err(
            "--procs applies to the device test and the collectives (allreduce, allgather, reducescatter)".into()
        );
    }
    if args.parts.is_some() && (args.test != TestKind::Device || args.procs) {
        return Err("--parts applies to the one-process device test".into());
    }
    if args.test == TestKind::Bootstrap {
        if args.scale.contains(&0) {
            return Err("--scale sizes must be at least 1".into());
        }
        return Ok(());
    }
    if coll::collective(args.test).is_some() {
        coll::Spec::from_args(args)?;
        let n = mscclpp::gpu::device_count().map_err(|e| format!("{}: {e}", args.test.name()))?;
        if args.device as usize >= n {
            return Err(format!("--device {}: this machine has {n} GPU(s)", args.device));
        }
        return Ok(());
    }
    if args.test == TestKind::Device {
        if args.procs && args.ranks != 2 {
            return Err(format!("device --procs runs between 2 ranks, not --ranks {}", args.ranks));
        }
        if !args.procs && args.json.is_some() {
            return Err("--json with the device test needs --procs (the one-process rows print only)".into());
        }
        mscclpp::gpu::device_count().map_err(|e| format!("device: {e}"))?;
        return Ok(());
    }
    if args.ranks < 2 {
        return Err("the p2p test needs at least 2 ranks".into());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.dry_run {
        // No GPU, no NCCL: before check(), which asks CUDA for the devices.
        return match plan::dry_run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mscclpp-perf: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.queue_probe {
        // A child of `device`'s hardware-queue rows, with its queue count already set.
        queues::probe_child(args.device);
        return ExitCode::SUCCESS;
    }
    // Before anything starts a thread (CUDA, the bootstrap, NCCL): the environment NCCL reads.
    let nccl_env_set = args.nccl.is_some() && coll::collective(args.test).is_some() && nccl::prepare_env();
    // Ranks as threads of this process (collectives and device tests without --procs): their
    // streams get hardware queues of their own (queues.rs says why).
    if !args.procs && (coll::collective(args.test).is_some() || args.test == TestKind::Device) {
        queues::prepare_env();
    }
    if let Err(e) = check(&args) {
        eprintln!("mscclpp-perf: {e}");
        return ExitCode::from(2);
    }
    // Ranks as threads of this process (and the bootstrap test): the library's logging from
    // `MSCCLPP_LOG_*` here (processes set theirs up in `launch`).
    let in_process = match args.test {
        TestKind::P2p => false,
        TestKind::Device | TestKind::Allreduce | TestKind::Allgather | TestKind::Reducescatter => !args.procs,
        TestKind::Bootstrap => true,
    };
    if in_process && let Err(e) = mscclpp::init_logging() {
        eprintln!("mscclpp-perf: logging: {e}");
        return ExitCode::from(2);
    }
    let res = match args.test {
        TestKind::P2p => launch::run(&args, p2p::run),
        TestKind::Device if args.procs => launch::run(&args, procs::run_rank),
        TestKind::Bootstrap => bootstrap::run(&args),
        TestKind::Allreduce | TestKind::Allgather | TestKind::Reducescatter if args.procs => {
            launch::run(&args, coll::run_rank)
        }
        TestKind::Allreduce | TestKind::Allgather | TestKind::Reducescatter => coll::run(&args, nccl_env_set),
        TestKind::Device => {
            // The MemoryChannel rows run even when the proxy rows failed.
            let proxy = device::run(&args);
            let memchan = args.parts.as_ref().is_none_or(|ps| ps.contains(&DevicePart::Channels));
            if memchan { proxy.and(memchan::run(&args)) } else { proxy }
        }
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mscclpp-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("256m").unwrap(), 256 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }

    #[test]
    fn unsupported_choices_are_clear_errors() {
        let a = Args::parse_from(["mscclpp-perf", "--gid-index", "1"]);
        assert!(check(&a).unwrap_err().contains("--transport ib"));
        if mscclpp::ib::devices().is_err() {
            // No RDMA device here: the reason, not a panic.
            let a = Args::parse_from(["mscclpp-perf", "--transport", "ib"]);
            assert!(check(&a).unwrap_err().contains("no IB transport"));
        }
        let a = Args::parse_from(["mscclpp-perf", "--transport", "cuda-ipc"]);
        assert!(check(&a).unwrap_err().contains("--memory gpu"));
        if mscclpp::gpu::device_count().is_err() {
            let a = Args::parse_from(["mscclpp-perf", "--memory", "gpu"]);
            assert!(check(&a).unwrap_err().contains("no CUDA driver found"));
        }
        let a = Args::parse_from(["mscclpp-perf", "--procs"]);
        assert!(check(&a).unwrap_err().contains("device test"));
        let a = Args::parse_from(["mscclpp-perf", "device", "--procs", "--ranks", "3"]);
        assert!(check(&a).unwrap_err().contains("2 ranks"));
        let a = Args::parse_from(["mscclpp-perf", "--transport", "carrier-pigeon"]);
        assert!(check(&a).unwrap_err().contains("unknown"));
        let a = Args::parse_from(["mscclpp-perf", "--min-bytes", "1M", "--max-bytes", "1K"]);
        assert!(check(&a).is_err());
        // The collective flags: refused elsewhere, parsed before any GPU is looked for.
        let a = Args::parse_from(["mscclpp-perf", "--graph"]);
        assert!(check(&a).unwrap_err().contains("collective tests"));
        let a = Args::parse_from(["mscclpp-perf", "device", "--nccl", "/x/libnccl.so.2"]);
        assert!(check(&a).unwrap_err().contains("collective tests"));
        let a = Args::parse_from(["mscclpp-perf", "allreduce", "-d", "int8"]);
        assert!(check(&a).unwrap_err().contains("unknown data type"));
        let a = Args::parse_from(["mscclpp-perf", "reducescatter", "-o", "xor"]);
        assert!(check(&a).unwrap_err().contains("unknown reduction"));
        let a = Args::parse_from(["mscclpp-perf", "allgather", "--algo", "allpair"]);
        assert!(check(&a).unwrap_err().contains("does not implement"));
        let a = Args::parse_from(["mscclpp-perf", "allreduce", "--ranks", "1"]);
        assert!(check(&a).unwrap_err().contains("2 to 64"));
        let a = Args::parse_from(["mscclpp-perf", "bootstrap", "--procs"]);
        assert!(check(&a).unwrap_err().contains("device test and the collectives"));
        let a =
            Args::parse_from(["mscclpp-perf", "allreduce", "-b", "8", "-e", "1G", "-d", "bf16", "--check", "--graph"]);
        assert!(a.check && a.graph && a.max_bytes == 1 << 30);
        if mscclpp::gpu::device_count().is_err() {
            assert!(check(&a).unwrap_err().contains("no CUDA driver found"));
        }
        let a = Args::parse_from(["mscclpp-perf"]);
        check(&a).unwrap();
        assert_eq!((a.min_bytes, a.max_bytes, a.ranks), (8, 256 << 20, 2));
    }
}
