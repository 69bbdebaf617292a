//! CPU attention against the f64 reference: every quick case under both schemes, the forced
//! recomputes, and every bad input of issue #4 refused with its reason (no panics).

use fdpp::backend::cpu::CpuBackend;
use fdpp::backend::Backend;
use fdpp::check::attention::{attention_cases_quick, check_attention, AttnKind, CHECK_ASYNC};
use fdpp::check::Status;
use fdpp::dtype::{random_bits, DType};
use fdpp::kv::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout};
use fdpp::ops::attention::{AttnGeometry, DecodeParams, PrefillParams, SoftmaxScheme};
use fdpp::reference::attention::decode_ref;
use fdpp::reference::gemm::nmse;

/// The quick list's cases a debug `cargo test` runs: every feature (decode, prefill, both forced
/// recomputes, paged, GQA 1/4/8 and one odd ratio of each kind, both dtypes), without the long
/// sequences and the other odd ratios. The whole quick list took ~270 CPU-seconds of a debug
/// build (it was 232 s of a 5:47 `cargo test`); CI runs it whole in release, `fdpp check
/// --backend cpu --quick` (.ci/run), and `fdpp check` runs the full list.
fn debug_subset() -> Vec<fdpp::check::AttnCase> {
    let mut odd_seen = (false, false);
    attention_cases_quick()
        .into_iter()
        .filter(|c| {
            // Decode up to 1000 keys a sequence; prefill up to 400 keys in all (the multi-tile
            // prefill cases exist for the GPU kernels' tile and TMA paths).
            let short = c.kv_lens.iter().all(|&l| l <= 1000)
                && (c.kind == AttnKind::Decode || c.kv_lens.iter().sum::<usize>() <= 400);
            if c.geom.group().is_power_of_two() {
                return short
                    && (c.dtype == DType::F16
                        || c.force != fdpp::check::attention::Force::None
                        || c.kv_lens.len() > 1);
            }
            // One odd-ratio case of each kind (the first short one).
            let seen = if c.kind == AttnKind::Decode {
                &mut odd_seen.0
            } else {
                &mut odd_seen.1
            };
            let keep = short && !*seen && c.force == fdpp::check::attention::Force::None;
            *seen |= keep;
            keep
        })
        .collect()
}

#[test]
fn every_quick_case_passes_on_the_cpu() {
    let b = CpuBackend::new();
    let cases = debug_subset();
    assert!(cases.iter().any(|c| c.dtype == DType::Bf16) && cases.iter().any(|c| !c.geom.group().is_power_of_two()));
    let rows = check_attention(&b, &cases, 0xC0FFEE).expect("check runs");
    assert_eq!(rows.len(), 2 * cases.len(), "sync and async per case");
    for r in &rows {
        assert_eq!(
            r.status,
            Status::Pass,
            "{} {} {}: {:?}",
            r.spec,
            r.dtype,
            r.case,
            r.status
        );
        assert!(r.nmse.is_some_and(|e| e < 1e-5), "{} {}: {:?}", r.spec, r.case, r.nmse);
    }
    // The forced cases recomputed under async, and only the targeted row.
    let forced: Vec<_> = rows
        .iter()
        .filter(|r| r.case.contains("force=") && r.spec.contains("async"))
        .collect();
    let n_forced = cases
        .iter()
        .filter(|c| c.force != fdpp::check::attention::Force::None)
        .count();
    assert!(n_forced >= 8, "2 kinds × 2 forces × 2 dtypes at least");
    assert_eq!(forced.len(), n_forced);
    for r in forced {
        assert_eq!(r.recomputed, Some(1), "{} {}", r.spec, r.case);
    }
    for kind in [AttnKind::Decode, AttnKind::Prefill] {
        assert!(rows
            .iter()
            .any(|r| r.kind == kind && r.recomputed == Some(0) && r.spec.contains("async")));
    }
}

