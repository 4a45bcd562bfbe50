//! OpenAI request bodies and their conversion to the cy-llm contract; every field is honoured,
//! accepted as a documented no-op, or refused (README, "OpenAI fields").

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::SidecarError;
use crate::proto::predict_request::Input;
use crate::proto::structured_output::Kind;
use crate::proto::{
    ChatInput, ChatMessage, Choices, PredictRequest, SamplingParams, StructuredOutput, ToolCall,
};
use crate::tools::{self, ToolPlan};

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
    fn into_vec(self) -> Vec<String> {
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

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: String,
    pub prompt: OneOrMany,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: String,
}

#[derive(Deserialize, Debug)]
pub struct FunctionCallIn {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

#[derive(Deserialize, Debug)]
pub struct ToolCallIn {
    #[serde(default)]
    pub id: String,
    pub function: FunctionCallIn,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Vec<ToolCallIn>,
    #[serde(default)]
    pub tool_call_id: String,
    #[serde(default)]
    pub name: String,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

fn invalid(message: impl Into<String>) -> SidecarError {
    SidecarError::InvalidRequest(message.into())
}

impl Sampling {
    fn to_proto(&self) -> Result<SamplingParams, SidecarError> {
        if let Some(field) = self.other.keys().find(|k| !NO_OPS.contains(&k.as_str())) {
            return Err(invalid(format!("{field}: not supported by cy-llm")));
        }
        if self.n == Some(0) || self.n.is_some_and(|n| n > 16) {
            return Err(invalid("n: must be 1 to 16"));
        }
        if self.best_of.is_some_and(|b| b != self.choices()) {
            return Err(invalid("best_of: only equal to n is supported"));
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(invalid("logit_bias: not supported"));
        }
        let seed = match self.seed {
            Some(seed) if seed < 0 => return Err(invalid("seed: must not be negative")),
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
    fn structured_output(&self) -> Result<Option<StructuredOutput>, SidecarError> {
        let mut kinds: Vec<(&str, Kind)> = Vec::new();
        if let Some(format) = &self.response_format {
            match format.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("json_object") => kinds.push(("response_format", Kind::JsonObject(true))),
                Some("json_schema") => {
                    let schema = format.pointer("/json_schema/schema").filter(|s| s.is_object() || s.is_boolean());
                    let schema = schema.ok_or_else(|| invalid("response_format.json_schema.schema: a JSON Schema object is required"))?;
                    kinds.push(("response_format", Kind::JsonSchema(schema.to_string())));
                }
                _ => return Err(invalid("response_format.type: must be text, json_object or json_schema")),
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
                        .ok_or_else(|| invalid("structured_outputs.choice: a list of strings"))?,
                }),
                _ => return Err(invalid(format!("structured_outputs.{key}: not supported"))),
            };
            kinds.push(("structured_outputs", kind));
        }
        match kinds.len() {
            0 => Ok(None),
            1 => Ok(Some(StructuredOutput { kind: Some(kinds.remove(0).1) })),
            _ => Err(invalid(format!("{} and {}: set one structured output", kinds[0].0, kinds[1].0))),
        }
    }

    /// logprobs (chat: true, with top_logprobs alternatives; completions: the number of alternatives).
    fn logprob_count(&self, chat: bool) -> Result<Option<u32>, SidecarError> {
        let count = match (&self.logprobs, chat) {
            (None | Some(Value::Null) | Some(Value::Bool(false)), _) => {
                if self.top_logprobs.is_some_and(|k| k > 0) {
                    return Err(invalid("top_logprobs: needs logprobs true"));
                }
                return Ok(None);
            }
            (Some(Value::Bool(true)), true) => self.top_logprobs.unwrap_or(0),
            (Some(Value::Number(n)), false) => n.as_u64().and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| invalid("logprobs: a number of alternatives, 0 or more"))?,
            _ => return Err(invalid(if chat { "logprobs: true or false" } else { "logprobs: a number, 0 to 20" })),
        };
        if count > MAX_LOGPROBS {
            return Err(invalid(format!("logprobs: at most {MAX_LOGPROBS} alternatives")));
        }
        Ok(Some(count))
    }
}

impl CompletionRequest {
    /// The request, and the prompt when echo asks for it back.
    pub fn into_proto(self, request_id: &str) -> Result<(PredictRequest, Option<String>), SidecarError> {
        let mut prompts = self.prompt.into_vec();
        if prompts.len() != 1 {
            return Err(invalid("prompt: exactly one prompt per request is supported"));
        }
        let prompt = prompts.remove(0);
        let logprobs = self.sampling.logprob_count(false)?;
        let sampling = self.sampling.to_proto()?;
        if sampling.max_tokens == Some(0) && !self.echo {
            return Err(invalid("max_tokens: 0 only with echo, to score the prompt"));
        }
        // echo with logprobs scores the prompt too; max_tokens 0 asks for nothing else.
        let prompt_logprobs = if self.echo && (logprobs.is_some() || sampling.max_tokens == Some(0)) {
            Some(logprobs.unwrap_or(0))
        } else {
            None
        };
        let proto = PredictRequest {
            request_id: request_id.into(),
            model: self.model,
            input: Some(Input::Prompt(prompt.clone())),
            sampling: Some(sampling),
            structured_output: self.sampling.structured_output()?,
            logprobs,
            prompt_logprobs,
            speculative: self.sampling.speculative,
            ..Default::default()
        };
        Ok((proto, self.echo.then_some(prompt)))
    }
}

