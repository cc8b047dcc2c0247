//! What every HTTP API of nvpool does alike on the server side (feature
//! `http-server`): the control plane's REST API, the target's admin API
//! and the agent's API call these, so that one rule has one copy.
//!
//! - [`bearer`]: the token of an `Authorization: Bearer TOKEN` header, the
//!   scheme in any case (RFC 9110 11.1), one or more spaces after it.
//! - [`json_body`]: a request body as a typed value. The body must say
//!   `Content-Type: application/json` (or `application/*+json`), else
//!   415; it must be one JSON document with no key twice in any object,
//!   and a type that is a JSON object in the schema (a struct) must be an
//!   object in the body, never an array (serde alone would fill a struct
//!   from an array by position): else 400. Integral floats (`3.0`) count as
//!   integers, as JSON Schema says.
//! - [`path`]: path parameters, a segment that does not decode a 400.
//! - [`Rejection`]: what went wrong, with the status and the error kind;
//!   each API wraps it into its own `{kind, message}` error body.
//!
//! Each API's router also answers a method its path does not take (405)
//! and an unknown path (404) with its JSON error rather than axum's empty
//! body; that fallback is each router's own (it needs the API's error
//! type) and a test of each API checks it.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, EnumAccess, Error as _, IntoDeserializer, MapAccess,
    SeqAccess, Unexpected, VariantAccess, Visitor,
};
use serde_json::{Map, Value};
use std::fmt;

/// The token an `Authorization` header value presents: `Bearer TOKEN`,
/// the scheme in any case, then one or more spaces; spaces around the
/// token are dropped. None for another scheme or an empty token. The one
/// parser of the control plane's REST API, the target's admin API and any
/// other nvpool server.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer";
    let (scheme, rest) = value.split_at_checked(SCHEME.len())?;
    if !scheme.eq_ignore_ascii_case(SCHEME) || rest.first() != Some(&b' ') {
        return None;
    }
    let start = rest.iter().position(|b| *b != b' ')?;
    let end = rest.iter().rposition(|b| *b != b' ')? + 1;
    Some(&rest[start..end])
}

/// [`bearer`] of a request's `Authorization` header: `Err(())` when the
/// header is there but holds no bearer token, `Ok(None)` when it is absent.
#[allow(clippy::result_unit_err)]
pub fn bearer_of(headers: &HeaderMap) -> Result<Option<&[u8]>, ()> {
    match headers.get(header::AUTHORIZATION) {
        None => Ok(None),
        Some(v) => bearer(v.as_bytes()).map(Some).ok_or(()),
    }
}

/// Why a request body was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// 415 for a missing or wrong content type, 400 otherwise.
    pub status: StatusCode,
    /// `unsupported_media_type` or `invalid`.
    pub kind: &'static str,
    pub message: String,
}

impl Rejection {
    fn invalid(message: impl Into<String>) -> Rejection {
        Rejection {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid",
            message: message.into(),
        }
    }
}

/// Whether the request says its body is JSON: `application/json` or
/// `application/*+json`, parameters (`; charset=utf-8`) allowed.
pub fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = ct.split(';').next().unwrap_or("").trim();
    let Some((ty, sub)) = essence.split_once('/') else {
        return false;
    };
    let sub = sub.to_ascii_lowercase();
    ty.eq_ignore_ascii_case("application") && (sub == "json" || sub.ends_with("+json"))
}

/// The body of `req` as a `T` (see the module's rules). With `optional`,
/// an empty (or all-whitespace) body is `None` whatever its content type;
/// otherwise it is refused like any body that is not JSON.
pub async fn json_body<T: DeserializeOwned, S: Send + Sync>(
    req: Request,
    state: &S,
    optional: bool,
) -> Result<Option<T>, Rejection> {
    let json = is_json(req.headers());
    let bytes = Bytes::from_request(req, state)
        .await
        .map_err(|e| Rejection::invalid(e.body_text()))?;
    if optional && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    if !json {
        return Err(Rejection {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            kind: "unsupported_media_type",
            message: "the request body must be JSON: send Content-Type: application/json".into(),
        });
    }
    let v = parse(&bytes).map_err(|e| Rejection::invalid(format!("invalid JSON body: {e}")))?;
    decode(v).map(Some).map_err(Rejection::invalid)
}

