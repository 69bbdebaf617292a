use clap::Args;

use super::Format;
use crate::model::{presets, ModelShapes};

#[derive(Args, Debug)]
pub struct ShapesArgs {
    /// Preset name, or a path to an HF config.json (or a directory holding one).
    #[arg(long)]
    pub model: String,
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
}

pub fn run(a: ShapesArgs) -> anyhow::Result<()> {
    let cfg = presets::preset(&a.model)?;
    let s = ModelShapes::of(&cfg);
    for l in &s.linears {
        println!("{} K={} N={}", l.kind, l.k, l.n);
    }
    Ok(())
}
