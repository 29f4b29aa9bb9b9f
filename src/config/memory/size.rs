//! Checked sizes: a count with the config field blamed for it, so an overflow or an
//! over-limit total names the field; and [`Bytes`], a byte count as people read it.

use std::fmt;

use super::super::ConfigError;

/// A size under construction: its value and the field blamed for it (with that field's
/// own value), so an overflow or an over-limit total names the field.
#[derive(Clone, Copy, Debug)]
pub(super) struct Size {
    pub(super) n: u64,
    /// `""` for a constant.
    pub(super) field: &'static str,
    /// The blamed field's own value (for the overflow message).
    pub(super) value: u64,
}

/// A config field's value as a factor.
pub(super) fn f(field: &'static str, value: impl TryInto<u64>) -> Size {
    let value = value.try_into().unwrap_or(u64::MAX);
    Size {
        n: value,
        field,
        value,
    }
}

/// A constant factor (never blamed).
pub(super) fn k(n: u64) -> Size {
    Size {
        n,
        field: "",
        value: n,
    }
}

pub(super) fn overflow(what: &str, blamed: Size) -> ConfigError {
    ConfigError::Invalid {
        field: blamed.field.to_string(),
        reason: format!(
            "{} is too large: the memory estimate of {what} passes {} (it overflows 64-bit \
             arithmetic)",
            blamed.value,
            Bytes(u64::MAX)
        ),
    }
}

/// `xs` folded from `init` by `op`; an overflow is blamed on the largest named one.
fn fold(
    what: &str,
    xs: &[Size],
    init: u64,
    op: fn(u64, u64) -> Option<u64>,
) -> Result<Size, ConfigError> {
    let blamed = xs
        .iter()
        .filter(|x| !x.field.is_empty())
        .max_by_key(|x| x.n)
        .copied()
        .unwrap_or(k(0));
    let n = xs
        .iter()
        .try_fold(init, |acc, x| op(acc, x.n))
        .ok_or_else(|| overflow(what, blamed))?;
    Ok(Size { n, ..blamed })
}

/// The product of `xs`; it is blamed on its largest named factor.
pub(super) fn mul(what: &str, xs: &[Size]) -> Result<Size, ConfigError> {
    fold(what, xs, 1, u64::checked_mul)
}

/// The sum of `xs`; it is blamed on its largest named term.
pub(super) fn add(what: &str, xs: &[Size]) -> Result<Size, ConfigError> {
    fold(what, xs, 0, u64::checked_add)
}

/// `ceil(a / b)` for `b ≥ 1`.
pub(super) fn div_ceil(a: Size, b: u64) -> Size {
    Size {
        n: a.n.div_ceil(b.max(1)),
        ..a
    }
}

/// A byte count in binary units: `512 B`, `1.5 KiB`, `14.9 GiB`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        match unit {
            0 => write!(f, "{} B", self.0),
            _ => write!(f, "{value:.1} {}", UNITS[unit]),
        }
    }
}
