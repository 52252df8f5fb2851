//! The results: a table on stdout (a row as each size finishes), JSON with the run's metadata,
//! and SVG plots (one chart helper for every subcommand).

use std::io::Write;
use std::path::Path;

use serde::Serialize;

/// The lowest, middle and highest of several rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stat {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Stat {
    /// Of the finite values in `v` (NaN marks "not measured"); all NaN when none is.
    pub fn of(v: &[f64]) -> Stat {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Stat { min: f64::NAN, median: f64::NAN, max: f64::NAN };
        }
        v.sort_by(f64::total_cmp);
        Stat { min: v[0], median: v[(v.len() - 1) / 2], max: v[v.len() - 1] }
    }
    /// Each value mapped by a decreasing function (seconds to bandwidth): min and max swap.
    pub fn inverse(&self, f: impl Fn(f64) -> f64) -> Stat {
        Stat { min: f(self.max), median: f(self.median), max: f(self.min) }
    }
    /// Each value mapped by an increasing function.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Stat {
        Stat { min: f(self.min), median: f(self.median), max: f(self.max) }
    }
}

/// One message size. Times are the slowest rank's, per round; the stats are over rounds.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    /// Bytes per message.
    pub size: u64,
    /// Microseconds per message in the bandwidth test (ours).
    pub time_us: Stat,
    /// Our bandwidth per sending rank (nccl-tests' algbw), GB/s.
    pub ours_gbps: Stat,
    /// The raw baseline's bandwidth, GB/s.
    pub baseline_gbps: Stat,
    /// Our write+signal round trip, µs.
    pub ours_rtt_us: Stat,
    /// The raw baseline's round trip, µs.
    pub baseline_rtt_us: Stat,
    /// Ours over the baseline (medians), bandwidth: higher is better for us.
    pub bw_ratio: f64,
    /// Ours over the baseline (medians), round trip: lower is better for us.
    pub rtt_ratio: f64,
    /// Timed iterations of the bandwidth test.
    pub bw_iters: u64,
    /// Timed iterations of the round-trip test.
    pub lat_iters: u64,
    /// With `-c`: bytes that differed from what the sender wrote, over all receivers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<u64>,
}

/// Where one rank ran.
#[derive(Clone, Debug, Serialize)]
pub struct RankInfo {
    pub rank: usize,
    pub host: String,
    pub pid: u32,
    pub device: String,
}

/// What the run was: printed as the table's header and written at the top of the JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    /// mscclpp-perf's version.
    pub version: String,
    pub test: String,
    pub transport: String,
    pub memory: String,
    /// Who writes to whom.
    pub pattern: String,
    pub baseline: String,
    pub ranks: usize,
    /// One entry per rank.
    pub hosts: Vec<RankInfo>,
    pub interface: String,
    pub rounds: u64,
    pub warmup: u64,
    /// `-n`, when given (otherwise per size, in the records).
    pub iters: Option<u64>,
    pub check: bool,
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub meta: Meta,
    pub records: Vec<Record>,
}

/// `1.5 MiB`-style sizes.
pub fn human(b: u64) -> String {
    const U: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < 3 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 { format!("{v:.0} {}", U[i]) } else { format!("{v:.1} {}", U[i]) }
}

impl Report {
    /// The header lines (run, pattern, baseline, one line per rank, column names).
    pub fn header(&self) -> Vec<String> {
        let m = &self.meta;
        let mut out = vec![
            format!(
                "# mscclpp-perf {} {}: transport {}, memory {}, {} ranks, interface {}, {} rounds, warmup {}",
                m.version, m.test, m.transport, m.memory, m.ranks, m.interface, m.rounds, m.warmup
            ),
            format!("# pattern: {}", m.pattern),
            format!("# baseline: {}", m.baseline),
        ];
        for h in &m.hosts {
            out.push(format!("#   rank {:>3}: host {}, pid {}, device {}", h.rank, h.host, h.pid, h.device));
        }
        out.push("# times: slowest rank per round, median of the rounds".into());
        let mut cols = format!(
            "# {:>11} {:>7} {:>10}  {:>10} {:>10} {:>6}  {:>10} {:>10} {:>6}",
            "size(B)", "iters", "time(us)", "ours GB/s", "base GB/s", "ratio", "rtt(us)", "base(us)", "ratio"
        );
        if m.check {
            cols += &format!(" {:>7}", "#wrong");
        }
        out.push(cols);
        out
    }

    /// One table row.
    pub fn row(&self, r: &Record) -> String {
        let mut s = format!(
            "  {:>11} {:>7} {:>10.2}  {:>10.3} {:>10.3} {:>6.2}  {:>10.1} {:>10.1} {:>6.2}",
            r.size,
            r.bw_iters,
            r.time_us.median,
            r.ours_gbps.median,
            r.baseline_gbps.median,
            r.bw_ratio,
            r.ours_rtt_us.median,
            r.baseline_rtt_us.median,
            r.rtt_ratio
        );
        if self.meta.check {
            s += &format!(" {:>7}", r.wrong.map_or("-".to_string(), |w| w.to_string()));
        }
        s
    }

    /// Prints lines at once (flushed: a run that fails later keeps them).
    pub fn emit(lines: &[String]) {
        let mut out = std::io::stdout().lock();
        for l in lines {
            let _ = writeln!(out, "{l}");
        }
        let _ = out.flush();
    }

