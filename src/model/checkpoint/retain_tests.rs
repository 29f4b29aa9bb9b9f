use super::*;
use crate::model::checkpoint::sharded::{Layout, shard_file};
use crate::model::checkpoint::test_model;

/// Saves a complete sharded checkpoint of `step` of job `hash` in `run`; its manifest.
fn save(run: &Path, step: u64, hash: &str) -> Manifest {
    let layout = Layout {
        dp: 1,
        stage_rank: vec![0, 1],
    };
    test_model::save(&step_dir(run, step), step, &layout, hash)
}

/// The names under `run/checkpoints/`, sorted.
fn listing(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(run.join(CHECKPOINTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn the_newest_complete_checkpoints_stay_even_when_they_complete_out_of_order() {
    let run = tempfile::tempdir().unwrap();
    let retention = Retention::new(2);
    for step in 1..=3 {
        let m = save(run.path(), step, "h");
        retention
            .completed(&step_dir(run.path(), step), &m)
            .unwrap();
    }
    assert_eq!(listing(run.path()), ["step-00000002", "step-00000003"]);
    // Step 5's writer finishes before step 4's: each deletion is of the oldest complete one.
    let five = save(run.path(), 5, "h");
    let removed = retention
        .completed(&step_dir(run.path(), 5), &five)
        .unwrap();
    assert_eq!(removed, [step_dir(run.path(), 2)]);
    let four = save(run.path(), 4, "h");
    retention
        .completed(&step_dir(run.path(), 4), &four)
        .unwrap();
    assert_eq!(listing(run.path()), ["step-00000004", "step-00000005"]);
}

#[test]
fn an_incomplete_checkpoint_is_not_counted_and_keep_0_keeps_all() {
    let run = tempfile::tempdir().unwrap();
    let retention = Retention::new(1);
    let one = save(run.path(), 1, "h");
    retention.completed(&step_dir(run.path(), 1), &one).unwrap();
    // Step 2 is being written (its shards are there, its manifest not yet): step 1 stays.
    save(run.path(), 2, "h");
    fs::remove_file(step_dir(run.path(), 2).join(MANIFEST_FILE)).unwrap();
    assert_eq!(listing(run.path()), ["step-00000001", "step-00000002"]);
    assert!(step_dir(run.path(), 1).join(MANIFEST_FILE).is_file());

    let all = tempfile::tempdir().unwrap();
    let keep_all = Retention::new(0);
    for step in 1..=4 {
        let m = save(all.path(), step, "h");
        keep_all.completed(&step_dir(all.path(), step), &m).unwrap();
    }
    assert_eq!(listing(all.path()).len(), 4);
}

#[test]
fn only_checkpoints_this_run_wrote_are_deleted() {
    let run = tempfile::tempdir().unwrap();
    // An earlier run's checkpoint, and other files in checkpoints/.
    save(run.path(), 1, "h");
    fs::write(run.path().join(CHECKPOINTS_DIR).join("notes.txt"), "mine").unwrap();
    let retention = Retention::new(1);
    let two = save(run.path(), 2, "h");
    // A file of the user's inside a checkpoint this run writes.
    fs::write(step_dir(run.path(), 2).join("README"), "keep me").unwrap();
    retention.completed(&step_dir(run.path(), 2), &two).unwrap();
    // Step 3 is completed in this run's name, but its directory is then rewritten by
    // another job (another fingerprint): it is not this run's checkpoint any more.
    let three = save(run.path(), 3, "h");
    retention
        .completed(&step_dir(run.path(), 3), &three)
        .unwrap();
    save(run.path(), 3, "other job");
    let four = save(run.path(), 4, "h");
    retention
        .completed(&step_dir(run.path(), 4), &four)
        .unwrap();

    assert_eq!(
        listing(run.path()),
        [
            "notes.txt",
            "step-00000001",
            "step-00000002",
            "step-00000003",
            "step-00000004"
        ]
    );
    // Step 2: the checkpoint's own files went, the user's stayed.
    let left: Vec<_> = fs::read_dir(step_dir(run.path(), 2))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["README"]);
    assert!(step_dir(run.path(), 1).join(shard_file(0)).is_file());
    assert_eq!(
        Manifest::read(&step_dir(run.path(), 3))
            .unwrap()
            .config_hash,
        "other job"
    );
}
