//! Tests of the data module as a whole: determinism, checkers, tokenizer, long tail, batches.

use super::*;

fn sample(seed: u64, n: usize) -> Vec<Task> {
    TaskGenerator::new(&TaskFamily::ALL, 1.5, 24, SplitMix64::new(seed))
        .unwrap()
        .take(n)
        .collect()
}

#[test]
fn same_seed_same_tasks_other_seed_other_tasks() {
    assert_eq!(sample(42, 300), sample(42, 300));
    assert_ne!(sample(42, 300), sample(43, 300));
    let data = StepData::new(DataConfig::default(), 64, 9).unwrap();
    assert_eq!(data.micro_batches(5, 2, 3), data.micro_batches(5, 2, 3));
    assert_ne!(data.micro_batches(5, 2, 3), data.micro_batches(6, 2, 3));
}

#[test]
fn worked_examples_have_the_documented_form() {
    let mut rng = SplitMix64::new(1);
    let t = TaskFamily::Addition.generate(3, &mut rng);
    let (a, b) = t.prompt["add ".len()..t.prompt.len() - 1]
        .split_once('+')
        .unwrap();
    let sum: u128 = a.parse::<u128>().unwrap() + b.parse::<u128>().unwrap();
    assert_eq!(t.answer, sum.to_string());
    let t = TaskFamily::Sorting.generate(4, &mut rng);
    let mut xs: Vec<u32> = t.prompt["sort ".len()..t.prompt.len() - 1]
        .split(',')
        .map(|x| x.parse().unwrap())
        .collect();
    assert_eq!(xs.len(), 5);
    xs.sort();
    assert_eq!(
        t.answer,
        xs.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    let t = TaskFamily::Parity.generate(3, &mut rng);
    let ones = t.prompt.chars().filter(|&c| c == '1').count();
    assert_eq!(t.answer, (ones % 2).to_string());
    let t = TaskFamily::Counting.generate(5, &mut rng);
    let digits = t.prompt.trim_end().rsplit(' ').next().unwrap();
    let target = t.prompt.chars().nth("count ".len()).unwrap();
    assert_eq!(
        t.answer,
        digits.chars().filter(|&c| c == target).count().to_string()
    );
}

#[test]
fn every_solution_passes_its_checker_and_wrong_answers_fail() {
    for t in sample(7, 2000) {
        assert!(t.check(&t.solution), "{t:?}");
        assert!(t.solution.ends_with(&format!("#{}", t.answer)));
        assert!(!t.check(&format!("{}#{}1", t.solution, t.answer)));
        assert!(!t.check(&t.solution.replace('#', "")));
        assert!(!t.check("#"));
        // A model that appends junk after the answer line still gets credit;
        // one that changes the answer does not.
        assert!(t.check(&format!("{}\nxyz", t.solution)));
        let wrong = if t.answer == "0" { "1" } else { "0" };
        assert!(!t.check(&format!("#{wrong}")));
    }
}

#[test]
fn tokenizer_round_trips_and_names_unknown_chars() {
    let tok = Tokenizer::new();
    for t in sample(3, 500) {
        let text = t.text();
        let ids = tok.encode(&text).unwrap();
        assert_eq!(ids.len(), text.chars().count());
        assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let doc = tok.encode_document(&text).unwrap();
        assert_eq!(doc.first(), Some(&tokenizer::BOS));
        assert_eq!(doc.last(), Some(&tokenizer::EOS));
    }
    let err = tok.encode("add 1+X").unwrap_err().to_string();
    assert!(err.contains("'X'") && err.contains("position 6"), "{err}");
    let err = tok.decode(&[5, 999]).unwrap_err().to_string();
    assert!(err.contains("999") && err.contains("position 1"), "{err}");
    assert!(tok.vocab_size() < 64);
    // The model's default vocabulary (`GptConfig::default().vocab`) is sized for this.
    assert_eq!(tok.vocab_size(), 50);
}

/// The summary of the default data of stream `seed`.
fn default_summary(seed: u64) -> DatasetSummary {
    DatasetSummary::of(&StepData::new(DataConfig::default(), 1, seed).unwrap()).unwrap()
}

#[test]
fn solution_lengths_are_long_tailed() {
    let s = default_summary(11);
    assert_eq!(s.tasks, DataConfig::default().summary_tasks);
    assert_eq!(s.per_family.len(), 4);
    assert!(s.p99 >= 3 * s.median, "median {}, p99 {}", s.median, s.p99);
    assert!(s.max >= s.p99 && s.p99 >= s.p90 && s.p90 >= s.median);
    assert_eq!(s.histogram.iter().map(|b| b.2).sum::<usize>(), s.tasks);
    let text = s.to_string();
    assert!(text.contains("p99") && text.contains('#'), "{text}");
}

#[test]
fn batches_have_the_right_shape_and_shifted_targets() {
    let data = StepData::new(DataConfig::default(), 16, 1).unwrap();
    let mbs = data.micro_batches(0, 3, 2);
    assert_eq!(mbs.len(), 3);
    for mb in &mbs {
        assert_eq!((mb.rows, mb.seq_len), (2, 16));
        assert_eq!(mb.inputs.len(), 32);
        assert_eq!(mb.targets.len(), 32);
        for r in 0..2 {
            let row = r * 16;
            assert_eq!(mb.inputs[row + 1..row + 16], mb.targets[row..row + 15]);
        }
    }
    // The same rows whether the batch is cut into 3×2 or 1×6 micro-batches.
    let whole = data.micro_batches(0, 1, 6);
    let joined: Vec<u32> = mbs.iter().flat_map(|m| m.inputs.clone()).collect();
    assert_eq!(whole[0].inputs, joined);
    assert_eq!(data.windows(0, 6).len(), 6 * 17);
}

#[test]
fn invalid_config_names_the_field() {
    let bad = DataConfig {
        families: vec![],
        ..DataConfig::default()
    };
    assert!(
        StepData::new(bad, 16, 0)
            .unwrap_err()
            .to_string()
            .contains("data.families")
    );
    let bad = DataConfig {
        size_scale: -1.0,
        ..DataConfig::default()
    };
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("data.size_scale")
    );
    assert!(
        "sudoku"
            .parse::<TaskFamily>()
            .unwrap_err()
            .to_string()
            .contains("sudoku")
    );
}

#[test]
fn streams_are_pinned_across_platforms_and_versions() {
    // Golden values: a change here means every seed now gives different data, which
    // breaks reproducing old runs. Only division, floor and integer arithmetic feed them.
    let mut g = TaskGenerator::new(&TaskFamily::ALL, 1.5, 24, SplitMix64::new(3)).unwrap();
    assert_eq!(g.next_task().text(), "sort 29,47\n29|47\n47|\n#29,47");
    assert_eq!(g.next_task().text(), "count 2 in 02\n0:0 2:1\n#1");
    let s = default_summary(0);
    assert_eq!((s.median, s.p90, s.p99, s.max), (18, 90, 353, 1051));
}
