//! Provenance: which watched object produced which rendered file or line, so that a line
//! HAProxy refuses can be traced to one object and that object left out of the next render,
//! not the whole set held.
//!
//! Two sources:
//!
//! - a per-item output (`sslCertificates.<name>.forEach: <store>`) comes from its item: the
//!   file `ssl/<bucket>/<namespace>_<name>.pem` ([`crate::functions::ssl_file`]) is that object's, always;
//! - a template marks where an object's lines begin with the `from` filter, which renders
//!   nothing: `{{ ["ingresses", r.namespace, r.ingress] | from }}`. Everything written after a
//!   mark, up to the next mark, is that object's; `{{ [] | from }}` ends a run (the lines that
//!   follow have no provenance). A mark inside a captured block (`{% set x %}…{% endset %}`)
//!   points where the capture began.
//!
//! [`Renderer::render_traced`](crate::Renderer::render_traced) returns the [`Provenance`] of
//! a render; [`Provenance::object_at`] answers for a file and a 1-based line, and
//! [`Provenance::attribute`] for the output of a refused `haproxy -c`.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use tera::{Kwargs, State, Tera, Value};

use crate::fileset::FileSet;

/// A watched object: the store it is in, its namespace (empty when cluster-scoped) and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectRef {
    /// The store (`ingresses`, `secrets`, ...).
    pub store: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            write!(f, "{}/{}", self.store, self.name)
        } else {
            write!(f, "{}/{}/{}", self.store, self.namespace, self.name)
        }
    }
}

/// Where the content of one output came from.
#[derive(Debug, Clone)]
pub(crate) enum Origin {
    /// A per-item file: all of it is this object's (shared with the kept output: 2,500
    /// certificates' files were three strings each to copy on every render).
    Item(Arc<ObjectRef>),
    /// A single output: byte offsets where a run of one object's content (or of none)
    /// begins, with the mark's value as the template gave it (converted when asked: a render
    /// makes tens of thousands of marks and is asked about them only when HAProxy refuses it).
    Marks(Marks),
}

/// The marks of one output, in output order, as pieces: the marks its templates made, and
/// the marks of each `render_each` call it reused whole, shared with the kept call rather
/// than copied mark by mark (the pool's backends in `haproxy.cfg` are 10,000 marks at 10,000
/// Services, copied and dropped on every render before).
#[derive(Debug, Clone, Default)]
pub(crate) struct Marks {
    /// Never an empty piece.
    pieces: Vec<Piece>,
}

#[derive(Debug, Clone)]
enum Piece {
    /// Marks at their offsets.
    Own(Vec<(usize, Value)>),
    /// Marks at their offsets plus the first field (a `render_each` call's: the row each
    /// belongs to, its offset in the call's text, its value).
    Shared(usize, Arc<[(u32, usize, Value)]>),
}

impl Piece {
    /// Where its first mark is.
    fn first(&self) -> Option<usize> {
        match self {
            Piece::Own(marks) => marks.first().map(|(at, _)| *at),
            Piece::Shared(at, marks) => marks.first().map(|(_, offset, _)| at + offset),
        }
    }
}

impl Marks {
    /// Adds a mark at `at`.
    pub(crate) fn push(&mut self, at: usize, value: Value) {
        match self.pieces.last_mut() {
            Some(Piece::Own(marks)) => marks.push((at, value)),
            _ => self.pieces.push(Piece::Own(vec![(at, value)])),
        }
    }

    /// Adds marks made elsewhere, each at its offset plus `at`, shared.
    pub(crate) fn extend_shared(&mut self, at: usize, marks: Arc<[(u32, usize, Value)]>) {
        if !marks.is_empty() {
            self.pieces.push(Piece::Shared(at, marks));
        }
    }

    /// Whether there is no mark.
    pub(crate) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Every mark, at its offset, in order.
    pub(crate) fn into_flat(self) -> Vec<(usize, Value)> {
        let mut pieces = self.pieces.into_iter();
        let mut flat = match pieces.next() {
            Some(Piece::Own(marks)) => marks,
            Some(Piece::Shared(at, marks)) => shifted(at, &marks).collect(),
            None => return Vec::new(),
        };
        for piece in pieces {
            match piece {
                Piece::Own(marks) => flat.extend(marks),
                Piece::Shared(at, marks) => flat.extend(shifted(at, &marks)),
            }
        }
        flat
    }

    /// The value of the last mark before `end` (the marks are in output order).
    fn last_before(&self, end: usize) -> Option<&Value> {
        let piece = self
            .pieces
            .partition_point(|piece| piece.first().is_some_and(|first| first < end));
        match self.pieces.get(piece.checked_sub(1)?)? {
            Piece::Own(marks) => {
                let i = marks.partition_point(|(offset, _)| *offset < end);
                marks.get(i.checked_sub(1)?).map(|(_, value)| value)
            }
            Piece::Shared(at, marks) => {
                let i = marks.partition_point(|(_, offset, _)| at + offset < end);
                marks.get(i.checked_sub(1)?).map(|(_, _, value)| value)
            }
        }
    }
}