    /// Writes the run as one JSON object: the metadata and `records`.
    pub fn write_json(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Draws bandwidth and round trip against size, ours and the baseline, log-log, each with
    /// its min-max range as a band.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        use plotters::style::{BLUE, RED};
        let pts = |f: &dyn Fn(&Record) -> f64| -> Vec<(f64, f64)> {
            self.records.iter().map(|r| (r.size as f64, f(r))).filter(|p| p.1.is_finite() && p.1 > 0.0).collect()
        };
        let label = format!("mscclpp {}", self.meta.transport);
        let bw = Panel {
            x_desc: "message size, bytes (k = 1e3, M = 1e6)".into(),
            y_desc: "bandwidth per sender, GB/s".into(),
            x_label: &si_bytes,
            series: vec![
                Series { name: label.clone(), color: BLUE, points: pts(&|r| r.ours_gbps.median) },
                Series { name: "baseline".into(), color: RED, points: pts(&|r| r.baseline_gbps.median) },
            ],
        };
        let lat = Panel {
            x_desc: "message size, bytes (k = 1e3, M = 1e6)".into(),
            y_desc: "round trip, us".into(),
            x_label: &si_bytes,
            series: vec![
                Series { name: label, color: BLUE, points: pts(&|r| r.ours_rtt_us.median) },
                Series { name: "baseline".into(), color: RED, points: pts(&|r| r.baseline_rtt_us.median) },
            ],
        };
        let m = &self.meta;
        let title =
            format!("mscclpp-perf {} over {} ({} memory, {} ranks, medians)", m.test, m.transport, m.memory, m.ranks);
        draw_svg(path, &title, &[bw, lat])
    }
}

/// One line of a chart.
pub struct Series {
    pub name: String,
    pub color: plotters::style::RGBColor,
    pub points: Vec<(f64, f64)>,
}

/// One log-log chart: its axis names (with the unit its tick labels use) and lines.
pub struct Panel<'a> {
    pub x_desc: String,
    pub y_desc: String,
    /// Tick labels of the x axis.
    pub x_label: &'a dyn Fn(f64) -> String,
    pub series: Vec<Series>,
}

/// Tick labels of a log size axis, whose ticks fall on powers of ten: `100 B`, `1 kB`, `10 MB`
/// (decimal, like the GB/s of the bandwidth axis; binary units would label them 9.8 KiB).
pub fn si_bytes(x: f64) -> String {
    const U: [(f64, &str); 4] = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")];
    let (d, u) = U.iter().copied().find(|(d, _)| x >= *d).unwrap_or((1.0, "B"));
    let v = x / d;
    if (v - v.round()).abs() < 1e-6 { format!("{v:.0} {u}") } else { format!("{v:.1} {u}") }
}

/// Tick labels of a log y axis: plain numbers in the axis's unit, as many digits as they need.
fn y_label(y: f64) -> String {
    if y >= 100.0 {
        format!("{y:.0}")
    } else if y >= 1.0 {
        format!("{y:.1}")
    } else {
        let s = format!("{y:.4}");
        s.trim_end_matches('0').to_string()
    }
}

/// Draws `panels` side by side into an SVG file under one caption: the chart code every
/// subcommand shares. Points that are not finite and positive are left out.
pub fn draw_svg(path: &Path, caption: &str, panels: &[Panel<'_>]) -> Result<(), String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    let width = 900 * panels.len().max(1) as u32 - 100 * (panels.len().max(1) as u32 - 1);
    let root = SVGBackend::new(path, (width, 580)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(caption, ("sans-serif", 22)).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let ok = |p: &&(f64, f64)| p.0.is_finite() && p.0 > 0.0 && p.1.is_finite() && p.1 > 0.0;
        let all: Vec<(f64, f64)> = panel.series.iter().flat_map(|s| s.points.iter().filter(ok).copied()).collect();
        let xmin = all.iter().map(|p| p.0).fold(f64::MAX, f64::min).min(1e18);
        let xmax = all.iter().map(|p| p.0).fold(0.0, f64::max).max(xmin * 2.0);
        let ymax = all.iter().map(|p| p.1).fold(1e-9, f64::max) * 2.0;
        let ymin = all.iter().map(|p| p.1).fold(f64::MAX, f64::min).min(ymax / 10.0) / 2.0;
        let (xmin, xmax) = if all.is_empty() { (1.0, 2.0) } else { (xmin / 1.2, xmax * 1.2) };
        let mut chart = ChartBuilder::on(area)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((xmin..xmax).log_scale(), (ymin..ymax).log_scale())
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(panel.x_desc.as_str())
            .y_desc(panel.y_desc.as_str())
            .x_label_formatter(&|x| (panel.x_label)(*x))
            .y_label_formatter(&|y| y_label(*y))
            .draw()
            .map_err(|e| err(&e))?;
        for s in &panel.series {
            let c = s.color;
            let pts: Vec<(f64, f64)> = s.points.iter().filter(ok).copied().collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
            chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled()))).map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(8), "8 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(256 << 20), "256 MiB");
    }

    #[test]
    fn stats_skip_unmeasured_and_invert() {
        let s = Stat::of(&[3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        assert!(Stat::of(&[f64::NAN]).median.is_nan());
        let bw = s.inverse(|t| 6.0 / t);
        assert_eq!((bw.min, bw.median, bw.max), (2.0, 3.0, 6.0));
        assert_eq!(y_label(0.0125), "0.0125");
        assert_eq!(y_label(12.0), "12.0");
        assert_eq!(si_bytes(1000.0), "1 kB");
        assert_eq!(si_bytes(100.0), "100 B");
        assert_eq!(si_bytes(1e7), "10 MB");
    }
}
