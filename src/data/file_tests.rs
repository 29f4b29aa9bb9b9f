//! Tests of the file-based data: the Hugging Face tokenizer and chat template against the
//! Python package's outputs (tests/fixtures/data/expected.json, written by
//! scripts/data_fixtures.py), JSONL records and their loss masks, file and line errors, and
//! the rewards.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::chat::ChatTemplate;
use super::documents::PROGRESS_EVERY;
use super::hf_tokenizer::HfTokenizer;
use super::jsonl::{Record, parse_record, read_lines};
use super::reward::{Reward, boxed_match, final_number, last_boxed, numeric_match};
use super::*;
use crate::tensor::IGNORE_TARGET;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokenizer() -> HfTokenizer {
    HfTokenizer::load(&fixtures().join("tokenizer")).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_ids_and_decodes_equal_the_python_tokenizers() {
    let tok = tokenizer();
    let exp = expected();
    assert_eq!(tok.vocab_size() as u64, exp["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.eos().text, "<|im_end|>");
    assert_eq!(tok.eos().id, 2);
    assert_eq!(tok.pad().unwrap().id, 0, "an AddedToken object entry");
    assert!(tok.bos().is_none(), "bos_token null");
    let cases = exp["encode"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap()
        );
    }
    let err = tok.decode(&[5, 300], true).unwrap_err().to_string();
    assert!(err.contains("token id 300 at position 1"), "{err}");
}

#[test]
fn the_chat_template_renders_as_jinja2_does() {
    let tok = tokenizer();
    let template = tok.chat_template().expect("the fixture has a template");
    for case in expected()["chat"].as_array().unwrap() {
        let messages = case["messages"].as_array().unwrap();
        let generation = case["add_generation_prompt"].as_bool().unwrap();
        let text = template
            .render(messages, generation, "", "<|im_end|>")
            .unwrap();
        assert_eq!(text, case["text"].as_str().unwrap());
        assert_eq!(tok.encode(&text, false).unwrap(), ids(&case["ids"]));
    }
}

#[test]
fn template_functions_and_errors() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' + m.content) }}{% endif %}\
         {{ m | tojson }}|{{ m.content.strip().upper() }}|{{ m | tojson(indent=2) }}{% endfor %}",
    )
    .unwrap();
    let m = serde_json::json!({"role": "user", "content": " a\"é\n ", "n": [1, 2.5, null, true]});
    let text = t.render(&[m], false, "", "").unwrap();
    // As Python: json.dumps(m, ensure_ascii=False), json.dumps(m, indent=2, ensure_ascii=False)
    // (keys in serde_json's sorted order).
    assert_eq!(
        text,
        "{\"content\": \" a\\\"é\\n \", \"n\": [1, 2.5, null, true], \"role\": \"user\"}|A\"É|\
         {\n  \"content\": \" a\\\"é\\n \",\n  \"n\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"role\": \"user\"\n}"
    );
    let err = t
        .render(
            &[serde_json::json!({"role": "tool", "content": "x"})],
            false,
            "",
            "",
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("no tools: x"), "{err}");
    let err = ChatTemplate::new("{% for %}").unwrap_err().to_string();
    assert!(err.starts_with("chat template: "), "{err}");
}

/// A template is bounded in work, in output and in the messages it is given: each limit is
/// one error saying which, and a template within them renders as before.
#[test]
fn template_renders_are_bounded() {
    use crate::data::chat::{FUEL, MAX_MESSAGES, OUTPUT_SLACK};
    let m = serde_json::json!({"role": "user", "content": "hi"});
    // Work: nested loops that write nothing.
    let t = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let err = t.render(std::slice::from_ref(&m), false, "", "");
    let err = err.unwrap_err().to_string();
    assert!(
        err.contains(&format!("limit of {FUEL} instructions")),
        "{err}"
    );
    // Output: a few instructions that write a lot.
    let t = ChatTemplate::new("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}").unwrap();
    let err = t.render(std::slice::from_ref(&m), false, "", "");
    let err = err.unwrap_err().to_string();
    assert!(err.contains("the chat template wrote more than"), "{err}");
    // Just under the output cap is fine: the slack alone, for no messages.
    let t = ChatTemplate::new(&format!("{{{{ 'x' * {} }}}}", OUTPUT_SLACK - 2)).unwrap();
    assert_eq!(
        t.render(&[], false, "", "").unwrap().len(),
        OUTPUT_SLACK - 2
    );
    // Messages.
    let t = ChatTemplate::new("{{ messages | length }}").unwrap();
    let many = vec![m.clone(); MAX_MESSAGES + 1];
    let err = t.render(&many, false, "", "").unwrap_err().to_string();
    assert!(err.contains("1025 messages is more than 1024"), "{err}");
    assert_eq!(t.render(&many[1..], false, "", "").unwrap(), "1024");
}

