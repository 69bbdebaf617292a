//! The markdown table printed by `fdpp bench gemm` and `fdpp tune`: grouped by shape and M,
//! fastest first within each group, with the roofline and the ratio to the vendor GEMM beside
//! each time.

use super::{shape_groups, GemmRecord};

const HEADER: [&str; 7] = [
    "shape",
    "M",
    "implementation",
    "median µs",
    "GB/s",
    "% roofline",
    "vs gemm",
];

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.filter(|x| x.is_finite()).map(f).unwrap_or_else(|| "–".into())
}

/// A markdown table, columns padded so that it also reads well in a terminal. The fastest
/// candidate of each (shape, M) group is in bold.
pub fn to_markdown(records: &[GemmRecord]) -> String {
    let groups = shape_groups(records);
    let many_models = groups.windows(2).any(|w| w[0].model != w[1].model);
    let mut rows: Vec<[String; 7]> = Vec::new();
    for g in &groups {
        let label = if many_models {
            format!("{} {} [K={}, N={}]", g.model, g.shape, g.k, g.n)
        } else {
            format!("{} [K={}, N={}]", g.shape, g.k, g.n)
        };
        let mut rs = g.rows.clone();
        rs.sort_by(|a, b| a.m.cmp(&b.m).then(a.median_us.total_cmp(&b.median_us)));
        let mut first_of_shape = true;
        let mut last_m = None;
        for r in rs {
            let first_of_m = last_m != Some(r.m);
            last_m = Some(r.m);
            let imp = if first_of_m {
                format!("**{}**", r.implementation)
            } else {
                r.implementation.clone()
            };
            rows.push([
                if first_of_shape { label.clone() } else { String::new() },
                if first_of_m { r.m.to_string() } else { String::new() },
                imp,
                format!("{:.2}", r.median_us),
                format!("{:.1}", r.gbps),
                opt(r.roofline_pct, |p| format!("{p:.0}%")),
                opt(r.speedup_vs_gemm, |s| format!("{s:.2}×")),
            ]);
            first_of_shape = false;
        }
    }
    let mut width = HEADER.map(|h| h.chars().count().max(3));
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    // Text columns left-aligned, numbers right-aligned.
    let numeric = [false, true, false, true, true, true, true];
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for ((c, w), num) in cells.iter().zip(width).zip(numeric) {
            let pad = " ".repeat(w - c.chars().count());
            if num {
                s.push_str(&format!(" {pad}{c} |"));
            } else {
                s.push_str(&format!(" {c}{pad} |"));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&HEADER.map(String::from));
    out.push('|');
    for (w, num) in width.iter().zip(numeric) {
        let dashes = "-".repeat(w - 1);
        out.push_str(&if num {
            format!(" {dashes}: |")
        } else {
            format!(" :{dashes} |")
        });
    }
    out.push('\n');
    for r in &rows {
        out.push_str(&line(r));
    }
    out
}

/// Markdown with padded columns; numeric columns right-aligned.
pub fn padded_table(header: &[&str], numeric: &[bool], rows: &[Vec<String>]) -> String {
    let mut width: Vec<usize> = header.iter().map(|h| h.chars().count().max(3)).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for ((c, w), num) in cells.iter().zip(&width).zip(numeric) {
            let pad = " ".repeat(w - c.chars().count());
            if *num {
                s.push_str(&format!(" {pad}{c} |"));
            } else {
                s.push_str(&format!(" {c}{pad} |"));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    out.push('|');
    for (w, num) in width.iter().zip(numeric) {
        let dashes = "-".repeat(w - 1);
        out.push_str(&if *num {
            format!(" {dashes}: |")
        } else {
            format!(" :{dashes} |")
        });
    }
    out.push('\n');
    for r in rows {
        out.push_str(&line(r));
    }
    out
}
