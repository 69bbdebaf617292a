//! Chat templates: the Jinja template an instruction-tuned model was trained with, applied to a
//! prompt (`fdpp generate --chat`) so that the model reads the turn markers it expects
//! (`<|im_start|>user\n…<|im_end|>\n<|im_start|>assistant\n` for SmolLM2) rather than bare text.
//!
//! Where a template comes from: the `chat_template` field of an HF directory's
//! tokenizer_config.json (a string, or a list of named templates of which `default` is used),
//! a `chat_template.jinja` file beside it (newer HF checkpoints), or a GGUF file's
//! `tokenizer.chat_template` metadata. The template sees what HF's `apply_chat_template` gives
//! it: `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and `raise_exception`, with
//! Python's string methods (`.strip()`, `.startswith()`), which templates call.
//!
//! The rendered text already holds every special token the model expects (BOS included where
//! the template writes it), so it is encoded without adding special tokens, as HF does.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

use crate::error::{FdppError, Result};

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's chat template and the special-token strings it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    pub template: String,
    /// Where the template came from (file and field), for messages.
    pub source: String,
    pub path: PathBuf,
    pub bos_token: String,
    pub eos_token: String,
}

/// A special token in tokenizer_config.json: a string, or an object with `content`.
fn token_string(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of an HF model directory: tokenizer_config.json's `chat_template`, else
    /// chat_template.jinja. Ok(None) when the directory has neither; a file that is present
    /// but malformed is an error naming it.
    pub fn from_hf_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<Value> = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| FdppError::io(&cfg_path, e))?;
            Some(serde_json::from_str(&text).map_err(|e| FdppError::Config {
                path: cfg_path.clone(),
                msg: format!("not valid JSON ({e})"),
            })?)
        } else {
            None
        };
        let (bos, eos) = match &cfg {
            Some(c) => (token_string(c.get("bos_token")), token_string(c.get("eos_token"))),
            None => (String::new(), String::new()),
        };
        let mut found = None;
        if let Some(t) = cfg.as_ref().and_then(|c| c.get("chat_template")) {
            let template = match t {
                Value::String(s) => s.clone(),
                // Several named templates (e.g. default, tool_use): the default one.
                Value::Array(list) => list
                    .iter()
                    .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|e| e.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| FdppError::Config {
                        path: cfg_path.clone(),
                        msg: "field 'chat_template' is a list without an entry named 'default' holding a \
                              'template' string"
                            .into(),
                    })?,
                Value::Null => String::new(),
                other => {
                    return Err(FdppError::Config {
                        path: cfg_path.clone(),
                        msg: format!(
                            "field 'chat_template' must be a string or a list of {{name, template}}, found {}",
                            json_kind(other)
                        ),
                    })
                }
            };
            if !template.is_empty() {
                found = Some((template, cfg_path.clone(), "field 'chat_template'".to_string()));
            }
        }
        if found.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                let template = std::fs::read_to_string(&jinja).map_err(|e| FdppError::io(&jinja, e))?;
                found = Some((template, jinja, "the whole file".to_string()));
            }
        }
        Ok(found.map(|(template, path, what)| ChatTemplate {
            template,
            source: format!("{} ({what})", path.display()),
            path,
            bos_token: bos,
            eos_token: eos,
        }))
    }

    /// The template from a GGUF file's `tokenizer.chat_template`; `bos`/`eos` are the strings
    /// of its BOS and EOS tokens. None when the metadata has no template.
    pub fn from_gguf(path: &Path, template: Option<String>, bos: String, eos: String) -> Option<ChatTemplate> {
        template.filter(|t| !t.is_empty()).map(|template| ChatTemplate {
            template,
            source: format!("{} (metadata 'tokenizer.chat_template')", path.display()),
            path: path.to_path_buf(),
            bos_token: bos,
            eos_token: eos,
        })
    }

    /// The conversation as the model's input text; with `add_generation_prompt` the text ends
    /// where the assistant's reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = minijinja::Environment::new();
        // HF renders with trim_blocks and lstrip_blocks; templates are written for that.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            },
        );
        let err = |e: minijinja::Error| FdppError::Config {
            path: self.path.clone(),
            msg: format!(
                "chat template ({}) does not render: {}; fix the template or run without --chat",
                self.source,
                chain(&e)
            ),
        };
        env.add_template("chat", &self.template).map_err(err)?;
        let t = env.get_template("chat").map_err(err)?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(err)
    }

    /// One user turn (after an optional system message) ready for the assistant's reply.
    pub fn prompt(&self, user: &str, system: Option<&str>) -> Result<String> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", user));
        self.render(&messages, true)
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A minijinja error with its causes and the template line, on one line.
fn chain(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(t: &str) -> ChatTemplate {
        ChatTemplate {
            template: t.into(),
            source: "test".into(),
            path: PathBuf::from("test.json"),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        }
    }

    #[test]
    fn renders_messages_the_generation_prompt_and_python_methods() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m['content'].strip() }}\n{% endfor %}\
             {% if add_generation_prompt %}[assistant]{% endif %}",
        );
        let s = t.prompt("  Hi there ", Some("Be brief.")).unwrap();
        assert_eq!(s, "<s>[system]Be brief.\n[user]Hi there\n[assistant]");
        let s = t.render(&[Message::new("user", "x")], false).unwrap();
        assert_eq!(s, "<s>[user]x\n");
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_errors_naming_the_source() {
        let t = template("{% if messages[0].role != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}");
        let e = t.prompt("hi", None).unwrap_err().to_string();
        assert!(
            e.contains("need a system turn") && e.contains("test.json") && e.contains("--chat"),
            "{e}"
        );
        let e = template("{% for m in messages %}")
            .prompt("hi", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not render"), "{e}");
    }
}
