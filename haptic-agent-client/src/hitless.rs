//! What a running HAProxy changes without a reload, read from the files alone: the `server`
//! lines whose address, weight or state alone changed, the `server` lines a backend gains or
//! loses (HAProxy's dynamic servers: `add server`, `del server`), and the maps `haproxy.cfg`
//! looks up only by key or longest prefix. The agent plans its runtime applies with these rules
//! (`haptic-agent`'s `runtime` module), and the controller's render gate reads a set that
//! differs from one `haproxy -c` passed only in such changes as passing too: the agent applies
//! them with no check, and none of them can make HAProxy refuse the files.
//!
//! The reasons a change is not one of these are `String`s: the agent's plan turns them into
//! "needs a reload".

use std::{collections::HashMap, net::SocketAddr};

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

/// How a server slot changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SlotChange {
    /// The line stays, its address, weight or state changed (`set server`).
    #[default]
    Set,
    /// A new line, with these tokens after its address other than `weight` and the state
    /// (all of them ones `add server` takes, [`ADDABLE`]): a backend's slots grew, or a spare
    /// backend without servers took a Service. `from` is the new server as `add server`
    /// makes it: in maintenance.
    Add(Vec<String>),
    /// The line is gone (`del server`, after `state maint`): a backend's slots shrank, or a
    /// backend went back to the pool of spares. `to` is `from` in maintenance. HAProxy
    /// refuses to delete a server with connections still on it: it then stays, in
    /// maintenance, until those end and the next reload, and a later [`SlotChange::Add`] of
    /// its name sets its address and weight.
    Delete,
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
    /// Whether the line stays, comes or goes.
    pub change: SlotChange,
}

/// The tokens of a `server` line (after its address; `weight`, `disabled` and `enabled`
/// apart) that a line added at run time may have, with the argument each takes, if any:
/// those of the reference templates' backends without cookies, all of which HAProxy 2.6's
/// `add server` takes. Any other token (`cookie`, which `add server` refuses; a file path)
/// makes the new line need a reload.
pub const ADDABLE: [(&str, Option<&[&str]>); 5] = [
    ("check", None),
    ("ssl", None),
    ("verify", Some(&["none"])),
    ("alpn", Some(&["h2", "http/1.1", "h2,http/1.1"])),
    ("proto", Some(&["h2"])),
];

/// Whether `rest` (a `server` line's other tokens, in order) is all [`ADDABLE`], with
/// `verify` beside `ssl` (HAProxy verifies a server's certificate by default and refuses
/// `ssl` without a CA file: the line would not pass `haproxy -c`).
fn addable(rest: &[&str]) -> bool {
    if rest.contains(&"ssl") && !rest.contains(&"verify") {
        return false;
    }
    let mut tokens = rest.iter();
    while let Some(token) = tokens.next() {
        match ADDABLE.iter().find(|(name, _)| name == token) {
            None => return false,
            Some((_, None)) => {}
            Some((_, Some(values))) => {
                if !tokens.next().is_some_and(|value| values.contains(value)) {
                    return false;
                }
            }
        }
    }
    true
}

