//! The memory plan of a generation, computed before the first step: weight bytes, the KV pages,
//! and the activation buffers of the largest step, laid out in one pool per device as
//! FlashDecoding++Next describes (KV pages grow from the bottom, activation buffers from the
//! top, so whatever is left between them is one free gap).
//!
//! Activations with reuse (FlashDecoding++Next's buffer reuse): a layer's ops run one after
//! the other, so three buffers serve every layer — the residual stream; a "narrow" buffer that
//! holds in turn the normed input, the attention output and the SiLU·mul output (every GEMM
//! input); a "wide" buffer that holds in turn the QKV output, the O output, the FFN1 output
//! and the FFN2 output (every GEMM output) — plus q, k and v scratch for attention. Without
//! reuse (`--no-reuse`, for comparison) every op of every layer writes its own buffer.
//!
//! The plan gives each buffer an offset in the pool, but backends allocate the KV pools and
//! the activation buffers as separate buffers today (the trait has no sub-allocation): the
//! offsets are the layout a single-allocation backend would use, and the byte counts are
//! exact either way.

use serde::Serialize;

use crate::dtype::DType;
use crate::error::{FdppError, Result};
use crate::model::arch::Arch;
use crate::model::ModelConfig;

/// The buffers one layer writes, as indices into [`ActPlan::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSlots {
    pub normed_attn: usize,
    pub qkv: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub attn: usize,
    pub o: usize,
    pub normed_ffn: usize,
    pub ffn1: usize,
    pub act: usize,
    pub ffn2: usize,
}

/// The buffers outside the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalSlots {
    pub residual: usize,
    pub final_normed: usize,
    /// The last token of each sequence, gathered before the LM head.
    pub gathered: usize,
    pub logits: usize,
    /// The token embedding before project_in, and the LM head's input after project_out, when
    /// the model projects its embedding (OPT's word_embed_proj_dim).
    pub embedded: Option<usize>,
    pub projected: Option<usize>,
}

/// The widths the activation buffers are sized by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActDims {
    pub hidden: usize,
    pub q: usize,
    pub kv: usize,
    /// The MLP's inner width (the GLU or activation output).
    pub inter: usize,
    /// FFN1's output width (2·inter when gated).
    pub ffn1: usize,
    /// The embedding's width (hidden unless projected).
    pub embed: usize,
    pub vocab: usize,
    pub layers: usize,
    /// A gated MLP (GLU from FFN1 into `act`); a plain one applies its activation to FFN1's
    /// output in place and FFN2 reads it there.
    pub gated: bool,
}

impl ActDims {
    pub fn of(a: &Arch) -> ActDims {
        ActDims {
            hidden: a.hidden,
            q: a.q_width(),
            kv: a.kv_width(),
            inter: a.inter,
            ffn1: a.ffn1_width(),
            embed: a.embed_dim,
            vocab: a.vocab,
            layers: a.layers,
            gated: matches!(a.mlp, crate::model::arch::Mlp::Gated(_)),
        }
    }

    /// From a config alone (a preset's description); a config the engine cannot describe is
    /// sized as a gated MLP, the largest FFN1.
    pub fn of_config(cfg: &ModelConfig) -> ActDims {
        match Arch::from_config(cfg) {
            Ok(a) => ActDims::of(&a),
            Err(_) => ActDims {
                hidden: cfg.hidden_size,
                q: cfg.num_heads * cfg.head_dim,
                kv: cfg.num_kv_heads * cfg.head_dim,
                inter: cfg.intermediate_size,
                ffn1: 2 * cfg.intermediate_size,
                embed: cfg.hidden_size,
                vocab: cfg.vocab_size,
                layers: cfg.num_layers,
                gated: true,
            },
        }
    }

    fn projects(&self) -> bool {
        self.embed != self.hidden
    }
}

