//! Training on JSONL datasets with a Hugging Face tokenizer (tests/fixtures/data/, written
//! by scripts/data_fixtures.py): the pipelined trainer stays bitwise the reference trainer
//! on SFT data whose prompts are masked out of the loss, and `pipefill train` runs on a
//! JSONL file through the binary, with a malformed line and a too-small vocabulary each one
//! error line; `pipefill rl` rolls out a file's prompt/answer records, in-process and
//! launched bitwise alike.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use pipefill::config::JobConfig;
use pipefill::data::{DataConfig, DataSource, StepData};
use pipefill::pipeline::{Clock, PipelineTrainer};
use pipefill::schedules::ScheduleKind;
use pipefill::tensor::IGNORE_TARGET;
use pipefill::train::Trainer;

mod common;
use common::job::tiny_job;
use common::{clean, metrics_column, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");
const STEPS: u64 = 3;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data")
}

/// The tiny job on `file` of the fixtures with the fixture tokenizer (vocab 300).
fn jsonl_job(file: &str, stages: usize) -> JobConfig {
    let mut job = tiny_job(stages, STEPS);
    job.model.vocab = 300;
    job.data = DataConfig {
        source: DataSource::Jsonl,
        path: Some(fixtures().join(file)),
        tokenizer: Some(fixtures().join("tokenizer")),
        ..job.data
    };
    job.validate().unwrap();
    job
}

/// Each parameter's bits by name ([`common::job::named_bits`], keyed).
fn params(names: Vec<String>, value: impl Fn(&str) -> Vec<f32>) -> BTreeMap<String, Vec<u32>> {
    common::job::named_bits(names, value).into_iter().collect()
}

#[test]
fn pipelined_training_on_chat_and_sft_data_is_bitwise_the_reference() {
    for file in ["chat.jsonl", "sft.jsonl", "pretrain.jsonl"] {
        let job = jsonl_job(file, 2);
        let data = StepData::new(job.data.clone(), job.model.seq_len, job.train.seed).unwrap();
        let batches = data.micro_batches(0, job.train.micro_batches, job.train.micro_batch_size);
        let ignored = batches
            .iter()
            .flat_map(|m| &m.targets)
            .filter(|&&t| t == IGNORE_TARGET)
            .count();
        if file == "pretrain.jsonl" {
            assert_eq!(ignored, 0, "{file}: every token is a target");
        } else {
            assert!(ignored > 0, "{file}: prompts are masked");
        }

        let mut reference = Trainer::reference(&job.model, &job.data, &job.train).unwrap();
        let steps: Vec<_> = (0..STEPS)
            .map(|_| reference.train_step().unwrap())
            .collect();
        let model = reference.model();
        let want = params(model.param_names(), |n| model.param_values(n).unwrap());

        let trainer = PipelineTrainer::builtin(&job, ScheduleKind::OneFOneB, None)
            .unwrap()
            .clock(Clock::virtual_free());
        let run = trainer.run(STEPS, |_| {}).unwrap();
        for (p, r) in run.steps.iter().zip(&steps) {
            assert!(
                r.loss.is_finite() && r.loss > 0.0,
                "{file}: loss {}",
                r.loss
            );
            assert!(
                (p.loss - r.loss).abs() <= 1e-6,
                "{file}: {} vs {}",
                p.loss,
                r.loss
            );
            assert_eq!(p.tokens, r.tokens);
        }
        let names = run.param_names().into_iter().map(str::to_string).collect();
        let got = params(names, |n| run.param_values(n).unwrap().to_vec());
        assert_eq!(got.len(), want.len());
        for (n, bits) in &want {
            assert!(got[n] == *bits, "{file}: {n} differs from the reference");
        }
        println!(
            "{file}: losses {:?}, bitwise",
            steps.iter().map(|s| s.loss).collect::<Vec<_>>()
        );
    }
}

