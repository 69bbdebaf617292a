//! `fdpp shapes`: the four linear shapes [K, N] a decoder layer runs, the attention geometry and
//! the weight bytes one decode step reads. These [K, N] are what `tune` sweeps over M.

use std::fmt::Write as _;

use clap::Args;

use super::Format;
use crate::model::{LinearKind, ModelConfig, ModelShapes};

#[derive(Args, Debug)]
pub struct ShapesArgs {
    /// Preset name, a path to an HF config.json (or a directory holding one), or a GGUF file.
    #[arg(long)]
    pub model: String,
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
}

pub fn run(a: ShapesArgs) -> anyhow::Result<()> {
    let cfg = ModelConfig::resolve(&a.model)?;
    let shapes = ModelShapes::of(&cfg);
    print!("{}", render(&shapes, a.format)?);
    Ok(())
}

/// The table in the requested format, ending with a newline.
pub fn render(s: &ModelShapes, format: Format) -> anyhow::Result<String> {
    match format {
        Format::Md => Ok(markdown(s)),
        Format::Csv => csv(s),
        Format::Json => Ok(serde_json::to_string_pretty(s)? + "\n"),
    }
}

const MIB: f64 = (1u64 << 20) as f64;

fn weight_gb_per_token(s: &ModelShapes) -> f64 {
    s.weight_bytes_per_token as f64 / 1e9
}

/// One sentence on what FFN1 holds, since its N differs from the checkpoint's tensors.
pub fn ffn1_note(s: &ModelShapes) -> String {
    let n = s.get(LinearKind::Ffn1).map_or(0, |l| l.n);
    if s.ffn1_fused_gate_up {
        format!(
            "FFN1 fuses gate+up into one GEMM: N = 2·intermediate = 2·{} = {n}.",
            s.intermediate_size
        )
    } else {
        format!("FFN1 is the single up projection (no gate): N = intermediate = {n}.")
    }
}

fn markdown(s: &ModelShapes) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail; the results are ignored for that reason.
    let _ = writeln!(
        out,
        "## {} ({}): y[M,N] = x[M,K] · W[N,K]ᵀ per layer\n",
        s.model, s.arch
    );
    let _ = writeln!(out, "| linear | K | N | weight MiB (fp16) |");
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for l in &s.linears {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} |",
            l.kind,
            l.k,
            l.n,
            l.weight_bytes() as f64 / MIB
        );
    }
    let _ = writeln!(out, "\n{}\n", ffn1_note(s));
    let _ = writeln!(out, "| attention and totals | value |");
    let _ = writeln!(out, "|---|---:|");
    let rows: [(&str, String); 6] = [
        ("heads", s.attention.num_heads.to_string()),
        ("kv heads", s.attention.num_kv_heads.to_string()),
        ("head dim", s.attention.head_dim.to_string()),
        ("GQA ratio (heads per kv head)", s.gqa_ratio.to_string()),
        ("layers", s.num_layers.to_string()),
        (
            "weight GB read per token (fp16, all layers + LM head)",
            format!("{:.2}", weight_gb_per_token(s)),
        ),
    ];
    for (name, value) in rows {
        let _ = writeln!(out, "| {name} | {value} |");
    }
    out
}

/// One self-describing row per linear: the model-wide columns repeat so that rows from several
/// models can be concatenated and filtered.
fn csv(s: &ModelShapes) -> anyhow::Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record([
        "model",
        "arch",
        "linear",
        "k",
        "n",
        "weight_mib",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "gqa_ratio",
        "num_layers",
        "weight_gb_per_token",
        "ffn1_fused_gate_up",
    ])?;
    for l in &s.linears {
        w.write_record([
            s.model.clone(),
            s.arch.to_string(),
            l.kind.to_string(),
            l.k.to_string(),
            l.n.to_string(),
            format!("{:.2}", l.weight_bytes() as f64 / MIB),
            s.attention.num_heads.to_string(),
            s.attention.num_kv_heads.to_string(),
            s.attention.head_dim.to_string(),
            s.gqa_ratio.to_string(),
            s.num_layers.to_string(),
            format!("{:.3}", weight_gb_per_token(s)),
            s.ffn1_fused_gate_up.to_string(),
        ])?;
    }
    let bytes = w.into_inner().map_err(|e| anyhow::anyhow!("csv: {e}"))?;
    Ok(String::from_utf8(bytes)?)
}
