//! Chrome trace files (open them in Perfetto or `chrome://tracing`) for the library's spans, one
//! file per rank, made to be loaded together:
//!
//! - the rank is the trace's process id (`pid`), and the process is named
//!   `rank R (host, pid P)`, so two ranks' tracks never merge;
//! - timestamps are the wall clock (microseconds since the Unix epoch; monotonic within a run),
//!   so ranks on one host, or on hosts whose clocks are synchronised, line up;
//! - the file is bounded: after `MSCCLPP_TRACE_MAX_MIB` MiB (default 64, fractions allowed) further events are
//!   dropped and counted, and the file ends with a `trace truncated` event saying how many.
//!
//! Each time a span is entered and left it becomes one complete (`"ph":"X"`) slice on its
//! thread's track; log events become instant events.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The variable bounding a trace file's size, in MiB.
pub const MAX_MIB_VAR: &str = "MSCCLPP_TRACE_MAX_MIB";
const DEFAULT_MAX_MIB: u64 = 64;

struct Inner {
    out: Mutex<Out>,
    pid: usize,
    /// Wall clock at `base`, in microseconds since the epoch.
    base_wall_us: f64,
    base: Instant,
    max_bytes: u64,
}

struct Out {
    w: Option<BufWriter<File>>,
    written: u64,
    dropped: u64,
    /// Write errors end the trace (reported once, on stderr).
    failed: bool,
}

/// The layer to add to a `tracing_subscriber` registry.
pub struct TraceLayer(Arc<Inner>);

/// Ends the file (closing the JSON array) when dropped; keep it alive for the whole run.
pub struct TraceGuard(Arc<Inner>);

/// The size limit from [`MAX_MIB_VAR`], in bytes (checked before ranks start, too).
pub fn max_bytes() -> Result<u64, String> {
    match std::env::var(MAX_MIB_VAR) {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(m) if m > 0.0 && m.is_finite() => Ok((m * 1048576.0) as u64),
            _ => Err(format!("{MAX_MIB_VAR}={v:?} is not a positive number of MiB")),
        },
        Err(_) => Ok(DEFAULT_MAX_MIB << 20),
    }
}

/// Opens `path` for rank `rank`'s trace, with the size limit from [`MAX_MIB_VAR`].
pub fn create(path: &Path, rank: usize) -> Result<(TraceLayer, TraceGuard), String> {
    let max_bytes = max_bytes()?;
    let file = File::create(path).map_err(|e| format!("cannot create the trace file {}: {e}", path.display()))?;
    let base = Instant::now();
    let base_wall_us = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0);
    let inner = Arc::new(Inner {
        out: Mutex::new(Out {
            w: Some(BufWriter::with_capacity(1 << 16, file)),
            written: 0,
            dropped: 0,
            failed: false,
        }),
        pid: rank,
        base_wall_us,
        base,
        max_bytes,
    });
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let name = format!("rank {rank} ({host}, pid {})", std::process::id());
    inner.raw("[\n");
    inner.emit(&serde_json::json!({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}}));
    inner
        .emit(&serde_json::json!({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}));
    Ok((TraceLayer(inner.clone()), TraceGuard(inner)))
}