/// Shared marks at their offsets plus `at`.
fn shifted(at: usize, marks: &[(u32, usize, Value)]) -> impl Iterator<Item = (usize, Value)> + '_ {
    marks
        .iter()
        .map(move |(_, offset, value)| (at + offset, value.clone()))
}

/// Which object produced which file or line of a render.
#[derive(Debug, Clone, Default)]
pub struct Provenance {
    origins: BTreeMap<String, Origin>,
}

impl Provenance {
    /// The origins of files given in path order, each path once (a map built in one pass).
    pub(crate) fn from_sorted(origins: impl Iterator<Item = (String, Origin)>) -> Self {
        Self {
            origins: origins.collect(),
        }
    }

    /// The object a whole file came from (a per-item output).
    pub fn file_object(&self, path: &str) -> Option<&ObjectRef> {
        match self.origins.get(path)? {
            Origin::Item(object) => Some(object),
            Origin::Marks(_) => None,
        }
    }

    /// The object that produced line `line` (1-based) of `path` in `files`: the file's own
    /// object for a per-item output, else the last mark before the line's end.
    pub fn object_at(&self, files: &FileSet, path: &str, line: usize) -> Option<ObjectRef> {
        match self.origins.get(path)? {
            Origin::Item(object) => Some(ObjectRef::clone(object)),
            Origin::Marks(marks) => {
                let bytes = files.files().get(path)?;
                let end = line_end(bytes, line)?;
                // The mark that begins the run this line's text belongs to: the last one
                // before the line's last byte (a mark placed just before the newline that
                // starts the line counts).
                mark_object(marks.last_before(end)?)
            }
        }
    }

    /// The objects HAProxy's output (`haproxy -c`, refused) points at, best first, each with
    /// the line of the output that names it: a per-item file it names (`'ssl/ns_name.pem'`),
    /// then the file and line of a `[file:line]` or `line N in file 'file'` it gives.
    pub fn attribute<'a>(&'a self, files: &FileSet, output: &'a str) -> Vec<(ObjectRef, &'a str)> {
        let mut found: Vec<(ObjectRef, &str)> = Vec::new();
        let mut push = |object: &ObjectRef, line: &'a str| {
            if !found.iter().any(|(o, _)| o == object) {
                found.push((object.clone(), line));
            }
        };
        let alerts = || output.lines().filter(|l| l.contains("[ALERT]"));
        for line in alerts() {
            for path in quoted(line) {
                if let Some(object) = self.file_object(path) {
                    push(object, line);
                }
            }
        }
        for line in alerts() {
            for (path, number) in file_lines(line) {
                if let Some(object) = self.object_at(files, path, number) {
                    push(&object, line);
                }
            }
        }
        found
    }
}

/// The offset just past the text of line `line` (1-based), without its newline.
fn line_end(bytes: &[u8], line: usize) -> Option<usize> {
    let mut start = 0;
    for _ in 1..line {
        start += bytes.get(start..)?.iter().position(|b| *b == b'\n')? + 1;
    }
    let rest = bytes.get(start..)?;
    Some(start + rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len()))
}

/// The texts between single quotes in a line.
fn quoted(line: &str) -> impl Iterator<Item = &str> {
    line.split('\'').skip(1).step_by(2)
}

