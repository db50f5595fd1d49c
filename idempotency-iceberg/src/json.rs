//! Editing a JSON object in place: members are removed and added as text, so that every
//! byte an edit does not touch stays as it was (key order, spacing, number formats). A
//! replay must be the stored answer byte for byte, and a stored answer the first answer
//! minus what was taken out.
//!
//! serde_json reads the object and hands each value back as its raw text
//! ([`RawValue`]), which borrows from the input; where that text sits in the input gives
//! every member's place. Only well-formed JSON objects are edited: anything else is
//! `None`, and the caller leaves the body alone.

use std::fmt;
use std::ops::Range;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The members of an object, in order: each key and where its member and its value sit.
struct Members {
    /// From just after `{` to just before `}`.
    inside: Range<usize>,
    members: Vec<Member>,
}

struct Member {
    key: String,
    /// From the key's opening quote to the end of the value.
    whole: Range<usize>,
    value: Range<usize>,
}

impl Members {
    fn read(text: &str) -> Option<Self> {
        let raw: RawMembers<'_> = serde_json::from_str(text).ok()?;
        let open = text.find('{')?;
        let close = text.rfind('}')?;
        let mut members = Vec::with_capacity(raw.0.len());
        let mut after_previous = open + 1;
        for (key, value) in raw.0 {
            let start = value.get().as_ptr() as usize - text.as_ptr() as usize;
            let value = start..start + value.get().len();
            // Between the previous member (or `{`) and this key there is only spacing
            // and one comma.
            let key_start = after_previous
                + text[after_previous..].find(|c: char| !(c.is_ascii_whitespace() || c == ','))?;
            members.push(Member {
                key,
                whole: key_start..value.end,
                value: value.clone(),
            });
            after_previous = value.end;
        }
        Some(Self {
            inside: open + 1..close,
            members,
        })
    }

    /// The text range to cut so that member `i` is gone and the object stays valid.
    fn cut(&self, i: usize) -> Range<usize> {
        let member = &self.members[i];
        match (self.members.get(i + 1), i.checked_sub(1)) {
            // `"k":v, ` up to the next key.
            (Some(next), _) => member.whole.start..next.whole.start,
            // `, "k":v` from the end of the previous value.
            (None, Some(previous)) => self.members[previous].value.end..member.whole.end,
            (None, None) => member.whole.clone(),
        }
    }
}

/// `text` without the top-level members whose key `remove` picks, or `None` when it
/// has none (or is not an object).
pub(super) fn remove_members(text: &str, remove: impl Fn(&str) -> bool) -> Option<String> {
    let mut out = text.to_owned();
    let mut removed = false;
    loop {
        let members = Members::read(&out)?;
        let Some(i) = members.members.iter().position(|m| remove(&m.key)) else {
            return removed.then_some(out);
        };
        out.replace_range(members.cut(i), "");
        removed = true;
    }
}

/// The raw text of the member `key`'s value, if the object has one.
pub(super) fn member<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let members = Members::read(text)?;
    let member = members.members.iter().find(|m| m.key == key)?;
    Some(&text[member.value.clone()])
}