/// The path parameters of a request as a `T` (axum's `Path`), a segment
/// that does not decode (not UTF-8 once percent-decoded, not a number
/// where one is wanted) refused as a 400 the API answers with its JSON
/// error, never axum's plain-text one.
pub async fn path<T: DeserializeOwned + Send, S: Send + Sync>(
    parts: &mut axum::http::request::Parts,
    state: &S,
) -> Result<T, Rejection> {
    use axum::extract::FromRequestParts;
    match axum::extract::Path::<T>::from_request_parts(parts, state).await {
        Ok(axum::extract::Path(v)) => Ok(v),
        Err(e) => Err(Rejection::invalid(e.body_text())),
    }
}

/// One JSON document, refusing an object that names a key twice (serde
/// would keep the last one silently: two clients could read one body two
/// ways). serde_json's nesting limit (128) applies.
pub fn parse(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut d = serde_json::Deserializer::from_slice(bytes);
    let v = Unique.deserialize(&mut d)?;
    d.end()?;
    Ok(v)
}

/// A value decoded as a `T`: integral floats as integers, a struct only
/// from an object, and the path of whatever did not fit in the message
/// (`invalid JSON body: devices[0].id: …`).
pub fn decode<T: DeserializeOwned>(mut v: Value) -> Result<T, String> {
    integral_floats_as_integers(&mut v);
    serde_path_to_error::deserialize(Strict(v)).map_err(|e| {
        let at = e.path().to_string();
        match at.as_str() {
            "." => format!("invalid JSON body: {}", e.inner()),
            _ => format!("invalid JSON body: {at}: {}", e.inner()),
        }
    })
}

