//! `pipefill train --model DIR` through the binary on the Hugging Face fixtures
//! (tests/fixtures/hf/, written by scripts/hf_fixtures.py): the run starts from the
//! directory's weights, with its shape; pipelined training of an imported (tied) model is
//! bitwise the reference trainer's; the result exports back to a directory that imports
//! to the run's checkpoint; a sequence longer than the model's positions is one line;
//! `pipefill generate` on a directory is transformers' greedy decoding; `pipefill rl
//! --model DIR` runs GRPO on a JSONL prompt/answer file with the directory's tokenizer and
//! exports back.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::hf::fixture;
use common::{clean, text};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::hf::HfModel;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const JOB: &[&str] = &[
    "model.seq_len=32",
    "train.micro_batches=4",
    "train.micro_batch_size=2",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
    "filler=\"none\"",
];

fn train(model: &Path, extra: &[&str], out: &Path) -> Output {
    let mut cmd = clean(EXE);
    cmd.arg("train").arg("--model").arg(model);
    for s in JOB.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(out).output().unwrap()
}

/// `pipefill export RUN --format hf` into `under/hf`: that directory, opened.
fn export(run: &Path, under: &Path) -> (PathBuf, HfModel) {
    let exported = under.join("hf");
    let out = clean(EXE)
        .arg("export")
        .arg(run)
        .args(["--format", "hf", "-o"])
        .arg(&exported)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let back = HfModel::open(&exported).unwrap();
    (exported, back)
}

/// The checkpoint's parameters (not its optimizer moments).
fn params(c: &Checkpoint) -> impl Iterator<Item = &pipefill::model::checkpoint::HostTensor> {
    c.tensors.iter().filter(|t| !t.name.starts_with("optim."))
}

fn tensor<'a>(c: &'a Checkpoint, name: &str) -> &'a [f32] {
    &c.tensors.iter().find(|t| t.name == name).unwrap().data
}

/// With a learning rate far below any weight's last bit, one step leaves every parameter
/// where the directory put it: the run started from the imported weights (a seeded
/// initialisation differs everywhere), and its job records the imported shape.
#[test]
fn a_run_starts_from_the_directorys_weights_and_shape() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let llama = fixture("llama");
    let out = train(
        &llama,
        &["train.lr=1e-30", "train.steps=1", "stages=2"],
        &run,
    );
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let hf = HfModel::open(&llama).unwrap();
    assert_eq!(params(&ckpt).count(), 1 + 2 * 9 + 2, "llama's parameters");
    let mut worst = 0.0f32;
    for t in params(&ckpt) {
        let want = hf.read(&t.name).unwrap();
        assert_eq!(t.shape, want.shape, "{}", t.name);
        for (a, b) in t.data.iter().zip(&want.data) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst <= 1e-12,
        "a parameter moved from the import by {worst:e}"
    );
    let job = std::fs::read_to_string(run.join("job.toml")).unwrap();
    for line in [
        "vocab = 256",
        "d_model = 64",
        "kv_heads = 2",
        "positions = \"rope\"",
    ] {
        assert!(job.contains(line), "job.toml lacks {line:?}:\n{job}");
    }
}

