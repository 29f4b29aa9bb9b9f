use super::*;
use crate::model::{AdamW, AdamWConfig, Gpt};

fn small() -> GptConfig {
    GptConfig {
        vocab: 50,
        d_model: 8,
        heads: 2,
        layers: 4,
        seq_len: 8,
        ..GptConfig::default()
    }
}

/// A whole-model checkpoint of a freshly initialised small model, with non-zero moments.
fn whole() -> Checkpoint {
    let be = CpuBackend::new(1).unwrap();
    let gpt = Gpt::new(&small(), be, &Cut::Even(1)).unwrap();
    let optimizer = AdamW::new(AdamWConfig::default());
    let mut c = Checkpoint::capture(&gpt, &optimizer, 7, 3).unwrap();
    // `capture` of an optimizer that never stepped has no moments: add some, as a stepped
    // one would have, so they must land in the right shards too.
    let moments: Vec<HostTensor> = c
        .tensors
        .iter()
        .flat_map(|t| {
            [ADAM_M_PREFIX, ADAM_V_PREFIX].map(|p| HostTensor {
                name: format!("{p}{}", t.name),
                shape: t.shape.clone(),
                data: t.data.iter().map(|x| x * 0.5 + 1.0).collect(),
            })
        })
        .collect();
    c.tensors.extend(moments);
    c
}

/// Two replicas of a 2-rank pipeline of 4 stages placed looped (rank 0: stages 0 and 2).
fn layout() -> Layout {
    Layout {
        dp: 2,
        stage_rank: vec![0, 1, 0, 1],
    }
}

fn save(dir: &Path) -> Manifest {
    let stages = param_stages(&small(), 4).unwrap();
    save_sharded(dir, &whole(), &layout(), &stages, "abc").unwrap()
}

#[test]
fn round_trip_is_bitwise_and_each_rank_holds_its_stages() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = save(dir.path());
    assert_eq!(manifest.world, 4);
    assert_eq!(manifest.shards.len(), 4);
    let stages = param_stages(&small(), 4).unwrap();
    for entry in &manifest.shards {
        let pipeline_rank = entry.rank % 2;
        assert!(!entry.tensors.is_empty());
        for name in &entry.tensors {
            let stage = stages[param_of(name)];
            assert_eq!(layout().stage_rank[stage], pipeline_rank, "{name}");
        }
    }
    // Replicas write the same bytes.
    assert_eq!(manifest.shards[0].hash, manifest.shards[2].hash);
    let back = load_sharded(dir.path(), &layout(), "abc").unwrap();
    let original = whole();
    assert_eq!(back.meta.step, 7);
    assert_eq!(back.meta.data_seed, 3);
    assert_eq!(back.meta.model, small());
    assert_eq!(back.tensors.len(), original.tensors.len());
    for t in &original.tensors {
        let b = back.tensor(&t.name).unwrap();
        assert_eq!(b.shape, t.shape);
        let bits = |d: &[f32]| d.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&b.data), bits(&t.data), "{}", t.name);
    }
    assert_eq!(
        back.optimizer_state().unwrap(),
        original.optimizer_state().unwrap()
    );
}

#[test]
fn a_checkpoint_without_manifest_is_refused_and_never_the_latest() {
    let run = tempfile::tempdir().unwrap();
    assert_eq!(latest(run.path()).unwrap(), None);
    save(&step_dir(run.path(), 4));
    // A later checkpoint whose manifest was never written: shards only.
    let torn = step_dir(run.path(), 8);
    save(&torn);
    fs::remove_file(torn.join(MANIFEST_FILE)).unwrap();
    assert_eq!(latest(run.path()).unwrap(), Some(step_dir(run.path(), 4)));
    let err = load_sharded(&torn, &layout(), "abc")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no manifest") && err.contains("incomplete"),
        "{err}"
    );
}

