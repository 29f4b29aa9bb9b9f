//! Property tests over a Hugging Face model directory, as the frame decoder has: arbitrary
//! values in config.json's fields and arbitrary damage to a safetensors header never panic,
//! never allocate what the files do not back, and are either a model or one error line.

use std::path::Path;
use std::time::{Duration, Instant};

use pipefill::model::Cut;
use pipefill::model::hf::HfModel;
use pipefill::tensor::CpuBackend;
use proptest::prelude::*;
use serde_json::{Value, json};

mod common;

/// config.json fields that size or shape the model.
const FIELDS: [&str; 12] = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "head_dim",
    "sliding_window",
    "tie_word_embeddings",
];

/// Values a hostile or broken config.json may hold.
fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..70_000).prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![
            json!(0),
            json!(-1),
            json!(1e300),
            json!(0.5),
            json!(1_000_000_000),
            json!(u64::MAX),
            json!("x"),
            json!(null),
            json!(true),
            json!([]),
            json!({}),
        ]),
    ]
}

/// `dir` opened, and when it opens, built as a one-stage model (every tensor read); an
/// error is one line. Bounded in time: nothing a header or config says is worked through
/// before it is checked against the files.
fn open_or_one_line(dir: &Path) -> Result<(), String> {
    let start = Instant::now();
    let result = HfModel::open(dir).and_then(|m| {
        m.gpt::<CpuBackend>(CpuBackend::new(1).unwrap(), &Cut::Even(1))
            .map(|_| ())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    match result {
        Ok(()) => Ok(()),
        Err(e) => {
            let msg = e.to_string();
            assert_eq!(msg.lines().count(), 1, "{msg}");
            Err(msg)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn config_json_values_never_panic(
        picks in proptest::collection::vec((0..FIELDS.len(), value()), 1..=3),
    ) {
        let (_tmp, dir) = common::hf::copy("mistral");
        common::hf::edit_config(&dir, |config| {
            for (field, v) in &picks {
                config.insert(FIELDS[*field].into(), v.clone());
            }
        });
        let _ = open_or_one_line(&dir);
    }

    #[test]
    fn damaged_safetensors_headers_never_panic(
        length in prop::option::of(any::<u64>()),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let (_tmp, dir) = common::hf::copy("mistral");
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, byte) in &flips {
            bytes[8 + at.index(header)] = *byte;
        }
        if let Some(n) = length {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        if let Some(at) = cut {
            bytes.truncate(at.index(bytes.len()));
        }
        std::fs::write(&path, &bytes).unwrap();
        let opened = open_or_one_line(&dir);
        if flips.is_empty() && length.is_none() && cut.is_none() {
            prop_assert!(opened.is_ok(), "{:?}", opened);
        }
    }
}
