use super::*;
use crate::model::checkpoint::Checkpoint;
use crate::model::checkpoint::resume::{FINAL_DIR, ResumePoint, verify_files};
use crate::model::checkpoint::sharded::{Layout, shard_file, step_dir};
use crate::model::checkpoint::test_model::{self, checkpoint};

/// A process id above any kernel's `pid_max`: never a running process.
const DEAD: u32 = 999_999_999;

/// A complete sharded checkpoint of `step` in `run`.
fn save(run: &Path, step: u64) -> PathBuf {
    let layout = Layout {
        dp: 1,
        stage_rank: vec![0, 1],
    };
    let dir = step_dir(run, step);
    test_model::save(&dir, step, &layout, "h");
    dir
}

/// A checkpoint of `step` a run was killed while writing: its first shard, the second's
/// temporary file, no manifest.
fn interrupted(run: &Path, step: u64) -> PathBuf {
    let dir = save(run, step);
    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    fs::rename(
        dir.join(shard_file(1)),
        dir.join(format!(".{}.tmp.{DEAD}", shard_file(1))),
    )
    .unwrap();
    dir
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn names_of_temporaries_shards_and_steps() {
    assert_eq!(
        temp_target(".rank-00001.safetensors.tmp.4242"),
        Some(("rank-00001.safetensors", 4242))
    );
    assert_eq!(
        temp_target(".manifest.json.tmp.7"),
        Some(("manifest.json", 7))
    );
    for not in [
        "rank-00001.safetensors.tmp.42",
        ".x.tmp.",
        ".x.tmp.4a",
        "..tmp.4",
        ".notes",
    ] {
        assert_eq!(temp_target(not), None, "{not}");
    }
    assert!(is_shard_name("rank-00003.safetensors"));
    assert!(is_shard_name("rank-123456.safetensors"));
    assert!(!is_shard_name("rank-3.safetensors"));
    assert!(!is_shard_name("model.safetensors"));
    assert_eq!(step_of("step-00000012"), Some(12));
    assert_eq!(step_of("step-"), None);
    assert_eq!(step_of("step-1x"), None);
    assert_eq!(step_of("mine"), None);
}

#[test]
fn overwrite_removes_the_checkpoints_files_and_keeps_the_users() {
    let run = tempfile::tempdir().unwrap();
    let run = run.path();
    let whole = run.join(FINAL_DIR);
    checkpoint(3).save(&whole).unwrap();
    fs::write(whole.join("notes.md"), "mine").unwrap();
    fs::write(whole.join(format!(".{META_FILE}.tmp.{DEAD}")), "x").unwrap();
    let complete = save(run, 2);
    fs::write(complete.join("notes.txt"), "mine").unwrap();
    let unfinished = interrupted(run, 4);
    let empty = step_dir(run, 5);
    fs::create_dir_all(&empty).unwrap();
    let root = run.join(CHECKPOINTS_DIR);
    fs::create_dir_all(root.join("mine")).unwrap();
    fs::write(root.join("mine").join(shard_file(0)), "mine").unwrap();
    fs::write(root.join("notes.txt"), "mine").unwrap();

    let removed = sweep_run(run, Sweep::Everything).unwrap();
    assert!(removed.contains(&unfinished) && removed.contains(&empty));
    assert_eq!(listing(&whole), ["notes.md"]);
    assert_eq!(listing(&complete), ["notes.txt"]);
    assert_eq!(listing(&root), ["mine", "notes.txt", "step-00000002"]);
    assert_eq!(listing(&root.join("mine")), [shard_file(0)]);

    // Without the user's files, nothing is left.
    fs::remove_file(whole.join("notes.md")).unwrap();
    fs::remove_file(complete.join("notes.txt")).unwrap();
    fs::remove_dir_all(root.join("mine")).unwrap();
    fs::remove_file(root.join("notes.txt")).unwrap();
    sweep_run(run, Sweep::Everything).unwrap();
    assert!(listing(run).is_empty(), "{:?}", listing(run));
}

#[test]
fn files_that_are_not_pipefills_stay_even_under_a_checkpoints_names() {
    let run = tempfile::tempdir().unwrap();
    let run = run.path();
    let whole = run.join(FINAL_DIR);
    fs::create_dir_all(&whole).unwrap();
    // Another program's safetensors file and JSON under the names a checkpoint writes.
    let data = [0u8; 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    let theirs = safetensors::serialize([("w", view)], None).unwrap();
    fs::write(whole.join(TENSOR_FILE), &theirs).unwrap();
    fs::write(whole.join(META_FILE), "{\"step\": 3}").unwrap();
    let step = step_dir(run, 1);
    fs::create_dir_all(&step).unwrap();
    fs::write(step.join(shard_file(0)), &theirs).unwrap();
    fs::write(step.join(MANIFEST_FILE), "{}").unwrap();
    // A temporary file of a process still running (pid 1) is its own.
    fs::write(step.join(format!(".{}.tmp.1", shard_file(1))), "x").unwrap();
    for what in [Sweep::Everything, Sweep::Leftovers] {
        assert!(sweep_run(run, what).unwrap().is_empty(), "{what:?}");
    }
    assert_eq!(listing(&whole), [META_FILE, TENSOR_FILE]);
    assert_eq!(
        listing(&step),
        [
            ".rank-00001.safetensors.tmp.1",
            MANIFEST_FILE,
            "rank-00000.safetensors"
        ]
    );
}

#[test]
fn leftovers_of_killed_writes_go_and_complete_checkpoints_stay_whole() {
    let run = tempfile::tempdir().unwrap();
    let run = run.path();
    let complete = save(run, 2);
    fs::write(complete.join(format!(".{MANIFEST_FILE}.tmp.{DEAD}")), "{").unwrap();
    let unfinished = interrupted(run, 4);
    let empty = step_dir(run, 5);
    fs::create_dir_all(&empty).unwrap();
    let whole = run.join(FINAL_DIR);
    checkpoint(2).save(&whole).unwrap();
    fs::write(whole.join(format!(".{TENSOR_FILE}.tmp.{DEAD}")), "x").unwrap();
    // Resume already picks the newest complete checkpoint, whatever lies beside it.
    assert_eq!(
        ResumePoint::find(run).unwrap(),
        ResumePoint::Sharded(complete.clone())
    );

    let mut removed = sweep_run(run, Sweep::Leftovers).unwrap();
    removed.sort();
    assert_eq!(
        removed,
        [
            whole.join(format!(".{TENSOR_FILE}.tmp.{DEAD}")),
            complete.join(format!(".{MANIFEST_FILE}.tmp.{DEAD}")),
            unfinished.clone(),
            unfinished.join(format!(".{}.tmp.{DEAD}", shard_file(1))),
            unfinished.join(shard_file(0)),
            empty.clone(),
        ]
    );
    assert_eq!(listing(&run.join(CHECKPOINTS_DIR)), ["step-00000002"]);
    verify_files(&complete).unwrap();
    Checkpoint::load(&whole).unwrap();
}