impl ServerChange {
    /// The commands that take the server from `from` to `to`: out of service first, in
    /// service last, so that it never takes traffic at a half-changed address.
    ///
    /// A new server is added in maintenance (as `add server` makes every one), its health
    /// checks started (`enable health`: a dynamic server's are off until then) and then put
    /// in service; a server that goes is put in maintenance, then deleted.
    pub fn commands(&self) -> Vec<String> {
        let name = format!("{}/{}", self.backend, self.server);
        let mut commands = Vec::new();
        match &self.change {
            SlotChange::Set => {}
            SlotChange::Add(options) => {
                let mut add = format!("add server {name} {}", self.to.address);
                for option in options {
                    add.push(' ');
                    add.push_str(option);
                }
                if self.to.weight != 1 {
                    add.push_str(&format!(" weight {}", self.to.weight));
                }
                commands.push(add);
                // A server whose `del server` was refused (it had connections: it stayed, in
                // maintenance) is still there, and `add server` refuses its name: it is set
                // to the new address and weight before it may take traffic.
                commands.push(format!(
                    "set server {name} addr {} port {}",
                    self.to.address.ip(),
                    self.to.address.port()
                ));
                commands.push(format!("set server {name} weight {}", self.to.weight));
                if options.iter().any(|option| option == "check") {
                    commands.push(format!("enable health {name}"));
                }
                if self.to.enabled {
                    commands.push(format!("set server {name} state ready"));
                }
                return commands;
            }
            SlotChange::Delete => {
                commands.push(format!("set server {name} state maint"));
                commands.push(format!("del server {name}"));
                return commands;
            }
        }
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
    let hunks = || crate::protocol::line_hunks(live, new);
    if live_lines.len() != new_lines.len() {
        // Lines came or went: read between the common head and tail.
        return config_changes_from_hunks(live, new, &hunks());
    }
    let mut changes = Vec::new();
    for (number, (old, new_line)) in live_lines.iter().zip(&new_lines).enumerate() {
        if old == new_line {
            continue;
        }
        // The section: the nearest header above the line, read back from it (a few lines in
        // a generated config; reading every line of a 7 MB haproxy.cfg for its headers was
        // most of a plan at 10,000 Ingresses). Lines above a changed one are unchanged, or
        // changed server lines: a changed header stops the plan where it is.
        let section = section_above(live_lines[..number].iter().rev().copied());
        match server_change(number, old, new_line, section) {
            Ok(change) => changes.extend(change),
            // Lines renamed, or shifted by a line one backend gained and another lost: read
            // by section.
            Err(_) => return config_changes_from_hunks(live, new, &hunks()),
        }
    }
    Ok(changes)
}

/// [`config_changes`] from the hunks that made `new` of `live` (a delta's): only the lines
/// they replace are read, and the live text is walked only up to the last of them. The
/// caller vouches that the hunks make `new` of `live` (the delta's checksum was checked
/// against its base, and `live` is that base). A hunk that replaces as many lines as it
/// inserts is read line by line; any other one by [`window_changes`].
pub fn config_changes_from_hunks(
    live: &str,
    new: &str,
    hunks: &[Hunk],
) -> Result<Vec<ServerChange>, String> {
    changes_of_hunks(live, new, hunks).or_else(|error| {
        // Hunks cut where shifted lines happen to match (a backend gained a line and a later
        // one lost one: the lines between compared one below the other) may split a section
        // between two of them: the whole middle, read by section, once.
        let middle = middle_hunk(live, new);
        match hunks {
            [only] if *only == middle => Err(error),
            _ => changes_of_hunks(live, new, std::slice::from_ref(&middle)).map_err(|_| error),
        }
    })
}

/// The one hunk that makes `new` of `live`: the lines between their common head and tail.
fn middle_hunk(live: &str, new: &str) -> Hunk {
    let (a, b) = (live.as_bytes(), new.as_bytes());
    let prefix = crate::protocol::common_prefix(a, b);
    let head_end = memchr::memrchr(b'\n', &a[..prefix]).map_or(0, |at| at + 1);
    let (a_rest, b_rest) = (&a[head_end..], &b[head_end..]);
    let suffix = crate::protocol::common_suffix(a_rest, b_rest);
    // The tail starts at a line start in both, inside the common suffix.
    let starts_line = |text: &[u8], at: usize| at == 0 || text[at - 1] == b'\n';
    let from = a_rest.len() - suffix;
    let tail = (from..=a_rest.len())
        .find(|&at| {
            at == a_rest.len()
                || (starts_line(a_rest, at)
                    && starts_line(b_rest, at + b_rest.len() - a_rest.len()))
        })
        .map_or(0, |at| a_rest.len() - at);
    let old_mid = &live[head_end..head_end + a_rest.len() - tail];
    let new_mid = &new[head_end..head_end + b_rest.len() - tail];
    Hunk {
        at: memchr::memchr_iter(b'\n', &a[..head_end]).count(),
        remove: old_mid.split_inclusive('\n').count(),
        insert: new_mid.split_inclusive('\n').map(str::to_owned).collect(),
    }
}

fn changes_of_hunks(live: &str, new: &str, hunks: &[Hunk]) -> Result<Vec<ServerChange>, String> {
    let mut changes = Vec::new();
    // (index, byte offset) of the live line the walk is at.
    let (mut index, mut offset) = (0usize, 0usize);
    let mut seek = |number: usize| -> Result<usize, String> {
        if let Some(skip) = number.checked_sub(index).and_then(|n| n.checked_sub(1)) {
            // The end of the line before `number`: the `skip`-th newline from here.
            let Some(newline) = memchr::memchr_iter(b'\n', &live.as_bytes()[offset..]).nth(skip)
            else {
                return Err("a hunk beyond the live haproxy.cfg".to_owned());
            };
            offset += newline + 1;
            index = number;
        }
        Ok(offset)
    };
    for hunk in hunks {
        let start = seek(hunk.at)?;
        if hunk.remove != hunk.insert.len() {
            changes.extend(hunk_by_section(live, new, hunk, start)?);
            continue;
        }
        let mut in_place = Vec::new();
        let mut whole = false;
        for (i, inserted) in hunk.insert.iter().enumerate() {
            let number = hunk.at + i;
            let at = seek(number)?;
            let old = live[at..].split('\n').next().unwrap_or_default();
            let new = inserted.strip_suffix('\n').unwrap_or(inserted);
            if old == new {
                continue;
            }
            let section = section_above(live[..at].rsplit('\n').skip(1));
            match server_change(number, old, new, section) {
                Ok(change) => in_place.extend(change),
                Err(_) => {
                    whole = true;
                    break;
                }
            }
        }
        if !whole {
            changes.append(&mut in_place);
            continue;
        }
        // A line renamed, or lines shifted by one a backend gained and another lost: the
        // hunk read by section.
        changes.extend(hunk_by_section(live, new, hunk, start)?);
    }
    // Each hunk is read on its own: a server named in two of them (a line moved, or a name
    // added twice, which `haproxy -c` would refuse) needs a reload.
    let mut named = std::collections::HashSet::with_capacity(changes.len());
    if let Some(twice) = changes
        .iter()
        .find(|change| !named.insert((change.backend.as_str(), change.server.as_str())))
    {
        return Err(format!(
            "haproxy.cfg names server {}/{} in two changed places",
            twice.backend, twice.server
        ));
    }
    Ok(changes)
}

/// [`window_changes`] of `hunk`, whose first line starts at byte `at` of `live`.
fn hunk_by_section<'a>(
    live: &'a str,
    new: &str,
    hunk: &Hunk,
    at: usize,
) -> Result<Vec<ServerChange>, String> {
    let old: Vec<&str> = live[at..].split('\n').take(hunk.remove).collect();
    if old.len() < hunk.remove || (hunk.remove > 0 && at == live.len()) {
        return Err("a hunk beyond the live haproxy.cfg".to_owned());
    }
    let inserted: Vec<&str> = hunk
        .insert
        .iter()
        .map(|line| line.strip_suffix('\n').unwrap_or(line))
        .collect();
    let above = || live[..at].rsplit('\n').skip(1);
    let section = section_above(above());
    // The section's lines above the window (up to its header) and below it (up to the next
    // header): the same in both configs. Their first two tokens.
    fn own<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<(Option<&'a str>, Option<&'a str>)> {
        lines
            .map_while(|line| {
                let mut tokens = line.split_ascii_whitespace();
                let first = tokens.next();
                (!first.is_some_and(|first| SECTIONS.contains(&first)))
                    .then_some((first, tokens.next()))
            })
            .collect()
    }
    let (up, down) = (own(above()), own(live[at..].split('\n').skip(hunk.remove)));
    let named = |lines: &[(Option<&'a str>, Option<&'a str>)], keyword: &str| -> Vec<&'a str> {
        lines
            .iter()
            .filter(|(first, _)| *first == Some(keyword))
            .filter_map(|(_, second)| *second)
            .collect()
    };
    let around = Around {
        balance: named(&up, "balance").first().copied(),
        above: named(&up, "server"),
        below: named(&down, "server"),
    };
    window_changes(hunk.at, section, &around, &old, &inserted, new)
}

