//! Checks of the small layer ops ([`crate::ops::layer`]) against the f64 oracles of
//! `crate::reference::layer`.
//!
//! Per case: fresh random inputs (never zeros), every output poisoned and followed by a guard
//! of [`GUARD_ELEMS`] poisoned elements (in-place buffers, the residual and the KV pools, carry
//! the guard too), then:
//! - add_rmsnorm, qkv_rope, silu_mul: every output finite, guards intact, NMSE within the
//!   dtype's limit; the residual add_rmsnorm writes back must be the rounded sum (within one
//!   unit in the last place, for kernels that round an f32 sum);
//! - embedding, gather_rows, kv_append, fill_random: bitwise equal to what the reference
//!   produces (kv_append over the whole pools: nothing but the new tokens may change).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::{Status, GUARD_ELEMS};
use crate::backend::{Backend, BackendKind};
use crate::dtype::{random_bits, DType};
use crate::error::{FdppError, Result};
use crate::kv::paged::{BlockTable, FlatBlockTables, PagedKv, PagedKvLayout, DEFAULT_PAGE_SIZE};
use crate::ops::attention::AttnGeometry;
use crate::ops::layer::{
    EmbeddingParams, GatherParams, KvAppendParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};
use crate::reference::gemm::nmse;
use crate::reference::layer::{
    add_rmsnorm_ref, embedding_ref, fill_random_ref, gather_rows_ref, kv_append_ref, qkv_rope_ref, silu_mul_ref,
};

/// The shape of one small-op case.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerShape {
    Embedding {
        vocab: usize,
        hidden: usize,
        tokens: usize,
    },
    AddRmsNorm {
        rows: usize,
        hidden: usize,
        /// With a delta (the residual add), or the norm alone (the first layer's input).
        delta: bool,
        eps: f32,
    },
    QkvRope {
        geom: AttnGeometry,
        positions: Vec<i32>,
        /// With the QKV bias (Qwen).
        bias: bool,
        rope_theta: f64,
    },
    SiluMul {
        rows: usize,
        inter: usize,
    },
    KvAppend {
        kv_heads: usize,
        head_dim: usize,
        /// kv_len of each sequence after the append.
        kv_lens: Vec<usize>,
        new_lens: Vec<usize>,
    },
    GatherRows {
        src_rows: usize,
        width: usize,
        rows: usize,
    },
    FillRandom {
        len: usize,
        scale: f32,
    },
}

/// One small-op case.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCase {
    pub dtype: DType,
    pub shape: LayerShape,
}

impl LayerCase {
    /// The op's name, as in the Backend method.
    pub fn op_name(&self) -> &'static str {
        match self.shape {
            LayerShape::Embedding { .. } => "embedding",
            LayerShape::AddRmsNorm { .. } => "add_rmsnorm",
            LayerShape::QkvRope { .. } => "qkv_rope",
            LayerShape::SiluMul { .. } => "silu_mul",
            LayerShape::KvAppend { .. } => "kv_append",
            LayerShape::GatherRows { .. } => "gather_rows",
            LayerShape::FillRandom { .. } => "fill_random",
        }
    }

    /// e.g. `rows=17 hidden=4097 +delta eps=1e-5`.
    pub fn label(&self) -> String {
        let list = |v: &[usize]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        match &self.shape {
            LayerShape::Embedding { vocab, hidden, tokens } => {
                format!("vocab={vocab} hidden={hidden} tokens={tokens}")
            }
            LayerShape::AddRmsNorm {
                rows,
                hidden,
                delta,
                eps,
            } => format!(
                "rows={rows} hidden={hidden} {} eps={eps:e}",
                if *delta { "+delta" } else { "no delta" }
            ),
            LayerShape::QkvRope {
                geom,
                positions,
                bias,
                rope_theta,
            } => {
                let max = positions.iter().max().copied().unwrap_or(0);
                format!(
                    "{} tokens={} max_pos={max} theta={rope_theta} {}",
                    geom.label(),
                    positions.len(),
                    if *bias { "+bias" } else { "no bias" }
                )
            }
            LayerShape::SiluMul { rows, inter } => format!("rows={rows} inter={inter}"),
            LayerShape::KvAppend {
                kv_heads,
                head_dim,
                kv_lens,
                new_lens,
            } => format!(
                "kv_heads={kv_heads} d={head_dim} kv=[{}] new=[{}]",
                list(kv_lens),
                list(new_lens)
            ),
            LayerShape::GatherRows { src_rows, width, rows } => {
                format!("src_rows={src_rows} width={width} rows={rows}")
            }
            LayerShape::FillRandom { len, scale } => format!("len={len} scale={scale}"),
        }
    }
}