/// A small decode set-up: one sequence of `len` tokens in pages 0.., h/kv heads of dim d.
fn decode_setup(
    h: usize,
    kv: usize,
    d: usize,
    len: usize,
) -> (CpuBackend, DecodeParams, PagedKv<fdpp::backend::cpu::CpuBuffer>) {
    let b = CpuBackend::new();
    let dt = DType::F16;
    let pages = len.div_ceil(16).max(1);
    let layout = PagedKvLayout::new(16, pages + 1, kv, d, dt).expect("layout");
    let table = BlockTable {
        pages: (0..pages as u32).collect(),
        seq_len: len,
    };
    let tables = FlatBlockTables::new(&layout, &[table]).expect("tables");
    let kv = PagedKv {
        layout,
        k: b.upload(dt, &random_bits(dt, layout.pool_elems(), 2.0, 1)).expect("k"),
        v: b.upload(dt, &random_bits(dt, layout.pool_elems(), 1.0, 2)).expect("v"),
    };
    let p = DecodeParams {
        geom: AttnGeometry {
            num_heads: h,
            num_kv_heads: kv.layout.num_kv_heads,
            head_dim: d,
        },
        dtype: dt,
        scheme: SoftmaxScheme::Sync,
        tables,
        num_splits: None,
    };
    (b, p, kv)
}

fn run_decode(b: &CpuBackend, p: &DecodeParams, kv: &PagedKv<fdpp::backend::cpu::CpuBuffer>) -> fdpp::Result<Vec<u16>> {
    let n = p.batch() * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 2.0, 3))?;
    let mut out = b.alloc(p.dtype, n)?;
    b.attention_decode(p, &q, kv, &mut out)?;
    b.download(&out)
}

#[test]
fn split_count_does_not_change_the_result() {
    let (b, mut p, kv) = decode_setup(8, 2, 64, 1500);
    let n = p.geom.num_heads * p.geom.head_dim;
    let qb = random_bits(p.dtype, n, 2.0, 9);
    let q = b.upload(p.dtype, &qb).expect("q");
    let reference = decode_ref(&p, &kv.layout, &qb, &kv.k.data, &kv.v.data);
    for scheme in [SoftmaxScheme::Sync, CHECK_ASYNC] {
        for splits in [1, 2, 5, 64, 256] {
            p.scheme = scheme;
            p.num_splits = Some(splits);
            let mut out = b.alloc(p.dtype, n).expect("out");
            let stats = b.attention_decode(&p, &q, &kv, &mut out).expect("decode");
            assert_eq!(stats.recomputed, 0);
            let y: Vec<f64> = out.data.iter().map(|&x| p.dtype.to_f32(x) as f64).collect();
            let e = nmse(&y, &reference);
            assert!(e < 1e-5, "{} splits={splits}: NMSE {e}", scheme.label());
        }
    }
}

#[test]
fn unsupported_head_dim_is_refused_naming_the_supported_set() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.geom.head_dim = 80;
    let e = run_decode(&b, &p, &kv).expect_err("head_dim 80");
    assert!(e.to_string().contains("head_dim 80; supported: [64, 128, 256]"), "{e}");
}

#[test]
fn every_whole_gqa_ratio_runs_and_a_fractional_one_is_refused() {
    // Ratios 3, 5 and 7 over two kv heads, several splits: the reference, whatever the split.
    for ratio in [3, 5, 7] {
        let (b, mut p, kv) = decode_setup(2 * ratio, 2, 64, 150);
        let n = p.geom.num_heads * p.geom.head_dim;
        let qb = random_bits(p.dtype, n, 2.0, 5);
        let q = b.upload(p.dtype, &qb).expect("q");
        let reference = decode_ref(&p, &kv.layout, &qb, &kv.k.data, &kv.v.data);
        for splits in [1, 3] {
            p.num_splits = Some(splits);
            let mut out = b.alloc(p.dtype, n).expect("out");
            b.attention_decode(&p, &q, &kv, &mut out).expect("decode");
            let y: Vec<f64> = out.data.iter().map(|&x| p.dtype.to_f32(x) as f64).collect();
            let e = nmse(&y, &reference);
            assert!(e < 1e-5, "ratio {ratio} splits={splits}: NMSE {e}");
        }
    }
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.geom.num_heads = 10; // 10 / 4
    let e = run_decode(&b, &p, &kv).expect_err("10 / 4");
    assert!(
        e.to_string()
            .contains("num_heads 10 is not a multiple of num_kv_heads 4"),
        "{e}"
    );
}

