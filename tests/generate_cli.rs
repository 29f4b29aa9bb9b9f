//! `pipefill generate` through the binary, on a tiny Llama-shaped run (rope, SwiGLU,
//! grouped-query attention, q/k/v biases) that `pipefill train` wrote with its drafter:
//! greedy generation is the training model's own greedy decoding (the checkpoint loaded
//! here, its full-sequence logits), speculation with the run's drafter changes no token,
//! sampling is reproducible by seed, and each bad input is one line of error.

use std::path::Path;
use std::process::Output;

use pipefill::data::Tokenizer;
use pipefill::data::tokenizer::{BOS, EOS};
use pipefill::model::checkpoint::Checkpoint;
use pipefill::model::{Cut, Gpt, Shape};
use pipefill::tensor::CpuBackend;
use serde_json::Value;

mod common;
use common::{clean, one_line_error, text};

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

const TINY_LLAMA: &[&str] = &[
    "model.d_model=16",
    "model.heads=2",
    "model.kv_heads=1",
    "model.seq_len=32",
    "model.positions=\"rope\"",
    "model.activation=\"swiglu\"",
    "model.intermediate=24",
    "model.qkv_bias=true",
    "train.micro_batch_size=2",
    "train.eval_tasks=2",
    "data.summary_tasks=50",
];

fn train(out: &Path) {
    let mut cmd = clean(EXE);
    cmd.args(["train", "--steps", "2"]);
    for s in TINY_LLAMA {
        cmd.args(["--set", s]);
    }
    let done = cmd.arg("--out-dir").arg(out).output().unwrap();
    assert!(done.status.success(), "train: {}", text(&done));
}

fn generate(args: &[&str]) -> Output {
    clean(EXE).arg("generate").args(args).output().unwrap()
}

/// The JSON object of a successful `--json` run.
fn json(args: &[&str]) -> Value {
    let out = generate(args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim().lines().count(), 1, "one object: {stdout}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn tokens(v: &Value) -> Vec<u32> {
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect()
}

/// Greedy decoding with the checkpoint's model and its full-sequence training forward.
fn reference_greedy(run: &Path, prompt: &[u32], max_new: usize) -> Vec<u32> {
    let ck = Checkpoint::load(&run.join("checkpoint")).unwrap();
    let config = ck.meta.model.clone();
    let mut gpt = Gpt::new(&config, CpuBackend::new(1).unwrap(), &Cut::Even(1)).unwrap();
    ck.restore_model(&mut gpt, ck.meta.data_seed).unwrap();
    let mut seq = prompt.to_vec();
    while seq.len() < (prompt.len() + max_new).min(config.seq_len) {
        let shape = Shape {
            batch: 1,
            seq: seq.len(),
        };
        let logits = gpt.logits(shape, &seq).unwrap();
        let last = &logits[(seq.len() - 1) * config.vocab..];
        let t = (0..config.vocab)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        seq.push(t);
        if t == EOS {
            break;
        }
    }
    seq[prompt.len()..].to_vec()
}

#[test]
fn generate_from_a_trained_llama_shaped_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    train(&run);
    assert!(
        run.join("checkpoint/drafter.safetensors").is_file(),
        "the run trained a drafter"
    );
    let model = run.to_str().unwrap();
    let prompt = "12+3=";
    let greedy = json(&["--model", model, "--prompt", prompt, "--json"]);
    let plain = json(&["--model", model, "--prompt", prompt, "--no-draft", "--json"]);
    assert_eq!(greedy, plain, "speculation with the drafter is lossless");
    let tok = Tokenizer::new();
    let mut ids = vec![BOS];
    ids.extend(tok.encode(prompt).unwrap());
    let got = tokens(&greedy);
    assert_eq!(
        got,
        reference_greedy(&run, &ids, 32),
        "the training model's greedy decoding"
    );
    assert_eq!(greedy["text"], tok.decode(&got).unwrap().as_str());
    // The same prompt as raw ids; text output is the completion's text.
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let by_ids = json(&["--model", model, "--prompt-ids", &list.join(","), "--json"]);
    assert_eq!(by_ids, greedy);
    let out = generate(&[
        "--model",
        model,
        "--prompt",
        prompt,
        "--max-new-tokens",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let short = &got[..3.min(got.len())];
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end_matches('\n'),
        tok.decode(short).unwrap()
    );
    // Sampling: reproducible by seed, ids inside the vocabulary.
    let sample = |seed: &str| {
        json(&[
            "--model",
            model,
            "--prompt",
            prompt,
            "--temperature",
            "1.5",
            "--seed",
            seed,
            "--json",
        ])
    };
    let (a, b) = (sample("3"), sample("3"));
    assert_eq!(a, b, "the same seed, the same sample");
    assert!(tokens(&a).iter().all(|&t| (t as usize) < tok.vocab_size()));

    // Bad input: one line of error each, naming what is wrong.
    let long: Vec<String> = (0..32).map(|_| "5".to_string()).collect();
    let long = long.join(",");
    let missing = dir.path().join("nope");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--model", model, "--prompt", "12+3=\u{e9}"],
            "not in the tokenizer",
        ),
        (vec!["--model", model, "--prompt-ids", "1,5,99"], "token 99"),
        (
            vec!["--model", model, "--prompt-ids", "1,x"],
            "not a token id",
        ),
        (
            vec!["--model", model, "--prompt-ids", &long],
            "32 positions",
        ),
        (
            vec!["--model", model, "--prompt", prompt, "--temperature", "-1"],
            "temperature",
        ),
        (
            vec!["--model", missing.to_str().unwrap(), "--prompt", prompt],
            "no such run directory",
        ),
        (
            vec!["--model", dir.path().to_str().unwrap(), "--prompt", prompt],
            "not a checkpoint or a run directory",
        ),
    ];
    for (args, want) in cases {
        let err = one_line_error(&generate(&args));
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
