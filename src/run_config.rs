//! The run configuration: every switch that changes what runs (fusions, PDL, graphs, the
//! pipelined greedy loop, kernel variants) or where fdpp finds its libraries, in one place, built
//! once per process from `--set KEY=VALUE` flags and the `FDPP_*` environment (a flag wins), and
//! written into every report row and profile provenance, so that a figure says how it was
//! obtained.
//!
//! The modules that act on a switch keep their own parsing and validation (a kernel variant's
//! rules belong with the kernel); they read the value here instead of from the environment.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use crate::error::{FdppError, Result};

/// One switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key {
    FusedGemv,
    FusedGlu,
    FusedRope,
    FusedPrefill,
    FusedPrefillMin,
    Graphs,
    Pdl,
    Pipeline,
    Prefill,
    DecodePath,
    DecodeTc,
    DecodeTcStages,
    DecodePrefetch,
    DecodeBwPipe,
    DecodeCluster,
    SoftmaxWindows,
    HopperTma,
    HopperQTma,
    HopperStages,
    HopperOverlap,
    HopperPingpong,
    HopperDiag,
    HopperRuns,
    PrefillL2Share,
    PrefillSectionWaves,
    PrefillEntryAhead,
    PrefillPersist,
    OpTimes,
    CpuIsa,
    CpuThreads,
    CpuPin,
    GraphsDebug,
    PtxasVerbose,
    CacheDir,
    CudaInclude,
    HipLib,
    HiprtcLib,
    RocblasLib,
    GemmFallback,
    TpGraphs,
    TpFused,
    TpVocab,
    TpFailAt,
}

/// What a switch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Changes which kernels run or how fast (recorded with every figure).
    Behaviour,
    /// Prints more, or waits after ops to time them (recorded: it slows the run).
    Diagnostic,
    /// Where a library or cache lives (not recorded: it changes nothing measured).
    Location,
}

pub struct KeyInfo {
    pub key: Key,
    /// The name of `--set NAME=VALUE`.
    pub name: &'static str,
    pub env: &'static str,
    pub values: &'static str,
    pub default: &'static str,
    pub kind: Kind,
    pub what: &'static str,
}