#[test]
fn kv_len_zero_is_refused() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.tables.seq_lens[0] = 0;
    let e = run_decode(&b, &p, &kv).expect_err("kv_len 0");
    assert!(e.to_string().contains("kv_len is 0"), "{e}");
}

#[test]
fn split_counts_outside_the_supported_range_are_refused() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 200);
    for n in [0, fdpp::ops::attention::MAX_SPLITS + 1] {
        p.num_splits = Some(n);
        let e = run_decode(&b, &p, &kv).expect_err("split count");
        assert!(
            e.to_string().contains(&format!(
                "num_splits {n} is outside 1..={}",
                fdpp::ops::attention::MAX_SPLITS
            )),
            "{e}"
        );
    }
    p.num_splits = Some(fdpp::ops::attention::MAX_SPLITS);
    run_decode(&b, &p, &kv).expect("the largest split count runs");
}

#[test]
fn block_table_past_the_pool_is_refused() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 40);
    p.tables.block_table[1] = kv.layout.num_pages as i32 + 5;
    let e = run_decode(&b, &p, &kv).expect_err("page past the pool");
    assert!(e.to_string().contains("past the pool"), "{e}");
    // The same table for prefill.
    let layout = kv.layout;
    let mut kv = kv;
    let pp = PrefillParams {
        geom: p.geom,
        dtype: p.dtype,
        scheme: SoftmaxScheme::Sync,
        tables: p.tables.clone(),
        new_lens: vec![40],
    };
    let n = 40 * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 1.0, 4)).expect("q");
    let kn = b
        .upload(p.dtype, &random_bits(p.dtype, 40 * layout.token_elems(), 1.0, 5))
        .expect("k");
    let mut out = b.alloc(p.dtype, n).expect("out");
    let before = kv.k.data.clone();
    let e = b
        .attention_prefill(&pp, &q, &kn, &kn, &mut kv, &mut out)
        .expect_err("prefill too");
    assert!(e.to_string().contains("past the pool"), "{e}");
    assert_eq!(kv.k.data, before, "a refused prefill writes nothing");
}

#[test]
fn async_windows_that_overflow_fp32_are_refused_with_the_reason() {
    let (b, mut p, kv) = decode_setup(4, 4, 64, 20);
    p.scheme = SoftmaxScheme::Async {
        phi: 0.0,
        a: -80.0,
        b: 10.0,
    };
    let e = run_decode(&b, &p, &kv).expect_err("b - a = 90");
    assert!(e.to_string().contains("e^(b−a) = e^90 overflows fp32"), "{e}");
    p.scheme = SoftmaxScheme::Async {
        phi: 0.0,
        a: 1.0,
        b: -1.0,
    };
    assert!(run_decode(&b, &p, &kv).is_err());
}

#[test]
fn prefill_with_bad_new_lens_is_refused() {
    let (b, p, mut kv) = decode_setup(4, 4, 64, 20);
    let n = 21 * p.geom.num_heads * p.geom.head_dim;
    let q = b.upload(p.dtype, &random_bits(p.dtype, n, 1.0, 4)).expect("q");
    let k = b
        .upload(p.dtype, &random_bits(p.dtype, 21 * 4 * 64, 1.0, 5))
        .expect("k");
    let mut out = b.alloc(p.dtype, n).expect("out");
    for new_lens in [vec![21], vec![0], vec![5, 5]] {
        let pp = PrefillParams {
            geom: p.geom,
            dtype: p.dtype,
            scheme: SoftmaxScheme::Sync,
            tables: p.tables.clone(),
            new_lens: new_lens.clone(),
        };
        let e = b
            .attention_prefill(&pp, &q, &k, &k, &mut kv, &mut out)
            .expect_err("bad new_lens");
        assert!(e.to_string().contains("new"), "{new_lens:?}: {e}");
    }
}

