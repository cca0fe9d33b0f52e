//! SVG plots written by hand (polylines and `<text>`): no plotting crate and
//! no fonts needed at build time; the viewer renders the labels.

use std::{fmt::Write as _, path::Path};

use crate::CellResult;

const W: f64 = 820.0;
const H: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 230.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 12] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#000000", "#aec7e8",
];

type Series = (String, Vec<(f64, f64)>);

struct Axis {
    label: &'static str,
    log: bool,
}

fn tr(v: f64, log: bool) -> f64 {
    if log {
        v.max(1e-9).log10()
    } else {
        v
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.abs() >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn ticks(lo: f64, hi: f64, log: bool) -> Vec<f64> {
    if log {
        let (a, b) = (lo.floor() as i32, hi.ceil() as i32);
        (a..=b).map(|e| 10f64.powi(e)).collect()
    } else {
        (0..=5).map(|i| lo + (hi - lo) * i as f64 / 5.0).collect()
    }
}

fn chart(title: &str, x: Axis, y: Axis, series: &[Series]) -> String {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(a, b) in pts {
        let (a, b) = (tr(a, x.log), tr(b, y.log));
        x0 = x0.min(a);
        x1 = x1.max(a);
        y0 = y0.min(b);
        y1 = y1.max(b);
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if !y.log {
        y0 = y0.min(0.0);
    } else {
        y0 = y0.floor();
        y1 = y1.ceil();
    }
    if x.log {
        x0 = x0.floor();
        x1 = x1.ceil();
    }
    if (x1 - x0).abs() < 1e-12 {
        x1 = x0 + 1.0;
    }
    if (y1 - y0).abs() < 1e-12 {
        y1 = y0 + 1.0;
    }
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let px = |v: f64| LEFT + (tr(v, x.log) - x0) / (x1 - x0) * pw;
    let py = |v: f64| TOP + ph - (tr(v, y.log) - y0) / (y1 - y0) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>
<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>
"##,
        LEFT + pw / 2.0,
        esc(title)
    );
    let xt = ticks(x0, x1, x.log);
    for t in xt {
        let v = t;
        let xx = LEFT + (tr(v, x.log) - x0) / (x1 - x0) * pw;
        if !(LEFT - 0.5..=LEFT + pw + 0.5).contains(&xx) {
            continue;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#ddd"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 16.0,
            fmt_tick(v)
        );
    }
    for t in ticks(y0, y1, y.log) {
        let yy = TOP + ph - (tr(t, y.log) - y0) / (y1 - y0) * ph;
        if !(TOP - 0.5..=TOP + ph + 0.5).contains(&yy) {
            continue;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0,
            fmt_tick(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>"#,
        LEFT + pw / 2.0,
        H - 12.0,
        esc(x.label),
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        esc(y.label)
    );
    for (i, (name, p)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<String> = p
            .iter()
            .map(|&(a, b)| format!("{:.1},{:.1}", px(a), py(b)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        for pt in &points {
            if p.len() <= 12 {
                if let Some((a, b)) = pt.split_once(',') {
                    let _ = writeln!(s, r#"<circle cx="{a}" cy="{b}" r="3" fill="{color}"/>"#);
                }
            }
        }
        let ly = TOP + 10.0 + i as f64 * 18.0;
        let lx = LEFT + pw + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{:.1}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn find<'a>(results: &'a [CellResult], imp: &str, scenario: &str) -> Option<&'a CellResult> {
    results
        .iter()
        .find(|r| r.implementation == imp && r.scenario.name == scenario)
}

fn impl_names(results: &[CellResult]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for r in results {
        if !names.contains(&r.implementation) {
            names.push(r.implementation.clone());
        }
    }
    names
}

/// Writes `throughput_vs_tasks.svg`, `handoff_cdf.svg` and `fairness.svg`
/// into `dir` from the results; returns the file names written.
///
/// # Errors
///
/// When a file cannot be written.
pub fn write_plots(dir: &Path, results: &[CellResult]) -> std::io::Result<Vec<String>> {
    let names = impl_names(results);
    let mut written = Vec::new();

    // Throughput vs tasks: 1 (uncontended), 16 and 50 on one key, hold 0, no think.
    let mut tp = Vec::new();
    for n in &names {
        let p: Vec<(f64, f64)> = [
            (1.0, "uncontended".to_owned()),
            (16.0, "contended-16-h0-t0".to_owned()),
            (50.0, "contended-50-h0-t0".to_owned()),
        ]
        .iter()
        .filter_map(|(x, sc)| find(results, n, sc).map(|r| (*x, r.acq_per_s.max(0.1))))
        .collect();
        if p.len() > 1 {
            tp.push((n.clone(), p));
        }
    }
    // Hand-off gap CDF at 16 tasks, hold 20 ms, no think (a waiter is always there).
    let mut cdf = Vec::new();
    for n in &names {
        if let Some(r) = find(results, n, "contended-16-h20-t0") {
            if !r.handoff_cdf_ms.is_empty() {
                let p = r
                    .handoff_cdf_ms
                    .iter()
                    .enumerate()
                    .map(|(i, &g)| (g.max(0.01), i as f64))
                    .collect();
                cdf.push((n.clone(), p));
            }
        }
    }
    // Fairness: per-task acquisitions / mean, sorted, 50 tasks, hold 20 ms, no think.
    let mut fair = Vec::new();
    for n in &names {
        if let Some(r) = find(results, n, "contended-50-h20-t0") {
            let mean = r.per_task.iter().sum::<u64>() as f64 / r.per_task.len().max(1) as f64;
            if mean > 0.0 {
                let mut v = r.per_task.clone();
                v.sort_unstable_by(|a, b| b.cmp(a));
                let p = v
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| ((i + 1) as f64, c as f64 / mean))
                    .collect();
                fair.push((n.clone(), p));
            }
        }
    }
    let plots = [
        (
            "throughput_vs_tasks.svg",
            chart(
                "Acquisitions/s vs tasks (one key, hold 0, no think)",
                Axis {
                    label: "tasks",
                    log: true,
                },
                Axis {
                    label: "acquisitions/s (log)",
                    log: true,
                },
                &tp,
            ),
            !tp.is_empty(),
        ),
        (
            "handoff_cdf.svg",
            chart(
                "Hand-off gap to a waiting task, CDF (16 tasks, hold 20 ms)",
                Axis {
                    label: "gap, ms (log)",
                    log: true,
                },
                Axis {
                    label: "percentile",
                    log: false,
                },
                &cdf,
            ),
            !cdf.is_empty(),
        ),
        (
            "fairness.svg",
            chart(
                "Per-task acquisitions / mean, sorted (50 tasks, hold 20 ms)",
                Axis {
                    label: "task rank",
                    log: false,
                },
                Axis {
                    label: "acquisitions / mean",
                    log: false,
                },
                &fair,
            ),
            !fair.is_empty(),
        ),
    ];
    for (file, body, any) in plots {
        if any {
            std::fs::write(dir.join(file), body)?;
            written.push(file.to_owned());
        }
    }
    Ok(written)
}