/// Where the values of the top-level members `keys` sit in `text`, a JSON object; `None`
/// unless it has every one of them. Found by a scan that follows only strings and
/// nesting, without parsing the values: it reads a megabyte of table metadata in a
/// fraction of the time a parse takes, and is exact for any well-formed object. Keys are
/// matched as written (escapes are not decoded).
pub(super) fn member_spans<const N: usize>(
    text: &[u8],
    keys: [&str; N],
) -> Option<[Range<usize>; N]> {
    let mut spans = keys.map(|_| None);
    let mut at = skip_spacing(text, 0);
    if text.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_spacing(text, at + 1);
    if text.get(at) == Some(&b'}') {
        at += 1;
    } else {
        loop {
            if text.get(at) != Some(&b'"') {
                return None;
            }
            let key_end = string_end(text, at)?;
            let key = &text[at + 1..key_end - 1];
            at = skip_spacing(text, key_end);
            if text.get(at) != Some(&b':') {
                return None;
            }
            let start = skip_spacing(text, at + 1);
            let end = value_end(text, start)?;
            if let Some(i) = keys.iter().position(|k| k.as_bytes() == key) {
                spans[i] = Some(start..end);
            }
            at = skip_spacing(text, end);
            match text.get(at)? {
                b',' => at = skip_spacing(text, at + 1),
                b'}' => {
                    at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    if skip_spacing(text, at) != text.len() {
        return None;
    }
    let found: Vec<Range<usize>> = spans.into_iter().collect::<Option<_>>()?;
    found.try_into().ok()
}

fn skip_spacing(text: &[u8], from: usize) -> usize {
    from + text[from.min(text.len())..]
        .iter()
        .take_while(|b| b.is_ascii_whitespace())
        .count()
}

/// Just past the string that starts (with its quote) at `start`.
fn string_end(text: &[u8], start: usize) -> Option<usize> {
    let mut at = start + 1;
    loop {
        match text.get(at)? {
            b'"' => return Some(at + 1),
            b'\\' => at += 2,
            _ => at += 1,
        }
    }
}

/// Just past the value that starts at `start`.
fn value_end(text: &[u8], start: usize) -> Option<usize> {
    match text.get(start)? {
        b'"' => string_end(text, start),
        b'{' | b'[' => {
            let mut depth = 0_usize;
            let mut at = start;
            loop {
                match text.get(at)? {
                    b'"' => {
                        at = string_end(text, at)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            let scalar = text[start..]
                .iter()
                .take_while(|b| !matches!(b, b',' | b'}' | b']') && !b.is_ascii_whitespace())
                .count();
            (scalar > 0).then_some(start + scalar)
        }
    }
}

/// The keys and raw values of an object's members, in order.
pub(super) fn entries(text: &str) -> Option<Vec<(String, &str)>> {
    let members = Members::read(text)?;
    Some(
        members
            .members
            .into_iter()
            .map(|m| (m.key, &text[m.value]))
            .collect(),
    )
}

/// `text` with the value of member `key` replaced by `edit` of it; `None` when the object
/// has no such member or `edit` declines.
pub(super) fn edit_member(
    text: &str,
    key: &str,
    edit: impl FnOnce(&str) -> Option<String>,
) -> Option<String> {
    let members = Members::read(text)?;
    let member = members.members.iter().find(|m| m.key == key)?;
    let edited = edit(&text[member.value.clone()])?;
    let mut out = text.to_owned();
    out.replace_range(member.value.clone(), &edited);
    Some(out)
}

/// `text` with member `key` set to the raw JSON `value`: replaced where it is, or added
/// after the last member.
pub(super) fn set_member(text: &str, key: &str, value: &str) -> Option<String> {
    let members = Members::read(text)?;
    let mut out = text.to_owned();
    if let Some(member) = members.members.iter().find(|m| m.key == key) {
        out.replace_range(member.value.clone(), value);
        return Some(out);
    }
    let key = serde_json::to_string(key).ok()?;
    match members.members.last() {
        Some(last) => out.insert_str(last.value.end, &format!(",{key}:{value}")),
        None => out.insert_str(members.inside.start, &format!("{key}:{value}")),
    }
    Some(out)
}

/// An object's members with their values as raw text, in the order they came.
struct RawMembers<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for RawMembers<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = RawMembers<'de>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, &'de RawValue>()? {
                    members.push(member);
                }
                Ok(RawMembers(members))
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removing_keeps_every_other_byte() {
        let text = r#"{ "a" : 1,  "secret":"x", "b":{"c":[1, 2]} ,"tail":"s" }"#;
        assert_eq!(
            remove_members(text, |k| k == "secret").unwrap(),
            r#"{ "a" : 1,  "b":{"c":[1, 2]} ,"tail":"s" }"#
        );
        assert_eq!(
            remove_members(text, |k| k == "tail").unwrap(),
            r#"{ "a" : 1,  "secret":"x", "b":{"c":[1, 2]} }"#
        );
        assert_eq!(
            remove_members(text, |k| k == "a").unwrap(),
            r#"{ "secret":"x", "b":{"c":[1, 2]} ,"tail":"s" }"#
        );
        assert_eq!(
            remove_members(text, |k| k != "b").unwrap(),
            r#"{ "b":{"c":[1, 2]} }"#
        );
        assert_eq!(remove_members(r#"{"only":1}"#, |_| true).unwrap(), "{}");
        assert_eq!(remove_members(text, |k| k == "absent"), None);
        assert_eq!(remove_members("[1]", |_| true), None);
        assert_eq!(remove_members("{broken", |_| true), None);
    }

    #[test]
    fn keys_with_escapes_and_values_with_braces_are_found() {
        let text = r#"{"q\"uote":"}{,","x":"{\"not\":1}","n":-1.50e3}"#;
        let entries = entries(text).unwrap();
        assert_eq!(entries[0], ("q\"uote".to_owned(), r#""}{,""#));
        assert_eq!(entries[2], ("n".to_owned(), "-1.50e3"));
        assert_eq!(
            remove_members(text, |k| k == "x").unwrap(),
            r#"{"q\"uote":"}{,","n":-1.50e3}"#
        );
    }

    #[test]
    fn setting_adds_after_the_last_member_or_replaces_in_place() {
        assert_eq!(
            set_member(r#"{"a":1, "b":2}"#, "c", r#""x""#).unwrap(),
            r#"{"a":1, "b":2,"c":"x"}"#
        );
        assert_eq!(
            set_member(r#"{"a":1, "b":2}"#, "a", "7").unwrap(),
            r#"{"a":7, "b":2}"#
        );
        assert_eq!(set_member("{ }", "k", "[]").unwrap(), r#"{"k":[] }"#);
        assert_eq!(
            edit_member(r#"{"c":{"s":1,"t":2},"d":0}"#, "c", |inner| remove_members(
                inner,
                |k| k == "s"
            ))
            .unwrap(),
            r#"{"c":{"t":2},"d":0}"#
        );
        assert_eq!(member(r#"{"c":{"s":1}}"#, "c"), Some(r#"{"s":1}"#));
    }

    #[test]
    fn member_spans_are_found_by_the_scan_where_a_parse_finds_them() {
        for text in [
            r#"{"b":[1,{"a":2}], "a" : "x","c":null}"#,
            r#" { "c" : -1.5e3 ,"b":"}{][\"\\","a":{"q\"":[{}],"s":"]"} } "#,
            "{\n  \"a\": true,\n  \"b\": [],\n  \"c\": {}\n}\n",
        ] {
            let [a, b, c] = member_spans(text.as_bytes(), ["a", "b", "c"]).unwrap();
            for (key, span) in [("a", a), ("b", b), ("c", c)] {
                assert_eq!(Some(&text[span]), member(text, key), "{key} in {text}");
            }
        }
        let text = br#"{"a":1}"#;
        assert_eq!(member_spans(text, ["a", "missing"]), None);
        for broken in [
            "[1]",
            "{",
            r#"{"a":1"#,
            r#"{"a":1}x"#,
            r#"{"a" 1}"#,
            r#"{"a":"x}"#,
            "{}",
            "",
        ] {
            assert_eq!(member_spans(broken.as_bytes(), ["a"]), None, "{broken}");
        }
    }

    #[test]
    fn a_removal_and_a_set_undo_each_other() {
        for text in [
            r#"{"a":1,"s":[1]}"#,
            r#"{"s":[1]}"#,
            "{\n  \"a\": 1,\n  \"b\": true\n}",
        ] {
            let added = set_member(text, "zz", r#"{"k":"v"}"#).unwrap();
            assert_eq!(remove_members(&added, |k| k == "zz").unwrap(), text);
        }
    }
}