#[test]
fn short_buffers_and_mismatched_caches_are_refused() {
    let (b, p, kv) = decode_setup(4, 4, 64, 20);
    let q = b.upload(p.dtype, &random_bits(p.dtype, 4 * 64 - 1, 1.0, 4)).expect("q");
    let mut out = b.alloc(p.dtype, 4 * 64).expect("out");
    let e = b.attention_decode(&p, &q, &kv, &mut out).expect_err("short q");
    assert!(e.to_string().contains("decode q"), "{e}");
    let mut p2 = p.clone();
    p2.geom = AttnGeometry::new(8, 2, 64).expect("geom");
    let e = run_decode(&b, &p2, &kv).expect_err("cache has 4 kv heads");
    assert!(e.to_string().contains("kv_heads=4"), "{e}");
    let q16 = b
        .upload(DType::F16, &random_bits(DType::F16, 4 * 64, 1.0, 4))
        .expect("q");
    let mut out_bf = b.alloc(DType::Bf16, 4 * 64).expect("out");
    let e = b
        .attention_decode(&p, &q16, &kv, &mut out_bf)
        .expect_err("bf16 out, f16 call");
    assert!(e.to_string().contains("every buffer must be f16"), "{e}");
}

/// The CLI's plumbing (case list, JSON rows, the tally) on a few cases: every quick case's
/// kernels are checked in-process by `every_quick_case_passes_on_the_cpu`, and the whole list
/// is `fdpp check --quick` (or the full `fdpp check`), so the subprocess need not run them all
/// again in a debug build.
const CLI_CASES: [&str; 2] = ["decode f16 h4/kv1 d128 kv=[97", "force=underflow"];

fn cli_selected() -> Vec<fdpp::check::AttnCase> {
    let pats: Vec<String> = CLI_CASES.iter().map(|s| s.to_string()).collect();
    attention_cases_quick()
        .into_iter()
        .filter(|c| fdpp::cli::check::case_selected(&pats, &fdpp::cli::check::attn_case_key(c)))
        .collect()
}

#[test]
fn fdpp_check_runs_the_attention_cases() {
    let selected = cli_selected();
    assert!(
        selected.len() >= 3 && selected.len() < attention_cases_quick().len() / 2,
        "{}",
        selected.len()
    );
    let mut args = vec![
        "check",
        "--backend",
        "cpu",
        "--quick",
        "--op",
        "attention",
        "--format",
        "json",
    ];
    for c in CLI_CASES {
        args.extend(["--case", c]);
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(&args)
        .output()
        .expect("run fdpp");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fdpp check failed: {stderr}");
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = rows.as_array().expect("an array of rows");
    assert_eq!(rows.len(), 2 * selected.len());
    for r in rows {
        assert_eq!(r["op"], "attention", "{r}");
        assert_eq!(r["status"], "pass", "{r}");
    }
    assert!(rows
        .iter()
        .any(|r| r["case"].as_str().is_some_and(|c| c.contains("force=underflow")) && r["recomputed"] == 1));
    assert!(stderr.contains(&format!("{} passed, 0 failed", rows.len())), "{stderr}");
    // A pattern nothing matches is an error, not an empty pass.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(["check", "--backend", "cpu", "--quick", "--case", "no-such-case"])
        .output()
        .expect("run fdpp");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no case of the quick list matches"));
}

#[test]
fn fdpp_check_md_prints_both_tables_by_default() {
    // One GEMM case key, one decode and one prefill attention key: every table is printed.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(["check", "--backend", "cpu", "--quick"])
        .args(["--case", "f16 M=1 ", "--case", "decode bf16 h2/kv2 d128 kv=[1]"])
        .args(["--case", "prefill f16 h2/kv2 d128 kv=[97] new=[97]"])
        .output()
        .expect("run fdpp");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("| gemv_f16 |") || s.contains("gemv_f16"), "{s}");
    assert!(s.contains("| decode_async_bf16 |"), "{s}");
    assert!(s.contains("| prefill_sync_f16 |"), "{s}");
}