impl Inner {
    fn now_us(&self) -> f64 {
        self.base_wall_us + self.base.elapsed().as_nanos() as f64 / 1000.0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Out> {
        self.out.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn raw(&self, s: &str) {
        let mut o = self.lock();
        o.write(s);
    }

    /// Appends one event line, or counts it as dropped past the size limit.
    fn emit(&self, v: &Value) {
        let line = format!("{v},\n");
        let mut o = self.lock();
        if o.written + line.len() as u64 > self.max_bytes {
            if o.dropped == 0 && o.w.is_some() {
                eprintln!(
                    "mscclpp-perf: the trace file reached {:.2} MiB ({MAX_MIB_VAR}); later events are dropped",
                    self.max_bytes as f64 / 1048576.0
                );
            }
            o.dropped += 1;
            return;
        }
        o.write(&line);
    }

    /// Writes the closing event and bracket; later events are ignored.
    fn finish(&self) {
        let end = self.now_us();
        let mut o = self.lock();
        let last = if o.dropped > 0 {
            serde_json::json!({"name": "trace truncated", "ph": "i", "s": "g", "ts": end, "pid": self.pid, "tid": 0,
                "args": {"dropped_events": o.dropped, "limit_bytes": self.max_bytes}})
        } else {
            serde_json::json!({"name": "trace end", "ph": "i", "s": "p", "ts": end, "pid": self.pid, "tid": 0})
        };
        o.write(&format!("{last}\n]\n"));
        if let Some(mut w) = o.w.take()
            && let Err(e) = w.flush()
        {
            eprintln!("mscclpp-perf: writing the trace file failed: {e}");
        }
    }
}

impl Out {
    fn write(&mut self, s: &str) {
        let Some(w) = self.w.as_mut() else { return };
        match w.write_all(s.as_bytes()) {
            Ok(()) => self.written += s.len() as u64,
            Err(e) => {
                if !self.failed {
                    eprintln!("mscclpp-perf: writing the trace file failed, tracing stops: {e}");
                }
                self.failed = true;
                self.w = None;
            }
        }
    }
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Small numbers for threads, in the order they first trace (Chrome wants integers).
fn tid() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TID: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    TID.with(|t| *t)
}

/// Whether this thread's name was already written (then marks it written).
fn thread_named() -> bool {
    thread_local!(static NAMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    NAMED.with(|n| n.replace(true))
}

/// A span's fields and the time it was last entered.
struct SpanData {
    args: Map<String, Value>,
    entered: Vec<f64>,
}

struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().into(), v.into());
    }
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        let mut s = String::new();
        let _ = write!(s, "{v:?}");
        self.0.insert(f.name().into(), s.into());
    }
}

impl TraceLayer {
    fn name_thread(&self) -> u64 {
        let t = tid();
        if !thread_named() {
            let cur = std::thread::current();
            let name = cur.name().map(str::to_string).unwrap_or_else(|| format!("thread {t}"));
            self.0.emit(&serde_json::json!({"name": "thread_name", "ph": "M", "pid": self.0.pid, "tid": t,
                "args": {"name": name}}));
        }
        t
    }
}

impl<S> Layer<S> for TraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut args = Map::new();
        attrs.record(&mut Fields(&mut args));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanData { args, entered: Vec::new() });
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(d) = span.extensions_mut().get_mut::<SpanData>()
        {
            values.record(&mut Fields(&mut d.args));
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let now = self.0.now_us();
        if let Some(span) = ctx.span(id)
            && let Some(d) = span.extensions_mut().get_mut::<SpanData>()
        {
            d.entered.push(now);
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        let now = self.0.now_us();
        let Some(span) = ctx.span(id) else { return };
        let (start, args) = {
            let mut ext = span.extensions_mut();
            let Some(d) = ext.get_mut::<SpanData>() else { return };
            let Some(start) = d.entered.pop() else { return };
            (start, d.args.clone())
        };
        let tid = self.name_thread();
        let meta = span.metadata();
        self.0.emit(&serde_json::json!({"name": meta.name(), "cat": meta.target(), "ph": "X", "ts": start,
            "dur": (now - start).max(0.0), "pid": self.0.pid, "tid": tid, "args": args}));
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let now = self.0.now_us();
        let mut args = Map::new();
        event.record(&mut Fields(&mut args));
        let tid = self.name_thread();
        let meta = event.metadata();
        let name =
            args.get("message").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| meta.name().into());
        self.0.emit(&serde_json::json!({"name": name, "cat": meta.target(), "ph": "i", "s": "t", "ts": now,
            "pid": self.0.pid, "tid": tid, "args": args}));
    }
}