impl ChatRequest {
    pub fn into_proto(self, request_id: &str) -> Result<(PredictRequest, ToolPlan), SidecarError> {
        let plan = tools::plan(self.tools.as_deref(), self.tool_choice.as_ref(), self.parallel_tool_calls.unwrap_or(true))?;
        let mut structured_output = self.sampling.structured_output()?;
        if let Some(constraint) = plan.constraint.clone() {
            if structured_output.is_some() {
                return Err(invalid("response_format and tool_choice: a required or named tool call is its own format"));
            }
            structured_output = Some(constraint);
        }
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let content = match m.content {
                    None => String::new(),
                    Some(Content::Text(text)) => text,
                    Some(Content::Parts(parts)) => {
                        if let Some(part) = parts.iter().find(|p| p.kind != "text") {
                            return Err(invalid(format!("messages[{i}].content: {:?} parts are not supported", part.kind)));
                        }
                        parts.into_iter().map(|p| p.text).collect()
                    }
                };
                let tool_calls = m.tool_calls.into_iter()
                    .map(|c| ToolCall { id: c.id, name: c.function.name, arguments: c.function.arguments })
                    .collect();
                Ok(ChatMessage { role: m.role, content, tool_calls, tool_call_id: m.tool_call_id, name: m.name })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let proto = PredictRequest {
            request_id: request_id.into(),
            model: self.model,
            input: Some(Input::Chat(ChatInput { messages, tools_json: plan.tools_json.clone() })),
            sampling: Some(self.sampling.to_proto()?),
            structured_output,
            logprobs: self.sampling.logprob_count(true)?,
            speculative: self.sampling.speculative,
            ..Default::default()
        };
        Ok((proto, plan))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_request_with_parts_and_max_completion_tokens() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 7, "stop": "END", "seed": 3, "stream": true, "stream_options": {"include_usage": true}});
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        assert!(request.sampling.stream && request.sampling.include_usage());
        let (proto, _) = request.into_proto("r1").unwrap();
        let Some(Input::Chat(chat)) = proto.input else { panic!("chat input expected") };
        assert_eq!(chat.messages[1].content, "hi there");
        let sampling = proto.sampling.unwrap();
        assert_eq!((sampling.max_tokens, sampling.seed, sampling.stop), (Some(7), Some(3), vec!["END".to_string()]));
    }

    #[test]
    fn structured_outputs_and_logprobs_map_to_the_contract() {
        let body = json!({"prompt": "x", "echo": true, "logprobs": 2, "max_tokens": 0, "user": "u",
                          "structured_outputs": {"choice": ["a", "b"]}});
        let (proto, echo) = serde_json::from_value::<CompletionRequest>(body).unwrap().into_proto("r").unwrap();
        assert_eq!((proto.logprobs, proto.prompt_logprobs, echo.as_deref()), (Some(2), Some(2), Some("x")));
        assert_eq!(proto.structured_output.unwrap().kind, Some(Kind::Choice(Choices { choices: vec!["a".into(), "b".into()] })));
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": true}}});
        let (proto, _) = serde_json::from_value::<ChatRequest>(body).unwrap().into_proto("r").unwrap();
        assert_eq!(proto.logprobs, Some(3));
        assert_eq!(proto.structured_output.unwrap().kind, Some(Kind::JsonSchema(r#"{"type":"object"}"#.into())));
        for (body, speculative) in [(json!({"prompt": "x", "speculative": false}), Some(false)), (json!({"prompt": "x"}), None)] {
            let (proto, _) = serde_json::from_value::<CompletionRequest>(body).unwrap().into_proto("r").unwrap();
            assert_eq!(proto.speculative, speculative);
        }
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "speculative": true});
        assert_eq!(serde_json::from_value::<ChatRequest>(body).unwrap().into_proto("r").unwrap().0.speculative, Some(true));
    }

    #[test]
    fn unsupported_fields_are_invalid_requests() {
        for body in [
            json!({"prompt": "x", "n": 20}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": "x", "max_tokens": 0}),
            json!({"prompt": "x", "logprobs": 30}),
            json!({"prompt": "x", "seed": -1}),
            json!({"prompt": "x", "suffix": "y"}),
            json!({"prompt": "x", "logit_bias": {"1": 5}}),
            json!({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}),
            json!({"prompt": "x", "response_format": {"type": "yaml"}}),
        ] {
            let request: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
            assert!(matches!(request.into_proto("r"), Err(SidecarError::InvalidRequest(_))), "{body}");
        }
        let image: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})).unwrap();
        assert!(image.into_proto("r").is_err());
    }
}
