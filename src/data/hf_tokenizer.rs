//! A Hugging Face tokenizer: `tokenizer.json` read with the `tokenizers` crate, its special
//! tokens (bos / eos / pad) from `tokenizer_config.json` beside it, and its chat template
//! from `chat_template.jinja` beside it or, without that file, from tokenizer_config.json's
//! `chat_template` field.
//!
//! The template's precedence is transformers' (4.47 and later, `PreTrainedTokenizerBase.
//! _from_pretrained`): a `chat_template.jinja` is the "default" template and replaces the
//! config's field; transformers 5.x saves the template only there. The field is a string,
//! or a list of named templates (`{"name", "template"}`) of which the one named "default"
//! is used, as `apply_chat_template` does when no template is named.
//!
//! [`HfTokenizer::load`] takes a `tokenizer.json` file or a model directory holding one.
//! Every file is input, read by [`crate::input::read`] (a regular file, its size checked
//! before a byte is read), and a file that is not valid is one error naming it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::chat::ChatTemplate;
use super::error::DataError;
use crate::input;

/// Largest `tokenizer.json` read (Llama 3's is 9 MB, Qwen2's 7 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Largest `tokenizer_config.json` / `special_tokens_map.json` read.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// The file transformers saves a tokenizer's chat template to, beside tokenizer_config.json.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Largest `chat_template.jinja` read (real ones are a few KB; the longest, with tool
/// calling and reasoning, tens of KB).
pub const MAX_CHAT_TEMPLATE_BYTES: u64 = 4 << 20;

/// Ids and each one's byte range in the encoded text.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// A tokenizer.json with its special tokens and chat template.
#[derive(Clone)]
pub struct HfTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: PathBuf,
    vocab_size: usize,
    bos: Option<SpecialToken>,
    eos: SpecialToken,
    pad: Option<SpecialToken>,
    template: Option<ChatTemplate>,
}

/// A special token's text and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    pub text: String,
    pub id: u32,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("chat_template", &self.template.is_some())
            .finish()
    }
}

/// A special token entry of tokenizer_config.json: a string, or an AddedToken object.
fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl HfTokenizer {
    /// Reads `path`: a tokenizer.json, or a directory with one. tokenizer_config.json (and,
    /// for missing special tokens, special_tokens_map.json) beside it give bos, eos, pad and
    /// the chat template; without an eos token there, the first of `</s>`,
    /// `<|endoftext|>`, `<|end_of_text|>`, `<|im_end|>` in the vocabulary is used.
    pub fn load(path: &Path) -> Result<Self, DataError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
        let bytes = input::read(&file, MAX_TOKENIZER_BYTES, "a tokenizer.json")?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
                path: file.clone(),
                reason: e.to_string(),
            })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let map = read_json(&dir.join("special_tokens_map.json"))?;
        let field = |name: &str| {
            [&config, &map]
                .into_iter()
                .flatten()
                .find_map(|c| c.get(name).and_then(token_text))
        };
        let special = |name: &'static str, text: String| -> Result<SpecialToken, DataError> {
            let id = inner
                .token_to_id(&text)
                .ok_or_else(|| DataError::Tokenizer {
                    path: file.clone(),
                    reason: format!("{name} {text:?} is not in the vocabulary"),
                })?;
            Ok(SpecialToken { text, id })
        };
        let bos = field("bos_token")
            .map(|t| special("bos_token", t))
            .transpose()?;
        let pad = field("pad_token")
            .map(|t| special("pad_token", t))
            .transpose()?;
        let eos = match field("eos_token") {
            Some(t) => special("eos_token", t)?,
            None => ["</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>"]
                .into_iter()
                .find_map(|t| {
                    inner.token_to_id(t).map(|id| SpecialToken {
                        text: t.to_string(),
                        id,
                    })
                })
                .ok_or_else(|| DataError::Tokenizer {
                    path: file.clone(),
                    reason: "no eos_token in tokenizer_config.json and none of </s>, \
                             <|endoftext|>, <|end_of_text|>, <|im_end|> in the vocabulary"
                        .into(),
                })?,
        };
        let template = chat_template(&dir, config.as_ref())?;
        Ok(Self {
            inner: Arc::new(inner),
            path: file,
            vocab_size,
            bos,
            eos,
            pad,
            template,
        })
    }

    /// The tokenizer.json this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more than the largest id (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos(&self) -> Option<&SpecialToken> {
        self.bos.as_ref()
    }

    pub fn eos(&self) -> &SpecialToken {
        &self.eos
    }

    pub fn pad(&self) -> Option<&SpecialToken> {
        self.pad.as_ref()
    }

    /// The chat template (chat_template.jinja, else tokenizer_config.json's), if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The ids of `text` and each one's byte range in it (added special tokens such as a
    /// post-processor's BOS have an empty range at 0). `add_special_tokens` runs the
    /// tokenizer's post-processor (a Llama 3 BOS), as `tokenizer(text)` does in Python.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Encoded, DataError> {
        let enc =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| DataError::Tokenizer {
                    path: self.path.clone(),
                    reason: format!("encoding failed: {e}"),
                })?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The ids of `text` (see [`encode_with_offsets`](Self::encode_with_offsets)).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_with_offsets(text, add_special_tokens)?.0)
    }

    /// The text of `ids`; special tokens are dropped when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, DataError> {
        if let Some((position, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= self.vocab_size)
        {
            return Err(DataError::UnknownToken {
                id,
                position,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| DataError::Tokenizer {
                path: self.path.clone(),
                reason: format!("decoding failed: {e}"),
            })
    }
}

/// The chat template of the tokenizer in `dir` whose tokenizer_config.json is `config`:
/// `chat_template.jinja` when it exists, else the config's `chat_template` (a string, or
/// the template named "default" of a list). A template that does not compile is an error
/// naming the file it came from.
fn chat_template(
    dir: &Path,
    config: Option<&serde_json::Value>,
) -> Result<Option<ChatTemplate>, DataError> {
    let compile = |path: PathBuf, source: &str| {
        ChatTemplate::new(source).map_err(|e| DataError::Tokenizer {
            path,
            reason: match e {
                DataError::Template { reason } => format!("its chat template: {reason}"),
                e => e.to_string(),
            },
        })
    };
    let jinja = dir.join(CHAT_TEMPLATE_FILE);
    if jinja.exists() {
        let source = input::read_text(&jinja, MAX_CHAT_TEMPLATE_BYTES, "a chat template")?;
        return compile(jinja, &source).map(Some);
    }
    let path = dir.join("tokenizer_config.json");
    match config.and_then(|c| c.get("chat_template")) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(source)) => compile(path, source).map(Some),
        // A list of named templates ({"name", "template"}): the "default" one.
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(|source| compile(path.clone(), source))
            .transpose(),
        Some(_) => Err(DataError::Tokenizer {
            path,
            reason: "chat_template is neither a string nor a list of templates".into(),
        }),
    }
}