/// One case's outcome.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerCheckRow {
    pub backend: BackendKind,
    /// "layer".
    pub op: String,
    /// The op and dtype, e.g. `add_rmsnorm_f16`.
    pub spec: String,
    pub case: String,
    pub dtype: DType,
    /// Arithmetic ops: the worst NMSE over their outputs.
    pub nmse: Option<f64>,
    /// Arithmetic ops: the worst max |y − ref| / max |ref| over their outputs.
    pub max_rel_err: Option<f64>,
    /// Exact ops (and the residual of add_rmsnorm): elements that differ from the expected bits.
    pub mismatches: Option<usize>,
    #[serde(flatten)]
    pub status: Status,
}

/// Positions of `n` consecutive tokens from `start` (a prefill chunk).
fn run_of(start: i32, n: i32) -> Vec<i32> {
    (start..start + n).collect()
}

fn geom(h: usize, kv: usize, d: usize) -> AttnGeometry {
    AttnGeometry {
        num_heads: h,
        num_kv_heads: kv,
        head_dim: d,
    }
}

/// The cases of one dtype. Sizes: hidden 4096 and the odd 4097 and 1000, rows 1, 3 and 17,
/// inter 11008 and 5504 (and an odd 1001), head_dim 64 and 128 (256 in the full list), GQA
/// ratios 1, 4 and 8, positions up to 4095, with and without bias; a decode append of one token
/// per sequence and a prefill append crossing pages.
fn cases_for(dt: DType, full: bool) -> Vec<LayerCase> {
    use LayerShape::*;
    let (r1, r4, r8) = if full {
        (geom(32, 32, 128), geom(32, 8, 128), geom(32, 4, 64))
    } else {
        (geom(2, 2, 128), geom(4, 1, 128), geom(8, 1, 64))
    };
    let mut shapes = vec![
        Embedding {
            vocab: 1000,
            hidden: 4097,
            tokens: 3,
        },
        Embedding {
            vocab: 67,
            hidden: 1000,
            tokens: 17,
        },
        AddRmsNorm {
            rows: 1,
            hidden: 4097,
            delta: true,
            eps: 1e-5,
        },
        AddRmsNorm {
            rows: 17,
            hidden: 1000,
            delta: true,
            eps: 1e-6,
        },
        AddRmsNorm {
            rows: 3,
            hidden: 4096,
            delta: false,
            eps: 1e-5,
        },
        QkvRope {
            geom: r1,
            positions: vec![4095],
            bias: false,
            rope_theta: 10000.0,
        },
        QkvRope {
            geom: r4,
            positions: run_of(3000, 17),
            bias: true,
            rope_theta: 1_000_000.0,
        },
        QkvRope {
            geom: r8,
            positions: vec![0, 1, 2047],
            bias: true,
            rope_theta: 500_000.0,
        },
        SiluMul { rows: 1, inter: 11008 },
        SiluMul { rows: 3, inter: 5504 },
        SiluMul { rows: 17, inter: 1001 },
        KvAppend {
            kv_heads: 2,
            head_dim: 128,
            kv_lens: vec![1, 97, 4097],
            new_lens: vec![1, 1, 1],
        },
        KvAppend {
            kv_heads: 1,
            head_dim: 64,
            kv_lens: vec![40, 17],
            new_lens: vec![40, 5],
        },
        GatherRows {
            src_rows: 17,
            width: 4097,
            rows: 3,
        },
        GatherRows {
            src_rows: 3,
            width: 1000,
            rows: 4,
        },
        FillRandom {
            len: 3 * 65536 + 5,
            scale: 0.02,
        },
        FillRandom { len: 1001, scale: 1.0 },
    ];
    if full {
        shapes.extend([
            Embedding {
                vocab: 4099,
                hidden: 4096,
                tokens: 17,
            },
            AddRmsNorm {
                rows: 17,
                hidden: 4096,
                delta: true,
                eps: 1e-5,
            },
            AddRmsNorm {
                rows: 3,
                hidden: 4097,
                delta: false,
                eps: 1e-6,
            },
            QkvRope {
                geom: r4,
                positions: vec![1, 4095, 777],
                bias: false,
                rope_theta: 500_000.0,
            },
            QkvRope {
                geom: geom(4, 2, 256),
                positions: run_of(100, 3),
                bias: true,
                rope_theta: 10000.0,
            },
            SiluMul { rows: 17, inter: 11008 },
            KvAppend {
                kv_heads: 8,
                head_dim: 128,
                kv_lens: vec![16, 33, 1000],
                new_lens: vec![1, 17, 1],
            },
            GatherRows {
                src_rows: 1,
                width: 4096,
                rows: 1,
            },
            FillRandom {
                len: (1 << 22) + 3,
                scale: 0.02,
            },
        ]);
    }
    shapes.into_iter().map(|shape| LayerCase { dtype: dt, shape }).collect()
}