pub const KEYS: &[KeyInfo] = &[
    KeyInfo {
        key: Key::FusedGemv,
        name: "fused_gemv",
        env: "FDPP_FUSED_GEMV",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "fold the RMSNorm weights into W_qkv/W_ffn1 and run decode layers on the fused GEMV kernels",
    },
    KeyInfo {
        key: Key::FusedGlu,
        name: "fused_glu",
        env: "FDPP_FUSED_GLU",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "a fused decode step computes silu(gate)·up inside the FFN1 GEMV",
    },
    KeyInfo {
        key: Key::FusedRope,
        name: "fused_rope",
        env: "FDPP_FUSED_ROPE",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "a fused step rotates q and k and appends k and v to the cache inside the QKV GEMV (decode) or GEMM (prefill; whole-head rotate-half rotary)",
    },
    KeyInfo {
        key: Key::FusedPrefill,
        name: "fused_prefill",
        env: "FDPP_FUSED_PREFILL",
        values: "all|attn|mlp|0",
        default: "all",
        kind: Kind::Behaviour,
        what: "on sm_90a, prefill layers run fdpp's wgmma GEMM with a norm, its residual add and what follows as epilogues: all (default: both norms), attn (FFN2 adds into the residual, QKV normalizes, rotates and writes the cache: no add_rmsnorm or qkv_rope there), mlp (O adds, FFN1 normalizes and applies the GLU: no add_rmsnorm or silu_mul there), or 0",
    },
    KeyInfo {
        key: Key::FusedPrefillMin,
        name: "fused_prefill_min",
        env: "FDPP_FUSED_PREFILL_MIN",
        values: "a number of tokens, at least 1",
        default: "1024",
        kind: Kind::Behaviour,
        what: "steps of at least this many tokens run the fused prefill layer (fused_prefill)",
    },
    KeyInfo {
        key: Key::TpGraphs,
        name: "tp_graphs",
        env: "FDPP_TP_GRAPHS",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "with --tp, capture the decode layers' NCCL all-reduces in the CUDA graph (0: graphs off with --tp, the collectives eager)",
    },
    KeyInfo {
        key: Key::TpFused,
        name: "tp_fused",
        env: "FDPP_TP_FUSED",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "with --tp, run the fused decode layer: rank 0 adds O/FFN2 into the residual, the others write their partial there, and the residual is all-reduced (0: unfused with --tp)",
    },
    KeyInfo {
        key: Key::TpVocab,
        name: "tp_vocab",
        env: "FDPP_TP_VOCAB",
        values: "1|0",
        default: "1 (where --tp divides the vocabulary)",
        kind: Kind::Behaviour,
        what: "with --tp, each rank's LM head is its slice of the vocabulary and the logits are all-gathered (0: the head is replicated and rank 0's logits broadcast)",
    },
    KeyInfo {
        key: Key::TpFailAt,
        name: "tp_fail_at",
        env: "FDPP_TP_FAIL_AT",
        values: "RANK:N",
        default: "none",
        kind: Kind::Diagnostic,
        what: "with --tp, rank RANK fails at its N-th collective, to check that every rank stops with its error (no hang)",
    },
    KeyInfo {
        key: Key::Graphs,
        name: "graphs",
        env: "FDPP_GRAPHS",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "replay decode layers 1.. from CUDA graphs",
    },
    KeyInfo {
        key: Key::Pdl,
        name: "pdl",
        env: "FDPP_PDL",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "programmatic dependent launch on sm_90+",
    },
    KeyInfo {
        key: Key::Pipeline,
        name: "pipeline",
        env: "FDPP_PIPELINE",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "greedy decoding keeps the host a step ahead of the device",
    },
    KeyInfo {
        key: Key::Prefill,
        name: "prefill",
        env: "FDPP_PREFILL",
        values: "hopper|mma",
        default: "hopper on sm_90a, else mma",
        kind: Kind::Behaviour,
        what: "the prefill attention kernel",
    },
    KeyInfo {
        key: Key::DecodePath,
        name: "decode_path",
        env: "FDPP_DECODE_PATH",
        values: "latency|bandwidth",
        default: "planned per shape",
        kind: Kind::Behaviour,
        what: "force one decode attention path",
    },
    KeyInfo {
        key: Key::DecodeTc,
        name: "decode_tc",
        env: "FDPP_DECODE_TC",
        values: "auto|0|1",
        default: "auto",
        kind: Kind::Behaviour,
        what: "CUDA grouped decode on tensor cores (auto: 2+ heads per block, up to 8 per block, head_dim ≤ 128; 0: CUDA cores, at most 4; 1: also MHA and head_dim 256)",
    },
    KeyInfo {
        key: Key::DecodeTcStages,
        name: "decode_tc_stages",
        env: "FDPP_DECODE_TC_STAGES",
        values: "0|2|3",
        default: "0",
        kind: Kind::Behaviour,
        what: "the tensor-core decode pass's bandwidth path with K/V staged through shared memory by cp.async, 2 or 3 stages per warp (0: the register pass)",
    },
    KeyInfo {
        key: Key::DecodePrefetch,
        name: "decode_prefetch",
        env: "FDPP_DECODE_PREFETCH",
        values: "a key count, 0-1024 (0: none)",
        default: "64",
        kind: Kind::Behaviour,
        what: "how many keys' K/V lines a CUDA async decode block with a split of 512+ keys requests into L2 before it waits for the previous kernel (PDL)",
    },
    KeyInfo {
        key: Key::DecodeBwPipe,
        name: "decode_bw_pipe",
        env: "FDPP_DECODE_BW_PIPE",
        values: "auto|0|1",
        default: "auto",
        kind: Kind::Behaviour,
        what: "whether the CUDA async decode with one head per block (MHA, head_dim 128+) runs its software-pipelined loop (the next round's K/V requested before this one is consumed; 4 blocks per SM instead of 6); auto: where its waves fill better (chosen with the split count)",
    },
    KeyInfo {
        key: Key::DecodeCluster,
        name: "decode_cluster",
        env: "FDPP_DECODE_CLUSTER",
        values: "auto|0",
        default: "auto",
        kind: Kind::Behaviour,
        what: "whether the CUDA async decode finishes a row's 2-8 splits inside one thread-block cluster (sm_90+: partials read through distributed shared memory, load-balancing placement) instead of through global atomics; auto: wherever a row's splits are one head chunk and every cluster of the launch is resident at once",
    },
    KeyInfo {
        key: Key::SoftmaxWindows,
        name: "softmax_windows",
        env: "FDPP_SOFTMAX_WINDOWS",
        values: "per_layer|global",
        default: "per_layer when the profile has them",
        kind: Kind::Behaviour,
        what: "the async softmax's phi and [a, b]: each layer's calibrated window, or the global one for all",
    },
    KeyInfo {
        key: Key::HopperTma,
        name: "hopper_tma",
        env: "FDPP_HOPPER_TMA",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "the Hopper prefill loads K/V with TMA (else cp.async)",
    },
    KeyInfo {
        key: Key::HopperQTma,
        name: "hopper_q_tma",
        env: "FDPP_HOPPER_Q_TMA",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "the Hopper prefill loads each block's query rows with TMA (else cp.async)",
    },
    KeyInfo {
        key: Key::HopperStages,
        name: "hopper_stages",
        env: "FDPP_HOPPER_STAGES",
        values: "2|3",
        default: "the kernel's schedule",
        kind: Kind::Behaviour,
        what: "K/V pipeline depth of the Hopper prefill",
    },
    KeyInfo {
        key: Key::HopperOverlap,
        name: "hopper_overlap",
        env: "FDPP_HOPPER_OVERLAP",
        values: "1|0",
        default: "the kernel's schedule",
        kind: Kind::Behaviour,
        what: "intra-warpgroup overlap of softmax and GEMMs in the Hopper prefill",
    },
    KeyInfo {
        key: Key::HopperPingpong,
        name: "hopper_pingpong",
        env: "FDPP_HOPPER_PINGPONG",
        values: "1|0",
        default: "the kernel's schedule",
        kind: Kind::Behaviour,
        what: "ping-pong of the two consumer warpgroups in the Hopper prefill",
    },
    KeyInfo {
        key: Key::HopperDiag,
        name: "hopper_diag",
        env: "FDPP_HOPPER_DIAG",
        values: "0|1|2|3",
        default: "0",
        kind: Kind::Diagnostic,
        what: "diagnostic variants of the Hopper prefill",
    },
    KeyInfo {
        key: Key::HopperRuns,
        name: "hopper_runs",
        env: "FDPP_HOPPER_RUNS",
        values: "auto|0|1",
        default: "auto",
        kind: Kind::Behaviour,
        what: "the Hopper prefill's run-box schedule, a tile of consecutive pages as one TMA box (auto: where at least half the tiles are such runs)",
    },
    KeyInfo {
        key: Key::PrefillL2Share,
        name: "prefill_l2_share",
        env: "FDPP_PREFILL_L2_SHARE",
        values: "a fraction in (0, 1]",
        default: "0.625",
        kind: Kind::Behaviour,
        what: "share of the L2 cache one section of a CUDA prefill launch's heads may fill with K/V",
    },
    KeyInfo {
        key: Key::PrefillSectionWaves,
        name: "prefill_section_waves",
        env: "FDPP_PREFILL_SECTION_WAVES",
        values: "a number of waves, 0-64 (0: the fewest sections that fit the L2 share)",
        default: "1.25",
        kind: Kind::Behaviour,
        what: "blocks a section of a CUDA prefill launch keeps while its K/V is cut to 1/8 of the L2",
    },
    KeyInfo {
        key: Key::PrefillEntryAhead,
        name: "prefill_entry_ahead",
        env: "FDPP_PREFILL_ENTRY_AHEAD",
        values: "a block count, 0-65536 (0: none)",
        default: "the SM count",
        kind: Kind::Behaviour,
        what: "how many blocks ahead a Hopper prefill block prefetches the block list's entry into L2",
    },
    KeyInfo {
        key: Key::PrefillPersist,
        name: "prefill_persist",
        env: "FDPP_PREFILL_PERSIST",
        values: "auto|0|1",
        default: "auto",
        kind: Kind::Behaviour,
        what: "the Hopper prefill as a persistent kernel (a block per SM taking tiles from a counter; auto: up to 8192 keys sync, 4096 async; needs hopper_q_tma=1)",
    },
    KeyInfo {
        key: Key::GemmFallback,
        name: "gemm_fallback",
        env: "FDPP_GEMM_FALLBACK",
        values: "rule|vendor",
        default: "rule",
        kind: Kind::Behaviour,
        what: "what runs a linear op no profile measured: the backend's built-in rule, or the vendor GEMM",
    },
    KeyInfo {
        key: Key::OpTimes,
        name: "op_times",
        env: "FDPP_OP_TIMES",
        values: "1|0",
        default: "0",
        kind: Kind::Diagnostic,
        what: "per-op device time of the engine (waits after every op)",
    },
    KeyInfo {
        key: Key::CpuIsa,
        name: "cpu_isa",
        env: "FDPP_CPU_ISA",
        values: "portable",
        default: "the best the CPU has",
        kind: Kind::Behaviour,
        what: "the CPU kernels' instruction set",
    },
    KeyInfo {
        key: Key::CpuThreads,
        name: "cpu_threads",
        env: "FDPP_CPU_THREADS",
        values: "N (1-1024)",
        default: "one per physical core the process may use",
        kind: Kind::Behaviour,
        what: "threads of the CPU backend's parallel loops (the caller included)",
    },
    KeyInfo {
        key: Key::CpuPin,
        name: "cpu_pin",
        env: "FDPP_CPU_PIN",
        values: "1|0",
        default: "1",
        kind: Kind::Behaviour,
        what: "pin the CPU backend's threads one per core (0: the OS places them)",
    },
    KeyInfo {
        key: Key::GraphsDebug,
        name: "graphs_debug",
        env: "FDPP_GRAPHS_DEBUG",
        values: "1|0",
        default: "0",
        kind: Kind::Diagnostic,
        what: "print every graph capture and replay decision",
    },
    KeyInfo {
        key: Key::PtxasVerbose,
        name: "ptxas_verbose",
        env: "FDPP_PTXAS_VERBOSE",
        values: "1|0",
        default: "0",
        kind: Kind::Diagnostic,
        what: "print ptxas register and spill counts of every compiled kernel",
    },
    KeyInfo {
        key: Key::CacheDir,
        name: "cache_dir",
        env: "FDPP_CACHE_DIR",
        values: "PATH",
        default: "~/.cache/fdpp",
        kind: Kind::Location,
        what: "the compiled-kernel cache",
    },
    KeyInfo {
        key: Key::CudaInclude,
        name: "cuda_include",
        env: "FDPP_CUDA_INCLUDE",
        values: "PATH",
        default: "$CUDA_HOME/include, /usr/local/cuda/include",
        kind: Kind::Location,
        what: "the CUDA headers NVRTC compiles against",
    },
    KeyInfo {
        key: Key::HipLib,
        name: "hip_lib",
        env: "FDPP_HIP_LIB",
        values: "PATH",
        default: "libamdhip64.so",
        kind: Kind::Location,
        what: "the HIP runtime library",
    },
    KeyInfo {
        key: Key::HiprtcLib,
        name: "hiprtc_lib",
        env: "FDPP_HIPRTC_LIB",
        values: "PATH",
        default: "libhiprtc.so",
        kind: Kind::Location,
        what: "the hiprtc library",
    },
    KeyInfo {
        key: Key::RocblasLib,
        name: "rocblas_lib",
        env: "FDPP_ROCBLAS_LIB",
        values: "PATH",
        default: "librocblas.so",
        kind: Kind::Location,
        what: "the rocBLAS library",
    },
];

