//! OpenAI request bodies and their conversion to the cy-llm contract; every field is honoured,
//! accepted as a documented no-op, or refused (README, "OpenAI fields").

use serde::Deserialize;
use serde_json::Value;

use crate::error::SidecarError;
use crate::proto::predict_request::Input;
use crate::proto::{ChatInput, ChatMessage, PredictRequest, ToolCall};
use crate::sampling::{OneOrMany, Sampling};
use crate::tools::{self, ToolPlan};

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

impl CompletionRequest {
    /// The request, and the prompt when echo asks for it back.
    pub fn into_proto(self, request_id: &str) -> Result<(PredictRequest, Option<String>), SidecarError> {
        let mut prompts = self.prompt.into_vec();
        if prompts.len() != 1 {
            return Err(SidecarError::invalid("prompt: exactly one prompt per request is supported"));
        }
        let prompt = prompts.remove(0);
        let logprobs = self.sampling.logprob_count(false)?;
        let sampling = self.sampling.to_proto()?;
        if sampling.max_tokens == Some(0) && !self.echo {
            return Err(SidecarError::invalid("max_tokens: 0 only with echo, to score the prompt"));
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
                return Err(SidecarError::invalid("response_format and tool_choice: a required or named tool call is its own format"));
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
                            return Err(SidecarError::invalid(format!("messages[{i}].content: {:?} parts are not supported", part.kind)));
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
    use crate::proto::structured_output::Kind;
    use crate::proto::Choices;
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
