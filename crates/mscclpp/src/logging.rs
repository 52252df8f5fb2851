//! Opt-in logging set up from the `MSCCLPP_LOG_*` variables.

use crate::env::LogLevel;
use crate::error::{Error, Result};

/// Target of the warnings about the log settings themselves.
const SETTINGS_TARGET: &str = "mscclpp::logging";

/// `tracing` target of each `MSCCLPP_LOG_SUBSYS` name.
const TARGETS: [(&str, &str); 7] = [
    ("ENV", "mscclpp::env"),
    ("GPU", "mscclpp::gpu"),
    ("NET", "mscclpp::net"),
    ("CONN", "mscclpp::conn"),
    ("IB", "mscclpp::ib"),
    ("BOOTSTRAP", "mscclpp::bootstrap"),
    ("PROXY", "mscclpp::proxy"),
];

fn level_name(l: LogLevel) -> &'static str {
    match l {
        LogLevel::None => "off",
        LogLevel::Error => "error",
        LogLevel::Warn => "warn",
        LogLevel::Info => "info",
        LogLevel::Debug => "debug",
        LogLevel::Trace => "trace",
    }
}

/// The `tracing` filter directives for a level and a subsystem selection.
pub(crate) fn directives(level: LogLevel, subsys: Option<&(bool, Vec<String>)>) -> String {
    let lv = level_name(level);
    match subsys {
        None => format!("mscclpp={lv}"),
        Some((_, names)) if names.iter().any(|n| n == "ALL") => format!("mscclpp={lv}"),
        Some((inverted, names)) => {
            let (base, each) = if *inverted { (lv, "off") } else { ("off", lv) };
            let mut d = vec![format!("mscclpp={base}")];
            for (n, t) in TARGETS {
                if names.iter().any(|x| x == n) {
                    d.push(format!("{t}={each}"));
                }
            }
            d.join(",")
        }
    }
}

/// `base` followed by `extra` (comma-separated `target=level` or bare `level` directives), where a
/// later directive for the same target replaces an earlier one, so `extra` wins.
pub(crate) fn merge_directives(base: &str, extra: &str) -> String {
    let mut out: Vec<(String, String)> = Vec::new();
    for d in base.split(',').chain(extra.split(',')).map(str::trim).filter(|d| !d.is_empty()) {
        let target = d.split_once('=').map_or("", |(t, _)| t).to_string();
        out.retain(|(t, _)| *t != target);
        out.push((target, d.to_string()));
    }
    out.into_iter().map(|(_, d)| d).collect::<Vec<_>>().join(",")
}

/// `MSCCLPP_LOG_FILE`'s pattern with `%h` (host), `%p` (pid), `%r` (rank, `-` when unknown) and
/// `%%` replaced; any other `%` is kept as written.
pub(crate) fn expand_log_path(pattern: &str, host: &str, pid: u32, rank: Option<usize>) -> String {
    let mut out = String::with_capacity(pattern.len() + 16);
    let mut it = pattern.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.peek() {
            Some('h') => out.push_str(host),
            Some('p') => out.push_str(&pid.to_string()),
            Some('r') => out.push_str(&rank.map_or_else(|| "-".to_string(), |r| r.to_string())),
            Some('%') => out.push('%'),
            _ => {
                out.push('%');
                continue;
            }
        }
        it.next();
    }
    out
}

/// The `[host:pid:rank]` in front of every line (`-` for the rank until the bootstrap sets it).
pub(crate) fn line_prefix(host: &str, pid: u32, rank: Option<usize>) -> String {
    format!("[{host}:{pid}:{}] ", rank.map_or_else(|| "-".to_string(), |r| r.to_string()))
}

fn host_name() -> String {
    nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "?".into())
}

/// Puts [`line_prefix`] in front of what the default format writes.
struct Prefixed<F> {
    inner: F,
    host: String,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for Prefixed<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        writer.write_str(&line_prefix(&self.host, std::process::id(), crate::identity::process_rank()))?;
        self.inner.format_event(ctx, writer.by_ref(), event)
    }
}

/// The log file of `MSCCLPP_LOG_FILE`: the pattern is expanded for every line, and the file
/// reopened when the expansion changes (the rank becoming known, a fork changing the pid).
struct LogFile {
    pattern: String,
    host: String,
    open: std::sync::Mutex<Option<(String, std::fs::File)>>,
}

impl LogFile {
    fn path_now(&self) -> String {
        expand_log_path(&self.pattern, &self.host, std::process::id(), crate::identity::process_rank())
    }

    fn open(path: &str) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new().create(true).append(true).open(path)
    }

    fn write_line(&self, buf: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let path = self.path_now();
        let mut g = crate::sync::lock(&self.open);
        if g.as_ref().is_none_or(|(p, _)| *p != path) {
            *g = Some((path.clone(), Self::open(&path)?));
        }
        match g.as_mut() {
            Some((_, f)) => f.write_all(buf),
            None => Ok(()),
        }
    }
}

/// One formatted event at a time (the fmt layer writes each event with one `write_all`).
struct LogFileWriter(std::sync::Arc<LogFile>);

