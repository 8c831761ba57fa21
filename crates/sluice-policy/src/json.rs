//! JSON read as every reader reads it. An object that names a key twice is read
//! differently by different parsers (serde_json, Python and JavaScript keep the
//! last value; others keep the first), so a body sluice classifies or estimates
//! by one reading could be run by its upstream as the other: such a document is
//! not taken (SPEC E5: refused, never counted as something cheaper).

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Why [`parse_unique`] did not take a document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotUnique {
    /// Not JSON (or nested past the parser's depth of 128).
    NotJson,
    /// An object names a key twice.
    DuplicateKey,
}

const DUPLICATE: &str = "an object names a key twice";

/// `bytes` as one JSON value, every object's keys unique.
///
/// # Errors
/// [`NotUnique`].
pub fn parse_unique(bytes: &[u8]) -> Result<Value, NotUnique> {
    match serde_json::from_slice::<Unique>(bytes) {
        Ok(Unique(v)) => Ok(v),
        Err(e) if e.to_string().starts_with(DUPLICATE) => Err(NotUnique::DuplicateKey),
        Err(_) => Err(NotUnique::NotJson),
    }
}

/// A JSON value whose objects name each key once.
struct Unique(Value);

impl<'de> Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UniqueVisitor).map(Unique)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Unique::deserialize(d).map(|Unique(v)| v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(Unique(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(DUPLICATE));
            }
            let Unique(v) = map.next_value()?;
            object.insert(key, v);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e5_a_key_named_twice_is_not_taken_at_any_depth() {
        for doc in [
            r#"{"a":1,"a":2}"#,
            r#"{"params":{"name":"x","name":"y"}}"#,
            r#"[{"ok":1},{"m":[{"k":1,"k":1}]}]"#,
            r#"{"a":1,"\u0061":2}"#,
        ] {
            assert_eq!(
                parse_unique(doc.as_bytes()),
                Err(NotUnique::DuplicateKey),
                "{doc}"
            );
        }
        for doc in ["", "{", "[1,]", "1e999", "\"\\ud800\""] {
            assert_eq!(
                parse_unique(doc.as_bytes()),
                Err(NotUnique::NotJson),
                "{doc:?}"
            );
        }
        let doc = r#"{"a":[1,-2,3.5,"s",true,null,{"b":{}}],"c":{"a":1}}"#;
        assert_eq!(
            parse_unique(doc.as_bytes()),
            Ok(serde_json::from_str::<Value>(doc).expect("json"))
        );
    }
}