/// One activation buffer: its name, its size and where it sits in the pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActBuffer {
    pub name: String,
    pub elems: usize,
    pub bytes: u64,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ActPlan {
    pub reuse: bool,
    /// Rows (tokens) of the largest step.
    pub max_tokens: usize,
    /// Sequences of the largest step (rows of the logits).
    pub max_batch: usize,
    pub buffers: Vec<ActBuffer>,
    pub bytes: u64,
    /// Offset of the lowest activation buffer in the pool (they fill the pool's top).
    pub offset: u64,
    #[serde(skip)]
    pub layers: Vec<LayerSlots>,
    #[serde(skip)]
    pub globals: GlobalSlots,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvPlan {
    pub page_size: usize,
    pub num_pages: usize,
    /// K and V of one token in every layer.
    pub bytes_per_token: u64,
    pub bytes: u64,
    /// The KV pages start at the bottom of the pool.
    pub offset: u64,
}

impl KvPlan {
    pub fn capacity_tokens(&self) -> usize {
        self.num_pages * self.page_size
    }
}

/// What the plan is made from.
#[derive(Clone, Debug)]
pub struct MemoryRequest {
    pub dtype: DType,
    /// What the device has (for the CPU, the host's memory).
    pub device_memory: u64,
    /// Share of `device_memory` fdpp may use, weights included.
    pub mem_fraction: f64,
    pub weights_bytes: u64,
    /// Tokens of the largest step (a prefill chunk or a decode batch).
    pub max_step_tokens: usize,
    /// Sequences decoded together.
    pub max_batch: usize,
    pub page_size: usize,
    pub reuse: bool,
    /// Tokens each sequence needs over the whole run (prompt plus generated): the plan refuses
    /// when the pool cannot hold them.
    pub seq_tokens: Vec<usize>,
    /// At most this many KV tokens (`--max-kv-tokens`); None: every page the pool can hold.
    pub kv_tokens_cap: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    pub dtype: DType,
    pub device_memory: u64,
    pub mem_fraction: f64,
    /// Resident outside the pool.
    pub weights_bytes: u64,
    /// mem_fraction · device_memory − weights: KV from the bottom, activations from the top.
    pub pool_bytes: u64,
    pub kv: KvPlan,
    pub activations: ActPlan,
    /// Between the last KV page and the first activation buffer.
    pub free_bytes: u64,
    /// Weights, KV and activations.
    pub total_bytes: u64,
}

/// The activation buffers of a step of `tokens` rows and `batch` sequences of the model of
/// `cfg` (a preset's description; the engine plans with [`plan_activations_for`]).
pub fn plan_activations(cfg: &ModelConfig, dtype: DType, tokens: usize, batch: usize, reuse: bool) -> ActPlan {
    plan_activations_for(&ActDims::of_config(cfg), dtype, tokens, batch, reuse)
}

/// The activation buffers of a step of `tokens` rows and `batch` sequences.
pub fn plan_activations_for(d: &ActDims, dtype: DType, tokens: usize, batch: usize, reuse: bool) -> ActPlan {
    let t = tokens.max(1);
    let b = batch.max(1);
    let (h, qd, kvd, inter, e) = (d.hidden, d.q, d.kv, d.inter, d.embed);
    let qkv_n = qd + 2 * kvd;
    let mut buffers: Vec<(String, usize)> = Vec::new();
    let mut add = |name: String, elems: usize| {
        buffers.push((name, elems));
        buffers.len() - 1
    };
    let residual = add("residual".into(), t * h);
    let (layers, final_normed, embedded, projected) = if reuse {
        // Every GEMM input lands in `narrow`, every GEMM output in `wide`; see the module docs
        // for why no op reads and writes the same one.
        // The embedding before project_in lands in `narrow` (project_in writes the residual),
        // the LM head's input after project_out in `wide`.
        let narrow = add(
            "narrow (normed, attention out, mlp act out)".into(),
            t * h.max(qd).max(inter).max(e),
        );
        let wide = add(
            "wide (qkv, o, ffn1, ffn2 out)".into(),
            (t * qkv_n.max(if d.gated { d.ffn1 } else { 0 }).max(h)).max(b * e),
        );
        let q = add("q".into(), t * qd);
        let k = add("k".into(), t * kvd);
        let v = add("v".into(), t * kvd);
        // A plain MLP's FFN1 output is activated in place and read by FFN2, which writes the
        // wide buffer: it needs a fourth buffer of its own (OPT).
        let (ffn1, act) = if d.gated {
            (wide, narrow)
        } else {
            let mlp = add("mlp (ffn1 out, activation in place)".into(), t * d.ffn1);
            (mlp, mlp)
        };
        let slots = LayerSlots {
            normed_attn: narrow,
            qkv: wide,
            q,
            k,
            v,
            attn: narrow,
            o: wide,
            normed_ffn: narrow,
            ffn1,
            act,
            ffn2: wide,
        };
        let proj = d.projects();
        (
            vec![slots; d.layers],
            narrow,
            proj.then_some(narrow),
            proj.then_some(wide),
        )
    } else {
        let layers = (0..d.layers)
            .map(|l| {
                let normed_attn = add(format!("layer {l} normed_attn"), t * h);
                let qkv = add(format!("layer {l} qkv"), t * qkv_n);
                let q = add(format!("layer {l} q"), t * qd);
                let k = add(format!("layer {l} k"), t * kvd);
                let v = add(format!("layer {l} v"), t * kvd);
                let attn = add(format!("layer {l} attn"), t * qd);
                let o = add(format!("layer {l} o"), t * h);
                let normed_ffn = add(format!("layer {l} normed_ffn"), t * h);
                let ffn1 = add(format!("layer {l} ffn1"), t * d.ffn1);
                // A plain MLP activates FFN1's output in place.
                let act = if d.gated {
                    add(format!("layer {l} act"), t * inter)
                } else {
                    ffn1
                };
                LayerSlots {
                    normed_attn,
                    qkv,
                    q,
                    k,
                    v,
                    attn,
                    o,
                    normed_ffn,
                    ffn1,
                    act,
                    ffn2: add(format!("layer {l} ffn2"), t * h),
                }
            })
            .collect();
        let final_normed = add("final_normed".into(), t * h);
        let (embedded, projected) = if d.projects() {
            (
                Some(add("embedded".into(), t * e)),
                Some(add("projected".into(), b * e)),
            )
        } else {
            (None, None)
        };
        (layers, final_normed, embedded, projected)
    };
    let gathered = add("gathered".into(), b * h);
    let logits = add("logits".into(), b * d.vocab);
    let globals = GlobalSlots {
        residual,
        final_normed,
        gathered,
        logits,
        embedded,
        projected,
    };
    let elem = dtype.size_bytes() as u64;
    let buffers: Vec<ActBuffer> = buffers
        .into_iter()
        .map(|(name, elems)| ActBuffer {
            name,
            elems,
            bytes: elems as u64 * elem,
            offset: 0,
        })
        .collect();
    let bytes = buffers.iter().map(|b| b.bytes).sum();
    ActPlan {
        reuse,
        max_tokens: t,
        max_batch: b,
        buffers,
        bytes,
        offset: 0,
        layers,
        globals,
    }
}

/// K and V of one token over every layer.
pub fn kv_bytes_per_token(cfg: &ModelConfig, dtype: DType) -> u64 {
    (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.size_bytes()) as u64
}

/// The whole plan, or an error saying how much memory the request needs.
pub fn plan(cfg: &ModelConfig, dims: &ActDims, req: &MemoryRequest) -> Result<MemoryPlan> {
    if !(req.mem_fraction > 0.0 && req.mem_fraction <= 1.0) {
        return Err(FdppError::InvalidArgument(format!(
            "--mem-fraction {} must be in (0, 1]",
            req.mem_fraction
        )));
    }
    if req.page_size == 0 {
        return Err(FdppError::InvalidArgument("--page-size must be at least 1".into()));
    }
    let mut act = plan_activations_for(dims, req.dtype, req.max_step_tokens, req.max_batch, req.reuse);
    let per_token = kv_bytes_per_token(cfg, req.dtype);
    let page_bytes = per_token.saturating_mul(req.page_size as u64);
    let need_pages: usize = req.seq_tokens.iter().map(|&t| t.div_ceil(req.page_size)).sum();
    let usable = (req.device_memory as f64 * req.mem_fraction) as u64;
    let need_kv = (need_pages as u64).saturating_mul(page_bytes);
    let need_total = req.weights_bytes.saturating_add(act.bytes).saturating_add(need_kv);
    let room = usable.saturating_sub(req.weights_bytes + act.bytes);
    let fit_pages = (room / page_bytes.max(1)) as usize;
    // KV is reserved in whole pages: a page much longer than the sequences can be what does not
    // fit, and then the page size is what to change, not the batch.
    let exact_kv = req.seq_tokens.iter().map(|&t| t as u64).sum::<u64>() * per_token;
    if need_total > usable && req.weights_bytes + act.bytes + exact_kv <= usable {
        return Err(FdppError::InvalidArgument(format!(
            "--page-size {}: KV is reserved in whole pages of {} tokens, so {} tokens over {} \
             sequences take {} pages = {} of KV (the tokens themselves need {}), more than the {} \
             usable ({} of {}); lower --page-size (default {})",
            req.page_size,
            req.page_size,
            req.seq_tokens.iter().sum::<usize>(),
            req.seq_tokens.len(),
            need_pages,
            gib(need_kv),
            gib(exact_kv),
            gib(usable),
            req.mem_fraction,
            gib(req.device_memory),
            crate::kv::DEFAULT_PAGE_SIZE
        )));
    }
    if need_total > usable {
        return Err(FdppError::InvalidArgument(format!(
            "the batch does not fit: it needs {} (weights {}, activations {} for {} tokens per step, \
             KV {} for {} tokens over {} sequences), but {} of the {} device memory is {}; lower \
             the batch, the prompt length, --max-tokens or --chunk-size, or raise --mem-fraction",
            gib(need_total),
            gib(req.weights_bytes),
            gib(act.bytes),
            act.max_tokens,
            gib(need_kv),
            req.seq_tokens.iter().sum::<usize>(),
            req.seq_tokens.len(),
            req.mem_fraction,
            gib(req.device_memory),
            gib(usable)
        )));
    }
    let cap_pages = req.kv_tokens_cap.map_or(usize::MAX, |t| t.div_ceil(req.page_size));
    let num_pages = fit_pages.min(cap_pages).max(1);
    let pool_bytes = usable - req.weights_bytes;
    let kv = KvPlan {
        page_size: req.page_size,
        num_pages,
        bytes_per_token: per_token,
        bytes: num_pages as u64 * page_bytes,
        offset: 0,
    };
    // Activations fill the pool from the top: the first buffer sits highest.
    let mut top = pool_bytes;
    for b in &mut act.buffers {
        top -= b.bytes;
        b.offset = top;
    }
    act.offset = top;
    Ok(MemoryPlan {
        dtype: req.dtype,
        device_memory: req.device_memory,
        mem_fraction: req.mem_fraction,
        weights_bytes: req.weights_bytes,
        pool_bytes,
        free_bytes: top - kv.bytes,
        total_bytes: req.weights_bytes + kv.bytes + act.bytes,
        kv,
        activations: act,
    })
}

/// Bytes in GiB with two decimals (MiB below one GiB).
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

impl MemoryPlan {
    /// A few lines for the user.
    pub fn summary(&self) -> Vec<String> {
        let a = &self.activations;
        vec![
            format!(
                "memory: weights {}, KV {} ({} pages of {} tokens = {} tokens), activations {} ({} buffers, {}, {} tokens per step)",
                gib(self.weights_bytes),
                gib(self.kv.bytes),
                self.kv.num_pages,
                self.kv.page_size,
                self.kv.capacity_tokens(),
                gib(a.bytes),
                a.buffers.len(),
                if a.reuse { "reused across layers" } else { "one per op per layer" },
                a.max_tokens
            ),
            // What is allocated first: the budget is an upper bound (all of it on a GPU without
            // --max-kv-tokens; on the CPU the KV is sized from the request, and a 1 MB model
            // must not read as a 21 GiB pool).
            format!(
                "pool: {} allocated (KV {} + activations {}) within a budget of {} ({} of {} minus weights); {} of the budget left unused",
                gib(self.kv.bytes + a.bytes),
                gib(self.kv.bytes),
                gib(a.bytes),
                gib(self.pool_bytes),
                self.mem_fraction,
                gib(self.device_memory),
                gib(self.free_bytes)
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::presets::preset;

    fn req(reuse: bool) -> MemoryRequest {
        MemoryRequest {
            dtype: DType::F16,
            device_memory: 80 << 30,
            mem_fraction: 0.9,
            weights_bytes: 13_476_839_424,
            max_step_tokens: 2048,
            max_batch: 32,
            page_size: 16,
            reuse,
            seq_tokens: vec![1024 + 128; 32],
            kv_tokens_cap: None,
        }
    }

    #[test]
    fn llama2_7b_numbers_add_up() {
        let cfg = preset("llama2-7b").expect("preset");
        let p = plan(&cfg, &ActDims::of_config(&cfg), &req(true)).expect("fits");
        // 2 (K, V) · 32 layers · 32 heads · 128 · 2 bytes = 512 KiB per token.
        assert_eq!(p.kv.bytes_per_token, 524_288);
        let a = &p.activations;
        // residual 4096, narrow 11008, wide 22016, q 4096, k 4096, v 4096 per token; gathered
        // and logits per sequence.
        let per_token = 4096 + 11008 + 22016 + 3 * 4096;
        let want = 2 * (2048 * per_token + 32 * (4096 + 32000)) as u64;
        assert_eq!(a.bytes, want);
        assert_eq!(
            p.pool_bytes,
            (80.0 * 0.9 * (1u64 << 30) as f64) as u64 - p.weights_bytes
        );
        assert_eq!(p.kv.bytes + a.bytes + p.free_bytes, p.pool_bytes);
        assert!(p.kv.bytes + a.bytes <= p.pool_bytes);
        // Activations sit at the top, the first buffer highest, without overlap.
        assert_eq!(a.buffers[0].offset + a.buffers[0].bytes, p.pool_bytes);
        for w in a.buffers.windows(2) {
            assert_eq!(w[1].offset + w[1].bytes, w[0].offset);
        }
        assert_eq!(a.offset, a.buffers.last().expect("buffers").offset);
        assert!(p.kv.offset + p.kv.bytes <= a.offset);
        assert!(p.kv.capacity_tokens() >= 32 * 1152);
    }

    #[test]
    fn reuse_needs_far_less_than_a_buffer_per_op() {
        let cfg = preset("llama2-7b").expect("preset");
        let with = plan_activations(&cfg, DType::F16, 512, 8, true);
        let without = plan_activations(&cfg, DType::F16, 512, 8, false);
        assert!(
            with.bytes * 5 <= without.bytes * 4,
            "{} vs {}",
            with.bytes,
            without.bytes
        );
        assert_eq!(without.buffers.len(), 11 * 32 + 4);
        assert_eq!(with.buffers.len(), 8);
        // Reuse: an op never reads the buffer it writes.
        let s = with.layers[0];
        assert_ne!(s.normed_attn, s.qkv);
        assert_ne!(s.attn, s.o);
        assert_ne!(s.act, s.ffn2);
        assert_ne!(s.ffn1, s.act);
        assert_eq!(with.layers[0], with.layers[31]);
        // Without reuse no two slots share a buffer.
        let mut all: Vec<usize> = without
            .layers
            .iter()
            .flat_map(|s| {
                [
                    s.normed_attn,
                    s.qkv,
                    s.q,
                    s.k,
                    s.v,
                    s.attn,
                    s.o,
                    s.normed_ffn,
                    s.ffn1,
                    s.act,
                    s.ffn2,
                ]
            })
            .collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 11 * 32);
    }

    #[test]
    fn a_cap_limits_the_pages_and_a_batch_too_large_says_what_it_needs() {
        let cfg = preset("llama2-7b").expect("preset");
        let mut r = req(true);
        r.kv_tokens_cap = Some(1000);
        let dims = ActDims::of_config(&cfg);
        let p = plan(&cfg, &dims, &r).expect("fits");
        assert_eq!(p.kv.num_pages, 63);
        r.seq_tokens = vec![4096; 256];
        let e = plan(&cfg, &dims, &r).expect_err("256 × 4096 tokens of 512 KiB = 512 GiB");
        let msg = e.to_string();
        assert!(msg.contains("does not fit") && msg.contains("KV 512.00 GiB"), "{msg}");
        let mut r = req(true);
        r.mem_fraction = 1.5;
        assert!(plan(&cfg, &dims, &r).is_err());
    }
}
