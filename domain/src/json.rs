//! JSON payloads read with errors that name where and what, never a value: the text of a failed read goes
//! to logs and to the dead-letter `dlq.error` header, where payload values (amounts, ids, names, card
//! tokens) must not appear. serde's own text quotes them (`invalid type: string "…", expected u64`).

use serde::de::DeserializeOwned;

/// Reads `payload` as `T`; on failure, [`describe`]'s reason.
pub fn read<T: DeserializeOwned>(payload: &[u8]) -> Result<T, String> {
    let mut de = serde_json::Deserializer::from_slice(payload);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        describe(e.inner(), &path)
    })
}

/// Why a JSON read failed, without the values serde quotes: the field's path (`data.object.amount`; `.` for
/// the document), what was expected (a type: schema, not data), and the position.
pub fn describe(e: &serde_json::Error, path: &str) -> String {
    use serde_json::error::Category;
    let text = e.to_string();
    let field = if path.is_empty() || path == "." { "the document".to_owned() } else { format!("field {path}") };
    // `invalid type: <value>, expected <schema> at line …`: the expectation is the schema's
    let expected = || {
        text.rsplit_once(", expected ")
            .map(|(_, rest)| rest.rsplit_once(" at line ").map_or(rest, |(e, _)| e).to_owned())
            .filter(|e| !e.contains('"'))
    };
    let named = |prefix: &str| text.strip_prefix(prefix).and_then(|rest| rest.split('`').next()).map(str::to_owned);
    let what = match e.classify() {
        Category::Syntax => "the body is not valid JSON".to_owned(),
        Category::Eof => "the body ends early".to_owned(),
        Category::Io => "the body could not be read".to_owned(),
        Category::Data => {
            if let Some(missing) = named("missing field `") {
                let at = if field == "the document" { String::new() } else { format!(" in {field}") };
                format!("missing field {missing}{at}")
            } else if let Some(unknown) = named("unknown field `") {
                format!("unknown field {unknown}")
            } else if text.starts_with("unknown variant") {
                format!("{field}: unknown type or variant")
            } else if text.starts_with("invalid type") || text.starts_with("invalid value") {
                match expected() {
                    Some(expected) => format!("{field} has the wrong type or an invalid value: expected {expected}"),
                    None => format!("{field} has the wrong type or an invalid value"),
                }
            } else {
                format!("{field} has the wrong type or an invalid value")
            }
        }
    };
    format!("{what} (line {}, column {})", e.line(), e.column())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Order {
        id: u64,
        customer: Customer,
        tags: Vec<String>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Customer {
        card: uuid::Uuid,
    }

    /// Issue 44: a `Dispatch` read error and a dead letter's reason name the field and the expected type,
    /// never the value.
    #[test]
    fn a_failed_read_names_the_field_and_the_type_never_the_value() {
        for (payload, secret, expected) in [
            (r#"{"id":"SECRET-1","customer":{"card":"x"},"tags":[]}"#, "SECRET-1", "field id has the wrong type"),
            (r#"{"id":1,"customer":{"card":"SECRET-2"},"tags":[]}"#, "SECRET-2", "field customer.card"),
            (
                r#"{"id":1,"customer":{"card":"0193a000-0000-7000-8000-000000000001"},"tags":[7777777]}"#,
                "7777777",
                "tags[0]",
            ),
            (r#"{"id":1,"customer":{}}"#, "", "missing field card in field customer"),
            (r#"{"id": "SECRET-3"#, "SECRET-3", "ends early"),
        ] {
            let why = read::<Order>(payload.as_bytes()).expect_err("a bad payload");
            assert!(secret.is_empty() || !why.contains(secret), "{why} echoes {secret}");
            assert!(why.contains(expected), "{why}: expected {expected:?}");
        }
        let why = read::<Order>(br#"{"id":"a","customer":{"card":"x"},"tags":[]}"#).expect_err("bad");
        assert!(why.contains("expected u64"), "{why}");
    }
}
