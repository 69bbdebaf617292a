//! Who made a result: fdpp version, git commit, the run configuration, date. Every report row
//! and profile carries it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub fdpp_version: String,
    pub git_commit: String,
    /// The run-configuration switches that were set (`crate::run_config`), or "defaults";
    /// empty in rows written before it was recorded.
    #[serde(default)]
    pub run_config: String,
}

impl BuildInfo {
    pub fn current() -> Self {
        BuildInfo {
            fdpp_version: crate::VERSION.to_string(),
            git_commit: env!("FDPP_GIT_COMMIT").to_string(),
            run_config: crate::run_config::get().label(),
        }
    }
}

/// UTC timestamp, RFC 3339, seconds precision.
pub fn now_utc() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}