fn info(key: Key) -> &'static KeyInfo {
    KEYS.iter().find(|k| k.key == key).unwrap_or(&KEYS[0])
}

/// Where a value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Env,
    Flag,
}

/// The switches set for this run (unset ones take their defaults where they are read).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunConfig {
    values: BTreeMap<Key, (String, Source)>,
}

impl RunConfig {
    /// The `FDPP_*` environment, then `flags` (`NAME=VALUE` each, as `--set` takes them) over it.
    pub fn build(env: impl Fn(&str) -> Option<String>, flags: &[String]) -> Result<Self> {
        let mut values = env_values(env);
        for f in flags {
            let (name, value) = f.split_once('=').ok_or_else(|| {
                FdppError::InvalidArgument(format!(
                    "--set '{f}': expected NAME=VALUE (see `fdpp --help` for the names)"
                ))
            })?;
            let k = KEYS.iter().find(|k| k.name == name.trim()).ok_or_else(|| {
                FdppError::InvalidArgument(format!(
                    "--set '{f}': unknown switch '{}'; known: {}",
                    name.trim(),
                    KEYS.iter().map(|k| k.name).collect::<Vec<_>>().join(", ")
                ))
            })?;
            values.insert(k.key, (value.trim().to_string(), Source::Flag));
        }
        for (key, (value, source)) in values.iter_mut() {
            let k = info(*key);
            *value = canonical_value(k, value).map_err(|expected| {
                let what = match source {
                    Source::Flag => format!("--set {}={value}", k.name),
                    Source::Env => format!("{}={value} (environment)", k.env),
                };
                FdppError::InvalidArgument(format!("{what}: expected {expected}"))
            })?;
        }
        Ok(RunConfig { values })
    }

