//! Report files: CSV and JSON round trips, SVG charts with their lines and marks, the derived
//! roofline and speedup columns, and clean errors when the directory cannot be written.

use std::collections::BTreeMap;
use std::path::Path;

use fdpp::cli::Format;
use fdpp::report::{self, annotate, csv, gemm_table, json, write_gemm_report, GemmRecord, Mark};
use fdpp::FdppError;
use rand::{Rng, SeedableRng};

const MS: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
const IMPLS: [(&str, &str); 4] = [
    ("gemv_f16", "gemv"),
    ("flat_gemm_f16_bn64", "flat_gemm"),
    ("flat_gemm_f16_bn128", "flat_gemm"),
    ("gemm_f16", "gemm"),
];

fn rec(shape: &str, k: usize, n: usize, uri: &str, imp: &str, m: usize, median_us: f64) -> GemmRecord {
    let bytes = 2.0 * (n * k + m * k + m * n) as f64;
    GemmRecord {
        fdpp_version: "0.1.0".into(),
        git_commit: "abc123def456".into(),
        device: "Test GPU 80GB".into(),
        backend: "cuda".into(),
        model: "llama2-7b".into(),
        shape: shape.into(),
        k,
        n,
        implementation: uri.into(),
        imp: imp.into(),
        m,
        samples: 30,
        median_us,
        min_us: median_us * 0.97,
        max_us: median_us * 1.08,
        gbps: bytes / (median_us * 1e-6) / 1e9,
        gflops: 2.0 * (m * n * k) as f64 / (median_us * 1e-6) / 1e9,
        nmse: 1e-7,
        roofline_pct: None,
        speedup_vs_gemm: None,
    }
}

/// Two shapes × 8 Ms × 4 candidates with crossovers like the paper's (GEMV best at small M,
/// the vendor GEMM best at large M), jittered by a fresh random seed.
fn table(seed: u64) -> Vec<GemmRecord> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut out = Vec::new();
    for (shape, k, n) in [("qkv", 4096, 12288), ("o", 4096, 4096)] {
        let base = (n * k) as f64 * 2.0 / 3.0e6; // µs at ~3 TB/s
        for m in MS {
            for (i, (uri, imp)) in IMPLS.iter().enumerate() {
                let slope = [0.9, 0.08, 0.06, 0.0][i] * m as f64;
                let fixed = [1.0, 1.15, 1.2, 1.6][i];
                let t = base * (fixed + slope) * rng.gen_range(0.95..1.05);
                out.push(rec(shape, k, n, uri, imp, m, t));
            }
        }
    }
    annotate(&mut out, Some(2600.0 + rng.gen_range(0.0..100.0)));
    out
}

fn marks() -> BTreeMap<String, Vec<Mark>> {
    let mut m = BTreeMap::new();
    m.insert(
        "qkv".to_string(),
        vec![
            Mark {
                label: "M1".into(),
                m: 4,
            },
            Mark {
                label: "M2".into(),
                m: 32,
            },
        ],
    );
    m
}

const COLUMNS: [&str; 20] = [
    "fdpp_version",
    "git_commit",
    "device",
    "backend",
    "model",
    "shape",
    "k",
    "n",
    "implementation",
    "imp",
    "m",
    "samples",
    "median_us",
    "min_us",
    "max_us",
    "gbps",
    "gflops",
    "nmse",
    "roofline_pct",
    "speedup_vs_gemm",
];

#[test]
fn csv_rows_describe_themselves_and_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let recs = table(rand::random());
    let files = write_gemm_report(dir.path(), "gemm-llama2-7b", "t", &recs, &marks()).unwrap();
    assert_eq!(files.csv, dir.path().join("gemm-llama2-7b.csv"));
    let text = std::fs::read_to_string(&files.csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(header, COLUMNS);
    let mut rows = 0;
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), COLUMNS.len(), "row {line}");
        assert!(cells.iter().all(|c| !c.is_empty()), "empty cell in {line}");
        rows += 1;
    }
    assert_eq!(rows, recs.len());
    assert_eq!(csv::read_csv(&files.csv).unwrap(), recs);
    // The stdout CSV is the same text as the file.
    assert_eq!(gemm_table(&recs, Format::Csv).unwrap(), text);
}

