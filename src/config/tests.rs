//! Tests of the job file: defaults, parsing, `--set`, errors naming the field.

use super::*;

#[test]
fn embedded_default_is_the_default() {
    assert_eq!(JobConfig::embedded(&[]).unwrap(), JobConfig::default());
    // And the serialized form reads back to the same job.
    let job = JobConfig::default();
    assert_eq!(
        JobConfig::from_toml(&job.to_toml(), "round trip").unwrap(),
        job
    );
}

/// The exact unrolled context cannot train a drafter of a Llama-style target: refused
/// when the job is read, naming the field, not at the first slice in a bubble.
#[test]
fn an_exact_unroll_context_on_a_llama_target_is_refused_naming_the_field() {
    let sets = |extra: &str| -> Vec<String> {
        ["drafter.unroll_context=\"exact\"", extra]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    for target in [
        "model.positions=\"rope\"",
        "model.qkv_bias=true",
        "model.kv_heads=1",
    ] {
        let e = JobConfig::embedded(&sets(target)).unwrap_err().to_string();
        assert!(
            e.contains("drafter.unroll_context") && e.contains("causal"),
            "{e}"
        );
    }
    // A plain target, one unrolled step, or no drafter filler: nothing to refuse.
    for ok in ["model.seed=1", "drafter.unroll=1", "filler=\"none\""] {
        JobConfig::embedded(&sets(ok)).unwrap();
    }
}

/// Internal tuning lives in `[drafter.advanced]` and `[rl.advanced]`; a job file written
/// before it moved is one error saying where each setting went.
#[test]
fn moved_settings_are_named_with_their_new_place() {
    let job = JobConfig::from_toml(
        "[drafter.advanced]\ncost_ema = 0.5\n[rl.advanced]\nmin_group_rows = 8\n",
        "job.toml",
    )
    .unwrap();
    assert_eq!(job.drafter.advanced.cost_ema, 0.5);
    assert_eq!(job.rl.advanced.min_group_rows, 8);
    for (text, now) in [
        ("[drafter]\ncost_ema = 0.5\n", "`drafter.advanced.cost_ema`"),
        ("[rl]\nidle_fill = false\n", "`rl.advanced.drafter_work`"),
        (
            "[rl]\ndrafter_leftover = \"after\"\n",
            "\"after\" is \"idle-then-after\"",
        ),
    ] {
        let e = JobConfig::from_toml(text, "job.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains(now), "{e}");
    }
    let e = JobConfig::embedded(&["rl.plain_arm=false".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`plain_arm` is now `rl.advanced.plain_arm`"),
        "{e}"
    );
}

/// A job file that states one field of a section gets every other field's one default
/// (a section's own `Default` once disagreed with the job's: a `[drafter]` table with
/// only `lr` got 4 × 64-position slices instead of 1 × 16).
#[test]
fn a_partial_section_keeps_the_other_defaults() {
    let default = JobConfig::default();
    for (text, changed) in [
        ("[drafter]\nlr = 0.001", "drafter"),
        ("[model]\nseed = 9", "model"),
        ("[train]\nseed = 9", "train"),
        ("[data]\nsummary_tasks = 9", "data"),
        ("[rl]\nseed = 9", "rl"),
    ] {
        let mut job = JobConfig::from_toml(text, "partial").unwrap();
        match changed {
            "drafter" => job.drafter.lr = default.drafter.lr,
            "model" => job.model.seed = default.model.seed,
            "train" => job.train.seed = default.train.seed,
            "data" => job.data.summary_tasks = default.data.summary_tasks,
            _ => job.rl.seed = default.rl.seed,
        }
        assert_eq!(job, default, "{text}: another field lost its default");
    }
}

#[test]
fn sets_override_and_create_sections() {
    let sets = [
        "train.steps=7".to_string(),
        "model.layers = 2".to_string(),
        "clock=wall".to_string(),
        "data.families=[\"parity\"]".to_string(),
    ];
    let job = JobConfig::from_toml_with("", "test", &sets).unwrap();
    assert_eq!(job.train.steps, 7);
    assert_eq!(job.model.layers, 2);
    assert_eq!(job.clock, ClockKind::Wall);
    assert_eq!(job.data.families, vec![crate::data::TaskFamily::Parity]);
    let err = JobConfig::from_toml_with("", "test", &["train.steps".into()]).unwrap_err();
    assert!(err.to_string().contains("key=value"), "{err}");
    let err = JobConfig::from_toml_with("stages = 1", "t", &["stages.x=1".into()]).unwrap_err();
    assert!(
        err.to_string().contains("`stages` is not a section"),
        "{err}"
    );
}

#[test]
fn device_parses_and_names_itself_when_unusable() {
    use crate::tensor::device::Device;
    let job = JobConfig::from_toml_with("", "t", &["device=cuda".into()]).unwrap();
    assert_eq!(job.device, DeviceKind::Cuda);
    assert_eq!(job.device.on_local_rank(3), Device::Cuda { ordinal: 3 });
    assert_eq!(
        DeviceKind::Cpu.usable_on_local_rank(3).unwrap(),
        Device::Cpu { threads: 1 }
    );
    let err = JobConfig::from_toml("device = \"tpu\"", "job.toml").unwrap_err();
    assert!(err.to_string().contains("unknown variant `tpu`"), "{err}");
    // Without the feature (or a driver) a CUDA job is one error naming the field.
    if let Err(e) = (Device::Cuda { ordinal: 0 }).check_available() {
        let err = DeviceKind::Cuda.usable_on_local_rank(0).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("invalid `device`: \"cuda\" (cuda:0) cannot be used here: {e}")
        );
    }
}

#[test]
fn parse_errors_are_one_line_naming_the_field() {
    let err = JobConfig::from_toml("[train]\nstepz = 3\n", "job.toml").unwrap_err();
    let err = err.to_string();
    assert!(
        err.starts_with("job.toml: line 2, column 1 (`stepz = 3`): unknown field `stepz`"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let err = JobConfig::from_toml_with("", "t", &["train.stepz=3".into()]).unwrap_err();
    let err = err.to_string();
    assert!(err.contains("in `train`: unknown field `stepz`"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let err = JobConfig::from_toml_with("", "t", &["stages=many".into()]).unwrap_err();
    assert!(err.to_string().contains("stages"), "{err}");
    assert_eq!(err.to_string().lines().count(), 1, "{err}");
}
