//! JSONL datasets: one JSON object per line, in one of four forms.
//!
//! - `{"text": ...}`: pretraining text; every token is a target.
//! - `{"prompt": ..., "completion": ...}`: SFT; only the completion's tokens are targets.
//! - `{"messages": [{"role": ..., "content": ...}, ...]}`: chat SFT, rendered with the
//!   tokenizer's chat template; only the assistant turns' tokens are targets.
//! - `{"prompt": ..., "answer": ...}`: a prompt with a reference answer, for RL rewards
//!   ([`super::reward`]); in training the answer is the completion.
//!
//! Other keys are ignored. Blank lines are skipped. The file's size is checked from its
//! metadata before it is read, each line is read at most `max_line_bytes` (+1) bytes at a
//! time, and a line that is too long, not UTF-8, not JSON or of no known form is one error
//! naming the file and the line number.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::chat::Message;
use super::error::DataError;

/// One record of a JSONL file.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Text(String),
    Completion { prompt: String, completion: String },
    Chat(Vec<Message>),
    Answer { prompt: String, answer: String },
}

/// A record and the line it came from (1-based).
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub line: u64,
    pub record: Record,
}

fn string_field(
    obj: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Option<String>, String> {
    match obj.get(key) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("`{key}` must be a string, not {}", kind(other))),
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Parses one line's text (see the module docs); the error is the reason only.
pub fn parse_record(text: &str) -> Result<Record, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let serde_json::Value::Object(obj) = value else {
        return Err(format!(
            "a record must be a JSON object, not {}",
            kind(&value)
        ));
    };
    if let Some(messages) = obj.get("messages") {
        let serde_json::Value::Array(list) = messages else {
            return Err(format!(
                "`messages` must be an array, not {}",
                kind(messages)
            ));
        };
        if list.is_empty() {
            return Err("`messages` is empty".into());
        }
        for (i, m) in list.iter().enumerate() {
            let serde_json::Value::Object(m) = m else {
                return Err(format!("messages[{i}] must be an object, not {}", kind(m)));
            };
            for key in ["role", "content"] {
                match m.get(key) {
                    Some(serde_json::Value::String(_)) => {}
                    Some(other) => {
                        return Err(format!(
                            "messages[{i}].{key} must be a string, not {}",
                            kind(other)
                        ));
                    }
                    None => return Err(format!("messages[{i}] has no `{key}`")),
                }
            }
        }
        return Ok(Record::Chat(list.clone()));
    }
    if let Some(text) = string_field(&obj, "text")? {
        return Ok(Record::Text(text));
    }
    if let Some(prompt) = string_field(&obj, "prompt")? {
        if let Some(completion) = string_field(&obj, "completion")? {
            return Ok(Record::Completion { prompt, completion });
        }
        if let Some(answer) = string_field(&obj, "answer")? {
            return Ok(Record::Answer { prompt, answer });
        }
        return Err("a record with `prompt` needs `completion` (SFT) or `answer` (RL)".into());
    }
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).take(8).collect();
    keys.sort_unstable();
    Err(format!(
        "a record needs `text`, `prompt` with `completion` or `answer`, or `messages` \
         (its keys: {keys:?})"
    ))
}

/// The records of the JSONL file `path`. The file is at most `max_bytes` long (checked
/// before reading), a line at most `max_line_bytes`.
pub fn read_records(
    path: &Path,
    max_bytes: u64,
    max_line_bytes: u64,
) -> Result<Vec<Line>, DataError> {
    let (file, len) = crate::input::open(path)?;
    if len > max_bytes {
        return Err(DataError::File {
            path: path.to_path_buf(),
            reason: format!("is {len} bytes, over data.max_file_bytes = {max_bytes}"),
        });
    }
    read_lines(BufReader::new(file), path, max_line_bytes)
}

/// The records of `reader` (named `path` in errors), each line at most `max_line_bytes`.
pub fn read_lines<R: BufRead>(
    mut reader: R,
    path: &Path,
    max_line_bytes: u64,
) -> Result<Vec<Line>, DataError> {
    let at = |line: u64, reason: String| DataError::Line {
        path: path.to_path_buf(),
        line,
        reason,
    };
    let mut records = Vec::new();
    let mut buf = Vec::new();
    for line in 1u64.. {
        buf.clear();
        let n = (&mut reader)
            .take(max_line_bytes.saturating_add(1))
            .read_until(b'\n', &mut buf)
            .map_err(|error| DataError::Io {
                path: path.to_path_buf(),
                error,
            })?;
        if n == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        }
        if buf.len() as u64 > max_line_bytes {
            return Err(at(
                line,
                format!("line is longer than data.max_line_bytes = {max_line_bytes}"),
            ));
        }
        let mut text =
            std::str::from_utf8(&buf).map_err(|e| at(line, format!("not UTF-8: {e}")))?;
        if line == 1 {
            text = text.strip_prefix('\u{feff}').unwrap_or(text);
        }
        if text.trim().is_empty() {
            continue;
        }
        let record = parse_record(text).map_err(|reason| at(line, reason))?;
        records.push(Line { line, record });
    }
    Ok(records)
}
