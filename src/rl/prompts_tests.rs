use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::*;
use crate::data::{DataConfig, Tokenizer, tokenizer};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data")
}

/// The default job on `file` (`tests/fixtures/data/rl.jsonl`: ten GSM8K-style records)
/// with the fixture tokenizer.
fn jsonl_job(file: &Path, prompts: usize) -> JobConfig {
    let mut job = JobConfig::default();
    job.model.vocab = 300;
    job.rl.prompts = prompts;
    job.data = DataConfig {
        source: DataSource::Jsonl,
        path: Some(file.to_path_buf()),
        tokenizer: Some(fixtures().join("tokenizer")),
        ..job.data
    };
    job
}

fn lines_of(source: &PromptSource, step: u64) -> Vec<u64> {
    source
        .prompts(step)
        .unwrap()
        .iter()
        .map(|p| match &p.check {
            Check::Answer { line, .. } => *line,
            Check::Task(_) => panic!("a task from a JSONL source"),
        })
        .collect()
}

#[test]
fn synthetic_prompts_are_the_tasks_after_bos() {
    let job = JobConfig::default();
    let source = PromptSource::from_job(&job).unwrap();
    assert_eq!(source.eos(), tokenizer::EOS);
    assert_eq!(source.records(), None);
    let tok = Tokenizer::new();
    for step in [0, 3] {
        let tasks = step_prompts(&job, step).unwrap();
        let prompts = source.prompts(step).unwrap();
        assert_eq!(prompts.len(), job.rl.prompts);
        for (p, t) in prompts.iter().zip(&tasks) {
            let mut ids = vec![tokenizer::BOS];
            tok.encode_into(&t.prompt, &mut ids).unwrap();
            assert_eq!(p.ids, ids);
            assert_eq!(p.check, Check::Task(t.clone()));
            // The task's worked solution scores 1, ended by EOS with garbage after it.
            let mut done = tok.encode(&t.solution).unwrap();
            done.push(tokenizer::EOS);
            done.extend(tok.encode("#999").unwrap());
            assert_eq!(source.score(p, &done).unwrap(), 1.0);
            assert_eq!(source.score(p, &tok.encode("#").unwrap()).unwrap(), 0.0);
        }
    }
}

#[test]
fn records_are_walked_once_per_epoch_in_a_seeded_order() {
    let job = jsonl_job(&fixtures().join("rl.jsonl"), 3);
    let source = PromptSource::from_job(&job).unwrap();
    assert_eq!(source.records(), Some(10));
    // Steps 0..10 take 30 prompts: three epochs of the ten records, each record once per
    // epoch (the epochs' boundaries fall inside steps 3 and 6).
    let taken: Vec<u64> = (0..10).flat_map(|s| lines_of(&source, s)).collect();
    for epoch in taken.chunks(10) {
        let mut seen: Vec<u64> = epoch.to_vec();
        seen.sort_unstable();
        assert_eq!(seen, (1..=10).collect::<Vec<u64>>(), "{taken:?}");
    }
    assert_ne!(taken[..10], taken[10..20], "every epoch in the same order");
    // A pure function of the job: again the same, another seed another order.
    let again = PromptSource::from_job(&job).unwrap();
    assert_eq!(lines_of(&again, 4), lines_of(&source, 4));
    let mut other = job.clone();
    other.rl.seed = 1;
    let other = PromptSource::from_job(&other).unwrap();
    let other_taken: Vec<u64> = (0..4).flat_map(|s| lines_of(&other, s)).collect();
    assert_ne!(other_taken, taken[..12]);
}

#[test]
fn prompts_are_encoded_as_the_warm_up_encodes_them_and_scored_by_rl_reward() {
    let mut job = jsonl_job(&fixtures().join("rl.jsonl"), 10);
    let source = PromptSource::from_job(&job).unwrap();
    let tok = job.data.text_tokenizer().unwrap();
    let records =
        crate::data::jsonl::read_records(job.data.path.as_ref().unwrap(), u64::MAX, 1 << 20)
            .unwrap();
    let by_line: BTreeMap<u64, (String, String)> = records
        .into_iter()
        .map(|l| match l.record {
            Record::Answer { prompt, answer } => (l.line, (prompt, answer)),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(source.eos(), tok.eos());
    for p in source.prompts(0).unwrap() {
        let Check::Answer { line, reward, .. } = &p.check else {
            panic!("{p:?}")
        };
        assert_eq!(*reward, Reward::Numeric);
        let (prompt, answer) = &by_line[line];
        assert_eq!(p.ids, tok.encode(prompt, true).unwrap());
        // The reference answer itself scores 1, up to EOS; a wrong number 0.
        let mut right = tok.encode(answer, false).unwrap();
        right.push(source.eos());
        right.extend(tok.encode("#### 1", false).unwrap());
        assert_eq!(source.score(&p, &right).unwrap(), 1.0, "{answer:?}");
        let wrong = tok.encode("#### 100000", false).unwrap();
        assert_eq!(source.score(&p, &wrong).unwrap(), 0.0);
    }
    // Exact: only the whole reference text.
    job.rl.reward = Reward::Exact;
    let exact = PromptSource::from_job(&job).unwrap();
    let p = &exact.prompts(0).unwrap()[0];
    let Check::Answer { line, .. } = &p.check else {
        panic!()
    };
    let answer = &by_line[line].1;
    let number = answer.rsplit("#### ").next().unwrap();
    let ids = tok.encode(&format!("#### {number}"), false).unwrap();
    assert_eq!(exact.score(p, &ids).unwrap(), 0.0);
    let ids = tok.encode(answer, false).unwrap();
    assert_eq!(exact.score(p, &ids).unwrap(), 1.0);
}

#[test]
fn long_prompts_are_left_out_and_bad_files_name_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mixed.jsonl");
    let long = "x ".repeat(200);
    std::fs::write(
        &file,
        format!(
            "{{\"prompt\": \"1 + 1?\", \"answer\": \"2\"}}\n{{\"prompt\": \"{long}\", \"answer\": \"3\"}}\n"
        ),
    )
    .unwrap();
    let job = jsonl_job(&file, 2);
    let source = PromptSource::from_job(&job).unwrap();
    assert_eq!(source.records(), Some(1));
    assert_eq!(lines_of(&source, 0), vec![1, 1]);

    // Nothing fits: one error naming the file and the limits.
    let mut tight = job.clone();
    tight.rl.max_new_tokens = tight.model.seq_len;
    let err = PromptSource::from_job(&tight).unwrap_err().to_string();
    assert!(
        err.contains("mixed.jsonl") && err.contains("rl.max_new_tokens"),
        "{err}"
    );

    // An SFT record is not a prompt with an answer: its line is named.
    std::fs::write(
        &file,
        "{\"prompt\": \"a\", \"answer\": \"b\"}\n\n{\"prompt\": \"a\", \"completion\": \"b\"}\n",
    )
    .unwrap();
    let err = PromptSource::from_job(&job).unwrap_err().to_string();
    assert!(
        err.contains("mixed.jsonl:3") && err.contains("`prompt` + `answer`"),
        "{err}"
    );

    // A prompt whose ids the model cannot embed.
    let mut small = jsonl_job(&fixtures().join("rl.jsonl"), 2);
    small.model.vocab = 60;
    let err = PromptSource::from_job(&small).unwrap_err().to_string();
    assert!(err.contains("model.vocab = 60"), "{err}");
}
