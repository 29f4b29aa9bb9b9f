//! [`MemoryLimit`]: the memory a job may use, from `--max-memory` or the machine.

use std::fmt;

use super::super::ConfigError;
use super::size::Bytes;

/// Where a memory limit comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// `--max-memory`.
    Flag,
    /// `MemAvailable` of `/proc/meminfo`.
    Available,
    /// `MemTotal` of `/proc/meminfo` (a kernel without `MemAvailable`).
    Total,
    /// Nothing to read it from: no limit.
    Unknown,
}

/// The memory a job may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    pub bytes: u64,
    pub source: LimitSource,
}

impl MemoryLimit {
    /// No limit.
    pub const UNLIMITED: MemoryLimit = MemoryLimit {
        bytes: u64::MAX,
        source: LimitSource::Unknown,
    };

    /// `--max-memory`'s value when given, else the machine's available memory.
    pub fn resolve(flag: Option<&str>) -> Result<Self, ConfigError> {
        match flag {
            Some(text) => Self::parse(text),
            None => Ok(Self::machine()),
        }
    }

    /// The machine's available memory (`MemAvailable`, else `MemTotal`, of
    /// `/proc/meminfo`); unlimited where it cannot be read.
    pub fn machine() -> Self {
        crate::input::machine_memory()
            .map(Self::of_meminfo)
            .unwrap_or(Self::UNLIMITED)
    }

    /// The limit `/proc/meminfo`'s text gives.
    pub fn from_meminfo(text: &str) -> Option<Self> {
        crate::input::meminfo(text).map(Self::of_meminfo)
    }

    fn of_meminfo(m: crate::input::MemInfo) -> Self {
        MemoryLimit {
            bytes: m.bytes,
            source: match m.available {
                true => LimitSource::Available,
                false => LimitSource::Total,
            },
        }
    }

    /// Parses `--max-memory`: a number of bytes with an optional unit, `8GiB`, `512MiB`,
    /// `1.5G` (K, M, G, T and KiB … TiB are powers of 1024; kB, MB, GB, TB of 1000).
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad = |why: &str| ConfigError::Invalid {
            field: "--max-memory".into(),
            reason: format!("{text:?} {why}"),
        };
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = (&t[..split], t[split..].trim());
        let scale: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024f64.powi(2),
            "g" | "gib" => 1024f64.powi(3),
            "t" | "tib" => 1024f64.powi(4),
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => {
                return Err(bad(
                    "is not a size: expected a number with an optional unit, e.g. 8GiB, 512MiB, 2000000000",
                ));
            }
        };
        let value: f64 = number.parse().map_err(|_| {
            bad("is not a size: expected a number with an optional unit, e.g. 8GiB, 512MiB, 2000000000")
        })?;
        let bytes = value * scale;
        if !(bytes.is_finite() && bytes >= 1.0) {
            return Err(bad("must be at least 1 byte"));
        }
        if bytes >= u64::MAX as f64 {
            return Err(bad("is larger than 2^64 bytes"));
        }
        Ok(MemoryLimit {
            bytes: bytes as u64,
            source: LimitSource::Flag,
        })
    }
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitSource::Flag => "--max-memory",
            LimitSource::Available => "the memory available, MemAvailable in /proc/meminfo; --max-memory sets another limit",
            LimitSource::Total => "the machine's memory, MemTotal in /proc/meminfo; --max-memory sets another limit",
            LimitSource::Unknown => "no limit known",
        })
    }
}

impl fmt::Display for MemoryLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            LimitSource::Unknown => f.write_str("no limit known"),
            LimitSource::Flag => write!(f, "{} (--max-memory)", Bytes(self.bytes)),
            LimitSource::Available => write!(f, "{} available", Bytes(self.bytes)),
            LimitSource::Total => write!(f, "{} of memory", Bytes(self.bytes)),
        }
    }
}