/// Ways a kernel can be wrong, each of which the check must catch.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// Decode reads one key too few per sequence.
    DropLastKey,
    /// Prefill attends correctly but leaves the pools unwritten.
    NoPoolWrite,
    /// Async reports no recompute.
    NoRecompute,
    /// One element written past the output.
    WriteGuard,
}

struct Faulty(CpuBackend, Fault);

type Buf = fdpp::backend::cpu::CpuBuffer;

impl Backend for Faulty {
    type Buffer = Buf;
    fn info(&self) -> &fdpp::backend::DeviceInfo {
        self.0.info()
    }
    fn kernel_hash(&self) -> String {
        self.0.kernel_hash()
    }
    fn alloc(&self, dtype: DType, len: usize) -> fdpp::Result<Buf> {
        self.0.alloc(dtype, len)
    }
    fn upload(&self, dtype: DType, bits: &[u16]) -> fdpp::Result<Buf> {
        self.0.upload(dtype, bits)
    }
    fn download(&self, buf: &Buf) -> fdpp::Result<Vec<u16>> {
        self.0.download(buf)
    }
    fn fill(&self, buf: &mut Buf, bits: u16) -> fdpp::Result<()> {
        self.0.fill(buf, bits)
    }
    fn gemm_candidates(&self, dtype: DType, n: usize, k: usize) -> Vec<fdpp::ops::gemm::GemmSpec> {
        self.0.gemm_candidates(dtype, n, k)
    }
    fn gemm(
        &self,
        spec: &fdpp::ops::gemm::GemmSpec,
        dims: fdpp::ops::gemm::GemmDims,
        x: &Buf,
        w: &Buf,
        y: &mut Buf,
    ) -> fdpp::Result<()> {
        self.0.gemm(spec, dims, x, w, y)
    }
    fn attention_decode(
        &self,
        p: &DecodeParams,
        q: &Buf,
        kv: &PagedKv<Buf>,
        out: &mut Buf,
    ) -> fdpp::Result<fdpp::ops::attention::AttnStats> {
        let mut p2 = p.clone();
        if self.1 == Fault::DropLastKey {
            p2.tables.seq_lens.iter_mut().filter(|l| **l > 1).for_each(|l| *l -= 1);
        }
        let s = self.0.attention_decode(&p2, q, kv, out)?;
        Ok(self.after(p.batch() * p.geom.num_heads * p.geom.head_dim, s, out))
    }
    fn attention_prefill(
        &self,
        p: &PrefillParams,
        q: &Buf,
        k: &Buf,
        v: &Buf,
        kv: &mut PagedKv<Buf>,
        out: &mut Buf,
    ) -> fdpp::Result<fdpp::ops::attention::AttnStats> {
        let before = kv.v.data.clone();
        let s = self.0.attention_prefill(p, q, k, v, kv, out)?;
        if self.1 == Fault::NoPoolWrite {
            kv.v.data = before;
        }
        Ok(self.after(p.tokens() * p.geom.num_heads * p.geom.head_dim, s, out))
    }
    fn attention_prefill_cached_enqueue(
        &self,
        p: &PrefillParams,
        q: &Buf,
        kv: &PagedKv<Buf>,
        out: &mut Buf,
    ) -> fdpp::Result<()> {
        self.0.attention_prefill_cached_enqueue(p, q, kv, out)?;
        let none = fdpp::ops::attention::AttnStats {
            rows: 0,
            recomputed: 0,
            splits: 0,
        };
        self.after(p.tokens() * p.geom.num_heads * p.geom.head_dim, none, out);
        Ok(())
    }
    fn synchronize(&self) -> fdpp::Result<()> {
        Ok(())
    }
    fn copy_gbps(&self) -> fdpp::Result<f64> {
        Ok(1.0)
    }
    fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> fdpp::Result<()>) -> fdpp::Result<Vec<f64>> {
        self.0.time_each(reps, f)
    }
}

