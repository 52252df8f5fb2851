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

/// Installs a global `tracing` subscriber that prints the library's events.
///
/// Honours `MSCCLPP_LOG_LEVEL` (default `WARN`), `MSCCLPP_LOG_SUBSYS`, `MSCCLPP_LOG_FILE`
/// (append; default stderr) and any `RUST_LOG` directives, which are added last and so win.
/// The library never installs a subscriber on its own.
///
/// # Errors
/// A bad `MSCCLPP_LOG_*` value, an unopenable log file, or a subscriber already installed.
pub fn init_logging() -> Result<()> {
    use tracing_subscriber::EnvFilter;
    let e = env()?;
    let mut d = directives(e.log_level.unwrap_or(LogLevel::Warn), e.log_subsys.as_ref());
    if let Ok(r) = std::env::var("RUST_LOG") {
        if !r.trim().is_empty() {
            d = format!("{d},{r}");
        }
    }
    let filter = EnvFilter::try_new(&d).map_err(|err| Error::invalid_usage(format!("bad log filter {d:?}: {err}")))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_thread_names(true);
    let res = match &e.log_file {
        Some(path) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|err| Error::io(format!("opening MSCCLPP_LOG_FILE {}", path.display()), err))?;
            builder.with_ansi(false).with_writer(std::sync::Mutex::new(f)).try_init()
        }
        None => builder.with_writer(std::io::stderr).try_init(),
    };
    res.map_err(|err| Error::invalid_usage(format!("cannot install the log subscriber: {err}")))
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
}
