//! Tool calls: what `tools` and `tool_choice` ask of the model, and its answer read back as calls.
//!
//! The tools reach the model through its chat template (the worker renders ChatInput.tools_json).
//! `required` and a named function constrain the output to a JSON Schema, so the arguments always
//! parse and validate: `required` to an array of {"name", "arguments"} objects (one at most without
//! parallel_tool_calls), a named function to its parameters. `auto` reads calls the model chose to
//! make, in the Hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) that many
//! open models' templates ask for, or as a bare {"name", "arguments"} object.

use serde_json::{json, Value};

use crate::error::SidecarError;
use crate::proto::structured_output::Kind;
use crate::proto::StructuredOutput;

#[derive(Clone, Debug, PartialEq)]
pub enum Mode {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Clone, Debug)]
pub struct ToolPlan {
    pub mode: Mode,
    /// The tools as the worker's template gets them ("" for none).
    pub tools_json: String,
    pub constraint: Option<StructuredOutput>,
    names: Vec<String>,
}

/// A call read from the model's output: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

pub fn plan(tools: Option<&[Value]>, choice: Option<&Value>, parallel: bool) -> Result<ToolPlan, SidecarError> {
    let tools = tools.unwrap_or_default();
    let mut names = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool.pointer("/function/name").and_then(Value::as_str).filter(|n| !n.is_empty());
        match (tool.get("type").and_then(Value::as_str), name) {
            (Some("function"), Some(name)) => names.push(name.to_owned()),
            _ => return Err(SidecarError::invalid(format!("tools[{i}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        }
        if tool.pointer("/function/parameters").is_some_and(|p| !p.is_object()) {
            return Err(SidecarError::invalid(format!("tools[{i}].function.parameters: must be a JSON Schema object")));
        }
    }
    let mode = match choice {
        None if tools.is_empty() => Mode::None,
        None => Mode::Auto,
        Some(Value::String(s)) if s == "none" => Mode::None,
        Some(Value::String(s)) if s == "auto" => Mode::Auto,
        Some(Value::String(s)) if s == "required" => Mode::Required,
        Some(named) => match named.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if named.get("type").and_then(Value::as_str) == Some("function") => Mode::Named(name.to_owned()),
            _ => return Err(SidecarError::invalid("tool_choice: none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")),
        },
    };
    if mode != Mode::None && tools.is_empty() {
        return Err(SidecarError::invalid("tool_choice: no tools given"));
    }
    if let Mode::Named(name) = &mode {
        if !names.contains(name) {
            return Err(SidecarError::invalid(format!("tool_choice: no tool is named {name:?}")));
        }
    }
    let parameters = |tool: &Value| tool.pointer("/function/parameters").cloned().unwrap_or(json!({"type": "object"}));
    let schema = match &mode {
        Mode::Required => {
            let calls: Vec<Value> = tools
                .iter()
                .zip(&names)
                .map(|(tool, name)| json!({"type": "object", "properties": {"name": {"enum": [name]}, "arguments": parameters(tool)},
                                           "required": ["name", "arguments"]}))
                .collect();
            let mut array = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            if !parallel {
                array["maxItems"] = json!(1);
            }
            Some(array)
        }
        Mode::Named(name) => tools.iter().zip(&names).find(|(_, n)| *n == name).map(|(tool, _)| parameters(tool)),
        _ => None,
    };
    let tools_json = if mode == Mode::None { String::new() } else { Value::from(tools.to_vec()).to_string() };
    Ok(ToolPlan {
        mode,
        tools_json,
        constraint: schema.map(|s| StructuredOutput { kind: Some(Kind::JsonSchema(s.to_string())) }),
        names,
    })
}

impl ToolPlan {
    /// Whether the answer is known to be a call from its first token (its arguments can stream).
    pub fn named(&self) -> Option<&str> {
        match &self.mode {
            Mode::Named(name) => Some(name),
            _ => None,
        }
    }

    /// Whether calls are read from the answer's text (`auto`, `required`), not the text itself.
    pub fn finds_calls(&self) -> bool {
        matches!(self.mode, Mode::Auto | Mode::Required)
    }

    /// The calls in the model's whole answer; None when it answered in text.
    pub fn calls(&self, text: &str) -> Option<Vec<Call>> {
        let calls = match &self.mode {
            Mode::None => return None,
            Mode::Named(name) => vec![Call { name: name.clone(), arguments: text.trim().to_owned() }],
            Mode::Required => serde_json::from_str::<Vec<Value>>(text).ok()?.iter().filter_map(call_of).collect(),
            Mode::Auto => {
                let tagged: Vec<Call> = text
                    .split("<tool_call>")
                    .skip(1)
                    .filter_map(|rest| serde_json::from_str::<Value>(rest.split("</tool_call>").next()?.trim()).ok())
                    .filter_map(|v| call_of(&v))
                    .collect();
                if tagged.is_empty() {
                    serde_json::from_str::<Value>(text.trim()).ok().as_ref().and_then(call_of).into_iter().collect()
                } else {
                    tagged
                }
            }
        };
        let known = calls.iter().all(|c| self.names.contains(&c.name));
        (!calls.is_empty() && known).then_some(calls)
    }
}

/// What one streamed `tool_calls` delta says of a call: its name the first time, then more of its
/// arguments' text.
#[derive(Clone, Debug, PartialEq)]
pub struct CallDelta {
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

/// The calls of a `required` answer, read as its text arrives. Its constraint makes it a JSON array
/// of `{"name": ..., "arguments": {...}}` objects, keys in that order: a call's name goes out once
/// its string is whole, then its arguments' text as it grows.
#[derive(Default)]
pub struct CallStream {
    text: String,
    depth: usize,
    in_string: bool,
    escaped: bool,
    calls: Vec<Open>,
}

/// A call of the stream: where its object starts in the text, where its arguments start (once its
/// name is read) and end, and how much of them was sent.
#[derive(Default)]
struct Open {
    start: usize,
    arguments: Option<usize>,
    end: Option<usize>,
    sent: usize,
}

impl CallStream {
    pub fn push(&mut self, more: &str) -> Vec<CallDelta> {
        let from = self.text.len();
        self.text.push_str(more);
        for (i, c) in more.char_indices() {
            if self.in_string {
                match c {
                    _ if self.escaped => self.escaped = false,
                    '\\' => self.escaped = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => {
                    self.depth += 1;
                    if c == '{' && self.depth == 2 {
                        self.calls.push(Open { start: from + i, ..Default::default() });
                    }
                }
                '}' | ']' => {
                    if c == '}' && self.depth == 3 {
                        if let Some(call) = self.calls.last_mut() {
                            call.end = Some(from + i + 1);
                        }
                    }
                    self.depth = self.depth.saturating_sub(1);
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        for (index, call) in self.calls.iter_mut().enumerate() {
            let mut name = None;
            if call.arguments.is_none() {
                let Some((called, length)) = header(&self.text[call.start..]) else { continue };
                call.arguments = Some(call.start + length);
                call.sent = call.start + length;
                name = Some(called);
            }
            let upto = call.end.unwrap_or(self.text.len());
            if name.is_some() || upto > call.sent {
                out.push(CallDelta { index, name, arguments: self.text[call.sent..upto].to_owned() });
                call.sent = upto;
            }
        }
        out
    }
}

/// A call object's `{"name": "...", "arguments": ` once whole: the name and the header's length.
fn header(text: &str) -> Option<(String, usize)> {
    let mut rest = text.strip_prefix('{')?;
    for token in ["\"name\"", ":", "\""] {
        rest = rest.trim_start().strip_prefix(token)?;
    }
    let (name, after) = rest.split_once('"')?;
    let mut rest = after;
    for token in [",", "\"arguments\"", ":"] {
        rest = rest.trim_start().strip_prefix(token)?;
    }
    let rest = rest.trim_start();
    rest.starts_with('{').then(|| (name.to_owned(), text.len() - rest.len()))
}

/// How much of an `auto` answer is surely text: all of it, but for a call's possible start (an
/// answer opening with `{`, a `<tool_call>` tag, or the tag's first characters at its end).
/// `known`: how much was found to be text before, which is not searched again.
pub fn text_part(text: &str, known: usize) -> usize {
    const TAG: &str = "<tool_call>";
    if known == 0 && text.trim_start().chars().next().is_none_or(|c| c == '{') {
        return 0;
    }
    let rest = &text[known..];
    if let Some(at) = rest.find(TAG) {
        return known + at;
    }
    let partial = (1..TAG.len()).rev().find(|&n| rest.ends_with(&TAG[..n])).unwrap_or(0);
    text.len() - partial
}

fn call_of(value: &Value) -> Option<Call> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = value.get("arguments").or_else(|| value.get("parameters"))?;
    arguments.is_object().then(|| Call { name, arguments: arguments.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]
    }

    #[test]
    fn required_constrains_to_an_array_of_calls_and_reads_it_back() {
        let plan = plan(Some(&weather()), Some(&json!("required")), false).unwrap();
        let Some(Kind::JsonSchema(schema)) = plan.constraint.clone().unwrap().kind else { panic!("a schema") };
        let schema: Value = serde_json::from_str(&schema).unwrap();
        assert_eq!((schema["minItems"].clone(), schema["maxItems"].clone()), (json!(1), json!(1)));
        let calls = plan.calls(r#"[{"name": "get_weather", "arguments": {"city": "Paris"}}]"#).unwrap();
        assert_eq!(calls, vec![Call { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }]);
    }

    #[test]
    fn auto_reads_hermes_calls_and_leaves_text_alone() {
        let plan = plan(Some(&weather()), None, true).unwrap();
        assert_eq!(plan.mode, Mode::Auto);
        assert!(plan.constraint.is_none());
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert_eq!(plan.calls(text).unwrap()[0].name, "get_weather");
        assert_eq!(plan.calls("It is sunny."), None);
        assert_eq!(plan.calls(r#"{"name": "unknown_tool", "arguments": {}}"#), None);
    }

    #[test]
    fn required_calls_stream_their_names_then_their_arguments() {
        let plan = plan(Some(&weather()), Some(&json!("required")), true).unwrap();
        let Some(Kind::JsonSchema(schema)) = plan.constraint.clone().unwrap().kind else { panic!("a schema") };
        let name_at = schema.find("\"name\"").unwrap();
        assert!(name_at < schema.find("\"arguments\"").unwrap(), "name first: {schema}");
        let text = r#"[{"name": "get_weather", "arguments": {"city": "Pa\"ris", "n": {"a": [1]}}}, {"name": "get_weather", "arguments": {}}]"#;
        let mut stream = CallStream::default();
        let mut pieces = Vec::new();
        for chunk in text.as_bytes().chunks(3) {  // splits names, keys and escapes
            pieces.extend(stream.push(std::str::from_utf8(chunk).unwrap()));
        }
        let starts: Vec<_> = pieces.iter().filter_map(|p| p.name.clone().map(|n| (p.index, n))).collect();
        assert_eq!(starts, vec![(0, "get_weather".to_owned()), (1, "get_weather".to_owned())]);
        let arguments = |index| pieces.iter().filter(|p| p.index == index).map(|p| p.arguments.as_str()).collect::<String>();
        assert_eq!(arguments(0), r#"{"city": "Pa\"ris", "n": {"a": [1]}}"#);
        assert_eq!(arguments(1), "{}");
        assert_eq!(plan.calls(text).unwrap().len(), 2);
    }

    #[test]
    fn auto_answers_stream_as_text_up_to_a_possible_call() {
        assert_eq!(text_part("  ", 0), 0);
        assert_eq!(text_part(" {\"name\"", 0), 0);
        assert_eq!(text_part("It is sunny", 0), 11);
        assert_eq!(text_part("Let me check. <tool", 0), 14);
        assert_eq!(text_part("Let me check. <tool_call>{", 0), 14);
        assert_eq!(text_part("Let me check. <tool_call>{", 14), 14);
        assert_eq!(text_part("a < b", 0), 5);
        assert_eq!(text_part("a set {1, 2}", 6), 12);  // a brace after text is text
    }

    #[test]
    fn bad_tool_choices_are_refused() {
        let tools = weather();
        for choice in [json!("sometimes"), json!({"type": "function", "function": {"name": "nope"}})] {
            assert!(plan(Some(&tools), Some(&choice), true).is_err(), "{choice}");
        }
        assert!(plan(None, Some(&json!("required")), true).is_err());
        assert!(plan(Some(&[json!({"type": "retrieval"})]), None, true).is_err());
    }
}
