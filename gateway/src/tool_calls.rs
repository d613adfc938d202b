//! Tool calling in Qwen3's format. `tools` go to the chat template (which lists them in the
//! system turn); the model answers a call as `<tool_call>\n{"name": ..., "arguments": {...}}\n
//! </tool_call>`, which is parsed back into OpenAI `tool_calls`. `tool_choice: "required"` or a
//! named function is enforced with a grammar (a Lark grammar whose calls are JSON Schemas of
//! the functions' parameters), so even a weak model's answer is a valid call.
use crate::error::GatewayError;
use serde_json::{json, Value};

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";
/// Most tools per request.
pub const MAX_TOOLS: usize = 128;

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    Required,
    Named(String),
}

/// The tools of a request that may call them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// As OpenAI sends them (`{"type": "function", "function": {...}}`), for the template.
    pub defs: Vec<Value>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per answer.
    pub parallel: bool,
}

fn function_name(i: usize, t: &Value) -> Result<&str, GatewayError> {
    let param = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(GatewayError::param(
            &format!("{param}.type"),
            format!("{param}.type must be \"function\""),
        ));
    }
    let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
        GatewayError::param(
            &format!("{param}.function"),
            format!("{param}.function must be an object"),
        )
    })?;
    let name = f.get("name").and_then(Value::as_str).unwrap_or("");
    if name.is_empty() || name.len() > 64 {
        return Err(GatewayError::param(
            &format!("{param}.function.name"),
            format!("{param}.function.name must be 1 to 64 characters"),
        ));
    }
    if let Some(p) = f.get("parameters") {
        if !p.is_object() && !p.is_null() {
            return Err(GatewayError::param(
                &format!("{param}.function.parameters"),
                format!("{param}.function.parameters must be a JSON Schema object"),
            ));
        }
    }
    Ok(name)
}