/// Every case of `fdpp check --op layer`, in f16 and bf16.
pub fn layer_cases() -> Vec<LayerCase> {
    [DType::F16, DType::Bf16]
        .iter()
        .flat_map(|&dt| cases_for(dt, true))
        .collect()
}

/// The reduced list (fewer heads, no full-size extras) for `cargo test` and `--quick`.
pub fn layer_cases_quick() -> Vec<LayerCase> {
    [DType::F16, DType::Bf16]
        .iter()
        .flat_map(|&dt| cases_for(dt, false))
        .collect()
}

/// Runs every case on the backend. A backend that declines an op (`Unsupported`) gives a
/// skipped row, any other error from the op a failed row; errors moving data end the check.
pub fn check_layer<B: Backend>(b: &B, cases: &[LayerCase], seed: u64) -> Result<Vec<LayerCheckRow>> {
    let mut rows = Vec::with_capacity(cases.len());
    for (ci, c) in cases.iter().enumerate() {
        let case_seed = mix(seed.wrapping_add(0x1A7E_0000 + ci as u64));
        let mut j = Judge::default();
        let ran = match &c.shape {
            LayerShape::Embedding { vocab, hidden, tokens } => {
                embedding_case(b, c.dtype, (*vocab, *hidden, *tokens), case_seed, &mut j)
            }
            LayerShape::AddRmsNorm {
                rows,
                hidden,
                delta,
                eps,
            } => {
                let p = RmsNormParams {
                    rows: *rows,
                    hidden: *hidden,
                    eps: *eps,
                    dtype: c.dtype,
                };
                rmsnorm_case(b, &p, *delta, case_seed, &mut j)
            }
            LayerShape::QkvRope {
                geom,
                positions,
                bias,
                rope_theta,
            } => {
                let p = RopeParams {
                    geom: *geom,
                    dtype: c.dtype,
                    positions: positions.clone(),
                    inv_freq: inv_freq(*rope_theta, geom.head_dim),
                    layout: RopeLayout::Half,
                };
                rope_case(b, &p, *bias, case_seed, &mut j)
            }
            LayerShape::SiluMul { rows, inter } => {
                let p = SiluMulParams {
                    rows: *rows,
                    inter: *inter,
                    dtype: c.dtype,
                };
                silu_case(b, &p, case_seed, &mut j)
            }
            LayerShape::KvAppend {
                kv_heads,
                head_dim,
                kv_lens,
                new_lens,
            } => kv_append_case(
                b,
                c.dtype,
                (*kv_heads, *head_dim),
                (kv_lens, new_lens),
                case_seed,
                &mut j,
            ),
            LayerShape::GatherRows { src_rows, width, rows } => {
                gather_case(b, c.dtype, (*src_rows, *width, *rows), case_seed, &mut j)
            }
            LayerShape::FillRandom { len, scale } => fill_random_case(b, c.dtype, *len, *scale, case_seed, &mut j),
        }?;
        let status = match ran {
            Err(e @ FdppError::Unsupported { .. }) => Status::Skipped(e.to_string()),
            Err(e) => Status::Fail(format!("run failed: {e}")),
            Ok(()) => match j.fail.take() {
                Some(why) => Status::Fail(why),
                None => Status::Pass,
            },
        };
        rows.push(LayerCheckRow {
            backend: b.info().backend,
            op: "layer".into(),
            spec: format!("{}_{}", c.op_name(), c.dtype),
            case: c.label(),
            dtype: c.dtype,
            nmse: j.nmse,
            max_rel_err: j.max_rel_err,
            mismatches: j.mismatches,
            status,
        });
    }
    Ok(rows)
}

