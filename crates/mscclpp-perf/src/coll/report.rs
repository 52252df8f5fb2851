//! The results of a collective sweep: one record per size, the text rows, JSON and SVG.

use serde::Serialize;

use super::Spec;
use crate::kern::e;

/// One placement's numbers (the slowest rank's time).
#[derive(Clone, Debug, Serialize)]
pub struct Placement {
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// With `--check`: wrong elements over all ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<u64>,
    /// With `--nccl`: NCCL's time for the same calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl_time_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nccl_busbw_gbps: Option<f64>,
}

/// One size.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub size: u64,
    pub count: usize,
    pub algorithm: String,
    pub blocks: u32,
    pub threads: u32,
    pub out_of_place: Placement,
    pub in_place: Placement,
    /// `cuMemcpyDtoDAsync` of `size` bytes on the same GPU: wall time per copy.
    pub copy_us: f64,
    pub copy_gbps: f64,
}

/// The whole run (JSON).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub version: String,
    pub test: String,
    pub ranks: usize,
    pub device: u32,
    pub device_name: String,
    pub dtype: String,
    pub redop: String,
    pub warmup: u64,
    pub iters: u64,
    pub graph: bool,
    pub check: bool,
    /// `--algo`, if given (else the selector's choice, per record).
    pub algo: Option<String>,
    /// The NCCL library the `nccl_*` fields come from.
    pub nccl: Option<String>,
    pub nccl_version: Option<String>,
    pub records: Vec<Record>,
}

fn f(v: Option<f64>, w: usize, p: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:>w$.p$}"),
        _ => format!("{:>w$}", "-"),
    }
}

/// The column names (two lines).
pub(super) fn columns(s: &Spec, nccl: bool) -> Vec<String> {
    let group = |title: &str| {
        let mut a = format!("  {:>9}", "time(us)");
        let mut t = format!("  {:>9}", "");
        if nccl {
            a += &format!(" {:>9}", "nccl(us)");
            t += &format!(" {:>9}", "");
        }
        a += &format!(" {:>7} {:>7}", "algbw", "busbw");
        t += &format!(" {:>7} {:>7}", "", "");
        if s.check {
            a += &format!(" {:>6}", "#wrong");
            t += &format!(" {:>6}", "");
        }
        let width = t.len();
        (format!("{title:>width$}"), a)
    };
    let (to, ao) = group("out-of-place");
    let (ti, ai) = group("in-place");
    vec![
        format!("# {:>10} {:>11} {:>5} {:>5}{to}{ti}", "", "", "", ""),
        format!(
            "# {:>10} {:>11} {:>5} {:>5}{ao}{ai}  {:>8} {:>9}",
            "size(B)", "count", "type", "redop", "algo", "copy(us)"
        ),
    ]
}

pub(super) fn row_text(s: &Spec, r: &Record, nccl: bool) -> String {
    let group = |p: &Placement| {
        let mut t = format!("  {}", f(Some(p.time_us), 9, 2));
        if nccl {
            t += &format!(" {}", f(p.nccl_time_us, 9, 2));
        }
        t += &format!(" {} {}", f(Some(p.algbw_gbps), 7, 2), f(Some(p.busbw_gbps), 7, 2));
        if s.check {
            t += &format!(" {:>6}", p.wrong.map_or("-".to_string(), |w| w.to_string()));
        }
        t
    };
    format!(
        "  {:>10} {:>11} {:>5} {:>5}{}{}  {:>8} {}",
        r.size,
        r.count,
        s.dtype.name(),
        s.redop(),
        group(&r.out_of_place),
        group(&r.in_place),
        r.algorithm,
        f(Some(r.copy_us), 9, 2)
    )
}

/// Draws bus bandwidth and time against size: ours (out of place, in place), NCCL's, the copy.
pub(super) fn write_svg(rep: &Report, path: &std::path::Path) -> Result<(), String> {
    use crate::report::{Panel, Series, draw_svg, si_bytes};
    use plotters::style::{BLACK, BLUE, GREEN, MAGENTA, RED};
    let pts = |g: &dyn Fn(&Record) -> Option<f64>| -> Vec<(f64, f64)> {
        rep.records.iter().filter_map(|r| g(r).map(|v| (r.size as f64, v))).collect()
    };
    let mut bw = vec![
        Series { name: "mscclpp out of place".into(), color: BLUE, points: pts(&|r| Some(r.out_of_place.busbw_gbps)) },
        Series { name: "mscclpp in place".into(), color: GREEN, points: pts(&|r| Some(r.in_place.busbw_gbps)) },
        Series { name: "cuMemcpyDtoDAsync (size / time)".into(), color: BLACK, points: pts(&|r| Some(r.copy_gbps)) },
    ];
    let mut time = vec![
        Series { name: "mscclpp out of place".into(), color: BLUE, points: pts(&|r| Some(r.out_of_place.time_us)) },
        Series { name: "mscclpp in place".into(), color: GREEN, points: pts(&|r| Some(r.in_place.time_us)) },
        Series { name: "cuMemcpyDtoDAsync".into(), color: BLACK, points: pts(&|r| Some(r.copy_us)) },
    ];
    if rep.nccl.is_some() {
        bw.push(Series {
            name: "NCCL out of place".into(),
            color: RED,
            points: pts(&|r| r.out_of_place.nccl_busbw_gbps),
        });
        bw.push(Series { name: "NCCL in place".into(), color: MAGENTA, points: pts(&|r| r.in_place.nccl_busbw_gbps) });
        time.push(Series {
            name: "NCCL out of place".into(),
            color: RED,
            points: pts(&|r| r.out_of_place.nccl_time_us),
        });
        time.push(Series { name: "NCCL in place".into(), color: MAGENTA, points: pts(&|r| r.in_place.nccl_time_us) });
    }
    let x_desc = "size, bytes (k = 1e3, M = 1e6)".to_string();
    let panels = [
        Panel { x_desc: x_desc.clone(), y_desc: "bus bandwidth, GB/s".into(), x_label: &si_bytes, series: bw },
        Panel { x_desc, y_desc: "time per call, us".into(), x_label: &si_bytes, series: time },
    ];
    let title = format!(
        "mscclpp-perf {} {} {}: {} ranks on GPU{} ({}), {}",
        rep.test,
        rep.dtype,
        rep.redop,
        rep.ranks,
        rep.device,
        rep.device_name,
        if rep.graph { "graph" } else { "eager" }
    );
    draw_svg(path, &title, &panels)
}

impl Report {
    pub(super) fn write_json(&self, path: &std::path::Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(e)?;
        std::fs::write(path, text + "\n").map_err(|x| format!("writing {}: {x}", path.display()))
    }
}
