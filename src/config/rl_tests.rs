//! Tests of the `[rl]` section: defaults, validation and the typed choices.

use super::*;

#[test]
fn a_policy_without_warm_up_or_init_is_refused() {
    let cold = RlConfig {
        warmup_steps: Some(0),
        ..RlConfig::default()
    };
    assert!(cold.check_trained(true, false).is_ok());
    assert!(cold.check_trained(false, true).is_ok());
    assert!(RlConfig::default().check_trained(false, false).is_ok());
    // Unset, the warm-up is the synthetic job's for an untrained policy, none for a
    // pretrained one.
    assert_eq!(RlConfig::default().warmup(false), WARMUP_STEPS);
    assert_eq!(RlConfig::default().warmup(true), 0);
    assert_eq!(cold.warmup(false), 0);
    let err = cold.check_trained(false, false).unwrap_err().to_string();
    assert!(err.starts_with("rl.warmup_steps is 0"), "{err}");
    assert!(err.ends_with("the policy would be untrained"), "{err}");
}

#[test]
fn default_is_valid_and_bad_values_name_the_field() {
    RlConfig::default().validate(64).unwrap();
    let cases = [
        (
            RlConfig {
                group: 1,
                ..RlConfig::default()
            },
            "rl.group",
        ),
        (
            RlConfig {
                prompts: 0,
                ..RlConfig::default()
            },
            "rl.prompts",
        ),
        (
            RlConfig {
                temperature: 0.0,
                ..RlConfig::default()
            },
            "rl.temperature",
        ),
        (
            RlConfig {
                max_new_tokens: 64,
                ..RlConfig::default()
            },
            "rl.max_new_tokens",
        ),
        (
            RlConfig {
                clip: 1.5,
                ..RlConfig::default()
            },
            "rl.clip",
        ),
        (
            RlConfig {
                kl_coef: -0.1,
                ..RlConfig::default()
            },
            "rl.kl_coef",
        ),
        (
            RlConfig {
                lr: -1.0,
                ..RlConfig::default()
            },
            "rl.lr",
        ),
        (
            RlConfig {
                drafter_lr: f32::NAN,
                ..RlConfig::default()
            },
            "rl.drafter_lr",
        ),
        (
            RlConfig {
                advanced: RolloutTuning {
                    min_group_rows: 0,
                    ..RolloutTuning::default()
                },
                ..RlConfig::default()
            },
            "rl.advanced.min_group_rows",
        ),
        (
            RlConfig {
                draft_tree: Some(DraftTreeConfig {
                    nodes: 0,
                    ..DraftTreeConfig::default()
                }),
                ..RlConfig::default()
            },
            "rl.draft_tree.nodes",
        ),
        (
            RlConfig {
                draft_tree: Some(DraftTreeConfig {
                    nodes: 40,
                    ..DraftTreeConfig::default()
                }),
                ..RlConfig::default()
            },
            "rl.draft_tree.nodes",
        ),
    ];
    for (cfg, field) in cases {
        let err = cfg.validate(64).unwrap_err().to_string();
        assert!(err.starts_with(&format!("invalid `{field}`")), "{err}");
    }
}

#[test]
fn drafter_work_is_one_of_three_and_anything_else_names_the_field() {
    use crate::config::JobConfig;
    let job = |set: &str| JobConfig::embedded(&[set.to_string()]);
    assert_eq!(
        RlConfig::default().advanced.drafter_work,
        DrafterTiming::Idle
    );
    for (text, work, idle, leftover) in [
        ("idle", DrafterTiming::Idle, true, DrafterLeftover::Defer),
        (
            "idle-then-after",
            DrafterTiming::IdleThenAfter,
            true,
            DrafterLeftover::After,
        ),
        ("after", DrafterTiming::After, false, DrafterLeftover::After),
    ] {
        let set = job(&format!("rl.advanced.drafter_work=\"{text}\"")).unwrap();
        assert_eq!(set.rl.advanced.drafter_work, work);
        assert_eq!((work.in_idle_time(), work.leftover()), (idle, leftover));
        assert_eq!(work.as_str(), text);
        // The job written next to a run reads back the same.
        let written = set.to_toml();
        assert!(
            written.contains(&format!("drafter_work = \"{text}\"")),
            "{written}"
        );
        let back = JobConfig::from_toml(&written, "written").unwrap();
        assert_eq!(back.rl.advanced.drafter_work, work);
    }
    for bad in [
        "rl.advanced.drafter_work=later",
        "rl.advanced.drafter_work=1",
    ] {
        let err = job(bad).unwrap_err().to_string();
        assert!(err.contains("drafter_work"), "{bad}: {err}");
        assert!(
            err.contains("idle-then-after") && err.contains("\"after\""),
            "{bad}: says what it takes: {err}"
        );
    }
    let text = "[rl.advanced]\ndrafter_work = \"never\"\n";
    let err = JobConfig::from_toml(text, "job.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("drafter_work") && err.contains("line 2"),
        "{err}"
    );
}

#[test]
fn spec_threshold_is_auto_or_a_number_and_anything_else_names_the_field() {
    use crate::config::JobConfig;
    let job = |set: &str| JobConfig::embedded(&[set.to_string()]);
    assert_eq!(RlConfig::default().spec_threshold, SpecThreshold::Auto);
    assert!(RlConfig::default().advanced.plain_arm);
    let auto = job("rl.spec_threshold=\"auto\"").unwrap();
    assert_eq!(auto.rl.spec_threshold, SpecThreshold::Auto);
    // A bare word on the command line is a string too.
    assert_eq!(
        job("rl.spec_threshold=auto").unwrap().rl.spec_threshold,
        SpecThreshold::Auto
    );
    assert_eq!(
        job("rl.spec_threshold=12").unwrap().rl.spec_threshold,
        SpecThreshold::Live(12)
    );
    assert!(
        !job("rl.advanced.plain_arm=false")
            .unwrap()
            .rl
            .advanced
            .plain_arm
    );
    // The job written next to a run reads back the same.
    let text = auto.to_toml();
    assert!(text.contains("spec_threshold = \"auto\""), "{text}");
    let back = JobConfig::from_toml(&text, "written").unwrap();
    assert_eq!(back.rl.spec_threshold, SpecThreshold::Auto);
    for bad in [
        "rl.spec_threshold=fast",
        "rl.spec_threshold=-1",
        "rl.spec_threshold=1.5",
    ] {
        let err = job(bad).unwrap_err().to_string();
        assert!(err.contains("spec_threshold"), "{bad}: {err}");
        assert!(err.contains("\"auto\""), "{bad}: says what it takes: {err}");
    }
    // In a file, the error points at the line.
    let text = "[rl]\nspec_threshold = \"sometimes\"\n";
    let err = JobConfig::from_toml(text, "job.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("spec_threshold") && err.contains("line 2"),
        "{err}"
    );
}
