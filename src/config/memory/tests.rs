use proptest::prelude::*;

use super::*;
use crate::schedules::{ScheduleKind, generate};

fn job(sets: &[&str]) -> Result<JobConfig, ConfigError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    JobConfig::embedded(&sets)
}

fn limit(text: &str) -> MemoryLimit {
    MemoryLimit::parse(text).unwrap()
}

/// The error's field, asserting it is one line.
fn field_of(err: ConfigError) -> String {
    let text = err.to_string();
    assert_eq!(text.lines().count(), 1, "{text}");
    match err {
        ConfigError::Invalid { field, .. } => field,
        other => panic!("expected an invalid field, got {other}"),
    }
}

#[test]
fn the_default_job_is_estimated_near_its_measured_peak() {
    // Measured: 98.0 MiB peak RSS for `pipefill train` of the default job (400 steps),
    // 74.8 MiB for 30 steps (docs/benchmarks.md, "Memory estimate calibration"): within
    // ±15% of the first. Those runs computed with the crates: what MKL adds where it
    // computes the products is measured and counted apart (`costs.rs`).
    let e = MemoryEstimate::of(&JobConfig::default(), Workload::Train).unwrap();
    let mkl = e
        .parts
        .iter()
        .find(|p| p.what == "MKL")
        .map_or(0, |p| p.bytes);
    assert_eq!(mkl > 0, crate::tensor::cpu::uses_mkl());
    assert!(
        (84 << 20..113 << 20).contains(&(e.total - mkl)),
        "{}",
        Bytes(e.total)
    );
    assert_eq!(e.total, e.parts.iter().map(|p| p.bytes).sum::<u64>());
    assert!(e.parts.windows(2).all(|w| w[0].bytes >= w[1].bytes));
    let rl = MemoryEstimate::of(&JobConfig::default(), Workload::Rl).unwrap();
    let params = |e: &MemoryEstimate| {
        let p = e.parts.iter().find(|p| p.what.starts_with("parameters"));
        p.unwrap().bytes
    };
    // The rollout engine's copy of the policy and the reference policy.
    assert!(params(&rl) > params(&e));
    assert!(rl.parts.iter().any(|p| p.what == "rollouts"));
}

#[test]
fn sizes_that_overflow_name_their_field() {
    for (set, field) in [
        ("model.d_model=4000000000", "model.d_model"),
        ("model.seq_len=9000000000000000000", "model.seq_len"),
        ("model.vocab=9000000000000000000", "model.vocab"),
        ("model.mlp_ratio=9000000000000000000", "model.mlp_ratio"),
        (
            "train.micro_batch_size=9000000000000000000",
            "train.micro_batch_size",
        ),
        ("train.eval_tasks=9000000000000000000", "train.eval_tasks"),
        ("train.steps=9000000000000000000", "train.steps"),
        (
            "data.summary_tasks=9000000000000000000",
            "data.summary_tasks",
        ),
    ] {
        let err = job(&[set]).unwrap_err();
        let text = err.to_string();
        assert_eq!(field_of(err), field, "{set}: {text}");
        assert!(
            text.contains("overflows 64-bit arithmetic"),
            "{set}: {text}"
        );
    }
}

#[test]
fn over_the_limit_is_one_line_naming_the_field_and_the_estimate() {
    let cases = [
        ("model.seq_len=1000000", "model.seq_len"),
        ("train.eval_tasks=100000000", "train.eval_tasks"),
        ("model.d_model=1000000", "model.d_model"),
        ("model.vocab=100000000", "model.vocab"),
        ("train.micro_batch_size=10000000", "train.micro_batch_size"),
    ];
    for (set, field) in cases {
        let job = job(&[set]).unwrap();
        let err = job
            .check_memory(Workload::Train, &limit("8GiB"), 1)
            .unwrap_err();
        let text = err.to_string();
        assert_eq!(field_of(err), field, "{set}: {text}");
        assert!(
            text.contains("the job needs an estimated")
                && text.contains("over the memory limit of 8.0 GiB (--max-memory)"),
            "{set}: {text}"
        );
    }
    // The same job fits a larger limit, and a launched rank checks its share only.
    let big = job(&["model.seq_len=4096"]).unwrap();
    let e = MemoryEstimate::of(&big, Workload::Train).unwrap();
    let just = MemoryLimit {
        bytes: e.total,
        source: LimitSource::Flag,
    };
    assert!(big.check_memory(Workload::Train, &just, 1).is_ok());
    let under = MemoryLimit {
        bytes: e.total - 1,
        ..just
    };
    assert!(big.check_memory(Workload::Train, &under, 1).is_err());
    assert!(big.check_memory(Workload::Train, &under, 4).is_ok());
}