#[test]
fn csv_without_the_optional_columns_still_parses() {
    // Rows written before roofline/speedup existed must keep loading.
    let recs = table(rand::random());
    let full = csv::to_csv_string(&recs).unwrap();
    let trimmed: String = full
        .lines()
        .map(|l| l.rsplitn(3, ',').nth(2).unwrap().to_string() + "\n")
        .collect();
    let back = csv::parse_csv(&trimmed, Path::new("old.csv")).unwrap();
    assert_eq!(back.len(), recs.len());
    assert!(back
        .iter()
        .all(|r| r.roofline_pct.is_none() && r.speedup_vs_gemm.is_none()));
    assert_eq!(back[5].median_us, recs[5].median_us);
}

#[test]
fn json_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let recs = table(rand::random());
    let files = write_gemm_report(dir.path(), "g", "t", &recs, &marks()).unwrap();
    assert_same(&json::read_json(&files.json).unwrap(), &recs);
    let stdout = gemm_table(&recs, Format::Json).unwrap();
    let parsed: Vec<GemmRecord> = serde_json::from_str(&stdout).unwrap();
    assert_same(&parsed, &recs);
}

/// Equal up to the last bit of each float (serde_json's default parser may round the last
/// digit differently; the values are measurements, so that is not a loss).
fn assert_same(a: &[GemmRecord], b: &[GemmRecord]) {
    assert_eq!(a.len(), b.len());
    let near = |x: f64, y: f64| (x - y).abs() <= 1e-14 * x.abs().max(y.abs());
    let near_opt = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) => near(x, y),
        (None, None) => true,
        _ => false,
    };
    for (x, y) in a.iter().zip(b) {
        let mut x2 = x.clone();
        for (f, g) in [
            (&mut x2.median_us, y.median_us),
            (&mut x2.min_us, y.min_us),
            (&mut x2.max_us, y.max_us),
            (&mut x2.gbps, y.gbps),
            (&mut x2.gflops, y.gflops),
            (&mut x2.nmse, y.nmse),
        ] {
            assert!(near(*f, g), "{} vs {g} in {}", *f, y.implementation);
            *f = g;
        }
        assert!(near_opt(x.roofline_pct, y.roofline_pct));
        assert!(near_opt(x.speedup_vs_gemm, y.speedup_vs_gemm));
        x2.roofline_pct = y.roofline_pct;
        x2.speedup_vs_gemm = y.speedup_vs_gemm;
        assert_eq!(&x2, y);
    }
}

/// `<polyline ... stroke-width="2" points="x,y x,y ">` → number of points, per line.
fn thick_polyline_points(svg: &str) -> Vec<usize> {
    svg.lines()
        .filter(|l| l.starts_with("<polyline") && l.contains("stroke-width=\"2\""))
        .filter_map(|l| l.split("points=\"").nth(1))
        .map(|p| p.split('"').next().unwrap_or("").split_whitespace().count())
        .collect()
}

fn text_elements(svg: &str) -> Vec<String> {
    // plotters writes `<text ...>\ncontent\n</text>`.
    let lines: Vec<&str> = svg.lines().collect();
    lines
        .windows(2)
        .filter(|w| w[0].starts_with("<text"))
        .map(|w| w[1].to_string())
        .collect()
}

