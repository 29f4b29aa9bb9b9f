//! The schedule IR, generators, validator and simulator of `pipefill-schedules`, re-exported,
//! with [`read_plan`]: that crate does no I/O, so reading a schedule file is this crate's,
//! through the one bounded reader ([`crate::input`]).

use std::path::Path;

pub use pipefill_schedules::*;

/// The largest schedule file read: a row of actions per rank, a few hundred KB at 64 ranks
/// and thousands of micro-batches.
pub const MAX_SCHEDULE_BYTES: u64 = 64 << 20;

/// Reads the schedule file at `path` (a `.csv` or `.toml`, see [`parse_plan`]).
pub fn read_plan(path: &Path) -> Result<Plan> {
    let file = path.display().to_string();
    let text =
        crate::input::read_text(path, MAX_SCHEDULE_BYTES, "a schedule file").map_err(|e| {
            ScheduleError::File {
                file: file.clone(),
                reason: e.reason(),
            }
        })?;
    parse_plan(&text, &file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_plan_names_the_file_and_what_is_wrong() {
        let err = read_plan(Path::new("missing.csv")).unwrap_err().to_string();
        assert!(err.starts_with("missing.csv: cannot be read"), "{err}");
        let err = read_plan(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.starts_with("/dev/zero: is a device"), "{err}");
    }
}