#[test]
fn activations_follow_the_schedules_peak() {
    let acts = |schedule: &str| {
        let job = job(&[&format!("schedule={schedule:?}"), "train.micro_batches=16"]).unwrap();
        let e = MemoryEstimate::of(&job, Workload::Train).unwrap();
        e.parts
            .iter()
            .find(|p| p.what == "activations")
            .unwrap()
            .bytes
    };
    // GPipe holds all 16 micro-batches on every rank, 1F1B at most 4, the reference one.
    let (gpipe, one_f_one_b, none) = (acts("gpipe"), acts("1f1b"), acts("none"));
    assert!(gpipe > 2 * one_f_one_b, "{gpipe} vs {one_f_one_b}");
    assert!(one_f_one_b > none, "{one_f_one_b} vs {none}");
    // A schedule file is read for its peak: 1F1B's, written out, is 1F1B's.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("1f1b.csv");
    let plan = generate(ScheduleKind::OneFOneB, 4, 16, 1).unwrap();
    std::fs::write(&file, crate::schedules::to_csv(&plan)).unwrap();
    assert_eq!(acts(file.to_str().unwrap()), one_f_one_b);
    // Without reading it (validation), or when it is missing, GPipe's peak bounds it.
    let missing = job(&["schedule=\"plan.csv\"", "train.micro_batches=16"]).unwrap();
    let bounded = MemoryEstimate::bounded(&missing, Workload::Train).unwrap();
    let part = bounded
        .parts
        .iter()
        .find(|p| p.what == "activations")
        .unwrap();
    assert!(part.bytes >= gpipe, "{} vs {gpipe}", part.bytes);
    // A file that cannot be read or used is one line naming `schedule`, its text once.
    let err = MemoryEstimate::of(&missing, Workload::Train).unwrap_err();
    assert!(
        err.to_string().contains("plan.csv: cannot be read"),
        "{err}"
    );
    assert_eq!(field_of(err), "schedule");
    let garbage = dir.path().join("garbage.csv");
    std::fs::write(&garbage, "0F0,garbage\n").unwrap();
    let sets = [format!("schedule={:?}", garbage.to_str().unwrap())];
    let err = MemoryEstimate::of(&JobConfig::embedded(&sets).unwrap(), Workload::Train)
        .unwrap_err()
        .to_string();
    assert_eq!(err.matches("is not an action").count(), 1, "{err}");
}

#[test]
fn the_parameter_bound_covers_every_model_option() {
    // Options of the model section are set by name, so a missing one is skipped.
    let variants: [&[&str]; 6] = [
        &[],
        &["model.d_model=512", "model.heads=8"],
        &["model.activation=\"swiglu\""],
        &["model.qkv_bias=true", "model.kv_heads=2"],
        &["model.positions=\"rope\""],
        &["model.intermediate=1000", "model.seq_len=4096"],
    ];
    for sets in variants {
        let Ok(job) = job(sets) else { continue };
        let bound = param_bound(&job).unwrap().n;
        let exact = job.model.param_count() as u64;
        assert!(bound >= exact, "{sets:?}: {bound} < {exact}");
        assert!(bound <= 2 * exact, "{sets:?}: {bound} is far above {exact}");
    }
}

#[test]
fn the_parameter_count_is_checked() {
    use crate::model::GptConfig;
    let default = GptConfig::default();
    assert_eq!(default.checked_param_count(), Some(default.param_count()));
    assert_eq!(default.param_count(), 404_800);
    for big in [
        GptConfig {
            d_model: 4_000_000_000,
            ..GptConfig::default()
        },
        GptConfig {
            mlp_ratio: usize::MAX,
            ..GptConfig::default()
        },
        GptConfig {
            kv_heads: Some(usize::MAX),
            ..GptConfig::default()
        },
        GptConfig {
            heads: 0,
            ..GptConfig::default()
        },
    ] {
        assert_eq!(big.checked_param_count(), None, "{big:?}");
        assert_eq!(big.param_count(), usize::MAX);
    }
}