#[test]
fn records_of_each_form_parse_and_bad_ones_are_named() {
    assert_eq!(
        parse_record(r#"{"text": "hi", "id": 3}"#).unwrap(),
        Record::Text("hi".into())
    );
    assert_eq!(
        parse_record(r#"{"prompt": "p", "completion": "c"}"#).unwrap(),
        Record::Completion {
            prompt: "p".into(),
            completion: "c".into()
        }
    );
    assert_eq!(
        parse_record("{\"prompt\": \"p\", \"answer\": \"#### 4\"}").unwrap(),
        Record::Answer {
            prompt: "p".into(),
            answer: "#### 4".into()
        }
    );
    assert!(matches!(
        parse_record(r#"{"messages": [{"role": "user", "content": "x"}]}"#).unwrap(),
        Record::Chat(m) if m.len() == 1
    ));
    for (line, want) in [
        ("[1]", "must be a JSON object, not an array"),
        ("{\"text\": 5}", "`text` must be a string, not a number"),
        (
            "{\"prompt\": \"p\"}",
            "needs `completion` (SFT) or `answer`",
        ),
        ("{\"messages\": []}", "`messages` is empty"),
        (
            "{\"messages\": [{\"role\": \"user\"}]}",
            "messages[0] has no `content`",
        ),
        (
            "{\"messages\": [{\"role\": 1, \"content\": \"\"}]}",
            "messages[0].role must be a string",
        ),
        (
            "{\"input\": 1, \"output\": 2}",
            "its keys: [\"input\", \"output\"]",
        ),
        ("{\"text\": ", "not valid JSON"),
    ] {
        let err = parse_record(line).unwrap_err();
        assert!(err.contains(want), "{line}: {err}");
    }
}

#[test]
fn a_malformed_line_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    std::fs::write(
        &path,
        "{\"text\": \"a\"}\n\n  \n{\"text\": \"b\"}\n{\"text\": oops}\n",
    )
    .unwrap();
    let err = jsonl::read_records(&path, 1 << 20, 1 << 10)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!("{}:5: not valid JSON", path.display())),
        "{err}"
    );
    // Blank lines skipped, line numbers kept, CRLF and a BOM accepted.
    std::fs::write(&path, "\u{feff}{\"text\": \"a\"}\r\n\n{\"text\": \"b\"}").unwrap();
    let lines = jsonl::read_records(&path, 1 << 20, 1 << 10).unwrap();
    assert_eq!(lines.iter().map(|l| l.line).collect::<Vec<_>>(), vec![1, 3]);
    // Not UTF-8.
    std::fs::write(&path, b"{\"text\": \"a\"}\n{\"text\": \"\xff\"}\n").unwrap();
    let err = jsonl::read_records(&path, 1 << 20, 1 << 10)
        .unwrap_err()
        .to_string();
    assert!(err.contains("d.jsonl:2: not UTF-8"), "{err}");
}

#[test]
fn sizes_are_checked_before_reading() {
    // An endless line is refused after max_line_bytes + 1 bytes, not read whole.
    let endless = std::io::BufReader::new(std::io::Read::take(std::io::repeat(b'a'), 1 << 40));
    let err = read_lines(endless, Path::new("big.jsonl"), 1000)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "big.jsonl:1: line is longer than data.max_line_bytes = 1000"
    );
    // A line of exactly the limit is fine.
    let line = format!("{{\"text\": \"{}\"}}\n", "x".repeat(988));
    assert_eq!(line.len(), 1001);
    let ok = read_lines(line.as_bytes(), Path::new("x"), 1000).unwrap();
    assert_eq!(ok.len(), 1);
    // A file over max_file_bytes, from its metadata.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.jsonl");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(b"{\"text\": \"a\"}\n").unwrap();
    f.set_len(1 << 30).unwrap();
    let err = jsonl::read_records(&path, 1 << 20, 1 << 10)
        .unwrap_err()
        .to_string();
    assert!(err.contains("over data.max_file_bytes = 1048576"), "{err}");
    // A directory, a missing file, an oversized tokenizer.json.
    let err = jsonl::read_records(dir.path(), 1 << 20, 1 << 10).unwrap_err();
    assert!(
        err.to_string()
            .contains("is a directory, not a regular file"),
        "{err}"
    );
    let err = jsonl::read_records(&dir.path().join("none"), 1, 1).unwrap_err();
    assert!(err.to_string().contains("none cannot be read"), "{err}");
    let big = dir.path().join("tokenizer.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(hf_tokenizer::MAX_TOKENIZER_BYTES + 1)
        .unwrap();
    let err = HfTokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("over the limit"), "{err}");
    std::fs::write(&big, "{\"not\": \"a tokenizer\"}").unwrap();
    let err = HfTokenizer::load(&big).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!("tokenizer {}", big.display())),
        "{err}"
    );
}