/// The inverse frequencies of plain RoPE: θ^(−2i/D) for i < D/2, rounded to f32 as a config
/// loader would store them.
fn inv_freq(theta: f64, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64) as f32)
        .collect()
}

/// SplitMix64's finaliser: unrelated input streams for consecutive case indices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `bits` followed by a poisoned guard, for in-place buffers.
fn with_guard(dt: DType, bits: &[u16]) -> Vec<u16> {
    let mut v = bits.to_vec();
    v.extend(std::iter::repeat_n(dt.poison(), GUARD_ELEMS));
    v
}

/// An output of `len` elements plus the guard, all poisoned.
fn poisoned<B: Backend>(b: &B, dt: DType, len: usize) -> Result<B::Buffer> {
    let mut buf = b.alloc(dt, len + GUARD_ELEMS)?;
    b.fill(&mut buf, dt.poison())?;
    Ok(buf)
}

/// The op's own error (kept for the row) inside the harness's `Result` (data movement).
type Ran = Result<Result<()>>;

fn embedding_case<B: Backend>(
    b: &B,
    dt: DType,
    (vocab, hidden, tokens): (usize, usize, usize),
    seed: u64,
    j: &mut Judge,
) -> Ran {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    // The last and the first row of the table always, the rest anywhere.
    let mut ids: Vec<i32> = (0..tokens).map(|_| rng.gen_range(0..vocab) as i32).collect();
    ids[0] = vocab as i32 - 1;
    if tokens > 1 {
        ids[tokens - 1] = 0;
    }
    let p = EmbeddingParams {
        ids,
        vocab,
        hidden,
        dtype: dt,
    };
    let table = random_bits(dt, vocab * hidden, 1.0, seed ^ 1);
    let tb = b.upload(dt, &table)?;
    let mut out = poisoned(b, dt, tokens * hidden)?;
    if let Err(e) = b.embedding(&p, &tb, &mut out).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    j.exact(
        dt,
        "out",
        &b.download(&out)?,
        &with_guard(dt, &embedding_ref(&p, &table)),
    );
    Ok(Ok(()))
}

fn rmsnorm_case<B: Backend>(b: &B, p: &RmsNormParams, delta: bool, seed: u64, j: &mut Judge) -> Ran {
    let (dt, n, h) = (p.dtype, p.rows * p.hidden, p.hidden);
    let mut residual = random_bits(dt, n, 1.0, seed ^ 1);
    let mut d = random_bits(dt, n, 0.5, seed ^ 2);
    if p.rows >= 3 {
        // A quiet last row (values near 2^-10, mean square below 1e-6): there eps weighs as
        // much as the row itself, so a kernel that drops or misplaces eps fails the NMSE.
        let tail = n - h..n;
        residual[tail.clone()].copy_from_slice(&random_bits(dt, h, 1.0 / 1024.0, seed ^ 4));
        d[tail].copy_from_slice(&random_bits(dt, h, 0.5 / 1024.0, seed ^ 5));
    }
    let w = random_bits(dt, p.hidden, 1.0, seed ^ 3);
    let mut rb = b.upload(dt, &with_guard(dt, &residual))?;
    let db = b.upload(dt, &d)?;
    let wb = b.upload(dt, &w)?;
    let mut out = poisoned(b, dt, n)?;
    let delta_buf = delta.then_some(&db);
    if let Err(e) = {
        b.add_rmsnorm(p, &mut rb, delta_buf, &wb, &mut out)
            .and_then(|()| b.synchronize())
    } {
        return Ok(Err(e));
    }
    let (want_res, want) = add_rmsnorm_ref(p, &residual, delta.then_some(&d[..]), &w);
    j.close(dt, "out", &b.download(&out)?, &want);
    j.within_one_ulp(dt, "residual", &b.download(&rb)?, &with_guard(dt, &want_res));
    Ok(Ok(()))
}

