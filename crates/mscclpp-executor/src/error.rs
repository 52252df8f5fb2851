//! Why a plan was refused.

use std::path::PathBuf;

/// A plan that could not be read, parsed or validated. Every variant that concerns a field names
/// its JSON path, such as `gpus[1].threadblocks[0].ops[3].src_buff[0].index`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The plan file could not be read.
    #[error("cannot read plan {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The text is not JSON.
    #[error("not JSON (line {line}, column {column}): {message}")]
    Json {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
        /// serde_json's message.
        message: String,
    },
    /// A required field is absent (or `null`).
    #[error("{path}: required field is missing")]
    Missing {
        /// The JSON path of the missing field.
        path: String,
    },
    /// A field has the wrong JSON type (or a number out of its integer range).
    #[error("{path}: expected {expected}, found {found}")]
    Type {
        /// The JSON path of the field.
        path: String,
        /// What the schema wants there.
        expected: &'static str,
        /// What the plan has there.
        found: String,
    },
    /// An operation name MSCCL++'s executor does not know.
    #[error("{path}: unknown operation {name:?}")]
    UnknownOp {
        /// The JSON path of the `name` field.
        path: String,
        /// The name found.
        name: String,
    },
    /// A switch (NVLS) channel or a buffer reached through one: these need NVLink multicast,
    /// which mscclpp-rs keeps off.
    #[error("{path}: switch (NVLS) channels need NVLink multicast, which is off in mscclpp-rs; this plan cannot run")]
    SwitchChannel {
        /// The JSON path of the field that names the switch channel.
        path: String,
    },
    /// A value is present and well typed but wrong: out of range, inconsistent with another
    /// field, or an unknown enumeration value.
    #[error("{path}: {reason}")]
    Invalid {
        /// The JSON path of the offending field.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl PlanError {
    /// The JSON path of the offending field, when the error concerns one.
    pub fn path(&self) -> Option<&str> {
        match self {
            PlanError::Io { .. } | PlanError::Json { .. } => None,
            PlanError::Missing { path }
            | PlanError::Type { path, .. }
            | PlanError::UnknownOp { path, .. }
            | PlanError::SwitchChannel { path }
            | PlanError::Invalid { path, .. } => Some(path),
        }
    }

    pub(crate) fn invalid(path: &str, reason: impl Into<String>) -> Self {
        PlanError::Invalid { path: path.to_owned(), reason: reason.into() }
    }
}