#[test]
fn a_vocabulary_smaller_than_the_tokenizers_is_refused_at_validation() {
    let err = job(&["model.vocab=5"]).unwrap_err();
    let text = err.to_string();
    assert_eq!(field_of(err), "model.vocab");
    assert!(text.contains("need at least 50"), "{text}");
    assert!(job(&["model.vocab=50"]).is_ok());
    assert_eq!(JobConfig::min_vocab(), 50);
}

#[test]
fn max_memory_parses_sizes_and_names_itself_when_it_cannot() {
    for (text, bytes) in [
        ("8GiB", 8u64 << 30),
        ("8G", 8 << 30),
        ("512MiB", 512 << 20),
        ("512 mib", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("2GB", 2_000_000_000),
        ("64kB", 64_000),
        ("1000", 1000),
        ("1000B", 1000),
        ("1TiB", 1 << 40),
    ] {
        let l = MemoryLimit::parse(text).unwrap();
        assert_eq!((l.bytes, l.source), (bytes, LimitSource::Flag), "{text}");
    }
    for (text, why) in [
        ("", "is not a size"),
        ("lots", "is not a size"),
        ("8XB", "is not a size"),
        ("-1GiB", "is not a size"),
        ("1.2.3G", "is not a size"),
        ("0", "at least 1 byte"),
        ("0.1", "at least 1 byte"),
        ("99999999999TiB", "larger than 2^64"),
    ] {
        let err = MemoryLimit::parse(text).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(why), "{text}: {msg}");
        assert_eq!(field_of(err), "--max-memory", "{text}");
    }
}

#[test]
fn the_machine_limit_is_memavailable_else_memtotal() {
    let both =
        "MemTotal:       24683584 kB\nMemFree:        22482948 kB\nMemAvailable:   24038920 kB\n";
    assert_eq!(
        MemoryLimit::from_meminfo(both),
        Some(MemoryLimit {
            bytes: 24038920 * 1024,
            source: LimitSource::Available
        })
    );
    assert_eq!(
        MemoryLimit::from_meminfo("MemTotal: 1000 kB\n"),
        Some(MemoryLimit {
            bytes: 1024000,
            source: LimitSource::Total
        })
    );
    assert_eq!(MemoryLimit::from_meminfo("Cached: 5 kB\n"), None);
    assert_eq!(
        MemoryLimit::from_meminfo("MemAvailable: 99999999999999999999 kB\nMemTotal: 4 kB"),
        Some(MemoryLimit {
            bytes: 4096,
            source: LimitSource::Total
        })
    );
}

#[test]
fn bytes_display_in_binary_units() {
    assert_eq!(Bytes(512).to_string(), "512 B");
    assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
    assert_eq!(Bytes(8 << 30).to_string(), "8.0 GiB");
    assert_eq!(Bytes(u64::MAX).to_string(), "16.0 EiB");
}

/// Every numeric field of the job file: those of the default job's TOML, and the optional
/// ones it leaves out (kept where this build has them).
fn numeric_fields() -> Vec<String> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
        for (key, value) in table {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            match value {
                toml::Value::Integer(_) | toml::Value::Float(_) => out.push(path),
                toml::Value::Table(t) => walk(&path, t, out),
                _ => {}
            }
        }
    }
    // With its optional tables present, so their fields are walked too.
    let doc: toml::Table = toml::from_str(&job(OPTIONAL_TABLES).unwrap().to_toml()).unwrap();
    let mut fields = Vec::new();
    walk("", &doc, &mut fields);
    for optional in [
        "model.intermediate",
        "model.kv_heads",
        "model.rope_theta",
        "rl.spec_threshold",
    ] {
        let known = job(&[&format!("{optional}=1")])
            .err()
            .is_none_or(|e| !e.to_string().contains("unknown field"));
        if known && !fields.iter().any(|f| f == optional) {
            fields.push(optional.to_string());
        }
    }
    fields
}

#[test]
fn the_numeric_fields_cover_every_section() {
    let fields = numeric_fields();
    for field in [
        "stages",
        "dp",
        "model.d_model",
        "model.seq_len",
        "train.eval_tasks",
        "data.max_size",
        "rl.max_new_tokens",
        "drafter.advanced.buffer_rows",
        "model.rope_scaling.factor",
        "model.rope_scaling.original_max_position_embeddings",
        "rl.draft_tree.nodes",
    ] {
        assert!(fields.iter().any(|f| f == field), "{field}: {fields:?}");
    }
}

