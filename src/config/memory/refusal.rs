//! What a memory refusal names ([`check`]): the setting whose change brings the job under
//! the limit, else the limit itself.
//!
//! [`MemoryEstimate::check`] blames the field that dominates the largest part. A field that
//! dominates a part need not be able to bring the whole under the limit (the other parts
//! alone may be over it, or the limit below what any run needs), so before that field is
//! named the job is estimated again with it at its smallest legal value (the smallest of
//! 0, 1, 2, 4, … below its value that the job validates with). If even that is over the
//! limit, no one setting can meet it, and the error says so, naming the limit, the value
//! tried and the fields of the largest parts.

use super::super::{ConfigError, JobConfig};
use super::{Bytes, MemoryEstimate, MemoryLimit, Workload};

/// "the memory limit of 8.0 GiB (--max-memory)".
pub(super) fn the_limit(limit: &MemoryLimit) -> String {
    format!(
        "the memory limit of {} ({})",
        Bytes(limit.bytes),
        limit.source
    )
}

/// Checks `estimate` of `job` run as `workload` in `processes` processes (each its share)
/// against `limit` (see the module docs).
pub(super) fn check(
    job: &JobConfig,
    estimate: &MemoryEstimate,
    workload: Workload,
    limit: &MemoryLimit,
    processes: usize,
) -> Result<(), ConfigError> {
    let bytes = estimate.share(processes);
    let err = match estimate.check(bytes, limit) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let blamed = match &err {
        ConfigError::Invalid { field, .. } if field == estimate.field => estimate.field,
        _ => return Err(err),
    };
    let Some((value, least)) = smallest(job, blamed, workload, processes) else {
        // Not a number (a file, a schedule), or already its smallest: it stays the one to
        // change where nothing smaller was tried.
        return Err(err);
    };
    if least <= limit.bytes {
        return Err(err);
    }
    let mut fields: Vec<&str> = Vec::new();
    for p in &estimate.parts {
        if !p.field.is_empty() && !fields.contains(&p.field) && fields.len() < 3 {
            fields.push(p.field);
        }
    }
    Err(ConfigError::Invalid {
        field: "--max-memory".into(),
        reason: format!(
            "{}, over {}, and no one setting brings it under: even `{blamed}` = {value} needs \
             {}; reduce several of `{}`, or raise the limit",
            estimate.needs(bytes),
            the_limit(limit),
            Bytes(least),
            fields.join("`, `")
        ),
    })
}

/// The smallest legal value of the numeric job field `field` below its value in `job`, and
/// the estimate's share (of `processes`) with it; `None` where `field` is not a number of
/// the job file or takes no smaller value.
fn smallest(
    job: &JobConfig,
    field: &str,
    workload: Workload,
    processes: usize,
) -> Option<(u64, u64)> {
    let text = job.to_toml();
    let doc: toml::Table = toml::from_str(&text).ok()?;
    let mut value = None;
    let mut table = &doc;
    let mut keys = field.split('.').peekable();
    while let Some(key) = keys.next() {
        match (table.get(key)?, keys.peek()) {
            (toml::Value::Table(t), Some(_)) => table = t,
            (toml::Value::Integer(n), None) => value = u64::try_from(*n).ok(),
            _ => return None,
        }
    }
    let current = value?;
    let candidates = std::iter::once(0).chain((0..63).map(|s| 1u64 << s));
    for v in candidates.take_while(|&v| v < current) {
        let set = [format!("{field}={v}")];
        let Ok(smaller) = JobConfig::from_toml_with(&text, "the memory check", &set) else {
            continue;
        };
        let estimate = MemoryEstimate::bounded(&smaller, workload).ok()?;
        return Some((v, estimate.share(processes)));
    }
    None
}