/// A jsonl [`DataConfig`] of `lines` written to a file in `dir`, with the fixture tokenizer.
fn jsonl_config(dir: &Path, lines: &[&str]) -> DataConfig {
    let path = dir.join("d.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    DataConfig {
        source: DataSource::Jsonl,
        path: Some(path),
        tokenizer: Some(fixtures().join("tokenizer")),
        ..DataConfig::default()
    }
}

/// The text of the counted targets of `data`'s step 0 in one row of `seq_len`, and the
/// whole row's input text.
fn one_row(data: &StepData) -> (String, String) {
    let mb = &data.micro_batches(0, 1, 1)[0];
    let counted: Vec<u32> = mb
        .targets
        .iter()
        .copied()
        .filter(|&t| t != IGNORE_TARGET)
        .collect();
    let tok = data.text_tokenizer();
    (
        tok.decode(&counted).unwrap(),
        tok.decode(&mb.inputs).unwrap(),
    )
}

#[test]
fn sft_loss_is_on_the_completion_only() {
    let dir = tempfile::tempdir().unwrap();
    let config = jsonl_config(
        dir.path(),
        &[r#"{"prompt": "what is the sum of 1 and 2? ", "completion": "answer 3."}"#],
    );
    // One document per window exactly: its ids + EOS.
    let tok = TextTokenizer::load(config.tokenizer.as_ref().unwrap()).unwrap();
    let n = tok
        .encode("what is the sum of 1 and 2? answer 3.", true)
        .unwrap()
        .len()
        + 1;
    let data = StepData::new(config, n - 1, 0).unwrap();
    let mb = &data.micro_batches(0, 1, 1)[0];
    let (targets, inputs) = one_row(&data);
    // The completion (a token joining the prompt's last space to its first word counts);
    // EOS is a target too, dropped by decode.
    assert!(
        targets.ends_with("answer 3.") && targets.len() <= " answer 3.".len(),
        "{targets:?}"
    );
    assert_eq!(*mb.targets.last().unwrap(), tok.eos());
    assert_eq!(inputs, "what is the sum of 1 and 2? answer 3.");
    assert!(mb.counted() < mb.tokens());
    assert_eq!(mb.targets[0], IGNORE_TARGET);
}

#[test]
fn chat_loss_is_on_the_assistant_turns_only() {
    let dir = tempfile::tempdir().unwrap();
    let record = r#"{"messages": [{"role": "user", "content": "add 12 and 30"}, {"role": "assistant", "content": "42"}, {"role": "user", "content": "and 1?"}, {"role": "assistant", "content": " 43 "}]}"#;
    let config = jsonl_config(dir.path(), &[record]);
    let tok = TextTokenizer::load(config.tokenizer.as_ref().unwrap()).unwrap();
    let Record::Chat(messages) = parse_record(record).unwrap() else {
        panic!()
    };
    let text = tok
        .chat_template()
        .unwrap()
        .render(&messages, false, "", "<|im_end|>")
        .unwrap();
    let n = tok.encode(&text, false).unwrap().len();
    let data = StepData::new(config, n - 1, 0).unwrap();
    let (targets, inputs) = one_row(&data);
    // Each assistant turn's content and end-of-turn marker (`<|im_end|>\n`; the special
    // token is dropped by decode).
    assert_eq!(targets, "42\n43\n");
    assert!(inputs.starts_with("system\nYou are a helpful assistant.\nuser\nadd 12"));
    // Without a template, a chat record is an error naming its line.
    let mut no_template = jsonl_config(dir.path(), &["{\"text\": \"a\"}", record]);
    let t = dir.path().join("tok");
    std::fs::create_dir(&t).unwrap();
    std::fs::copy(
        fixtures().join("tokenizer/tokenizer.json"),
        t.join("tokenizer.json"),
    )
    .unwrap();
    no_template.tokenizer = Some(t);
    let err = StepData::new(no_template, 8, 0).unwrap_err().to_string();
    assert!(
        err.contains("d.jsonl:2: a `messages` record needs a tokenizer with a chat_template"),
        "{err}"
    );
}

#[test]
fn tokenizing_reports_its_progress_up_to_every_record_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<String> = (0..2 * PROGRESS_EVERY + 5)
        .map(|i| format!(r#"{{"text": "bubble {i}"}}"#))
        .collect();
    let lines: Vec<&str> = records.iter().map(String::as_str).collect();
    let config = jsonl_config(dir.path(), &lines);
    let mut reports = Vec::new();
    let data = StepData::load(config, 16, 0, &mut |t| reports.push(t)).unwrap();
    let tokens = data.documents().unwrap().tokens();
    let of = records.len();
    assert_eq!(
        reports
            .iter()
            .map(|t| (t.records, t.of))
            .collect::<Vec<_>>(),
        [(PROGRESS_EVERY, of), (2 * PROGRESS_EVERY, of), (of, of)]
    );
    assert!(reports.windows(2).all(|w| w[0].tokens < w[1].tokens));
    assert_eq!(reports.last().unwrap().tokens, tokens);
    // The synthetic tasks read nothing.
    let mut synthetic = 0;
    StepData::load(DataConfig::default(), 16, 0, &mut |_| synthetic += 1).unwrap();
    assert_eq!(synthetic, 0);
}

#[test]
fn pretraining_text_is_packed_with_eos_and_every_token_is_a_target() {
    let dir = tempfile::tempdir().unwrap();
    let config = jsonl_config(
        dir.path(),
        &[r#"{"text": "the pipeline"}"#, r#"{"text": "a bubble"}"#],
    );
    let data = StepData::new(config, 40, 3).unwrap();
    let docs = data.documents().unwrap();
    assert_eq!(docs.len(), 2);
    let eos = data.text_tokenizer().eos();
    for d in 0..2 {
        let (ids, targets) = docs.document(d);
        assert_eq!(*ids.last().unwrap(), eos);
        assert!(targets.iter().all(|&t| t));
    }
    let mbs = data.micro_batches(2, 2, 3);
    for mb in &mbs {
        assert_eq!(mb.counted(), mb.tokens());
        for r in 0..mb.rows {
            let row = r * 40..(r + 1) * 40;
            assert_eq!(
                mb.inputs[row.start + 1..row.end],
                mb.targets[row.start..row.end - 1]
            );
        }
    }
    // A pure function of (seed, step), and 1×6 rows are 2×3 rows.
    assert_eq!(mbs, data.micro_batches(2, 2, 3));
    assert_ne!(mbs, data.micro_batches(3, 2, 3));
    let one = &data.micro_batches(2, 1, 6)[0];
    let joined: Vec<u32> = mbs.iter().flat_map(|m| m.inputs.clone()).collect();
    assert_eq!(one.inputs, joined);
    // Every window is made of whole documents: the text decodes to repeats of the two.
    let text = data.text_tokenizer().decode(&one.inputs).unwrap();
    assert!(
        text.contains("the pipeline") && text.contains("a bubble"),
        "{text}"
    );
}

#[test]
fn the_fixture_datasets_load() {
    for name in ["pretrain.jsonl", "sft.jsonl", "chat.jsonl", "rl.jsonl"] {
        let config = DataConfig {
            source: DataSource::Jsonl,
            path: Some(fixtures().join(name)),
            tokenizer: Some(fixtures().join("tokenizer")),
            ..DataConfig::default()
        };
        assert_eq!(config.tokenizer_vocab().unwrap(), Some(300));
        let data = StepData::new(config, 32, 1).unwrap();
        let mb = &data.micro_batches(0, 2, 2)[0];
        assert!(mb.counted() > 0, "{name}");
        assert!(mb.inputs.iter().all(|&i| i < 300));
    }
    // The config's own checks, and the character tokenizer for jsonl.
    let mut config = DataConfig {
        source: DataSource::Jsonl,
        ..DataConfig::default()
    };
    assert!(
        config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("data.path")
    );
    config.path = Some(fixtures().join("pretrain.jsonl"));
    assert!(
        config
            .validate()
            .unwrap_err()
            .to_string()
            .contains("data.tokenizer")
    );
    config.tokenizer = Some("chars".into());
    let err = StepData::new(config, 8, 0).unwrap_err().to_string();
    assert!(err.contains("pretrain.jsonl:1: character"), "{err}");
}

#[test]
fn synthetic_config_serializes_as_before() {
    let json = serde_json::to_string(&DataConfig::default()).unwrap();
    assert_eq!(
        json,
        r#"{"families":["addition","sorting","counting","parity"],"size_scale":1.5,"max_size":24,"summary_tasks":4000}"#
    );
}

#[test]
fn rewards_and_their_edge_cases() {
    // Numeric (GSM8K).
    assert_eq!(final_number("so 3 + 4 = 7\n#### 7").as_deref(), Some("7"));
    assert_eq!(
        final_number("#### 1,234.50 dollars").as_deref(),
        Some("1234.5")
    );
    assert_eq!(final_number("it is -3 then 5").as_deref(), Some("5"));
    assert_eq!(final_number("#### -0.0").as_deref(), Some("0"));
    assert_eq!(final_number("#### $12").as_deref(), Some("12"));
    assert_eq!(final_number("no number #### here"), None);
    assert_eq!(final_number(""), None);
    assert!(numeric_match("The answer is 042.", "a + b = 42\n#### 42"));
    assert!(numeric_match("#### 1000", "#### 1,000"));
    assert!(!numeric_match("#### -3", "#### 3"));
    assert!(!numeric_match("no answer", "#### 3"));
    assert!(
        !numeric_match("#### 4 then 5", "#### 5"),
        "the first number after ####"
    );
    assert!(
        numeric_match("1, 2 and 3.", "#### 3"),
        "a trailing period is not a decimal"
    );
    // Boxed (MATH).
    assert_eq!(last_boxed(r"so \boxed{\frac{1}{2}}."), Some(r"\frac{1}{2}"));
    assert_eq!(
        last_boxed(r"\boxed{1} then \boxed{ {a}{b} }"),
        Some(" {a}{b} ")
    );
    assert_eq!(last_boxed(r"\boxed{unclosed {"), None);
    assert_eq!(last_boxed(r"\fbox{7}"), Some("7"));
    assert_eq!(last_boxed(r"$\boxed 5$"), Some("5"));
    assert_eq!(last_boxed("none"), None);
    assert!(boxed_match(r"thus \boxed{\dfrac{1}{2}}", r"\frac{1}{2}"));
    assert!(boxed_match(
        r"\boxed{ \left( 1, 2 \right) }",
        r"so \boxed{(1,2)}."
    ));
    assert!(boxed_match(r"\boxed{5.0}", "5"));
    assert!(!boxed_match(r"\boxed{}", ""));
    assert!(!boxed_match(r"\boxed{1,2}", "12"), "a tuple is not twelve");
    assert!(boxed_match(r"\boxed{1,000}", "1000"));
    assert!(!boxed_match("5", "5"), "no box in the response");
    assert!(!boxed_match(r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"));
    // Exact, and the enum.
    assert_eq!(Reward::Exact.score(" yes\n", "yes"), 1.0);
    assert_eq!(Reward::Exact.score("Yes", "yes"), 0.0);
    assert_eq!(Reward::Numeric.score("#### 7", "#### 7"), 1.0);
    assert_eq!(Reward::Boxed.score(r"\boxed{x}", "y"), 0.0);
}

#[test]
fn a_llama3_style_tokenizer_adds_its_bos_and_matches_python() {
    let tok = HfTokenizer::load(&fixtures().join("llama3-tokenizer")).unwrap();
    let exp = &expected()["llama3"];
    let bos = exp["bos"].as_u64().unwrap() as u32;
    assert_eq!(tok.bos().unwrap().id, bos);
    assert_eq!(tok.eos().id as u64, exp["eos"].as_u64().unwrap());
    assert!(tok.chat_template().is_none());
    for case in exp["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(want[0], bos);
        assert_eq!(tok.encode(text, true).unwrap(), want, "{text:?}");
    }
    // A text record is BOS, the text, EOS; BOS's empty offset keeps it out of a completion.
    let dir = tempfile::tempdir().unwrap();
    let mut config = jsonl_config(
        dir.path(),
        &[
            r#"{"text": "the pipeline"}"#,
            r#"{"prompt": "a", "completion": "b"}"#,
        ],
    );
    config.tokenizer = Some(fixtures().join("llama3-tokenizer"));
    let data = StepData::new(config, 8, 0).unwrap();
    let docs = data.documents().unwrap();
    let (text_ids, _) = docs.document(0);
    assert_eq!(text_ids[0], bos);
    assert_eq!(*text_ids.last().unwrap(), tok.eos().id);
    let (_, targets) = docs.document(1);
    assert_eq!(targets, [false, false, true, true], "BOS a | b EOS");
}
