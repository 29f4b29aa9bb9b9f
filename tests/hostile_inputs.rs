//! Hostile inputs, each a reproduction from the reliability issue: a model directory, a chat
//! template, a data line, a size on the command line or a file that is not a file. Each
//! gives one clear error naming the file or the setting, within seconds, with no panic and
//! no hang (a run that does not end in time is killed and the test fails).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::hf::{copy, edit_config};
use common::{clean, one_line_error, text};

/// Longest any of these may take (the bound).
const LIMIT: Duration = Duration::from_secs(10);

/// `cmd` run to its end within [`LIMIT`] (killed and failed past it).
fn within_limit(mut cmd: Command) -> Output {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    loop {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            assert!(start.elapsed() < LIMIT, "took {:?}", start.elapsed());
            return out;
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {LIMIT:?}: {}", text(&out));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pipefill(args: &[&str]) -> Command {
    let mut cmd = clean(env!("CARGO_BIN_EXE_pipefill"));
    cmd.args(args);
    cmd
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "{path:?}");
}

fn generate(dir: &Path) -> Output {
    within_limit(pipefill(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1",
    ]))
}

#[test]
fn a_billion_layers_in_config_json_is_refused_naming_the_field() {
    let (_tmp, dir) = copy("mistral");
    edit_config(&dir, |m| {
        m.insert("num_hidden_layers".into(), 1_000_000_000.into());
    });
    let err = one_line_error(&generate(&dir));
    assert!(
        err.contains("is missing (config.json: num_hidden_layers = 1000000000)"),
        "{err}"
    );
}

#[test]
fn weight_files_that_are_not_files_are_named() {
    // A FIFO named model.safetensors would block a plain open forever.
    let (_tmp, dir) = copy("mistral");
    let weights = dir.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    mkfifo(&weights);
    let err = one_line_error(&generate(&dir));
    assert!(err.contains("model.safetensors is a FIFO"), "{err}");

    // A config.json that is a FIFO is the model directory's config, not a missing one.
    let (_tmp, dir) = copy("mistral");
    let config = dir.join("config.json");
    std::fs::remove_file(&config).unwrap();
    mkfifo(&config);
    let err = one_line_error(&generate(&dir));
    assert!(
        err.contains("config.json is a FIFO, not a regular file"),
        "{err}"
    );

    // A shard that is a directory.
    let (_tmp, dir) = copy("qwen2");
    let shard = dir.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    let err = one_line_error(&generate(&dir));
    assert!(
        err.contains("model-00002-of-00003.safetensors is a directory"),
        "{err}"
    );

    // An index that is endless.
    let (_tmp, dir) = copy("qwen2");
    let index = dir.join("model.safetensors.index.json");
    std::fs::remove_file(&index).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &index).unwrap();
    let err = one_line_error(&generate(&dir));
    assert!(
        err.contains("model.safetensors.index.json is a device"),
        "{err}"
    );
}

#[test]
fn a_header_over_safetensors_limit_says_so() {
    let (_tmp, dir) = copy("mistral");
    let mut bytes = 150_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    let err = one_line_error(&generate(&dir));
    assert!(
        err.contains("has a 150000000-byte safetensors header, over the format's limit"),
        "{err}"
    );
}

#[test]
fn job_schedule_and_report_files_that_never_end_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("job.toml");
    mkfifo(&fifo);
    let err = one_line_error(&within_limit(pipefill(&["train", fifo.to_str().unwrap()])));
    assert!(
        err.contains("job.toml is a FIFO, not a regular file"),
        "{err}"
    );

    let zero = tmp.path().join("plan.csv");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let err = one_line_error(&within_limit(pipefill(&[
        "schedule",
        "show",
        zero.to_str().unwrap(),
    ])));
    assert!(err.contains("plan.csv: is a device"), "{err}");

    let run = tmp.path().join("run");
    std::fs::create_dir(&run).unwrap();
    mkfifo(&run.join("report.json"));
    let err = one_line_error(&within_limit(pipefill(&["profile", run.to_str().unwrap()])));
    assert!(err.contains("report.json is a FIFO"), "{err}");
}

