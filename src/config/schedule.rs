//! [`ScheduleChoice`]: the job's `schedule`, parsed once when the job is read, so that every
//! path (the reference trainer, the in-process pipeline, a launched rank, the memory
//! estimate) matches on one typed value instead of re-reading the string.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::error::ConfigError;
use crate::schedules::ScheduleKind;

/// What plan a job runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleChoice {
    /// A built-in generator (`gpipe`, `1f1b`, `zb-h1`, ...).
    Builtin(ScheduleKind),
    /// A custom schedule file, `.csv` (PyTorch pipelining's form) or `.toml` (pipefill's).
    File(PathBuf),
    /// ZB-H1 until every stage's costs are measured, then the auto-scheduler's plan for them
    /// within ZB-H1's memory.
    Auto,
    /// No pipeline: the single-device reference trainer.
    None,
}

impl ScheduleChoice {
    /// Whether the job trains with the reference trainer, not a pipeline.
    pub fn is_none(&self) -> bool {
        matches!(self, ScheduleChoice::None)
    }

    /// Whether the plan is re-built from measured costs.
    pub fn is_auto(&self) -> bool {
        matches!(self, ScheduleChoice::Auto)
    }

    /// The generator the first plan comes from: the built-in kind, ZB-H1 for `auto`; `None`
    /// for a file or no pipeline.
    pub fn kind(&self) -> Option<ScheduleKind> {
        match self {
            ScheduleChoice::Builtin(kind) => Some(*kind),
            ScheduleChoice::Auto => Some(ScheduleKind::ZbH1),
            ScheduleChoice::File(_) | ScheduleChoice::None => None,
        }
    }

    /// The schedule file, if the choice is one.
    pub fn file(&self) -> Option<&Path> {
        match self {
            ScheduleChoice::File(path) => Some(path),
            _ => None,
        }
    }
}

impl FromStr for ScheduleChoice {
    type Err = ConfigError;

    /// Names are case-insensitive and trimmed; anything ending in `.csv` or `.toml` is a
    /// file (read, and checked to exist, when the plan is built).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let name = s.trim();
        if name.eq_ignore_ascii_case("none") {
            return Ok(ScheduleChoice::None);
        }
        if name.eq_ignore_ascii_case("auto") {
            return Ok(ScheduleChoice::Auto);
        }
        if let Ok(kind) = name.parse::<ScheduleKind>() {
            return Ok(ScheduleChoice::Builtin(kind));
        }
        let path = Path::new(name);
        let ext = path.extension().and_then(|e| e.to_str());
        if ext.is_some_and(|e| e.eq_ignore_ascii_case("csv") || e.eq_ignore_ascii_case("toml")) {
            return Ok(ScheduleChoice::File(path.to_path_buf()));
        }
        Err(ConfigError::UnknownSchedule(cut(name)))
    }
}

/// A user's value quoted in an error, cut to 40 characters.
fn cut(s: &str) -> String {
    let mut out: String = s.chars().take(40).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

impl fmt::Display for ScheduleChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleChoice::Builtin(kind) => f.write_str(kind.name()),
            ScheduleChoice::File(path) => write!(f, "{}", path.display()),
            ScheduleChoice::Auto => f.write_str("auto"),
            ScheduleChoice::None => f.write_str("none"),
        }
    }
}

impl Serialize for ScheduleChoice {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ScheduleChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_once_and_prints_back() {
        for kind in ScheduleKind::ALL {
            let choice: ScheduleChoice = kind.name().parse().unwrap();
            assert_eq!(choice, ScheduleChoice::Builtin(kind));
            assert_eq!(choice.to_string(), kind.name());
            assert_eq!(choice.kind(), Some(kind));
        }
        let auto: ScheduleChoice = " AUTO ".parse().unwrap();
        assert!(auto.is_auto() && auto.kind() == Some(ScheduleKind::ZbH1));
        let none: ScheduleChoice = "None".parse().unwrap();
        assert!(none.is_none() && none.kind().is_none());
        let file: ScheduleChoice = "examples/zb.CSV".parse().unwrap();
        assert_eq!(file.file(), Some(Path::new("examples/zb.CSV")));
        assert_eq!(file.to_string(), "examples/zb.CSV");
        let toml: ScheduleChoice = "my plan.toml".parse().unwrap();
        assert_eq!(toml.file(), Some(Path::new("my plan.toml")));
    }

    #[test]
    fn an_unknown_name_is_one_error_listing_the_names() {
        let err = "zb-h9".parse::<ScheduleChoice>().unwrap_err().to_string();
        assert!(
            err.starts_with("schedule \"zb-h9\" is neither a built-in schedule (gpipe, 1f1b")
                && err.contains("auto, or none")
                && err.contains(".csv or .toml"),
            "{err}"
        );
        let long = "x".repeat(10_000);
        let err = long.parse::<ScheduleChoice>().unwrap_err().to_string();
        assert!(err.len() < 300, "{err}");
    }
}
