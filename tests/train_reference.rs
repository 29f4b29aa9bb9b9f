//! The single-device reference trainer end to end: the loss falls, gradient accumulation
//! does not change the update, checkpoints resume exactly, and job-file errors name the
//! field.

use pipefill::config::JobConfig;
use pipefill::config::TrainConfig;
use pipefill::data::{DataConfig, StepData};
use pipefill::model::GptConfig;
use pipefill::model::checkpoint::Checkpoint;
use pipefill::tensor::CpuBackend;
use pipefill::train::Trainer;

/// A shortened, smaller default job: 2 blocks of width 32, sequences of 32 tokens.
fn small_job() -> (GptConfig, DataConfig, TrainConfig) {
    let model = GptConfig {
        layers: 2,
        d_model: 32,
        seq_len: 32,
        ..GptConfig::default()
    };
    let train = TrainConfig {
        steps: LOSS_STEPS,
        warmup: 10,
        threads: 1,
        ..TrainConfig::default()
    };
    (model, DataConfig::default(), train)
}

/// Steps of the loss test, and the mean loss of its last 10 steps must end below
/// [`LOSS_THRESHOLD`] (it starts at ln(50) ≈ 3.9, a uniform guess over the vocabulary).
const LOSS_STEPS: u64 = 200;
const LOSS_THRESHOLD: f32 = 2.0;

#[test]
fn loss_falls_below_threshold_within_the_step_budget() {
    let (model, data, train) = small_job();
    let mut trainer = Trainer::reference(&model, &data, &train).unwrap();
    // Step 10 000's data is never trained on: a held-out batch.
    let held_out_before = trainer.eval_loss(10_000).unwrap();
    let losses: Vec<f32> = (0..LOSS_STEPS)
        .map(|_| trainer.train_step().unwrap().loss)
        .collect();
    let first = losses[0];
    let last10 = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    assert!((first - 50f32.ln()).abs() < 0.3, "initial loss {first}");
    assert!(
        last10 < LOSS_THRESHOLD,
        "mean loss of the last 10 of {LOSS_STEPS} steps is {last10}, expected < {LOSS_THRESHOLD}; \
         curve {losses:?}"
    );
    let held_out_after = trainer.eval_loss(10_000).unwrap();
    assert!(
        held_out_after < held_out_before - 1.0,
        "held-out loss {held_out_before} → {held_out_after}"
    );
}

/// Max |a - b| over two parameter sets, relative to the largest |a|.
fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn accumulating_micro_batches_gives_the_same_update() {
    let (model, data, base) = small_job();
    // The same 4 sequences as 1×4, 2×2 and 4×1 micro-batches.
    let shapes = [(1, 4), (2, 2), (4, 1)];
    let mut trainers: Vec<Trainer<CpuBackend>> = shapes
        .iter()
        .map(|&(micro_batches, micro_batch_size)| {
            let train = TrainConfig {
                micro_batches,
                micro_batch_size,
                ..base.clone()
            };
            Trainer::reference(&model, &data, &train).unwrap()
        })
        .collect();
    let rows = |t: &Trainer<CpuBackend>| -> Vec<u32> {
        t.micro_batches(0)
            .into_iter()
            .flat_map(|mb| mb.inputs)
            .collect()
    };
    assert_eq!(rows(&trainers[0]), rows(&trainers[1]));
    assert_eq!(rows(&trainers[0]), rows(&trainers[2]));

    let mut losses = Vec::new();
    for t in &mut trainers {
        let batches = t.micro_batches(0);
        assert_eq!(batches.len() * batches[0].rows, 4);
        losses.push(t.accumulate(&batches).unwrap().0);
    }
    let names = trainers[0].model().param_names();
    for name in &names {
        let g0 = trainers[0].model().grad_values(name).unwrap();
        for t in &trainers[1..] {
            let g = t.model().grad_values(name).unwrap();
            let d = max_rel_diff(&g0, &g);
            assert!(d < 1e-4, "gradient of {name} differs by {d} (relative)");
        }
    }
    for l in &losses[1..] {
        assert!((l - losses[0]).abs() < 1e-5, "losses {losses:?}");
    }
    // And the updated parameters agree too.
    for t in &mut trainers {
        t.apply_update().unwrap();
    }
    for name in &names {
        let p0 = trainers[0].model().param_values(name).unwrap();
        for t in &trainers[1..] {
            let p = t.model().param_values(name).unwrap();
            let d = p0
                .iter()
                .zip(&p)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            // The first AdamW step moves each weight by at most lr; agreement to a small
            // fraction of it means the same update.
            assert!(d < 0.02 * base.lr, "{name} differs by {d} after the update");
        }
    }
}

