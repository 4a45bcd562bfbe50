//! OpenAI request and response bodies, and their conversion to and from the cy-llm contract.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::SidecarError;
use crate::proto::predict_request::Input;
use crate::proto::{ChatInput, ChatMessage, FinishReason, PredictRequest, PredictResponse, SamplingParams};

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
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
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
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

fn invalid(message: impl Into<String>) -> SidecarError {
    SidecarError::InvalidRequest(message.into())
}

impl Sampling {
    fn to_proto(&self) -> Result<SamplingParams, SidecarError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(invalid("n: only 1 choice per request is supported"));
        }
        if self.logprobs.as_ref().is_some_and(|v| !v.is_null() && v != &Value::Bool(false)) {
            return Err(invalid("logprobs: not supported"));
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
}

impl CompletionRequest {
    pub fn into_proto(self, request_id: &str) -> Result<PredictRequest, SidecarError> {
        if self.echo {
            return Err(invalid("echo: not supported"));
        }
        let mut prompts = self.prompt.into_vec();
        if prompts.len() != 1 {
            return Err(invalid("prompt: exactly one prompt per request is supported"));
        }
        Ok(PredictRequest {
            request_id: request_id.into(),
            model: self.model,
            input: Some(Input::Prompt(prompts.remove(0))),
            sampling: Some(self.sampling.to_proto()?),
            ..Default::default()
        })
    }
}

impl ChatRequest {
    pub fn into_proto(self, request_id: &str) -> Result<PredictRequest, SidecarError> {
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
                Ok(ChatMessage { role: m.role, content, ..Default::default() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PredictRequest {
            request_id: request_id.into(),
            model: self.model,
            input: Some(Input::Chat(ChatInput { messages, ..Default::default() })),
            sampling: Some(self.sampling.to_proto()?),
            ..Default::default()
        })
    }
}

pub fn finish_reason(response: &PredictResponse) -> Option<&'static str> {
    match FinishReason::try_from(response.finish_reason).unwrap_or(FinishReason::Unspecified) {
        FinishReason::Unspecified => None,
        FinishReason::Stop => Some("stop"),
        FinishReason::Length => Some("length"),
        FinishReason::Aborted => Some("abort"),
    }
}

pub fn usage(response: &PredictResponse) -> Value {
    let usage = response.usage.unwrap_or_default();
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_with_parts_and_max_completion_tokens() {
        let body = json!({"model": "m", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
            "max_completion_tokens": 7, "stop": "END", "seed": 3, "stream": true, "stream_options": {"include_usage": true}});
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        assert!(request.sampling.stream && request.sampling.include_usage());
        let proto = request.into_proto("r1").unwrap();
        let Some(Input::Chat(chat)) = proto.input else { panic!("chat input expected") };
        assert_eq!(chat.messages[1].content, "hi there");
        let sampling = proto.sampling.unwrap();
        assert_eq!((sampling.max_tokens, sampling.seed, sampling.stop), (Some(7), Some(3), vec!["END".to_string()]));
    }

    #[test]
    fn unsupported_fields_are_invalid_requests() {
        for body in [
            json!({"prompt": "x", "n": 2}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": "x", "echo": true}),
            json!({"prompt": "x", "logprobs": 3}),
            json!({"prompt": "x", "seed": -1}),
        ] {
            let request: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
            assert!(matches!(request.into_proto("r"), Err(SidecarError::InvalidRequest(_))), "{body}");
        }
        let image: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})).unwrap();
        assert!(image.into_proto("r").is_err());
    }
}