    /// The environment alone, unchecked (tests and library use: each switch's reader refuses a
    /// bad value where it has a parser; the CLI builds with [`RunConfig::build`], which checks).
    pub fn from_env() -> Self {
        RunConfig {
            values: env_values(|v| std::env::var(v).ok()),
        }
    }

    /// The value set for `key`, if any (a module applies its own default when None).
    pub fn get(&self, key: Key) -> Option<&str> {
        self.values.get(&key).map(|(v, _)| v.as_str())
    }

    /// A location (a library or cache path): the flag's value, else the environment as it is
    /// now. Locations change nothing measured, so they are not frozen at start-up, and a
    /// process (a test) may point them elsewhere as it runs.
    pub fn location(&self, key: Key) -> Option<String> {
        match self.values.get(&key) {
            Some((v, Source::Flag)) => Some(v.clone()),
            _ => std::env::var(info(key).env).ok().filter(|v| !v.trim().is_empty()),
        }
    }

    /// A boolean switch: on unless set to 0, off or false (the defaults of every 1|0 switch
    /// that defaults to 1).
    pub fn on(&self, key: Key) -> bool {
        !matches!(self.get(key), Some("0") | Some("off") | Some("false"))
    }

    /// A boolean switch that defaults to off: on when set to anything but 0, off or false.
    pub fn set_on(&self, key: Key) -> bool {
        self.get(key).is_some() && self.on(key)
    }