/// Optional tables a job may have, each a `--set`: the Llama-3 rope scaling and draft trees.
const OPTIONAL_TABLES: &[&str] = &[
    "model.positions=\"rope\"",
    "model.rope_scaling={factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, \
     original_max_position_embeddings = 32}",
    "rl.draft_tree={}",
];

/// A `--set` value for a numeric field: boundary integers, arbitrary ones, and floats
/// (infinities and NaN included, in TOML's spelling).
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0i64..=8).prop_map(|v| v.to_string()),
        (0u32..=63).prop_map(|b| (1i64 << b).to_string()),
        (0u32..=62).prop_map(|b| ((1i64 << b) - 1).to_string()),
        Just(i64::MAX.to_string()),
        Just(i64::MIN.to_string()),
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| match v {
            v if v.is_nan() => "nan".to_string(),
            v if v.is_infinite() => if v > 0.0 { "inf" } else { "-inf" }.to_string(),
            v => format!("{v:e}"),
        }),
        (-1e3f64..1e9).prop_map(|v| format!("{v:e}")),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Arbitrary values for up to three numeric fields, through the path `--set` takes
    /// (parse, validate, estimate, check): never a panic, every error one line, and a job
    /// that passes the check is estimated within the limit.
    #[test]
    fn numeric_sets_never_panic_and_never_pass_over_the_limit(
        picks in proptest::collection::vec((any::<prop::sample::Index>(), value()), 1..=3),
        with_tables in any::<bool>(),
    ) {
        let fields = numeric_fields();
        // Half the jobs have the optional tables whose fields may be picked (without them a
        // pick of such a field is an error naming what is missing).
        let base = if with_tables { OPTIONAL_TABLES } else { &[] };
        let sets: Vec<String> = base
            .iter()
            .map(|s| s.to_string())
            .chain(
                picks
                    .iter()
                    .map(|(i, v)| format!("{}={v}", fields[i.index(fields.len())])),
            )
            .collect();
        let limit = MemoryLimit::parse("8GiB").unwrap();
        match JobConfig::embedded(&sets) {
            Err(e) => prop_assert_eq!(e.to_string().lines().count(), 1, "{:?}: {}", sets, e),
            Ok(job) => {
                for workload in [Workload::Train, Workload::Rl] {
                    if workload == Workload::Rl
                        && let Err(e) = job.rl.validate(job.model.seq_len)
                    {
                        prop_assert_eq!(e.to_string().lines().count(), 1, "{}", e);
                        continue;
                    }
                    match job.check_memory(workload, &limit, 1) {
                        Ok(e) => prop_assert!(e.total <= limit.bytes, "{:?}: {}", sets, e.total),
                        Err(e) => {
                            prop_assert_eq!(e.to_string().lines().count(), 1, "{}", e)
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_jsonl_dataset_and_its_tokenizer_are_counted_by_their_size() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data");
    let dir = tempfile::tempdir().unwrap();
    let data_bytes = |lines: usize| {
        let file = dir.path().join(format!("{lines}.jsonl"));
        std::fs::write(&file, "{\"text\": \"the quick brown fox\"}\n".repeat(lines)).unwrap();
        let sets = [
            "data.source=\"jsonl\"".to_string(),
            format!("data.path={:?}", file.display().to_string()),
            format!(
                "data.tokenizer={:?}",
                fixtures.join("tokenizer").display().to_string()
            ),
            "model.vocab=300".into(),
        ];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let e = MemoryEstimate::of(&job(&sets).unwrap(), Workload::Train).unwrap();
        (
            std::fs::metadata(&file).unwrap().len(),
            e.parts.iter().find(|p| p.what == "data").unwrap().bytes,
        )
    };
    let (small_file, small) = data_bytes(10);
    let (big_file, big) = data_bytes(100_000);
    // Each file is counted by its size, and the tokenizing of its longest possible line: the
    // whole small file, data.max_line_bytes of the big one.
    let max_line = crate::data::MAX_LINE_BYTES;
    assert!(small_file < max_line && big_file > max_line);
    assert_eq!(
        big - small,
        (big_file - small_file) * JSONL_BYTE_COST + (max_line - small_file) * TOKENIZE_BYTE_COST
    );
    // The tokenizer is counted too: the synthetic job's data part is smaller still.
    let tokenizer = std::fs::metadata(fixtures.join("tokenizer/tokenizer.json"))
        .unwrap()
        .len();
    let synthetic = MemoryEstimate::of(&job(&["model.vocab=300"]).unwrap(), Workload::Train)
        .unwrap()
        .parts
        .iter()
        .find(|p| p.what == "data")
        .unwrap()
        .bytes;
    assert!(
        small
            >= synthetic
                + tokenizer * TOKENIZER_BYTE_COST
                + small_file * (JSONL_BYTE_COST + TOKENIZE_BYTE_COST),
        "{small} vs {synthetic}"
    );
}

/// The activations part of `sets`' estimate.
fn activations_of(sets: &[&str]) -> u64 {
    let e = MemoryEstimate::of(&job(sets).unwrap(), Workload::Train).unwrap();
    e.parts
        .iter()
        .find(|p| p.what == "activations")
        .unwrap()
        .bytes
}

#[test]
fn recomputation_shrinks_the_activations_rank_by_rank() {
    // Sequences long enough that attention's probabilities weigh.
    let base = ["model.seq_len=256", "schedule=\"1f1b\""];
    let with = |mode: &str| {
        let set = format!("train.recompute={mode}");
        activations_of(&[base[0], base[1], set.as_str()])
    };
    let (none, selective, full) = (with("\"none\""), with("\"selective\""), with("\"full\""));
    assert_eq!(none, activations_of(&base), "none is the default");
    assert!(
        full < selective && selective < none,
        "{full} {selective} {none}"
    );
    // One rank of four recomputing saves a part of what all four save.
    let one = with("[\"full\", \"none\", \"none\", \"none\"]");
    assert!(full < one && one < none, "{full} {one} {none}");
    // A list needs one mode per rank, and a mode is one of three names.
    let err = job(&["train.recompute=[\"full\", \"none\"]"]).unwrap_err();
    assert_eq!(field_of(err), "train.recompute");
    let err = job(&["train.recompute=\"most\""]).unwrap_err().to_string();
    assert!(
        err.contains("recompute") && err.contains("\"selective\""),
        "{err}"
    );
}

#[test]
fn bf16_counts_the_master_weights_and_stashes_at_two_bytes() {
    let part = |sets: &[&str], what: &str| {
        let e = MemoryEstimate::of(&job(sets).unwrap(), Workload::Train).unwrap();
        e.parts.iter().find(|p| p.what == what).unwrap().bytes
    };
    let bf16 = "train.precision=\"bf16\"";
    // Per parameter of the default (pipelined) job: 16 bytes live in f32; in bf16 the
    // value's 2 bytes saved and the master's 4 added.
    let params = "parameters, gradients and optimizer state";
    let (f, b) = (part(&[], params), part(&[bf16], params));
    let bf16_live = LIVE_PARAM_BYTES + live_precision_bytes(crate::tensor::DType::Bf16);
    assert_eq!((LIVE_PARAM_BYTES, bf16_live), (16, 18));
    assert_eq!(b * 16, f * 18, "{f} against {b}");
    // The final checkpoint's host copies (where they outweigh the activations): 8 bytes a
    // parameter beyond the live state in f32, 12 in bf16 (the master's 4).
    let copies = "the final checkpoint's copies";
    let wide = ["model.d_model=1024", "model.heads=8", "filler=\"none\""];
    let (f, b) = (
        part(&wide, copies),
        part(&[&wide[..], &[bf16]].concat(), copies),
    );
    let bf16_copy = final_copy_bytes(true) + copy_precision_bytes(crate::tensor::DType::Bf16);
    assert_eq!((final_copy_bytes(true), bf16_copy), (8, 12));
    assert_eq!(b * 8, f * 12, "{f} against {b}");
    // The stash is half; the working sets and the head's f32 `dW` are not.
    for seq in ["model.seq_len=64", "model.seq_len=512"] {
        let (f, b) = (
            part(&[seq], "activations"),
            part(&[seq, bf16], "activations"),
        );
        assert!(b < f && 2 * b > f, "{seq}: {f} against {b}");
    }
    // Sharded (ZeRO-1), the master weights are divided with the moments.
    let zero = ["dp=2", "optimizer.shard=true"];
    let (f, b) = (
        part(&zero, params),
        part(&[&zero[..], &[bf16]].concat(), params),
    );
    let p = f / (2 * LIVE_PARAM_BYTES - MOMENT_BYTES);
    assert_eq!(b, p * (2 * bf16_live - MOMENT_BYTES - MASTER_BYTES));
}
