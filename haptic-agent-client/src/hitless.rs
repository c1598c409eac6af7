//! What a running HAProxy changes without a reload, read from the files alone: the `server`
//! lines whose address, weight or state alone changed, and the maps `haproxy.cfg` looks up
//! only by key or longest prefix. The agent plans its runtime applies with these rules
//! (`haptic-agent`'s `runtime` module), and the controller's render gate reads a set that
//! differs from one `haproxy -c` passed only in such changes as passing too: the agent applies
//! them with no check, and none of them can make HAProxy refuse the files.
//!
//! The reasons a change is not one of these are `String`s: the agent's plan turns them into
//! "needs a reload".

use std::net::SocketAddr;

use crate::protocol::Hunk;

/// A `server` line's changeable part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSpec {
    /// Address and port.
    pub address: SocketAddr,
    /// `weight` (HAProxy's default 1).
    pub weight: u32,
    /// Not `disabled`.
    pub enabled: bool,
}

/// One server slot to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerChange {
    /// The backend (or `listen` section).
    pub backend: String,
    /// The server's name.
    pub server: String,
    /// As live.
    pub from: ServerSpec,
    /// As wanted.
    pub to: ServerSpec,
}

impl ServerChange {
    /// The commands that take the server from `from` to `to`: out of service first, in
    /// service last, so that it never takes traffic at a half-changed address.
    pub fn commands(&self) -> Vec<String> {
        let name = format!("{}/{}", self.backend, self.server);
        let mut commands = Vec::new();
        if self.from.enabled && !self.to.enabled {
            commands.push(format!("set server {name} state maint"));
        }
        if self.from.address != self.to.address {
            commands.push(format!(
                "set server {name} addr {} port {}",
                self.to.address.ip(),
                self.to.address.port()
            ));
        }
        if self.from.weight != self.to.weight {
            commands.push(format!("set server {name} weight {}", self.to.weight));
        }
        if !self.from.enabled && self.to.enabled {
            commands.push(format!("set server {name} state ready"));
        }
        commands
    }
}

/// Section keywords of an HAProxy configuration.
const SECTIONS: [&str; 14] = [
    "global",
    "defaults",
    "frontend",
    "backend",
    "listen",
    "peers",
    "resolvers",
    "userlist",
    "mailers",
    "program",
    "http-errors",
    "ring",
    "cache",
    "fcgi-app",
];

/// Characters that make a line or an entry unsafe to change at run time: quoting and
/// escapes (the agent does not re-implement HAProxy's), comments, variables, and the CLI's
/// command separator.
pub fn unsafe_text(text: &str) -> bool {
    // Byte by byte (every map entry of a change is checked): ASCII controls include `\r`;
    // the other control characters (C1) are not ASCII.
    text.bytes().any(|byte| {
        matches!(byte, b'"' | b'\'' | b'\\' | b'#' | b'$' | b';') || byte.is_ascii_control()
    }) || (!text.is_ascii() && text.chars().any(char::is_control))
}

/// A `server` line: name, changeable part, and every other token in order.
pub fn parse_server(line: &str) -> Option<(&str, ServerSpec, Vec<&str>)> {
    if unsafe_text(line) {
        return None;
    }
    let mut tokens = line.split_ascii_whitespace();
    if tokens.next()? != "server" {
        return None;
    }
    let name = tokens.next()?;
    let address: SocketAddr = tokens.next()?.parse().ok()?;
    let mut spec = ServerSpec {
        address,
        weight: 1,
        enabled: true,
    };
    let mut rest = Vec::new();
    while let Some(token) = tokens.next() {
        match token {
            "disabled" => spec.enabled = false,
            "enabled" => spec.enabled = true,
            "weight" => spec.weight = tokens.next()?.parse().ok().filter(|w| *w <= 256)?,
            other => rest.push(other),
        }
    }
    Some((name, spec, rest))
}

/// The server changes between two `haproxy.cfg` texts, or why they differ in more.
pub fn config_changes(live: &str, new: &str) -> Result<Vec<ServerChange>, String> {
    let (live_lines, new_lines): (Vec<&str>, Vec<&str>) =
        (live.split('\n').collect(), new.split('\n').collect());
    if live_lines.len() != new_lines.len() {
        return Err(format!(
            "haproxy.cfg has {} lines, the live one {}",
            new_lines.len(),
            live_lines.len()
        ));
    }
    let mut changes = Vec::new();
    for (number, (old, new)) in live_lines.iter().zip(&new_lines).enumerate() {
        if old == new {
            continue;
        }
        // The section: the nearest header above the line, read back from it (a few lines in
        // a generated config; reading every line of a 7 MB haproxy.cfg for its headers was
        // most of a plan at 10,000 Ingresses). Lines above a changed one are unchanged, or
        // changed server lines: a changed header stops the plan where it is.
        let section = section_above(live_lines[..number].iter().rev().copied());
        changes.extend(server_change(number, old, new, section)?);
    }
    Ok(changes)
}

