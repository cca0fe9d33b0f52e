//! The three SVG plots, drawn with `plotters`' SVG backend.
//!
//! Text is laid out (label areas, tick spacing, legend) with the metrics of
//! DejaVu Sans, compiled in from the `dejavu` crate and registered with
//! plotters' `ab_glyph` font table as `sans-serif`: no system font is read, so
//! the same results give the same bytes on every machine. The SVG names the
//! family `sans-serif`; the viewer renders the glyphs.

use std::{path::Path, sync::OnceLock};

use plotters::{
    coord::{
        ranged1d::{AsRangedCoord, ValueFormatter},
        Shift,
    },
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use crate::CellResult;

const W: u32 = 820;
const H: u32 = 480;
/// Width of the legend column right of the chart.
const LEGEND_W: u32 = 230;
/// The family every text of the plots uses (registered in [`font`]).
const FAMILY: &str = "sans-serif";
/// The series colours (matplotlib's tab10, then black and tab20's light
/// blue, orange and green), as `0xRRGGBB`: one per series of a full run.
const COLORS: [u32; 14] = [
    0x1f77b4, 0xd62728, 0x2ca02c, 0xff7f0e, 0x9467bd, 0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22,
    0x17becf, 0x000000, 0xaec7e8, 0xffbb78, 0x98df8a,
];

/// The colour of series `i`.
fn color(i: usize) -> RGBColor {
    let [_, r, g, b] = COLORS[i % COLORS.len()].to_be_bytes();
    RGBColor(r, g, b)
}
/// Series with at most this many points get a dot on each point.
const MAX_DOTTED: usize = 12;

type Series = (String, Vec<(f64, f64)>);

/// Registers DejaVu Sans as `sans-serif` once per process.
fn font() -> std::io::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::other(
            "the embedded DejaVu Sans font did not parse",
        ))
    }
}

fn other(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("drawing a plot: {e}"))
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

/// One axis: its label and whether it is logarithmic.
struct Axis {
    label: &'static str,
    log: bool,
}

/// The axis range over `values`: whole decades on a log axis; on a linear
/// one, the data's extent, starting at 0 at most when `from_zero`.
fn range(values: impl Iterator<Item = f64>, log: bool, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for v in values {
        let v = if log { v.max(1e-9).log10() } else { v };
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        (lo, hi) = (0.0, 1.0);
    }
    if log {
        (lo, hi) = (lo.floor(), hi.ceil());
    } else if from_zero {
        lo = lo.min(0.0);
    }
    if (hi - lo).abs() < 1e-12 {
        hi = lo + 1.0;
    }
    if log {
        (10f64.powf(lo), 10f64.powf(hi))
    } else {
        (lo, hi)
    }
}

/// Draws one chart (`series` as lines, dots when short) on the left of
/// `root` and its legend in the column right of it.
fn chart_on<X, Y>(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    (x, x_spec): (&Axis, X),
    (y, y_spec): (&Axis, Y),
    series: &[Series],
) -> std::io::Result<()>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    root.fill(&WHITE).map_err(other)?;
    let (plot, legend) = root.split_horizontally(W - LEGEND_W);
    let mut chart = ChartBuilder::on(&plot)
        .caption(title, (FAMILY, 19))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_spec, y_spec)
        .map_err(other)?;
    let light = RGBColor(0xee, 0xee, 0xee);
    let bold = RGBColor(0xcc, 0xcc, 0xcc);
    chart
        .configure_mesh()
        .x_desc(x.label)
        .y_desc(y.label)
        .x_label_formatter(&|v| fmt_tick(*v))
        .y_label_formatter(&|v| fmt_tick(*v))
        .label_style((FAMILY, 15))
        .max_light_lines(4)
        .axis_desc_style((FAMILY, 15))
        .light_line_style(light)
        .bold_line_style(bold)
        .axis_style(RGBColor(0x44, 0x44, 0x44))
        .draw()
        .map_err(other)?;
    for (i, (_, points)) in series.iter().enumerate() {
        let color = color(i);
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(other)?;
        if points.len() <= MAX_DOTTED {
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(other)?;
        }
    }
    // The legend: a colour swatch and the implementation's name per series,
    // top-aligned with the plotting area.
    let top = chart.plotting_area().get_pixel_range().1.start;
    let text = TextStyle::from((FAMILY, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, (name, _)) in series.iter().enumerate() {
        let color = color(i);
        let ly = top + 10 + 18 * i as i32;
        legend
            .draw(&PathElement::new(
                vec![(12, ly), (30, ly)],
                color.stroke_width(3),
            ))
            .map_err(other)?;
        legend
            .draw(&Text::new(name.as_str(), (36, ly), text.clone()))
            .map_err(other)?;
    }
    root.present().map_err(other)
}

