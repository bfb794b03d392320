//! Where a value comes from in an input: the payload format, and field references (a JSON
//! pointer, a delimited position, a topic level, or a template of them). A leaf: the
//! definition, payload parsing and `where` filters all read it, and it reads none of them.

use serde::{Deserialize, Serialize};

/// Payload format of a pipeline's input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Format {
    /// A JSON document; fields are addressed by JSON pointer (`/account`).
    Json,
    /// Text split on `separator` (e.g. `E2/A/35000` with `/`); fields by position `"0"`, `"1"`.
    Delimited { separator: String },
    /// Sparkplug B protobuf (`sparkplug_b`): each metric value is an event; keys are
    /// templates over the topic's IDs and the metric's name ([`SparkplugPart`]).
    SparkplugB,
}

/// What a Sparkplug B key template can name (`{group}`, `{edge_node}`, `{device}`,
/// `{metric}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SparkplugPart {
    Group,
    EdgeNode,
    /// "" for a metric of the edge node itself.
    Device,
    Metric,
}

impl SparkplugPart {
    pub fn name(self) -> &'static str {
        match self {
            SparkplugPart::Group => "group",
            SparkplugPart::EdgeNode => "edge_node",
            SparkplugPart::Device => "device",
            SparkplugPart::Metric => "metric",
        }
    }
}

/// One part of an event-ID template such as `{/device}-{/seq}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TemplatePart {
    Literal(String),
    Field(Field),
}

/// Where a value comes from in a payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Field {
    /// JSON pointer (RFC 6901), e.g. `/account` or `/meta/id`.
    Pointer(String),
    /// Position in a delimited payload, counted from 0.
    Index(usize),
    /// Concatenation of literals and fields, e.g. `{/device}-{/seq}`.
    Template(Vec<TemplatePart>),
    /// A level of the input's topic, counted from 0: `topic[1]` of `plant/m7/temp` is `m7`.
    Topic(usize),
    /// A part of a Sparkplug B metric's identity (format `sparkplug_b`, in templates only).
    Sparkplug(SparkplugPart),
}

impl Field {
    /// Parse a field reference for the given format: a JSON pointer (`/a/b`), a position
    /// (`"2"`, delimited only), or a template containing `{...}` parts.
    pub fn parse(text: &str, format: &Format) -> Result<Field, String> {
        if *format == Format::SparkplugB && !text.contains('{') {
            return Err(format!(
                "`{text}`: with format = \"sparkplug_b\" a key is a template over {{group}}, \
                 {{edge_node}}, {{device}} and {{metric}}, e.g. \"{{edge_node}}/{{device}}/{{metric}}\""
            ));
        }
        if text.contains('{') || text.contains('}') {
            return parse_template(text, format);
        }
        parse_simple(text, format)
    }
}

fn parse_simple(text: &str, format: &Format) -> Result<Field, String> {
    if *format == Format::SparkplugB {
        let parts = [
            SparkplugPart::Group,
            SparkplugPart::EdgeNode,
            SparkplugPart::Device,
            SparkplugPart::Metric,
        ];
        return parts
            .into_iter()
            .find(|p| p.name() == text)
            .map(Field::Sparkplug)
            .ok_or_else(|| {
                format!(
                    "`{{{text}}}` is not a Sparkplug part: expected {{group}}, {{edge_node}}, \
                     {{device}} or {{metric}}"
                )
            });
    }
    if let Some(inner) = text.strip_prefix("topic[") {
        return inner
            .strip_suffix(']')
            .and_then(|n| {
                n.parse::<usize>()
                    .ok()
                    .filter(|_| n.bytes().all(|b| b.is_ascii_digit()))
            })
            .map(Field::Topic)
            .ok_or_else(|| {
                format!("`{text}` is not a topic level: write `topic[N]`, N counted from 0")
            });
    }
    match format {
        Format::Json => {
            if !text.starts_with('/') {
                return Err(format!(
                    "`{text}` is not a JSON pointer: it must start with `/`, e.g. `/id`"
                ));
            }
            let mut chars = text.chars().peekable();
            while let Some(c) = chars.next() {
                if c == '~' && !matches!(chars.peek(), Some('0') | Some('1')) {
                    return Err(format!(
                        "`{text}` is not a valid JSON pointer: `~` must be followed by 0 or 1"
                    ));
                }
            }
            Ok(Field::Pointer(text.to_string()))
        }
        Format::SparkplugB => unreachable!("handled above"),
        Format::Delimited { .. } => text.parse::<usize>().map(Field::Index).map_err(|_| {
            format!(
                "`{text}` is not a field position: delimited fields are numbered from 0, e.g. \"1\""
            )
        }),
    }
}