/// `pipefill train` with a tiny model on `data.*` settings `sets`.
fn train(sets: &[String], extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.arg("train").args(["--steps", "2"]).args(extra);
    for s in [
        "model.d_model=16",
        "model.heads=2",
        "model.layers=2",
        "model.seq_len=32",
        "model.vocab=300",
        "stages=2",
        "train.micro_batch_size=2",
        "train.eval_tasks=2",
        "data.summary_tasks=50",
    ] {
        cmd.args(["--set", s]);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

fn jsonl_sets(path: &Path) -> Vec<String> {
    vec![
        "data.source=jsonl".into(),
        format!("data.path={}", path.display()),
        format!("data.tokenizer={}", fixtures().join("tokenizer").display()),
    ]
}

fn losses(run: &Path) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn pipefill_train_runs_on_a_jsonl_file() {
    let dir = tempfile::tempdir().unwrap();
    let sets = jsonl_sets(&fixtures().join("chat.jsonl"));
    let records = std::fs::read_to_string(fixtures().join("chat.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();
    let pipelined = dir.path().join("pipelined");
    let reference = dir.path().join("reference");
    for (run, extra) in [
        (&pipelined, &[][..]),
        (&reference, &["--schedule", "none"][..]),
    ] {
        let out = train(&sets, extra, run);
        assert!(out.status.success(), "{}", text(&out));
        // The file is tokenized once, for the summary and the run, and says what it read.
        let stdout = String::from_utf8_lossy(&out.stdout);
        let read: Vec<&str> = stdout.lines().filter(|l| l.starts_with("data: ")).collect();
        assert_eq!(read.len(), 1, "{stdout}");
        assert!(
            read[0].starts_with(&format!("data: {records} records, ")),
            "{}",
            read[0]
        );
    }
    let (a, b) = (losses(&pipelined), losses(&reference));
    assert_eq!(a.len(), 2);
    for (x, y) in a.iter().zip(&b) {
        assert!(x.is_finite() && *x > 0.0, "{a:?}");
        assert!((x - y).abs() <= 1e-6, "pipelined {a:?} vs reference {b:?}");
    }
    let job = std::fs::read_to_string(pipelined.join("job.toml")).unwrap();
    assert!(job.contains("source = \"jsonl\""), "{job}");
}

#[test]
fn file_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{\"txt\": 1}\n",
    )
    .unwrap();
    for extra in [&[][..], &["--schedule", "none"][..]] {
        let out = train(&jsonl_sets(&bad), extra, &dir.path().join("run"));
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains(&format!("{}:3: a record needs", bad.display())),
            "{stderr}"
        );
    }
    let mut sets = jsonl_sets(&fixtures().join("sft.jsonl"));
    sets.push("model.vocab=100".into());
    let out = train(&sets, &[], &dir.path().join("run2"));
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!out.status.success());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("model.vocab") && stderr.contains("300 ids"),
        "{stderr}"
    );
}

/// `pipefill PREFIX... rl` of a tiny model on the fixture's prompt/answer records.
fn rl(prefix: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.args(prefix).args(["rl", "--steps", "2"]);
    let mut sets = jsonl_sets(&fixtures().join("rl.jsonl"));
    sets.extend(
        [
            "model.d_model=32",
            "model.heads=2",
            "model.layers=2",
            "model.seq_len=64",
            "model.vocab=300",
            "stages=2",
            "filler=\"none\"",
            "train.micro_batch_size=4",
            "train.lr=1e-2",
            "train.eval_tasks=2",
            "data.summary_tasks=50",
            "rl.prompts=4",
            "rl.group=4",
            "rl.max_new_tokens=24",
            "rl.warmup_steps=200",
        ]
        .map(String::from),
    );
    for s in sets {
        cmd.args(["--set", &s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

#[test]
fn pipefill_rl_rolls_out_a_jsonl_files_prompts_in_process_and_launched_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (single, multi) = (dir.path().join("single"), dir.path().join("multi"));
    let out = rl(&[], &single);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("prompts: 10 prompt/answer records of") && stdout.contains("Numeric"),
        "{stdout}"
    );
    // Warmed up on the same records, the policy answers some of them right (the numeric
    // reward read the `#### N` of its completions), so the update has a gradient.
    let rewards = metrics_column(&single, "reward");
    assert_eq!(rewards.len(), 2);
    assert!(
        rewards.iter().all(|r| (0.0..=1.0).contains(r)),
        "{rewards:?}"
    );
    assert!(rewards[0] > 0.0, "{rewards:?}: {stdout}");
    assert!(metrics_column(&single, "grad_norm")[0] > 0.0);

    // Rank 0 rolls out the same records with the same tokenizer: the same rewards, the
    // same policy bit for bit.
    let out = rl(&["launch", "-n", "2", "--"], &multi);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(metrics_column(&multi, "reward"), rewards);
    let load = |d: &Path| pipefill::model::checkpoint::Checkpoint::load(&d.join("checkpoint"));
    common::assert_bitwise(&load(&single).unwrap(), &load(&multi).unwrap());
}
