//! The softmax calibration report: the histogram of the scores x = q·k/√d with the chosen
//! window [φ + a, φ + b] marked (FlashDecoding++ §3), as SVG, and its bins as CSV.

use std::path::{Path, PathBuf};

use plotters::coord::combinators::IntoLogRange;
use plotters::prelude::*;

use super::write_atomic;
use crate::error::{FdppError, Result};
use crate::ops::scores::ScoreHist;

const SIZE: (u32, u32) = (1000, 600);

/// The window drawn on the chart: (φ, a, b), or the too-wide coverage interval.
#[derive(Clone, Debug, PartialEq)]
pub enum Marked {
    Window { phi: f64, a: f64, b: f64 },
    TooWide { lo: f64, hi: f64 },
}

impl Marked {
    fn range(&self) -> (f64, f64) {
        match *self {
            Marked::Window { phi, a, b } => (phi + a, phi + b),
            Marked::TooWide { lo, hi } => (lo, hi),
        }
    }
}

pub struct SoftmaxReport<'a> {
    pub title: &'a str,
    pub subtitle: &'a str,
    /// All layers together (drawn).
    pub global: &'a ScoreHist,
    /// One per layer (CSV columns).
    pub layers: &'a [ScoreHist],
    pub marked: Marked,
}

pub struct SoftmaxFiles {
    pub csv: PathBuf,
    pub svg: PathBuf,
}

/// `<dir>/<stem>-softmax.csv` and `.svg`.
pub fn write_softmax_report(dir: &Path, stem: &str, r: &SoftmaxReport<'_>) -> Result<SoftmaxFiles> {
    std::fs::create_dir_all(dir).map_err(|e| FdppError::io(dir, format!("cannot create the report directory: {e}")))?;
    let csv = dir.join(format!("{stem}-softmax.csv"));
    let svg = dir.join(format!("{stem}-softmax.svg"));
    write_atomic(&csv, bins_csv(r)?.as_bytes())?;
    let text = histogram_svg(r).map_err(|e| FdppError::io(&svg, e))?;
    write_atomic(&svg, text.as_bytes())?;
    Ok(SoftmaxFiles { csv, svg })
}