/// The request's tools and choice; `None` when no tool may be called (no tools, or
/// `tool_choice: "none"`).
pub fn parse(
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, GatewayError> {
    let defs = tools.unwrap_or_default();
    if defs.len() > MAX_TOOLS {
        return Err(GatewayError::param(
            "tools",
            format!("{} tools given, over the limit of {MAX_TOOLS}", defs.len()),
        ));
    }
    let mut names = Vec::with_capacity(defs.len());
    for (i, t) in defs.iter().enumerate() {
        names.push(function_name(i, t)?.to_string());
    }
    let choice = match &tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(GatewayError::param(
                    "tool_choice",
                    format!("tool_choice {other:?} is not one of none, auto, required, or a named function"),
                ))
            }
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => {
                if !names.iter().any(|x| x == n) {
                    return Err(GatewayError::param(
                        "tool_choice",
                        format!("tool_choice names function {n:?}, which is not in tools"),
                    ));
                }
                ToolChoice::Named(n.to_string())
            }
            _ => {
                return Err(GatewayError::param(
                    "tool_choice",
                    "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if defs.is_empty() {
        if choice != ToolChoice::Auto {
            return Err(GatewayError::param(
                "tool_choice",
                "tool_choice needs tools",
            ));
        }
        return Ok(None);
    }
    Ok(Some(Tools {
        defs,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

impl Tools {
    /// The Lark grammar that forces calls (`required`: any of the tools; named: that one),
    /// `None` for `auto`. Each call's JSON is written as the template renders past calls.
    pub fn grammar(&self) -> Option<String> {
        let only = match &self.choice {
            ToolChoice::Auto => return None,
            ToolChoice::Required => None,
            ToolChoice::Named(n) => Some(n.as_str()),
        };
        let mut rules = Vec::new();
        for t in &self.defs {
            let f = &t["function"];
            let name = f["name"].as_str().unwrap_or_default();
            if only.is_some_and(|o| o != name) {
                continue;
            }
            // No `parameters`: OpenAI's "empty parameter list".
            let params = match f.get("parameters") {
                Some(p) if p.is_object() => p.clone(),
                _ => json!({"type": "object", "properties": {}, "additionalProperties": false}),
            };
            let schema = json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
                "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
            });
            rules.push(format!("fn{}: %json {schema}", rules.len()));
        }
        let alts: Vec<String> = (0..rules.len()).map(|i| format!("fn{i}")).collect();
        let call = format!(
            "call: {OPEN:?} \"\\n\" ({}) \"\\n\" {CLOSE:?}",
            alts.join(" | ")
        );
        let start = if self.parallel {
            "start: call (\"\\n\" call)*"
        } else {
            "start: call"
        };
        Some(format!("{start}\n{call}\n{}\n", rules.join("\n")))
    }
}

/// A parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments object as JSON text.
    pub arguments: String,
}

impl ParsedCall {
    /// OpenAI's `tool_calls[i]` (with `index` for streamed deltas).
    pub fn openai_json(&self, index: usize, id: &str) -> Value {
        json!({"index": index, "id": id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// The answer split into its content (text outside the call blocks, trimmed) and its calls.
/// A block that is not a `{"name", "arguments"}` object stays in the content, as it was.
pub fn split(text: &str, parallel: bool) -> (String, Vec<ParsedCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let after = &rest[at + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        let parsed = serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| {
                let name = v.get("name")?.as_str()?.to_string();
                let args = v.get("arguments").cloned().unwrap_or(json!({}));
                let arguments = match args {
                    Value::String(s) => s,
                    Value::Object(_) => args.to_string(),
                    _ => return None,
                };
                Some(ParsedCall { name, arguments })
            });
        match parsed {
            Some(c) if parallel || calls.is_empty() => calls.push(c),
            Some(_) => {}
            None => content.push_str(&rest[at..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// Streaming: text is shown until a call block may be starting (a suffix that could begin
/// `<tool_call>` is held back); from the first block on, everything is kept for [`split`] at
/// the end.
#[derive(Debug, Default)]
pub struct CallStream {
    held: String,
    in_call: bool,
}

impl CallStream {
    /// What may be shown of `text` now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_call {
            return String::new();
        }
        if let Some(at) = self.held.find(OPEN) {
            self.in_call = true;
            let shown = self.held[..at].to_string();
            self.held.drain(..at);
            return shown;
        }
        let keep = (1..OPEN.len())
            .rev()
            .find(|&k| self.held.ends_with(&OPEN[..k]))
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let shown = self.held[..cut].to_string();
        self.held.drain(..cut);
        shown
    }

    /// At the end: the text not shown yet (content) and the calls.
    pub fn finish(&mut self, parallel: bool) -> (String, Vec<ParsedCall>) {
        let held = std::mem::take(&mut self.held);
        if !self.in_call {
            return (held, Vec::new());
        }
        let (content, calls) = split(&held, parallel);
        (content, calls)
    }
}

/// A call id as OpenAI writes them.
pub fn call_id() -> String {
    format!(
        "call_{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Result<Option<Tools>, GatewayError> {
        parse(
            Some(vec![
                json!({"type": "function", "function": {"name": "get_weather", "parameters":
                    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
                json!({"type": "function", "function": {"name": "now"}}),
            ]),
            Some(choice),
            None,
        )
    }

    #[test]
    fn choices_parse_and_bad_ones_name_their_field() {
        assert_eq!(tools(json!("none")).unwrap(), None);
        assert_eq!(
            tools(json!("auto")).unwrap().unwrap().choice,
            ToolChoice::Auto
        );
        assert_eq!(
            tools(json!("required")).unwrap().unwrap().choice,
            ToolChoice::Required
        );
        assert_eq!(
            tools(json!({"type": "function", "function": {"name": "now"}}))
                .unwrap()
                .unwrap()
                .choice,
            ToolChoice::Named("now".into())
        );
        for (choice, needle) in [
            (json!("sometimes"), "not one of"),
            (
                json!({"type": "function", "function": {"name": "nope"}}),
                "not in tools",
            ),
            (json!(3), "must be none"),
        ] {
            let e = tools(choice).unwrap_err();
            assert_eq!(e.param_name(), Some("tool_choice"));
            assert!(e.to_string().contains(needle), "{e}");
        }
        let e = parse(
            Some(vec![json!({"type": "function", "function": {}})]),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(e.param_name(), Some("tools[0].function.name"));
        assert_eq!(parse(None, None, None).unwrap(), None);
        assert!(parse(None, Some(json!("required")), None).is_err());
    }

    #[test]
    fn required_and_named_grammars_list_the_right_functions() {
        let g = tools(json!("required"))
            .unwrap()
            .unwrap()
            .grammar()
            .unwrap();
        assert!(g.contains("get_weather") && g.contains("\"now\""), "{g}");
        assert!(g.starts_with("start: call (\"\\n\" call)*"), "{g}");
        // Qwen writes the name first.
        assert!(
            g.find("\"name\"").unwrap() < g.find("\"arguments\"").unwrap(),
            "{g}"
        );
        let g = tools(json!({"type": "function", "function": {"name": "now"}}))
            .unwrap()
            .unwrap()
            .grammar()
            .unwrap();
        assert!(!g.contains("get_weather") && g.contains("\"now\""), "{g}");
        assert_eq!(tools(json!("auto")).unwrap().unwrap().grammar(), None);
    }

    #[test]
    fn answers_split_into_content_and_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = split(text, true);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            serde_json::from_str::<Value>(&calls[0].arguments).unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(split(text, false).1.len(), 1);
        // A block that is no call stays text.
        let (content, calls) = split("a <tool_call>not json</tool_call> b", true);
        assert_eq!(
            (content.as_str(), calls.len()),
            ("a <tool_call>not json</tool_call> b", 0)
        );
        // The stream shows text up to the block, holds a possible start, and parses at the end.
        let mut s = CallStream::default();
        let mut shown = String::new();
        for piece in [
            "Let me",
            " check.\n<tool",
            "_call>\n{\"name\": \"now\", ",
            "\"arguments\": {}}\n</tool_call>",
        ] {
            shown.push_str(&s.push(piece));
        }
        assert_eq!(shown, "Let me check.\n");
        let (rest, calls) = s.finish(true);
        assert_eq!((rest.as_str(), calls.len()), ("", 1));
        let mut s = CallStream::default();
        assert_eq!(s.push("a <to"), "a ");
        assert_eq!(s.push("y"), "<toy");
        assert_eq!(s.finish(true), (String::new(), Vec::new()));
    }
}