    /// The switches that change what runs or slow it, as set: `graphs=0 pdl=0`, or `defaults`.
    /// Locations are left out: they change nothing measured.
    pub fn label(&self) -> String {
        let set: Vec<String> = self
            .values
            .iter()
            .filter(|(k, _)| info(**k).kind != Kind::Location)
            .map(|(k, (v, _))| format!("{}={v}", info(*k).name))
            .collect();
        if set.is_empty() {
            "defaults".into()
        } else {
            set.join(" ")
        }
    }
}

/// Every switch the environment sets (a blank value is unset), trimmed.
fn env_values(env: impl Fn(&str) -> Option<String>) -> BTreeMap<Key, (String, Source)> {
    KEYS.iter()
        .filter_map(|k| {
            env(k.env)
                .filter(|v| !v.trim().is_empty())
                .map(|v| (k.key, (v.trim().to_string(), Source::Env)))
        })
        .collect()
}

/// A switch whose `values` lists its choices (`auto|0|1`) takes only those, and the value is
/// stored as the choice it names: compared without case and with `-` as `_`, and on/true for
/// 1, off/false for 0 where those are choices. So every reader sees its own spelling: a reader
/// without a parser for its choices (decode_path) took a typo, or `Bandwidth`, as its default,
/// silently. Other switches (numbers, paths) keep their value and are checked where they are read.
fn canonical_value(k: &KeyInfo, value: &str) -> std::result::Result<String, String> {
    let choices: Vec<&str> = k.values.split('|').collect();
    let plain = |c: &str| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_');
    if value.is_empty() || choices.len() < 2 || !choices.iter().all(|c| plain(c)) {
        return Ok(value.to_string());
    }
    let v = value.to_ascii_lowercase().replace('-', "_");
    let named = match v.as_str() {
        "on" | "true" => "1",
        "off" | "false" => "0",
        other => other,
    };
    choices
        .iter()
        .find(|c| c.to_ascii_lowercase() == v || **c == named)
        .map(|c| c.to_string())
        .ok_or_else(|| format!("one of {}", k.values))
}

static CONFIG: OnceLock<RunConfig> = OnceLock::new();

/// Set the process's configuration once, at start-up (the CLI, from its flags). A second call
/// or a call after the first [`get`] is an error: the configuration must not change mid-run.
pub fn init(cfg: RunConfig) -> Result<()> {
    CONFIG
        .set(cfg)
        .map_err(|_| FdppError::InvalidArgument("internal: the run configuration was set twice".into()))
}

/// The process's configuration (from the environment alone when [`init`] was not called, as in
/// tests and library use).
pub fn get() -> &'static RunConfig {
    CONFIG.get_or_init(RunConfig::from_env)
}