/// What a window's section has outside it: the `balance` line's algorithm above it, and the
/// names of the `server` lines above and below it.
struct Around<'a> {
    balance: Option<&'a str>,
    above: Vec<&'a str>,
    below: Vec<&'a str>,
}

/// The lines of a window of `haproxy.cfg` cut at its section headers: each part's header
/// line (none for the first, which goes on with the section above the window), its `server`
/// lines by name, and its other lines in order.
#[derive(Debug, PartialEq, Eq)]
struct Part<'a> {
    header: Option<&'a str>,
    servers: Vec<(&'a str, &'a str)>,
    others: Vec<&'a str>,
}

fn parts<'a>(lines: &[&'a str]) -> Vec<Part<'a>> {
    let mut parts = vec![Part {
        header: None,
        servers: Vec::new(),
        others: Vec::new(),
    }];
    for &line in lines {
        let mut tokens = line.split_ascii_whitespace();
        let first = tokens.next();
        if first.is_some_and(|first| SECTIONS.contains(&first)) {
            parts.push(Part {
                header: Some(line),
                servers: Vec::new(),
                others: Vec::new(),
            });
            continue;
        }
        let part = parts
            .last_mut()
            .unwrap_or_else(|| unreachable!("one part at least"));
        match (first, tokens.next()) {
            (Some("server"), Some(name)) => part.servers.push((name, line)),
            _ => part.others.push(line),
        }
    }
    parts
}

