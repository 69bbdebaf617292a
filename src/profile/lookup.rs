//! Finding a profile by the shapes a model needs, not by its name.
//!
//! A profile is a measurement of four [K, N] GEMM shapes on one device and dtype (FlashDecoding++
//! §4: the inflection points M1/M2 are properties of the shape and the device). Any model whose
//! QKV/O/FFN1/FFN2 shapes match can use it: Llama-3.1-8B and Llama-3-8B share all four, so the
//! shipped llama3-8b profile serves both. The softmax section is different: φ and [a, b] are
//! properties of the weights (§3), so it is taken only from a profile made for the model itself
//! (the same name), never from a profile found by shape alone.
//!
//! The rule, in order: among the profiles in the device's directory that load and have no hard
//! mismatch with this machine (backend, arch, kernel hash), take the one that covers the most of
//! the model's four shapes; on a tie, the model's own profile, then the one of the same dtype,
//! then the newest. Shapes it does not cover follow the backend's built-in rule
//! ([`crate::select::Fallback`]), and the note says which.

use std::path::{Path, PathBuf};

use super::{classify_mismatches, Profile, Severity};
use crate::backend::DeviceInfo;
use crate::dtype::DType;
use crate::model::{LinearShape, ModelConfig, ModelShapes};

/// A profile file in a directory, loaded or with the reason it was not.
pub struct OnDisk {
    pub path: PathBuf,
    pub profile: std::result::Result<Profile, String>,
}

/// Every `*.json` in `dir`, sorted by path; an unreadable directory is an empty list (there is
/// nothing to find, which the caller reports).
pub fn scan(dir: &Path) -> Vec<OnDisk> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let profile = Profile::load(&path).map_err(|e| e.to_string());
            OnDisk { path, profile }
        })
        .collect()
}

/// How well one profile serves a model.
#[derive(Clone, Debug)]
pub struct Coverage {
    /// The model's shapes the profile has measured entries for.
    pub covered: Vec<LinearShape>,
    /// The model's shapes it has none for (they fall back to the vendor GEMM).
    pub missing: Vec<LinearShape>,
}

impl Coverage {
    /// `profile`'s entries against the shapes of `cfg` (an entry counts when K and N match; the
    /// kind may differ, as in [`Profile::shape_for`]).
    pub fn of(profile: &Profile, cfg: &ModelConfig) -> Coverage {
        let (covered, missing) = ModelShapes::of(cfg)
            .linears
            .into_iter()
            .partition(|s| profile.shape_for(s).is_some());
        Coverage { covered, missing }
    }

    /// "ffn1[K=4096,N=28672], ffn2[K=14336,N=4096]".
    pub fn missing_label(&self) -> String {
        self.missing
            .iter()
            .map(LinearShape::label)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The profile a model runs with, and why.
pub struct Found {
    pub path: PathBuf,
    /// The profile, its softmax section replaced by the model's own (see the module docs).
    pub profile: Profile,
    pub coverage: Coverage,
    /// The profile was made for this model (same name), not only for its shapes.
    pub own: bool,
    /// Where the softmax section came from, when it came from another file.
    pub softmax_from: Option<PathBuf>,
    /// What to tell the user: the choice and its reason, shape fallbacks, the softmax source.
    pub notes: Vec<String>,
}

/// Whether `p` was made for the model `cfg` names (the file stem rule of [`super::default_path`],
/// so that `Llama-2-7b-hf` and a profile saved as `Llama-2-7b-hf.json` agree).
pub fn same_model(p: &Profile, cfg: &ModelConfig) -> bool {
    super::file_stem(&p.model.name) == super::file_stem(&cfg.name)
}

/// The best profile in `dir` for `cfg` on this machine (see the module docs), or None with a
/// note saying what was looked at.
pub fn find(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    current: &DeviceInfo,
    kernel_hash: &str,
) -> std::result::Result<Found, String> {
    let on_disk = scan(dir);
    if on_disk.is_empty() {
        return Err(format!("no profile in {}", dir.display()));
    }
    let mut usable = Vec::new();
    let mut refused = Vec::new();
    for d in on_disk {
        let p = match d.profile {
            Ok(p) => p,
            Err(e) => {
                refused.push(format!("{}: {e}", d.path.display()));
                continue;
            }
        };
        let hard: Vec<String> = classify_mismatches(&p.provenance, current, kernel_hash)
            .into_iter()
            .filter(|m| m.severity == Severity::Hard)
            .map(|m| m.to_string())
            .collect();
        if !hard.is_empty() {
            refused.push(format!("{}: {}", d.path.display(), hard.join("; ")));
            continue;
        }
        usable.push((d.path, p));
    }
    let own_softmax = usable
        .iter()
        .filter(|(_, p)| same_model(p, cfg) && p.softmax.is_some())
        .max_by(|a, b| a.1.provenance.created.cmp(&b.1.provenance.created))
        .map(|(path, p)| (path.clone(), p.softmax.clone()));
    let rank = |p: &Profile| {
        let c = Coverage::of(p, cfg);
        (
            c.covered.len(),
            same_model(p, cfg),
            p.dtype == dtype,
            p.provenance.created.clone(),
        )
    };
    let best = usable
        .into_iter()
        .filter(|(_, p)| same_model(p, cfg) || !Coverage::of(p, cfg).covered.is_empty())
        .max_by_key(|(_, p)| rank(p));
    let Some((path, mut profile)) = best else {
        let mut msg = format!(
            "no profile in {} measures any of {}'s shapes ({})",
            dir.display(),
            cfg.name,
            ModelShapes::of(cfg)
                .linears
                .iter()
                .map(LinearShape::label)
                .collect::<Vec<_>>()
                .join(", ")
        );
        if !refused.is_empty() {
            msg.push_str(&format!("; not usable here: {}", refused.join(" | ")));
        }
        return Err(msg);
    };
    let coverage = Coverage::of(&profile, cfg);
    let own = same_model(&profile, cfg);
    // The first line is the path alone: scripts read it.
    let mut notes = vec![format!("profile: {}", path.display())];
    if !own {
        notes.push(format!(
            "profile: found by shape: made for '{}', it measures {} of {}'s {} linear shapes",
            profile.model.name,
            coverage.covered.len(),
            cfg.name,
            coverage.covered.len() + coverage.missing.len()
        ));
    }
    if !coverage.missing.is_empty() {
        let rule =
            crate::select::Fallback::configured(current.backend).map_or_else(|e| e.to_string(), |f| f.describe());
        notes.push(format!(
            "profile: no entry for {}: {} follow{} the {rule}",
            coverage.missing_label(),
            if coverage.missing.len() == 1 { "it" } else { "they" },
            if coverage.missing.len() == 1 { "s" } else { "" }
        ));
    }
    let mut softmax_from = None;
    if !own {
        match own_softmax {
            Some((from, softmax)) => {
                notes.push(format!(
                    "profile: softmax window from {} (this model's own)",
                    from.display()
                ));
                profile.softmax = softmax;
                softmax_from = Some(from);
            }
            None => {
                if profile.softmax.is_some() {
                    notes.push(format!(
                        "profile: its softmax section (calibrated on '{}') is not used: the window \
                         belongs to the weights; run `fdpp tune --model <this model> --calibrate`",
                        profile.model.name
                    ));
                }
                profile.softmax = None;
            }
        }
    }
    if profile.dtype != dtype {
        notes.push(format!(
            "profile: tuned for {}; running {dtype} with its thresholds",
            profile.dtype
        ));
    }
    Ok(Found {
        path,
        profile,
        coverage,
        own,
        softmax_from,
        notes,
    })
}
