//! `fdpp check --op layer` from the command line.

use std::process::Command;

#[test]
fn quick_layer_check_passes_on_the_cpu_and_prints_every_row() {
    let out = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args([
            "check",
            "--backend",
            "cpu",
            "--quick",
            "--op",
            "layer",
            "--format",
            "json",
        ])
        .output()
        .expect("run fdpp");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fdpp check failed: {stderr}");
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = rows.as_array().expect("an array of rows");
    let n = fdpp::check::layer_cases_quick().len();
    assert_eq!(rows.len(), n);
    for op in [
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
        for dt in ["f16", "bf16"] {
            let spec = format!("{op}_{dt}");
            assert!(rows.iter().any(|r| r["spec"] == spec.as_str()), "no {spec} row");
        }
    }
    for r in rows {
        assert_eq!(r["op"], "layer", "{r}");
        assert!(r["case"].as_str().is_some_and(|c| !c.is_empty()), "{r}");
        assert_eq!(r["status"], "pass", "{r}");
        // Every row measured something: an NMSE (arithmetic ops) or a mismatch count (exact ops).
        assert!(r["nmse"].as_f64().is_some() || r["mismatches"] == 0, "{r}");
    }
    assert!(stderr.contains(&format!("{n} passed, 0 failed, 0 skipped")), "{stderr}");
}

#[test]
fn markdown_layer_table_has_a_row_per_case() {
    let out = Command::new(env!("CARGO_BIN_EXE_fdpp"))
        .args(["check", "--backend", "cpu", "--quick", "--op", "layer"])
        .output()
        .expect("run fdpp");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let md = String::from_utf8_lossy(&out.stdout);
    let n = fdpp::check::layer_cases_quick().len();
    // Header, rule, one line per case.
    assert_eq!(md.trim_end().lines().count(), n + 2, "{md}");
    assert!(
        md.contains("| cpu | qkv_rope_bf16 | h4/kv1 d128 tokens=17 max_pos=3016"),
        "{md}"
    );
}
