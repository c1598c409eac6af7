//! The config policy: what a set may make HAProxy do, checked before `haproxy -c` ever runs.
//!
//! A set is code. HAProxy runs Lua while it parses (`haproxy -c` included), forks `program`
//! sections and external checks, and reads or writes any file its configuration names: an
//! `errorfile /etc/passwd`, a `map(/run/haptic/token)` or a `bind /etc/shadow` (a unix socket
//! is renamed over its path) would let whoever writes a template read or clobber the node.
//! [`Policy::check`] refuses, by default:
//!
//! - Lua (`lua-load`, `lua-load-per-thread`, `lua-prepend-path`): [`Capability::Lua`];
//! - `program` sections: [`Capability::Program`];
//! - external checks and forking (`external-check`, `option external-check`,
//!   `insecure-fork-wanted`, `insecure-setuid-wanted`): [`Capability::ExternalCheck`];
//! - environment directives (`setenv`, `presetenv`, `resetenv`, `unsetenv`): [`Capability::Env`];
//! - crypto engines and providers, which load shared libraries (`ssl-engine`,
//!   `ssl-provider`, `ssl-provider-path`): [`Capability::SslEngine`];
//! - `daemon` (a daemonised master outlives whoever supervises it), `default-path parent`,
//!   network namespaces (`namespace`), inherited descriptors (`fd@`, `sockpair@`) outside
//!   `log`;
//! - every file or unix socket a configuration names that does not resolve inside the set: an
//!   absolute path (unless under one of [`Policy::allowed_path_prefixes`]), a `..` component,
//!   or a name built from an environment variable;
//! - environment variables read by the configuration (`"${NAME}"` expansion, the `env(NAME)`
//!   sample fetch) other than [`Policy::allowed_env`] (default [`DEFAULT_ALLOWED_ENV`]): the
//!   agent's environment may hold secrets.
//!
//! The file-taking keywords of HAProxy 2.6 it knows: `errorfile`, `return`/`deny`/`tarpit`/
//! `http-error` with `file`/`lf-file`/`errorfile`, ACL and map files (`-f`, `map*()`
//! converters, `set-map()`/`del-map()`/`add-acl()`/`del-acl()`), `crt`, `crt-list` (whose
//! lines are checked too when the list is in the set), `ca-file`, `ca-verify-file`,
//! `ca-sign-file`, `crl-file`, `tls-ticket-keys`, `ssl-dh-param-file`, `issuers-chain-path`,
//! `crt-base`, `ca-base`, `chroot`, `pidfile`, `default-path origin`, `server-state-base`,
//! `server-state-file`, `h1-case-adjust-file`, `httpclient.ssl.ca-file`, `unix-bind prefix`,
//! `filter spoe ... config` (whose file, when in the set, is checked too: its `log` lines and
//! expansions), `ring` `backing-file`, the device-detection data files, and unix
//! socket addresses (`/path`, `unix@`, `uxst@`, `uxdg@`) of `bind`, `server`, `log`,
//! `stats socket`, `peer`, `nameserver`, `mailer` and `dgram-bind`.
//!
//! Both sides run the very same check: the controller's render gate and admission webhook
//! (a refused set never leaves the controller) and the agent, which answers
//! `refused_by_policy` (422) before it writes anything.
//!
//! ```
//! use haptic_agent_client::{FileSet, policy::{Capability, Policy}};
//!
//! let files = FileSet::new().with(
//!     "haproxy.cfg",
//!     "global\n  lua-load /etc/haproxy/x.lua\nfrontend f\n  bind \"${POD_IP}:80\"\n",
//! )?;
//! let refused = Policy::default().check(&files).expect_err("Lua is off by default");
//! assert_eq!(
//!     refused.violations()[0].to_string(),
//!     "haproxy.cfg:2: lua-load: Lua is not allowed by the agent's policy (allow it with `lua`)"
//! );
//! // Allowing Lua still keeps the file inside the set.
//! let lua = Policy::default().with_capability(Capability::Lua);
//! assert!(lua.check(&files).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::{borrow::Cow, collections::BTreeSet, fmt, str::FromStr};

use serde::{Deserialize, Serialize};

use crate::protocol::{FileSet, MAIN_CONFIG};

/// Environment variables a configuration may read by default: what a pod of a fleet needs to
/// bind to its own address with the same configuration as its peers (`bind "${POD_IP}:80"`).
pub const DEFAULT_ALLOWED_ENV: [&str; 4] = ["POD_IP", "POD_NAME", "POD_NAMESPACE", "HOSTNAME"];

/// Variables HAProxy defines itself while it parses, always allowed.
const BUILTIN_ENV: [&str; 4] = [".FILE", ".LINE", ".SECTION", "HAPROXY_LOCALPEER"];

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The set breaks the policy; each violation names the file, the line and why.
    #[error("{}", refused_text(violations))]
    Refused {
        /// Every violation found, in file and line order.
        violations: Vec<Violation>,
    },
    /// A capability name is not one of [`Capability::ALL`].
    #[error("unknown capability {0:?} (known: lua, program, external-check, env, ssl-engine)")]
    UnknownCapability(String),
    /// An allowed path prefix is not an absolute path without `..`.
    #[error("allowed path prefix {0:?} must be absolute and without `..`")]
    BadPrefix(String),
    /// An allowed environment variable name is not a valid HAProxy variable name.
    #[error("allowed environment variable {0:?} is not a valid name (letters, digits, `_`)")]
    BadEnvName(String),
}

fn refused_text(violations: &[Violation]) -> String {
    const SHOWN: usize = 20;
    let mut text = format!(
        "the set breaks the config policy ({} violation{})",
        violations.len(),
        if violations.len() == 1 { "" } else { "s" }
    );
    for violation in violations.iter().take(SHOWN) {
        text.push_str("\n  ");
        text.push_str(&violation.to_string());
    }
    if violations.len() > SHOWN {
        text.push_str(&format!("\n  ... and {} more", violations.len() - SHOWN));
    }
    text
}

impl PolicyError {
    /// The violations of a [`PolicyError::Refused`] (empty for the other variants).
    pub fn violations(&self) -> &[Violation] {
        match self {
            Self::Refused { violations } => violations,
            _ => &[],
        }
    }
}

/// Result type of this module.
pub type Result<T, E = PolicyError> = std::result::Result<T, E>;

/// One thing a set may do only when the operator allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capability {
    /// `lua-load`, `lua-load-per-thread`, `lua-prepend-path` (files still inside the set
    /// unless under an allowed prefix). Lua runs during `haproxy -c` and can run programs.
    Lua,
    /// `program` sections: HAProxy's master forks and runs the command.
    Program,
    /// `external-check`, `option external-check`, `insecure-fork-wanted`,
    /// `insecure-setuid-wanted`: health checks that run binaries.
    ExternalCheck,
    /// `setenv`, `presetenv`, `resetenv`, `unsetenv`.
    Env,
    /// `ssl-engine`, `ssl-provider`, `ssl-provider-path`: OpenSSL loads shared libraries.
    SslEngine,
}

impl Capability {
    /// Every capability.
    pub const ALL: [Capability; 5] = [
        Self::Lua,
        Self::Program,
        Self::ExternalCheck,
        Self::Env,
        Self::SslEngine,
    ];

    /// The name used in flags and messages: `lua`, `program`, `external-check`, `env`,
    /// `ssl-engine`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lua => "lua",
            Self::Program => "program",
            Self::ExternalCheck => "external-check",
            Self::Env => "env",
            Self::SslEngine => "ssl-engine",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Lua => "Lua",
            Self::Program => "a program section",
            Self::ExternalCheck => "an external check or forking",
            Self::Env => "changing the environment",
            Self::SslEngine => "an OpenSSL engine or provider",
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Capability {
    type Err = PolicyError;

    fn from_str(name: &str) -> Result<Self> {
        let name = name.trim();
        Self::ALL
            .into_iter()
            .find(|capability| capability.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| PolicyError::UnknownCapability(name.to_owned()))
    }
}

/// One reason a set is refused: `<file>:<line>: <keyword>: <why>` when displayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The file of the set, as its path in the set.
    pub file: String,
    /// The line, 1-based.
    pub line: usize,
    /// The keyword (or converter, fetch, option) at fault.
    pub keyword: String,
    /// Why it is refused.
    pub why: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {}: {}",
            self.file, self.line, self.keyword, self.why
        )
    }
}