/// [`config_changes`] from the hunks that made `new` of `live` (a delta's): only the lines
/// they replace are read, and the live text is walked only up to the last of them. The
/// caller vouches that the hunks make `new` of `live` (the delta's checksum was checked
/// against its base, and `live` is that base).
pub fn config_changes_from_hunks(
    live: &str,
    new: &str,
    hunks: &[Hunk],
) -> Result<Vec<ServerChange>, String> {
    if hunks.iter().any(|hunk| hunk.remove != hunk.insert.len()) {
        let count = |text: &str| text.bytes().filter(|b| *b == b'\n').count() + 1;
        return Err(format!(
            "haproxy.cfg has {} lines, the live one {}",
            count(new),
            count(live)
        ));
    }
    let mut changes = Vec::new();
    // (index, byte offset) of the live line the walk is at.
    let (mut index, mut offset) = (0usize, 0usize);
    for hunk in hunks {
        for (i, inserted) in hunk.insert.iter().enumerate() {
            let number = hunk.at + i;
            if let Some(skip) = number.checked_sub(index).and_then(|n| n.checked_sub(1)) {
                // The end of the line before `number`: the `skip`-th newline from here.
                let Some(newline) =
                    memchr::memchr_iter(b'\n', &live.as_bytes()[offset..]).nth(skip)
                else {
                    return Err("a hunk beyond the live haproxy.cfg".to_owned());
                };
                offset += newline + 1;
                index = number;
            }
            let old = live[offset..].split('\n').next().unwrap_or_default();
            let new = inserted.strip_suffix('\n').unwrap_or(inserted);
            if old == new {
                continue;
            }
            let section = section_above(live[..offset].rsplit('\n').skip(1));
            changes.extend(server_change(number, old, new, section)?);
        }
    }
    Ok(changes)
}

/// The section (keyword, name) the first header among `lines_above` (nearest first) opens.
fn section_above<'a>(mut lines_above: impl Iterator<Item = &'a str>) -> (&'a str, &'a str) {
    lines_above
        .find_map(|line| {
            let mut tokens = line.split_ascii_whitespace();
            let first = tokens.next().filter(|first| SECTIONS.contains(first))?;
            Some((first, tokens.next().unwrap_or("")))
        })
        .unwrap_or(("", ""))
}

/// The server change of line `number` (0-based), `old` become `new`, in `section`: none when
/// the server holds the same, an error when the line changed in more.
fn server_change(
    number: usize,
    old: &str,
    new: &str,
    section: (&str, &str),
) -> Result<Option<ServerChange>, String> {
    let differs = || {
        format!(
            "haproxy.cfg line {} changed beyond a server's address, weight or state",
            number + 1
        )
    };
    if !matches!(section.0, "backend" | "listen") {
        return Err(differs());
    }
    let (Some((old_name, from, old_rest)), Some((new_name, to, new_rest))) =
        (parse_server(old), parse_server(new))
    else {
        return Err(differs());
    };
    if old_name != new_name || old_rest != new_rest || unsafe_text(section.1) {
        return Err(differs());
    }
    Ok((from != to).then(|| ServerChange {
        backend: section.1.to_owned(),
        server: new_name.to_owned(),
        from,
        to,
    }))
}

/// Whether `haproxy.cfg` (`config`) uses the map file `path` only through the converters
/// `map`, `map_str` and `map_beg`, and at least once. HAProxy indexes those lookups in trees
/// (the exact key; the longest prefix), so the order of the entries does not change what a
/// lookup finds, as long as no key is listed twice; a `map_reg` (first match in file order),
/// an ACL's `-f` or any other use makes the order matter.
pub fn order_free(config: &str, path: &str) -> bool {
    if path.is_empty() {
        return false;
    }
    let mut uses = 0;
    // Every mention of `path`, found in the whole text at once (a 7 MB haproxy.cfg at 10,000
    // Ingresses; memmem's search, several times the standard library's for such a needle),
    // then read in its line; comment lines name no map HAProxy uses. A match of a whole UTF-8
    // needle begins on a character boundary.
    let bytes = config.as_bytes();
    for at in memchr::memmem::find_iter(bytes, path.as_bytes()) {
        let start = memchr::memrchr(b'\n', &bytes[..at]).map_or(0, |newline| newline + 1);
        let end = memchr::memchr(b'\n', &bytes[at..]).map_or(bytes.len(), |newline| at + newline);
        let line = config[start..end]
            .strip_suffix('\r')
            .unwrap_or(&config[start..end]);
        if line.trim_start().starts_with('#') {
            continue;
        }
        if !order_free_use(line, at - start, path) {
            return false;
        }
        uses += 1;
    }
    uses > 0
}

