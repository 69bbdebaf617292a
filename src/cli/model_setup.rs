//! What `fdpp generate` and `fdpp bench e2e` resolve the same way: where the weights come from
//! and which tuning profile the linear ops follow.

use std::path::PathBuf;

use anyhow::bail;

use crate::backend::Backend;
use crate::dtype::DType;
use crate::engine::build::WeightSource;
use crate::model::llama::ModelSpec;
use crate::profile::{self, Profile};

/// `--random-weights` or the HF directory's safetensors; a preset without `--random-weights`
/// has no weights to read.
pub fn weight_source(
    spec: &ModelSpec,
    model_arg: &str,
    random_weights: bool,
    seed: u64,
) -> anyhow::Result<WeightSource> {
    Ok(match (&spec.dir, random_weights) {
        (_, true) => WeightSource::Random { seed },
        (Some(dir), false) => WeightSource::Dir(dir.clone()),
        (None, false) => {
            bail!("'{model_arg}' is a preset: it has no weights; add --random-weights, or give an HF model directory")
        }
    })
}

/// Where `profiles/<device-slug>/<model>.json` would be for this backend and model.
pub fn default_profile_path<B: Backend>(b: &B, spec: &ModelSpec) -> PathBuf {
    profile::default_path(&b.info().slug, &spec.cfg.name)
}

/// A profile that was found: the profile and its path.
pub struct FoundProfile {
    pub profile: Profile,
    pub path: PathBuf,
}

/// `--profile P`, `--profile none` (None), or, when not given, the default path when a profile
/// is there. The string says what was chosen, for the user.
pub fn find_profile<B: Backend>(
    b: &B,
    arg: Option<&str>,
    spec: &ModelSpec,
    model_arg: &str,
    dtype: DType,
) -> anyhow::Result<(Option<FoundProfile>, String)> {
    let path: PathBuf = match arg {
        Some("none") => return Ok((None, "profile: none (vendor GEMM for every linear op)".into())),
        Some(p) => PathBuf::from(p),
        None => {
            let p = default_profile_path(b, spec);
            if !p.exists() {
                return Ok((
                    None,
                    format!(
                        "profile: none found at {} (defaults: vendor GEMM; run `fdpp tune --model {model_arg}` to make one)",
                        p.display(),
                    ),
                ));
            }
            p
        }
    };
    let profile = load_profile(b, &path, spec, dtype)?;
    let note = format!("profile: {}", path.display());
    Ok((Some(FoundProfile { profile, path }), note))
}

/// Load a profile for this device and model, printing its warnings (another dtype included).
pub fn load_profile<B: Backend>(
    b: &B,
    path: &std::path::Path,
    spec: &ModelSpec,
    dtype: DType,
) -> anyhow::Result<Profile> {
    let (p, warnings) = profile::load_for_use(path, &spec.cfg, b.info(), &b.kernel_hash())?;
    for w in warnings {
        eprintln!("warning: {w}");
    }
    if p.dtype != dtype {
        eprintln!(
            "warning: {} was tuned for {}; running {} with its thresholds",
            path.display(),
            p.dtype,
            dtype
        );
    }
    Ok(p)
}
