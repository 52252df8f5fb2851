//! `init_logging` in real processes (each test re-runs this binary as a child, since a process
//! installs one subscriber): the `[host:pid:rank]` prefix, no colour codes into a pipe,
//! `MSCCLPP_LOG_FILE` patterns, MSCCL++'s subsystem names and the deprecated variable names.

use std::path::PathBuf;
use std::process::{Command, Output};

use mscclpp::TcpBootstrap;

const CHILD: &str = "MSCCLPP_LOGGING_TEST_CHILD";

/// What a child does: log before and after its bootstrap sets the rank.
fn child_body() {
    mscclpp::init_logging().unwrap();
    tracing::warn!(target: "mscclpp::net", "net event before bootstrap");
    let id = TcpBootstrap::create_unique_id().unwrap();
    let _bs = TcpBootstrap::initialize(0, 1, &id).unwrap();
    tracing::warn!(target: "mscclpp::net", "net event after bootstrap");
    tracing::warn!(target: "mscclpp::conn", "conn event after bootstrap");
    tracing::info!(target: "mscclpp::gpu", "gpu info event");
    tracing::debug!(target: "mscclpp::gpu", "gpu debug event");
    tracing::trace!(target: "mscclpp::gpu", "gpu trace event");
}

/// Runs test `name` as a child with `env` (and no inherited log settings); returns its output
/// and pid.
fn child(name: &str, env: &[(&str, String)]) -> (Output, u32) {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--nocapture", "--test-threads=1"]).env(CHILD, "1");
    for k in ["RUST_LOG", "MSCCLPP_LOG_LEVEL", "MSCCLPP_LOG_SUBSYS", "MSCCLPP_LOG_FILE", "MSCCLPP_DEBUG"] {
        c.env_remove(k);
    }
    c.env_remove("MSCCLPP_DEBUG_SUBSYS");
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let ch = c.spawn().unwrap();
    let pid = ch.id();
    let out = ch.wait_with_output().unwrap();
    assert!(out.status.success(), "child failed:\n{}", String::from_utf8_lossy(&out.stderr));
    (out, pid)
}

fn host() -> String {
    nix::unistd::gethostname().unwrap().to_string_lossy().into_owned()
}

fn line_with<'a>(text: &'a str, what: &str) -> &'a str {
    text.lines().find(|l| l.contains(what)).unwrap_or_else(|| panic!("no line with {what:?} in:\n{text}"))
}

#[test]
fn stderr_lines_carry_host_pid_rank_and_no_colour() {
    if std::env::var(CHILD).is_ok() {
        return child_body();
    }
    let (out, pid) = child(
        "stderr_lines_carry_host_pid_rank_and_no_colour",
        &[("MSCCLPP_LOG_SUBSYS", "EXEC,NET,NCCL".into()), ("MSCCLPP_LOG_LEVEL", "WARN".into())],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let h = host();
    assert!(line_with(&err, "net event before").starts_with(&format!("[{h}:{pid}:-] ")), "{err}");
    assert!(line_with(&err, "net event after").starts_with(&format!("[{h}:{pid}:0] ")), "{err}");
    assert!(!err.contains('\x1b'), "colour codes into a pipe:\n{err}");
    // MSCCL++'s EXEC and NCCL: accepted, warned about once, and only NET's events shown
    assert_eq!(err.matches("have no counterpart").count(), 1, "{err}");
    assert!(line_with(&err, "have no counterpart").contains("EXEC, NCCL"), "{err}");
    assert!(!err.contains("conn event"), "{err}");
}

#[test]
fn deprecated_debug_variables_are_read_with_a_warning() {
    if std::env::var(CHILD).is_ok() {
        return child_body();
    }
    let (out, _) = child(
        "deprecated_debug_variables_are_read_with_a_warning",
        &[("MSCCLPP_DEBUG", "WARN".into()), ("MSCCLPP_DEBUG_SUBSYS", "CONN".into())],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MSCCLPP_DEBUG is deprecated: use MSCCLPP_LOG_LEVEL"), "{err}");
    assert!(err.contains("MSCCLPP_DEBUG_SUBSYS is deprecated: use MSCCLPP_LOG_SUBSYS"), "{err}");
    assert!(err.contains("conn event after") && !err.contains("net event"), "{err}");
}

#[test]
fn log_file_pattern_gives_one_file_per_process_and_rank() {
    if std::env::var(CHILD).is_ok() {
        return child_body();
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("mscclpp-logging-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("log.%h.%p.%r.txt").to_string_lossy().into_owned();
    let name = "log_file_pattern_gives_one_file_per_process_and_rank";
    let (a, pa) = child(name, &[("MSCCLPP_LOG_FILE", pattern.clone())]);
    let (_, pb) = child(name, &[("MSCCLPP_LOG_FILE", pattern)]);
    assert!(!String::from_utf8_lossy(&a.stderr).contains("net event"), "logged to stderr too");
    let h = host();
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let mut want: Vec<String> =
        [pa, pb].iter().flat_map(|p| [format!("log.{h}.{p}.-.txt"), format!("log.{h}.{p}.0.txt")]).collect();
    want.sort();
    assert_eq!(names, want);
    for p in [pa, pb] {
        let before = std::fs::read_to_string(dir.join(format!("log.{h}.{p}.-.txt"))).unwrap();
        let after = std::fs::read_to_string(dir.join(format!("log.{h}.{p}.0.txt"))).unwrap();
        assert!(line_with(&before, "net event before").starts_with(&format!("[{h}:{p}:-] ")), "{before}");
        assert!(!before.contains("after bootstrap"), "{before}");
        assert!(line_with(&after, "net event after").starts_with(&format!("[{h}:{p}:0] ")), "{after}");
        assert!(!after.contains('\x1b'), "{after}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every level of `MSCCLPP_LOG_LEVEL` reaches its events: DEBUG and TRACE too (the fmt
/// subscriber's own INFO ceiling once hid them whatever the variable said).
#[test]
fn debug_and_trace_levels_show_their_events() {
    if std::env::var(CHILD).is_ok() {
        return child_body();
    }
    let name = "debug_and_trace_levels_show_their_events";
    for (level, shown, hidden) in [
        ("WARN", &[][..], &["gpu info event", "gpu debug event", "gpu trace event"][..]),
        ("INFO", &["gpu info event"][..], &["gpu debug event", "gpu trace event"][..]),
        ("DEBUG", &["gpu info event", "gpu debug event"][..], &["gpu trace event"][..]),
        ("TRACE", &["gpu info event", "gpu debug event", "gpu trace event"][..], &[][..]),
    ] {
        let (out, _) = child(name, &[("MSCCLPP_LOG_LEVEL", level.into()), ("MSCCLPP_LOG_SUBSYS", "GPU".into())]);
        let err = String::from_utf8_lossy(&out.stderr);
        for s in shown {
            assert!(err.contains(s), "{level}: no {s:?} in:\n{err}");
        }
        for s in hidden {
            assert!(!err.contains(s), "{level}: {s:?} in:\n{err}");
        }
    }
}