/// Whether the mention of `path` at `at` in `line` is an argument of `map`, `map_str` or
/// `map_beg`.
fn order_free_use(line: &str, at: usize, path: &str) -> bool {
    let before = &line[..at];
    let after = line[at + path.len()..].chars().next();
    let converter = ["map(", "map_str(", "map_beg("]
        .iter()
        .find(|c| before.ends_with(*c))
        .and_then(|c| before[..before.len() - c.len()].chars().next_back());
    // A converter follows a fetch or another converter: `,map(...)` or `(map(...)`.
    matches!(converter, Some(',' | ' ' | '(')) && matches!(after, Some(')' | ','))
}

/// The entries of a map file, as HAProxy reads one: leading blanks skipped, `#` lines and
/// blank lines left out, the key up to the first blank, the value the rest of the line
/// without its leading and trailing blanks.
pub fn map_entries(text: &str) -> Vec<(&str, &str)> {
    // Split on `\n`, then on a rare `\r`: each a memchr, where a pattern of two characters
    // steps through the 10,000 lines of a map character by character.
    text.split('\n')
        .flat_map(|line| line.split('\r'))
        .filter_map(|line| {
            let line = line.trim_start_matches(|c: char| c.is_ascii_whitespace());
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let (key, value) = line
                .split_once(|c: char| c.is_ascii_whitespace())
                .unwrap_or((line, ""));
            Some((key, value.trim_matches([' ', '\t'])))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::line_hunks;

    /// `backends` backends of `servers` server lines each, with line `(b, s)` as `server`
    /// gives it, and the first backend's `balance` as `balance` says.
    fn config(
        backends: usize,
        servers: usize,
        balance: &str,
        server: impl Fn(usize, usize) -> String,
    ) -> String {
        let mut text = String::from("global\n    maxconn 10\n\nfrontend f\n    bind :80\n");
        for b in 0..backends {
            let balance = if b == 0 { balance } else { "roundrobin" };
            text.push_str(&format!("\nbackend be_{b}\n    balance {balance}\n"));
            for s in 0..servers {
                text.push_str(&format!("    {}\n", server(b, s)));
            }
        }
        text
    }

    proptest::proptest! {
        /// The changes read at the lines a delta's hunks replace are the changes of the whole
        /// texts compared line by line, or both are refused.
        #[test]
        fn changes_read_from_the_hunks_are_the_changes_of_the_whole_texts(
            backends in 1usize..40,
            servers in 1usize..4,
            edits in proptest::collection::vec((0usize..40, 0usize..4, 0u8..4), 0..6),
            balance in proptest::sample::select(vec!["roundrobin", "roundrobin", "leastconn"]),
        ) {
            let line = |b: usize, s: usize, edit: Option<u8>| match edit {
                None => format!("server s{s} 10.0.{b}.{s}:80 weight 1 disabled"),
                Some(0) => format!("server s{s} 10.9.{b}.{s}:8080 weight 1 disabled"),
                Some(1) => format!("server s{s} 10.0.{b}.{s}:80 weight 7 disabled"),
                Some(2) => format!("server s{s} 10.0.{b}.{s}:80 weight 1"),
                Some(_) => format!("server s{s} 10.0.{b}.{s}:80 weight 1 disabled check"),
            };
            let edit_of = |b: usize, s: usize| {
                edits
                    .iter()
                    .rev()
                    .find(|(eb, es, _)| *eb == b && *es == s)
                    .map(|(_, _, kind)| *kind)
            };
            let live = config(backends, servers, "roundrobin", |b, s| line(b, s, None));
            let new = config(backends, servers, balance, |b, s| line(b, s, edit_of(b, s)));
            let hunks = line_hunks(&live, &new);
            proptest::prop_assert_eq!(
                config_changes_from_hunks(&live, &new, &hunks),
                config_changes(&live, &new)
            );
        }
    }
}