/// A JSON object file, `None` if it does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>, DataError> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = input::read(path, MAX_CONFIG_BYTES, "a tokenizer config")?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| DataError::Tokenizer {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
    if !value.is_object() {
        return Err(DataError::Tokenizer {
            path: path.to_path_buf(),
            reason: "is not a JSON object".into(),
        });
    }
    Ok(Some(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::chat::Message;
    use crate::data::{DataConfig, DataSource, StepData};
    use crate::tensor::IGNORE_TARGET;

    const USER: &str = r#"{"role": "user", "content": "add 12 and 30"}"#;
    const CHAT: &str = r#"{"messages": [{"role": "user", "content": "add 12 and 30"}, {"role": "assistant", "content": "42"}]}"#;

    /// A directory with the data fixture's tokenizer.json, `config` as its
    /// tokenizer_config.json (none when `None`) and `jinja` as its chat_template.jinja.
    fn tokenizer_dir(config: Option<serde_json::Value>, jinja: Option<&str>) -> tempfile::TempDir {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data/tokenizer");
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            fixture.join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        if let Some(c) = config {
            std::fs::write(dir.path().join("tokenizer_config.json"), c.to_string()).unwrap();
        }
        if let Some(j) = jinja {
            std::fs::write(dir.path().join(CHAT_TEMPLATE_FILE), j).unwrap();
        }
        dir
    }

    /// The fixture's tokenizer_config.json, its `chat_template` moved out: (the config
    /// without it, the template).
    fn fixture_config() -> (serde_json::Value, String) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/data/tokenizer/tokenizer_config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let template = config
            .as_object_mut()
            .unwrap()
            .remove("chat_template")
            .unwrap();
        (config, template.as_str().unwrap().to_string())
    }

    fn render(t: &HfTokenizer) -> String {
        let user: Message = serde_json::from_str(USER).unwrap();
        t.chat_template()
            .expect("a chat template")
            .render(&[user], true, "", &t.eos().text)
            .unwrap()
    }

    /// transformers 5.x's layout: the template only in chat_template.jinja. It is the
    /// tokenizer's template, renders as the config's field did, and a `messages` record
    /// trains with its loss on the assistant's turn.
    #[test]
    fn a_chat_template_jinja_file_is_the_template() {
        let (config, template) = fixture_config();
        let field = tokenizer_dir(Some(fixture_config_with(&template)), None);
        let file = tokenizer_dir(Some(config.clone()), Some(&template));
        let none = tokenizer_dir(Some(config), None);
        let from_field = HfTokenizer::load(field.path()).unwrap();
        let from_file = HfTokenizer::load(file.path()).unwrap();
        assert!(
            HfTokenizer::load(none.path())
                .unwrap()
                .chat_template()
                .is_none()
        );
        assert_eq!(render(&from_file), render(&from_field));
        assert!(render(&from_file).ends_with("<|im_start|>assistant\n"));

        let data = file.path().join("d.jsonl");
        std::fs::write(&data, CHAT).unwrap();
        let config = DataConfig {
            source: DataSource::Jsonl,
            path: Some(data),
            tokenizer: Some(file.path().to_path_buf()),
            ..DataConfig::default()
        };
        // One row of the whole conversation: its tokens but the last as inputs.
        let messages = serde_json::from_str::<serde_json::Value>(CHAT).unwrap()["messages"]
            .as_array()
            .unwrap()
            .clone();
        let text = from_file
            .chat_template()
            .unwrap()
            .render(&messages, false, "", &from_file.eos().text)
            .unwrap();
        let n = from_file.encode(&text, false).unwrap().len();
        let steps = StepData::new(config, n - 1, 0).unwrap();
        let mb = &steps.micro_batches(0, 1, 1)[0];
        let counted: Vec<u32> = mb
            .targets
            .iter()
            .copied()
            .filter(|&t| t != IGNORE_TARGET)
            .collect();
        assert_eq!(from_file.decode(&counted, true).unwrap(), "42\n");
    }

    fn fixture_config_with(template: &str) -> serde_json::Value {
        let (mut config, _) = fixture_config();
        config["chat_template"] = template.into();
        config
    }

    /// As in transformers, chat_template.jinja wins over the config's field; a list of
    /// named templates gives its "default" one (none without it).
    #[test]
    fn the_jinja_file_takes_precedence_and_a_list_gives_its_default() {
        let both = tokenizer_dir(
            Some(fixture_config_with("from the config")),
            Some("from the file{{ messages | length }}"),
        );
        assert_eq!(
            render(&HfTokenizer::load(both.path()).unwrap()),
            "from the file1"
        );
        let named = |names: &[&str]| {
            let list: Vec<_> = names
                .iter()
                .map(|n| serde_json::json!({"name": n, "template": format!("{n} template")}))
                .collect();
            let (mut config, _) = fixture_config();
            config["chat_template"] = list.into();
            tokenizer_dir(Some(config), None)
        };
        let dir = named(&["tool_use", "default"]);
        assert_eq!(
            render(&HfTokenizer::load(dir.path()).unwrap()),
            "default template"
        );
        let dir = named(&["tool_use"]);
        assert!(
            HfTokenizer::load(dir.path())
                .unwrap()
                .chat_template()
                .is_none()
        );
        // Without any tokenizer_config.json, the file still is the template.
        let bare = tokenizer_dir(None, Some("bare"));
        assert_eq!(render(&HfTokenizer::load(bare.path()).unwrap()), "bare");
    }

    /// A template file that does not compile, is not a regular file or is too big is one
    /// error naming it.
    #[test]
    fn a_bad_template_file_is_named() {
        let (config, _) = fixture_config();
        let broken = tokenizer_dir(Some(config.clone()), Some("{% for %}"));
        let err = HfTokenizer::load(broken.path()).unwrap_err().to_string();
        let jinja = broken.path().join(CHAT_TEMPLATE_FILE);
        assert!(
            err.starts_with(&format!(
                "tokenizer {}: its chat template: ",
                jinja.display()
            )),
            "{err}"
        );
        let dir = tokenizer_dir(Some(config.clone()), None);
        std::fs::create_dir(dir.path().join(CHAT_TEMPLATE_FILE)).unwrap();
        let err = HfTokenizer::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("chat_template.jinja is a directory"), "{err}");
        let big = "x".repeat(MAX_CHAT_TEMPLATE_BYTES as usize + 1);
        let dir = tokenizer_dir(Some(config), Some(&big));
        let err = HfTokenizer::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("for a chat template"), "{err}");
        // The config's own field, broken, names the config.
        let dir = tokenizer_dir(Some(fixture_config_with("{% if %}")), None);
        let err = HfTokenizer::load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json: its chat template: "),
            "{err}"
        );
    }
}