#[test]
fn corrupted_or_truncated_shards_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = save(dir.path());
    let path = dir.path().join(&manifest.shards[3].file);
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    fs::write(&path, &bytes).unwrap();
    let err = load_sharded(dir.path(), &layout(), "abc")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("corrupted") && err.contains("rank-00003.safetensors"),
        "{err}"
    );
    fs::write(&path, &bytes[..last]).unwrap();
    let err = load_sharded(dir.path(), &layout(), "abc")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("truncated") && err.contains("rank-00003"),
        "{err}"
    );
}

#[test]
fn another_layout_or_job_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    save(dir.path());
    let one_replica = Layout { dp: 1, ..layout() };
    let err = load_sharded(dir.path(), &one_replica, "abc")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("written by 4 ranks") && err.contains("has 2"),
        "{err}"
    );
    let contiguous = Layout {
        dp: 2,
        stage_rank: vec![0, 0, 1, 1],
    };
    let err = load_sharded(dir.path(), &contiguous, "abc")
        .unwrap_err()
        .to_string();
    assert!(err.contains("stage → rank map"), "{err}");
    let err = load_sharded(dir.path(), &layout(), "xyz")
        .unwrap_err()
        .to_string();
    assert!(err.contains("job settings") && err.contains("abc"), "{err}");
}

#[test]
fn fingerprint_is_fnv1a() {
    // Published FNV-1a 64 test vectors.
    assert_eq!(fingerprint(b""), "cbf29ce484222325");
    assert_eq!(fingerprint(b"a"), "af63dc4c8601ec8c");
    assert_eq!(fingerprint(b"foobar"), "85944171f73967e8");
    // Fed in pieces, the same hash.
    let mut h = Fnv1a::default();
    for piece in [&b"fo"[..], b"", b"oba", b"r"] {
        h.update(piece);
    }
    assert_eq!(h.finish(), "85944171f73967e8");
}

/// A sharded checkpoint of version 1 (the LM head and its moments `[d_model, vocab]`, the
/// drafter's frozen heads too) loads as today's, whole or rank by rank: the head's tensors
/// transposed, every other bit for bit. A version from the future is refused, naming it.
#[test]
fn a_version_1_sharded_checkpoint_loads_with_its_head_transposed() {
    use super::super::test_model::{as_version_1, drafter, drafter_as_version_1};
    use crate::model::checkpoint::resume::RankShard;
    let mut now = whole();
    now.drafter = Some(drafter(&small()));
    let mut old = now.clone();
    assert_eq!(
        as_version_1(&small(), &mut old.tensors),
        3,
        "head.w, m and v"
    );
    drafter_as_version_1(&small(), old.drafter.as_mut().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let stages = param_stages(&small(), 4).unwrap();
    let mut manifest = save_sharded(dir.path(), &old, &layout(), &stages, "abc").unwrap();
    manifest.version = 1;
    manifest.write(dir.path()).unwrap();
    let back = load_sharded(dir.path(), &layout(), "abc").unwrap();
    assert_eq!(back.meta.version, VERSION);
    assert_eq!(back.drafter, now.drafter);
    assert_eq!(back.tensors.len(), now.tensors.len());
    for t in &now.tensors {
        assert_eq!(back.tensor(&t.name).unwrap(), t, "{}", t.name);
    }
    // Rank by rank, as a launched run reads it: each rank's tensors, and the drafter.
    let mut read = 0;
    for rank in 0..layout().pp() {
        let shard = RankShard::load(dir.path(), &layout(), "abc", rank).unwrap();
        for t in &shard.tensors {
            assert_eq!(now.tensor(&t.name).unwrap(), t, "{}", t.name);
        }
        read += shard.tensors.len();
        assert_eq!(shard.drafter().unwrap(), now.drafter);
    }
    assert_eq!(read, now.tensors.len());
    manifest.version = VERSION + 1;
    manifest.write(dir.path()).unwrap();
    let err = Manifest::read(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&format!("version {}", VERSION + 1)), "{err}");
}
