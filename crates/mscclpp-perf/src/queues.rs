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
    // SAFETY: called at the top of `main`, right after parsing the command line and before
    // anything (CUDA, the bootstrap, NCCL) has started a thread, so nothing reads or writes the
    // environment at the same time.
    let said = match unsafe { mscclpp::gpu::use_all_hw_queues() } {
        (v, false) => format!("{VAR}={v} (yours)"),
        (v, true) => format!(
            "{VAR}={v} (set by mscclpp-perf: ranks as threads share one context, whose streams must not share hardware queues)"
        ),
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
            Ok(p) if p.arrived => {
                format!("arrived, {:.1} us after the write was issued", p.after_issue.as_secs_f64() * 1e6)
            }
            Ok(p) => format!("BLOCKED (the spinner gave up after {:.0} ms)", p.waited.as_secs_f64() * 1e3),
            Err(e) => format!("failed: {e}"),
        };
        println!("hardware queues ({VAR}={var}): {w} on a {s}, {behind}: {what}");
    }
    if var.parse::<u32>().is_ok_and(|q| q > 1) {
        for keep in [true, false] {
            println!("{}", map_row(&var, keep, mscclpp::bench::queue_map_probe(device, MAP_STREAMS, keep, MAP_LIMIT)));
        }
    }
}

/// Streams made after the waiting one in the stream-mapping probe: past the 32 queues.
const MAP_STREAMS: usize = 40;
/// How long each mapping probe's spinner waits.
const MAP_LIMIT: std::time::Duration = std::time::Duration::from_millis(50);

/// The stream-mapping probe's line: which of the streams made after a waiting one share its
/// hardware queue (issue #28: does the driver assign queues round-robin in creation order, and
/// does a destroyed stream's queue come back?).
fn map_row(var: &str, keep: bool, r: mscclpp::Result<Vec<bool>>) -> String {
    let how = if keep { "kept alive" } else { "each destroyed before the next is made" };
    let what = match r {
        Ok(b) => {
            let hit: Vec<String> =
                b.iter().enumerate().filter(|(_, x)| **x).map(|(i, _)| (i + 1).to_string()).collect();
            if hit.is_empty() {
                format!("none of {} shared its queue", b.len())
            } else {
                format!("blocked (sharing its queue): stream {} of {}", hit.join(", "), b.len())
            }
        }
        Err(e) => format!("failed: {e}"),
    };
    format!(
        "hardware queues ({VAR}={var}): stream mapping, streams made one after another after a waiting stream ({how}), \
         a cuStreamWriteValue64 from each behind the waiting stream's spinner and queued launch: {what}"
    )
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
        let mut cmd = std::process::Command::new(&exe);
        cmd.args(["device", PROBE_FLAG, "--device", &device.to_string()]).env(VAR, q.to_string());
        match run_child(cmd, CHILD_LIMIT) {
            Ok((true, out, _)) => rows.extend(out.lines().map(str::to_string)),
            Ok((false, out, err)) => {
                rows.extend(out.lines().map(str::to_string));
                rows.push(format!("hardware queues ({VAR}={q}): the probe failed: {}", err.trim()));
            }
            Err(e) => rows.push(format!("hardware queues ({VAR}={q}): {e}")),
        }
    }
    rows
}

/// How long one probe child may take (16 probes of at most ~0.2 s each, 80 mapping probes of at
/// most ~0.06 s each, plus CUDA's start).
const CHILD_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs a probe child: `(succeeded, stdout, stderr)`, or why it could not run (it is killed
/// once it has run `limit`).
fn run_child(mut cmd: std::process::Command, limit: std::time::Duration) -> Result<(bool, String, String), String> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the probe: {e}"))?;
    // The pipes are drained on threads, so a chatty child never blocks on a full pipe.
    fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<String> {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    }
    let (out, err) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let t0 = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Ok(st),
            Ok(None) if t0.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("the probe was still running after {limit:?} and was killed"));
            }
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(20)),
            Err(e) => break Err(format!("waiting for the probe: {e}")),
        }
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    status.map(|st| (st.success(), out, err))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Duration;

    #[test]
    fn a_child_reports_its_output_and_status() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo row; echo why >&2; exit 3"]);
        assert_eq!(run_child(c, Duration::from_secs(30)).unwrap(), (false, "row\n".into(), "why\n".into()));
        let mut c = Command::new("sh");
        c.args(["-c", "echo fine"]);
        assert_eq!(run_child(c, Duration::from_secs(30)).unwrap(), (true, "fine\n".into(), String::new()));
    }

    #[test]
    fn the_mapping_row_names_the_blocked_streams_from_one() {
        let r = map_row("32", true, Ok(vec![false, true, false, true]));
        assert!(r.contains("kept alive") && r.ends_with("stream 2, 4 of 4"), "{r}");
        let r = map_row("32", false, Ok(vec![false; 3]));
        assert!(r.contains("each destroyed") && r.ends_with("none of 3 shared its queue"), "{r}");
    }

    #[test]
    fn a_child_past_its_limit_is_killed() {
        let mut c = Command::new("sleep");
        c.arg("30");
        let e = run_child(c, Duration::from_millis(100)).unwrap_err();
        assert!(e.contains("killed"), "{e}");
    }
}