impl Faulty {
    fn after(&self, n: usize, s: fdpp::ops::attention::AttnStats, out: &mut Buf) -> fdpp::ops::attention::AttnStats {
        match self.1 {
            Fault::NoRecompute => fdpp::ops::attention::AttnStats { recomputed: 0, ..s },
            Fault::WriteGuard => {
                out.data[n + 3] = 0;
                s
            }
            _ => s,
        }
    }
}

#[test]
fn the_check_catches_broken_kernels() {
    // f16, no 4097-token sequence and no odd GQA ratio (those test the kernels, not the check):
    // every failure mode has cases enough, at a fraction of the time in a debug build.
    let cases: Vec<_> = attention_cases_quick()
        .into_iter()
        .filter(|c| {
            c.dtype == DType::F16
                && c.kv_lens.iter().all(|&l| l <= 1000)
                && (c.kind == AttnKind::Decode || c.kv_lens.iter().sum::<usize>() <= 400)
                && c.geom.group().is_power_of_two()
        })
        .collect();
    for fault in [
        Fault::DropLastKey,
        Fault::NoPoolWrite,
        Fault::NoRecompute,
        Fault::WriteGuard,
    ] {
        // Each fault on the cases that can show it, and a couple that must stay clean (a
        // correct kernel passing every case is `every_quick_case_passes_on_the_cpu`).
        let shows = |c: &fdpp::check::AttnCase| match fault {
            Fault::DropLastKey => c.kind == AttnKind::Decode,
            Fault::NoPoolWrite => c.kind == AttnKind::Prefill,
            Fault::NoRecompute => c.force != fdpp::check::attention::Force::None,
            Fault::WriteGuard => false,
        };
        let mut clean = 0;
        let cases: Vec<_> = cases
            .iter()
            .filter(|c| {
                let keep = shows(c) || clean < 2;
                clean += usize::from(!shows(c) && keep);
                keep
            })
            .cloned()
            .collect();
        let rows = check_attention(&Faulty(CpuBackend::new(), fault), &cases, 11).expect("check runs");
        for (r, c) in rows.iter().zip(cases.iter().flat_map(|c| [c, c])) {
            let async_forced = r.spec.contains("async") && c.force != fdpp::check::attention::Force::None;
            let must_fail = match fault {
                // One key in 300 or more can carry too little weight to show in the NMSE; the
                // short sequences are where a lost key is seen.
                Fault::DropLastKey => c.kind == AttnKind::Decode && c.kv_lens.iter().any(|&l| (2..=97).contains(&l)),
                Fault::NoPoolWrite => c.kind == AttnKind::Prefill,
                Fault::NoRecompute => async_forced,
                Fault::WriteGuard => true,
            };
            let why = r.status.reason().unwrap_or("");
            if must_fail {
                assert!(r.status.is_fail(), "{fault:?} not caught on {} {}", r.spec, r.case);
                let expect = match fault {
                    Fault::DropLastKey => "NMSE",
                    Fault::NoPoolWrite => "V pool differs",
                    Fault::NoRecompute => "not recomputed",
                    Fault::WriteGuard => "guard",
                };
                assert!(why.contains(expect), "{fault:?} on {}: {why}", r.case);
            } else if fault != Fault::DropLastKey {
                assert_eq!(r.status, Status::Pass, "{fault:?} on {} {}", r.spec, r.case);
            }
        }
    }
}
