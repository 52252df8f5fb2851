//! The results: a table on stdout, JSON records, and an SVG plot.

use std::path::Path;

use serde::Serialize;

/// One message size.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    /// Bytes per message.
    pub size: u64,
    /// Our one-way bandwidth (nccl-tests' algbw), GB/s.
    pub ours_gbps: f64,
    /// The raw baseline's bandwidth, GB/s.
    pub baseline_gbps: f64,
    /// Our write+signal round trip, µs.
    pub ours_rtt_us: f64,
    /// The raw baseline's ping-pong round trip, µs.
    pub baseline_rtt_us: f64,
    /// Timed iterations of the bandwidth test.
    pub bw_iters: u64,
    /// Timed iterations of the round-trip test.
    pub lat_iters: u64,
}

impl Record {
    /// Ours over the baseline, bandwidth (higher is better for us).
    pub fn bw_ratio(&self) -> f64 {
        self.ours_gbps / self.baseline_gbps
    }
    /// Ours over the baseline, round trip (lower is better for us).
    pub fn rtt_ratio(&self) -> f64 {
        self.ours_rtt_us / self.baseline_rtt_us
    }
}

/// A whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub test: String,
    pub transport: String,
    pub memory: String,
    pub baseline: String,
    pub ranks: usize,
    pub interface: String,
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

#[derive(Serialize)]
struct JsonRecord<'a> {
    test: &'a str,
    transport: &'a str,
    memory: &'a str,
    size: u64,
    ours_gbps: f64,
    baseline_gbps: f64,
    bw_ratio: f64,
    ours_rtt_us: f64,
    baseline_rtt_us: f64,
    rtt_ratio: f64,
    bw_iters: u64,
    lat_iters: u64,
}

impl Report {
    /// Prints the table.
    pub fn print(&self) {
        println!(
            "# mscclpp-perf {}: transport {}, memory {}, {} ranks, interface {}",
            self.test, self.transport, self.memory, self.ranks, self.interface
        );
        println!("# baseline: {}", self.baseline);
        println!(
            "# {:>10}  {:>10} {:>10} {:>6}  {:>11} {:>11} {:>6}",
            "size", "ours GB/s", "base GB/s", "ratio", "ours rtt us", "base rtt us", "ratio"
        );
        for r in &self.records {
            println!(
                "  {:>10}  {:>10.3} {:>10.3} {:>6.2}  {:>11.1} {:>11.1} {:>6.2}",
                human(r.size),
                r.ours_gbps,
                r.baseline_gbps,
                r.bw_ratio(),
                r.ours_rtt_us,
                r.baseline_rtt_us,
                r.rtt_ratio()
            );
        }
    }

    /// Writes a JSON array, one record per size.
    pub fn write_json(&self, path: &Path) -> Result<(), String> {
        let recs: Vec<JsonRecord<'_>> = self
            .records
            .iter()
            .map(|r| JsonRecord {
                test: &self.test,
                transport: &self.transport,
                memory: &self.memory,
                size: r.size,
                ours_gbps: r.ours_gbps,
                baseline_gbps: r.baseline_gbps,
                bw_ratio: r.bw_ratio(),
                ours_rtt_us: r.ours_rtt_us,
                baseline_rtt_us: r.baseline_rtt_us,
                rtt_ratio: r.rtt_ratio(),
                bw_iters: r.bw_iters,
                lat_iters: r.lat_iters,
            })
            .collect();
        let text = serde_json::to_string_pretty(&recs).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Draws bandwidth against size, ours and the baseline, log-log.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        use plotters::prelude::*;
        let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
        let pts = |f: &dyn Fn(&Record) -> f64| -> Vec<(f64, f64)> {
            self.records.iter().map(|r| (r.size as f64, f(r).max(1e-6))).collect()
        };
        let ours = pts(&|r| r.ours_gbps);
        let base = pts(&|r| r.baseline_gbps);
        let xmin = ours.first().map(|p| p.0).unwrap_or(1.0);
        let xmax = ours.last().map(|p| p.0).unwrap_or(2.0).max(xmin * 2.0);
        let ymax = ours.iter().chain(&base).map(|p| p.1).fold(1e-3, f64::max) * 2.0;
        let ymin = ours.iter().chain(&base).map(|p| p.1).fold(f64::MAX, f64::min).min(ymax / 10.0) / 2.0;
        let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let title = format!("mscclpp-perf {} over {} ({} memory)", self.test, self.transport, self.memory);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d((xmin..xmax).log_scale(), (ymin..ymax).log_scale())
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("message size")
            .y_desc("bandwidth, GB/s")
            .x_label_formatter(&|x| human(*x as u64))
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(LineSeries::new(ours.clone(), BLUE.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("mscclpp {}", self.transport))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart.draw_series(ours.iter().map(|p| Circle::new(*p, 3, BLUE.filled()))).map_err(|e| err(&e))?;
        chart
            .draw_series(LineSeries::new(base.clone(), RED.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("baseline")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart.draw_series(base.iter().map(|p| Circle::new(*p, 3, RED.filled()))).map_err(|e| err(&e))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))
    }
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
}
