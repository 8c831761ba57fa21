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

/// The key path of the first key an object of `bytes` names twice
/// (`limits.classes.expensive`; an array's item as `[2]`), at any depth; `None`
/// when every object names each key once, or when `bytes` is not JSON.
pub fn key_named_twice(bytes: &[u8]) -> Option<String> {
    let found = std::cell::RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let _ = de::DeserializeSeed::deserialize(
        KeysAt {
            path: String::new(),
            found: &found,
        },
        &mut deserializer,
    );
    found.into_inner()
}

/// A JSON value read for its keys alone, at `path`: the first key named twice is
/// kept in `found`.
struct KeysAt<'a> {
    path: String,
    found: &'a std::cell::RefCell<Option<String>>,
}

impl<'de> de::DeserializeSeed<'de> for KeysAt<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for KeysAt<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        while seq
            .next_element_seed(KeysAt {
                path: format!("{}[{i}]", self.path),
                found: self.found,
            })?
            .is_some()
        {
            i += 1;
        }
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = if self.path.is_empty() {
                key.clone()
            } else {
                format!("{}.{key}", self.path)
            };
            if !seen.insert(key) {
                *self.found.borrow_mut() = Some(path);
                return Err(de::Error::custom(DUPLICATE));
            }
            map.next_value_seed(KeysAt {
                path,
                found: self.found,
            })?;
        }
        Ok(())
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

    #[test]
    fn p4_a_key_named_twice_at_any_depth_is_named_by_its_key_path() {
        for (doc, path) in [
            (r#"{"plan":"a","plan":"b"}"#, "plan"),
            (
                r#"{"plan":"free","limits":{"classes":{"expensive":5,"expensive":500}}}"#,
                "limits.classes.expensive",
            ),
            (
                r#"{"limits":{"lanes":{"l":{"workspace_starts":1,"workspace_starts":2}}}}"#,
                "limits.lanes.l.workspace_starts",
            ),
            (r#"{"a":[{"k":1},{"k":1,"\u006b":2}]}"#, "a[1].k"),
            (r#"[1,[{"x":{"y":1,"y":1}}]]"#, "[1][0].x.y"),
        ] {
            assert_eq!(
                key_named_twice(doc.as_bytes()).as_deref(),
                Some(path),
                "{doc}"
            );
        }
        for doc in [
            r#"{"plan":"free","limits":{"classes":{"expensive":5},"buckets":{"expensive":5}}}"#,
            r#"[{"k":1},{"k":1}]"#,
            "",
            "{",
            "1",
        ] {
            assert_eq!(key_named_twice(doc.as_bytes()), None, "{doc}");
        }
    }
}