/// The config policy. [`Policy::default`] is the strict one: no capability, no absolute
/// path, the environment variables of [`DEFAULT_ALLOWED_ENV`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Capabilities the operator enabled (default none).
    pub allow: BTreeSet<Capability>,
    /// Absolute path prefixes a configuration may name, matched by whole components
    /// (`/etc/ssl` allows `/etc/ssl/certs/x.pem`, not `/etc/sslx`; default none).
    pub allowed_path_prefixes: Vec<String>,
    /// Environment variables a configuration may read with `"${NAME}"` or `env(NAME)`
    /// (default [`DEFAULT_ALLOWED_ENV`]).
    pub allowed_env: BTreeSet<String>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            allow: BTreeSet::new(),
            allowed_path_prefixes: Vec::new(),
            allowed_env: DEFAULT_ALLOWED_ENV
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
        }
    }
}

impl Policy {
    /// The strict default, the same as [`Policy::default`].
    pub fn strict() -> Self {
        Self::default()
    }

    /// Adds a capability.
    #[must_use]
    pub fn with_capability(mut self, capability: Capability) -> Self {
        self.allow.insert(capability);
        self
    }

    /// Adds an allowed absolute path prefix (see [`Policy::allowed_path_prefixes`]).
    #[must_use]
    pub fn with_path_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.allowed_path_prefixes.push(prefix.into());
        self
    }

    /// Adds an allowed environment variable.
    #[must_use]
    pub fn with_env(mut self, name: impl Into<String>) -> Self {
        self.allowed_env.insert(name.into());
        self
    }

    /// Parses a comma-separated capability list (`lua,program`; empty allows nothing).
    pub fn parse_capabilities(list: &str) -> Result<BTreeSet<Capability>> {
        list.split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(Capability::from_str)
            .collect()
    }

    /// Checks the rules: every prefix absolute without `..`, every variable name valid.
    pub fn validate(&self) -> Result<()> {
        for prefix in &self.allowed_path_prefixes {
            if !prefix.starts_with('/') || prefix.split('/').any(|c| c == "..") {
                return Err(PolicyError::BadPrefix(prefix.clone()));
            }
        }
        for name in &self.allowed_env {
            let valid = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(PolicyError::BadEnvName(name.clone()));
            }
        }
        Ok(())
    }

    /// Checks `files` (its `haproxy.cfg`, and the crt-lists it names that are in the set):
    /// `Ok` when nothing breaks the policy, else every violation.
    pub fn check(&self, files: &FileSet) -> Result<()> {
        let violations = self.violations(files);
        if violations.is_empty() {
            Ok(())
        } else {
            Err(PolicyError::Refused { violations })
        }
    }

    /// Every violation in `files`, in file and line order (empty: the set passes).
    pub fn violations(&self, files: &FileSet) -> Vec<Violation> {
        self.violations_and_roles(files).0
    }

    /// [`Policy::violations`], and the [`Roles`] `haproxy.cfg` gives the set's other files.
    pub fn violations_and_roles(&self, files: &FileSet) -> (Vec<Violation>, Roles) {
        let mut checker = self.checker();
        if let Some(config) = files.get(MAIN_CONFIG) {
            checker.config(&String::from_utf8_lossy(config));
        }
        let lists = std::mem::take(&mut checker.crt_lists);
        let spoe = std::mem::take(&mut checker.spoe);
        // HAProxy resolves a relative crt-list against the set's root (`-C`, `default-path
        // config`), a `default-path origin` and `crt-base`: every place it could be found in
        // the set is checked.
        let candidates = |named: &BTreeSet<String>| {
            let mut found = BTreeSet::new();
            for name in named {
                for base in &checker.bases {
                    found.insert(if base.is_empty() {
                        name.clone()
                    } else {
                        format!("{}/{name}", base.trim_end_matches('/'))
                    });
                }
            }
            found
        };
        let roles = Roles {
            crt_lists: candidates(&lists),
            spoe: candidates(&spoe),
        };
        checker.files(files, &roles, |_| true);
        (checker.violations, roles)
    }

    /// The violations a change brings into a set that passed the policy, with the result of a
    /// check of the whole set: `files` is the whole new set, `changed` the paths the change
    /// added or rewrote, `roles` those of the set before it. Only the changed files
    /// `haproxy.cfg` makes crt-lists or SPOE configurations are read (the policy reads no
    /// other file). When `haproxy.cfg` changed by `config_hunks` (the old text and the hunks
    /// that made the new one), only the lines they inserted are checked, each in its section;
    /// when a changed line opens a section or names a crt-list, an SPOE configuration or a
    /// base directory, or `haproxy.cfg` changed otherwise, the whole set is checked
    /// ([`Policy::violations_and_roles`]) and the roles follow it.
    pub fn violations_of_change<'a>(
        &self,
        files: &FileSet,
        changed: impl IntoIterator<Item = &'a str>,
        roles: &Roles,
        config_hunks: Option<(&[u8], &[crate::protocol::Hunk])>,
    ) -> (Vec<Violation>, Roles) {
        let changed: BTreeSet<&str> = changed.into_iter().collect();
        let mut checker = self.checker();
        if changed.contains(MAIN_CONFIG) {
            let lines = config_hunks.and_then(|(old, hunks)| {
                let new = std::str::from_utf8(files.get(MAIN_CONFIG)?).ok()?;
                Some((new, changed_lines(std::str::from_utf8(old).ok()?, hunks)?))
            });
            let Some((new, lines)) = lines else {
                return self.violations_and_roles(files);
            };
            checker.config_lines(new, &lines);
        }
        checker.files(files, roles, |path| changed.contains(path));
        (checker.violations, roles.clone())
    }

    fn checker(&self) -> Checker<'_> {
        Checker {
            policy: self,
            violations: Vec::new(),
            crt_lists: BTreeSet::new(),
            spoe: BTreeSet::new(),
            bases: vec![String::new()],
            file: MAIN_CONFIG.to_owned(),
            line: 0,
        }
    }

    /// Why `path` does not resolve inside the set or under an allowed prefix, if it does not.
    fn path_refusal(&self, path: &str) -> Option<String> {
        if path.split('/').any(|component| component == "..") {
            return Some(format!("{path:?} leaves the set (`..`)"));
        }
        if path.starts_with('/') {
            let allowed = self.allowed_path_prefixes.iter().any(|prefix| {
                let prefix = prefix.trim_end_matches('/');
                prefix.is_empty()
                    || path == prefix
                    || path
                        .strip_prefix(prefix)
                        .is_some_and(|rest| rest.starts_with('/'))
            });
            if !allowed {
                return Some(format!(
                    "{path:?} is an absolute path outside the set (not under an allowed prefix)"
                ));
            }
        }
        None
    }

    fn env_allowed(&self, name: &str) -> bool {
        BUILTIN_ENV.contains(&name) || self.allowed_env.contains(name)
    }
}

/// One word of a configuration line, after HAProxy's quoting and escaping.
#[derive(Debug, Default)]
struct Word<'a> {
    /// The text, with `${NAME}` expansions left as written (borrowed from the line when
    /// nothing in it was quoted or escaped).
    text: Cow<'a, str>,
    /// The variables expanded in it.
    env: Vec<String>,
}

/// The most words HAProxy 2.6 reads on one configuration line (`MAX_LINE_ARGS` of its
/// `defaults.h`). A line with more is refused (`too many words, truncating after word 64`),
/// and with it the whole configuration: `haproxy -c` fails, and so does every later load.
pub const MAX_LINE_WORDS: usize = 64;

/// A configuration line with more words than HAProxy reads ([`long_lines`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LongLine {
    /// The line's number, from 1.
    pub line: usize,
    /// Its words, counted as HAProxy's parser splits them.
    pub words: usize,
}

/// The lines of a configuration `text` with more than [`MAX_LINE_WORDS`] words, in order,
/// counted as HAProxy 2.6's parser splits a line (blanks outside quotes separate words; a
/// quoted or escaped blank does not; a `#` outside quotes ends the line; an empty quoted word
/// counts). A line at exactly the limit loads.
///
/// ```
/// use haptic_agent_client::policy::{LongLine, MAX_LINE_WORDS, long_lines};
///
/// let fits = format!("acl a path{}", " /p".repeat(MAX_LINE_WORDS - 3));
/// let over = format!("acl a path{}", " /p".repeat(MAX_LINE_WORDS - 2));
/// let quoted = format!("acl a path \"{}\"", " /p".repeat(MAX_LINE_WORDS));
/// let text = [fits.as_str(), over.as_str(), quoted.as_str()].join("\n");
/// assert_eq!(long_lines(&text), [LongLine { line: 2, words: MAX_LINE_WORDS + 1 }]);
/// ```
pub fn long_lines(text: &str) -> Vec<LongLine> {
    text.split('\n')
        .enumerate()
        .filter_map(|(index, line)| {
            // Quotes and escapes only join blank-separated runs and a comment only ends the
            // line, so a line of at most MAX_LINE_WORDS runs (nearly all) needs no parse.
            line.split_ascii_whitespace().nth(MAX_LINE_WORDS)?;
            let words = words(line).len();
            (words > MAX_LINE_WORDS).then_some(LongLine {
                line: index + 1,
                words,
            })
        })
        .collect()
}

