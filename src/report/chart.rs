//! SVG charts: median time against M for every candidate of one shape, with the inflection
//! points (FlashDecoding++ §4: M1 where flat GEMM overtakes GEMV, M2 where the vendor GEMM
//! overtakes flat GEMM) drawn as dashed vertical lines.
//!
//! Only plotters' SVG backend is used, without its font features: text goes into the file as
//! `<text>` elements for the viewer to render, so nothing here needs fontconfig or system fonts.

use plotters::coord::combinators::{BindKeyPoints, IntoLogRange};
use plotters::prelude::*;
use plotters::style::HSLColor;

use super::{imp_rank, GemmRecord, Mark, ShapeGroup};

const SIZE: (u32, u32) = (1000, 640);

/// Hue per implementation family, so that every flat_gemm variant reads as one family; the
/// variants differ in lightness.
fn colour(imp: &str, variant: usize, variants: usize) -> HSLColor {
    let hue = match imp {
        "gemv" => 0.60,
        "flat_gemm" => 0.33,
        "gemm" => 0.0,
        _ => 0.80,
    };
    let light = if variants <= 1 {
        0.42
    } else {
        0.28 + 0.32 * variant as f64 / (variants - 1) as f64
    };
    HSLColor(hue, 0.85, light)
}

/// Digit runs zero-padded, so that `bn64` sorts before `bn128` in the legend.
fn natural_key(s: &str) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    for c in s.chars().chain(std::iter::once('\0')) {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        if !digits.is_empty() {
            out.push_str(&format!("{digits:0>12}"));
            digits.clear();
        }
        if c != '\0' {
            out.push(c);
        }
    }
    out
}

/// Ticks sit on the Ms that were run: integers.
fn m_label(v: f64) -> String {
    format!("{}", v.round() as u64)
}

/// Tick values for a log time axis: 1-2-5 per decade, or every 1..9 when the range is too
/// narrow for those to give three labels (plotters' own log ticks stop at powers of ten).
fn time_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let pick = |mantissas: &[f64]| -> Vec<f64> {
        (d0..=d1)
            .flat_map(|d| mantissas.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| *v >= lo && *v <= hi)
            .collect()
    };
    let ticks = pick(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 3 {
        return ticks;
    }
    let ticks = pick(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    if ticks.len() >= 2 {
        ticks
    } else {
        vec![lo, hi]
    }
}

/// Three significant digits, no trailing zeros.
fn time_label(v: f64) -> String {
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else if v >= 1.0 {
        2
    } else {
        3
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Render one shape's chart to SVG text. `subtitle` is the caller's run title. None when the
/// shape has no finite timing to plot.
pub fn shape_chart_svg(subtitle: &str, g: &ShapeGroup<'_>, marks: &[Mark]) -> Result<Option<String>, String> {
    let pts: Vec<&GemmRecord> = g
        .rows
        .iter()
        .copied()
        .filter(|r| r.m > 0 && r.median_us.is_finite() && r.median_us > 0.0)
        .collect();
    if pts.is_empty() {
        return Ok(None);
    }
    // Series: one per implementation spec, families in A, B, C order.
    let mut uris: Vec<(&str, &str)> = pts
        .iter()
        .map(|r| (r.imp.as_str(), r.implementation.as_str()))
        .collect();
    uris.sort_by_key(|(imp, uri)| (imp_rank(imp), natural_key(uri)));
    uris.dedup();

    let marks: Vec<&Mark> = marks.iter().filter(|k| k.m > 0).collect();
    let xs = pts.iter().map(|r| r.m).chain(marks.iter().map(|k| k.m));
    let (m_lo, m_hi) = xs.fold((usize::MAX, 0), |(lo, hi), m| (lo.min(m), hi.max(m)));
    // Log axis in M itself (a log2 axis: powers of two are evenly spaced), ticks at the Ms run.
    let x_lo = m_lo as f64 / 1.25;
    let x_hi = m_hi as f64 * 1.25;
    let (t_lo, t_hi) = pts.iter().fold((f64::INFINITY, 0f64), |(lo, hi), r| {
        (lo.min(r.median_us), hi.max(r.median_us))
    });
    let (y_lo, y_hi) = (t_lo / 1.3, t_hi * 1.3);
    let mut x_ticks: Vec<f64> = pts
        .iter()
        .map(|r| r.m)
        .chain(marks.iter().map(|k| k.m))
        .map(|m| m as f64)
        .collect();
    x_ticks.sort_by(f64::total_cmp);
    x_ticks.dedup();

    let caption = format!("{} {} [K={}, N={}] on {}", g.model, g.shape, g.k, g.n, g.device);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| format!("drawing chart for {}: {e}", g.shape);
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(&caption, ("sans-serif", 22)).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(subtitle, ("sans-serif", 15))
            .margin(14)
            .x_label_area_size(52)
            .y_label_area_size(84)
            .build_cartesian_2d(
                (x_lo..x_hi).log_scale().with_key_points(x_ticks),
                (y_lo..y_hi).log_scale().with_key_points(time_ticks(y_lo, y_hi)),
            )
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_label_formatter(&|v| m_label(*v))
            .y_label_formatter(&|v| time_label(*v))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .x_desc("M (rows of x), log2 scale")
            .y_desc("median time (µs), log scale")
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(e)?;

        for (imp, uri) in &uris {
            let family: Vec<&str> = uris.iter().filter(|u| u.0 == *imp).map(|u| u.1).collect();
            let variant = family.iter().position(|u| u == uri).unwrap_or(0);
            let style = ShapeStyle::from(colour(imp, variant, family.len())).stroke_width(2);
            let mut line: Vec<(f64, f64)> = pts
                .iter()
                .filter(|r| r.implementation == *uri)
                .map(|r| (r.m as f64, r.median_us))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.clone(), style))
                .map_err(e)?
                .label(*uri)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], style));
            chart
                .draw_series(line.iter().map(|p| Circle::new(*p, 4, style.filled())))
                .map_err(e)?;
        }

        let mark_style = ShapeStyle::from(BLACK.mix(0.65)).stroke_width(1);
        for k in &marks {
            let x = k.m as f64;
            chart
                .draw_series(DashedLineSeries::new(vec![(x, y_lo), (x, y_hi)], 7, 5, mark_style))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((x, y_hi)) + Text::new(format!("{}={}", k.label, k.m), (5, 6), ("sans-serif", 14)),
                ))
                .map_err(e)?;
        }

        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    Ok(Some(svg))
}