#[test]
fn checkpoints_resume_bit_for_bit() {
    let (model, data, train) = small_job();
    let mut a = Trainer::reference(&model, &data, &train).unwrap();
    for _ in 0..3 {
        a.train_step().unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let mut saved = a.checkpoint().unwrap();
    saved.save(dir.path()).unwrap();
    let loaded = Checkpoint::load(dir.path()).unwrap();
    assert_eq!(loaded.meta.step, 3);
    assert_eq!(loaded.meta.optimizer_step, 3);
    assert_eq!(loaded.tensors.len(), saved.tensors.len());
    for (x, y) in saved.tensors.iter().zip(&loaded.tensors) {
        assert_eq!(x.name, y.name);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.data), bits(&y.data), "{}", x.name);
    }
    // Every parameter is stored with both AdamW moments.
    for name in a.model().param_names() {
        for prefix in ["", "optim.m.", "optim.v."] {
            assert!(
                loaded.tensor(&format!("{prefix}{name}")).is_some(),
                "{prefix}{name}"
            );
        }
    }

    let mut b = Trainer::reference(&model, &data, &train).unwrap();
    b.restore(&loaded).unwrap();
    assert_eq!(b.step(), 3);
    let ma = a.train_step().unwrap();
    let mb = b.train_step().unwrap();
    assert_eq!(ma.loss.to_bits(), mb.loss.to_bits());
    for name in a.model().param_names() {
        assert_eq!(
            a.model().param_values(&name).unwrap(),
            b.model().param_values(&name).unwrap(),
            "{name}"
        );
    }

    // A checkpoint of another model shape is refused, naming the mismatch.
    let other = GptConfig {
        layers: 3,
        ..model.clone()
    };
    let mut c = Trainer::reference(&other, &data, &train).unwrap();
    let err = c.restore(&loaded).unwrap_err().to_string();
    assert!(
        err.contains("does not fit") && err.contains("`layers` (checkpoint 2, run 3)"),
        "{err}"
    );
}

fn job_err(text: &str, sets: &[&str]) -> String {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    JobConfig::from_toml_with(text, "job.toml", &sets)
        .unwrap_err()
        .to_string()
}

#[test]
fn config_errors_name_the_field() {
    let cases: &[(&str, &[&str], &[&str])] = &[
        ("[train]\nstepz = 3\n", &[], &["stepz"]),
        ("[train]\nsteps = \"many\"\n", &[], &["steps", "many"]),
        ("shedule = \"none\"\n", &[], &["shedule"]),
        ("[model]\nheads = 3\n", &[], &["model.heads"]),
        (
            "[train]\nmicro_batches = 0\n",
            &[],
            &["train.micro_batches"],
        ),
        ("[data]\nfamilies = []\n", &[], &["data.families"]),
        ("[data]\nfamilies = [\"sudoku\"]\n", &[], &["sudoku"]),
        ("", &["train.lr=fast"], &["train.lr", "fast"]),
        ("", &["train.bogus=1"], &["bogus", "train"]),
        ("", &["stages=0"], &["stages"]),
    ];
    for (text, sets, needles) in cases {
        let err = job_err(text, sets);
        for n in *needles {
            assert!(
                err.contains(n),
                "error for {text:?} {sets:?} lacks {n:?}: {err}"
            );
        }
    }
}

