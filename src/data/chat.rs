//! Chat templates: tokenizer_config.json's `chat_template` rendered with `minijinja`, the way
//! transformers' `apply_chat_template` renders it with jinja2 (and Hugging Face's Rust
//! servers with minijinja): blocks trimmed (`trim_blocks`, `lstrip_blocks`), Python's
//! string and dict methods (`.strip()`, `.get()`, ...), `raise_exception(msg)` and a
//! `tojson` filter that writes what Python's `json.dumps(x, ensure_ascii=False)` writes.
//! The template sees `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.
//!
//! [`ChatTemplate::assistant_spans`] finds the text of each assistant turn (the SFT loss
//! mask of a conversation): the conversation up to a turn, rendered with a generation
//! prompt, must be a prefix of the conversation through that turn.
//!
//! A template is input from a model directory, so a render is bounded: it runs on
//! [`FUEL`] instructions, writes at most [`MAX_OUTPUT_FACTOR`] times its messages' size (plus
//! [`OUTPUT_SLACK`]), and a conversation has at most [`MAX_MESSAGES`] messages (finding the
//! assistant turns renders every prefix of it).

use std::io::Write;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use super::error::DataError;

/// Instructions one render may run: a real template spends tens per message, so this is a
/// conversation of hundreds of thousands of messages, and a few seconds at most.
pub const FUEL: u64 = 20_000_000;
/// A render writes at most this many times the JSON size of its messages...
pub const MAX_OUTPUT_FACTOR: usize = 4;
/// ... plus this much (a system prompt the template writes itself, role markers).
pub const OUTPUT_SLACK: usize = 64 << 10;
/// The most messages one conversation may have.
pub const MAX_MESSAGES: usize = 1024;

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

/// One message of a conversation: its role and content, and any other fields a template
/// may read (kept as JSON).
pub type Message = serde_json::Value;

fn template_error(e: Error) -> DataError {
    // minijinja's Display carries the kind and the detail; the source chain adds nothing.
    let mut reason = e.to_string();
    if let Some(detail) = e.detail()
        && !reason.contains(detail)
    {
        reason = format!("{reason}: {detail}");
    }
    DataError::Template { reason }
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `x | tojson` (and `tojson(indent=2)`), as Python's `json.dumps(x, ensure_ascii=False)`:
/// `", "` and `": "` between items (`","` at line ends with an indent), keys in the order
/// the value holds them.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Python's own keyword arguments that change nothing here.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    write_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                write_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A writer that refuses to grow past `cap` bytes, and remembers that it did (so the
/// caller can tell the cap from another write error).
struct Capped {
    bytes: Vec<u8>,
    cap: usize,
    over: bool,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is an error naming the line.
    pub fn new(source: &str) -> Result<Self, DataError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(template_error)?,
        );
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat_template", source.to_string())
            .map_err(template_error)?;
        Ok(Self { env: Arc::new(env) })
    }

    /// The text of `messages`, ending with the assistant's header when
    /// `add_generation_prompt`. `bos_token` / `eos_token` are the tokenizer's (empty if it
    /// has none). An error raised by the template (`raise_exception`) is its message.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, DataError> {
        if messages.len() > MAX_MESSAGES {
            return Err(DataError::Template {
                reason: format!(
                    "a conversation of {} messages is more than {MAX_MESSAGES}",
                    messages.len()
                ),
            });
        }
        let template = self
            .env
            .get_template("chat_template")
            .map_err(template_error)?;
        let size = serde_json::to_string(messages).map_or(0, |s| s.len());
        let cap = size
            .saturating_mul(MAX_OUTPUT_FACTOR)
            .saturating_add(OUTPUT_SLACK);
        let mut out = Capped {
            bytes: Vec::new(),
            cap,
            over: false,
        };
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            },
            &mut out,
        );
        match rendered {
            Ok(_) => {}
            Err(_) if out.over => {
                return Err(DataError::Template {
                    reason: format!(
                        "the chat template wrote more than {cap} bytes for {} messages of \
                         {size} bytes ({MAX_OUTPUT_FACTOR}x their size + {OUTPUT_SLACK})",
                        messages.len()
                    ),
                });
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(DataError::Template {
                    reason: format!(
                        "the chat template ran past its limit of {FUEL} instructions for {} \
                         messages",
                        messages.len()
                    ),
                });
            }
            Err(e) => return Err(template_error(e)),
        }
        String::from_utf8(out.bytes).map_err(|e| DataError::Template {
            reason: format!("the chat template wrote text that is not UTF-8: {e}"),
        })
    }

    /// The whole conversation's text and the byte range of each assistant turn in it: for
    /// the `i`-th message with role `assistant`, the text that rendering `messages[..=i]`
    /// adds to rendering `messages[..i]` with a generation prompt (its content and the
    /// template's end-of-turn marker). A template for which that is not a prefix is an
    /// error naming the message.
    pub fn assistant_spans(
        &self,
        messages: &[Message],
        bos_token: &str,
        eos_token: &str,
    ) -> Result<(String, Vec<(usize, usize)>), DataError> {
        let full = self.render(messages, false, bos_token, eos_token)?;
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.get("role").and_then(|r| r.as_str()) != Some("assistant") {
                continue;
            }
            let before = self.render(&messages[..i], true, bos_token, eos_token)?;
            let through = self.render(&messages[..=i], false, bos_token, eos_token)?;
            if !through.starts_with(&before) || !full.starts_with(&through) {
                return Err(DataError::Template {
                    reason: format!(
                        "the chat template does not render message {i} (assistant) as an \
                         extension of the messages before it with a generation prompt, so \
                         its tokens cannot be told apart for the loss"
                    ),
                });
            }
            if through.len() > before.len() {
                spans.push((before.len(), through.len()));
            }
        }
        Ok((full, spans))
    }
}
