//! What a memory refusal names (issue 34, item 10): the setting whose change can bring the
//! job under the limit, else the limit itself.

use super::*;

fn default_job() -> JobConfig {
    JobConfig::embedded(&[]).unwrap()
}

fn flag(bytes: u64) -> MemoryLimit {
    MemoryLimit {
        bytes,
        source: LimitSource::Flag,
    }
}

/// The refusal's field and text, asserting it is one line.
fn refusal(job: &JobConfig, limit: &MemoryLimit, processes: usize) -> (String, String) {
    let err = job
        .check_memory(Workload::Train, limit, processes)
        .unwrap_err();
    let text = err.to_string();
    assert_eq!(text.lines().count(), 1, "{text}");
    match err {
        ConfigError::Invalid { field, .. } => (field, text),
        other => panic!("expected an invalid field, got {other}"),
    }
}

#[test]
fn a_limit_below_what_any_run_needs_names_the_limit_not_a_setting() {
    let job = default_job();
    for processes in [1, 4] {
        let (field, text) = refusal(&job, &MemoryLimit::parse("1KiB").unwrap(), processes);
        assert_eq!(field, "--max-memory", "{text}");
        assert!(
            text.contains("the memory limit of 1.0 KiB (--max-memory) is too small")
                && text.contains("whatever its settings")
                && !text.contains("model."),
            "{text}"
        );
    }
}

#[test]
fn a_limit_one_setting_can_meet_names_that_setting() {
    let job = default_job();
    let e = MemoryEstimate::of(&job, Workload::Train).unwrap();
    let driver = e.parts.iter().find(|p| !p.field.is_empty()).unwrap();
    assert_eq!(driver.field, e.field);
    // With that field at its smallest the job fits: the field is what to change.
    let smallest = JobConfig::embedded(&[format!("{}=1", e.field)]).unwrap();
    let fits = MemoryEstimate::of(&smallest, Workload::Train)
        .unwrap()
        .total;
    assert!(
        fits < e.total,
        "{} = 1 needs {fits}, the job {}",
        e.field,
        e.total
    );
    let (field, text) = refusal(&job, &flag(fits + 1), 1);
    assert_eq!(field, e.field, "{text}");
    assert!(text.contains("the job needs an estimated"), "{text}");
}

#[test]
fn a_limit_no_one_setting_can_meet_says_so() {
    let job = default_job();
    let e = MemoryEstimate::of(&job, Workload::Train).unwrap();
    let fixed: u64 = e
        .parts
        .iter()
        .filter(|p| p.field.is_empty())
        .map(|p| p.bytes)
        .sum();
    // Just over what any run needs: the largest part's field at its smallest still leaves
    // the other parts over it.
    let (field, text) = refusal(&job, &flag(fixed + 1), 1);
    assert_eq!(field, "--max-memory", "{text}");
    assert!(
        text.contains("no one setting brings it under")
            && text.contains(&format!("even `{}` = ", e.field))
            && text.contains("raise the limit"),
        "{text}"
    );
}
