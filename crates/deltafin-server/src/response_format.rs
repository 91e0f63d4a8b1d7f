//! `response_format`: plain text (the default), any JSON object, or JSON that a schema accepts,
//! as OpenAI's chat API takes it. The schema is compiled later, off the async workers, by
//! `deltafin::Grammars`; here only its shape is checked.

use serde_json::Value;

use crate::request::ApiError;

/// What shape the reply must have.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// `{"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
    JsonSchema(Value),
}

impl ResponseFormat {
    /// The schema to compile (`None`: any object).
    pub fn schema(&self) -> Option<&Value> {
        match self {
            ResponseFormat::JsonObject => None,
            ResponseFormat::JsonSchema(s) => Some(s),
        }
    }
}

/// Reads `response_format` (`None`: text).
pub fn parse(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    let bad = |why: &str| ApiError::bad("response_format", why.to_string());
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let kind = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`response_format` must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(ResponseFormat::JsonObject)),
        "json_schema" => {
            let js = v
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("`response_format.json_schema` must be an object with `name` and `schema`"))?;
            if let Some(n) = js.get("name") {
                let ok = n.as_str().is_some_and(|n| {
                    !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                });
                if !ok {
                    return Err(bad("`response_format.json_schema.name` must be 1-64 letters, digits, `_` or `-`"));
                }
            }
            if js.get("strict").is_some_and(|s| !s.is_null() && !s.is_boolean()) {
                return Err(bad("`response_format.json_schema.strict` must be a boolean"));
            }
            // Without a schema, any JSON object (what `strict: false` with no schema means).
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(ResponseFormat::JsonObject)),
                Some(s @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(ResponseFormat::JsonSchema(s.clone()))),
                Some(_) => Err(bad("`response_format.json_schema.schema` must be a JSON schema object")),
            }
        }
        other => Err(bad(&format!("`response_format.type` {other:?} is not one of text, json_object, json_schema"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_three_types_and_their_mistakes() {
        assert_eq!(parse(None).unwrap(), None);
        assert_eq!(parse(Some(&json!({"type": "text"}))).unwrap(), None);
        assert_eq!(parse(Some(&json!({"type": "json_object"}))).unwrap(), Some(ResponseFormat::JsonObject));
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let got = parse(Some(&json!({"type": "json_schema", "json_schema": {"name": "a_1", "schema": s, "strict": true}}))).unwrap();
        assert_eq!(got, Some(ResponseFormat::JsonSchema(s)));
        for bad in [
            json!({"type": "xml"}),
            json!({"kind": "json_object"}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}),
        ] {
            let e = parse(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("response_format"), "{bad}");
        }
    }
}