impl std::io::Write for LogFileWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write_line(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs a global `tracing` subscriber that prints the library's events.
///
/// Every line starts with `[host:pid:rank]` (rank `-` until a [`TcpBootstrap`](crate::TcpBootstrap)
/// has been initialized in this process). Honours `MSCCLPP_LOG_LEVEL` (default `WARN`),
/// `MSCCLPP_LOG_SUBSYS` (MSCCL++'s names accepted: see [`mod@crate::env`]), `MSCCLPP_LOG_FILE`
/// (append; default stderr; `%h`, `%p`, `%r` become host, pid and rank, so
/// `MSCCLPP_LOG_FILE=log.%h.%p` gives one file per process; with `%r`, lines before the bootstrap
/// go to the file named with rank `-`), the deprecated `MSCCLPP_DEBUG`/`MSCCLPP_DEBUG_SUBSYS`
/// (with a warning), and `RUST_LOG` directives of the forms `target=level` and `level`, which are
/// added last and so win (span and field filters are not supported: the filter is
/// `tracing_subscriber::filter::Targets`, which keeps a regex engine out of users' builds).
/// Colour codes are used only when the output is stderr and stderr is a terminal. Warnings about
/// the settings themselves are logged once, right after installing. The library never installs
/// a subscriber on its own.
///
/// # Errors
/// A bad `MSCCLPP_LOG_*` or `RUST_LOG` value, an unopenable log file, or a subscriber already
/// installed.
pub fn init_logging() -> Result<()> {
    use std::io::IsTerminal;
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    use tracing_subscriber::prelude::*;
    let e = crate::env::env_quiet()?;
    let level = e.log_level.unwrap_or(LogLevel::Warn);
    let mut d = directives(level, e.log_subsys.as_ref());
    if level >= LogLevel::Warn {
        // warnings about the settings pass whatever subsystems are selected
        d = merge_directives(&d, &format!("{SETTINGS_TARGET}=warn"));
    }
    if let Ok(r) = std::env::var("RUST_LOG") {
        d = merge_directives(&d, &r);
    }
    let filter: Targets = d.parse().map_err(|err| Error::invalid_usage(format!("bad log filter {d:?}: {err}")))?;
    let host = host_name();
    let (writer, ansi) = match &e.log_file {
        Some(pattern) => {
            let file = LogFile {
                pattern: pattern.to_string_lossy().into_owned(),
                host: host.clone(),
                open: Default::default(),
            };
            let path = file.path_now();
            // open now, so a bad path is this call's error rather than silence later
            let f = LogFile::open(&path)
                .map_err(|err| Error::io(format!("opening MSCCLPP_LOG_FILE {path} (pattern {})", file.pattern), err))?;
            *crate::sync::lock(&file.open) = Some((path, f));
            let file = std::sync::Arc::new(file);
            (BoxMakeWriter::new(move || LogFileWriter(file.clone())), false)
        }
        None => (BoxMakeWriter::new(std::io::stderr), std::io::stderr().is_terminal()),
    };
    let format = Prefixed { inner: tracing_subscriber::fmt::format().with_thread_names(true).with_ansi(ansi), host };
    tracing_subscriber::fmt()
        // The builder's own ceiling is INFO: lift it, so that `filter` alone decides (DEBUG and
        // TRACE were silently dropped before).
        .with_max_level(tracing::level_filters::LevelFilter::TRACE)
        .with_ansi(ansi)
        .with_writer(writer)
        .event_format(format)
        .finish()
        .with(filter)
        .try_init()
        .map_err(|err| Error::invalid_usage(format!("cannot install the log subscriber: {err}")))?;
    for w in &e.log_warnings {
        tracing::warn!(target: SETTINGS_TARGET, "{w}");
    }
    crate::env::warn_unread_once(e);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_directives() {
        assert_eq!(directives(LogLevel::Info, None), "mscclpp=info");
        let sel = (false, vec!["NET".to_string(), "IB".to_string()]);
        assert_eq!(directives(LogLevel::Debug, Some(&sel)), "mscclpp=off,mscclpp::net=debug,mscclpp::ib=debug");
        let inv = (true, vec!["BOOTSTRAP".to_string()]);
        assert_eq!(directives(LogLevel::Warn, Some(&inv)), "mscclpp=warn,mscclpp::bootstrap=off");
        let all = (false, vec!["ALL".to_string()]);
        assert_eq!(directives(LogLevel::None, Some(&all)), "mscclpp=off");
    }

    #[test]
    fn later_directives_win_and_parse_without_env_filter() {
        let d = merge_directives("mscclpp=warn,mscclpp::ib=off", " mscclpp::ib=debug,info");
        assert_eq!(d, "mscclpp=warn,mscclpp::ib=debug,info");
        let t: tracing_subscriber::filter::Targets = d.parse().unwrap();
        assert!(t.would_enable("mscclpp::ib", &tracing::Level::DEBUG));
        assert!(!t.would_enable("mscclpp::net", &tracing::Level::INFO));
        assert!(t.would_enable("other", &tracing::Level::INFO));
        assert_eq!(merge_directives("mscclpp=warn", ""), "mscclpp=warn");
    }

    #[test]
    fn log_paths_expand() {
        assert_eq!(expand_log_path("/tmp/l.%h.%p.%r.txt", "node7", 42, Some(3)), "/tmp/l.node7.42.3.txt");
        assert_eq!(expand_log_path("l.%r", "h", 1, None), "l.-");
        assert_eq!(expand_log_path("100%%-%x-%", "h", 1, None), "100%-%x-%");
        assert_eq!(expand_log_path("plain.log", "h", 1, Some(0)), "plain.log");
        assert_eq!(line_prefix("node7", 42, Some(3)), "[node7:42:3] ");
        assert_eq!(line_prefix("node7", 42, None), "[node7:42:-] ");
    }
}