/// Splits a line the way HAProxy 2.6's parser does: blanks separate words; `#` outside quotes
/// starts a comment (also in the middle of a word); single quotes are literal; double quotes
/// expand `$NAME`, `${NAME}` and `${NAME-default}` (`\$` is a literal `$`); a backslash
/// outside single quotes escapes a blank, `#`, `\`, a quote or `$` and writes `\r`, `\n`,
/// `\t`, `\xHH`.
fn words(line: &str) -> Vec<Word<'_>> {
    // Most lines (servers, options, timeouts) quote, escape, expand and comment nothing.
    if !line
        .bytes()
        .any(|b| matches!(b, b'\\' | b'\'' | b'"' | b'#' | b'$'))
    {
        return line
            .split_ascii_whitespace()
            .map(|text| Word {
                text: Cow::Borrowed(text),
                env: Vec::new(),
            })
            .collect();
    }
    let mut out = Vec::new();
    let mut word: Option<Word> = None;
    let mut chars = line.chars().peekable();
    let (mut single, mut double) = (false, false);
    while let Some(c) = chars.next() {
        if !single && !double && c.is_ascii_whitespace() {
            if let Some(done) = word.take() {
                out.push(done);
            }
            continue;
        }
        if !single && !double && c == '#' {
            break;
        }
        let current = word.get_or_insert_with(Word::default);
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '\\' if !single => match chars.peek().copied() {
                Some(next @ (' ' | '\t' | '#' | '\\' | '\'' | '"')) => {
                    current.text.to_mut().push(next);
                    chars.next();
                }
                Some('$') if double => {
                    current.text.to_mut().push('$');
                    chars.next();
                }
                Some('x') => {
                    // `\xHH` is a byte: decoded, so that `\x2e\x2e` reads as the `..` it is.
                    let mut ahead = chars.clone();
                    ahead.next();
                    let hex: String = ahead.by_ref().take(2).collect();
                    match u8::from_str_radix(&hex, 16) {
                        Ok(byte) if hex.len() == 2 => {
                            current.text.to_mut().push(char::from(byte));
                            chars = ahead;
                        }
                        _ => current.text.to_mut().push('\\'),
                    }
                }
                Some('r') => {
                    current.text.to_mut().push('\r');
                    chars.next();
                }
                Some('n') => {
                    current.text.to_mut().push('\n');
                    chars.next();
                }
                Some('t') => {
                    current.text.to_mut().push('\t');
                    chars.next();
                }
                _ => current.text.to_mut().push('\\'),
            },
            '$' if double => {
                let braced = chars.peek() == Some(&'{');
                if braced {
                    chars.next();
                }
                let mut name = String::new();
                while let Some(&next) = chars.peek() {
                    let valid = next.is_ascii_alphanumeric() || next == '_' || next == '.';
                    if !valid {
                        break;
                    }
                    name.push(next);
                    chars.next();
                }
                if braced {
                    // `${NAME[*]}` and `${NAME-default}`: skip to the closing brace.
                    let mut rest = String::new();
                    for next in chars.by_ref() {
                        if next == '}' {
                            break;
                        }
                        rest.push(next);
                    }
                    current
                        .text
                        .to_mut()
                        .push_str(&format!("${{{name}{rest}}}"));
                } else {
                    current.text.to_mut().push('$');
                    current.text.to_mut().push_str(&name);
                }
                current.env.push(name);
            }
            other => current.text.to_mut().push(other),
        }
    }
    if let Some(done) = word {
        out.push(done);
    }
    out
}

/// The section a line opens, if it is a section header: [`Checker::config_line`]'s rule,
/// read from the first words alone (a line with quotes or escapes is read as it does).
fn section_header(line: &str) -> Option<Section> {
    // Only the first two words matter: those without quotes, escapes, `$` or `#` read the
    // same split at blanks (most lines: the rest of the line is not looked at).
    let special = |word: &str| word.contains(['"', '\'', '\\', '$', '#']);
    let mut first_two = line.split_ascii_whitespace();
    let first = first_two.next()?;
    let keyword = if special(first) {
        None
    } else if matches!(first, "no" | "default") {
        first_two.next().filter(|second| !special(second))
    } else {
        Some(first)
    };
    if let Some(keyword) = keyword {
        return section_of(keyword);
    }
    let keyword = if line.contains(['"', '\'', '\\', '$', '#']) {
        let words = words(line);
        let skip = usize::from(
            words
                .first()
                .is_some_and(|w| matches!(w.text.as_ref(), "no" | "default")),
        );
        return words.get(skip).and_then(|w| section_of(&w.text));
    } else {
        let mut words = line.split_ascii_whitespace();
        match words.next()? {
            "no" | "default" => words.next()?,
            first => first,
        }
    };
    section_of(keyword)
}

/// The section a header keyword opens.
fn section_of(keyword: &str) -> Option<Section> {
    match keyword {
        "global" => Some(Section::Global),
        "defaults" | "frontend" | "backend" | "listen" | "peers" | "resolvers" | "mailers"
        | "log-forward" | "http-errors" => Some(Section::Proxy),
        "ring" => Some(Section::Ring),
        "program" => Some(Section::Program),
        "userlist" | "cache" | "fcgi-app" => Some(Section::Other),
        _ => None,
    }
}

/// The lines of the new configuration `hunks` inserted (0-based ranges, in order), when no
/// line they remove or insert is [`structural`]; none otherwise.
fn changed_lines(
    old: &str,
    hunks: &[crate::protocol::Hunk],
) -> Option<Vec<std::ops::Range<usize>>> {
    let mut cursor = Lines::new(old);
    let mut ranges = Vec::with_capacity(hunks.len());
    let mut shift: isize = 0;
    for hunk in hunks {
        cursor.seek(hunk.at)?;
        for _ in 0..hunk.remove {
            if structural(cursor.next_line()?) {
                return None;
            }
        }
        if hunk.insert.iter().map(String::as_str).any(structural) {
            return None;
        }
        let start = hunk.at.checked_add_signed(shift)?;
        ranges.push(start..start + hunk.insert.len());
        shift += hunk.insert.len() as isize - hunk.remove as isize;
    }
    Some(ranges)
}

/// Reads a text's lines (as `str::split_inclusive('\n')` cuts them) forward from any line,
/// skipping to a line by counting line ends with memchr, not by splitting every line before
/// it: a 7 MB `haproxy.cfg` is 200,000 lines.
struct Lines<'a> {
    text: &'a str,
    /// The line `offset` starts.
    line: usize,
    offset: usize,
}

impl<'a> Lines<'a> {
    fn new(text: &'a str) -> Self {
        Self {
            text,
            line: 0,
            offset: 0,
        }
    }

    /// Moves to the start of line `target` (0-based; the line after the last one is its
    /// end): `None` when it is behind or the text has fewer lines.
    fn seek(&mut self, target: usize) -> Option<()> {
        let skip = target.checked_sub(self.line)?;
        if skip == 0 {
            return Some(());
        }
        let rest = self.text.as_bytes().get(self.offset..)?;
        match memchr::memchr_iter(b'\n', rest).nth(skip - 1) {
            Some(end) => self.offset += end + 1,
            None => {
                // Fewer line ends than lines to skip: only a last line without one is left.
                let ends = memchr::memchr_iter(b'\n', rest).count();
                let unterminated = !rest.is_empty() && rest.last() != Some(&b'\n');
                if !(unterminated && ends + 1 == skip) {
                    return None;
                }
                self.offset = self.text.len();
            }
        }
        self.line = target;
        Some(())
    }

    /// The line at the cursor, with its line end, and moves past it; `None` at the end.
    fn next_line(&mut self) -> Option<&'a str> {
        let rest = self
            .text
            .get(self.offset..)
            .filter(|rest| !rest.is_empty())?;
        let len = memchr::memchr(b'\n', rest.as_bytes()).map_or(rest.len(), |end| end + 1);
        let line = rest.get(..len)?;
        self.offset += len;
        self.line += 1;
        Some(line)
    }
}