#[test]
fn one_svg_per_shape_with_title_lines_and_marks() {
    let dir = tempfile::tempdir().unwrap();
    let recs = table(rand::random());
    let files = write_gemm_report(
        dir.path(),
        "gemm-llama2-7b",
        "fdpp bench gemm, run title",
        &recs,
        &marks(),
    )
    .unwrap();
    if let Ok(d) = std::env::var("FDPP_TEST_DUMP") {
        for f in &files.svgs {
            std::fs::copy(f, Path::new(&d).join(f.file_name().unwrap())).unwrap();
        }
    }
    assert_eq!(
        files.svgs,
        vec![
            dir.path().join("gemm-llama2-7b-qkv.svg"),
            dir.path().join("gemm-llama2-7b-o.svg")
        ]
    );
    for (path, shape, kn) in [
        (&files.svgs[0], "qkv", "[K=4096, N=12288]"),
        (&files.svgs[1], "o", "[K=4096, N=4096]"),
    ] {
        let svg = std::fs::read_to_string(path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", path.display());
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        let texts = text_elements(&svg);
        let title = format!("llama2-7b {shape} {kn} on Test GPU 80GB");
        assert!(texts.contains(&title), "no title {title:?} in {texts:?}");
        assert!(texts.iter().any(|t| t == "fdpp bench gemm, run title"));
        for (uri, _) in IMPLS {
            assert!(texts.iter().any(|t| t == uri), "no legend entry for {uri}");
        }
        // One data line through every M per implementation (legend swatches have 2 points).
        let lines = thick_polyline_points(&svg);
        assert_eq!(
            lines.iter().filter(|&&p| p == MS.len()).count(),
            IMPLS.len(),
            "{lines:?}"
        );
        assert_eq!(svg.matches("<circle").count(), IMPLS.len() * MS.len());
        // Every M is a tick label.
        for m in MS {
            assert!(texts.contains(&m.to_string()), "no tick label {m}");
        }
        let has_marks = shape == "qkv";
        assert_eq!(texts.iter().any(|t| t == "M1=4"), has_marks);
        assert_eq!(texts.iter().any(|t| t == "M2=32"), has_marks);
        // Dashed mark lines: many short vertical segments, at two distinct x positions.
        let dashes: Vec<Vec<&str>> = svg
            .lines()
            .filter(|l| l.starts_with("<polyline fill=\"none\" opacity=\"0.65\""))
            .filter_map(|l| l.split("points=\"").nth(1)?.split('"').next())
            .map(|p| {
                p.split_whitespace()
                    .map(|xy| xy.split(',').next().unwrap_or(""))
                    .collect()
            })
            .collect();
        assert!(
            dashes.iter().all(|d| d.len() == 2 && d[0] == d[1]),
            "not vertical: {dashes:?}"
        );
        let mut xs: Vec<&str> = dashes.iter().map(|d| d[0]).collect();
        xs.sort();
        xs.dedup();
        assert_eq!(xs.len(), if has_marks { 2 } else { 0 }, "{xs:?}");
        assert!(!has_marks || dashes.len() >= 20, "{} dashes", dashes.len());
    }
}

#[test]
fn annotate_fills_roofline_and_ratio_to_the_best_gemm() {
    let (k, n) = (4096, 4096);
    let mut recs = vec![
        rec("o", k, n, "gemv_f16", "gemv", 1, 50.0),
        rec("o", k, n, "flat_gemm_f16_bn64", "flat_gemm", 1, 80.0),
        rec("o", k, n, "gemm_f16", "gemm", 1, 100.0),
        rec("o", k, n, "gemm_f16_lt", "gemm", 1, 90.0),
        // Same shape, other M: no gemm row there, so no ratio.
        rec("o", k, n, "gemv_f16", "gemv", 2, 60.0),
        // Same M, other shape: its gemm must not be used for "o".
        rec("qkv", k, 3 * n, "gemm_f16", "gemm", 1, 10.0),
    ];
    annotate(&mut recs, Some(1000.0));
    let bytes = 2.0 * (n * k + k + n) as f64;
    let roof_us = bytes / 1000e9 * 1e6;
    assert!((report::roofline_us(1, n, k, 1000.0) - roof_us).abs() < 1e-12);
    let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() < 1e-9 * b.abs().max(1.0);
    assert!(close(recs[0].roofline_pct, 100.0 * roof_us / 50.0));
    assert!(close(recs[2].roofline_pct, 100.0 * roof_us / 100.0));
    assert!(close(recs[0].speedup_vs_gemm, 90.0 / 50.0));
    assert!(close(recs[1].speedup_vs_gemm, 90.0 / 80.0));
    assert!(close(recs[2].speedup_vs_gemm, 0.9));
    assert!(close(recs[3].speedup_vs_gemm, 1.0));
    assert_eq!(recs[4].speedup_vs_gemm, None);
    assert!(close(recs[5].speedup_vs_gemm, 1.0));
    let bytes2 = 2.0 * (n * k + 2 * k + 2 * n) as f64;
    assert!(close(recs[4].roofline_pct, 100.0 * bytes2 / 1000e9 * 1e6 / 60.0));

    // No usable bandwidth: the roofline is cleared, the ratios stay.
    for bad in [None, Some(0.0), Some(f64::NAN)] {
        annotate(&mut recs, bad);
        assert!(recs.iter().all(|r| r.roofline_pct.is_none()));
        assert!(close(recs[0].speedup_vs_gemm, 1.8));
    }
}

#[test]
fn markdown_table_groups_by_shape_and_m() {
    let mut recs = vec![
        rec("o", 4096, 4096, "gemm_f16", "gemm", 1, 100.0),
        rec("o", 4096, 4096, "gemv_f16", "gemv", 1, 50.0),
        rec("o", 4096, 4096, "gemv_f16", "gemv", 2, 70.0),
        rec("o", 4096, 4096, "gemm_f16", "gemm", 2, 35.0),
    ];
    annotate(&mut recs, Some(1000.0));
    let md = gemm_table(&recs, Format::Md).unwrap();
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(lines.len(), 2 + recs.len(), "{md}");
    for col in [
        "shape",
        "M",
        "implementation",
        "median µs",
        "GB/s",
        "% roofline",
        "vs gemm",
    ] {
        assert!(lines[0].contains(col), "{}", lines[0]);
    }
    fn cells(l: &str) -> Vec<&str> {
        l.split('|').map(str::trim).filter(|c| !c.is_empty()).collect()
    }
    // Fastest first within each M, in bold; the shape label only on its first row.
    assert_eq!(
        cells(lines[2]),
        [
            "o [K=4096, N=4096]",
            "1",
            "**gemv_f16**",
            "50.00",
            &format!("{:.1}", recs[1].gbps),
            "67%",
            "2.00×"
        ]
    );
    assert_eq!(
        cells(lines[3]),
        ["gemm_f16", "100.00", &format!("{:.1}", recs[0].gbps), "34%", "1.00×"]
    );
    assert_eq!(cells(lines[4])[..3], ["2", "**gemm_f16**", "35.00"]);
    assert_eq!(
        cells(lines[5])[..3],
        ["gemv_f16", "70.00", &format!("{:.1}", recs[2].gbps)]
    );
    assert_eq!(cells(lines[5])[4], "0.50×");
    // Every line has the same width, so it reads in a terminal too.
    let w = lines[0].chars().count();
    assert!(lines.iter().all(|l| l.chars().count() == w), "{md}");
}

#[test]
fn unwritable_report_dir_is_a_clean_io_error() {
    let tmp = tempfile::tempdir().unwrap();
    let blocker = tmp.path().join("blocker");
    std::fs::write(&blocker, b"a file, not a directory").unwrap();
    let dir = blocker.join("reports");
    let err = write_gemm_report(&dir, "g", "t", &table(rand::random()), &marks()).unwrap_err();
    match &err {
        FdppError::Io { path, .. } => assert_eq!(path, &dir),
        other => panic!("expected Io, got {other:?}"),
    }
    assert!(err.to_string().contains(&dir.display().to_string()), "{err}");

    // The directory exists but the CSV's name is taken by a directory: the error names the CSV.
    let ok_dir = tmp.path().join("r");
    std::fs::create_dir_all(ok_dir.join("g.csv")).unwrap();
    let err = write_gemm_report(&ok_dir, "g", "t", &table(rand::random()), &marks()).unwrap_err();
    match &err {
        FdppError::Io { path, .. } => assert_eq!(path, &ok_dir.join("g.csv")),
        other => panic!("expected Io, got {other:?}"),
    }
    // No temporary file is left behind.
    assert!(!ok_dir.join("g.csv.tmp").exists());
}

#[test]
fn a_row_faster_than_the_roofline_has_no_roofline_share() {
    let (k, n) = (4096, 4096);
    // 33.6 MB in 1 µs at 1000 GB/s would be 3360 % of the roofline: from a cache, not memory.
    let mut recs = vec![
        rec("o", k, n, "gemv_f16", "gemv", 1, 1.0),
        rec("o", k, n, "gemm_f16", "gemm", 1, 100.0),
    ];
    annotate(&mut recs, Some(1000.0));
    assert_eq!(recs[0].roofline_pct, None);
    assert!(recs[1].roofline_pct.is_some_and(|p| p > 0.0 && p <= 100.0));
    assert_eq!(report::annotate::over_roofline(&recs, Some(1000.0)), 1);
    assert_eq!(report::annotate::over_roofline(&recs, None), 0);
}
