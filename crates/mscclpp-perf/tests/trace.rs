//! Trace files of several ranks load together: the rank is the pid, times are on one wall clock,
//! and a long run stays within `MSCCLPP_TRACE_MAX_MIB`.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

fn wall_us() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64() * 1e6
}

fn load(p: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(v)) => v,
        other => panic!("{} is not a JSON array: {other:?}", p.display()),
    }
}

/// (first start, last end) of the `write` slices.
fn write_span(events: &[Value]) -> (f64, f64) {
    let w: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "write")
        .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
        .collect();
    assert!(!w.is_empty(), "no write slices");
    (w.iter().map(|x| x.0).fold(f64::MAX, f64::min), w.iter().map(|x| x.1).fold(0.0, f64::max))
}

#[test]
fn two_ranks_trace_with_their_rank_as_pid_on_the_wall_clock() {
    let dir = std::env::temp_dir().join(format!("mscclpp-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t0 = wall_us();
    let out = Command::new(env!("CARGO_BIN_EXE_mscclpp-perf"))
        .args(["--max-bytes", "1K", "--iters", "30", "--warmup", "2", "--quiet"])
        .env("MSCCLPP_TRACE_FILE", dir.join("t.json"))
        .output()
        .unwrap();
    let t1 = wall_us();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ranks = [load(&dir.join("t.json")), load(&dir.join("t.rank1.json"))];
    let mut spans = Vec::new();
    for (rank, ev) in ranks.iter().enumerate() {
        assert!(ev.iter().all(|e| e["pid"] == rank), "rank {rank}: every event has pid {rank}");
        let pname = ev.iter().find(|e| e["name"] == "process_name").expect("process_name");
        assert!(pname["args"]["name"].as_str().unwrap().starts_with(&format!("rank {rank} (")), "{pname}");
        for e in ev.iter().filter(|e| e["ph"] != "M") {
            let ts = e["ts"].as_f64().unwrap();
            assert!(ts >= t0 && ts <= t1, "rank {rank}: {e} is not between {t0} and {t1} (wall clock, us)");
        }
        assert_eq!(ev.last().unwrap()["name"], "trace end", "rank {rank}: no truncation below the limit");
        spans.push(write_span(ev));
    }
    // Both ranks wrote during the same stretch of the one clock.
    assert!(spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1, "write slices do not overlap: {spans:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_long_run_stays_within_the_size_limit() {
    let dir = std::env::temp_dir().join(format!("mscclpp-trace-limit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // 1 size x 1000 iterations x 3 spans per rank: about 0.4 MiB untruncated.
    let out = Command::new(env!("CARGO_BIN_EXE_mscclpp-perf"))
        .args(["--max-bytes", "8", "--iters", "1000", "--warmup", "2", "--quiet"])
        .env("MSCCLPP_TRACE_FILE", dir.join("t.json"))
        .env("MSCCLPP_TRACE_MAX_MIB", "0.1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("MSCCLPP_TRACE_MAX_MIB"), "the truncation is announced: {stderr}");
    for name in ["t.json", "t.rank1.json"] {
        let p = dir.join(name);
        let len = std::fs::metadata(&p).unwrap().len();
        assert!(len <= 104_858 + 512, "{name} is {len} bytes, over the 0.1 MiB limit");
        let ev = load(&p);
        let last = ev.last().unwrap();
        assert_eq!(last["name"], "trace truncated", "{name}");
        assert!(last["args"]["dropped_events"].as_u64().is_some_and(|n| n > 0), "{last}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_mscclpp-perf"))
        .env("MSCCLPP_TRACE_FILE", dir.join("u.json"))
        .env("MSCCLPP_TRACE_MAX_MIB", "lots")
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("MSCCLPP_TRACE_MAX_MIB"));
    let _ = std::fs::remove_dir_all(&dir);
}
