//! The regular expressions of HTTPRoute matches of type `RegularExpression` (implementation
//! specific in the Gateway API): written into `haproxy.cfg` as ACL patterns (`-m reg`), which
//! HAProxy compiles with PCRE2 when it loads the configuration. A pattern HAProxy refuses makes
//! the whole configuration fail (`haproxy -c`), and a pattern is text from a route, so only a
//! conservative subset of PCRE2 is taken, checked here: what it accepts compiles, means the
//! same in every PCRE2 version, and can only be one word of the line.
//!
//! The subset: printable ASCII and the space, without `'`, `"` or `#` (a pattern is written
//! between single quotes, where HAProxy reads every other character as it is); literals;
//! `.`; `^` and `$`; `\` with a punctuation character (that character), or `d D w W s S`
//! (classes) or `b B` (word boundaries); classes `[...]` and `[^...]` of literals, escaped
//! punctuation, ranges `a-z` of them in order, and the class escapes, a literal `-` first or
//! last, no `[` inside; groups `(...)` and `(?:...)`, nested at most [`MAX_DEPTH`] deep;
//! alternation `|`; the quantifiers `*`, `+`, `?`, `{n}`, `{n,}`, `{n,m}` (at most
//! [`MAX_REPEAT`]), each optionally lazy (`?`), after something they can repeat. Not taken:
//! other escapes (back references, `\Q`, `\x`, `\p`, ...), other `(?` groups (look-around,
//! named groups, options), possessive quantifiers, POSIX classes, `{`, `}` and `]` unescaped
//! outside a class, and patterns whose compiled size could come near PCRE2's limit.

/// The most a counted quantifier may repeat (PCRE2 allows 65,535).
pub(crate) const MAX_REPEAT: u64 = 1000;

/// The deepest groups may nest (PCRE2's default limit is 250).
pub(crate) const MAX_DEPTH: usize = 32;

/// An upper bound of the compiled size (in PCRE2 code units, counted generously: a class
/// 40, a literal 4, a repeated group as many times as it may repeat) a pattern may have.
/// PCRE2 with its default link size refuses patterns over 65,535.
const MAX_SIZE: u64 = 10_000;

/// Why `re` is not a pattern of the subset, if it is not.
pub(crate) fn check(re: &str) -> Result<(), String> {
    if re.is_empty() {
        return Err("it is empty".to_owned());
    }
    for (i, c) in re.char_indices() {
        if !(c == ' ' || c.is_ascii_graphic()) {
            return Err(format!(
                "{c:?} at {i}: only printable ASCII characters and the space are supported"
            ));
        }
        if matches!(c, '\'' | '"' | '#') {
            return Err(format!(
                "{c:?} at {i}: quotes and '#' are not supported (match them with '.')"
            ));
        }
    }
    let mut p = Parser {
        b: re.as_bytes(),
        i: 0,
        depth: 0,
    };
    let size = p.alternation()?;
    if p.i < p.b.len() {
        return Err(format!("')' at {} closes no group", p.i));
    }
    if size > MAX_SIZE {
        return Err("it is too large".to_owned());
    }
    Ok(())
}

