//! Durations written as Go writes them (`30s`, `1m30s`, `1.5s`, `500ms`): a malformed one is an
//! error naming the field, never a silent default.

use std::time::Duration;

/// A duration string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {value:?} is not a duration ({why}; write e.g. 30s, 1m30s, 500ms)")]
pub struct DurationError {
    /// The field, e.g. `agent.deploymentTimeout`.
    pub field: String,
    /// The value as written.
    pub value: String,
    /// What is wrong.
    pub why: &'static str,
}

/// Parses `value` (units `ns`, `us`, `ms`, `s`, `m`, `h`; decimals allowed; no sign) for
/// `field`.
pub fn parse(field: &str, value: &str) -> Result<Duration, DurationError> {
    let fail = |why| DurationError {
        field: field.to_owned(),
        value: value.to_owned(),
        why,
    };
    let s = value.trim();
    if s.is_empty() {
        return Err(fail("it is empty"));
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| fail("a number has no unit"))?;
        if digits == 0 {
            return Err(fail("a unit has no number before it"));
        }
        let number: f64 = rest[..digits]
            .parse()
            .map_err(|_| fail("a number is malformed"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(fail("unknown unit")),
        };
        total += number * seconds;
        rest = &rest[unit_len..];
    }
    if !total.is_finite() || total > 1e9 {
        return Err(fail("it is too large"));
    }
    Ok(Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_style_durations_parse() {
        for (text, want) in [
            ("30s", Duration::from_secs(30)),
            ("1m30s", Duration::from_secs(90)),
            ("1.5s", Duration::from_millis(1500)),
            ("500ms", Duration::from_millis(500)),
            ("2h", Duration::from_secs(7200)),
            ("0", Duration::ZERO),
            ("100us", Duration::from_micros(100)),
        ] {
            assert_eq!(parse("f", text), Ok(want), "{text}");
        }
    }

    #[test]
    fn malformed_durations_are_errors_naming_the_field() {
        for text in ["", "30", "s", "30x", "1..5s", "-1s", "30 s", "1e3s"] {
            let error = parse("agent.deploymentTimeout", text).expect_err(text);
            assert!(
                error.to_string().starts_with("agent.deploymentTimeout: "),
                "{error}"
            );
        }
    }
}
