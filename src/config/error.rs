//! [`ConfigError`]: reading or checking a job file; the one error of the `config` layer.

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
    /// A `schedule` value that names no built-in schedule and no schedule file.
    #[error(
        "schedule {0:?} is neither a built-in schedule ({names}, auto, or none) nor a schedule file \
         (.csv or .toml)",
        names = crate::schedules::ScheduleKind::ALL.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
    )]
    UnknownSchedule(String),
    /// RL would start from random weights ([`crate::config::RlConfig::check_trained`]).
    #[error(
        "rl.warmup_steps is 0 and neither --init nor --model gives the policy its weights: the \
         policy would be untrained"
    )]
    UntrainedPolicy,
}
