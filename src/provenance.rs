//! Who made a result: fdpp version, git commit, date. Every report row and profile carries it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub fdpp_version: String,
    pub git_commit: String,
}

impl BuildInfo {
    pub fn current() -> Self {
        BuildInfo {
            fdpp_version: crate::VERSION.to_string(),
            git_commit: env!("FDPP_GIT_COMMIT").to_string(),
        }
    }
}

/// UTC timestamp, RFC 3339, seconds precision.
pub fn now_utc() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}
