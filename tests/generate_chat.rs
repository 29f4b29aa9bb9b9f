//! A model directory laid out as transformers 5.x saves it, its chat template in
//! `chat_template.jinja` and not in tokenizer_config.json (the qwen2_rl fixture, its template
//! moved there): `pipefill train` tokenizes `messages` records with it, and `pipefill
//! generate --chat` renders the prompt as one user message with the assistant's header
//! after it. The text `generate` writes as it comes is the `--json` object's text; `--chat`
//! without a template, or with `--prompt-ids`, is one error.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{clean, one_line_error, text};
use pipefill::data::TextTokenizer;
use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_pipefill");

/// A copy of the qwen2_rl fixture whose chat template is in chat_template.jinja only.
fn jinja_model() -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = common::hf::copy("qwen2_rl");
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let template = config
        .as_object_mut()
        .unwrap()
        .remove("chat_template")
        .expect("the fixture has a chat_template");
    std::fs::write(&path, config.to_string()).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template.as_str().unwrap()).unwrap();
    (tmp, dir)
}

fn generate(model: &Path, args: &[&str]) -> Output {
    clean(EXE)
        .args(["generate", "--model"])
        .arg(model)
        .args(args)
        .output()
        .unwrap()
}

/// The JSON object of a successful `--json` run.
fn json(model: &Path, args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = generate(model, &args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "one object: {stdout}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// What a run without `--json` writes: the generated text and a newline.
fn streamed(model: &Path, args: &[&str]) -> String {
    let out = generate(model, args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn generate_chat_renders_a_user_message_through_the_jinja_template() {
    let (_tmp, model) = jinja_model();
    let tok = TextTokenizer::load(&model).unwrap();
    let template = tok
        .chat_template()
        .expect("chat_template.jinja is the template");
    let (bos, eos) = tok.special_texts();
    let question = "add 2 and 3";
    let user = serde_json::json!({"role": "user", "content": question});
    let rendered = template.render(&[user], true, &bos, &eos).unwrap();
    assert!(
        rendered.ends_with("<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"),
        "{rendered:?}"
    );
    let ids: Vec<String> = tok
        .encode(&rendered, false)
        .unwrap()
        .iter()
        .map(u32::to_string)
        .collect();
    let ids = ids.join(",");
    let max = ["--max-new-tokens", "12"];
    let chat = json(
        &model,
        &[&["--chat", "--prompt", question][..], &max].concat(),
    );
    let by_ids = json(
        &model,
        &[&["--prompt-ids", ids.as_str()][..], &max].concat(),
    );
    assert_eq!(chat, by_ids, "--chat is the rendered template's ids");
    let plain = json(&model, &[&["--prompt", question][..], &max].concat());
    assert_ne!(chat["tokens"], plain["tokens"], "--chat changes the prompt");

    // The text as it comes is the --json object's text, with or without --chat.
    for (args, object) in [
        (&["--chat", "--prompt", question][..], &chat),
        (&["--prompt", question][..], &plain),
    ] {
        let out = streamed(&model, &[args, &max].concat());
        assert_eq!(
            out,
            format!("{}\n", object["text"].as_str().unwrap()),
            "{args:?}"
        );
    }

    // Errors: --chat with ids is a usage error; a tokenizer without a template is one line.
    let out = generate(&model, &["--chat", "--prompt-ids", "1,2"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--chat"),
        "{}",
        text(&out)
    );
    std::fs::remove_file(model.join("chat_template.jinja")).unwrap();
    let err = one_line_error(&generate(&model, &["--chat", "--prompt", question]));
    assert!(err.contains("has no chat template"), "{err}");
    let ids_only = common::hf::fixture("qwen2_tied");
    let err = one_line_error(&generate(&ids_only, &["--chat", "--prompt", question]));
    assert!(err.contains("has no tokenizer.json"), "{err}");
}

/// Streamed text is the whole decode on every greedy fixture prompt (multi-byte pieces
/// included where the model writes them).
#[test]
fn streamed_text_is_the_json_text() {
    let model = common::hf::fixture("qwen2_rl");
    for prompt in ["Hello, World", "é€😀 ü", "1 2 3"] {
        let args = ["--prompt", prompt, "--max-new-tokens", "24"];
        let object = json(&model, &args);
        let out = streamed(&model, &args);
        assert_eq!(
            out,
            format!("{}\n", object["text"].as_str().unwrap()),
            "{prompt:?}"
        );
    }
}

/// `pipefill train --model DIR` on `messages` records: the template comes from
/// chat_template.jinja (before, such a directory's records were refused as needing a
/// tokenizer with a chat_template), and `generate --chat` on the run uses it too.
#[test]
fn messages_records_train_with_the_jinja_template() {
    let (tmp, model) = jinja_model();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/chat.jsonl");
    let run = tmp.path().join("sft");
    let mut cmd = clean(EXE);
    cmd.arg("train").arg("--model").arg(&model);
    for s in [
        "model.seq_len=96",
        "stages=1",
        "train.steps=1",
        "train.micro_batches=2",
        "train.micro_batch_size=2",
        "train.eval_tasks=2",
        "data.summary_tasks=50",
        "filler=\"none\"",
        "data.source=\"jsonl\"",
        &format!(
            "data.path={}",
            toml::Value::String(data.display().to_string())
        ),
    ] {
        cmd.args(["--set", s]);
    }
    let out = cmd.arg("--out-dir").arg(&run).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let args = ["--chat", "--prompt", "add 1 and 2", "--max-new-tokens", "4"];
    let on_run = json(&run, &args);
    assert_eq!(on_run["tokens"].as_array().unwrap().len(), 4, "{on_run}");
}
