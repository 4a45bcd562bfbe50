//! OpenAI response bodies from the worker's messages: one `Reply` per choice, whole or as deltas,
//! with logprobs in each endpoint's shape and tool calls read back from the text.

use serde_json::{json, Map, Value};

use crate::gateway::Route;
use crate::proto::{FinishReason, PredictResponse, TokenLogprob, Usage};
use crate::tools::{self, CallDelta, CallStream, Mode, ToolPlan};

/// What the request asked of every choice's shape.
pub struct Shape {
    pub route: Route,
    pub tools: Option<ToolPlan>,
    pub logprobs: bool,
    /// The prompt, for completions with echo.
    pub echo: Option<String>,
}

/// One choice: what has arrived of it, and what of it was sent.
#[derive(Default)]
pub struct Reply {
    pub index: u32,
    text: String,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Vec<TokenLogprob>,
    pub finish: Option<&'static str>,
    pub usage: Usage,
    started: bool,
    /// Characters of text sent before this delta, for completions' text_offset.
    offset: usize,
    call_id: String,
    /// A streamed `required` answer's calls, read as they arrive.
    calls: Option<CallStream>,
    /// A streamed `auto` answer: bytes of its text sent as content; whether calls were sent.
    sent: usize,
    called: bool,
}

pub fn finish_reason(response: &PredictResponse) -> Option<&'static str> {
    match FinishReason::try_from(response.finish_reason).unwrap_or(FinishReason::Unspecified) {
        FinishReason::Unspecified => None,
        FinishReason::Stop => Some("stop"),
        FinishReason::Length => Some("length"),
        FinishReason::Aborted => Some("abort"),
    }
}