/// An imported tied model (Qwen2 with tie_word_embeddings) trained under 1F1B on 2 stages
/// is bitwise the reference trainer's (`--schedule none`), its tied copies still equal;
/// the run exports and the export imports to the checkpoint's tensors.
#[test]
fn a_pipelined_imported_model_is_the_reference_and_exports() {
    let dir = tempfile::tempdir().unwrap();
    let qwen = fixture("qwen2_tied");
    let (single, piped) = (dir.path().join("single"), dir.path().join("piped"));
    let out = train(&qwen, &["train.steps=2", "schedule=\"none\""], &single);
    assert!(out.status.success(), "{}", text(&out));
    let out = train(
        &qwen,
        &["train.steps=2", "schedule=\"1f1b\"", "stages=2"],
        &piped,
    );
    assert!(out.status.success(), "{}", text(&out));
    let (a, b) = (
        Checkpoint::load(&single.join("checkpoint")).unwrap(),
        Checkpoint::load(&piped.join("checkpoint")).unwrap(),
    );
    assert_eq!(a.tensors.len(), b.tensors.len());
    let bits = |t: &[f32]| t.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!(x.name, y.name);
        assert!(bits(&x.data) == bits(&y.data), "{} differs", x.name);
    }
    let (tok, head) = (tensor(&b, "embed.tok"), tensor(&b, "head.w"));
    assert_eq!(tok, head);
    let hf = HfModel::open(&qwen).unwrap();
    assert_ne!(
        tok,
        hf.read("embed.tok").unwrap().data,
        "training moved nothing"
    );

    let (_, back) = export(&piped, dir.path());
    assert!(back.config().tie_embeddings);
    for t in params(&b) {
        assert_eq!(back.read(&t.name).unwrap().data, t.data, "{}", t.name);
    }
}

#[test]
fn a_sequence_longer_than_the_models_positions_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(
        &fixture("llama"),
        &["model.seq_len=1000"],
        &dir.path().join("run"),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.seq_len") && err.contains("1000 is longer than the 256 positions"),
        "{err}"
    );
    let out = train(&dir.path().join("nowhere"), &[], &dir.path().join("run2"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.from") && err.contains("config.json"),
        "{err}"
    );
}

/// `pipefill generate --model DIR` on a Hugging Face directory: greedy decoding token for
/// token what transformers 5.24's `generate(do_sample=False)` gives on the same fixture and
/// prompt (computed once with scripts/hf_fixtures.py's venv; the fixtures are fixed), and
/// a text prompt without a tokenizer.json is one line asking for ids.
#[test]
fn generation_from_a_model_directory_is_transformers_greedy() {
    // Every fixture's greedy.json (scripts/hf_fixtures.py --greedy): transformers' greedy
    // continuations, stopped at generation_config.json's EOS where it names one (mistral's
    // first prompt ends there; qwen2_tied names none and generates id 2 on and on).
    for name in [
        "llama",
        "qwen2",
        "qwen2_tied",
        "mistral",
        "llama3",
        "qwen2_rl",
    ] {
        let greedy: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture(name).join("greedy.json")).unwrap(),
        )
        .unwrap();
        let ids = |v: &serde_json::Value| -> Vec<u64> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap())
                .collect()
        };
        let max_new = greedy["max_new_tokens"].to_string();
        let prompts = greedy["prompts"].as_array().unwrap();
        let wants = greedy["tokens"].as_array().unwrap();
        assert_eq!(prompts.len(), wants.len());
        for (prompt, want) in prompts.iter().zip(wants) {
            let list: Vec<String> = ids(prompt).iter().map(u64::to_string).collect();
            let out = clean(EXE)
                .args(["generate", "--model"])
                .arg(fixture(name))
                .args([
                    "--prompt-ids",
                    &list.join(","),
                    "--max-new-tokens",
                    &max_new,
                ])
                .arg("--json")
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", text(&out));
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(ids(&json["tokens"]), ids(want), "{name} after {list:?}");
        }
    }
    let out = clean(EXE)
        .args(["generate", "--model"])
        .arg(fixture("llama"))
        .args(["--prompt", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("has no tokenizer.json"),
        "{}",
        text(&out)
    );
}

/// `pipefill rl --model DIR` needs no warm-up: without `rl.warmup_steps` the pretrained
/// model is the starting policy as it is (the synthetic tasks' warm-up would only pull it
/// away from what it knows), in one process and launched.
#[test]
fn rl_on_a_pretrained_model_starts_without_warm_up() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("qwen2_rl");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/rl.jsonl");
    let sets = [
        "model.seq_len=64".to_string(),
        "stages=2".into(),
        "data.source=\"jsonl\"".into(),
        format!(
            "data.path={}",
            toml::Value::String(data.display().to_string())
        ),
        "rl.steps=1".into(),
        "rl.max_new_tokens=8".into(),
    ];
    for launched in [false, true] {
        let run = dir.path().join(format!("rl-{launched}"));
        let mut cmd = clean(EXE);
        if launched {
            cmd.args(["launch", "-n", "2", "--"]);
        }
        cmd.arg("rl").arg("--model").arg(&model);
        for s in &sets {
            cmd.args(["--set", s]);
        }
        let out = cmd.arg("--out-dir").arg(&run).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("(no warm-up)"), "{stdout}");
        assert!(!stdout.contains("supervised steps"), "{stdout}");
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 1, "{metrics}");
    }
}

