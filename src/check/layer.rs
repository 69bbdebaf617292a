//! Checks of the small layer ops ([`crate::ops::layer`]) against the f64 oracles of
//! `crate::reference::layer`.
//!
//! Per case: fresh random inputs (never zeros), every output poisoned and followed by a guard
//! of [`GUARD_ELEMS`] poisoned elements (in-place buffers, the residual and the KV pools, carry
//! the guard too), then:
//! - add_rmsnorm, add_layernorm, qkv_rope (every rotary form), qkv_rope_append, silu_mul, glu,
//!   bias_act: every output finite, guards intact, NMSE within the dtype's limit; the residual
//!   the norms write back, and add_positions' sum, must be the rounded sum (within one unit in
//!   the last place, for kernels that round an f32 sum);
//! - embedding, gather_rows, kv_append, fill_random: bitwise equal to what the reference
//!   produces (kv_append over the whole pools: nothing but the new tokens may change; the same
//!   for the pools after qkv_rope_append, whose new rows are judged by NMSE).

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
    Activation, BiasActParams, EmbeddingParams, GatherParams, GluParams, KvAppendParams, LayerNormParams,
    PositionParams, RmsNormParams, RopeLayout, RopeParams, SiluMulParams,
};
use crate::reference::gemm::nmse;
use crate::reference::layer::{
    add_layernorm_ref, add_positions_ref, add_rmsnorm_ref, bias_act_ref, embedding_ref, fill_random_ref,
    gather_rows_ref, glu_ref, kv_append_ref, qkv_rope_ref, round_f64, silu_mul_ref,
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
        rot: Rotary,
    },
    /// The decode step's fused rotation and KV append: one new token per sequence, at position
    /// kv_len − 1, its k and v written into scattered pages of the pools.
    QkvRopeAppend {
        geom: AttnGeometry,
        /// kv_len of each sequence after the append.
        kv_lens: Vec<usize>,
        bias: bool,
        rope_theta: f64,
        rot: Rotary,
    },
    AddLayerNorm {
        rows: usize,
        hidden: usize,
        delta: bool,
        eps: f32,
    },
    BiasAct {
        rows: usize,
        width: usize,
        act: Activation,
        bias: bool,
    },
    Glu {
        rows: usize,
        inter: usize,
        act: Activation,
    },
    AddPositions {
        positions: Vec<i32>,
        offset: usize,
        table_rows: usize,
        hidden: usize,
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

/// Which elements of each q and k head a rope case rotates, and how they pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotary {
    /// Rotated elements per head (0: none, OPT; head_dim: Llama).
    pub dim: usize,
    pub layout: RopeLayout,
}

impl Rotary {
    /// Llama's: rotate-half over the whole head.
    pub fn whole(head_dim: usize) -> Self {
        Rotary {
            dim: head_dim,
            layout: RopeLayout::Half,
        }
    }