fn parse_template(text: &str, format: &Format) -> Result<Field, String> {
    let mut parts = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        match rest.find(['{', '}']) {
            None => {
                parts.push(TemplatePart::Literal(rest.to_string()));
                break;
            }
            Some(i) => {
                if rest.as_bytes()[i] == b'}' {
                    return Err(format!("`{text}`: unmatched `}}`"));
                }
                if i > 0 {
                    parts.push(TemplatePart::Literal(rest[..i].to_string()));
                }
                let after = &rest[i + 1..];
                let close = after
                    .find('}')
                    .ok_or_else(|| format!("`{text}`: unclosed `{{`"))?;
                let inner = &after[..close];
                if inner.contains('{') {
                    return Err(format!("`{text}`: nested `{{`"));
                }
                parts.push(TemplatePart::Field(parse_simple(inner, format)?));
                rest = &after[close + 1..];
            }
        }
    }
    if !parts.iter().any(|p| matches!(p, TemplatePart::Field(_))) {
        return Err(format!(
            "`{text}`: a template needs at least one `{{field}}`"
        ));
    }
    Ok(Field::Template(parts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_pointer_and_template_parse() {
        assert_eq!(
            Field::parse("/id", &Format::Json),
            Ok(Field::Pointer("/id".into()))
        );
        assert!(Field::parse("id", &Format::Json).is_err());
        assert!(Field::parse("/a~2", &Format::Json).is_err());
        let t = Field::parse("{/device}-{/seq}", &Format::Json).unwrap();
        assert_eq!(
            t,
            Field::Template(vec![
                TemplatePart::Field(Field::Pointer("/device".into())),
                TemplatePart::Literal("-".into()),
                TemplatePart::Field(Field::Pointer("/seq".into())),
            ])
        );
        assert!(Field::parse("{/a", &Format::Json).is_err());
        assert!(Field::parse("a}", &Format::Json).is_err());
        assert!(Field::parse("plain{}", &Format::Json).is_err());
    }

    #[test]
    fn sparkplug_keys_are_templates_over_the_metric_identity() {
        let f = Format::SparkplugB;
        assert_eq!(
            Field::parse("{edge_node}/{device}/{metric}", &f),
            Ok(Field::Template(vec![
                TemplatePart::Field(Field::Sparkplug(SparkplugPart::EdgeNode)),
                TemplatePart::Literal("/".into()),
                TemplatePart::Field(Field::Sparkplug(SparkplugPart::Device)),
                TemplatePart::Literal("/".into()),
                TemplatePart::Field(Field::Sparkplug(SparkplugPart::Metric)),
            ]))
        );
        assert!(Field::parse("metric", &f).is_err());
        assert!(Field::parse("{/metric}", &f).is_err());
        assert!(Field::parse("{topic[1]}", &f).is_err());
        assert!(Field::parse("{group}", &f).is_ok());
    }

    #[test]
    fn delimited_positions_parse() {
        let f = Format::Delimited {
            separator: "/".into(),
        };
        assert_eq!(Field::parse("2", &f), Ok(Field::Index(2)));
        assert!(Field::parse("/x", &f).is_err());
        assert!(matches!(
            Field::parse("{0}-{1}", &f),
            Ok(Field::Template(_))
        ));
    }
}
