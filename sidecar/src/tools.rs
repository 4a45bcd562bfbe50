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

fn invalid(message: impl Into<String>) -> SidecarError {
    SidecarError::InvalidRequest(message.into())
}

pub fn plan(tools: Option<&[Value]>, choice: Option<&Value>, parallel: bool) -> Result<ToolPlan, SidecarError> {
    let tools = tools.unwrap_or_default();
    let mut names = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let name = tool.pointer("/function/name").and_then(Value::as_str).filter(|n| !n.is_empty());
        match (tool.get("type").and_then(Value::as_str), name) {
            (Some("function"), Some(name)) => names.push(name.to_owned()),
            _ => return Err(invalid(format!("tools[{i}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"))),
        }
        if tool.pointer("/function/parameters").is_some_and(|p| !p.is_object()) {
            return Err(invalid(format!("tools[{i}].function.parameters: must be a JSON Schema object")));
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
            _ => return Err(invalid("tool_choice: none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}")),
        },
    };
    if mode != Mode::None && tools.is_empty() {
        return Err(invalid("tool_choice: no tools given"));
    }
    if let Mode::Named(name) = &mode {
        if !names.contains(name) {
            return Err(invalid(format!("tool_choice: no tool is named {name:?}")));
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

    /// Whether the answer must be read whole before it is known to be text or calls.
    pub fn buffers(&self) -> bool {
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
    fn bad_tool_choices_are_refused() {
        let tools = weather();
        for choice in [json!("sometimes"), json!({"type": "function", "function": {"name": "nope"}})] {
            assert!(plan(Some(&tools), Some(&choice), true).is_err(), "{choice}");
        }
        assert!(plan(None, Some(&json!("required")), true).is_err());
        assert!(plan(Some(&[json!({"type": "retrieval"})]), None, true).is_err());
    }
}