/// `(file, line)` pairs a line of HAProxy's output gives: `[file:N]` and `line N in file 'file'`.
fn file_lines(line: &str) -> Vec<(&str, usize)> {
    let mut pairs = Vec::new();
    let mut rest = line;
    while let Some(open) = rest.find('[') {
        rest = &rest[open + 1..];
        let Some(close) = rest.find(']') else { break };
        if let Some((file, number)) = rest[..close].rsplit_once(':')
            && let Ok(number) = number.parse()
        {
            pairs.push((file, number));
        }
        rest = &rest[close..];
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    for window in words.windows(5) {
        if let ["line", number, "in", "file", file] = window
            && let Ok(number) = number.parse()
        {
            pairs.push((
                file.trim_matches(|c| c == '\'' || c == ':' || c == ','),
                number,
            ));
        }
    }
    pairs
}

thread_local! {
    /// How many bytes the output rendering on this thread has written so far.
    static WRITTEN: Cell<usize> = const { Cell::new(0) };
    /// The marks the output rendering on this thread made so far.
    static MARKS: RefCell<Marks> = const { RefCell::new(Marks { pieces: Vec::new() }) };
}

/// A writer that tells the `from` filter where the output is.
pub(crate) struct Counting<'a>(pub(crate) &'a mut Vec<u8>);

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        WRITTEN.with(|w| w.set(self.0.len()));
        Ok(buf.len())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.write(buf).map(|_| ())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` (one output rendered on this thread into a [`Counting`] writer) and returns the
/// marks its templates made, as `(offset, [store, namespace, name] or [])`.
///
/// Nests: a render inside a render (a fragment of `render_each`) collects its own marks, and
/// the enclosing render's are as they were when it returns.
pub(crate) fn collect<T>(f: impl FnOnce() -> T) -> (T, Marks) {
    collect_from(0, f)
}

/// As [`collect`], for a render into a writer that holds `start` bytes already.
pub(crate) fn collect_from<T>(start: usize, f: impl FnOnce() -> T) -> (T, Marks) {
    let written = WRITTEN.with(|w| w.replace(start));
    let outer = MARKS.with(|m| std::mem::take(&mut *m.borrow_mut()));
    let out = f();
    let marks = MARKS.with(|m| std::mem::replace(&mut *m.borrow_mut(), outer));
    WRITTEN.with(|w| w.set(written));
    (out, marks)
}

/// Takes the marks made so far on this thread (a row of a run of rows is done).
pub(crate) fn take_marks() -> Vec<(usize, Value)> {
    MARKS
        .with(|m| std::mem::take(&mut *m.borrow_mut()))
        .into_flat()
}

/// How many bytes the output rendering on this thread has written so far.
pub(crate) fn written() -> usize {
    WRITTEN.with(Cell::get)
}

/// Adds marks made elsewhere (a reused call's, at their offsets from `at`), shared.
pub(crate) fn replay(at: usize, marks: Arc<[(u32, usize, Value)]>) {
    MARKS.with(|m| m.borrow_mut().extend_shared(at, marks));
}

/// The object a mark names: `[store, namespace, name]` (or `[store, name]`); none for `[]`.
pub(crate) fn mark_object(value: &Value) -> Option<ObjectRef> {
    let parts = value.as_array()?;
    let text = |i: usize| parts.get(i).and_then(Value::as_str).map(str::to_owned);
    match parts.len() {
        3 => Some(ObjectRef {
            store: text(0)?,
            namespace: text(1)?,
            name: text(2)?,
        }),
        2 => Some(ObjectRef {
            store: text(0)?,
            namespace: String::new(),
            name: text(1)?,
        }),
        _ => None,
    }
}

/// Registers the `from` filter.
pub(crate) fn register(tera: &mut Tera) {
    tera.register_filter(
        "from",
        |value: &Value, _: Kwargs, _: &State| -> tera::TeraResult<String> {
            let at = WRITTEN.with(Cell::get);
            MARKS.with(|m| m.borrow_mut().push(at, value.clone()));
            Ok(String::new())
        },
    );
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_messages_give_files_and_lines() {
        let alert = "[ALERT]    (1) : config : parsing [haproxy.cfg:45] : 'server' expects <addr>";
        assert_eq!(file_lines(alert), [("haproxy.cfg", 45)]);
        let crt = "[ALERT]    (1) : config : 'bind :443' : 'crt-list' : error processing line 3 in file 'maps/certs.list' : unable to load 'ssl/a_b.pem'";
        assert_eq!(file_lines(crt), [("maps/certs.list", 3)]);
        assert_eq!(
            quoted(crt).collect::<Vec<_>>(),
            ["bind :443", "crt-list", "maps/certs.list", "ssl/a_b.pem"]
        );
    }

    #[test]
    fn lines_belong_to_the_last_mark_before_them() {
        let a = ObjectRef {
            store: "ingresses".into(),
            namespace: "a".into(),
            name: "x".into(),
        };
        let b = ObjectRef {
            name: "y".into(),
            ..a.clone()
        };
        // "head\nA1\nB1\ntail": marks before the newline that starts A1 and B1, none for tail.
        let text = "head\nA1\nB1\ntail";
        let mark = |o: &ObjectRef| {
            Value::from(vec![
                Value::from(o.store.as_str()),
                Value::from(o.namespace.as_str()),
                Value::from(o.name.as_str()),
            ])
        };
        // B's mark comes from a reused call (shared, at 6 + 1), between marks of the output's own.
        let mut marks = Marks::default();
        marks.push(4, mark(&a));
        marks.extend_shared(6, Arc::from(vec![(0, 1, mark(&b))]));
        marks.push(10, Value::from(Vec::<Value>::new()));
        let flat: Vec<usize> = marks
            .clone()
            .into_flat()
            .iter()
            .map(|(at, _)| *at)
            .collect();
        assert_eq!(flat, [4, 7, 10]);
        let marks = Origin::Marks(marks);
        let p = Provenance::from_sorted(std::iter::once(("f".to_owned(), marks)));
        let mut files = BTreeMap::new();
        files.insert("f".to_owned(), text.as_bytes().to_vec());
        let files = FileSet::new(files);
        let at = |line| p.object_at(&files, "f", line);
        assert_eq!(at(1), None);
        assert_eq!(at(2), Some(a));
        assert_eq!(at(3), Some(b));
        assert_eq!(at(4), None);
        assert_eq!(at(5), None);
    }
}