/// JSON Schema counts `3.0` as an integer, and the documents say
/// "integer": such numbers become integers before the body is decoded
/// (serde would refuse a float where it wants a u64). Others stay floats.
fn integral_floats_as_integers(v: &mut Value) {
    match v {
        Value::Number(n) if !n.is_u64() && !n.is_i64() => {
            if let Some(f) = n.as_f64() {
                // Exactly representable and integral: below 2^53 every such
                // float is an exact integer.
                if f.fract() == 0.0 && f.abs() < (1u64 << 53) as f64 {
                    *v = if f < 0.0 {
                        Value::from(f as i64)
                    } else {
                        Value::from(f as u64)
                    };
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

// ----- parsing without duplicate keys -----

/// Builds a [`Value`] like serde_json's own, refusing duplicate keys.
struct Unique;

impl<'de> DeserializeSeed<'de> for Unique {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Unique {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::from(n))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::from(n))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(Unique)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(Unique)? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                return Err(A::Error::custom(format_args!("duplicate key {k:?}")));
            }
            let v = map.next_value_seed(Unique)?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

// ----- decoding with structs from objects only -----

/// A [`Value`] as a deserializer that is serde_json's own but for one
/// rule: a struct (or a struct variant) comes from an object only.
struct Strict(Value);

type JsonError = serde_json::Error;

macro_rules! forward_to_value {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
                de::Deserializer::$method(self.0, v)
            }
        )*
    };
}

fn visit_array<'de, V: Visitor<'de>>(items: Vec<Value>, v: V) -> Result<V::Value, JsonError> {
    let len = items.len();
    let mut seq = Seq(items.into_iter());
    let out = v.visit_seq(&mut seq)?;
    match seq.0.len() {
        0 => Ok(out),
        _ => Err(JsonError::invalid_length(len, &"fewer elements in array")),
    }
}

fn visit_object<'de, V: Visitor<'de>>(m: Map<String, Value>, v: V) -> Result<V::Value, JsonError> {
    let len = m.len();
    let mut access = Fields {
        iter: m.into_iter(),
        value: None,
    };
    let out = v.visit_map(&mut access)?;
    match access.iter.len() {
        0 => Ok(out),
        _ => Err(JsonError::invalid_length(len, &"fewer elements in map")),
    }
}

impl<'de> de::Deserializer<'de> for Strict {
    type Error = JsonError;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        match self.0 {
            Value::Array(_) if is_tagged_enum(&v) => {
                Err(JsonError::invalid_type(Unexpected::Seq, &v))
            }
            Value::Array(items) => visit_array(items, v),
            Value::Object(m) => visit_object(m, v),
            other => other.deserialize_any(v),
        }
    }

    forward_to_value! {
        deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64
        deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64
        deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char deserialize_str
        deserialize_string deserialize_bytes deserialize_byte_buf deserialize_unit
        deserialize_identifier
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        v: V,
    ) -> Result<V::Value, JsonError> {
        self.0.deserialize_unit_struct(name, v)
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        match self.0 {
            Value::Null => v.visit_none(),
            other => v.visit_some(Strict(other)),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, JsonError> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        match self.0 {
            Value::Array(items) => visit_array(items, v),
            other => other.deserialize_seq(v),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, v: V) -> Result<V::Value, JsonError> {
        self.deserialize_seq(v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        v: V,
    ) -> Result<V::Value, JsonError> {
        self.deserialize_seq(v)
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        match self.0 {
            Value::Object(m) => visit_object(m, v),
            other => other.deserialize_map(v),
        }
    }

    /// The one difference from serde_json: an array is refused here.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, JsonError> {
        self.deserialize_map(v)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, JsonError> {
        match self.0 {
            Value::String(variant) => v.visit_enum(Enum {
                variant,
                value: None,
            }),
            Value::Object(m) if m.len() == 1 => {
                let Some((variant, value)) = m.into_iter().next() else {
                    unreachable!("one entry")
                };
                v.visit_enum(Enum {
                    variant,
                    value: Some(value),
                })
            }
            other => other.deserialize_enum(name, variants, v),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        v.visit_unit()
    }
}

/// Whether `v` reads an internally tagged enum (`#[serde(tag = "…")]`,
/// a struct in the schema). serde reads one through `deserialize_any`
/// and would take an array's first element as its tag; its visitor is
/// told apart by what it says it expects ("internally tagged enum
/// LayoutBody"), the one thing serde lets a deserializer see of it.
fn is_tagged_enum(v: &dyn de::Expected) -> bool {
    v.to_string().starts_with("internally tagged enum")
}

struct Seq(std::vec::IntoIter<Value>);

impl<'de> SeqAccess<'de> for Seq {
    type Error = JsonError;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, JsonError> {
        self.0
            .next()
            .map(|v| seed.deserialize(Strict(v)))
            .transpose()
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Fields {
    iter: serde_json::map::IntoIter,
    value: Option<Value>,
}

impl<'de> MapAccess<'de> for Fields {
    type Error = JsonError;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, JsonError> {
        match self.iter.next() {
            Some((k, v)) => {
                self.value = Some(v);
                seed.deserialize(Key(k)).map(Some)
            }
            None => Ok(None),
        }
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, JsonError> {
        match self.value.take() {
            Some(v) => seed.deserialize(Strict(v)),
            None => Err(JsonError::custom("a map value asked for before its key")),
        }
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.iter.len())
    }
}

/// An object's key: a string, or a number written as one where the map's
/// key type is a number (as serde_json reads them).
struct Key(String);

macro_rules! key_number {
    ($($method:ident $visit:ident $ty:ty)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
                match self.0.parse::<$ty>() {
                    Ok(n) => v.$visit(n),
                    Err(_) => Err(JsonError::invalid_type(Unexpected::Str(&self.0), &v)),
                }
            }
        )*
    };
}

impl<'de> de::Deserializer<'de> for Key {
    type Error = JsonError;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        v.visit_string(self.0)
    }

    key_number! {
        deserialize_i8 visit_i8 i8 deserialize_i16 visit_i16 i16
        deserialize_i32 visit_i32 i32 deserialize_i64 visit_i64 i64
        deserialize_u8 visit_u8 u8 deserialize_u16 visit_u16 u16
        deserialize_u32 visit_u32 u32 deserialize_u64 visit_u64 u64
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, JsonError> {
        v.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, JsonError> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, JsonError> {
        v.visit_enum(Enum {
            variant: self.0,
            value: None,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i128 u128 f32 f64 char str string bytes byte_buf unit unit_struct seq tuple
        tuple_struct map struct identifier ignored_any
    }
}

/// An enum: `"variant"` or `{"variant": value}`.
struct Enum {
    variant: String,
    value: Option<Value>,
}

impl<'de> EnumAccess<'de> for Enum {
    type Error = JsonError;
    type Variant = Variant;
    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Variant), JsonError> {
        let variant: de::value::StringDeserializer<JsonError> = self.variant.into_deserializer();
        Ok((seed.deserialize(variant)?, Variant(self.value)))
    }
}

struct Variant(Option<Value>);

impl<'de> VariantAccess<'de> for Variant {
    type Error = JsonError;

    fn unit_variant(self) -> Result<(), JsonError> {
        match self.0 {
            None | Some(Value::Null) => Ok(()),
            Some(other) => Err(JsonError::invalid_type(unexpected(&other), &"unit variant")),
        }
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, JsonError> {
        match self.0 {
            Some(v) => seed.deserialize(Strict(v)),
            None => Err(JsonError::invalid_type(
                Unexpected::UnitVariant,
                &"newtype variant",
            )),
        }
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, v: V) -> Result<V::Value, JsonError> {
        match self.0 {
            Some(Value::Array(items)) => visit_array(items, v),
            Some(other) => Err(JsonError::invalid_type(
                unexpected(&other),
                &"tuple variant",
            )),
            None => Err(JsonError::invalid_type(
                Unexpected::UnitVariant,
                &"tuple variant",
            )),
        }
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, JsonError> {
        match self.0 {
            Some(Value::Object(m)) => visit_object(m, v),
            Some(other) => Err(JsonError::invalid_type(
                unexpected(&other),
                &"struct variant",
            )),
            None => Err(JsonError::invalid_type(
                Unexpected::UnitVariant,
                &"struct variant",
            )),
        }
    }
}

fn unexpected(v: &Value) -> Unexpected<'_> {
    match v {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(_) => Unexpected::Other("number"),
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[test]
    fn bearer_scheme_in_any_case() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"BEARER  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearerabc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"Bearer"), None);
        assert_eq!(bearer(b""), None);
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        a: u64,
        #[serde(default)]
        b: Option<String>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Outer {
        #[serde(default)]
        inner: Option<Inner>,
        #[serde(default)]
        list: Vec<Inner>,
        #[serde(default)]
        by_id: BTreeMap<u32, String>,
        #[serde(default)]
        mode: Option<Mode>,
        #[serde(default)]
        shape: Option<Shape>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    enum Shape {
        Square { side: u32 },
    }

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Plain,
        Sized(u64),
        Shaped { w: u32 },
    }

    fn strict<T: DeserializeOwned>(text: &str) -> Result<T, String> {
        decode(parse(text.as_bytes()).map_err(|e| e.to_string())?)
    }

    #[test]
    fn structs_only_from_objects() {
        assert!(strict::<Outer>("[]")
            .unwrap_err()
            .contains("expected struct Outer"));
        assert!(strict::<Outer>(r#"{"inner": [1]}"#)
            .unwrap_err()
            .contains("inner"));
        assert!(strict::<Outer>(r#"{"list": [{"a": 1}, [2]]}"#)
            .unwrap_err()
            .contains("list[1]"));
        assert!(strict::<Outer>(r#"{"mode": {"shaped": [3]}}"#).is_err());
        assert!(strict::<Shape>(r#"["square", 2]"#)
            .unwrap_err()
            .contains("internally tagged enum Shape"));
        assert!(strict::<Outer>(r#"{"shape": ["square", 2]}"#).is_err());
        assert_eq!(
            strict::<Shape>(r#"{"kind": "square", "side": 2}"#).unwrap(),
            Shape::Square { side: 2 }
        );
        let ok: Outer = strict(
            r#"{"inner": {"a": 2.0}, "list": [{"a": 1, "b": "x"}], "by_id": {"7": "s"}, "mode": {"sized": 4}}"#,
        )
        .unwrap();
        assert_eq!(ok.inner, Some(Inner { a: 2, b: None }));
        assert_eq!(ok.by_id.get(&7).map(String::as_str), Some("s"));
        assert_eq!(ok.mode, Some(Mode::Sized(4)));
        assert_eq!(
            strict::<Outer>(r#"{"mode": "plain"}"#).unwrap().mode,
            Some(Mode::Plain)
        );
        assert_eq!(
            strict::<Outer>(r#"{"mode": {"shaped": {"w": 1}}}"#)
                .unwrap()
                .mode,
            Some(Mode::Shaped { w: 1 })
        );
        // What the schema says is an array or a map is taken as before.
        assert_eq!(strict::<Vec<u8>>("[1, 2]").unwrap(), vec![1, 2]);
        assert!(strict::<Outer>(r#"{"unknown": 1}"#).is_err());
        assert!(strict::<Outer>(r#"{"by_id": {"x": "s"}}"#).is_err());
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert!(parse(br#"{"a": 1, "a": 2}"#)
            .unwrap_err()
            .to_string()
            .contains("duplicate key \"a\""));
        assert!(parse(br#"{"x": [{"a": 1, "b": {"c": 1, "c": 1}}]}"#).is_err());
        assert_eq!(
            parse(br#"{"a": {"a": 1}, "b": [1.5, null, true, "s"]}"#).unwrap(),
            serde_json::json!({"a": {"a": 1}, "b": [1.5, null, true, "s"]})
        );
        assert!(parse(b"{} {}").is_err());
        assert!(parse(b"").is_err());
    }

    #[test]
    fn json_content_types() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            is_json(&h)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/merge-patch+json"));
        assert!(!with("text/plain"));
        assert!(!with("application/jsonx"));
        assert!(!with("json"));
        assert!(!is_json(&HeaderMap::new()));
    }
}
