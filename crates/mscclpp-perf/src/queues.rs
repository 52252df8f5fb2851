//! The GPU's hardware work queues for ranks that are threads of this process.
//!
//! The driver maps every stream of a context onto one of `CUDA_DEVICE_MAX_CONNECTIONS` hardware
//! queues (8 unless set, at most 32). Work in one queue starts in order, whatever stream it came
//! from: when two ranks' streams share a queue, a rank's kernel can sit behind the other rank's
//! next launch, which waits (in its stream) for the other rank's current kernel, which spins
//! waiting for this very rank. Nothing moves until a device wait times out. Ranks as threads
//! give one context several rank streams plus each rank's connection stream, so with 4 ranks
//! they outgrow 8 queues: on the H200 the two-node plan's `allreduce --plan ... --ranks 4`
//! timed out in 3 of 6 runs with 8 queues and 3 of 3 with 2, and in 1 of 6 with 32 (sessions 13
//! and 14); the failures with 8 were each a rank whose first launch started only after its peers
//! had timed out (issue #28).
//! Separate processes do not share queues this way (one context each).

use mscclpp::gpu::{HW_QUEUES_MAX, HW_QUEUES_VAR as VAR};

static SETTING: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets [`VAR`] to [`HW_QUEUES_MAX`] (the most the driver allows) when it is not set. `main`
/// calls it first thing for runs whose ranks are threads of this process, before any thread or
/// CUDA context exists.
pub fn prepare_env() {
    let said = match std::env::var_os(VAR) {
        Some(v) => format!("{VAR}={} (yours)", v.to_string_lossy()),
        None => {
            // SAFETY: called at the top of `main`, right after parsing the command line and
            // before anything (CUDA, the bootstrap, NCCL) has started a thread, so nothing reads
            // or writes the environment at the same time.
            unsafe { std::env::set_var(VAR, HW_QUEUES_MAX.to_string()) };
            format!(
                "{VAR}={HW_QUEUES_MAX} (set by mscclpp-perf: ranks as threads share one context, whose streams must not share hardware queues)"
            )
        }
    };
    let _ = SETTING.set(said);
}

/// What [`prepare_env`] found or set, for the header; `None` when it did not run.
pub fn setting() -> Option<&'static str> {
    SETTING.get().map(String::as_str)
}

/// The hidden flag that makes `mscclpp-perf` a probe child (see [`probe_rows`]).
pub const PROBE_FLAG: &str = "--queue-probe";
/// The queue counts the probe runs under: one shared queue (Megatron-LM's setting), and the
/// most the driver gives (the control).
const PROBE_QUEUES: [u32; 2] = [1, HW_QUEUES_MAX];
/// How long each probe's spinning kernel waits for the write before it reports "blocked".
const PROBE_LIMIT: std::time::Duration = std::time::Duration::from_millis(200);

/// One line per probe of `mscclpp::bench::queue_probe` on GPU `device`, in this process (started
/// with [`PROBE_FLAG`] and [`VAR`] set by [`probe_rows`]): every way the proxy writes (and a
/// kernel) from a stream of default, greatest and least priority, behind a spinning kernel with a
/// launch queued after it; then the default stream without the queued launch.
pub fn probe_child(device: u32) {
    use mscclpp::bench::{ProbeStream, ProbeWrite, queue_probe};
    let var = std::env::var(VAR).unwrap_or_else(|_| "unset".to_string());
    if let Err(e) = mscclpp::gpu::device_count() {
        println!("hardware queues ({VAR}={var}): no probe: {e}");
        return;
    }
    let mut cases = Vec::new();
    for w in [ProbeWrite::Kernel, ProbeWrite::WriteValue, ProbeWrite::Copy] {
        for s in [ProbeStream::Default, ProbeStream::Greatest, ProbeStream::Least] {
            cases.push((w, s, true));
        }
        cases.push((w, ProbeStream::Default, false));
    }
    for (w, s, queued) in cases {
        let behind = if queued { "behind a spinner with a launch queued after it" } else { "behind a spinner alone" };
        let what = match queue_probe(device, w, s, queued, PROBE_LIMIT) {
            Ok(p) if p.arrived => format!("arrived after {:.1} us", p.waited.as_secs_f64() * 1e6),
            Ok(p) => format!("BLOCKED (not there after {:.0} ms)", p.waited.as_secs_f64() * 1e3),
            Err(e) => format!("failed: {e}"),
        };
        println!("hardware queues ({VAR}={var}): {w} on a {s}, {behind}: {what}");
    }
}

/// The probe's lines for each of [`PROBE_QUEUES`], each from a child process of this binary
/// (the variable is read once, when CUDA starts in a process), or a line saying why not.
pub fn probe_rows(device: u32) -> Vec<String> {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return vec![format!("hardware queues: cannot start the probe: {e}")],
    };
    let mut rows = Vec::new();
    for q in PROBE_QUEUES {
        let out = std::process::Command::new(&exe)
            .args(["device", PROBE_FLAG, "--device", &device.to_string()])
            .env(VAR, q.to_string())
            .output();
        match out {
            Ok(o) if o.status.success() => {
                rows.extend(String::from_utf8_lossy(&o.stdout).lines().map(str::to_string));
            }
            Ok(o) => rows.push(format!(
                "hardware queues, {VAR}={q}: the probe failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => rows.push(format!("hardware queues ({VAR}={q}): cannot start the probe: {e}")),
        }
    }
    rows
}