/// The SVG text of one chart; axes are logarithmic where the [`Axis`] says.
fn chart(title: &str, x: Axis, y: Axis, series: &[Series]) -> std::io::Result<String> {
    font()?;
    let pts = || series.iter().flat_map(|(_, p)| p.iter());
    let (x0, x1) = range(pts().map(|p| p.0), x.log, false);
    let (y0, y1) = range(pts().map(|p| p.1), y.log, true);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        let x_lin = (&x, x0..x1);
        let y_lin = (&y, y0..y1);
        match (x.log, y.log) {
            (false, false) => chart_on(&root, title, x_lin, y_lin, series)?,
            (true, false) => chart_on(&root, title, (&x, (x0..x1).log_scale()), y_lin, series)?,
            (false, true) => chart_on(&root, title, x_lin, (&y, (y0..y1).log_scale()), series)?,
            (true, true) => chart_on(
                &root,
                title,
                (&x, (x0..x1).log_scale()),
                (&y, (y0..y1).log_scale()),
                series,
            )?,
        }
    }
    Ok(svg)
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
/// When a file cannot be written (or, never expected, a plot cannot be drawn).
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
            "Acquisitions/s vs tasks (one key, hold 0, no think)",
            Axis {
                label: "tasks",
                log: true,
            },
            Axis {
                label: "acquisitions/s (log)",
                log: true,
            },
            tp,
        ),
        (
            "handoff_cdf.svg",
            "Hand-off gap to a waiting task, CDF (16 tasks, hold 20 ms)",
            Axis {
                label: "gap, ms (log)",
                log: true,
            },
            Axis {
                label: "percentile",
                log: false,
            },
            cdf,
        ),
        (
            "fairness.svg",
            "Per-task acquisitions / mean, sorted (50 tasks, hold 20 ms)",
            Axis {
                label: "task rank",
                log: false,
            },
            Axis {
                label: "acquisitions / mean",
                log: false,
            },
            fair,
        ),
    ];
    for (file, title, x, y, series) in plots {
        if !series.is_empty() {
            std::fs::write(dir.join(file), chart(title, x, y, &series)?)?;
            written.push(file.to_owned());
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::{stats::Kind, Profile};

    /// Two implementations measured in every plotted scenario, one with the
    /// uncontended cell only (a floor: one point, so no throughput line), and
    /// a name that needs escaping.
    fn synthetic() -> Vec<CellResult> {
        let impls = [
            ("fenced/alpha", Kind::Fenced, 1.0),
            ("peer/b&<eta>", Kind::Peer, 3.0),
        ];
        let mut results = Vec::new();
        for s in Profile::Full.scenarios() {
            for (name, kind, scale) in impls {
                let mut r = CellResult::empty(name, kind, &s);
                r.acq_per_s = 1000.0 * scale / s.tasks as f64;
                r.handoff_cdf_ms = (0..=100).map(|p| 0.2 * scale + p as f64 / 20.0).collect();
                r.per_task = (0..s.tasks as u64).map(|t| 40 + t % 7).collect();
                results.push(r);
            }
            if s.name == "uncontended" {
                let mut r = CellResult::empty("floor/only-one", Kind::Floor, &s);
                r.acq_per_s = 20_000.0;
                results.push(r);
            }
        }
        results
    }

    /// Every text element's content, in document order.
    fn texts(svg: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).unwrap();
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        assert_eq!(
            root.tag_name().namespace(),
            Some("http://www.w3.org/2000/svg")
        );
        root.descendants()
            .filter(|n| n.has_tag_name("text"))
            .map(|n| n.text().unwrap_or_default().trim().to_owned())
            .collect()
    }

    #[test]
    fn plots_are_svg_with_every_series_and_label() {
        let dir = tempfile::tempdir().unwrap();
        let results = synthetic();
        let written = write_plots(dir.path(), &results).unwrap();
        assert_eq!(
            written,
            ["throughput_vs_tasks.svg", "handoff_cdf.svg", "fairness.svg"]
        );
        let expect = [
            (
                "throughput_vs_tasks.svg",
                "Acquisitions/s vs tasks (one key, hold 0, no think)",
                ["tasks", "acquisitions/s (log)"],
            ),
            (
                "handoff_cdf.svg",
                "Hand-off gap to a waiting task, CDF (16 tasks, hold 20 ms)",
                ["gap, ms (log)", "percentile"],
            ),
            (
                "fairness.svg",
                "Per-task acquisitions / mean, sorted (50 tasks, hold 20 ms)",
                ["task rank", "acquisitions / mean"],
            ),
        ];
        let points_per_line = std::collections::HashMap::from([
            ("throughput_vs_tasks.svg", 3),
            ("handoff_cdf.svg", 101),
            ("fairness.svg", 50),
        ]);
        for (file, title, axes) in expect {
            let svg = std::fs::read_to_string(dir.path().join(file)).unwrap();
            let texts = texts(&svg);
            for want in [title, axes[0], axes[1], "fenced/alpha", "peer/b&<eta>"] {
                assert!(
                    texts.iter().any(|t| t == want),
                    "{file}: no text {want:?} in {texts:?}"
                );
            }
            assert!(
                !texts.iter().any(|t| t == "floor/only-one"),
                "{file}: a one-point series got a legend entry"
            );
            // One data line per series (width 2), with a point per cell or
            // percentile, and one legend swatch (width 3) of the same colour.
            let doc = roxmltree::Document::parse(&svg).unwrap();
            let lines = |width: &str| -> Vec<(String, usize)> {
                doc.descendants()
                    .filter(|n| {
                        n.has_tag_name("polyline") && n.attribute("stroke-width") == Some(width)
                    })
                    .map(|n| {
                        let points = n.attribute("points").unwrap().split_whitespace().count();
                        (n.attribute("stroke").unwrap().to_owned(), points)
                    })
                    .collect()
            };
            let data = lines("2");
            let points = points_per_line[file];
            assert_eq!(
                data,
                [
                    ("#1F77B4".to_owned(), points),
                    ("#D62728".to_owned(), points)
                ],
                "{file}"
            );
            let swatches: Vec<_> = lines("3").into_iter().map(|(c, _)| c).collect();
            assert_eq!(swatches, ["#1F77B4", "#D62728"], "{file}");
        }
        // Only the throughput plot has few enough points to dot them: 3 per series.
        let tp = std::fs::read_to_string(dir.path().join("throughput_vs_tasks.svg")).unwrap();
        assert_eq!(tp.matches("<circle").count(), 6);
        let fair = std::fs::read_to_string(dir.path().join("fairness.svg")).unwrap();
        assert_eq!(fair.matches("<circle").count(), 0);

        // The same results give the same bytes.
        let again = tempfile::tempdir().unwrap();
        write_plots(again.path(), &results).unwrap();
        for file in &written {
            assert_eq!(
                std::fs::read(dir.path().join(file)).unwrap(),
                std::fs::read(again.path().join(file)).unwrap(),
                "{file} differs between two renders"
            );
        }
    }

    #[test]
    fn nothing_to_plot_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_plots(dir.path(), &[]).unwrap().is_empty());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