/// The switches for `fdpp --help`.
pub fn help() -> String {
    let mut s = String::from(
        "Run configuration (--set NAME=VALUE, repeatable, or the environment variable; a flag wins).\n\
         Every report row and profile records the switches that were set:\n",
    );
    for k in KEYS {
        s.push_str(&format!(
            "  {:<16} {:<18} {} [{}: {}] ({})\n",
            k.name, k.values, k.what, "default", k.default, k.env
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn flags_win_over_the_environment_and_the_label_says_what_was_set() {
        let c = RunConfig::build(
            env(&[("FDPP_GRAPHS", "0"), ("FDPP_PDL", "0"), ("FDPP_CACHE_DIR", "/x")]),
            &["pdl=1".into(), "prefill=mma".into()],
        )
        .unwrap();
        assert!(!c.on(Key::Graphs));
        assert!(c.on(Key::Pdl));
        assert!(c.on(Key::FusedGemv), "unset boolean switches default to on");
        assert!(!c.set_on(Key::OpTimes), "op_times defaults to off");
        assert_eq!(c.get(Key::Prefill), Some("mma"));
        assert_eq!(c.label(), "graphs=0 pdl=1 prefill=mma", "locations are not recorded");
        assert_eq!(RunConfig::build(env(&[]), &[]).unwrap().label(), "defaults");
    }

    #[test]
    fn unknown_or_malformed_flags_are_errors_naming_the_known_switches() {
        let e = RunConfig::build(env(&[]), &["graph=0".into()]).unwrap_err().to_string();
        assert!(e.contains("unknown switch 'graph'") && e.contains("graphs"), "{e}");
        let e = RunConfig::build(env(&[]), &["graphs".into()]).unwrap_err().to_string();
        assert!(e.contains("NAME=VALUE"), "{e}");
    }

    #[test]
    fn a_value_outside_a_switchs_choices_is_refused_with_them() {
        let e = RunConfig::build(env(&[]), &["decode_path=lat".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--set decode_path=lat") && e.contains("latency|bandwidth"),
            "{e}"
        );
        let e = RunConfig::build(env(&[("FDPP_GRAPHS", "maybe")]), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("FDPP_GRAPHS=maybe") && e.contains("1|0"), "{e}");
        // What the readers take: the choices in any case, '-' for '_', on/off/true/false where
        // 0 or 1 is a choice, an empty value (the default); free-form switches are theirs.
        for ok in [
            "decode_path=Bandwidth",
            "softmax_windows=per-layer",
            "graphs=off",
            "fused_prefill=ALL",
            "decode_tc=on",
            "decode_bw_pipe=",
            "cpu_threads=7",
            "prefill_l2_share=0.5",
            "tp_fail_at=1:40",
            "cache_dir=/tmp/x",
        ] {
            assert!(RunConfig::build(env(&[]), &[ok.into()]).is_ok(), "{ok}");
        }
        // Stored as the choice it names, so that readers comparing exact strings see it.
        let c = RunConfig::build(
            env(&[("FDPP_GRAPHS", "off")]),
            &[
                "decode_path=Bandwidth".into(),
                "softmax_windows=per-layer".into(),
                "decode_tc=on".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.get(Key::DecodePath), Some("bandwidth"));
        assert_eq!(c.get(Key::SoftmaxWindows), Some("per_layer"));
        assert_eq!(c.get(Key::DecodeTc), Some("1"));
        assert!(!c.on(Key::Graphs));
        assert_eq!(
            c.label(),
            "graphs=0 decode_path=bandwidth decode_tc=1 softmax_windows=per_layer"
        );
        // on is no choice of decode_cluster (auto|0).
        let e = RunConfig::build(env(&[]), &["decode_cluster=on".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("auto|0"), "{e}");
        for bad in [
            "prefill=cudnn",
            "hopper_diag=4",
            "gemm_fallback=cublas",
            "op_times=yes",
            "fused_prefill=true",
        ] {
            let e = RunConfig::build(env(&[]), &[bad.into()]).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("expected one of"), "{e}");
        }
    }

    #[test]
    fn every_key_has_one_entry_and_a_distinct_name() {
        for (i, a) in KEYS.iter().enumerate() {
            for b in &KEYS[i + 1..] {
                assert!(a.key != b.key && a.name != b.name && a.env != b.env, "{}", a.name);
            }
        }
        assert_eq!(KEYS.len(), 43);
        assert!(help().contains("FDPP_HOPPER_TMA") && help().contains("FDPP_CPU_THREADS"));
    }
}
