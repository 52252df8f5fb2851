//! Opt-in logging set up from the `MSCCLPP_LOG_*` variables.

use crate::env::{LogLevel, env};
use crate::error::{Error, Result};

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

/// Installs a global `tracing` subscriber that prints the library's events.
///
/// Honours `MSCCLPP_LOG_LEVEL` (default `WARN`), `MSCCLPP_LOG_SUBSYS`, `MSCCLPP_LOG_FILE`
/// (append; default stderr) and `RUST_LOG` directives of the forms `target=level` and `level`,
/// which are added last and so win (span and field filters are not supported: the filter is
/// `tracing_subscriber::filter::Targets`, which keeps a regex engine out of users' builds).
/// The library never installs a subscriber on its own.
///
/// # Errors
/// A bad `MSCCLPP_LOG_*` or `RUST_LOG` value, an unopenable log file, or a subscriber already
/// installed.
pub fn init_logging() -> Result<()> {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    use tracing_subscriber::prelude::*;
    let e = env()?;
    let mut d = directives(e.log_level.unwrap_or(LogLevel::Warn), e.log_subsys.as_ref());
    if let Ok(r) = std::env::var("RUST_LOG") {
        d = merge_directives(&d, &r);
    }
    let filter: Targets = d.parse().map_err(|err| Error::invalid_usage(format!("bad log filter {d:?}: {err}")))?;
    let (writer, ansi) = match &e.log_file {
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|err| Error::io(format!("opening MSCCLPP_LOG_FILE {}", path.display()), err))?;
            (BoxMakeWriter::new(std::sync::Mutex::new(f)), false)
        }
        None => (BoxMakeWriter::new(std::io::stderr), true),
    };
    tracing_subscriber::fmt()
        .with_thread_names(true)
        .with_ansi(ansi)
        .with_writer(writer)
        .finish()
        .with(filter)
        .try_init()
        .map_err(|err| Error::invalid_usage(format!("cannot install the log subscriber: {err}")))
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
}
