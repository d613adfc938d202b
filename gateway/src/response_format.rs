//! Structured-output requests in OpenAI's spelling (`response_format`: `json_object`,
//! `json_schema`) and vLLM's (`structured_outputs` with `json` / `regex` / `choice` / `grammar`
//! / `json_object`, and the older `guided_json`, `guided_regex`, `guided_choice`,
//! `guided_grammar`), turned into the one `vlm.v1.StructuredOutput` the LM enforces. At most
//! one constraint per request; each malformed one is a 400 naming its field.
use crate::error::GatewayError;
use crate::openai::params::check_unread;
use serde_json::{Map, Value};
use vlm_proto::v1 as pb;
use vlm_proto::v1::structured_output::Kind;

/// The body fields that ask for structured output.
#[derive(Debug, Default, serde::Deserialize)]
pub struct StructuredFields {
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Map<String, Value>>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

fn schema_text(param: &str, v: &Value) -> Result<String, GatewayError> {
    match v {
        // vLLM accepts the schema as JSON text too.
        Value::String(s) => Ok(s.clone()),
        Value::Object(_) | Value::Bool(true) => Ok(v.to_string()),
        _ => Err(GatewayError::param(
            param,
            format!("{param} must be a JSON Schema (an object, or its JSON text)"),
        )),
    }
}

fn response_format(v: &Value) -> Result<Option<Kind>, GatewayError> {
    let Some(obj) = v.as_object() else {
        return Err(GatewayError::param(
            "response_format",
            "response_format must be an object with a `type`",
        ));
    };
    let t = obj.get("type").and_then(Value::as_str).unwrap_or("");
    let mut rest = obj.clone();
    rest.remove("type");
    match t {
        "text" => {
            check_unread(&rest, "response_format.")?;
            Ok(None)
        }
        "json_object" => {
            check_unread(&rest, "response_format.")?;
            Ok(Some(Kind::JsonObject(true)))
        }
        "json_schema" => {
            let Some(js) = rest.remove("json_schema") else {
                return Err(GatewayError::param(
                    "response_format.json_schema",
                    "response_format.json_schema is required with type json_schema",
                ));
            };
            check_unread(&rest, "response_format.")?;
            let Some(js) = js.as_object() else {
                return Err(GatewayError::param(
                    "response_format.json_schema",
                    "response_format.json_schema must be an object {name, schema, strict}",
                ));
            };
            let mut js = js.clone();
            let schema = js.remove("schema").unwrap_or(Value::Bool(true));
            // `name` and `description` label the schema; `strict` is what this server always
            // does (the grammar enforces the schema exactly).
            for k in ["name", "description", "strict"] {
                js.remove(k);
            }
            check_unread(&js, "response_format.json_schema.")?;
            Ok(Some(Kind::JsonSchema(schema_text(
                "response_format.json_schema.schema",
                &schema,
            )?)))
        }
        other => Err(GatewayError::param(
            "response_format.type",
            format!("response_format.type {other:?} is not one of text, json_object, json_schema"),
        )),
    }
}

fn structured_outputs(m: &Map<String, Value>) -> Result<Vec<(String, Kind)>, GatewayError> {
    let mut out = Vec::new();
    let mut rest = Map::new();
    for (k, v) in m {
        let param = format!("structured_outputs.{k}");
        if v.is_null() {
            continue;
        }
        let kind = match k.as_str() {
            "json" => Kind::JsonSchema(schema_text(&param, v)?),
            "regex" | "grammar" => {
                let Some(s) = v.as_str() else {
                    return Err(GatewayError::param(
                        &param,
                        format!("{param} must be a string"),
                    ));
                };
                if k == "regex" {
                    Kind::Regex(s.to_string())
                } else {
                    Kind::Lark(s.to_string())
                }
            }
            "choice" => Kind::Choice(pb::ChoiceList {
                choices: serde_json::from_value(v.clone()).map_err(|_| {
                    GatewayError::param(&param, format!("{param} must be a list of strings"))
                })?,
            }),
            "json_object" => match v.as_bool() {
                Some(true) => Kind::JsonObject(true),
                Some(false) => continue,
                None => {
                    return Err(GatewayError::param(
                        &param,
                        format!("{param} must be a boolean"),
                    ))
                }
            },
            _ => {
                rest.insert(k.clone(), v.clone());
                continue;
            }
        };
        out.push((param, kind));
    }
    check_unread(&rest, "structured_outputs.")?;
    Ok(out)
}

/// The one constraint the body asks for, if any.
pub fn structured_output(
    f: StructuredFields,
) -> Result<Option<pb::StructuredOutput>, GatewayError> {
    let mut asked: Vec<(String, Kind)> = Vec::new();
    if let Some(v) = &f.response_format {
        if let Some(k) = response_format(v)? {
            asked.push(("response_format".into(), k));
        }
    }
    if let Some(m) = &f.structured_outputs {
        asked.extend(structured_outputs(m)?);
    }
    if let Some(v) = &f.guided_json {
        asked.push((
            "guided_json".into(),
            Kind::JsonSchema(schema_text("guided_json", v)?),
        ));
    }
    if let Some(s) = f.guided_regex {
        asked.push(("guided_regex".into(), Kind::Regex(s)));
    }
    if let Some(c) = f.guided_choice {
        asked.push((
            "guided_choice".into(),
            Kind::Choice(pb::ChoiceList { choices: c }),
        ));
    }
    if let Some(s) = f.guided_grammar {
        asked.push(("guided_grammar".into(), Kind::Lark(s)));
    }
    match asked.len() {
        0 => Ok(None),
        1 => Ok(asked
            .pop()
            .map(|(_, k)| pb::StructuredOutput { kind: Some(k) })),
        _ => {
            let names: Vec<&str> = asked.iter().map(|(p, _)| p.as_str()).collect();
            Err(GatewayError::param(
                &asked[1].0,
                format!(
                    "one structured-output constraint per request; this one asks for {}",
                    names.join(" and ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<Kind>, GatewayError> {
        let f: StructuredFields = serde_json::from_value(v).unwrap();
        structured_output(f).map(|o| o.and_then(|s| s.kind))
    }

    #[test]
    fn every_spelling_maps_to_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(
            parse(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_object"}})).unwrap(),
            Some(Kind::JsonObject(true))
        );
        let want = Some(Kind::JsonSchema(schema.to_string()));
        assert_eq!(
            parse(
                json!({"response_format": {"type": "json_schema", "json_schema":
                {"name": "x", "strict": true, "schema": schema}}})
            )
            .unwrap(),
            want
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"json": schema}})).unwrap(),
            want
        );
        assert_eq!(parse(json!({"guided_json": schema})).unwrap(), want);
        assert_eq!(
            parse(json!({"guided_json": schema.to_string()})).unwrap(),
            want
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"regex": "a+"}})).unwrap(),
            Some(Kind::Regex("a+".into()))
        );
        assert_eq!(
            parse(json!({"guided_choice": ["x", "y"]})).unwrap(),
            Some(Kind::Choice(pb::ChoiceList {
                choices: vec!["x".into(), "y".into()]
            }))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"grammar": "start: \"a\""}})).unwrap(),
            Some(Kind::Lark("start: \"a\"".into()))
        );
    }

    #[test]
    fn a_schema_keeps_its_property_order() {
        // The order properties are written in is the schema's, not alphabetical.
        let body =
            r#"{"guided_json": {"type": "object", "properties": {"zeta": {}, "alpha": {}}}}"#;
        let f: StructuredFields = serde_json::from_str(body).unwrap();
        let Some(Kind::JsonSchema(text)) = structured_output(f).unwrap().and_then(|s| s.kind)
        else {
            panic!("no schema");
        };
        assert!(
            text.find("zeta").unwrap() < text.find("alpha").unwrap(),
            "{text}"
        );
    }

    #[test]
    fn malformed_or_doubled_constraints_name_their_field() {
        for (v, param) in [
            (
                json!({"response_format": {"type": "bogus"}}),
                "response_format.type",
            ),
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}}),
                "response_format.json_schema.x",
            ),
            (
                json!({"structured_outputs": {"choice": [1]}}),
                "structured_outputs.choice",
            ),
            (
                json!({"structured_outputs": {"backend": "xgrammar"}}),
                "structured_outputs.backend",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            let e = parse(v.clone()).unwrap_err();
            assert_eq!(e.param_name(), Some(param), "{v}: {e}");
        }
    }
}