/// A JSONL training job on `data` with the fixture tokenizer, whose tokenizer_config.json
/// is `config` when given.
fn train_jsonl(tmp: &Path, data: &Path, config: Option<serde_json::Value>) -> Output {
    let tokenizer = tmp.join("tokenizer");
    std::fs::create_dir_all(&tokenizer).unwrap();
    let source = fixtures().join("data/tokenizer");
    for e in std::fs::read_dir(&source).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tokenizer.join(e.file_name())).unwrap();
    }
    if let Some(config) = config {
        std::fs::write(
            tokenizer.join("tokenizer_config.json"),
            serde_json::to_vec(&config).unwrap(),
        )
        .unwrap();
    }
    let sets = [
        "data.source=\"jsonl\"".to_string(),
        format!("data.path=\"{}\"", data.display()),
        format!("data.tokenizer=\"{}\"", tokenizer.display()),
        "model.vocab=300".into(),
        "train.steps=1".into(),
    ];
    let mut cmd = pipefill(&["train"]);
    for s in &sets {
        cmd.args(["--set", s]);
    }
    cmd.arg("--out-dir").arg(tmp.join("run"));
    within_limit(cmd)
}

#[test]
fn a_chat_template_that_runs_without_end_is_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let endless = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}\
                   {% endfor %}";
    let out = train_jsonl(
        tmp.path(),
        &fixtures().join("data/chat.jsonl"),
        Some(serde_json::json!({ "chat_template": endless, "eos_token": "<|im_end|>" })),
    );
    let err = one_line_error(&out);
    assert!(err.contains("chat.jsonl:1:"), "{err}");
    // Either limit may be what stops it: the output cap (x per instruction) or the fuel.
    assert!(
        err.contains("instructions") || err.contains("the chat template wrote more than"),
        "{err}"
    );
}

#[test]
fn a_chat_template_that_renders_nothing_names_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = train_jsonl(
        tmp.path(),
        &fixtures().join("data/chat.jsonl"),
        Some(
            serde_json::json!({ "chat_template": "{% if false %}x{% endif %}", "eos_token": "<|im_end|>" }),
        ),
    );
    let err = one_line_error(&out);
    assert!(err.contains("chat.jsonl:1:"), "{err}");
    assert!(err.contains("renders this record's"), "{err}");
}

#[test]
fn a_line_over_the_default_cap_is_refused_before_it_is_tokenized() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("long.jsonl");
    let text = "the cat sat on a mat ".repeat(100_000); // 2.1 MB
    std::fs::write(&data, format!("{}\n", serde_json::json!({ "text": text }))).unwrap();
    let err = one_line_error(&train_jsonl(tmp.path(), &data, None));
    assert!(err.contains("long.jsonl:1:"), "{err}");
    assert!(err.contains("data.max_line_bytes = 1048576"), "{err}");
}

#[test]
fn sizes_on_the_command_line_are_checked_before_they_are_used() {
    let out = within_limit(pipefill(&["launch", "-n", "100000", "--", "train"]));
    let err = one_line_error(&out);
    assert!(
        err.contains("-n 100000: a launcher starts 1 to 256 ranks"),
        "{err}"
    );

    // clap's own refusal: a usage line follows the error.
    let out = within_limit(pipefill(&[
        "launch",
        "-n",
        "2",
        "--master-port",
        "0",
        "--",
        "train",
    ]));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: invalid value '0' for '--master-port"),
        "{stderr}"
    );

    let mut cmd = pipefill(&["train", "--steps", "1"]);
    cmd.env("PIPEFILL_RANK", "0")
        .env("PIPEFILL_WORLD_SIZE", "4")
        .env("PIPEFILL_MASTER_ADDR", "127.0.0.1")
        .env("PIPEFILL_MASTER_PORT", "1")
        .env("PIPEFILL_JOIN_TIMEOUT", "1e300");
    let err = one_line_error(&within_limit(cmd));
    assert!(err.contains("PIPEFILL_JOIN_TIMEOUT"), "{err}");
}