/// One line of a [`LineChart`]: `family` picks the hue (every series of one family shares it and
/// differs in lightness), points are (x, y) with x > 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub family: String,
    pub points: Vec<(f64, f64)>,
}

/// A rate against a size: log2 x axis with ticks at the xs measured, linear y axis from 0, and
/// labelled horizontal reference lines (rooflines).
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart<'a> {
    pub caption: &'a str,
    pub subtitle: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub series: Vec<Series>,
    pub hlines: Vec<(String, f64)>,
}

/// Three significant digits without trailing zeros, scientific below 0.001 (a rate on the CPU
/// backend is a few GB/s, i.e. 0.00x TB/s; on a GPU it is 2.x TB/s).
fn rate_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 || !a.is_finite() {
        return format!("{v}");
    }
    if a < 1e-3 {
        return format!("{v:.1e}");
    }
    let digits = (2 - a.log10().floor() as i32).clamp(0, 5) as usize;
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Hues of the families in order of first appearance.
const FAMILY_HUES: [f64; 6] = [0.60, 0.33, 0.0, 0.80, 0.12, 0.50];

/// Render a [`LineChart`] to SVG text. None when no series has a finite point with x > 0. A
/// reference line more than twice the largest value is left out (it would flatten the data).
pub fn line_chart_svg(c: &LineChart<'_>) -> Result<Option<String>, String> {
    let finite = |p: &&(f64, f64)| p.0 > 0.0 && p.0.is_finite() && p.1.is_finite();
    let pts: Vec<(f64, f64)> = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite))
        .copied()
        .collect();
    if pts.is_empty() {
        return Ok(None);
    }
    let (x_min, x_max) = pts
        .iter()
        .fold((f64::INFINITY, 0f64), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let v_max = pts.iter().fold(0f64, |m, p| m.max(p.1));
    let hlines: Vec<&(String, f64)> = c
        .hlines
        .iter()
        .filter(|h| h.1.is_finite() && h.1 > 0.0 && (v_max <= 0.0 || h.1 <= 2.0 * v_max))
        .collect();
    let top = hlines.iter().fold(v_max, |m, h| m.max(h.1));
    let y_hi = if top > 0.0 { top * 1.15 } else { 1.0 };
    let (x_lo, x_hi) = (x_min / 1.25, x_max * 1.25);
    let mut x_ticks: Vec<f64> = pts.iter().map(|p| p.0).collect();
    x_ticks.sort_by(f64::total_cmp);
    x_ticks.dedup();

    let mut families: Vec<&str> = Vec::new();
    for s in &c.series {
        if !families.contains(&s.family.as_str()) {
            families.push(&s.family);
        }
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| format!("drawing chart {}: {e}", c.caption);
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(c.caption, ("sans-serif", 22)).map_err(e)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(c.subtitle, ("sans-serif", 15))
            .margin(14)
            .x_label_area_size(52)
            .y_label_area_size(84)
            .build_cartesian_2d((x_lo..x_hi).log_scale().with_key_points(x_ticks), 0f64..y_hi)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_label_formatter(&|v| m_label(*v))
            .y_label_formatter(&|v| rate_label(*v))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 16))
            .x_desc(c.x_desc)
            .y_desc(c.y_desc)
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(e)?;

        for s in &c.series {
            let fi = families.iter().position(|f| *f == s.family).unwrap_or(0);
            let members: Vec<&Series> = c.series.iter().filter(|o| o.family == s.family).collect();
            let variant = members.iter().position(|o| std::ptr::eq(*o, s)).unwrap_or(0);
            let light = if members.len() <= 1 {
                0.42
            } else {
                0.28 + 0.32 * variant as f64 / (members.len() - 1) as f64
            };
            let style = ShapeStyle::from(HSLColor(FAMILY_HUES[fi % FAMILY_HUES.len()], 0.85, light)).stroke_width(2);
            let line: Vec<(f64, f64)> = s.points.iter().filter(finite).copied().collect();
            chart
                .draw_series(LineSeries::new(line.clone(), style))
                .map_err(e)?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], style));
            chart
                .draw_series(line.iter().map(|p| Circle::new(*p, 4, style.filled())))
                .map_err(e)?;
        }

        let mark_style = ShapeStyle::from(BLACK.mix(0.65)).stroke_width(1);
        for (label, y) in hlines {
            chart
                .draw_series(DashedLineSeries::new(vec![(x_lo, *y), (x_hi, *y)], 7, 5, mark_style))
                .map_err(e)?;
            chart
                .draw_series(std::iter::once(
                    EmptyElement::at((x_lo, *y)) + Text::new(label.clone(), (6, -18), ("sans-serif", 14)),
                ))
                .map_err(e)?;
        }

        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(e)?;
        root.present().map_err(e)?;
    }
    Ok(Some(svg))
}