/// One row per bin (and one for the scores under and over the bins): its edges, the count over
/// all layers, whether it lies inside the window, and each layer's count.
pub fn bins_csv(r: &SoftmaxReport<'_>) -> Result<String> {
    let h = r.global;
    let (lo, hi) = r.marked.range();
    let mut w = csv::Writer::from_writer(Vec::new());
    let err = |e: csv::Error| FdppError::InvalidArgument(format!("softmax report CSV: {e}"));
    let mut head = vec![
        "bin_lo".to_string(),
        "bin_hi".into(),
        "count".into(),
        "in_window".into(),
    ];
    head.extend((0..r.layers.len()).map(|l| format!("layer{l}")));
    w.write_record(&head).map_err(err)?;
    let width = h.spec.width() as f64;
    let mut row = |a: f64, b: f64, count: u64, per: Vec<u64>| -> Result<()> {
        let inside = a >= lo && b <= hi;
        let mut rec = vec![format!("{a}"), format!("{b}"), count.to_string(), inside.to_string()];
        rec.extend(per.iter().map(|c| c.to_string()));
        w.write_record(&rec).map_err(err)
    };
    row(
        h.min as f64,
        h.spec.lo as f64,
        h.under,
        r.layers.iter().map(|l| l.under).collect(),
    )?;
    for i in 0..h.counts.len() {
        let a = h.spec.lo as f64 + i as f64 * width;
        row(
            a,
            a + width,
            h.counts[i],
            r.layers.iter().map(|l| l.counts[i]).collect(),
        )?;
    }
    row(
        h.spec.hi as f64,
        h.max as f64,
        h.over,
        r.layers.iter().map(|l| l.over).collect(),
    )?;
    let bytes = w
        .into_inner()
        .map_err(|e| FdppError::InvalidArgument(format!("softmax report CSV: {e}")))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The share of scores per bin on a log axis (the tails the window cuts are orders of magnitude
/// below the peak), with the window shaded and its edges and φ drawn as dashed lines.
pub fn histogram_svg(r: &SoftmaxReport<'_>) -> std::result::Result<String, String> {
    let h = r.global;
    let total = h.count.max(1) as f64;
    let width = h.spec.width() as f64;
    let bars: Vec<(f64, f64, f64)> = h
        .counts
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(i, &c)| {
            let a = h.spec.lo as f64 + i as f64 * width;
            (a, a + width, c as f64 / total)
        })
        .collect();
    let (wlo, whi) = r.marked.range();
    // The x range: the data and the window, clipped to the bins (scores past them are counted
    // in the caption, not drawn).
    let (dlo, dhi) = bars.iter().fold((wlo, whi), |(lo, hi), b| (lo.min(b.0), hi.max(b.1)));
    let pad = 0.04 * (dhi - dlo).max(1.0);
    let (x_lo, x_hi) = (
        (dlo - pad).max(h.spec.lo as f64 - pad),
        (dhi + pad).min(h.spec.hi as f64 + pad),
    );
    let y_min = bars.iter().fold(1.0f64, |m, b| m.min(b.2)).max(1e-12) / 3.0;
    let y_max = bars.iter().fold(y_min * 10.0, |m, b| m.max(b.2)) * 3.0;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| format!("drawing the softmax histogram: {e}");
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(r.title, ("sans-serif", 22)).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(r.subtitle, ("sans-serif", 14))
            .margin(14)
            .x_label_area_size(52)
            .y_label_area_size(84)
            .build_cartesian_2d(x_lo..x_hi, (y_min..y_max).log_scale())
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("score x = q·k/√d")
            .y_desc("share of scores per bin")
            .y_label_formatter(&|v| format!("{v:.0e}"))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(e)?;
        let (shade, edge) = match r.marked {
            Marked::Window { .. } => (HSLColor(0.33, 0.6, 0.85), HSLColor(0.33, 0.8, 0.3)),
            Marked::TooWide { .. } => (HSLColor(0.0, 0.6, 0.9), HSLColor(0.0, 0.8, 0.4)),
        };
        let (slo, shi) = (wlo.max(x_lo), whi.min(x_hi));
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(slo, y_min), (shi, y_max)],
                ShapeStyle::from(shade).filled(),
            )))
            .map_err(e)?;
        let bar_style = ShapeStyle::from(HSLColor(0.60, 0.7, 0.45)).filled();
        chart
            .draw_series(
                bars.iter()
                    .map(|&(a, b, y)| Rectangle::new([(a, y_min), (b, y)], bar_style)),
            )
            .map_err(e)?
            .label(format!("{} scores", h.count))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], bar_style));
        let line = ShapeStyle::from(edge).stroke_width(2);
        let mut marks = vec![(wlo, format!("{wlo:.2}")), (whi, format!("{whi:.2}"))];
        if let Marked::Window { phi, a, b } = r.marked {
            marks[0].1 = format!("φ+a = {wlo:.2}");
            marks[1].1 = format!("φ+b = {whi:.2}");
            marks.push((phi, format!("φ = {phi:.2} (a = {a:.2}, b = {b:.2})")));
        }
        for (i, (x, label)) in marks.iter().enumerate() {
            if *x < x_lo || *x > x_hi {
                continue;
            }
            chart
                .draw_series(DashedLineSeries::new(vec![(*x, y_min), (*x, y_max)], 7, 5, line))
                .map_err(e)?;
            let y = y_max / 10f64.powf(0.4 + 0.5 * i as f64);
            chart
                .draw_series(std::iter::once(
                    // Labels in the right half go left of their line, so none runs off the chart.
                    EmptyElement::at((*x, y))
                        + Text::new(
                            label.clone(),
                            (
                                if *x > (x_lo + x_hi) / 2.0 {
                                    -8 - 7 * label.chars().count() as i32
                                } else {
                                    5
                                },
                                0,
                            ),
                            ("sans-serif", 14),
                        ),
                ))
                .map_err(e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::scores::HistSpec;

    #[test]
    fn csv_has_every_bin_and_the_window_flag_and_svg_marks_the_window() {
        let spec = HistSpec {
            lo: -8.0,
            hi: 8.0,
            bins: 16,
        };
        let mut l0 = ScoreHist::new(spec);
        let mut l1 = ScoreHist::new(spec);
        for i in 0..200 {
            l0.add((i % 7) as f32 - 3.2);
            l1.add((i % 5) as f32 * 0.9 - 1.0);
        }
        l1.add(-20.0);
        let mut g = l0.clone();
        g.merge(&l1).expect("spec");
        let r = SoftmaxReport {
            title: "t",
            subtitle: "s",
            global: &g,
            layers: &[l0, l1],
            marked: Marked::Window {
                phi: 0.5,
                a: -4.5,
                b: 3.5,
            },
        };
        let csv = bins_csv(&r).expect("csv");
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "bin_lo,bin_hi,count,in_window,layer0,layer1");
        assert_eq!(lines.len(), 1 + 16 + 2);
        assert_eq!(lines[1], "-20,-8,1,false,0,1");
        // Bin [−4, −3) is inside [−4, 4]; [−5, −4) is not.
        assert!(lines[1 + 1 + 4].starts_with("-4,-3,") && lines[1 + 1 + 4].contains(",true,"));
        assert!(lines[1 + 1 + 3].starts_with("-5,-4,") && lines[1 + 1 + 3].contains(",false,"));
        let total: u64 = lines[1..]
            .iter()
            .map(|l| l.split(',').nth(2).unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(total, 401);
        let svg = histogram_svg(&r).expect("svg");
        assert!(
            svg.contains("φ+a = -4.00") && svg.contains("φ+b = 4.00"),
            "window marked"
        );
        assert!(svg.contains("401 scores"));
    }
}