fn rope_case<B: Backend>(b: &B, p: &RopeParams, bias: bool, seed: u64, j: &mut Judge) -> Ran {
    let g = p.geom;
    let (dt, t, width) = (p.dtype, p.tokens(), p.qkv_width());
    let qkv = random_bits(dt, t * width, 1.0, seed ^ 1);
    let bias_bits = random_bits(dt, width, 0.5, seed ^ 2);
    let qkv_b = b.upload(dt, &qkv)?;
    let bias_b = b.upload(dt, &bias_bits)?;
    let mut q = poisoned(b, dt, t * g.num_heads * g.head_dim)?;
    let mut k = poisoned(b, dt, t * g.num_kv_heads * g.head_dim)?;
    let mut v = poisoned(b, dt, t * g.num_kv_heads * g.head_dim)?;
    let bias_buf = bias.then_some(&bias_b);
    if let Err(e) = {
        b.qkv_rope(p, &qkv_b, bias_buf, &mut q, &mut k, &mut v)
            .and_then(|()| b.synchronize())
    } {
        return Ok(Err(e));
    }
    let (rq, rk, rv) = qkv_rope_ref(p, &qkv, bias.then_some(&bias_bits[..]));
    j.close(dt, "q", &b.download(&q)?, &rq);
    j.close(dt, "k", &b.download(&k)?, &rk);
    j.close(dt, "v", &b.download(&v)?, &rv);
    Ok(Ok(()))
}

fn silu_case<B: Backend>(b: &B, p: &SiluMulParams, seed: u64, j: &mut Judge) -> Ran {
    let dt = p.dtype;
    // Gates over [−6, 6): silu's negative tail, its minimum near −1.28 and its linear part.
    let gu = random_bits(dt, 2 * p.rows * p.inter, 6.0, seed ^ 1);
    let gb = b.upload(dt, &gu)?;
    let mut out = poisoned(b, dt, p.rows * p.inter)?;
    if let Err(e) = b.silu_mul(p, &gb, &mut out).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    j.close(dt, "out", &b.download(&out)?, &silu_mul_ref(p, &gu));
    Ok(Ok(()))
}

fn kv_append_case<B: Backend>(
    b: &B,
    dt: DType,
    (kv_heads, head_dim): (usize, usize),
    (kv_lens, new_lens): (&[usize], &[usize]),
    seed: u64,
    j: &mut Judge,
) -> Ran {
    // Scattered pages: a shuffled pool with 3 pages no sequence owns.
    let ps = DEFAULT_PAGE_SIZE;
    let need: usize = kv_lens.iter().map(|&l| l.div_ceil(ps)).sum();
    let layout = PagedKvLayout::new(ps, need + 3, kv_heads, head_dim, dt)?;
    let mut ids: Vec<u32> = (0..layout.num_pages as u32).collect();
    ids.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
    let mut next = ids.into_iter();
    let tables: Vec<BlockTable> = kv_lens
        .iter()
        .map(|&l| BlockTable {
            pages: next.by_ref().take(l.div_ceil(ps)).collect(),
            seq_len: l,
        })
        .collect();
    let p = KvAppendParams {
        tables: FlatBlockTables::new(&layout, &tables)?,
        new_lens: new_lens.iter().map(|&n| n as i32).collect(),
    };
    let n = p.tokens() * layout.token_elems();
    let k = random_bits(dt, n, 1.0, seed ^ 1);
    let v = random_bits(dt, n, 1.0, seed ^ 2);
    let k_pool = random_bits(dt, layout.pool_elems(), 1.0, seed ^ 3);
    let v_pool = random_bits(dt, layout.pool_elems(), 1.0, seed ^ 4);
    let kb = b.upload(dt, &k)?;
    let vb = b.upload(dt, &v)?;
    let mut kv = PagedKv {
        layout,
        k: b.upload(dt, &with_guard(dt, &k_pool))?,
        v: b.upload(dt, &with_guard(dt, &v_pool))?,
    };
    if let Err(e) = b.kv_append(&p, &kb, &vb, &mut kv).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    let (ek, ev) = kv_append_ref(&p, &layout, &k, &v, &k_pool, &v_pool);
    j.exact(dt, "K pool", &b.download(&kv.k)?, &with_guard(dt, &ek));
    j.exact(dt, "V pool", &b.download(&kv.v)?, &with_guard(dt, &ev));
    Ok(Ok(()))
}

