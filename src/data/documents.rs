//! [`Documents`]: a JSONL dataset tokenized once, each document a run of ids with a flag per
//! id saying whether it is a training target (the SFT loss mask).
//!
//! - `text`: the tokenizer's encoding with its special tokens (a Llama 3 BOS), then EOS;
//!   every id is a target.
//! - `prompt` + `completion` (or `answer`): `prompt + completion` encoded as one text, then
//!   EOS; an id is a target when its text overlaps the completion (so a token that joins the
//!   prompt's last space to the completion's first word counts), EOS too.
//! - `messages`: the chat template's text (encoded without added special tokens, as
//!   transformers' `apply_chat_template` does); an id is a target when its text overlaps an
//!   assistant turn (the turn's end-of-turn marker included, see
//!   [`super::chat::ChatTemplate::assistant_spans`]).
//!
//! A record that cannot be tokenized is an error naming the file and line.

use std::path::{Path, PathBuf};

use super::error::DataError;
use super::jsonl::{Line, Record};
use super::text_tokenizer::TextTokenizer;

/// Every document's ids and target flags, concatenated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    ids: Vec<u32>,
    targets: Vec<bool>,
    /// `starts[d]..starts[d + 1]` is document `d`'s range (`docs + 1` entries).
    starts: Vec<usize>,
}

/// How far [`Documents::build`] got: records tokenized so far of all of them, and the ids
/// they gave. Reported every [`PROGRESS_EVERY`] records and once at the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokenized {
    pub records: usize,
    pub of: usize,
    pub tokens: usize,
}

/// Records between two progress reports (a report costs a callback, not a syscall).
pub const PROGRESS_EVERY: usize = 1024;

/// Whether byte range `(a, b)` of a token overlaps `[lo, hi)`.
fn overlaps((a, b): (usize, usize), lo: usize, hi: usize) -> bool {
    b > lo && a < hi && b > a
}

impl Documents {
    /// Tokenizes `lines` (read from `path`, which errors name) with `tokenizer`, telling
    /// `progress` how far it got.
    pub fn build(
        lines: &[Line],
        path: &Path,
        tokenizer: &TextTokenizer,
        progress: &mut dyn FnMut(Tokenized),
    ) -> Result<Self, DataError> {
        let mut docs = Documents {
            ids: Vec::new(),
            targets: Vec::new(),
            starts: vec![0],
        };
        let eos = tokenizer.eos();
        let at = |line: u64, e: DataError| DataError::Line {
            path: PathBuf::from(path),
            line,
            reason: e.to_string(),
        };
        for (done, Line { line, record }) in lines.iter().enumerate() {
            if done % PROGRESS_EVERY == 0 && done > 0 {
                progress(Tokenized {
                    records: done,
                    of: lines.len(),
                    tokens: docs.ids.len(),
                });
            }
            let (ids, targets): (Vec<u32>, Vec<bool>) = match record {
                Record::Text(text) => {
                    let ids = tokenizer.encode(text, true).map_err(|e| at(*line, e))?;
                    let n = ids.len();
                    (ids, vec![true; n])
                }
                Record::Completion { prompt, completion }
                | Record::Answer {
                    prompt,
                    answer: completion,
                } => {
                    let text = format!("{prompt}{completion}");
                    let (ids, offsets) = tokenizer
                        .encode_with_offsets(&text, true)
                        .map_err(|e| at(*line, e))?;
                    let targets = offsets
                        .iter()
                        .map(|&o| overlaps(o, prompt.len(), text.len()))
                        .collect();
                    (ids, targets)
                }
                Record::Chat(messages) => {
                    let template = tokenizer.chat_template().ok_or_else(|| DataError::Line {
                        path: PathBuf::from(path),
                        line: *line,
                        reason: "a `messages` record needs a tokenizer with a chat_template \
                                 (tokenizer_config.json)"
                            .into(),
                    })?;
                    let (bos, eos) = tokenizer.special_texts();
                    let (text, spans) = template
                        .assistant_spans(messages, &bos, &eos)
                        .map_err(|e| at(*line, e))?;
                    let (ids, offsets) = tokenizer
                        .encode_with_offsets(&text, false)
                        .map_err(|e| at(*line, e))?;
                    if ids.is_empty() {
                        return Err(at(
                            *line,
                            DataError::Template {
                                reason: format!(
                                    "it renders this record's {} messages as no tokens",
                                    messages.len()
                                ),
                            },
                        ));
                    }
                    let targets = offsets
                        .iter()
                        .map(|&o| spans.iter().any(|&(lo, hi)| overlaps(o, lo, hi)))
                        .collect();
                    (ids, targets)
                }
            };
            docs.ids.extend_from_slice(&ids);
            docs.targets.extend_from_slice(&targets);
            if !matches!(record, Record::Chat(_)) {
                docs.ids.push(eos);
                docs.targets.push(true);
            }
            docs.starts.push(docs.ids.len());
        }
        progress(Tokenized {
            records: lines.len(),
            of: lines.len(),
            tokens: docs.ids.len(),
        });
        // Every document has at least one id; an empty file is refused by the caller.
        docs.starts.dedup();
        Ok(docs)
    }

    /// Number of (non-empty) documents.
    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total ids of all documents.
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Document `d`'s ids and target flags.
    pub fn document(&self, d: usize) -> (&[u32], &[bool]) {
        let r = self.starts[d]..self.starts[d + 1];
        (&self.ids[r.clone()], &self.targets[r])
    }

    /// Each document's length in ids.
    pub fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.starts.windows(2).map(|w| w[1] - w[0])
    }

    /// The largest id of any document (`None` if there are none).
    pub fn max_id(&self) -> Option<u32> {
        self.ids.iter().copied().max()
    }
}
