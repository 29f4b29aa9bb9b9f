use super::*;
use crate::model::checkpoint::sharded::{shard_file, step_dir};
use crate::model::checkpoint::test_model;

fn layout(dp: usize) -> Layout {
    Layout {
        dp,
        stage_rank: vec![0, 1],
    }
}

/// Saves a sharded checkpoint of a fresh small model at `step` into `dir`.
fn save(dir: &Path, step: u64, dp: usize) -> Manifest {
    test_model::save(dir, step, &layout(dp), "h")
}

#[test]
fn a_run_directory_resumes_from_its_newest_complete_checkpoint() {
    let run = tempfile::tempdir().unwrap();
    save(&step_dir(run.path(), 2), 2, 1);
    let unfinished = step_dir(run.path(), 4);
    save(&unfinished, 4, 1);
    fs::remove_file(unfinished.join(MANIFEST_FILE)).unwrap();
    let point = ResumePoint::find(run.path()).unwrap();
    assert_eq!(point, ResumePoint::Sharded(step_dir(run.path(), 2)));
    assert_eq!(point.step().unwrap(), 2);
    // Named directly, the unfinished one is refused with the missing file named.
    let err = ResumePoint::find(&unfinished).unwrap_err().to_string();
    assert!(
        err.contains(MANIFEST_FILE) && err.contains("incomplete"),
        "{err}"
    );
    // No complete checkpoint at all.
    fs::remove_file(step_dir(run.path(), 2).join(MANIFEST_FILE)).unwrap();
    let err = ResumePoint::find(run.path()).unwrap_err().to_string();
    assert!(err.contains("no complete checkpoint"), "{err}");
}

#[test]
fn a_rank_reads_its_own_shard_and_another_replicas_rank_reads_replica_0s() {
    let dir = tempfile::tempdir().unwrap();
    let mut manifest = save(dir.path(), 3, 2);
    assert_eq!(manifest.replicas_saved, Some(2));
    // As a multi-process run writes it: replica 0's shards only.
    manifest.shards.truncate(2);
    manifest.replicas_saved = Some(1);
    manifest.write(dir.path()).unwrap();
    for f in [shard_file(2), shard_file(3)] {
        fs::remove_file(dir.path().join(f)).unwrap();
    }
    let own = RankShard::load(dir.path(), &layout(2), "h", 1).unwrap();
    let other = RankShard::load(dir.path(), &layout(2), "h", 3).unwrap();
    assert_eq!(own.path, dir.path().join(shard_file(1)));
    assert_eq!(other.path, own.path);
    assert_eq!(own.tensors, manifest_tensors(dir.path(), 1));
    let c = own.checkpoint();
    assert_eq!((c.meta.step, c.meta.data_seed), (3, 5));
    assert!(c.tensors.iter().all(|t| t.name != "embed.tok"), "stage 0's");
    // A manifest listing fewer shards than it says were saved is refused.
    manifest.replicas_saved = Some(2);
    manifest.write(dir.path()).unwrap();
    let err = RankShard::load(dir.path(), &layout(2), "h", 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(MANIFEST_FILE) && err.contains("expected one per rank 0..4"),
        "{err}"
    );
}

fn manifest_tensors(dir: &Path, rank: usize) -> Vec<HostTensor> {
    let m = Manifest::read(dir).unwrap();
    read_shard(dir, &m.shards[rank]).unwrap()
}

#[test]
fn a_truncated_or_corrupted_shard_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path(), 1, 1);
    let path = dir.path().join(shard_file(1));
    let bytes = fs::read(&path).unwrap();
    // Truncated: every rank sees it, rank 0 included, from the size alone.
    fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let err = RankShard::load(dir.path(), &layout(1), "h", 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    // Same size, one bit flipped at the end (in the tensor data): the owner's hash check.
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 1;
    fs::write(&path, &flipped).unwrap();
    assert!(RankShard::load(dir.path(), &layout(1), "h", 0).is_ok());
    let err = RankShard::load(dir.path(), &layout(1), "h", 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("corrupted"),
        "{err}"
    );
    // Another job's or layout's checkpoint.
    fs::write(&path, &bytes).unwrap();
    let err = RankShard::load(dir.path(), &layout(1), "other", 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fingerprint"), "{err}");
    let err = RankShard::load(dir.path(), &layout(2), "h", 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("written by 2 ranks"), "{err}");
}