/// Whether a configuration line can change more than itself: a section header, or a line
/// that names crt-lists, SPOE configurations or the directories they resolve against.
fn structural(line: &str) -> bool {
    section_header(line).is_some()
        || ["crt-list", "crt-base", "default-path", "spoe"]
            .iter()
            .any(|word| line.contains(word))
}

/// Where a configuration line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Global,
    Proxy,
    Program,
    Ring,
    Other,
}

/// What a set's `haproxy.cfg` makes of its other files, as far as the policy reads them: the
/// paths (in the set or not) it would read as crt-lists and as SPOE configurations. The agent
/// keeps it with its live set, so that a change that leaves `haproxy.cfg` alone is checked by
/// its changed files only ([`Policy::violations_of_change`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roles {
    crt_lists: BTreeSet<String>,
    spoe: BTreeSet<String>,
}

struct Checker<'a> {
    policy: &'a Policy,
    violations: Vec<Violation>,
    crt_lists: BTreeSet<String>,
    /// SPOE configuration files named by `filter spoe ... config`.
    spoe: BTreeSet<String>,
    /// Directories of the set a relative crt-list may be resolved against: the root, and the
    /// relative `crt-base` and `default-path origin` (and the one below the other).
    bases: Vec<String>,
    file: String,
    line: usize,
}

/// Bind and server options that name a file.
const FILE_OPTIONS: [&str; 8] = [
    "crt",
    "crt-list",
    "ca-file",
    "ca-verify-file",
    "ca-sign-file",
    "crl-file",
    "tls-ticket-keys",
    "issuers-chain-path",
];

/// Global keywords whose first argument is a file or directory.
const GLOBAL_FILES: [&str; 14] = [
    "chroot",
    "ca-base",
    "crt-base",
    "pidfile",
    "server-state-base",
    "server-state-file",
    "ssl-dh-param-file",
    "issuers-chain-path",
    "h1-case-adjust-file",
    "httpclient.ssl.ca-file",
    "51degrees-data-file",
    "wurfl-data-file",
    "deviceatlas-json-file",
    "ssl-provider-path",
];