#[test]
fn cli_trains_a_tiny_job_with_schedule_none() {
    // `--schedule none` selects the reference trainer (the default job is a pipeline).
    let exe = env!("CARGO_BIN_EXE_pipefill");
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "train",
            "--schedule",
            "none",
            "--steps",
            "3",
            "--set",
            "model.layers=1",
            "--set",
            "train.threads=1",
        ])
        .arg("--out-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("solution length") && stdout.contains("p99"),
        "{stdout}"
    );
    assert!(stdout.contains("done: 3 steps"), "{stdout}");
    assert!(
        stdout.contains("exact match (greedy) on 32 held-out tasks"),
        "{stdout}"
    );
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 3);
    let job = std::fs::read_to_string(dir.path().join("job.toml")).unwrap();
    let job = JobConfig::from_toml(&job, "written job").unwrap();
    assert_eq!((job.train.steps, job.model.layers), (3, 1));
    let ckpt = Checkpoint::load(&dir.path().join("checkpoint")).unwrap();
    assert_eq!(ckpt.meta.step, 3);

    // Resuming continues the same run: two more steps, appended metrics. `--resume` names
    // the run directory (its newest checkpoint, checkpoint/ here), as for a pipelined run.
    let tiny = ["--set", "model.layers=1", "--set", "train.threads=1"];
    let out = std::process::Command::new(exe)
        .args(["train", "--schedule", "none", "--steps", "5"])
        .args(tiny)
        .arg("--resume")
        .arg(dir.path())
        .arg("--out-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("at step 3") && stdout.contains("done: 2 steps"),
        "{stdout}"
    );
    let metrics = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4]);
    assert_eq!(
        Checkpoint::load(&dir.path().join("checkpoint"))
            .unwrap()
            .meta
            .step,
        5
    );

    // A checkpoint of another model is refused.
    let out = std::process::Command::new(exe)
        .args(["train", "--schedule", "none", "--steps", "6"])
        .args(["--set", "model.layers=2"])
        .arg("--resume")
        .arg(dir.path().join("checkpoint"))
        .arg("--out-dir")
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not fit"), "{stderr}");
}

#[test]
fn held_out_tasks_fit_and_greedy_completions_stay_in_context() {
    use pipefill::train::eval::{exact_match, greedy_completion, held_out_tasks};
    let (model, data, train) = small_job();
    let tasks = held_out_tasks(&data.families, data.size_scale, data.max_size, 5, 32, 8).unwrap();
    assert_eq!(tasks.len(), 8);
    assert!(tasks.iter().all(|t| t.text().len() + 2 <= 32));
    assert_eq!(
        tasks,
        held_out_tasks(&data.families, data.size_scale, data.max_size, 5, 32, 8).unwrap()
    );
    let mut trainer = Trainer::reference(&model, &data, &train).unwrap();
    let tok = pipefill::data::Tokenizer::new();
    for t in &tasks {
        let c = greedy_completion(trainer.model_mut(), &tok, t).unwrap();
        assert!(c.len() + t.prompt.len() < 32, "{c:?}");
    }
    let em = exact_match(trainer.model_mut(), &tasks).unwrap();
    assert_eq!(em.tasks, 8);
    assert!(em.correct <= 8);
}

#[test]
fn the_oracle_is_deterministic() {
    // The same job twice gives bit-identical losses and parameters: pipelines compare
    // against one run of it.
    let (model, data, train) = small_job();
    let train = TrainConfig {
        threads: 2,
        ..train
    };
    let run = || {
        let mut t = Trainer::reference(&model, &data, &train).unwrap();
        let losses: Vec<u32> = (0..5)
            .map(|_| t.train_step().unwrap().loss.to_bits())
            .collect();
        let params: Vec<Vec<u32>> = t
            .model()
            .param_names()
            .iter()
            .map(|n| {
                t.model()
                    .param_values(n)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .collect();
        (losses, params)
    };
    assert_eq!(run(), run());
}

#[test]
fn data_loaded_once_trains_as_the_config_does_and_must_fit_the_job() {
    // `with_data` (the CLI's path: the data is loaded once for the summary and the run)
    // trains bit for bit as `with_backend` loading it itself; data built for another
    // `seq_len` or seed is refused naming the field.
    let (model, data, train) = small_job();
    let losses = |mut t: Trainer<CpuBackend>| -> Vec<u32> {
        (0..3)
            .map(|_| t.train_step().unwrap().loss.to_bits())
            .collect()
    };
    let be = || CpuBackend::new(1).unwrap();
    let loaded = StepData::new(data.clone(), model.seq_len, train.seed).unwrap();
    assert_eq!(
        losses(Trainer::with_data(be(), &model, loaded, &train).unwrap()),
        losses(Trainer::with_backend(be(), &model, &data, &train).unwrap())
    );
    for (seq_len, seed, field) in [
        (model.seq_len / 2, train.seed, "model.seq_len"),
        (model.seq_len, train.seed + 1, "train.seed"),
    ] {
        let other = StepData::new(data.clone(), seq_len, seed).unwrap();
        let e = Trainer::with_data(be(), &model, other, &train)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(field), "{e}");
    }
}