/// The ACL pattern HAProxy reads for `re` (checked): the whole value must match (anchored),
/// single-quoted.
pub(crate) fn anchored(re: &str) -> String {
    format!("'^(?:{re})$'")
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek();
        self.i += 1;
        c
    }

    /// Alternatives, up to the end or a `)`; their size.
    fn alternation(&mut self) -> Result<u64, String> {
        let mut size = self.sequence()?;
        while self.peek() == Some(b'|') {
            self.i += 1;
            size = size.saturating_add(4).saturating_add(self.sequence()?);
        }
        Ok(size)
    }

    /// Items, each maybe quantified, up to the end, a `|` or a `)`.
    fn sequence(&mut self) -> Result<u64, String> {
        let mut size: u64 = 0;
        while let Some(c) = self.peek() {
            if matches!(c, b'|' | b')') {
                break;
            }
            let at = self.i;
            let (item, repeatable) = self.item()?;
            let item = match self.peek() {
                Some(b'*' | b'+' | b'?' | b'{') => {
                    if !repeatable {
                        return Err(format!(
                            "the quantifier at {} repeats nothing it can (at {at})",
                            self.i
                        ));
                    }
                    let (min, max) = self.quantifier()?;
                    if self.b[at] == b'(' {
                        // PCRE2 writes a repeated group out as many times as it may repeat.
                        let copies = max.unwrap_or(min.saturating_add(1)).max(1);
                        item.saturating_add(4)
                            .saturating_mul(copies.saturating_add(1))
                    } else {
                        // A character, class or escape repeated is one opcode with its counts.
                        item.saturating_add(8)
                    }
                }
                _ => item,
            };
            size = size.saturating_add(item);
        }
        Ok(size)
    }

    /// One item: its size and whether a quantifier may follow it.
    fn item(&mut self) -> Result<(u64, bool), String> {
        let at = self.i;
        let Some(c) = self.next() else {
            return Err("unexpected end".to_owned());
        };
        match c {
            b'(' => {
                if self.peek() == Some(b'?') {
                    if self.b.get(self.i + 1) != Some(&b':') {
                        return Err(format!("'(?' at {at}: only '(?:' groups are supported"));
                    }
                    self.i += 2;
                }
                self.depth += 1;
                if self.depth > MAX_DEPTH {
                    return Err(format!("groups nest more than {MAX_DEPTH} deep"));
                }
                let inner = self.alternation()?;
                if self.next() != Some(b')') {
                    return Err(format!("'(' at {at} is not closed"));
                }
                self.depth -= 1;
                Ok((inner.saturating_add(10), true))
            }
            b'[' => Ok((self.class(at)?, true)),
            b'.' => Ok((4, true)),
            b'^' | b'$' => Ok((4, false)),
            b'\\' => match self.next() {
                None => Err(format!("'\\' at {at} escapes nothing")),
                Some(b'd' | b'D' | b'w' | b'W' | b's' | b'S') => Ok((4, true)),
                Some(b'b' | b'B') => Ok((4, false)),
                Some(e) if e.is_ascii_alphanumeric() => Err(format!(
                    "'\\{}' at {at}: only '\\' with punctuation, 'd', 'D', 'w', 'W', 's', 'S', 'b' or 'B' is supported",
                    char::from(e)
                )),
                Some(_) => Ok((4, true)),
            },
            b'*' | b'+' | b'?' => Err(format!("the quantifier at {at} repeats nothing it can")),
            b'{' | b'}' | b']' => Err(format!(
                "'{}' at {at}: escape it ('\\{}') outside a class",
                char::from(c),
                char::from(c)
            )),
            _ => Ok((4, true)),
        }
    }

    /// A quantifier (at `*`, `+`, `?` or `{`): its least and most repetitions (none: no
    /// most), after an optional lazy `?`.
    fn quantifier(&mut self) -> Result<(u64, Option<u64>), String> {
        let at = self.i;
        let bounds = match self.next() {
            Some(b'*') => (0, None),
            Some(b'+') => (1, None),
            Some(b'?') => (0, Some(1)),
            _ => {
                let bad = || {
                    format!(
                        "'{{' at {at} is not a repetition {{n}}, {{n,}} or {{n,m}} (escape it: '\\{{')"
                    )
                };
                let min = self.number().ok_or_else(bad)?;
                let max = match self.next() {
                    Some(b'}') => Some(min),
                    Some(b',') if self.peek() == Some(b'}') => {
                        self.i += 1;
                        None
                    }
                    Some(b',') => {
                        let max = self.number().ok_or_else(bad)?;
                        if self.next() != Some(b'}') {
                            return Err(bad());
                        }
                        Some(max)
                    }
                    _ => return Err(bad()),
                };
                if max.is_some_and(|max| max < min) {
                    return Err(format!(
                        "the repetition at {at} has its bounds out of order"
                    ));
                }
                if min.max(max.unwrap_or(0)) > MAX_REPEAT {
                    return Err(format!("the repetition at {at} is over {MAX_REPEAT}"));
                }
                (min, max)
            }
        };
        if self.peek() == Some(b'?') {
            self.i += 1;
        }
        if matches!(self.peek(), Some(b'*' | b'+' | b'?' | b'{')) {
            return Err(format!(
                "the quantifier at {} follows another (possessive and nested quantifiers are not supported)",
                self.i
            ));
        }
        Ok(bounds)
    }

    /// A decimal number of at most 4 digits.
    fn number(&mut self) -> Option<u64> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) && self.i - start < 4 {
            self.i += 1;
        }
        std::str::from_utf8(&self.b[start..self.i])
            .ok()?
            .parse()
            .ok()
    }

    /// A class, after its `[` at `at`: its size.
    fn class(&mut self, at: usize) -> Result<u64, String> {
        if self.peek() == Some(b'^') {
            self.i += 1;
        }
        let mut items = 0;
        loop {
            let pos = self.i;
            let Some(c) = self.next() else {
                return Err(format!("'[' at {at} is not closed"));
            };
            // One member: a character, or a class escape (None).
            let member = match c {
                b']' if items > 0 => return Ok(40),
                b']' => {
                    return Err(format!(
                        "the class at {at} is empty or begins with ']' (escape it: '\\]')"
                    ));
                }
                b'[' => {
                    return Err(format!("'[' at {pos} inside a class (escape it: '\\[')"));
                }
                b'-' if items > 0 && self.peek() != Some(b']') => {
                    return Err(format!(
                        "'-' at {pos} inside a class is not a range: put it first or last, or escape it"
                    ));
                }
                b'\\' => self.class_escape(pos)?,
                c => Some(c),
            };
            items += 1;
            if self.peek() == Some(b'-') && !matches!(self.b.get(self.i + 1), None | Some(b']')) {
                let Some(from) = member else {
                    return Err(format!("the range at {pos} begins with a class escape"));
                };
                self.i += 1;
                let end = self.i;
                let to = match self.next() {
                    Some(b'\\') => self.class_escape(end)?,
                    Some(b'[') => {
                        return Err(format!("'[' at {end} inside a class (escape it: '\\[')"));
                    }
                    other => other,
                };
                let Some(to) = to else {
                    return Err(format!("the range at {pos} ends with a class escape"));
                };
                if to < from {
                    return Err(format!(
                        "the range {}-{} at {pos} is out of order",
                        char::from(from),
                        char::from(to)
                    ));
                }
            }
        }
    }

    /// After a `\` in a class at `at`: the character it stands for, or None for `\d`, `\D`,
    /// `\w`, `\W`, `\s`, `\S`.
    fn class_escape(&mut self, at: usize) -> Result<Option<u8>, String> {
        match self.next() {
            None => Err(format!("'\\' at {at} escapes nothing")),
            Some(b'd' | b'D' | b'w' | b'W' | b's' | b'S') => Ok(None),
            Some(e) if e.is_ascii_alphanumeric() => Err(format!(
                "'\\{}' at {at} inside a class: only '\\' with punctuation, 'd', 'D', 'w', 'W', 's' or 'S' is supported",
                char::from(e)
            )),
            Some(e) => Ok(Some(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn the_subset_takes_common_patterns() {
        for re in [
            "/api/v[0-9]+/tasks",
            "^/admin/.+$",
            "/users/\\d{1,6}(/profile)?",
            "/(foo|bar)/[a-zA-Z_.-]*",
            "Bearer .+",
            "[-a]|[a-]|[\\-\\]\\[]",
            "(?:a|b){2,}?",
            "x{0}y{3}z{1,1000}",
            "[0-9]{1,1000}\\d{1000,}.{0,1000}",
            "(ab){1,300}",
            "\\.\\*\\{\\}\\$\\^\\/\\\\",
            "\\bword\\B\\s\\S\\w\\W\\D",
            "[^/]*",
            "a||b|()",
            "\\_\\~\\@\\<\\>\\ \\!",
        ] {
            assert_eq!(check(re), Ok(()), "{re}");
        }
    }

    #[test]
    fn the_subset_refuses_what_could_break_the_line_or_the_load() {
        for re in [
            "",
            "/a\nuse_backend x",
            "/a\r",
            "/a\tb",
            "/a' }",
            "/a\" }",
            "/a#x",
            "/é",
            "/a(",
            "/a)",
            "(?=a)",
            "(?i)a",
            "(?<n>a)",
            "(?P<n>a)",
            "\\1",
            "(a)\\1",
            "\\Qa\\E",
            "\\x41",
            "\\p{L}",
            "\\",
            "a**",
            "a*+",
            "a{2}{3}",
            "*a",
            "+",
            "^*",
            "\\b+",
            "a{",
            "a{x}",
            "a{,3}",
            "a{3,2}",
            "a{1001}",
            "a{99999}",
            "{",
            "}",
            "]",
            "[",
            "[]",
            "[^]a]",
            "[a",
            "[z-a]",
            "[a-\\d]",
            "[\\d-z]",
            "[a-b-c]",
            "[[:alpha:]]",
            "[\\b]",
            "((((((((((((((((((((((((((((((((((a))))))))))))))))))))))))))))))))))",
            "(([a-z]{1000}){1000})",
            "(ab){1000}",
            "((a){100}){100}",
        ] {
            assert!(check(re).is_err(), "{re:?} should be refused");
        }
        // Too large: 260 classes.
        assert!(check(&"[ab]".repeat(260)).is_err());
        assert_eq!(check(&"[ab]".repeat(200)), Ok(()));
    }
}