impl Checker<'_> {
    fn refuse(&mut self, keyword: &str, why: impl Into<String>) {
        self.violations.push(Violation {
            file: self.file.clone(),
            line: self.line,
            keyword: keyword.to_owned(),
            why: why.into(),
        });
    }

    fn needs(&mut self, keyword: &str, capability: Capability) {
        if !self.policy.allow.contains(&capability) {
            self.refuse(
                keyword,
                format!(
                    "{} is not allowed by the agent's policy (allow it with `{}`)",
                    capitalized(capability.what()),
                    capability.name()
                ),
            );
        }
    }

    /// Checks a word naming a file or directory.
    fn path(&mut self, keyword: &str, word: Option<&Word>) {
        let Some(word) = word else { return };
        if !word.env.is_empty() {
            self.refuse(
                keyword,
                format!(
                    "{:?}: a file name must not depend on an environment variable",
                    word.text
                ),
            );
            return;
        }
        if keyword.ends_with("ca-file") && word.text == "@system-ca" {
            return;
        }
        if let Some(why) = self.policy.path_refusal(&word.text) {
            self.refuse(keyword, why);
        }
    }

    /// Checks an address: unix socket paths must stay inside the set, inherited descriptors
    /// are refused except for `log`.
    fn address(&mut self, keyword: &str, word: Option<&Word>) {
        let Some(word) = word else { return };
        for address in word.text.split(',') {
            let lower = address.to_ascii_lowercase();
            let path = ["unix@", "uxst@", "uxdg@"]
                .iter()
                .find_map(|prefix| lower.starts_with(prefix).then(|| &address[prefix.len()..]))
                .or_else(|| address.starts_with('/').then_some(address));
            if let Some(path) = path {
                let socket = Word {
                    text: Cow::Borrowed(path),
                    env: word.env.clone(),
                };
                self.path(keyword, Some(&socket));
            } else if (lower.starts_with("fd@") && keyword != "log")
                || lower.starts_with("sockpair@")
            {
                self.refuse(
                    keyword,
                    format!("{address:?}: inherited file descriptors are the agent's"),
                );
            }
        }
    }

    /// Checks every word for expansions, `env()` fetches and map/ACL file converters.
    fn expressions(&mut self, keyword: &str, words: &[Word]) {
        for word in words {
            for name in &word.env {
                if !self.policy.env_allowed(name) {
                    self.refuse(
                        keyword,
                        format!(
                            "environment variable {name:?} is not allowed by the agent's policy"
                        ),
                    );
                }
            }
            for (function, argument) in calls(&word.text) {
                if function == "env" {
                    if !self.policy.env_allowed(&argument) {
                        self.refuse(
                            "env",
                            format!("environment variable {argument:?} is not allowed by the agent's policy"),
                        );
                    }
                } else {
                    let env = if argument.contains('$') {
                        word.env.clone()
                    } else {
                        Vec::new()
                    };
                    let file = Word {
                        text: Cow::Owned(argument),
                        env,
                    };
                    self.path(&function, Some(&file));
                }
            }
        }
    }

    fn config(&mut self, text: &str) {
        let mut section = Section::Other;
        for (index, line) in text.lines().enumerate() {
            self.line = index + 1;
            self.config_line(line, &mut section);
        }
    }

    /// Checks the lines of `text` in `changed` (0-based line ranges of `text`, in order): the
    /// others only move the section along. For a configuration whose other lines passed.
    fn config_lines(&mut self, text: &str, changed: &[std::ops::Range<usize>]) {
        // Each run of changed lines is checked in the section the nearest header above it
        // opens, found by reading back from the run (a few lines in a generated config),
        // not by reading every line of a 7 MB `haproxy.cfg` from its top for its headers;
        // and the run itself is found by counting line ends.
        let mut lines = Lines::new(text);
        for range in changed {
            // Lines of a run that overlaps the one before were checked with it.
            if lines.seek(range.start.max(lines.line)).is_none() {
                return;
            }
            let mut section = text
                .get(..lines.offset)
                .unwrap_or_default()
                .lines()
                .rev()
                .find_map(section_header)
                .unwrap_or(Section::Other);
            while lines.line < range.end {
                let index = lines.line;
                let Some(line) = lines.next_line() else {
                    return;
                };
                // As `str::lines` gives it: without its line end.
                let line = match line.strip_suffix('\n') {
                    Some(line) => line.strip_suffix('\r').unwrap_or(line),
                    None => line,
                };
                self.line = index + 1;
                self.config_line(line, &mut section);
            }
        }
    }

    /// Checks one line of `haptic.cfg` in `section`, which a section header changes.
    fn config_line(&mut self, line: &str, section: &mut Section) {
        let words = words(line);
        let Some(first) = words.first() else { return };
        // `no option x` and `default option x` name the same keyword as `option x`.
        let skip = usize::from(matches!(first.text.as_ref(), "no" | "default"));
        let args = &words[skip..];
        let Some(keyword) = args.first().map(|word| word.text.as_ref()) else {
            return;
        };
        let arg = |i: usize| args.get(i);
        match keyword {
            "global" => *section = Section::Global,
            "defaults" | "frontend" | "backend" | "listen" | "peers" | "resolvers" | "mailers"
            | "log-forward" | "http-errors" => *section = Section::Proxy,
            "ring" => *section = Section::Ring,
            "program" => {
                *section = Section::Program;
                self.needs("program", Capability::Program);
            }
            "userlist" | "cache" | "fcgi-app" => *section = Section::Other,
            _ => {}
        }
        if *section == Section::Program {
            // A program's command line is not HAProxy configuration.
            return;
        }
        self.expressions(keyword, &words);
        match keyword {
            "lua-load" | "lua-load-per-thread" | "lua-prepend-path" => {
                self.needs(keyword, Capability::Lua);
                self.path(keyword, arg(1));
            }
            "setenv" | "presetenv" | "resetenv" | "unsetenv" => {
                self.needs(keyword, Capability::Env);
            }
            "external-check" | "insecure-fork-wanted" | "insecure-setuid-wanted" => {
                self.needs(keyword, Capability::ExternalCheck);
            }
            "option" if arg(1).is_some_and(|w| w.text == "external-check") => {
                self.needs("option external-check", Capability::ExternalCheck);
            }
            "ssl-engine" | "ssl-provider" => self.needs(keyword, Capability::SslEngine),
            "ssl-provider-path" => {
                self.needs(keyword, Capability::SslEngine);
                self.path(keyword, arg(1));
            }
            "daemon" if *section == Section::Global => self.refuse(
                "daemon",
                "a daemonised HAProxy outlives the agent that supervises it",
            ),
            "default-path" => match arg(1).map(|w| w.text.as_ref()) {
                Some("origin") => {
                    self.path("default-path origin", arg(2));
                    self.base(arg(2));
                }
                Some("parent") => self.refuse(
                    "default-path",
                    "`parent` resolves relative paths outside the set",
                ),
                _ => {}
            },
            "unix-bind" => {
                if let Some(i) = args.iter().position(|w| w.text == "prefix") {
                    self.path("unix-bind prefix", arg(i + 1));
                }
            }
            "stats" if arg(1).is_some_and(|w| w.text == "socket") => {
                self.address("stats socket", arg(2));
            }
            "log" => self.address("log", arg(1)),
            "bind" | "dgram-bind" => {
                self.address(keyword, arg(1));
                self.options(keyword, &args[1..]);
            }
            "server" | "peer" | "nameserver" | "mailer" => {
                self.address(keyword, arg(2));
                self.options(keyword, &args[2..]);
            }
            "default-server" | "server-template" => self.options(keyword, &args[1..]),
            "errorfile" => self.path("errorfile", arg(2)),
            "backing-file" if *section == Section::Ring => self.path(keyword, arg(1)),
            "http-request" | "http-response" | "http-after-response" | "http-error" => {
                let answers = keyword == "http-error"
                    || arg(1)
                        .is_some_and(|w| matches!(w.text.as_ref(), "return" | "deny" | "tarpit"));
                if answers {
                    for (i, word) in args.iter().enumerate() {
                        if matches!(word.text.as_ref(), "file" | "lf-file" | "errorfile") {
                            self.path(&format!("{keyword} {}", word.text), arg(i + 1));
                        }
                    }
                }
            }
            "filter" if arg(1).is_some_and(|w| w.text == "spoe") => {
                if let Some(i) = args.iter().position(|w| w.text == "config") {
                    self.path("filter spoe config", arg(i + 1));
                    if let Some(file) = arg(i + 1)
                        && file.env.is_empty()
                    {
                        self.spoe
                            .insert(file.text.trim_start_matches("./").to_owned());
                    }
                }
            }
            known if *section == Section::Global && GLOBAL_FILES.contains(&known) => {
                self.path(known, arg(1));
                if known == "crt-base" {
                    self.base(arg(1));
                }
            }
            "server-state-file" => self.path(keyword, arg(1)),
            _ => {}
        }
        // ACL and map files (`acl x ... -f file`, `if { ... -f file }`).
        for (i, word) in words.iter().enumerate() {
            if word.text == "-f" {
                self.path("-f", words.get(i + 1));
            }
        }
    }

    /// Checks the crt-lists and SPOE configurations of `files` that `roles` names and
    /// `wanted` selects, in path order.
    fn files(&mut self, files: &FileSet, roles: &Roles, wanted: impl Fn(&str) -> bool) {
        for path in &roles.crt_lists {
            if let Some(content) = files.get(path).filter(|_| wanted(path)) {
                self.file = path.clone();
                self.crt_list(&String::from_utf8_lossy(content));
            }
        }
        for path in &roles.spoe {
            if let Some(content) = files.get(path).filter(|_| wanted(path)) {
                self.file = path.clone();
                self.spoe(&String::from_utf8_lossy(content));
            }
        }
    }

    /// Records a relative base directory a crt-list may be resolved against.
    fn base(&mut self, word: Option<&Word>) {
        let Some(word) = word else { return };
        let base = word.text.trim_start_matches("./").trim_end_matches('/');
        if base.is_empty() || base.starts_with('/') || !word.env.is_empty() {
            return;
        }
        let below: Vec<String> = self
            .bases
            .iter()
            .filter(|known| !known.is_empty())
            .map(|known| format!("{known}/{base}"))
            .collect();
        self.bases.push(base.to_owned());
        self.bases.extend(below);
    }

    /// Checks the options of a `bind` or `server` line.
    fn options(&mut self, keyword: &str, words: &[Word]) {
        for (i, word) in words.iter().enumerate() {
            let option = word.text.as_ref();
            if FILE_OPTIONS.contains(&option) {
                self.path(&format!("{keyword} {option}"), words.get(i + 1));
                if option == "crt-list"
                    && let Some(list) = words.get(i + 1)
                    && list.env.is_empty()
                {
                    self.crt_lists
                        .insert(list.text.trim_start_matches("./").to_owned());
                }
            } else if option == "namespace" {
                self.refuse(
                    &format!("{keyword} namespace"),
                    "network namespaces are the node's",
                );
            }
        }
    }

    /// Checks an SPOE configuration file: HAProxy parses it like its own (quotes and
    /// expansions), and its `log` lines name addresses.
    fn spoe(&mut self, text: &str) {
        for (index, line) in text.lines().enumerate() {
            self.line = index + 1;
            let words = words(line);
            let Some(first) = words.first() else { continue };
            let keyword = first.text.to_string();
            self.expressions(&keyword, &words);
            if keyword == "log" {
                self.address("log", words.get(1));
            }
        }
    }

    /// Checks a crt-list: `<crtfile> [[<ssl options>]] [<sni filters>]` a line.
    fn crt_list(&mut self, text: &str) {
        for (index, line) in text.lines().enumerate() {
            self.line = index + 1;
            let words = words(line);
            let Some(first) = words.first() else { continue };
            self.expressions("crt-list", &words);
            self.path("crt-list certificate", Some(first));
            for (i, word) in words.iter().enumerate() {
                let option = word.text.trim_start_matches('[');
                if FILE_OPTIONS.contains(&option) {
                    let file = words.get(i + 1).map(|w| Word {
                        text: Cow::Borrowed(w.text.trim_end_matches(']')),
                        env: w.env.clone(),
                    });
                    self.path(&format!("crt-list {option}"), file.as_ref());
                }
            }
        }
    }
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The calls in a word that read a file or the environment: `env(NAME)`, the map converters
/// (`map`, `map_beg`, `map_str_int`, ...) and `set-map`/`del-map`/`add-acl`/`del-acl`, each
/// with its first argument (quotes removed). A converter argument that is quoted is read to
/// its closing quote, so a comma inside it does not hide the rest of the name.
fn calls(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut start = 0;
    while let Some(offset) = text[start..].find('(') {
        let open = start + offset;
        start = open + 1;
        // The function name: the identifier characters right before the parenthesis.
        // (The character that ends it may be multibyte: step over it whole.)
        let name_start = text[..open]
            .char_indices()
            .rev()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'))
            .map_or(0, |(i, c)| i + c.len_utf8());
        let name = &text[name_start..open];
        let file_taking = name == "map"
            || name.starts_with("map_")
            || matches!(name, "set-map" | "del-map" | "add-acl" | "del-acl");
        if name != "env" && !file_taking {
            continue;
        }
        let mut argument = String::new();
        let mut i = open + 1;
        let quote = match bytes.get(i) {
            Some(&q @ (b'"' | b'\'')) => {
                i += 1;
                Some(q)
            }
            _ => None,
        };
        // Every arm breaks or moves `i` past one whole character, so `i` stays on a boundary.
        while let Some(&b) = bytes.get(i) {
            match quote {
                Some(q) if b == q => break,
                Some(_) if b == b'\\' => {
                    // The escaped character is taken whole: a byte index that stopped inside
                    // a multibyte character would make the next slice panic.
                    i += 1;
                    if let Some(escaped) = text.get(i..).and_then(|rest| rest.chars().next()) {
                        argument.push(escaped);
                        i += escaped.len_utf8();
                    }
                    continue;
                }
                None if b == b',' || b == b')' => break,
                _ => {
                    // Multibyte characters are copied whole.
                    let Some(ch) = text.get(i..).and_then(|rest| rest.chars().next()) else {
                        break;
                    };
                    argument.push(ch);
                    i += ch.len_utf8();
                }
            }
        }
        out.push((name.to_owned(), argument.trim().to_owned()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`changed_lines`] as it was, over every line split first.
    fn changed_lines_by_split(
        old: &str,
        hunks: &[crate::protocol::Hunk],
    ) -> Option<Vec<std::ops::Range<usize>>> {
        let old_lines: Vec<&str> = old.split_inclusive('\n').collect();
        let mut ranges = Vec::new();
        let mut shift: isize = 0;
        for hunk in hunks {
            let removed = old_lines.get(hunk.at..hunk.at.checked_add(hunk.remove)?)?;
            if removed
                .iter()
                .copied()
                .chain(hunk.insert.iter().map(String::as_str))
                .any(structural)
            {
                return None;
            }
            let start = hunk.at.checked_add_signed(shift)?;
            ranges.push(start..start + hunk.insert.len());
            shift += hunk.insert.len() as isize - hunk.remove as isize;
        }
        Some(ranges)
    }

    proptest::proptest! {
        /// The line cursor reads the lines `split_inclusive` cuts, from any line on, and
        /// refuses a line the text lacks; the hunks' ranges come out as from every line split.
        #[test]
        fn lines_are_read_as_split_and_hunks_found_alike(
            words in proptest::collection::vec(
                proptest::sample::select(vec!["a", "b c", "\n", "\r\n", "backend x\n", "crt-list l\n", ""]),
                0..40,
            ),
            targets in proptest::collection::vec((0usize..30, 0usize..4, 0usize..3), 0..5),
        ) {
            let text: String = words.concat();
            let split: Vec<&str> = text.split_inclusive('\n').collect();
            for start in 0..split.len() + 2 {
                let mut cursor = Lines::new(&text);
                let sought = cursor.seek(start);
                proptest::prop_assert_eq!(sought.is_some(), start <= split.len());
                if sought.is_some() {
                    let rest: Vec<&str> = std::iter::from_fn(|| cursor.next_line()).collect();
                    proptest::prop_assert_eq!(rest, split[start..].to_vec());
                }
            }
            let mut at = 0;
            let hunks: Vec<crate::protocol::Hunk> = targets
                .into_iter()
                .map(|(skip, remove, insert)| {
                    at += skip;
                    let hunk = crate::protocol::Hunk {
                        at,
                        remove,
                        insert: (0..insert).map(|i| format!("server s{i} 10.0.0.{i}:80\n")).collect(),
                    };
                    at += remove;
                    hunk
                })
                .collect();
            proptest::prop_assert_eq!(changed_lines(&text, &hunks), changed_lines_by_split(&text, &hunks));
        }
    }

    fn set(config: &str) -> FileSet {
        FileSet::new()
            .with(MAIN_CONFIG, config.to_owned())
            .expect("valid set")
    }

    #[test]
    fn long_lines_count_words_as_haproxy_splits_them() {
        let line = |words: usize| format!("acl a path{}", " /p".repeat(words - 3));
        let counted = |text: &str| long_lines(text).iter().map(|l| l.words).collect::<Vec<_>>();
        assert!(long_lines(&line(MAX_LINE_WORDS)).is_empty());
        assert_eq!(counted(&line(MAX_LINE_WORDS + 1)), [MAX_LINE_WORDS + 1]);
        // Tabs and runs of blanks separate as one; a comment is no words.
        let tabs = line(MAX_LINE_WORDS).replace(' ', " \t ");
        assert!(long_lines(&format!("{tabs}   # {}", "x ".repeat(80))).is_empty());
        // A quoted or escaped blank joins; an empty quoted word counts.
        let joined = format!("{} \"a b\" c\\ d", line(MAX_LINE_WORDS - 2));
        assert!(long_lines(&joined).is_empty());
        let empty = format!("{} \"\"", line(MAX_LINE_WORDS));
        assert_eq!(counted(&empty), [MAX_LINE_WORDS + 1]);
        // Numbered from 1, every such line.
        let text = format!("global\n{}\n{}\n", line(70), line(65));
        assert_eq!(
            long_lines(&text),
            [
                LongLine { line: 2, words: 70 },
                LongLine { line: 3, words: 65 }
            ]
        );
    }

    fn refusals(policy: &Policy, config: &str) -> Vec<String> {
        policy
            .violations(&set(config))
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    fn strict(config: &str) -> Vec<String> {
        refusals(&Policy::default(), config)
    }

    #[test]
    fn words_follow_haproxys_quoting() {
        let texts = |line: &str| -> Vec<String> {
            words(line)
                .into_iter()
                .map(|w| w.text.into_owned())
                .collect()
        };
        assert_eq!(texts("  bind :80 # comment"), ["bind", ":80"]);
        assert_eq!(texts("a#b c"), ["a"]);
        assert_eq!(texts("x 'a b' \"c#d\" e\\ f"), ["x", "a b", "c#d", "e f"]);
        assert_eq!(texts("x a\"b\"'c'"), ["x", "abc"]);
        assert_eq!(texts("crt \\x2fetc '\\x2f'"), ["crt", "/etc", "\\x2f"]);
        let word = &words("x \"${POD_IP}:80\" '${HOME}' \"\\${HOME}\"")[1..];
        assert_eq!(word[0].env, ["POD_IP"]);
        assert!(word[1].env.is_empty(), "single quotes do not expand");
        assert!(word[2].env.is_empty(), "an escaped dollar does not expand");
        assert_eq!(word[2].text, "${HOME}");
        assert_eq!(words("x \"$HOME/a\"")[1].env, ["HOME"]);
        assert_eq!(words("x \"${A-def}\"")[1].env, ["A"]);
    }

    #[test]
    fn each_capability_is_refused_by_default_and_allowed_by_name() {
        let cases = [
            ("global\n  lua-load x.lua\n", Capability::Lua, "lua-load"),
            (
                "global\n  lua-load-per-thread x.lua\n",
                Capability::Lua,
                "lua-load-per-thread",
            ),
            (
                "global\n  lua-prepend-path lua/?.lua\n",
                Capability::Lua,
                "lua-prepend-path",
            ),
            (
                "program p\n  command sh -c 'sleep 100'\n",
                Capability::Program,
                "program",
            ),
            (
                "global\n  external-check\n",
                Capability::ExternalCheck,
                "external-check",
            ),
            (
                "global\n  insecure-fork-wanted\n",
                Capability::ExternalCheck,
                "insecure-fork-wanted",
            ),
            (
                "global\n  insecure-setuid-wanted\n",
                Capability::ExternalCheck,
                "insecure-setuid-wanted",
            ),
            (
                "backend b\n  option external-check\n",
                Capability::ExternalCheck,
                "option external-check",
            ),
            (
                "backend b\n  external-check command /bin/true\n",
                Capability::ExternalCheck,
                "external-check",
            ),
            ("global\n  setenv A b\n", Capability::Env, "setenv"),
            ("global\n  presetenv A b\n", Capability::Env, "presetenv"),
            ("global\n  resetenv A\n", Capability::Env, "resetenv"),
            ("global\n  unsetenv A\n", Capability::Env, "unsetenv"),
            (
                "global\n  ssl-engine rdrand\n",
                Capability::SslEngine,
                "ssl-engine",
            ),
            (
                "global\n  ssl-provider legacy\n",
                Capability::SslEngine,
                "ssl-provider",
            ),
        ];
        for (config, capability, keyword) in cases {
            let found = strict(config);
            assert_eq!(found.len(), 1, "{config}: {found:?}");
            let line = if config.starts_with("program") { 1 } else { 2 };
            assert!(
                found[0].starts_with(&format!("haproxy.cfg:{line}: {keyword}: ")),
                "{found:?}"
            );
            assert!(found[0].contains(capability.name()), "{found:?}");
            let allowed = Policy::default().with_capability(capability);
            assert_eq!(refusals(&allowed, config), Vec::<String>::new(), "{config}");
        }
    }

    #[test]
    fn files_outside_the_set_are_refused_with_file_line_and_keyword() {
        let cases = [
            ("global\n  chroot /var/empty\n", "chroot"),
            ("global\n  ca-base /etc/ssl\n", "ca-base"),
            ("global\n  crt-base ../x\n", "crt-base"),
            ("global\n  pidfile /run/haproxy.pid\n", "pidfile"),
            (
                "global\n  server-state-base /var/state\n",
                "server-state-base",
            ),
            (
                "global\n  server-state-file /var/state/s\n",
                "server-state-file",
            ),
            (
                "backend b\n  server-state-file /var/state/s\n",
                "server-state-file",
            ),
            (
                "global\n  ssl-dh-param-file /etc/dh.pem\n",
                "ssl-dh-param-file",
            ),
            (
                "global\n  issuers-chain-path /etc/chains\n",
                "issuers-chain-path",
            ),
            (
                "global\n  h1-case-adjust-file /etc/h1\n",
                "h1-case-adjust-file",
            ),
            (
                "global\n  httpclient.ssl.ca-file /etc/ca.pem\n",
                "httpclient.ssl.ca-file",
            ),
            (
                "global\n  default-path origin /etc\n",
                "default-path origin",
            ),
            ("global\n  default-path parent\n", "default-path"),
            (
                "global\n  unix-bind prefix /etc mode 600\n",
                "unix-bind prefix",
            ),
            (
                "global\n  stats socket /run/admin.sock level admin\n",
                "stats socket",
            ),
            (
                "global\n  stats socket unix@../admin.sock\n",
                "stats socket",
            ),
            ("global\n  log /dev/log local0\n", "log"),
            ("defaults\n  errorfile 503 /etc/passwd\n", "errorfile"),
            (
                "http-errors e\n  errorfile 404 ../../etc/passwd\n",
                "errorfile",
            ),
            (
                "frontend f\n  http-request return status 200 file /etc/passwd\n",
                "http-request file",
            ),
            (
                "frontend f\n  http-request deny deny_status 403 lf-file /etc/passwd\n",
                "http-request lf-file",
            ),
            (
                "frontend f\n  http-response return errorfile /etc/passwd\n",
                "http-response errorfile",
            ),
            (
                "frontend f\n  http-error status 500 file /etc/passwd\n",
                "http-error file",
            ),
            ("frontend f\n  acl bad src -f /etc/hosts.allow\n", "-f"),
            ("frontend f\n  use_backend b if { src -f ../x.acl }\n", "-f"),
            (
                "frontend f\n  use_backend %[req.hdr(host),map(/run/haptic/token)]\n",
                "map",
            ),
            (
                "frontend f\n  use_backend %[req.hdr(host),lower,map_beg(\"/etc/x\",b)]\n",
                "map_beg",
            ),
            (
                "frontend f\n  use_backend %[src,map_ip_int(maps/../../x)]\n",
                "map_ip_int",
            ),
            (
                "frontend f\n  http-request set-header x \"%[src,map_str('a,/../../x')]\"\n",
                "map_str",
            ),
            (
                "frontend f\n  http-request set-map(/etc/x) %[src] %[src]\n",
                "set-map",
            ),
            (
                "frontend f\n  bind :443 ssl crt /etc/ssl/private/key.pem\n",
                "bind crt",
            ),
            (
                "frontend f\n  bind :443 ssl crt-list /etc/list\n",
                "bind crt-list",
            ),
            (
                "frontend f\n  bind :443 ssl crt \\x2fetc/key.pem\n",
                "bind crt",
            ),
            (
                "frontend f\n  bind :443 ssl crt a\\x2f\\x2e\\x2e/x.pem\n",
                "bind crt",
            ),
            (
                "frontend f\n  bind :443 ssl crt x.pem ca-file /etc/ca.pem verify required\n",
                "bind ca-file",
            ),
            (
                "frontend f\n  bind :443 ssl crt x.pem crl-file ../crl.pem\n",
                "bind crl-file",
            ),
            (
                "frontend f\n  bind :443 ssl crt x.pem tls-ticket-keys /etc/keys\n",
                "bind tls-ticket-keys",
            ),
            ("frontend f\n  bind /etc/shadow\n", "bind"),
            ("frontend f\n  bind unix@/etc/shadow,:80\n", "bind"),
            ("frontend f\n  bind fd@3\n", "bind"),
            ("frontend f\n  bind :80 namespace host\n", "bind namespace"),
            ("backend b\n  server s /var/run/docker.sock\n", "server"),
            (
                "backend b\n  server s 10.0.0.1:443 ssl ca-file /etc/ca.pem\n",
                "server ca-file",
            ),
            (
                "backend b\n  server s 10.0.0.1:443 ssl crt /etc/client.pem\n",
                "server crt",
            ),
            (
                "backend b\n  default-server ssl crl-file /etc/crl.pem\n",
                "default-server crl-file",
            ),
            (
                "backend b\n  filter spoe engine e config /etc/spoe.conf\n",
                "filter spoe config",
            ),
            ("ring r\n  backing-file /etc/ring\n", "backing-file"),
            ("peers p\n  peer a unix@/run/peer.sock\n", "peer"),
            ("global\n  lua-load /etc/x.lua\n", "lua-load"),
        ];
        let lua = Policy::default().with_capability(Capability::Lua);
        for (config, keyword) in cases {
            let found = refusals(&lua, config);
            assert!(
                found
                    .iter()
                    .any(|v| v.starts_with(&format!("haproxy.cfg:2: {keyword}: "))),
                "{config:?} should be refused as {keyword}: {found:?}"
            );
        }
    }

    #[test]
    fn files_inside_the_set_and_allowed_prefixes_pass() {
        let config = "global\n  default-path config\n  crt-base ssl\n  log stdout format raw local0\n  \
            log stderr local0\n  log fd@2 local0\n  log 127.0.0.1:514 local0\n  stats socket unix@admin.sock\n  \
            stats socket ipv4@127.0.0.1:9999\n  ca-base ssl\n  server-state-file state\n\
            defaults\n  mode http\n  errorfile 503 errors/503.http\n\
            frontend f\n  bind \"${POD_IP}:80\"\n  bind :443 ssl crt ssl/a.pem crt-list maps/certs.list ca-file @system-ca\n  \
            bind abns@x\n  http-request return status 200 file pages/a.html\n  \
            use_backend %[req.hdr(host),lower,map(maps/hosts.map,be)]\n  acl ok src -f maps/ok.acl\n  \
            http-request set-header x \"%[env(POD_NAME)]\"\n\
            backend b\n  server s 10.0.0.1:80\n  server t unix@sockets/t.sock\n";
        assert_eq!(strict(config), Vec::<String>::new());
        let allowed = Policy::default().with_path_prefix("/etc/ssl/");
        let config =
            "global\n  ca-base /etc/ssl\nfrontend f\n  bind :443 ssl crt /etc/ssl/certs/a.pem\n";
        assert_eq!(refusals(&allowed, config), Vec::<String>::new());
        let config = "global\n  ca-base /etc/sslx\n  crt-base /etc/ssl/../shadow\n";
        assert_eq!(refusals(&allowed, config).len(), 2);
    }

    #[test]
    fn environment_variables_are_bounded_by_the_allow_list() {
        let config = "frontend f\n  bind \"${POD_IP}:80\"\n  bind \"$HOSTNAME:81\"\n  \
            http-request return status 200 string \"${AGENT_TOKEN}\"\n  \
            http-request set-header x %[env(AWS_SECRET_ACCESS_KEY)]\n  .notice \"$SECRET\"\n";
        let found = strict(config);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(
            found[0]
                .starts_with("haproxy.cfg:4: http-request: environment variable \"AGENT_TOKEN\"")
        );
        assert!(found[1].starts_with("haproxy.cfg:5: env: "), "{found:?}");
        assert!(
            found[2].starts_with("haproxy.cfg:6: .notice: "),
            "{found:?}"
        );
        let extended = Policy::default()
            .with_env("AGENT_TOKEN")
            .with_env("AWS_SECRET_ACCESS_KEY")
            .with_env("SECRET");
        assert_eq!(refusals(&extended, config), Vec::<String>::new());
        // A file name built from a variable is refused even when the variable is allowed.
        assert_eq!(
            strict("frontend f\n  bind :443 ssl crt \"${POD_NAME}.pem\"\n").len(),
            1
        );
    }

    #[test]
    fn crt_lists_in_the_set_are_checked_line_by_line() {
        let files = set("frontend f\n  bind :443 ssl crt-list maps/certs.list\n")
            .with(
                "maps/certs.list",
                "ssl/a.pem a.example\n# comment\n/etc/ssl/private/k.pem b.example\n\
                 ssl/c.pem [ca-file /etc/ca.pem verify required] c.example\n",
            )
            .expect("set");
        let found: Vec<String> = Policy::default()
            .violations(&files)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("maps/certs.list:3: crt-list certificate: "));
        assert!(found[1].starts_with("maps/certs.list:4: crt-list ca-file: "));
    }

    #[test]
    fn a_crt_list_ca_file_in_the_set_is_allowed() {
        // ingress-nginx's auth-tls-secret: the CA a client certificate is verified against is
        // a file of the set on the host's crt-list line; one outside the set is refused.
        let line = |ca: &str| {
            set("frontend f\n  bind :443 ssl crt-list maps/certs.list ca-ignore-err all crt-ignore-err all\n")
                .with(
                    "maps/certs.list",
                    format!("ssl/a_tls.pem [ca-file {ca} verify optional] a.example\n"),
                )
                .and_then(|s| s.with("ssl/a_tls.pem", "pem"))
                .and_then(|s| s.with("ssl/a_client-ca.pem", "ca"))
                .expect("set")
        };
        let found = |files: &FileSet| -> Vec<String> {
            Policy::default()
                .violations(files)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(found(&line("ssl/a_client-ca.pem")), Vec::<String>::new());
        let outside = found(&line("../ca.pem"));
        assert_eq!(outside.len(), 1, "{outside:?}");
        assert!(outside[0].starts_with("maps/certs.list:1: crt-list ca-file: "));
    }

    #[test]
    fn a_change_is_checked_by_what_it_changes_with_the_result_of_a_whole_check() {
        let policy = Policy::default();
        let base = set("global\n  crt-base certs\nfrontend f\n  bind :443 ssl crt-list l.list\n")
            .with("certs/l.list", "ssl/a.pem a.example\n")
            .and_then(|s| s.with("maps/m.map", "a b\n"))
            .expect("set");
        let (found, roles) = policy.violations_and_roles(&base);
        assert!(found.is_empty(), "{found:?}");
        // A crt-list line that leaves the set, a map (not read by the policy), a file added
        // at another place the crt-list could be found (the set's root).
        let mut changed = base.clone();
        changed
            .put("certs/l.list", "/etc/k.pem a.example\n")
            .expect("put");
        changed.put("maps/m.map", "/etc/passwd b\n").expect("put");
        changed.put("l.list", "../x.pem b.example\n").expect("put");
        let paths = ["certs/l.list", "maps/m.map", "l.list"];
        let (of_change, kept) = policy.violations_of_change(&changed, paths, &roles, None);
        assert_eq!(of_change, policy.violations(&changed));
        assert_eq!(of_change.len(), 2, "{of_change:?}");
        assert_eq!(kept, roles);
        // Only the map changed: nothing to read.
        let (none, _) = policy.violations_of_change(&changed, ["maps/m.map"], &roles, None);
        assert!(none.is_empty());
        // haproxy.cfg changed: the whole set is checked, and the roles follow it.
        let mut config = changed.clone();
        config
            .put(
                MAIN_CONFIG,
                "frontend f\n  bind :443 ssl crt-list other.list\n",
            )
            .expect("put");
        let (whole, roles) = policy.violations_of_change(&config, [MAIN_CONFIG], &roles, None);
        assert_eq!(whole, policy.violations(&config));
        assert_eq!(roles, policy.violations_and_roles(&config).1);
    }

    #[test]
    fn changed_configuration_lines_are_checked_in_their_section_as_a_whole_check_would() {
        use crate::protocol::line_hunks;
        let policy = Policy::default();
        let mut base = String::from("global\n  maxconn 100\ndefaults\n  mode http\n");
        for i in 0..50 {
            base.push_str(&format!("backend b{i}\n  server s1 10.0.0.{i}:80\n"));
        }
        base.push_str("program p\n  command /bin/true\n");
        let files = set(&base);
        let (none, roles) = policy.violations_and_roles(&files);
        assert!(none.is_empty() || none.len() == 1, "{none:?}");
        let cases = [
            // A server line that leaves the set, one that is fine, an env read.
            base.replace("s1 10.0.0.7:80", "s1 unix@/run/x.sock")
                .replace("s1 10.0.0.9:80", "s1 10.9.9.9:80")
                .replace("s1 10.0.0.20:80", "s1 \"${SECRET}\":80"),
            // `daemon` is refused in global only: moved into a backend, a whole check.
            base.replace("  maxconn 100\n", "  maxconn 100\n  daemon\n"),
            base.replace("backend b3\n", "global\n  daemon\nbackend b3\n"),
            // Lines added and removed, and a crt-list named.
            base.replace("  server s1 10.0.0.4:80\n", ""),
            base.replace(
                "backend b5\n",
                "backend b5\n  http-request return file /etc/x\n",
            ),
            base.replace(
                "backend b6\n",
                "frontend f\n  bind :443 ssl crt-list /etc/l\nbackend b6\n",
            ),
            // Inside the program section: not configuration.
            base.replace("command /bin/true", "command /bin/false"),
        ];
        for new in &cases {
            let changed = set(new);
            let hunks = line_hunks(&base, new);
            let (found, _) = policy.violations_of_change(
                &changed,
                [MAIN_CONFIG],
                &roles,
                Some((base.as_bytes(), &hunks)),
            );
            assert_eq!(
                found
                    .iter()
                    .filter(|v| !v.to_string().contains("program"))
                    .collect::<Vec<_>>(),
                policy
                    .violations(&changed)
                    .iter()
                    .filter(|v| !v.to_string().contains("program"))
                    .collect::<Vec<_>>(),
                "{new}"
            );
        }
        let first = set(&cases[0]);
        let hunks = line_hunks(&base, &cases[0]);
        let (found, _) = policy.violations_of_change(
            &first,
            [MAIN_CONFIG],
            &roles,
            Some((base.as_bytes(), &hunks)),
        );
        assert_eq!(found.len(), 2, "{found:?}");
    }

    #[test]
    fn a_crt_list_under_crt_base_or_origin_is_checked_too() {
        for (global, path) in [
            ("crt-base ssl", "ssl/certs.list"),
            ("default-path origin conf", "conf/certs.list"),
        ] {
            let files = set(&format!(
                "global\n  {global}\nfrontend f\n  bind :443 ssl crt-list certs.list\n"
            ))
            .with(path, "/var/lib/kubelet/pki/kubelet.pem node.example\n")
            .expect("set");
            let found = Policy::default().violations(&files);
            assert!(
                found.len() == 1 && found[0].file == path,
                "{global}: {found:?}"
            );
        }
    }

    #[test]
    fn an_spoe_configuration_in_the_set_is_checked_too() {
        let files = set("backend b\n  filter spoe engine e config spoe/e.conf\n")
            .with(
                "spoe/e.conf",
                "[e]\nspoe-agent a\n  log /dev/log local0\n  messages m\n  option var-prefix \"${SECRET}\"\n",
            )
            .expect("set");
        let found: Vec<String> = Policy::default()
            .violations(&files)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].starts_with("spoe/e.conf:3: log: "), "{found:?}");
        assert!(found[1].starts_with("spoe/e.conf:5: option: "), "{found:?}");
    }

    #[test]
    fn capabilities_parse_and_rules_are_named() {
        let parsed = Policy::parse_capabilities("lua, program,,External-Check").expect("parse");
        assert_eq!(
            parsed.into_iter().collect::<Vec<_>>(),
            [
                Capability::Lua,
                Capability::Program,
                Capability::ExternalCheck
            ]
        );
        assert!(matches!(
            Policy::parse_capabilities("lua,shell"),
            Err(PolicyError::UnknownCapability(name)) if name == "shell"
        ));
        assert!(Policy::default().validate().is_ok());
        assert!(
            Policy::default()
                .with_path_prefix("etc")
                .validate()
                .is_err()
        );
        assert!(
            Policy::default()
                .with_path_prefix("/a/../b")
                .validate()
                .is_err()
        );
        assert!(Policy::default().with_env("A-B").validate().is_err());
    }

    #[test]
    fn an_escaped_multibyte_character_in_a_quoted_map_argument_is_read_whole() {
        // This panicked (a byte index inside a multibyte character) and ended the render gate.
        assert_eq!(
            calls(r#"%[req.hdr(host),map_beg("/etc/\é\x",b)]"#),
            vec![("map_beg".to_owned(), "/etc/éx".to_owned())]
        );
        // Found by tests/fuzz.rs: a multibyte character right before the function name.
        assert_eq!(calls("é🦀("), vec![]);
        assert_eq!(
            calls("🦀map(/etc/x)"),
            vec![("map".to_owned(), "/etc/x".to_owned())]
        );
        // The quote reaches `calls` escaped on the line (`\"`) or inside other quotes.
        for line in [
            r#"frontend f
  use_backend %[req.hdr(host),map(\"/etc/\\é\")]
"#,
            r#"frontend f
  use_backend "%[req.hdr(host),map('/etc/\é')]"
"#,
        ] {
            let refused = strict(line);
            assert_eq!(refused.len(), 1, "{line}: {refused:?}");
            assert!(refused[0].contains("/etc/é"), "{line}: {refused:?}");
        }
    }

    #[test]
    fn the_refusal_text_lists_the_violations() {
        let error = Policy::default()
            .check(&set("global\n  lua-load a.lua\n  setenv A b\n"))
            .expect_err("refused");
        let text = error.to_string();
        assert!(
            text.starts_with("the set breaks the config policy (2 violations)"),
            "{text}"
        );
        assert!(text.contains("\n  haproxy.cfg:3: setenv: "), "{text}");
    }
}