fn gather_case<B: Backend>(
    b: &B,
    dt: DType,
    (src_rows, width, rows): (usize, usize, usize),
    seed: u64,
    j: &mut Judge,
) -> Ran {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut picked: Vec<i32> = (0..rows).map(|_| rng.gen_range(0..src_rows) as i32).collect();
    picked[0] = src_rows as i32 - 1;
    let p = GatherParams {
        rows: picked,
        width,
        dtype: dt,
    };
    let src = random_bits(dt, src_rows * width, 1.0, seed ^ 1);
    let sb = b.upload(dt, &src)?;
    let mut dst = poisoned(b, dt, rows * width)?;
    if let Err(e) = b.gather_rows(&p, &sb, &mut dst).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    j.exact(
        dt,
        "dst",
        &b.download(&dst)?,
        &with_guard(dt, &gather_rows_ref(&p, &src)),
    );
    Ok(Ok(()))
}

/// fill_random writes its whole buffer by definition, so there is no guard: every element,
/// poisoned before, must be the reference's.
fn fill_random_case<B: Backend>(b: &B, dt: DType, len: usize, scale: f32, seed: u64, j: &mut Judge) -> Ran {
    let mut buf = b.alloc(dt, len)?;
    b.fill(&mut buf, dt.poison())?;
    if let Err(e) = b.fill_random(&mut buf, seed, scale).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    j.exact(dt, "buf", &b.download(&buf)?, &fill_random_ref(dt, len, seed, scale));
    Ok(Ok(()))
}

/// The measures of one case over its outputs, and the first reason it fails.
#[derive(Default)]
struct Judge {
    nmse: Option<f64>,
    max_rel_err: Option<f64>,
    mismatches: Option<usize>,
    fail: Option<String>,
}

impl Judge {
    fn fail(&mut self, why: String) {
        self.fail.get_or_insert(why);
    }

    /// `got` is the output then [`GUARD_ELEMS`] of guard: finite outputs, intact guard, NMSE
    /// within the dtype's limit.
    fn close(&mut self, dt: DType, name: &str, got: &[u16], reference: &[f64]) {
        let len = reference.len();
        if got.len() != len + GUARD_ELEMS {
            self.fail(format!(
                "{name}: download returned {} elements, expected {}",
                got.len(),
                len + GUARD_ELEMS
            ));
            return;
        }
        let (y, guard) = got.split_at(len);
        let y: Vec<f64> = y.iter().map(|&x| dt.to_f32(x) as f64).collect();
        let err = nmse(&y, reference);
        let scale = reference.iter().fold(0f64, |a, r| a.max(r.abs()));
        let worst = y.iter().zip(reference).map(|(o, r)| (o - r).abs()).fold(0f64, f64::max);
        let non_finite = y.iter().position(|v| !v.is_finite());
        let rel = if non_finite.is_some() {
            f64::INFINITY
        } else {
            worst / scale.max(f64::MIN_POSITIVE)
        };
        self.nmse = Some(self.nmse.map_or(err, |e| e.max(err)));
        self.max_rel_err = Some(self.max_rel_err.map_or(rel, |e| e.max(rel)));
        if let Some(i) = non_finite {
            self.fail(format!("{name}: element {i} of {len} not finite (never written?)"));
        } else if let Some(i) = guard.iter().position(|&g| g != dt.poison()) {
            self.fail(format!("{name}: wrote past the end: guard element {i} changed"));
        } else if err > dt.nmse_limit() {
            let at = y
                .iter()
                .zip(reference)
                .map(|(o, r)| (o - r).abs())
                .enumerate()
                .fold((0, -1f64), |best, (i, e)| if e > best.1 { (i, e) } else { best })
                .0;
            self.fail(format!(
                "{name}: NMSE {err:.3e} > {:.1e}; worst at element {at}: {} vs reference {:.6}",
                dt.nmse_limit(),
                y[at],
                reference[at]
            ));
        }
    }

    /// Bitwise equal, guard included (`want` holds the guard's poison where there is one).
    fn exact(&mut self, dt: DType, name: &str, got: &[u16], want: &[u16]) {
        self.compare(dt, name, got, want, 0);
    }

