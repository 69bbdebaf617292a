//! What `fdpp generate` and `fdpp bench e2e` resolve the same way: where the weights come from
//! and which tuning profile the linear ops follow.

use std::path::PathBuf;

use anyhow::bail;

use crate::backend::Backend;
use crate::dtype::DType;
use crate::engine::build::WeightSource;
use crate::model::llama::ModelSpec;
use crate::profile::{self, lookup, Profile};

/// `--random-weights` or the HF directory's safetensors; a preset without `--random-weights`
/// has no weights to read.
pub fn weight_source(
    spec: &ModelSpec,
    model_arg: &str,
    random_weights: bool,
    seed: u64,
) -> anyhow::Result<WeightSource> {
    if let (Some(g), false) = (&spec.gguf, random_weights) {
        return Ok(WeightSource::Gguf(g.clone()));
    }
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

/// `--profile P`, `--profile none` (None), or, when not given, the best profile of this device
/// for the model's shapes ([`lookup::find`]: any model whose four linear shapes match, the
/// softmax section only from the model's own). The string says what was chosen and why, one
/// line per fact, the first `profile: <path>`.
pub fn find_profile<B: Backend>(
    b: &B,
    arg: Option<&str>,
    spec: &ModelSpec,
    model_arg: &str,
    dtype: DType,
) -> anyhow::Result<(Option<FoundProfile>, String)> {
    match arg {
        Some("none") => Ok((
            None,
            format!(
                "profile: none (asked for): {}",
                crate::select::Fallback::configured(b.info().backend)?.describe()
            ),
        )),
        Some(p) => {
            let path = PathBuf::from(p);
            let profile = load_profile(b, &path, spec, dtype)?;
            Ok((
                Some(FoundProfile {
                    profile,
                    path: path.clone(),
                }),
                format!("profile: {}", path.display()),
            ))
        }
        None => find_by_shape(b, spec, model_arg, dtype),
    }
}

/// The lookup of [`find_profile`] when no `--profile` is given.
pub fn find_by_shape<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    model_arg: &str,
    dtype: DType,
) -> anyhow::Result<(Option<FoundProfile>, String)> {
    let own = default_profile_path(b, spec);
    let dir = own.parent().map(PathBuf::from).unwrap_or_default();
    match lookup::find(&dir, &spec.cfg, dtype, b.info(), &b.kernel_hash()) {
        Ok(f) => {
            for w in profile::load_for_use_warnings(&f.path, &f.profile, b.info(), &b.kernel_hash()) {
                eprintln!("warning: {w}");
            }
            Ok((
                Some(FoundProfile {
                    profile: f.profile,
                    path: f.path,
                }),
                f.notes.join("\n"),
            ))
        }
        Err(why) => Ok((
            None,
            format!(
                "profile: none found at {} ({why}); no profile: {} until `fdpp tune --model {model_arg}` measures this machine",
                own.display(),
                crate::select::Fallback::configured(b.info().backend)?.describe(),
            ),
        )),
    }
}

/// Load a profile for use with this device and model, printing its warnings (another dtype,
/// shapes that fall back to the vendor GEMM). A profile that measures none of the model's
/// shapes is refused.
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
