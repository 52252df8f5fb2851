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