    /// Each element at most one unit in the last place from `want` (the exactly rounded
    /// value): a kernel that sums in f32 before rounding may round a near-tie the other way.
    fn within_one_ulp(&mut self, dt: DType, name: &str, got: &[u16], want: &[u16]) {
        self.compare(dt, name, got, want, 1);
    }

    fn compare(&mut self, dt: DType, name: &str, got: &[u16], want: &[u16], ulps: u32) {
        if got.len() != want.len() {
            self.fail(format!(
                "{name}: download returned {} elements, expected {}",
                got.len(),
                want.len()
            ));
            return;
        }
        let off = |(&g, &w): (&u16, &u16)| ulp_distance(g, w) > ulps || (g == dt.poison()) != (w == dt.poison());
        let bad = got.iter().zip(want).filter(|p| off(*p)).count();
        self.mismatches = Some(self.mismatches.unwrap_or(0) + bad);
        if let Some(i) = got.iter().zip(want).position(off) {
            self.fail(format!(
                "{name}: {bad} of {} elements differ from the expected bits{}, first at {i}: {:#06x} vs {:#06x}",
                want.len(),
                if ulps > 0 { " by more than 1 ulp" } else { "" },
                got[i],
                want[i]
            ));
        }
    }
}

/// Distance in units in the last place between two 16-bit floats of the same type (sign and
/// magnitude mapped onto a line, so that +0 and −0 coincide and the step across 0 counts 1).
fn ulp_distance(a: u16, b: u16) -> u32 {
    let line = |x: u16| {
        let mag = (x & 0x7fff) as i32;
        if x & 0x8000 != 0 {
            -mag
        } else {
            mag
        }
    };
    line(a).abs_diff(line(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn case_lists_hold_what_the_issue_asks_for() {
        for list in [layer_cases(), layer_cases_quick()] {
            for dt in [DType::F16, DType::Bf16] {
                let of: Vec<&LayerShape> = list.iter().filter(|c| c.dtype == dt).map(|c| &c.shape).collect();
                let hidden = |h: usize| {
                    of.iter()
                        .any(|s| matches!(s, LayerShape::AddRmsNorm { hidden, .. } if *hidden == h))
                };
                assert!(hidden(4096) && hidden(4097) && hidden(1000), "{dt}: hidden sizes");
                for rows in [1, 3, 17] {
                    assert!(
                        of.iter()
                            .any(|s| matches!(s, LayerShape::AddRmsNorm { rows: r, .. } if *r == rows)),
                        "{dt}: rmsnorm rows {rows}"
                    );
                    assert!(
                        of.iter()
                            .any(|s| matches!(s, LayerShape::SiluMul { rows: r, .. } if *r == rows)),
                        "{dt}: silu rows {rows}"
                    );
                }
                for inter in [11008, 5504] {
                    assert!(
                        of.iter()
                            .any(|s| matches!(s, LayerShape::SiluMul { inter: i, .. } if *i == inter)),
                        "{dt}: inter {inter}"
                    );
                }
                for delta in [false, true] {
                    assert!(
                        of.iter()
                            .any(|s| matches!(s, LayerShape::AddRmsNorm { delta: x, .. } if *x == delta)),
                        "{dt}: rmsnorm delta {delta}"
                    );
                }
                let ropes: Vec<(&AttnGeometry, &Vec<i32>, bool)> = of
                    .iter()
                    .filter_map(|s| match s {
                        LayerShape::QkvRope {
                            geom, positions, bias, ..
                        } => Some((geom, positions, *bias)),
                        _ => None,
                    })
                    .collect();
                for d in [64, 128] {
                    assert!(ropes.iter().any(|r| r.0.head_dim == d), "{dt}: rope d {d}");
                }
                for ratio in [1, 4, 8] {
                    assert!(ropes.iter().any(|r| r.0.group() == ratio), "{dt}: GQA {ratio}");
                }
                assert!(
                    ropes.iter().any(|r| r.2) && ropes.iter().any(|r| !r.2),
                    "{dt}: bias on/off"
                );
                assert!(
                    ropes.iter().any(|r| r.1.iter().any(|&p| p >= 4000)),
                    "{dt}: positions in the thousands"
                );
                for s in [
                    "embedding",
                    "add_rmsnorm",
                    "qkv_rope",
                    "silu_mul",
                    "kv_append",
                    "gather_rows",
                    "fill_random",
                ] {
                    assert!(
                        list.iter().any(|c| c.dtype == dt && c.op_name() == s),
                        "{dt}: no {s} case"
                    );
                }
            }
        }
    }

    #[test]
    fn every_quick_case_passes_on_the_cpu() {
        let b = CpuBackend::new();
        let cases = layer_cases_quick();
        let rows = check_layer(&b, &cases, 0xC0FFEE).expect("check runs");
        assert_eq!(rows.len(), cases.len());
        for r in &rows {
            assert_eq!(r.status, Status::Pass, "{} {}: {:?}", r.spec, r.case, r.status);
            let arithmetic = ["add_rmsnorm", "qkv_rope", "silu_mul"]
                .iter()
                .any(|s| r.spec.starts_with(s));
            if arithmetic {
                assert!(
                    r.nmse.is_some_and(|e| e < r.dtype.nmse_limit()),
                    "{}: {:?}",
                    r.case,
                    r.nmse
                );
            }
            if !arithmetic || r.spec.starts_with("add_rmsnorm") {
                assert_eq!(r.mismatches, Some(0), "{} {}", r.spec, r.case);
            }
        }
    }

    #[test]
    fn a_backend_without_the_ops_is_skipped_not_failed() {
        let b = crate::backend::cpu::hooked::HookedCpu::new(|inner, spec, d, x, w, y| inner.gemm(spec, d, x, w, y))
            .without_layer_ops();
        let cases = layer_cases_quick();
        let rows = check_layer(&b, &cases, 1).expect("check runs");
        assert_eq!(rows.len(), cases.len());
        for r in &rows {
            let op = r.spec.rsplit_once('_').map_or("?", |(op, _)| op);
            assert!(
                matches!(&r.status, Status::Skipped(m) if m.contains(&format!("{op} on cpu"))),
                "{} {:?}",
                r.spec,
                r.status
            );
            assert_eq!((r.nmse, r.mismatches), (None, None));
        }
    }

    fn judge_exact(got: &[u16], want: &[u16]) -> Judge {
        let mut j = Judge::default();
        j.exact(DType::F16, "out", got, want);
        j
    }

    #[test]
    fn judges_catch_wrong_unwritten_and_out_of_bounds_elements() {
        let dt = DType::F16;
        let want = with_guard(dt, &[0x3c00, 0xbc00, 0x4000]);
        assert!(judge_exact(&want, &want).fail.is_none());
        let mut wrong = want.clone();
        wrong[1] = 0x3c00;
        let j = judge_exact(&wrong, &want);
        assert!(
            j.fail.as_deref().is_some_and(|m| m.contains("first at 1")),
            "{:?}",
            j.fail
        );
        assert_eq!(j.mismatches, Some(1));
        let mut past = want.clone();
        past[3 + 7] = 0x3c00;
        assert!(judge_exact(&past, &want).fail.is_some(), "guard write");
        // One ulp apart passes the residual's judge, two do not; ±0 are the same.
        let mut j = Judge::default();
        j.within_one_ulp(dt, "residual", &[0x3c01, 0x8000], &[0x3c00, 0x0000]);
        assert!(j.fail.is_none(), "{:?}", j.fail);
        j.within_one_ulp(dt, "residual", &[0x3c02], &[0x3c00]);
        assert!(j.fail.is_some());
        assert_eq!(ulp_distance(0x0001, 0x8001), 2, "across zero");

        let reference = [0.5, -1.0, 2.0];
        let ok: Vec<u16> = with_guard(dt, &reference.map(|r| dt.from_f32(r as f32)));
        let mut j = Judge::default();
        j.close(dt, "out", &ok, &reference);
        assert!(j.fail.is_none() && j.nmse == Some(0.0));
        let mut unwritten = ok.clone();
        unwritten[2] = dt.poison();
        let mut j = Judge::default();
        j.close(dt, "out", &unwritten, &reference);
        assert!(
            j.fail.as_deref().is_some_and(|m| m.contains("not finite")),
            "{:?}",
            j.fail
        );
        let mut off = ok.clone();
        off[0] = dt.from_f32(0.6);
        let mut j = Judge::default();
        j.close(dt, "out", &off, &reference);
        assert!(j.fail.as_deref().is_some_and(|m| m.contains("NMSE")), "{:?}", j.fail);
    }
}