    fn label(&self) -> String {
        let layout = match self.layout {
            RopeLayout::Half => "half",
            RopeLayout::Interleaved => "interleaved",
        };
        format!("rot={} {layout}", self.dim)
    }
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
            LayerShape::QkvRopeAppend { .. } => "qkv_rope_append",
            LayerShape::AddLayerNorm { .. } => "add_layernorm",
            LayerShape::BiasAct { .. } => "bias_act",
            LayerShape::Glu { .. } => "glu",
            LayerShape::AddPositions { .. } => "add_positions",
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
                rot,
            } => {
                let max = positions.iter().max().copied().unwrap_or(0);
                format!(
                    "{} tokens={} max_pos={max} theta={rope_theta} {} {}",
                    geom.label(),
                    positions.len(),
                    if *bias { "+bias" } else { "no bias" },
                    rot.label()
                )
            }
            LayerShape::QkvRopeAppend {
                geom,
                kv_lens,
                bias,
                rope_theta,
                rot,
            } => format!(
                "{} kv=[{}] theta={rope_theta} {} {}",
                geom.label(),
                list(kv_lens),
                if *bias { "+bias" } else { "no bias" },
                rot.label()
            ),
            LayerShape::AddLayerNorm {
                rows,
                hidden,
                delta,
                eps,
            } => format!(
                "rows={rows} hidden={hidden} {} eps={eps:e}",
                if *delta { "+delta" } else { "no delta" }
            ),
            LayerShape::BiasAct { rows, width, act, bias } => format!(
                "rows={rows} width={width} act={} {}",
                act.name(),
                if *bias { "+bias" } else { "no bias" }
            ),
            LayerShape::Glu { rows, inter, act } => format!("rows={rows} inter={inter} act={}", act.name()),
            LayerShape::AddPositions {
                positions,
                offset,
                table_rows,
                hidden,
            } => {
                let max = positions.iter().max().copied().unwrap_or(0);
                format!(
                    "tokens={} max_pos={max} offset={offset} table_rows={table_rows} hidden={hidden}",
                    positions.len()
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
            rot: Rotary::whole(r1.head_dim),
            rope_theta: 10000.0,
        },
        QkvRope {
            geom: r4,
            positions: run_of(3000, 17),
            bias: true,
            rot: Rotary::whole(r4.head_dim),
            rope_theta: 1_000_000.0,
        },
        QkvRope {
            geom: r8,
            positions: vec![0, 1, 2047],
            bias: true,
            rot: Rotary::whole(r8.head_dim),
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
                rot: Rotary::whole(r4.head_dim),
                rope_theta: 500_000.0,
            },
            QkvRope {
                geom: geom(4, 2, 256),
                positions: run_of(100, 3),
                bias: true,
                rot: Rotary::whole(256),
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
    shapes.extend(general_shapes(full));
    shapes.into_iter().map(|shape| LayerCase { dtype: dt, shape }).collect()
}

/// The ops of the general executor (issue #17): LayerNorm, bias + activation and GLU with every
/// activation, learned positions, and the rotary forms: rotary_dim 0 (OPT), 32, head_dim / 2
/// (ChatGLM2) and head_dim, in both layouts, at head_dim 64, 128 and 256, plus the fused decode
/// append. Widths 4097, 1000 and 133 (and 4096, 11008 in the full list) reach the vector and
/// scalar paths; rotary dims 20 and 24 reach the general kernel's element-by-element partner.
fn general_shapes(full: bool) -> Vec<LayerShape> {
    use Activation::*;
    use LayerShape::*;
    use RopeLayout::{Half, Interleaved};
    let rot = |dim, layout| Rotary { dim, layout };
    let mut v = vec![
        AddLayerNorm {
            rows: 1,
            hidden: 4097,
            delta: true,
            eps: 1e-5,
        },
        AddLayerNorm {
            rows: 17,
            hidden: 1000,
            delta: true,
            eps: 1e-5,
        },
        AddLayerNorm {
            rows: 3,
            hidden: 133,
            delta: false,
            eps: 1e-5,
        },
        AddLayerNorm {
            rows: 3,
            hidden: 4096,
            delta: true,
            eps: 1e-5,
        },
        BiasAct {
            rows: 17,
            width: 1000,
            act: Relu,
            bias: true,
        },
        BiasAct {
            rows: 3,
            width: 4097,
            act: None,
            bias: true,
        },
        BiasAct {
            rows: 1,
            width: 133,
            act: Gelu,
            bias: true,
        },
        BiasAct {
            rows: 3,
            width: 4096,
            act: GeluTanh,
            bias: false,
        },
        BiasAct {
            rows: 17,
            width: 1000,
            act: Silu,
            bias: true,
        },
        Glu {
            rows: 1,
            inter: 4096,
            act: Gelu,
        },
        Glu {
            rows: 3,
            inter: 1000,
            act: GeluTanh,
        },
        Glu {
            rows: 17,
            inter: 133,
            act: Relu,
        },
        Glu {
            rows: 3,
            inter: 4097,
            act: None,
        },
        Glu {
            rows: 1,
            inter: 1000,
            act: Silu,
        },
        // OPT-125m's table: 2048 + 2 rows; positions 0, 1 and the last one.
        AddPositions {
            positions: vec![0, 1, 2047],
            offset: 2,
            table_rows: 2050,
            hidden: 1000,
        },
        AddPositions {
            positions: run_of(5, 17),
            offset: 2,
            table_rows: 40,
            hidden: 133,
        },
        AddPositions {
            positions: vec![37],
            offset: 2,
            table_rows: 40,
            hidden: 4096,
        },
        // ChatGLM2: half of each head, interleaved, GQA 16 (2 kv heads of 32 queries).
        QkvRope {
            geom: geom(32, 2, 128),
            positions: run_of(3000, 17),
            bias: true,
            rope_theta: 10000.0,
            rot: rot(64, Interleaved),
        },
        // OPT: no rotation, the split and the bias.
        QkvRope {
            geom: geom(4, 4, 128),
            positions: vec![0, 1, 2047],
            bias: true,
            rope_theta: 10000.0,
            rot: rot(0, Half),
        },
        QkvRope {
            geom: geom(4, 1, 64),
            positions: vec![4095],
            bias: false,
            rope_theta: 10000.0,
            rot: rot(32, Half),
        },
        QkvRope {
            geom: geom(8, 1, 128),
            positions: vec![7, 1000],
            bias: false,
            rope_theta: 10000.0,
            rot: rot(32, Half),
        },
        QkvRope {
            geom: geom(2, 1, 256),
            positions: vec![0, 5, 9999],
            bias: true,
            rope_theta: 10000.0,
            rot: rot(32, Interleaved),
        },
        QkvRope {
            geom: geom(4, 2, 64),
            positions: vec![1, 777, 4000],
            bias: false,
            rope_theta: 500_000.0,
            rot: rot(64, Interleaved),
        },
        QkvRope {
            geom: geom(4, 2, 64),
            positions: vec![3, 4001],
            bias: true,
            rope_theta: 10000.0,
            rot: rot(20, Half),
        },
        QkvRopeAppend {
            geom: geom(8, 2, 128),
            kv_lens: vec![1, 17, 100],
            bias: true,
            rope_theta: 10000.0,
            rot: rot(64, Interleaved),
        },
        QkvRopeAppend {
            geom: geom(4, 1, 128),
            kv_lens: vec![5, 4097],
            bias: false,
            rope_theta: 10000.0,
            rot: Rotary::whole(128),
        },
        QkvRopeAppend {
            geom: geom(4, 4, 64),
            kv_lens: vec![33, 2],
            bias: true,
            rope_theta: 10000.0,
            rot: rot(0, Half),
        },
    ];
    if full {
        v.extend([
            AddLayerNorm {
                rows: 17,
                hidden: 4096,
                delta: true,
                eps: 1e-5,
            },
            AddLayerNorm {
                rows: 3,
                hidden: 4097,
                delta: false,
                eps: 1e-5,
            },
            BiasAct {
                rows: 17,
                width: 11008,
                act: Relu,
                bias: true,
            },
            BiasAct {
                rows: 3,
                width: 133,
                act: Gelu,
                bias: false,
            },
            BiasAct {
                rows: 1,
                width: 4097,
                act: GeluTanh,
                bias: true,
            },
            Glu {
                rows: 17,
                inter: 11008,
                act: Gelu,
            },
            Glu {
                rows: 3,
                inter: 5504,
                act: GeluTanh,
            },
            Glu {
                rows: 1,
                inter: 1001,
                act: Relu,
            },
            QkvRopeAppend {
                geom: geom(4, 2, 256),
                kv_lens: vec![16, 1000, 3],
                bias: false,
                rope_theta: 10000.0,
                rot: rot(32, Half),
            },
            QkvRope {
                geom: geom(4, 2, 128),
                positions: vec![2, 2048],
                bias: true,
                rope_theta: 10000.0,
                rot: rot(24, Half),
            },
            QkvRope {
                geom: geom(4, 2, 128),
                positions: vec![2, 2048],
                bias: true,
                rope_theta: 10000.0,
                rot: rot(20, Interleaved),
            },
        ]);
        // Every head_dim × rotary_dim × layout of the issue.
        for d in [64, 128, 256] {
            for r in [0, 32, d / 2, d] {
                for layout in [Half, Interleaved] {
                    v.push(QkvRope {
                        geom: geom(8, 2, d),
                        positions: vec![0, 17, 4095],
                        bias: d != 128,
                        rope_theta: 10000.0,
                        rot: rot(r, layout),
                    });
                }
            }
        }
    }
    v
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
                rot,
            } => {
                let p = RopeParams {
                    geom: *geom,
                    dtype: c.dtype,
                    positions: positions.clone(),
                    inv_freq: inv_freq(*rope_theta, rot.dim),
                    layout: rot.layout,
                };
                rope_case(b, &p, *bias, case_seed, &mut j)
            }
            LayerShape::QkvRopeAppend {
                geom,
                kv_lens,
                bias,
                rope_theta,
                rot,
            } => {
                let p = RopeParams {
                    geom: *geom,
                    dtype: c.dtype,
                    positions: kv_lens.iter().map(|&l| l as i32 - 1).collect(),
                    inv_freq: inv_freq(*rope_theta, rot.dim),
                    layout: rot.layout,
                };
                rope_append_case(b, &p, kv_lens, *bias, case_seed, &mut j)
            }
            LayerShape::AddLayerNorm {
                rows,
                hidden,
                delta,
                eps,
            } => {
                let p = LayerNormParams {
                    rows: *rows,
                    hidden: *hidden,
                    eps: *eps,
                    dtype: c.dtype,
                };
                layernorm_case(b, &p, *delta, case_seed, &mut j)
            }
            LayerShape::BiasAct { rows, width, act, bias } => {
                let p = BiasActParams {
                    rows: *rows,
                    width: *width,
                    act: *act,
                    dtype: c.dtype,
                };
                bias_act_case(b, &p, *bias, case_seed, &mut j)
            }
            LayerShape::Glu { rows, inter, act } => {
                let p = GluParams {
                    rows: *rows,
                    inter: *inter,
                    act: *act,
                    dtype: c.dtype,
                };
                glu_case(b, &p, case_seed, &mut j)
            }
            LayerShape::AddPositions {
                positions,
                offset,
                table_rows,
                hidden,
            } => {
                let p = PositionParams {
                    positions: positions.clone(),
                    offset: *offset,
                    table_rows: *table_rows,
                    hidden: *hidden,
                    dtype: c.dtype,
                };
                positions_case(b, &p, case_seed, &mut j)
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

/// The inverse frequencies of RoPE over R = `rotary_dim` elements: θ^(−2i/R) for i < R/2 (HF
/// Llama with R = head_dim, ChatGLM2 with R = head_dim / 2), rounded to f32 as a config loader
/// would store them.
fn inv_freq(theta: f64, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| theta.powf(-2.0 * i as f64 / rotary_dim as f64) as f32)
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
        held: None,
    };
    let table = random_bits(dt, vocab * hidden, 1.0, seed ^ 1);
    let mut runs = vec![("out", table.clone(), p.clone())];
    // The middle rank's slice of three (tensor parallelism): its rows looked up, every other id
    // a zero row.
    if vocab >= 3 {
        let (first, rows) = (vocab / 3, vocab / 3);
        let part = table[first * hidden..(first + rows) * hidden].to_vec();
        let s = EmbeddingParams {
            held: Some((first, rows)),
            ..p
        };
        runs.push(("out (vocabulary slice)", part, s));
    }
    for (name, table, p) in runs {
        let tb = b.upload(dt, &table)?;
        let mut out = poisoned(b, dt, tokens * hidden)?;
        if let Err(e) = b.embedding(&p, &tb, &mut out).and_then(|()| b.synchronize()) {
            return Ok(Err(e));
        }
        j.exact(
            dt,
            name,
            &b.download(&out)?,
            &with_guard(dt, &embedding_ref(&p, &table)),
        );
    }
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

/// The decode step's qkv_rope_append: q judged by NMSE; in the pools, the new tokens' rows by
/// NMSE against the reference's k and v, and every other element (and the guard) bit for bit
/// as it was. The k and v buffers are scratch: a fused kernel leaves them, the unfused default
/// writes them, neither is judged.
fn rope_append_case<B: Backend>(b: &B, p: &RopeParams, kv_lens: &[usize], bias: bool, seed: u64, j: &mut Judge) -> Ran {
    let g = p.geom;
    let (dt, t, width) = (p.dtype, p.tokens(), p.qkv_width());
    let ps = DEFAULT_PAGE_SIZE;
    let need: usize = kv_lens.iter().map(|&l| l.div_ceil(ps)).sum();
    let layout = PagedKvLayout::new(ps, need + 3, g.num_kv_heads, g.head_dim, dt)?;
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
    let append = KvAppendParams {
        tables: FlatBlockTables::new(&layout, &tables)?,
        new_lens: vec![1; kv_lens.len()],
    };
    let qkv = random_bits(dt, t * width, 1.0, seed ^ 1);
    let bias_bits = random_bits(dt, width, 0.5, seed ^ 2);
    let k_pool = random_bits(dt, layout.pool_elems(), 1.0, seed ^ 3);
    let v_pool = random_bits(dt, layout.pool_elems(), 1.0, seed ^ 4);
    let qkv_b = b.upload(dt, &qkv)?;
    let bias_b = b.upload(dt, &bias_bits)?;
    let kv_width = g.num_kv_heads * g.head_dim;
    let mut q = poisoned(b, dt, t * g.num_heads * g.head_dim)?;
    let mut k = poisoned(b, dt, t * kv_width)?;
    let mut v = poisoned(b, dt, t * kv_width)?;
    let mut kv = PagedKv {
        layout,
        k: b.upload(dt, &with_guard(dt, &k_pool))?,
        v: b.upload(dt, &with_guard(dt, &v_pool))?,
    };
    let bias_buf = bias.then_some(&bias_b);
    if let Err(e) = {
        b.qkv_rope_append(p, &append, &qkv_b, bias_buf, &mut q, &mut k, &mut v, &mut kv)
            .and_then(|()| b.synchronize())
    } {
        return Ok(Err(e));
    }
    let (rq, rk, rv) = qkv_rope_ref(p, &qkv, bias.then_some(&bias_bits[..]));
    j.close(dt, "q", &b.download(&q)?, &rq);
    // Where each new token lives: its position's page and slot, straight from the tables.
    let rows: Vec<usize> = tables
        .iter()
        .map(|tb| {
            let pos = tb.seq_len - 1;
            layout.offset(tb.pages[pos / ps] as usize, pos % ps, 0)
        })
        .collect();
    for (name, pool, before, want) in [("K pool", &kv.k, &k_pool, &rk), ("V pool", &kv.v, &v_pool, &rv)] {
        let got = b.download(pool)?;
        if got.len() != before.len() + GUARD_ELEMS {
            j.fail(format!("{name}: download returned {} elements", got.len()));
            continue;
        }
        // The new rows, then the pool's guard: judged by NMSE, the guard intact.
        let mut new_rows: Vec<u16> = rows.iter().flat_map(|&at| got[at..at + kv_width].to_vec()).collect();
        new_rows.extend_from_slice(&got[before.len()..]);
        j.close(dt, &format!("{name} new rows"), &new_rows, want);
        // Everything else as it was: the expected pool is the old one with the new rows as got.
        let mut expect = with_guard(dt, before);
        for &at in &rows {
            expect[at..at + kv_width].copy_from_slice(&got[at..at + kv_width]);
        }
        j.exact(dt, &format!("{name} (other slots)"), &got, &expect);
    }
    Ok(Ok(()))
}

/// As [`rmsnorm_case`], with the bias, and two hard rows when rows ≥ 3: a quiet one (spread
/// near 2^-10, variance below eps, where eps must be in the right place) and an offset one
/// (mean 100, spread ±1, where a variance taken as E[x²] − mean² in f32 loses every digit).
fn layernorm_case<B: Backend>(b: &B, p: &LayerNormParams, delta: bool, seed: u64, j: &mut Judge) -> Ran {
    let (dt, n, h) = (p.dtype, p.rows * p.hidden, p.hidden);
    let mut residual = random_bits(dt, n, 1.0, seed ^ 1);
    let mut d = random_bits(dt, n, 0.5, seed ^ 2);
    if p.rows >= 3 {
        let quiet = n - 2 * h..n - h;
        residual[quiet.clone()].copy_from_slice(&random_bits(dt, h, 1.0 / 1024.0, seed ^ 4));
        d[quiet].copy_from_slice(&random_bits(dt, h, 0.5 / 1024.0, seed ^ 5));
        let offset: Vec<u16> = random_bits(dt, h, 1.0, seed ^ 6)
            .iter()
            .map(|&x| dt.from_f32(100.0 + dt.to_f32(x)))
            .collect();
        residual[n - h..].copy_from_slice(&offset);
    }
    let w = random_bits(dt, h, 1.0, seed ^ 3);
    let bias = random_bits(dt, h, 0.5, seed ^ 7);
    let mut rb = b.upload(dt, &with_guard(dt, &residual))?;
    let db = b.upload(dt, &d)?;
    let wb = b.upload(dt, &w)?;
    let bb = b.upload(dt, &bias)?;
    let mut out = poisoned(b, dt, n)?;
    let delta_buf = delta.then_some(&db);
    if let Err(e) = {
        b.add_layernorm(p, &mut rb, delta_buf, &wb, &bb, &mut out)
            .and_then(|()| b.synchronize())
    } {
        return Ok(Err(e));
    }
    let (want_res, want) = add_layernorm_ref(p, &residual, delta.then_some(&d[..]), &w, &bias);
    j.close(dt, "out", &b.download(&out)?, &want);
    j.within_one_ulp(dt, "residual", &b.download(&rb)?, &with_guard(dt, &want_res));
    Ok(Ok(()))
}

/// The reference's values rounded once to `dt`. An elementwise op computed in f32 and rounded
/// once lands within one unit in the last place of these: a stricter judge than the NMSE, which
/// a near miss such as GELU's tanh form in place of the erf one (off by up to 5e-4) passes.
fn rounded(dt: DType, v: &[f64]) -> Vec<u16> {
    v.iter().map(|&x| round_f64(dt, x)).collect()
}

/// x over [−6, 6): ReLU's kink, GELU's and SiLU's negative tails and their linear parts. x is
/// in place, so its guard is the buffer's own tail.
fn bias_act_case<B: Backend>(b: &B, p: &BiasActParams, bias: bool, seed: u64, j: &mut Judge) -> Ran {
    let dt = p.dtype;
    let x = random_bits(dt, p.rows * p.width, 6.0, seed ^ 1);
    let bias_bits = random_bits(dt, p.width, 1.0, seed ^ 2);
    let mut xb = b.upload(dt, &with_guard(dt, &x))?;
    let bb = b.upload(dt, &bias_bits)?;
    if let Err(e) = b
        .bias_act(p, &mut xb, bias.then_some(&bb))
        .and_then(|()| b.synchronize())
    {
        return Ok(Err(e));
    }
    let got = b.download(&xb)?;
    let want = bias_act_ref(p, &x, bias.then_some(&bias_bits[..]));
    j.close(dt, "x", &got, &want);
    j.within_one_ulp(dt, "x", &got, &with_guard(dt, &rounded(dt, &want)));
    Ok(Ok(()))
}

fn glu_case<B: Backend>(b: &B, p: &GluParams, seed: u64, j: &mut Judge) -> Ran {
    let dt = p.dtype;
    let gu = random_bits(dt, 2 * p.rows * p.inter, 6.0, seed ^ 1);
    let gb = b.upload(dt, &gu)?;
    let mut out = poisoned(b, dt, p.rows * p.inter)?;
    if let Err(e) = b.glu(p, &gb, &mut out).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    let got = b.download(&out)?;
    let want = glu_ref(p, &gu);
    j.close(dt, "out", &got, &want);
    j.within_one_ulp(dt, "out", &got, &with_guard(dt, &rounded(dt, &want)));
    Ok(Ok(()))
}

/// add_positions: the embeddings plus their table rows, each within one ulp of the exactly
/// rounded sum (the kernels add in f32); the guard after the embeddings intact.
fn positions_case<B: Backend>(b: &B, p: &PositionParams, seed: u64, j: &mut Judge) -> Ran {
    let dt = p.dtype;
    let n = p.positions.len() * p.hidden;
    let table = random_bits(dt, p.table_rows * p.hidden, 1.0, seed ^ 1);
    let emb = random_bits(dt, n, 1.0, seed ^ 2);
    let tb = b.upload(dt, &table)?;
    let mut ob = b.upload(dt, &with_guard(dt, &emb))?;
    if let Err(e) = b.add_positions(p, &tb, &mut ob).and_then(|()| b.synchronize()) {
        return Ok(Err(e));
    }
    j.within_one_ulp(
        dt,
        "out",
        &b.download(&ob)?,
        &with_guard(dt, &add_positions_ref(p, &table, &emb)),
    );
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
                general_cases_hold_what_issue_17_asks_for(dt, &of);
                for s in [
                    "embedding",
                    "add_rmsnorm",
                    "qkv_rope",
                    "silu_mul",
                    "kv_append",
                    "gather_rows",
                    "fill_random",
                    "add_layernorm",
                    "bias_act",
                    "glu",
                    "add_positions",
                    "qkv_rope_append",
                ] {
                    assert!(
                        list.iter().any(|c| c.dtype == dt && c.op_name() == s),
                        "{dt}: no {s} case"
                    );
                }
            }
        }
    }

    /// Issue #17's list: LayerNorm at hidden 4097, 1000 and 133 and rows 1, 3, 17; bias_act with
    /// every activation, with and without bias; GLU with GELU (both forms) and ReLU; learned
    /// positions; rotary dims 0, 32, head_dim / 2 and head_dim in both layouts, head_dim 64, 128
    /// and 256; the fused decode append in the general form.
    fn general_cases_hold_what_issue_17_asks_for(dt: DType, of: &[&LayerShape]) {
        for h in [4097, 1000, 133] {
            assert!(
                of.iter()
                    .any(|s| matches!(s, LayerShape::AddLayerNorm { hidden, .. } if *hidden == h)),
                "{dt}: layernorm hidden {h}"
            );
        }
        for rows in [1, 3, 17] {
            assert!(
                of.iter()
                    .any(|s| matches!(s, LayerShape::AddLayerNorm { rows: r, .. } if *r == rows)),
                "{dt}: layernorm rows {rows}"
            );
        }
        for act in [
            Activation::None,
            Activation::Relu,
            Activation::Silu,
            Activation::Gelu,
            Activation::GeluTanh,
        ] {
            assert!(
                of.iter()
                    .any(|s| matches!(s, LayerShape::BiasAct { act: a, .. } if *a == act)),
                "{dt}: bias_act {act:?}"
            );
            assert!(
                of.iter()
                    .any(|s| matches!(s, LayerShape::Glu { act: a, .. } if *a == act)),
                "{dt}: glu {act:?}"
            );
        }
        for bias in [false, true] {
            assert!(
                of.iter()
                    .any(|s| matches!(s, LayerShape::BiasAct { bias: x, .. } if *x == bias)),
                "{dt}: bias_act bias {bias}"
            );
        }
        assert!(
            of.iter()
                .any(|s| matches!(s, LayerShape::AddPositions { offset: 2, .. })),
            "{dt}: OPT's positions"
        );
        let rots: Vec<(usize, Rotary)> = of
            .iter()
            .filter_map(|s| match s {
                LayerShape::QkvRope { geom, rot, .. } => Some((geom.head_dim, *rot)),
                _ => None,
            })
            .collect();
        for d in [64, 128, 256] {
            assert!(
                rots.iter().any(|r| r.0 == d && r.1.dim < d),
                "{dt}: partial rotary at d {d}"
            );
        }
        for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
            for want in ["0", "32", "d/2", "d"] {
                let hit = rots.iter().any(|(d, r)| {
                    r.layout == layout
                        && match want {
                            "0" => r.dim == 0,
                            "32" => r.dim == 32 && *d > 64,
                            "d/2" => r.dim == d / 2,
                            _ => r.dim == *d,
                        }
                });
                // The quick list holds rotary 0 in the rotate-half layout only (it rotates
                // nothing, so the layout is moot there).
                if hit || (want == "0" && layout == RopeLayout::Interleaved) {
                    continue;
                }
                panic!("{dt}: no rope case with rotary {want} {layout:?}");
            }
        }
        assert!(
            of.iter()
                .any(|s| matches!(s, LayerShape::QkvRopeAppend { geom, rot, .. } if rot.dim < geom.head_dim)),
            "{dt}: fused append with partial rotary"
        );
    }

    #[test]
    fn every_quick_case_passes_on_the_cpu() {
        let b = CpuBackend::new();
        let cases = layer_cases_quick();
        let rows = check_layer(&b, &cases, 0xC0FFEE).expect("check runs");
        assert_eq!(rows.len(), cases.len());
        for r in &rows {
            assert_eq!(r.status, Status::Pass, "{} {}: {:?}", r.spec, r.case, r.status);
            let arithmetic = [
                "add_rmsnorm",
                "qkv_rope",
                "silu_mul",
                "add_layernorm",
                "bias_act",
                "glu",
            ]
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
            if !arithmetic || r.spec.starts_with("add_rmsnorm") || r.spec.starts_with("add_layernorm") {
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
            // The defaults decline through the op they fall back on: glu with SiLU through
            // silu_mul, qkv_rope_append through qkv_rope.
            let via = match op {
                "glu" => "silu_mul",
                "qkv_rope_append" => "qkv_rope",
                _ => op,
            };
            assert!(
                matches!(&r.status, Status::Skipped(m)
                    if (m.starts_with(op) || m.starts_with(via)) && m.contains(" on cpu")),
                "{} {:?}",
                r.spec,
                r.status
            );
            assert_eq!((r.nmse, r.mismatches), (None, None));
        }
    }

    /// The CPU backend with the new ops of issue #17 run by the f64 reference (each output
    /// rounded once), or with one planted bug: it tests the check's new cases themselves (their
    /// inputs, poisoning, guards and judges) before any kernel runs them.
    mod ref_ops {
        use super::*;
        use crate::backend::cpu::CpuBuffer;
        use crate::backend::{DeviceBuffer, DeviceInfo};
        use crate::ops::gemm::{GemmDims, GemmSpec};

        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Bug {
            None,
            LayerNormDropsBias,
            InterleavedAsHalf,
            PositionsIgnoreOffset,
            GeluAsTanh,
            BiasActWritesOnePast,
            AppendSkipsLastToken,
        }

        pub struct RefOps {
            pub inner: CpuBackend,
            pub bug: Bug,
        }

        impl RefOps {
            /// Overwrite the first elements of `buf` with `bits` (the rest, its guard, kept).
            fn put(&self, buf: &mut CpuBuffer, bits: &[u16]) -> Result<()> {
                let mut all = self.inner.download(buf)?;
                all[..bits.len()].copy_from_slice(bits);
                *buf = self.inner.upload(buf.dtype(), &all)?;
                Ok(())
            }

            fn put_f64(&self, buf: &mut CpuBuffer, vals: &[f64]) -> Result<()> {
                let dt = buf.dtype();
                let bits: Vec<u16> = vals.iter().map(|&v| round_f64(dt, v)).collect();
                self.put(buf, &bits)
            }
        }

        impl Backend for RefOps {
            type Buffer = CpuBuffer;
            fn info(&self) -> &DeviceInfo {
                self.inner.info()
            }
            fn kernel_hash(&self) -> String {
                self.inner.kernel_hash()
            }
            fn alloc(&self, dtype: DType, len: usize) -> Result<CpuBuffer> {
                self.inner.alloc(dtype, len)
            }
            fn upload(&self, dtype: DType, bits: &[u16]) -> Result<CpuBuffer> {
                self.inner.upload(dtype, bits)
            }
            fn download(&self, buf: &CpuBuffer) -> Result<Vec<u16>> {
                self.inner.download(buf)
            }
            fn fill(&self, buf: &mut CpuBuffer, bits: u16) -> Result<()> {
                self.inner.fill(buf, bits)
            }
            fn gemm_candidates(&self, dtype: DType, n: usize, k: usize) -> Vec<GemmSpec> {
                self.inner.gemm_candidates(dtype, n, k)
            }
            fn gemm(
                &self,
                spec: &GemmSpec,
                d: GemmDims,
                x: &CpuBuffer,
                w: &CpuBuffer,
                y: &mut CpuBuffer,
            ) -> Result<()> {
                self.inner.gemm(spec, d, x, w, y)
            }
            fn synchronize(&self) -> Result<()> {
                self.inner.synchronize()
            }
            fn copy_gbps(&self) -> Result<f64> {
                self.inner.copy_gbps()
            }
            fn time_each(&self, reps: usize, f: &mut dyn FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
                self.inner.time_each(reps, f)
            }
            fn silu_mul(&self, p: &SiluMulParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
                self.inner.silu_mul(p, gate_up, out)
            }
            fn kv_append(
                &self,
                p: &KvAppendParams,
                k: &CpuBuffer,
                v: &CpuBuffer,
                kv: &mut PagedKv<CpuBuffer>,
            ) -> Result<()> {
                if self.bug == Bug::AppendSkipsLastToken {
                    let mut short = p.clone();
                    if let Some(last) = short.new_lens.len().checked_sub(1) {
                        short.tables.seq_lens[last] -= 1;
                        short.new_lens.truncate(last);
                        short.tables.seq_lens.truncate(last);
                        short.tables.block_table.truncate(last * short.tables.max_pages);
                    }
                    return self.inner.kv_append(&short, k, v, kv);
                }
                self.inner.kv_append(p, k, v, kv)
            }
            fn qkv_rope(
                &self,
                p: &RopeParams,
                qkv: &CpuBuffer,
                bias: Option<&CpuBuffer>,
                q: &mut CpuBuffer,
                k: &mut CpuBuffer,
                v: &mut CpuBuffer,
            ) -> Result<()> {
                let mut p = p.clone();
                if self.bug == Bug::InterleavedAsHalf {
                    p.layout = RopeLayout::Half;
                }
                let b = match bias {
                    Some(b) => Some(self.inner.download(b)?),
                    None => None,
                };
                let (rq, rk, rv) = qkv_rope_ref(&p, &self.inner.download(qkv)?, b.as_deref());
                self.put_f64(q, &rq)?;
                self.put_f64(k, &rk)?;
                self.put_f64(v, &rv)
            }
            fn add_layernorm(
                &self,
                p: &LayerNormParams,
                residual: &mut CpuBuffer,
                delta: Option<&CpuBuffer>,
                weight: &CpuBuffer,
                bias: &CpuBuffer,
                out: &mut CpuBuffer,
            ) -> Result<()> {
                let d = match delta {
                    Some(d) => Some(self.inner.download(d)?),
                    None => None,
                };
                let mut b = self.inner.download(bias)?;
                if self.bug == Bug::LayerNormDropsBias {
                    b.fill(0);
                }
                let (res, y) = add_layernorm_ref(
                    p,
                    &self.inner.download(residual)?,
                    d.as_deref(),
                    &self.inner.download(weight)?,
                    &b,
                );
                self.put(residual, &res)?;
                self.put_f64(out, &y)
            }
            fn bias_act(&self, p: &BiasActParams, x: &mut CpuBuffer, bias: Option<&CpuBuffer>) -> Result<()> {
                let b = match bias {
                    Some(b) => Some(self.inner.download(b)?),
                    None => None,
                };
                let mut y = bias_act_ref(p, &self.inner.download(x)?, b.as_deref());
                if self.bug == Bug::BiasActWritesOnePast {
                    y.push(0.0);
                }
                self.put_f64(x, &y)
            }
            fn glu(&self, p: &GluParams, gate_up: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
                let mut p = *p;
                if self.bug == Bug::GeluAsTanh && p.act == Activation::Gelu {
                    p.act = Activation::GeluTanh;
                }
                self.put_f64(out, &glu_ref(&p, &self.inner.download(gate_up)?))
            }
            fn add_positions(&self, p: &PositionParams, table: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
                let mut p = p.clone();
                if self.bug == Bug::PositionsIgnoreOffset {
                    p.offset = 0;
                }
                let y = add_positions_ref(&p, &self.inner.download(table)?, &self.inner.download(out)?);
                self.put(out, &y)
            }
        }
    }

    /// The ops the general model executor added (issue #17): LayerNorm, bias+activation, GLU
    /// other than SiLU, learned positions, rotary other than whole-head rotate-half.
    fn executor_op(c: &LayerCase) -> bool {
        match &c.shape {
            LayerShape::AddLayerNorm { .. } | LayerShape::BiasAct { .. } | LayerShape::AddPositions { .. } => true,
            LayerShape::Glu { act, .. } => *act != Activation::Silu,
            LayerShape::QkvRope { geom, rot, .. } | LayerShape::QkvRopeAppend { geom, rot, .. } => {
                *rot != Rotary::whole(geom.head_dim)
            }
            _ => false,
        }
    }

    #[test]
    fn the_new_cases_pass_on_the_reference_and_catch_planted_bugs() {
        use ref_ops::{Bug, RefOps};
        let cases: Vec<LayerCase> = layer_cases_quick()
            .into_iter()
            .filter(|c| executor_op(c) || matches!(c.shape, LayerShape::QkvRopeAppend { .. }))
            .collect();
        let run = |bug| {
            let b = RefOps {
                inner: CpuBackend::new(),
                bug,
            };
            check_layer(&b, &cases, 7).expect("check runs")
        };
        for r in run(Bug::None) {
            assert_eq!(r.status, Status::Pass, "{} {}: {:?}", r.spec, r.case, r.status);
        }
        for (bug, op, why) in [
            (Bug::LayerNormDropsBias, "add_layernorm", "NMSE"),
            (Bug::InterleavedAsHalf, "qkv_rope", "NMSE"),
            (Bug::InterleavedAsHalf, "qkv_rope_append", "NMSE"),
            (Bug::PositionsIgnoreOffset, "add_positions", "differ"),
            (Bug::GeluAsTanh, "glu", "by more than 1 ulp"),
            (Bug::BiasActWritesOnePast, "bias_act", "guard"),
            (Bug::AppendSkipsLastToken, "qkv_rope_append", "pool new rows"),
        ] {
            let rows = run(bug);
            let failed: Vec<_> = rows
                .iter()
                .filter(|r| r.spec.rsplit_once('_').is_some_and(|(o, _)| o == op))
                .filter_map(|r| match &r.status {
                    Status::Fail(m) => Some(m.clone()),
                    _ => None,
                })
                .collect();
            assert!(
                failed.iter().any(|m| m.contains(why)),
                "{bug:?}: no {op} case failed with {why:?}: {failed:?}"
            );
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