/// The server changes of `old`, lines of the live `haproxy.cfg` from line `number` (0-based)
/// on, in `section`, replaced by the lines `new` (of the new config `config`), where their
/// counts differ. Both are cut at their section headers, which must be the same and in the
/// same order, as must each part's lines other than `server` lines; the `server` lines of a
/// part are matched by name: in both, a slot changed in place ([`SlotChange::Set`]); only in
/// `new`, a slot added ([`SlotChange::Add`]: its tokens [`ADDABLE`], no `default-server`
/// anywhere in `config`, whose settings `add server` would not apply, and the section's
/// `balance` line, above the window or in it, `roundrobin`: the algorithm
/// of the reference templates' plain backends and slots, and the one whose dynamic servers
/// HAProxy 2.6 balances without known faults; releases up to 3.0 had some with `leastconn`
/// and `random`, haproxy/haproxy issues 2497 and 3413); only in `old`, a slot deleted. A
/// name twice in a part, or added where the section has it outside the window, needs a
/// reload.
fn window_changes(
    number: usize,
    section: (&str, &str),
    around: &Around<'_>,
    old: &[&str],
    new: &[&str],
    config: &str,
) -> Result<Vec<ServerChange>, String> {
    let differs = || {
        format!(
            "haproxy.cfg lines {}-{} changed beyond servers' addresses, weights and states and \
             server lines added or removed",
            number + 1,
            number + old.len().max(1)
        )
    };
    let (old_parts, new_parts) = (parts(old), parts(new));
    if old_parts.len() != new_parts.len() {
        return Err(differs());
    }
    let mut changes = Vec::new();
    let mut default_server: Option<bool> = None;
    let last = new_parts.len() - 1;
    for (index, (was, now)) in old_parts.iter().zip(&new_parts).enumerate() {
        if was.header != now.header || was.others != now.others {
            return Err(differs());
        }
        if was.servers == now.servers {
            continue;
        }
        let section = match now.header {
            None => section,
            Some(header) => {
                let mut tokens = header.split_ascii_whitespace();
                (
                    tokens.next().unwrap_or_default(),
                    tokens.next().unwrap_or_default(),
                )
            }
        };
        if !matches!(section.0, "backend" | "listen") || unsafe_text(section.1) {
            return Err(differs());
        }
        let mut roundrobin: Option<bool> = None;
        let live: HashMap<&str, &str> = was.servers.iter().copied().collect();
        let wanted: HashMap<&str, &str> = now.servers.iter().copied().collect();
        if live.len() != was.servers.len() || wanted.len() != now.servers.len() {
            return Err(differs());
        }
        for &(name, line) in &now.servers {
            match live.get(name) {
                Some(&before) => {
                    changes.extend(
                        server_change(number, before, line, section).map_err(|_| differs())?,
                    );
                }
                None => {
                    let (_, to, rest) = parse_server(line).ok_or_else(differs)?;
                    // The whole config is searched once a window, the section once a part.
                    let default_server = *default_server.get_or_insert_with(|| {
                        memchr::memmem::find(config.as_bytes(), b"default-server").is_some()
                    });
                    let roundrobin = *roundrobin.get_or_insert_with(|| {
                        let own = now.others.iter().find_map(|line| {
                            let mut tokens = line.split_ascii_whitespace();
                            (tokens.next() == Some("balance"))
                                .then(|| tokens.next())
                                .flatten()
                        });
                        own.or(if index == 0 { around.balance } else { None }) == Some("roundrobin")
                    });
                    // A name the section has outside the window would be there twice.
                    let elsewhere = (index == 0 && around.above.contains(&name))
                        || (index == last && around.below.contains(&name));
                    if !addable(&rest) || default_server || !roundrobin || elsewhere {
                        return Err(differs());
                    }
                    changes.push(ServerChange {
                        backend: section.1.to_owned(),
                        server: name.to_owned(),
                        from: ServerSpec {
                            enabled: false,
                            ..to
                        },
                        to,
                        change: SlotChange::Add(
                            rest.iter().map(|token| (*token).to_owned()).collect(),
                        ),
                    });
                }
            }
        }
        for &(name, line) in &was.servers {
            if wanted.contains_key(name) {
                continue;
            }
            let (_, from, _) = parse_server(line).ok_or_else(differs)?;
            changes.push(ServerChange {
                backend: section.1.to_owned(),
                server: name.to_owned(),
                from,
                to: ServerSpec {
                    enabled: false,
                    ..from
                },
                change: SlotChange::Delete,
            });
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
        change: SlotChange::Set,
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
    use std::collections::BTreeMap;

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

    /// A name added in two hunks of a delta (each read on its own, the other's line not yet
    /// in the live text) is a duplicate `haproxy -c` would refuse: a reload.
    #[test]
    fn a_server_added_in_two_hunks_needs_a_reload() {
        let live = "backend b\n    balance roundrobin\n    server s1 10.0.0.1:80\n    \
            timeout server 1s\n    server s2 10.0.0.2:80\n";
        let line = "    server s3 10.0.0.3:80\n".to_owned();
        let once = live.replace("timeout", "server s3 10.0.0.3:80\n    timeout");
        let hunk = |at| Hunk {
            at,
            remove: 0,
            insert: vec![line.clone()],
        };
        assert_eq!(
            config_changes_from_hunks(live, &once, &[hunk(3)]).map(|changes| changes.len()),
            Ok(1)
        );
        let twice = format!("{once}{line}");
        assert!(config_changes_from_hunks(live, &twice, &[hunk(3), hunk(5)]).is_err());
        assert!(config_changes(live, &twice).is_err());
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

        /// Backends that gain and lose `server` lines (slots grown or shrunk, a spare backend
        /// without servers taking a Service and giving it back) beside lines changed in
        /// place: the changes, applied to the live servers as HAProxy would hold them, give
        /// the new config's servers (each added one with its options); both readings agree;
        /// a new line `add server` would refuse (`cookie`) or a config with `default-server`
        /// needs a reload; lines that changed in place alone never do.
        #[test]
        fn servers_added_and_removed_take_the_live_servers_to_the_new_ones(
            counts in proptest::collection::vec((0usize..5, 0usize..5), 1..12),
            edits in proptest::collection::vec((0usize..12, 0usize..5, 0u8..3), 0..8),
            check in proptest::bool::ANY,
            refused in proptest::sample::select(
                vec![None, None, None, Some("cookie"), Some("default"), Some("leastconn")],
            ),
        ) {
            let line = |b: usize, s: usize, edit: Option<u8>, extra: &str| {
                let mut line = match edit {
                    None => format!("server s{s} 10.0.{b}.{s}:80"),
                    Some(0) => format!("server s{s} 10.9.{b}.{s}:8080"),
                    Some(1) => format!("server s{s} 10.0.{b}.{s}:80 weight 7"),
                    Some(_) => format!("server s{s} 10.0.{b}.{s}:80 disabled"),
                };
                if check {
                    line.push_str(" check");
                }
                line.push_str(extra);
                line
            };
            let edit_of = |b: usize, s: usize| {
                edits.iter().rev().find(|(eb, es, _)| *eb == b && *es == s).map(|(_, _, k)| *k)
            };
            let text = |new: bool| {
                let mut text = String::from("global\n    maxconn 10\n\nfrontend f\n    bind :80\n");
                if refused == Some("default") {
                    text.push_str("\ndefaults\n    default-server inter 3s\n");
                }
                for (b, &(before, after)) in counts.iter().enumerate() {
                    // With `leastconn` refused, every backend balances so.
                    let balance = if refused == Some("leastconn") { "leastconn" } else { "roundrobin" };
                    text.push_str(&format!("\nbackend be_{b}\n    balance {balance}\n"));
                    let count = if new { after } else { before };
                    for s in 0..count {
                        let (edit, extra) = match new {
                            false => (None, ""),
                            // The refused option on the lines a backend gains.
                            true if s >= before && refused == Some("cookie") => (edit_of(b, s), " cookie c"),
                            true => (edit_of(b, s), ""),
                        };
                        text.push_str(&format!("    {}\n", line(b, s, edit, extra)));
                    }
                }
                text
            };
            let (live, new) = (text(false), text(true));
            let servers = |config: &str| -> BTreeMap<(String, String), (ServerSpec, Vec<String>)> {
                let mut backend = String::new();
                let mut servers = BTreeMap::new();
                for line in config.lines() {
                    if let Some(name) = line.strip_prefix("backend ") {
                        backend = name.to_owned();
                    }
                    if let Some((name, spec, rest)) = parse_server(line.trim()) {
                        let rest = rest.iter().map(|t| (*t).to_owned()).collect();
                        servers.insert((backend.clone(), name.to_owned()), (spec, rest));
                    }
                }
                servers
            };
            let full = config_changes(&live, &new);
            let read = config_changes_from_hunks(&live, &new, &line_hunks(&live, &new));
            proptest::prop_assert_eq!(&full, &read);
            let gains = counts.iter().any(|(before, after)| after > before);
            match full {
                Ok(changes) => {
                    proptest::prop_assert!(refused.is_none() || !gains);
                    let mut held = servers(&live);
                    for change in &changes {
                        let key = (change.backend.clone(), change.server.clone());
                        match &change.change {
                            SlotChange::Set => {
                                let slot = held.get_mut(&key).expect("a live server set");
                                proptest::prop_assert_eq!(slot.0, change.from);
                                slot.0 = change.to;
                            }
                            SlotChange::Add(options) => {
                                proptest::prop_assert!(!change.from.enabled);
                                let before = held.insert(key, (change.to, options.clone()));
                                proptest::prop_assert!(before.is_none(), "{change:?} added twice");
                            }
                            SlotChange::Delete => {
                                let gone = held.remove(&key).expect("a live server deleted");
                                proptest::prop_assert_eq!(gone.0, change.from);
                            }
                        }
                    }
                    proptest::prop_assert_eq!(held, servers(&new));
                }
                Err(_) => proptest::prop_assert!(refused.is_some() && gains),
            }
        }
    }
}
