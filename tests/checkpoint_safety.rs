//! A checkpoint's manifest or sidecar is input: the names it gives its shards and its drafter
//! are plain file names inside the checkpoint's directory, each a regular file whose size is
//! checked from its metadata before a byte is read. A manifest pointing outside its
//! directory (`../`, an absolute path), at a directory, a symlink (to a device or a copy
//! of a real shard) or a socket, or declaring an impossible size, is refused in one error
//! naming the field and the name. The single-process checkpoint carries the tensor file's
//! hash: one flipped byte in `checkpoint/model.safetensors` is refused by `pipefill train
//! --resume`, and so is a sidecar without the hash.

use std::path::{Path, PathBuf};

use pipefill::model::checkpoint::drafter::DrafterEntry;
use pipefill::model::checkpoint::files::MAX_FILE_BYTES;
use pipefill::model::checkpoint::resume::RankShard;
use pipefill::model::checkpoint::sharded::{
    Layout, Manifest, load_sharded, param_stages, save_sharded, shard_file,
};
use pipefill::model::checkpoint::{Checkpoint, META_FILE, TENSOR_FILE};
use pipefill::model::drafter::state::{BufferMeta, DrafterMeta};
use pipefill::model::{AdamW, AdamWConfig, Cut, Gpt, GptConfig};
use pipefill::tensor::CpuBackend;

