//! [`ConfigError`]: reading or checking a job file.

/// Errors reading or checking a job file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Read(#[from] crate::input::InputError),
    /// A syntax error, an unknown field or an ill-typed value; `message` names the field.
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    /// A `--set` argument that is not `key=value` or cannot be applied.
    #[error("--set {arg:?}: {reason}")]
    Set { arg: String, reason: String },
    /// A value that parses but cannot be used.
    #[error("invalid `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}
