//! The sampling and output fields both OpenAI endpoints take (completions and chat), and their
//! conversion to the contract's SamplingParams, structured output and logprobs.

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::SidecarError;
use crate::proto::structured_output::Kind;
use crate::proto::{Choices, SamplingParams, StructuredOutput};

/// The most alternatives logprobs may ask for (the worker's limit too).
pub const MAX_LOGPROBS: u32 = 20;
/// Accepted and without effect here: nothing is stored, no tier or cache key applies.
const NO_OPS: [&str; 6] = ["user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key"];

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields both endpoints take; top_k, min_p, repetition_penalty and ignore_eos are the
/// usual extensions (vLLM, TGI).
#[derive(Deserialize, Debug, Default)]
pub struct Sampling {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub stop: Option<OneOrMany>,
    pub seed: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub n: Option<u32>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub response_format: Option<Value>,
    // vLLM's structured-output fields, so clients written for it work unchanged.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub structured_outputs: Option<Map<String, Value>>,
    pub logit_bias: Option<Map<String, Value>>,
    pub best_of: Option<u32>,
    /// cy-llm's: speculative decoding for this request (PredictRequest.speculative); unset follows
    /// the worker.
    pub speculative: Option<bool>,
    /// Everything else: a no-op of NO_OPS, or refused.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl Sampling {
    pub fn to_proto(&self) -> Result<SamplingParams, SidecarError> {
        if let Some(field) = self.other.keys().find(|k| !NO_OPS.contains(&k.as_str())) {
            return Err(SidecarError::invalid(format!("{field}: not supported by cy-llm")));
        }
        if self.n == Some(0) || self.n.is_some_and(|n| n > 16) {
            return Err(SidecarError::invalid("n: must be 1 to 16"));
        }
        if self.best_of.is_some_and(|b| b != self.choices()) {
            return Err(SidecarError::invalid("best_of: only equal to n is supported"));
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(SidecarError::invalid("logit_bias: not supported"));
        }
        let seed = match self.seed {
            Some(seed) if seed < 0 => return Err(SidecarError::invalid("seed: must not be negative")),
            seed => seed.map(|s| s as u64),
        };
        Ok(SamplingParams {
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            stop: self.stop.as_ref().map(|s| match s {
                OneOrMany::One(one) => vec![one.clone()],
                OneOrMany::Many(many) => many.clone(),
            }).unwrap_or_default(),
            stop_token_ids: vec![],
            seed,
            ignore_eos: self.ignore_eos,
        })
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }

    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    /// response_format or one of vLLM's fields; more than one is refused.
    pub fn structured_output(&self) -> Result<Option<StructuredOutput>, SidecarError> {
        let mut kinds: Vec<(&str, Kind)> = Vec::new();
        if let Some(format) = &self.response_format {
            match format.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => kinds.push(("response_format", Kind::JsonObject(true))),
                Some("json_schema") => {
                    let schema = format.pointer("/json_schema/schema").filter(|s| s.is_object() || s.is_boolean());
                    let schema = schema.ok_or_else(|| SidecarError::invalid("response_format.json_schema.schema: a JSON Schema object is required"))?;
                    kinds.push(("response_format", Kind::JsonSchema(schema.to_string())));
                }
                _ => return Err(SidecarError::invalid("response_format.type: must be text, json_object or json_schema")),
            }
        }
        if let Some(schema) = &self.guided_json {
            kinds.push(("guided_json", Kind::JsonSchema(schema.as_str().map(str::to_owned).unwrap_or_else(|| schema.to_string()))));
        }
        if let Some(regex) = &self.guided_regex {
            kinds.push(("guided_regex", Kind::Regex(regex.clone())));
        }
        if let Some(choices) = &self.guided_choice {
            kinds.push(("guided_choice", Kind::Choice(Choices { choices: choices.clone() })));
        }
        if let Some(grammar) = &self.guided_grammar {
            kinds.push(("guided_grammar", Kind::Grammar(grammar.clone())));
        }
        for (key, value) in self.structured_outputs.iter().flatten() {
            let kind = match (key.as_str(), value) {
                (_, Value::Null) | ("disable_any_whitespace" | "disable_additional_properties", _) => continue,
                ("json", Value::String(text)) => Kind::JsonSchema(text.clone()),
                ("json", schema) => Kind::JsonSchema(schema.to_string()),
                ("regex", Value::String(text)) => Kind::Regex(text.clone()),
                ("grammar", Value::String(text)) => Kind::Grammar(text.clone()),
                ("json_object", Value::Bool(true)) => Kind::JsonObject(true),
                ("json_object", Value::Bool(false)) => continue,
                ("choice", Value::Array(items)) => Kind::Choice(Choices {
                    choices: items.iter().map(|c| c.as_str().map(str::to_owned)).collect::<Option<_>>()
                        .ok_or_else(|| SidecarError::invalid("structured_outputs.choice: a list of strings"))?,
                }),
                _ => return Err(SidecarError::invalid(format!("structured_outputs.{key}: not supported"))),
            };
            kinds.push(("structured_outputs", kind));
        }
        match kinds.len() {
            0 => Ok(None),
            1 => Ok(Some(StructuredOutput { kind: Some(kinds.remove(0).1) })),
            _ => Err(SidecarError::invalid(format!("{} and {}: set one structured output", kinds[0].0, kinds[1].0))),
        }
    }

    /// logprobs (chat: true, with top_logprobs alternatives; completions: the number of alternatives).
    pub fn logprob_count(&self, chat: bool) -> Result<Option<u32>, SidecarError> {
        let count = match (&self.logprobs, chat) {
            (None | Some(Value::Null) | Some(Value::Bool(false)), _) => {
                if self.top_logprobs.is_some_and(|k| k > 0) {
                    return Err(SidecarError::invalid("top_logprobs: needs logprobs true"));
                }
                return Ok(None);
            }
            (Some(Value::Bool(true)), true) => self.top_logprobs.unwrap_or(0),
            (Some(Value::Number(n)), false) => n.as_u64().and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| SidecarError::invalid("logprobs: a number of alternatives, 0 or more"))?,
            _ => return Err(SidecarError::invalid(if chat { "logprobs: true or false" } else { "logprobs: a number, 0 to 20" })),
        };
        if count > MAX_LOGPROBS {
            return Err(SidecarError::invalid(format!("logprobs: at most {MAX_LOGPROBS} alternatives")));
        }
        Ok(Some(count))
    }
}