mod common;
use common::{clean, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

fn small() -> GptConfig {
    GptConfig {
        vocab: 50,
        d_model: 8,
        heads: 2,
        layers: 2,
        seq_len: 8,
        ..GptConfig::default()
    }
}

fn layout() -> Layout {
    Layout {
        dp: 1,
        stage_rank: vec![0, 1],
    }
}

fn checkpoint() -> Checkpoint {
    let gpt = Gpt::new(&small(), CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    Checkpoint::capture(&gpt, &AdamW::new(AdamWConfig::default()), 3, 5).unwrap()
}

/// A sharded checkpoint in `root/ckpt`, and a byte-for-byte copy of its shard 0 outside it,
/// at `root/outside.safetensors` (a manifest pointing at it would otherwise load).
fn sharded(root: &Path) -> (PathBuf, Manifest, PathBuf) {
    let dir = root.join("ckpt");
    let stages = param_stages(&small(), 2).unwrap();
    let m = save_sharded(&dir, &checkpoint(), &layout(), &stages, "h").unwrap();
    let outside = root.join("outside.safetensors");
    std::fs::copy(dir.join(shard_file(0)), &outside).unwrap();
    (dir, m, outside)
}

/// The errors of every reader of the sharded checkpoint in `dir`: the whole-model load and
/// each rank's own (which stats every shard and reads its own).
fn errors(dir: &Path) -> Vec<String> {
    let mut errs = vec![load_sharded(dir, &layout(), "h").unwrap_err().to_string()];
    for rank in 0..2 {
        errs.push(
            RankShard::load(dir, &layout(), "h", rank)
                .unwrap_err()
                .to_string(),
        );
    }
    errs
}

/// Asserts that every reader of `dir` refuses it with an error holding all of `words`.
fn refused(dir: &Path, words: &[&str]) {
    for err in errors(dir) {
        assert!(!err.contains('\n'), "not one line: {err}");
        for w in words {
            assert!(err.contains(w), "`{w}` missing from: {err}");
        }
    }
}

#[test]
fn shard_names_outside_the_checkpoint_directory_are_refused_naming_the_field() {
    let root = tempfile::tempdir().unwrap();
    let (dir, m, outside) = sharded(root.path());
    let absolute = outside.to_str().unwrap().to_string();
    for name in [
        "../outside.safetensors",
        absolute.as_str(),
        "./rank-00000.safetensors",
    ] {
        let mut bad = m.clone();
        bad.shards[0].file = name.into();
        bad.write(&dir).unwrap();
        refused(
            &dir,
            &[
                "manifest.json",
                "shards[0].file",
                &format!("{name:?}"),
                "not a plain file name",
            ],
        );
    }
    // The crafted manifest still points at nothing else: the real one loads.
    m.write(&dir).unwrap();
    assert!(load_sharded(&dir, &layout(), "h").is_ok());
}

#[test]
fn a_directory_a_symlink_or_a_socket_as_shard_is_refused_naming_the_field() {
    let root = tempfile::tempdir().unwrap();
    let (dir, m, outside) = sharded(root.path());
    std::fs::create_dir(dir.join("sub")).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("copy.safetensors")).unwrap();
    // A device (`/dev/null`, not `/dev/zero`: a reader without the check then fails this
    // test on its size instead of reading without end).
    std::os::unix::fs::symlink("/dev/null", dir.join("null")).unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(dir.join("sock")).unwrap();
    for (name, kind) in [
        ("sub", "is a directory"),
        ("copy.safetensors", "is a symlink"),
        ("null", "is a symlink"),
        ("sock", "is a device, pipe or socket"),
    ] {
        let mut bad = m.clone();
        bad.shards[1].file = name.into();
        bad.write(&dir).unwrap();
        refused(&dir, &["shards[1].file", &format!("{name:?}"), kind]);
    }
}

#[test]
fn sizes_are_checked_before_a_byte_is_read() {
    let root = tempfile::tempdir().unwrap();
    let (dir, m, _) = sharded(root.path());
    // Declared larger than any checkpoint file may be: refused from the manifest alone.
    let mut bad = m.clone();
    bad.shards[0].bytes = MAX_FILE_BYTES + 1;
    bad.write(&dir).unwrap();
    refused(
        &dir,
        &[
            "shards[0].file",
            "declares",
            "more than a checkpoint file may hold",
        ],
    );
    // A shard whose size on disk is not the declared one: a sparse file of the largest
    // size allowed (reading it would take 256 GiB), refused from its metadata.
    m.write(&dir).unwrap();
    let shard = std::fs::File::options()
        .write(true)
        .open(dir.join(shard_file(0)))
        .unwrap();
    shard.set_len(MAX_FILE_BYTES).unwrap();
    refused(
        &dir,
        &[
            &shard_file(0),
            "truncated or was replaced",
            &MAX_FILE_BYTES.to_string(),
        ],
    );

    // The same for the whole-model checkpoint's tensor file.
    let whole = root.path().join("whole");
    checkpoint().save(&whole).unwrap();
    let tensors = std::fs::File::options()
        .write(true)
        .open(whole.join(TENSOR_FILE))
        .unwrap();
    tensors.set_len(MAX_FILE_BYTES).unwrap();
    let err = Checkpoint::load(&whole).unwrap_err().to_string();
    assert!(
        err.contains(TENSOR_FILE) && err.contains("truncated or was replaced"),
        "{err}"
    );
}

/// A drafter entry naming `file` (its state is never reached: the name is refused first).
fn drafter_entry(file: &str) -> DrafterEntry {
    DrafterEntry {
        file: file.into(),
        bytes: 16,
        hash: "0000000000000000".into(),
        tensors: Vec::new(),
        state: DrafterMeta {
            version: 0,
            frozen_step: None,
            optimizer_step: 0,
            samplers: Vec::new(),
            buffer: BufferMeta::default(),
            held_out: BufferMeta::default(),
            round: None,
        },
    }
}

#[test]
fn drafter_names_are_checked_in_manifests_and_sidecars() {
    let root = tempfile::tempdir().unwrap();
    let (dir, mut m, _) = sharded(root.path());
    m.drafter = Some(drafter_entry("../outside.safetensors"));
    m.write(&dir).unwrap();
    refused(
        &dir,
        &[
            "drafter.file",
            "\"../outside.safetensors\"",
            "not a plain file name",
        ],
    );

    // The whole-model checkpoint's sidecar.
    let whole = root.path().join("whole");
    checkpoint().save(&whole).unwrap();
    let sidecar = whole.join(META_FILE);
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    meta["drafter"] = serde_json::to_value(drafter_entry("/etc/passwd")).unwrap();
    std::fs::write(&sidecar, serde_json::to_vec(&meta).unwrap()).unwrap();
    let err = Checkpoint::load(&whole).unwrap_err().to_string();
    assert!(
        err.contains(META_FILE)
            && err.contains("drafter.file \"/etc/passwd\"")
            && err.contains("not a plain file name"),
        "{err}"
    );
}

#[test]
fn a_whole_checkpoint_reads_only_regular_files_and_needs_its_hash() {
    let root = tempfile::tempdir().unwrap();
    let whole = root.path().join("whole");
    checkpoint().save(&whole).unwrap();
    assert!(Checkpoint::load(&whole).is_ok());

    // model.safetensors replaced by a symlink to a device: refused, nothing read.
    let tensors = whole.join(TENSOR_FILE);
    let kept = root.path().join("kept.safetensors");
    std::fs::rename(&tensors, &kept).unwrap();
    std::os::unix::fs::symlink("/dev/null", &tensors).unwrap();
    let err = Checkpoint::load(&whole).unwrap_err().to_string();
    assert!(
        err.contains(TENSOR_FILE) && err.contains("is a symlink, not a regular file"),
        "{err}"
    );
    std::fs::remove_file(&tensors).unwrap();
    std::fs::rename(&kept, &tensors).unwrap();

    // A sidecar without the hash (as written before checkpoints carried one).
    let sidecar = whole.join(META_FILE);
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
    assert!(meta["tensor_hash"].is_string(), "{meta}");
    meta.as_object_mut().unwrap().remove("tensor_hash");
    std::fs::write(&sidecar, serde_json::to_vec(&meta).unwrap()).unwrap();
    let err = Checkpoint::load(&whole).unwrap_err().to_string();
    assert!(
        err.contains(META_FILE) && err.contains("no `tensor_hash`"),
        "{err}"
    );
}

/// `pipefill train --steps <steps>` of a tiny single-process job (schedule `none`) into
/// `out`, with `extra` arguments.
fn train(steps: u64, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--schedule", "none", "--steps", &steps.to_string()]);
    for s in common::TINY_MODEL {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).args(extra).output().unwrap()
}

#[test]
fn one_flipped_byte_in_a_single_process_checkpoint_is_refused_on_resume() {
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let out = train(2, &run, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = run.join("checkpoint");
    let resume = ["--resume", ckpt.to_str().unwrap()];
    // The untouched checkpoint resumes.
    let ok = train(3, &root.path().join("ok"), &resume);
    assert!(ok.status.success(), "{}", text(&ok));

    let path = ckpt.join(TENSOR_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    let out = train(3, &root.path().join("bad"), &resume);
    assert!(!out.status.success(), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(
        stderr.contains("corrupted") && stderr.contains(TENSOR_FILE) && stderr.contains(META_FILE),
        "{stderr}"
    );
}

/// A checkpoint whose file declares (and on disk has, sparse) more bytes than the memory
/// holds is refused in one line before the read is allocated; it aborted in the allocator.
#[test]
fn a_checkpoint_file_larger_than_memory_is_refused_before_it_is_allocated() {
    const HUGE: u64 = 250 << 30;
    let available = pipefill::config::memory::MemoryLimit::machine().bytes;
    if available >= HUGE {
        eprintln!("skipped: {available} bytes available, the sparse file would fit");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let run = root.path().join("run");
    let out = train(2, &run, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = run.join("checkpoint");
    let meta_path = ckpt.join(META_FILE);
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    meta["tensor_bytes"] = HUGE.into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    std::fs::File::options()
        .write(true)
        .open(ckpt.join(TENSOR_FILE))
        .unwrap()
        .set_len(HUGE)
        .unwrap();
    let out = train(
        3,
        &root.path().join("bad"),
        &["--resume", ckpt.to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(
        stderr.contains("more than the memory can hold") && stderr.contains(TENSOR_FILE),
        "{stderr}"
    );
}