/// OpenAI's usage for a whole request: the prompt counted once (the choices share it, as OpenAI
/// and vLLM count it), the completions summed.
pub fn usage<'a>(replies: impl IntoIterator<Item = &'a Reply>) -> Value {
    let (mut prompt, mut completion) = (0, 0);
    for reply in replies {
        prompt = prompt.max(reply.usage.prompt_tokens);
        completion += reply.usage.completion_tokens;
    }
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

impl Reply {
    pub fn new(index: u32) -> Self {
        Self { index, call_id: call_id(), ..Default::default() }
    }

    /// Takes a message into the choice (for a whole reply).
    pub fn absorb(&mut self, message: PredictResponse) {
        let finish = finish_reason(&message);
        self.text.push_str(&message.text);
        self.logprobs.extend(message.logprobs);
        self.prompt_logprobs.extend(message.prompt_logprobs);
        if finish.is_some() {
            self.finish = finish;
            self.usage = message.usage.unwrap_or_default();
        }
    }

    /// The whole choice object.
    pub fn whole(&self, shape: &Shape) -> Value {
        let logprobs = self.logprobs_json(shape, &self.prompt_logprobs, &self.logprobs, 0);
        if shape.route != Route::ChatCompletions {
            let text = format!("{}{}", shape.echo.as_deref().unwrap_or(""), self.text);
            return json!({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish});
        }
        let calls = shape.tools.as_ref().and_then(|plan| plan.calls(&self.text));
        let (message, finish) = match calls {
            Some(calls) => {
                let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| {
                    let id = if i == 0 { self.call_id.clone() } else { call_id() };
                    json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
                }).collect();
                (json!({"role": "assistant", "content": null, "tool_calls": calls}), self.tool_finish())
            }
            None => (json!({"role": "assistant", "content": self.text}), self.finish),
        };
        json!({"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
    }

    fn tool_finish(&self) -> Option<&'static str> {
        self.finish.map(|f| if f == "stop" { "tool_calls" } else { f })
    }

    /// The choice object for one streamed message; None when there is nothing to send yet.
    pub fn delta(&mut self, shape: &Shape, message: PredictResponse) -> Option<Value> {
        let finish = finish_reason(&message);
        if finish.is_some() {
            self.usage = message.usage.unwrap_or_default();
            self.finish = finish;
        }
        let first = !self.started;
        let plan = shape.tools.as_ref();
        if let Some(plan) = plan.filter(|p| p.finds_calls()) {
            return self.tool_delta(shape, plan, message, finish);
        }
        if message.text.is_empty() && message.logprobs.is_empty() && message.prompt_logprobs.is_empty() && finish.is_none() && !first {
            return None;
        }
        self.started = true;
        let logprobs = self.logprobs_json(shape, &message.prompt_logprobs, &message.logprobs, self.offset);
        if shape.route != Route::ChatCompletions {
            let echo = if first { shape.echo.as_deref().unwrap_or("") } else { "" };
            let text = format!("{echo}{}", message.text);
            self.offset += text.chars().count();
            return Some(json!({"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}));
        }
        let mut delta = Map::new();
        if first {
            delta.insert("role".into(), json!("assistant"));
        }
        let finish = match plan.and_then(ToolPlan::named) {
            Some(name) => {
                let mut function = json!({"arguments": message.text});
                let mut call = json!({"index": 0});
                if first {
                    function["name"] = json!(name);
                    call["id"] = json!(self.call_id);
                    call["type"] = json!("function");
                }
                call["function"] = function;
                delta.insert("tool_calls".into(), json!([call]));
                finish.map(|f| if f == "stop" { "tool_calls" } else { f })
            }
            None => {
                delta.insert("content".into(), json!(message.text));
                finish
            }
        };
        Some(json!({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}))
    }

    /// A streamed delta of an answer that may be calls (`required`, `auto`). `required` sends each
    /// call's name, then its arguments as they come; `auto` sends text as content until a call may
    /// be starting, and the calls it finds once the answer is whole.
    fn tool_delta(&mut self, shape: &Shape, plan: &ToolPlan, message: PredictResponse, finish: Option<&'static str>) -> Option<Value> {
        let logprobs = self.logprobs_json(shape, &message.prompt_logprobs, &message.logprobs, 0);
        self.text.push_str(&message.text);
        let mut content = "";
        let calls = if plan.mode == Mode::Required {
            self.calls.get_or_insert_with(CallStream::default).push(&message.text)
        } else {
            let found = finish.and_then(|_| plan.calls(&self.text)).unwrap_or_default();
            let upto = if finish.is_some() && found.is_empty() { self.text.len() } else { tools::text_part(&self.text, self.sent) };
            if upto > self.sent {
                content = &self.text[self.sent..upto];
                self.sent = upto;
            }
            found.into_iter().enumerate().map(|(index, c)| CallDelta { index, name: Some(c.name), arguments: c.arguments }).collect()
        };
        let mut delta = Map::new();
        if !self.started {
            delta.insert("role".into(), json!("assistant"));
        }
        if !content.is_empty() {
            delta.insert("content".into(), json!(content));
        }
        if !calls.is_empty() {
            let calls: Vec<Value> = calls.into_iter().map(|c| {
                let mut call = json!({"index": c.index, "function": {"arguments": c.arguments}});
                if let Some(name) = c.name {
                    call["id"] = json!(if c.index == 0 { self.call_id.clone() } else { call_id() });
                    call["type"] = json!("function");
                    call["function"]["name"] = json!(name);
                }
                call
            }).collect();
            delta.insert("tool_calls".into(), json!(calls));
            self.called = true;
        }
        if delta.is_empty() && logprobs.is_null() && finish.is_none() {
            return None;
        }
        self.started = true;
        let finish = if self.called { self.tool_finish() } else { finish };
        Some(json!({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}))
    }

    fn logprobs_json(&self, shape: &Shape, prompt: &[TokenLogprob], generated: &[TokenLogprob], offset: usize) -> Value {
        if !shape.logprobs {
            return Value::Null;
        }
        if shape.route == Route::ChatCompletions {
            let entry = |t: &TokenLogprob| json!({"token": t.text, "logprob": t.logprob.unwrap_or(0.0), "bytes": t.bytes});
            let content: Vec<Value> = generated.iter().map(|t| {
                let mut e = entry(t);
                e["top_logprobs"] = t.top_logprobs.iter().map(entry).collect();
                e
            }).collect();
            return json!({"content": content});
        }
        // Completions: parallel arrays over the echoed prompt's tokens (when echo) and the new ones.
        let tokens: Vec<&TokenLogprob> = if shape.echo.is_some() { prompt.iter().chain(generated).collect() } else { generated.iter().collect() };
        let mut position = offset;
        let mut text_offset = Vec::new();
        for t in &tokens {
            text_offset.push(position);
            position += t.text.chars().count();
        }
        json!({
            "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": tokens.iter().map(|t| if t.logprob.is_none() { Value::Null } else {
                Value::Object(t.top_logprobs.iter().map(|a| (a.text.clone(), json!(a.logprob.unwrap_or(0.0)))).collect())
            }).collect::<Vec<_>>(),
            "text_offset": text_offset,
        })
    }
}
