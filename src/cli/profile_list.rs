//! `fdpp profile list`: what is on disk, for which device and shapes, and (with `--model`) which
//! profile a model would run with on each device ([`crate::profile::lookup`]'s rule).

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

use super::Format;
use crate::backend::kernel_hash_of;
use crate::model::{LinearShape, ModelConfig};
use crate::profile::lookup::{self, Coverage};
use crate::profile::Profile;

#[derive(Args, Debug)]
pub struct ListArgs {
    /// The profiles directory (one folder per device slug, as `fdpp tune` writes them).
    #[arg(long, default_value = "profiles")]
    pub dir: PathBuf,
    /// Also show how much of this model's four linear shapes each profile measures, and which
    /// one `generate` / `bench e2e` would take on each device.
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t = Format::Md)]
    pub format: Format,
}

/// One profile file, as listed.
#[derive(Serialize, Debug)]
struct Row {
    path: String,
    device: String,
    backend: String,
    arch: String,
    model: String,
    dtype: String,
    shapes: String,
    softmax: String,
    /// Whether the profile's kernel hash is this binary's (otherwise it is refused).
    kernels: &'static str,
    created: String,
    /// With --model: "4/4", or "2/4 (no ffn1[..], ffn2[..])".
    covers: Option<String>,
    /// With --model: the profile the engine would take for it on this device.
    chosen: Option<bool>,
    /// A file that does not load: why.
    error: Option<String>,
}

pub fn run(a: ListArgs) -> anyhow::Result<()> {
    let cfg = a.model.as_deref().map(super::tune::load_model).transpose()?;
    let dirs = device_dirs(&a.dir)?;
    let mut rows = Vec::new();
    for dir in &dirs {
        rows.extend(rows_of(dir, cfg.as_ref()));
    }
    if rows.is_empty() {
        anyhow::bail!(
            "no profile under {} (one folder per device); make one with `fdpp tune --model <model>`",
            a.dir.display()
        );
    }
    print!("{}", render(&rows, a.format)?);
    Ok(())
}

/// `dir`'s sub-folders, sorted; `dir` itself when it holds profiles directly.
fn device_dirs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| {
        anyhow::anyhow!(
            "{}: cannot read the profiles directory ({e}); give one with --dir",
            dir.display()
        )
    })?;
    let mut dirs: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs.push(dir.to_path_buf());
    Ok(dirs)
}

fn rows_of(dir: &Path, cfg: Option<&ModelConfig>) -> Vec<Row> {
    let on_disk = lookup::scan(dir);
    // The choice ignores the device's own hard mismatches (no device is opened here) but not
    // the kernel hash, which this binary knows.
    let current = |p: &Profile| kernel_hash_of(p.provenance.backend) == p.provenance.kernel_hash;
    let chosen: Option<PathBuf> = cfg.and_then(|cfg| {
        on_disk
            .iter()
            .filter_map(|d| d.profile.as_ref().ok().map(|p| (&d.path, p)))
            .filter(|(_, p)| current(p))
            .filter(|(_, p)| lookup::same_model(p, cfg) || !Coverage::of(p, cfg).covered.is_empty())
            .max_by_key(|(_, p)| {
                (
                    Coverage::of(p, cfg).covered.len(),
                    lookup::same_model(p, cfg),
                    p.provenance.created.clone(),
                )
            })
            .map(|(path, _)| path.clone())
    });
    on_disk
        .into_iter()
        .map(|d| match d.profile {
            Ok(p) => {
                let covers = cfg.map(|cfg| {
                    let c = Coverage::of(&p, cfg);
                    let n = c.covered.len() + c.missing.len();
                    if c.missing.is_empty() {
                        format!("{n}/{n}")
                    } else {
                        format!("{}/{n} (no {})", c.covered.len(), c.missing_label())
                    }
                });
                Row {
                    path: d.path.display().to_string(),
                    device: p.provenance.device.name.clone(),
                    backend: p.provenance.backend.to_string(),
                    arch: p.provenance.device.arch.clone(),
                    model: p.model.name.clone(),
                    dtype: p.dtype.to_string(),
                    shapes: shapes_label(&p),
                    softmax: softmax_label(&p),
                    kernels: if current(&p) { "this build" } else { "other (refused)" },
                    created: p.provenance.created.clone(),
                    covers,
                    chosen: cfg.map(|_| chosen.as_ref() == Some(&d.path)),
                    error: None,
                }
            }
            Err(e) => Row {
                path: d.path.display().to_string(),
                device: String::new(),
                backend: String::new(),
                arch: String::new(),
                model: String::new(),
                dtype: String::new(),
                shapes: String::new(),
                softmax: String::new(),
                kernels: "",
                created: String::new(),
                covers: None,
                chosen: cfg.map(|_| false),
                error: Some(e),
            },
        })
        .collect()
}

/// "qkv[4096,12288] o[4096,4096] …" of the measured entries ("no sweep" when none).
fn shapes_label(p: &Profile) -> String {
    if p.shapes.is_empty() {
        return "no sweep (softmax only)".into();
    }
    p.shapes
        .iter()
        .map(|s| {
            LinearShape {
                kind: s.kind,
                k: s.k,
                n: s.n,
            }
            .label()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn softmax_label(p: &Profile) -> String {
    match &p.softmax {
        None => "none".into(),
        Some(s) if !s.enabled => "disabled".into(),
        Some(s) => format!(
            "φ={:.2} [{:.1}, {:.1}]{}",
            s.phi,
            s.a,
            s.b,
            if s.per_layer.is_empty() { "" } else { " + per layer" }
        ),
    }
}

fn render(rows: &[Row], format: Format) -> anyhow::Result<String> {
    Ok(match format {
        Format::Json => {
            let mut j = serde_json::to_string_pretty(rows)?;
            j.push('\n');
            j
        }
        Format::Csv => {
            let mut w = csv::Writer::from_writer(Vec::new());
            for r in rows {
                w.serialize(r)?;
            }
            String::from_utf8_lossy(&w.into_inner()?).into_owned()
        }
        Format::Md => {
            let with_model = rows.iter().any(|r| r.covers.is_some() || r.chosen.is_some());
            let mut header = vec![
                "file", "device", "model", "dtype", "shapes", "softmax", "kernels", "created",
            ];
            if with_model {
                header.extend(["covers", "chosen"]);
            }
            let table: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    let mut cells = match &r.error {
                        Some(e) => vec![
                            r.path.clone(),
                            format!("does not load: {e}"),
                            String::new(),
                            String::new(),
                            String::new(),
                            String::new(),
                            String::new(),
                            String::new(),
                        ],
                        None => vec![
                            r.path.clone(),
                            format!("{} ({} {})", r.device, r.backend, r.arch),
                            r.model.clone(),
                            r.dtype.clone(),
                            r.shapes.clone(),
                            r.softmax.clone(),
                            r.kernels.to_string(),
                            r.created.clone(),
                        ],
                    };
                    if with_model {
                        cells.push(r.covers.clone().unwrap_or_default());
                        cells.push(if r.chosen == Some(true) {
                            "yes".into()
                        } else {
                            String::new()
                        });
                    }
                    cells
                })
                .collect();
            let numeric = vec![false; header.len()];
            crate::report::md::padded_table(&header, &numeric, &table)
        }
    })
}