/// `pipefill rl --model DIR` on the JSONL prompt/answer fixture: the directory's tokenizer
/// tokenizes the prompts (no `data.tokenizer` given), the warm-up moves the imported
/// weights, and the run exports to a directory that imports to its checkpoint and carries
/// the tokenizer.
#[test]
fn rl_on_a_model_directory_and_a_jsonl_file_exports_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("qwen2_rl");
    let run = dir.path().join("rl");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/rl.jsonl");
    let mut cmd = clean(EXE);
    cmd.arg("rl").arg("--model").arg(&model);
    for s in [
        "model.seq_len=64".to_string(),
        "stages=2".into(),
        "data.source=\"jsonl\"".into(),
        format!(
            "data.path={}",
            toml::Value::String(data.display().to_string())
        ),
        "rl.steps=2".into(),
        "rl.warmup_steps=2".into(),
        "rl.max_new_tokens=12".into(),
    ] {
        cmd.args(["--set", &s]);
    }
    let out = cmd.arg("--out-dir").arg(&run).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("prompt/answer records of"), "{stdout}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");

    let ckpt = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let hf = HfModel::open(&model).unwrap();
    assert_ne!(
        tensor(&ckpt, "embed.tok"),
        hf.read("embed.tok").unwrap().data,
        "the warm-up and the updates moved nothing"
    );
    let (exported, back) = export(&run, dir.path());
    for t in params(&ckpt) {
        assert_eq!(back.read(&t.name).unwrap().data, t.data, "{}", t.name);
    }
    assert_eq!(
        std::fs::read(exported.join("tokenizer.json")).unwrap(),
        std::fs::read(model.join("tokenizer.json")).unwrap()
    );
}

/// The training path end to end: a Hugging Face directory and a JSONL chat file
/// (tokenized by the directory's tokenizer, its chat template included), pipelined under
/// ZB-H1 with the drafter trained in the bubbles, exported back with the tokenizer.
#[test]
fn train_on_a_model_directory_and_a_jsonl_file_with_the_drafter_exports_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture("qwen2_rl");
    let run = dir.path().join("sft");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/chat.jsonl");
    let path = format!(
        "data.path={}",
        toml::Value::String(data.display().to_string())
    );
    let out = train(
        &model,
        &[
            "train.steps=3",
            "stages=2",
            "schedule=\"zb-h1\"",
            "filler=\"drafter\"",
            "data.source=\"jsonl\"",
            &path,
        ],
        &run,
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("data: ") && stdout.contains("chat.jsonl"),
        "{stdout}"
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let slices: Vec<u64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["drafter_slices"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(slices.len(), 3, "{metrics}");
    assert!(
        slices.iter().sum::<u64>() > 0,
        "no drafter slice ran: {metrics}"
    );
    assert!(run.join("checkpoint/drafter.safetensors").is_file());

    let ckpt = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let (exported, back) = export(&run, dir.path());
    for t in params(&ckpt) {
        assert_eq!(back.read(&t.name).unwrap().data, t.data, "{}", t.name);
    }
    assert!(exported.join("tokenizer_config.json").is_file());
    // `generate` on the run encodes with the run's own tokenizer (the synthetic tasks'
    // characters have no 'H'), the same ids as on the export.
    let generate = |model: &Path| {
        let out = clean(EXE)
            .args(["generate", "--model"])
            .arg(model)
            .args([
                "--prompt",
                "Hello, World",
                "--max-new-tokens",
                "4",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(generate(&run), generate(&exported));
}
