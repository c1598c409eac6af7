//! The compiled renderer: a template set compiled once, rendered against stores many times.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tera::{Context, ErrorKind, Tera, Value};
use tracing::instrument;

use crate::fileset::FileSet;
use crate::fragments::{self, Active, Fragments, ItemFile, Items, Singles};
use crate::functions::{self, DERIVED_VAR, GET_VAR, INDEX_VAR, REVIEW_VAR};
use crate::provenance::{self, Counting, ObjectRef, Provenance};
use crate::requests::{self, Requests};
use crate::set::{self, Output, TemplateSet};
use crate::store::{Overlay, Stores, Wants};
use crate::value::{Interner, map_value, to_tera};

/// What [`Renderer::with_split_rows`] is by default: below about a thousand rows a thread
/// costs more than it saves.
const DEFAULT_SPLIT_ROWS: usize = 1024;

/// Template sources larger than this are refused before they reach the engine.
pub const MAX_TEMPLATE_BYTES: usize = 4 << 20;

/// Brackets and parentheses nested deeper than this are refused before they reach the engine,
/// whose recursive-descent parser would otherwise be able to exhaust the stack.
pub const MAX_NESTING: usize = 64;

/// Why a template set did not compile or render.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The set breaks a structural rule (paths, names).
    #[error(transparent)]
    Set(#[from] set::Error),
    /// A template does not compile.
    #[error("template `{template}`{}: {cause}", at_line(*line))]
    Compile {
        /// The template, by its engine name (`haproxyConfig`, `maps.<name>`, a snippet name...).
        template: String,
        /// 1-based line of the error, when the engine knows it.
        line: Option<usize>,
        /// What is wrong.
        cause: String,
    },
    /// A template failed while rendering (including a template's own `fail(...)`).
    #[error("rendering {output}: template `{template}`{}: {cause}", at_line(*line))]
    Render {
        /// What was being rendered: the output path, or `<entry> for <namespace>/<name>`.
        output: String,
        /// The template the error is in (a snippet when it comes from an include).
        template: String,
        /// 1-based line of the error, when the engine knows it.
        line: Option<usize>,
        /// What went wrong.
        cause: String,
    },
    /// A per-item certificate entry names a store that the render was not given.
    #[error("sslCertificates.{entry}: forEach store `{store}` is not among the stores ({known})")]
    UnknownStore {
        /// The certificate entry.
        entry: String,
        /// The store it names.
        store: String,
        /// The stores the render was given.
        known: String,
    },
    /// Two per-item certificates (or one and a fixed output) render to the same path.
    #[error("two outputs render to the same path `{0}`")]
    DuplicatePath(String),
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" line {l}")).unwrap_or_default()
}

/// A `Result` with this module's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where an engine error points: template name, line, message (with its sources).
pub(crate) fn locate(
    error: &tera::Error,
    fallback_template: &str,
) -> (String, Option<usize>, String) {
    let mut cause = match error.kind() {
        ErrorKind::SyntaxError(report) | ErrorKind::RenderingError(report) => {
            let template = if report.filename().is_empty() {
                fallback_template.to_owned()
            } else {
                let name = report.filename();
                // A runner whose loop body is its snippet's source: the snippet's line.
                crate::fragments::snippet_of_runner(name)
                    .unwrap_or(name)
                    .to_owned()
            };
            let mut cause = report.message().to_owned();
            append_sources(error, &mut cause);
            return (template, Some(report.span().start_line), cause);
        }
        other => other.to_string(),
    };
    append_sources(error, &mut cause);
    (fallback_template.to_owned(), None, cause)
}

fn append_sources(error: &tera::Error, cause: &mut String) {
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        cause.push_str(": ");
        cause.push_str(&s.to_string());
        source = s.source();
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Refuses sources the engine should never see: too large, or nested deeply enough to risk the
/// parser's stack.
fn precheck(name: &str, source: &str) -> Result<()> {
    let refuse = |line: Option<usize>, cause: String| Error::Compile {
        template: name.to_owned(),
        line,
        cause,
    };
    if source.len() > MAX_TEMPLATE_BYTES {
        return Err(refuse(
            None,
            format!(
                "the source is {} bytes; the limit is {MAX_TEMPLATE_BYTES}",
                source.len()
            ),
        ));
    }
    let (mut depth, mut line) = (0usize, 1usize);
    for c in source.chars() {
        match c {
            '\n' => line += 1,
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(refuse(
                        Some(line),
                        format!("brackets nest deeper than {MAX_NESTING}"),
                    ));
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// A template set compiled once, rendered many times.
///
/// Rendering needs `&self` only: one renderer can serve concurrent renders.
#[derive(Debug)]
pub struct Renderer {
    tera: Arc<Tera>,
    outputs: Vec<Output>,
    extra: Arc<Vec<(String, Value)>>,
    /// The per-row fragments of `render_each`, kept from one render to the next.
    fragments: Arc<Fragments>,
    /// What each output (by index in `outputs`) can read of the context (a per-item output:
    /// beyond its item; `None`: not known), and what it gave (each item) last time.
    item_reads: Vec<Option<Vec<(&'static str, String)>>>,
    items: Items,
    /// What each single output rendered by this render shares with its last render (its
    /// path, its bytes, the bytes before, the counts), for the checksum.
    known: Mutex<Vec<(String, Bytes, Bytes, haptic_checksum::Same)>>,
    singles: Singles,
    /// The templates that have a runner for `render_each`.
    runners: Arc<std::collections::HashSet<String>>,
    /// Whether renders reuse fragments and per-item outputs ([`Renderer::with_reuse`]).
    reuse: bool,
    threads: usize,
    /// Rows a `render_each` run needs per thread before it is split ([`Renderer::with_split_rows`]).
    split_rows: usize,
    /// How long each single output (by index in `outputs`) took in the last render, in
    /// nanoseconds: the next render starts the longest first (0: not rendered yet).
    costs: Vec<AtomicU64>,
    /// How many bytes each output (by index) wrote in the last render (per-item outputs: the
    /// last non-blank item): the next render's buffer starts that large.
    sizes: Vec<AtomicUsize>,
    /// Where the last render's time went.
    timings: Mutex<Timings>,
    /// The buffers of single outputs' files that sets let go, for their next render.
    recycler: Arc<crate::recycle::Recycler>,
    /// Which parts of the store views the templates read.
    store_reads: StoreReads,
}

/// Which parts of the stores' views a template set reads, beyond `get` (every store's
/// resources by name): the lists when a template names `resources` at all, the indexes when
/// one calls `lookup` (as a function or a filter: [`calls`]), and the list of each store a
/// per-item output walks. Comments are left out; a string that reads like one counts too
/// (the views built are then more than needed, never fewer).
#[derive(Debug)]
struct StoreReads {
    lists: bool,
    indexes: bool,
    items: Vec<String>,
}

/// A template's source without its comments (`{# ... #}`; an unclosed one runs to the end).
fn without_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{#") {
        out.push_str(rest.get(..start).unwrap_or_default());
        rest = match rest
            .get(start + 2..)
            .and_then(|r| r.find("#}").map(|end| (r, end)))
        {
            Some((r, end)) => r.get(end + 2..).unwrap_or_default(),
            None => "",
        };
    }
    out.push_str(rest);
    out
}

/// Whether template source `source` may call `name`: as a function (`name(`, not preceded by
/// a character of a longer name, a `-` or a `.`) or as a filter (`| name`). The snippet
/// `gateway-lookup`, or the word in a sentence, is not a call.
fn calls(source: &str, name: &str) -> bool {
    source.match_indices(name).any(|(at, _)| {
        let before = source.get(..at).unwrap_or_default();
        let after = source.get(at + name.len()..).unwrap_or_default();
        let part_of_name = |c: char| c.is_alphanumeric() || c == '_' || c == '-' || c == '.';
        if before.chars().next_back().is_some_and(part_of_name)
            || after
                .chars()
                .next()
                .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            return false;
        }
        after.trim_start().starts_with('(') || before.trim_end().ends_with('|')
    })
}

/// Where one render's time went, phase by phase (what [`Renderer::last_timings`] returns).
#[derive(Debug, Clone, Default)]
pub struct Timings {
    /// Rebuilding the store views and derived views a change made stale.
    pub refresh: std::time::Duration,
    /// Assembling the template context.
    pub context: std::time::Duration,
    /// Each output's template run, by output path (per-item outputs: their entry, all items
    /// together, summed over threads), in output order.
    pub outputs: Vec<(String, std::time::Duration)>,
    /// Running the jobs, wall clock (outputs in parallel).
    pub templates: std::time::Duration,
    /// Putting the files in order, with their requests and provenance.
    pub assemble: std::time::Duration,
    /// The sha256 checksum of the set.
    pub checksum: std::time::Duration,
    /// Bytes the checksum did not compare with the previous set's: the render knew them the
    /// same (a call's text that starts or ends with the rows of the last one, where it was).
    pub checksum_known: u64,
    /// Fragments of `render_each` rendered by the engine.
    pub fragments_rendered: u64,
    /// Fragments of `render_each` reused from an earlier render.
    pub fragments_reused: u64,
    /// Calls of `render_each` made.
    pub calls: u64,
    /// Calls of `render_each` reused whole: given the very rows list of a call of an earlier
    /// render (a derived view no event changed), they gave its very output.
    pub calls_reused: u64,
    /// Single outputs (not per item) reused whole: none of the views and stores they read
    /// changed since they were rendered.
    pub outputs_reused: u64,
    /// Items of per-item outputs (`forEach`) rendered by the engine.
    pub items_rendered: u64,
    /// Items of per-item outputs reused from an earlier render.
    pub items_reused: u64,
    /// Runs of items (a job's, up to 128) of per-item outputs reused whole: the very items,
    /// and none of the stores and views they read changed (their items count as reused too).
    pub item_chunks_reused: u64,
}

impl Renderer {
    /// Checks and compiles a template set.
    ///
    /// Errors name the template, the line and the cause. Unknown filters, functions and
    /// included snippets are compile errors, not render errors.
    #[instrument(skip_all, fields(templates = set.sources().len()))]
    pub fn compile(set: &TemplateSet) -> Result<Self> {
        let outputs = set.outputs()?;
        let sources = set.sources();
        for (name, source) in &sources {
            precheck(name, source)?;
        }
        let mut tera = Tera::new();
        // HAProxy files are not HTML: nothing is escaped.
        tera.autoescape_on(Vec::<&'static str>::new());
        functions::register(&mut tera);
        requests::register(&mut tera);
        provenance::register(&mut tera);
        crate::slots::register(&mut tera);
        crate::pool::register(&mut tera);
        crate::nginx_rules::register(&mut tera);
        crate::gateway_action::register(&mut tera);
        fragments::register(&mut tera);
        // Each template gets a runner: it renders the template once per row of a list, for
        // `render_each` (one run of the engine for all the rows it cannot reuse).
        let runners: Vec<(String, String, String)> = sources
            .iter()
            .filter_map(|(name, source)| {
                Some((
                    name.clone(),
                    fragments::runner_name(name),
                    fragments::runner_source(name, source)?,
                ))
            })
            .collect();
        let added = catch_unwind(AssertUnwindSafe(|| {
            tera.add_raw_templates(
                sources
                    .iter()
                    .map(|(n, s)| (n.as_str(), *s))
                    .chain(runners.iter().map(|(_, n, s)| (n.as_str(), s.as_str()))),
            )
        }));
        match added {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let (template, line, cause) = locate(&e, "template set");
                return Err(Error::Compile {
                    template,
                    line,
                    cause,
                });
            }
            Err(panic) => {
                return Err(Error::Compile {
                    template: "template set".to_owned(),
                    line: None,
                    cause: format!("the template engine panicked: {}", panic_message(&*panic)),
                });
            }
        }
        let extra = set
            .extra_context
            .iter()
            .map(|(k, v)| (k.clone(), to_tera(v, &mut Interner::default(), &[])))
            .collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
        let costs = outputs.iter().map(|_| AtomicU64::new(0)).collect();
        let item_reads = outputs
            .iter()
            .map(|output| {
                fragments::template_reads(&output.template, &sources)
                    .map(|reads| reads.into_iter().collect())
            })
            .collect();
        let sizes = outputs.iter().map(|_| AtomicUsize::new(0)).collect();
        let code: Vec<String> = sources.iter().map(|(_, s)| without_comments(s)).collect();
        let store_reads = StoreReads {
            lists: code.iter().any(|s| s.contains("resources")),
            indexes: code
                .iter()
                .any(|s| calls(s, "lookup") || s.contains(INDEX_VAR)),
            items: outputs.iter().filter_map(|o| o.for_each.clone()).collect(),
        };
        Ok(Self {
            tera: Arc::new(tera),
            outputs,
            extra: Arc::new(extra),
            fragments: Arc::default(),
            item_reads,
            singles: Singles::default(),
            runners: Arc::new(runners.into_iter().map(|(name, _, _)| name).collect()),
            items: Items::default(),
            known: Mutex::default(),
            reuse: true,
            threads,
            split_rows: DEFAULT_SPLIT_ROWS,
            costs,
            sizes,
            timings: Mutex::new(Timings::default()),
            recycler: Arc::default(),
            store_reads,
        })
    }

    /// The parts of `store`'s view this template set reads ([`StoreReads`]).
    fn wants(&self, store: &str) -> Wants {
        let reads = &self.store_reads;
        Wants {
            list: reads.lists || reads.items.iter().any(|s| s == store),
            index: reads.indexes,
        }
    }

    /// Makes compact ([`Store::set_compact`](crate::Store::set_compact)) each store of
    /// `stores` whose resources this template set never lists, looks up by index or renders
    /// a file for (`resources.<store>`, `lookup()`, `forEach`), and no derived view keeps
    /// whole ([`Derivation::keeps_whole`](crate::Derivation::keeps_whole)); the others are
    /// kept as template values. What is read of a compact store (a derived view's extract,
    /// once per version of a resource; `get()`, one resource) is made into a template value
    /// when read: the bytes rendered are the same. Returns the stores made compact.
    pub fn compact_unread_stores(&self, stores: &mut Stores) -> Vec<String> {
        let kept: BTreeSet<String> = stores.kept_whole().into_iter().map(str::to_owned).collect();
        let names: Vec<String> = stores.iter().map(|(name, _)| name.to_owned()).collect();
        let mut compact = Vec::new();
        for name in names {
            let wants = self.wants(&name);
            let on = !wants.list && !wants.index && !kept.contains(&name);
            if let Some(store) = stores.get_mut(&name) {
                store.set_compact(on);
                if on {
                    compact.push(name);
                }
            }
        }
        compact
    }

    /// Whether renders reuse what earlier renders gave for the same inputs (default: yes):
    /// `render_each` rows and per-item outputs. Off, every render renders everything (the
    /// same bytes, slower): for comparisons and to rule reuse out when looking for a bug.
    #[must_use]
    pub fn with_reuse(mut self, reuse: bool) -> Self {
        self.reuse = reuse;
        self
    }

    /// Renders on at most `threads` threads (at least one; 1 renders on the calling thread).
    ///
    /// Default: the machine's available parallelism, at most 8. Outputs (and chunks of
    /// per-item certificates) are independent, so they render in parallel; the result is the
    /// same bytes whatever the number of threads.
    #[must_use]
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Splits a `render_each` run of rows over the render's threads when each thread gets at
    /// least `rows` rows (default 1,024; at least 1): the parts render at once, each in a run
    /// of its own, and are laid end to end, so the bytes, Events, status and provenance are
    /// those of one run. The big views of a full render (backends, routes, TLS rows) are then
    /// not bound to one core. Tests set it low to split small sets.
    #[must_use]
    pub fn with_split_rows(mut self, rows: usize) -> Self {
        self.split_rows = rows.max(1);
        self
    }

    /// The context every template of a render sees (`overlay` laid over its store, and named
    /// as the resource under review, which `refuse()` may refuse).
    fn context(&self, stores: &Stores, overlay: Option<&Overlay>) -> Context {
        let mut context = Context::new();
        for (key, value) in self.extra.iter() {
            context.insert_value(key.clone(), value.clone());
        }
        let views = stores.views(overlay, &|store| self.wants(store));
        let derived = stores.derived_values_over(overlay);
        if let Some(over) = overlay {
            let (namespace, name) = over.key();
            context.insert_value(
                REVIEW_VAR,
                map_value([
                    ("store", Value::from(over.store())),
                    ("namespace", Value::from(namespace)),
                    ("name", Value::from(name)),
                ]),
            );
        }
        context.insert_value(
            "resources",
            map_value(
                views
                    .iter()
                    .filter_map(|(n, v)| Some((*n, v.list.clone()?))),
            ),
        );
        context.insert_value(
            GET_VAR,
            map_value(views.iter().map(|(n, v)| (*n, v.by_name.clone()))),
        );
        context.insert_value(
            INDEX_VAR,
            map_value(
                views
                    .iter()
                    .filter_map(|(n, v)| Some((*n, v.by_index.clone()?))),
            ),
        );
        context.insert_value(DERIVED_VAR, map_value(derived));
        context
    }

    /// Renders `template` into a buffer of `capacity` bytes to start with (what the same output
    /// took last time: no regrowth, no copies of a multi-megabyte output). `output` names what
    /// was being rendered, for an error.
    #[allow(clippy::too_many_arguments)]
    fn render_one(
        &self,
        active: &Active,
        template: &str,
        context: &Context,
        output: impl FnOnce() -> String,
        mut bytes: Vec<u8>,
        asked_for: &mut Requests,
        marks: &mut provenance::Marks,
        spans: Option<&mut Vec<fragments::Span>>,
    ) -> Result<Vec<u8>> {
        let ((rendered, asked), marked) = provenance::collect(|| {
            requests::collect(|| {
                catch_unwind(AssertUnwindSafe(|| {
                    fragments::with_active(active.clone(), || match spans {
                        Some(spans) => self.tera.render_to(
                            template,
                            context,
                            fragments::Spanning {
                                bytes: &mut bytes,
                                spans,
                            },
                        ),
                        None => self.tera.render_to(template, context, Counting(&mut bytes)),
                    })
                }))
            })
        });
        asked_for.extend(asked);
        *marks = marked;
        let error = |template: String, line, cause| Error::Render {
            output: output(),
            template,
            line,
            cause,
        };
        match rendered {
            Ok(Ok(())) => Ok(bytes),
            Ok(Err(e)) => {
                let (template, line, cause) = locate(&e, template);
                Err(error(template, line, cause))
            }
            Err(panic) => Err(error(
                template.to_owned(),
                None,
                format!("the template engine panicked: {}", panic_message(&*panic)),
            )),
        }
    }

    /// Renders every output against `stores`.
    ///
    /// The result depends only on the template set and the stores' contents: never on the
    /// order in which resources were applied, nor on how the work was spread over threads.
    /// When several outputs fail, the error is the first one in output order.
    #[instrument(skip_all, fields(threads = self.threads))]
    pub fn render(&self, stores: &Stores) -> Result<FileSet> {
        self.render_all(stores).map(|(files, _)| files)
    }

    /// Renders every output, as [`Renderer::render`], and returns with the files what the
    /// templates asked the cluster to show ([`Requests`]: Events and status), in output order.
    pub fn render_all(&self, stores: &Stores) -> Result<(FileSet, Requests)> {
        self.render_with(stores, None, None)
            .map(|(files, requests, _)| (files, requests))
    }

    /// Renders every output, as [`Renderer::render_all`], and returns with the files and the
    /// requests the [`Provenance`] of the files and lines: which object produced them, so
    /// that a line HAProxy refuses can be traced to one object.
    pub fn render_traced(&self, stores: &Stores) -> Result<(FileSet, Requests, Provenance)> {
        self.render_with(stores, None, None)
    }

    /// Renders as [`Renderer::render_traced`] does, hashing the set only from about where it
    /// first differs from `previous` (the set this renderer rendered last, say): the same
    /// checksum ([`FileSet::following`]), most of 12 MB not hashed again at 10,000 Ingresses.
    pub fn render_traced_following(
        &self,
        stores: &Stores,
        previous: &FileSet,
    ) -> Result<(FileSet, Requests, Provenance)> {
        self.render_with(stores, None, Some(previous))
    }

    /// Renders every output against `stores` with `overlay`'s change laid over its store, as
    /// if that store held (or no longer held) the resource, without copying or changing the
    /// stores: what the admission webhook renders. The resource is the one under review:
    /// a template's `refuse(...)` naming it fails this render with its message. (What the
    /// templates ask the cluster to show is dropped: the change is not made.)
    #[instrument(skip_all, fields(threads = self.threads, store = overlay.store()))]
    pub fn render_overlay(&self, stores: &Stores, overlay: &Overlay) -> Result<FileSet> {
        self.render_with(stores, Some(overlay), None)
            .map(|(files, _, _)| files)
    }

    /// Renders with a change laid over the stores, as [`Renderer::render_overlay`], and returns
    /// with the files what the templates asked the cluster to show ([`Requests`]).
    pub fn render_overlay_all(
        &self,
        stores: &Stores,
        overlay: &Overlay,
    ) -> Result<(FileSet, Requests)> {
        self.render_with(stores, Some(overlay), None)
            .map(|(files, requests, _)| (files, requests))
    }

    fn render_with(
        &self,
        stores: &Stores,
        overlay: Option<&Overlay>,
        previous: Option<&FileSet>,
    ) -> Result<(FileSet, Requests, Provenance)> {
        let mut timings = Timings::default();
        let started = Instant::now();
        // After a watch event, the changed stores' views and the derived views that read them
        // are rebuilt here, before any template runs, on the render's threads.
        stores.refresh(self.threads, &|store| self.wants(store));
        timings.refresh = started.elapsed();
        let started = Instant::now();
        let context = self.context(stores, overlay);
        timings.context = started.elapsed();
        let mut views = Vec::new();
        for (index, output) in self.outputs.iter().enumerate() {
            if let Some(store_name) = &output.for_each {
                let Some(source) = stores.source(store_name, overlay) else {
                    return Err(Error::UnknownStore {
                        entry: output.path.clone(),
                        store: store_name.clone(),
                        known: stores.iter().map(|(n, _)| n).collect::<Vec<_>>().join(", "),
                    });
                };
                views.push((index, output, source.view(self.wants(store_name))));
            }
        }
        // Single outputs start longest first, by what each took in the previous render (the
        // main config first on the first render: it is usually the largest job), so that one
        // long output started last does not keep every other thread waiting for it; per-item
        // chunks, small and many, fill in at the end.
        let mut singles: Vec<(usize, &Output)> = self
            .outputs
            .iter()
            .enumerate()
            .filter(|(_, o)| o.for_each.is_none())
            .collect();
        singles.sort_by_key(|(index, _)| {
            std::cmp::Reverse(
                self.costs
                    .get(*index)
                    .map_or(0, |c| c.load(Ordering::Relaxed)),
            )
        });
        // What each output can read (a per-item output: beyond its item), as it is in this
        // render.
        let item_inputs: Vec<Option<Vec<Value>>> = self
            .item_reads
            .iter()
            .map(|reads| {
                let reads = reads.as_ref()?;
                Some(
                    reads
                        .iter()
                        .map(|(kind, name)| {
                            context
                                .get(kind)
                                .and_then(Value::as_map)
                                .and_then(|m| m.get(&tera::value::Key::Str(name)))
                                .cloned()
                                .unwrap_or_else(Value::none)
                        })
                        .collect(),
                )
            })
            .collect();
        let inputs_of = |index: usize| {
            item_inputs
                .get(index)
                .and_then(Option::as_deref)
                .filter(|_| self.reuse)
        };
        let mut jobs: Vec<Job<'_>> = singles
            .into_iter()
            .map(|(index, output)| Job::Single {
                index,
                output,
                inputs: inputs_of(index),
            })
            .collect();
        for (index, output, view) in &views {
            let items = view
                .list
                .as_ref()
                .and_then(Value::as_array)
                .unwrap_or_default();
            jobs.extend(
                items
                    .chunks(ITEMS_PER_JOB)
                    .enumerate()
                    .map(|(chunk, items)| Job::Items {
                        index: *index,
                        inputs: inputs_of(*index),
                        chunk,
                        output,
                        items,
                    }),
            );
        }
        // What a render that failed left.
        if let Ok(mut known) = self.known.lock() {
            known.clear();
        }
        let started = Instant::now();
        let active = Active {
            tera: Arc::clone(&self.tera),
            fragments: Arc::clone(&self.fragments),
            extra: Arc::clone(&self.extra),
            epoch: self.fragments.begin(),
            // An overlay render reuses fragments but keeps none of its own.
            keep: overlay.is_none() && self.reuse,
            reuse: self.reuse,
            runners: Arc::clone(&self.runners),
            threads: self.threads,
            split_rows: self.split_rows,
        };
        let results = self.run_jobs(&jobs, &context, &active);
        if overlay.is_none() {
            self.fragments.end(active.epoch);
            self.items.end(active.epoch);
        }
        (
            timings.fragments_rendered,
            timings.fragments_reused,
            timings.calls,
            timings.calls_reused,
        ) = self.fragments.take_counts();
        (
            timings.items_rendered,
            timings.items_reused,
            timings.item_chunks_reused,
        ) = self.items.take_counts();
        timings.outputs_reused = self.singles.take_count();
        timings.templates = started.elapsed();
        let started = Instant::now();
        // Back in output order, so that the error reported is the same whatever the job order.
        let mut results: Vec<((usize, usize), Result<Rendered>)> =
            jobs.iter().map(Job::place).zip(results).collect();
        results.sort_by_key(|(place, _)| *place);
        let mut spent: Vec<std::time::Duration> = vec![Default::default(); self.outputs.len()];
        for ((index, _), result) in &results {
            if let (Ok((_, _, took)), Some(spent)) = (result, spent.get_mut(*index)) {
                *spent += *took;
            }
        }
        timings.outputs = self
            .outputs
            .iter()
            .zip(spent)
            .map(|(o, t)| (o.path.clone(), t))
            .collect();
        let mut asked = Requests::default();
        // Sized once: grown by doubling, the list of 12,500 files at 10,000 Ingresses was
        // copied four times a render, each copy a fresh 128 KiB-1 MiB block.
        let mut entries = Vec::with_capacity(
            results
                .iter()
                .map(|(_, result)| result.as_ref().map_or(0, |(files, _, _)| files.len()))
                .sum(),
        );
        for (_, result) in results {
            let (rendered, asked_here, _) = result?;
            asked.extend(asked_here);
            entries.extend(rendered);
        }
        // The files in path order (mostly sorted runs already: a stable sort merges them), so
        // that the maps are built in one pass: inserted one by one, the 2,500 certificates'
        // paths (long common prefixes) cost a tenth of a render after one event at 10,000.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(pair) = entries.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(Error::DuplicatePath(pair[0].0.clone()));
        }
        let mut traced = Vec::with_capacity(entries.len());
        let files: BTreeMap<String, Bytes> = entries
            .into_iter()
            .map(|(path, bytes, origin)| {
                traced.push((path.clone(), origin));
                (path, bytes)
            })
            .collect();
        let origins =
            Provenance::from_sorted(
                traced
                    .into_iter()
                    .filter_map(|(path, origin)| match origin {
                        Origin::Marks(marks) if marks.is_empty() => None,
                        Origin::Marks(marks) => Some((path, provenance::Origin::Marks(marks))),
                        Origin::Item(object) => Some((path, provenance::Origin::Item(object))),
                    }),
            );
        timings.assemble = started.elapsed();
        let started = Instant::now();
        let known = self
            .known
            .lock()
            .map(|mut known| std::mem::take(&mut *known))
            .unwrap_or_default();
        let told_bytes = std::sync::atomic::AtomicU64::new(0);
        // A file's bytes and the previous set's at its path, as the render compared them.
        let told = |path: &str, bytes: &[u8], old: &[u8]| {
            known
                .iter()
                .find(|(p, new, was, _)| {
                    p == path
                        && std::ptr::eq(new.as_ref(), bytes)
                        && std::ptr::eq(was.as_ref(), old)
                })
                .map(|(_, _, _, same)| {
                    told_bytes.fetch_add((same.prefix + same.suffix) as u64, Ordering::Relaxed);
                    *same
                })
                .unwrap_or_default()
        };
        let files = match previous {
            Some(previous) => FileSet::following_known(files, previous, &told),
            None => FileSet::of_shared(files),
        };
        timings.checksum = started.elapsed();
        timings.checksum_known = told_bytes.into_inner();
        // What the render replaced goes now, on the renderer's dropper thread.
        self.fragments.graveyard.flush();
        if let Ok(mut last) = self.timings.lock() {
            *last = timings;
        }
        Ok((files, asked, origins))
    }

    /// Where the last render's time went, phase by phase.
    pub fn last_timings(&self) -> Timings {
        self.timings.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Runs the jobs on up to `self.threads` threads; results come back in job order.
    fn run_jobs(
        &self,
        jobs: &[Job<'_>],
        context: &Context,
        active: &Active,
    ) -> Vec<Result<Rendered>> {
        let threads = self.threads.clamp(1, jobs.len().max(1));
        if threads == 1 {
            return jobs
                .iter()
                .map(|job| self.run_job(job, context, active))
                .collect();
        }
        let next = AtomicUsize::new(0);
        let slots: Vec<Mutex<Option<Result<Rendered>>>> =
            jobs.iter().map(|_| Mutex::new(None)).collect();
        let work = || {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(index) else { break };
                let result = self.run_job(job, context, active);
                if let Ok(mut slot) = slots[index].lock() {
                    *slot = Some(result);
                }
            }
        };
        // The calling thread works too (as the views' refresh does): the longest job, taken
        // first, runs where the last render's buffers are.
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(work);
            }
            work();
        });
        slots
            .into_iter()
            .map(|slot| {
                slot.into_inner().ok().flatten().unwrap_or_else(|| {
                    Err(Error::Render {
                        output: "render worker".to_owned(),
                        template: String::new(),
                        line: None,
                        cause: "a render worker stopped without a result".to_owned(),
                    })
                })
            })
            .collect()
    }

    fn run_job(&self, job: &Job<'_>, context: &Context, active: &Active) -> Result<Rendered> {
        let started = Instant::now();
        let (files, asked) = self.run_job_untimed(job, context, active)?;
        Ok((files, asked, started.elapsed()))
    }

    fn run_job_untimed(
        &self,
        job: &Job<'_>,
        context: &Context,
        active: &Active,
    ) -> Result<Produced> {
        match job {
            Job::Single {
                index,
                output,
                inputs,
            } => {
                let started = Instant::now();
                // What reads are checked against: the stores and the derived views.
                let stores = || {
                    [
                        (GET_VAR, context.get(GET_VAR).cloned()),
                        (INDEX_VAR, context.get(INDEX_VAR).cloned()),
                        (DERIVED_VAR, context.get(DERIVED_VAR).cloned()),
                    ]
                };
                let review = context.get(REVIEW_VAR).is_some();
                // The same views and stores read: what it gave last time (an event that
                // changed none of them, or only the views another output reads).
                if let Some(kept) = inputs.and_then(|inputs| {
                    self.singles
                        .reuse(*index, inputs, &stores(), review, active.epoch)
                }) {
                    // A status template writes no file: what it asked for is what it gives.
                    let files = output
                        .writes
                        .then(|| {
                            (
                                output.path.clone(),
                                kept.bytes.clone(),
                                Origin::Marks(kept.marks.clone()),
                            )
                        })
                        .into_iter()
                        .collect();
                    return Ok((files, kept.requests.clone()));
                }
                let size = self.sizes.get(*index);
                let capacity = size.map_or(0, |s| s.load(Ordering::Relaxed));
                let mut asked = Requests::default();
                let mut marks = provenance::Marks::default();
                let keep = inputs.filter(|_| active.keep);
                let mut spans = Vec::new();
                // Written in the buffer this output's file had in a set now gone, if any.
                let buffer = self.recycler.take(*index, capacity);
                let (bytes, tracked) = fragments::tracking_calls(|| {
                    self.render_one(
                        active,
                        &output.template,
                        context,
                        || output.path.clone(),
                        buffer,
                        &mut asked,
                        &mut marks,
                        Some(&mut spans),
                    )
                });
                let bytes = self.recycler.wrap(*index, bytes?);
                let replaced = match keep {
                    Some(inputs) => self.singles.keep(
                        *index,
                        inputs.to_vec(),
                        (bytes.clone(), marks.clone(), asked.clone()),
                        tracked,
                        spans.clone(),
                    ),
                    // Kept outputs are of the stores as they are: an overlay render's are not.
                    None if active.keep => self.singles.forget(*index),
                    None => None,
                };
                if let Some(replaced) = replaced {
                    // What the file shares with its last render, as its calls' texts say:
                    // the checksum does not compare those bytes again.
                    let same =
                        fragments::known_same(&bytes, &spans, &replaced.bytes, &replaced.spans);
                    if same != haptic_checksum::Same::default()
                        && let Ok(mut known) = self.known.lock()
                    {
                        known.push((
                            output.path.clone(),
                            bytes.clone(),
                            replaced.bytes.clone(),
                            same,
                        ));
                    }
                    // Its bytes are let go here, the rest (marks, calls) on the dropper thread:
                    // a recycled buffer then comes back as soon as the sets holding it are
                    // dropped, not when that thread gets to it.
                    match Arc::try_unwrap(replaced) {
                        Ok(mut output) => {
                            drop(std::mem::take(&mut output.bytes));
                            self.fragments.graveyard.bury(output);
                        }
                        Err(shared) => self.fragments.graveyard.bury(shared),
                    }
                }
                if let Some(cost) = self.costs.get(*index) {
                    let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    cost.store(nanos.max(1), Ordering::Relaxed);
                }
                if let Some(size) = size {
                    size.store(bytes.len(), Ordering::Relaxed);
                }
                let files = output
                    .writes
                    .then(|| (output.path.clone(), bytes, Origin::Marks(marks)))
                    .into_iter()
                    .collect();
                Ok((files, asked))
            }
            Job::Items {
                index,
                inputs,
                output,
                items,
                chunk,
            } => {
                let mut files = Vec::new();
                let mut asked = Requests::default();
                let mut marks = provenance::Marks::default();
                let store = output.for_each.as_deref().unwrap_or_default();
                let size = self.sizes.get(*index);
                let review = context.get(REVIEW_VAR).is_some();
                // What reads are checked against: the stores, and the derived views (an item
                // reads one entry of a view with `derived_get`).
                let stores = [
                    (GET_VAR, context.get(GET_VAR).cloned()),
                    (INDEX_VAR, context.get(INDEX_VAR).cloned()),
                    (DERIVED_VAR, context.get(DERIVED_VAR).cloned()),
                ];
                // The very items, reading stores and views none of which changed: the whole
                // chunk as it was.
                if let Some(whole) = inputs.and_then(|inputs| {
                    self.items.reuse_chunk(
                        *index,
                        *chunk,
                        items,
                        inputs,
                        &stores,
                        review,
                        active.epoch,
                    )
                }) {
                    for kept in &whole.outputs {
                        asked.extend(kept.requests.clone());
                        if let Some(file) = &kept.file {
                            files.push((
                                file.path.clone(),
                                kept.bytes.clone(),
                                Origin::Item(Arc::clone(&file.object)),
                            ));
                        }
                    }
                    return Ok((files, asked));
                }
                // One context per run of items; `item` is replaced for each.
                let mut item_context = context.clone();
                // Each item's output as kept (none once an item's is not: the chunk is not
                // kept whole).
                let mut outputs = Some(Vec::with_capacity(items.len()))
                    .filter(|_| active.keep && inputs.is_some());
                for item in *items {
                    // The same item, reading the same views and stores: what it gave last time.
                    let kept = inputs.and_then(|inputs| {
                        self.items
                            .reuse(*index, item, inputs, &stores, review, active.epoch)
                    });
                    self.items.count(kept.is_some());
                    let (bytes, file) = match kept {
                        Some(kept) => {
                            asked.extend(kept.requests.clone());
                            let reused = (kept.bytes.clone(), kept.file.clone());
                            if let Some(outputs) = &mut outputs {
                                outputs.push(kept);
                            }
                            reused
                        }
                        None => {
                            let text_of = |path: &str| {
                                item.get_from_path(path)
                                    .and_then(Value::as_str)
                                    .unwrap_or_default()
                                    .to_owned()
                            };
                            let (namespace, name) =
                                (text_of("metadata.namespace"), text_of("metadata.name"));
                            item_context.insert_value("item", item.clone());
                            let label = || format!("{} for {namespace}/{name}", output.template);
                            let capacity = size.map_or(0, |s| s.load(Ordering::Relaxed));
                            let mut asked_here = Requests::default();
                            let (bytes, tracked) = fragments::tracking(|| {
                                self.render_one(
                                    active,
                                    &output.template,
                                    &item_context,
                                    label,
                                    Vec::with_capacity(capacity),
                                    &mut asked_here,
                                    &mut marks,
                                    None,
                                )
                            });
                            // Shared with what is kept: the set made of it holds the very
                            // bytes a later render reuses, and tells them by address.
                            let bytes = Bytes::from(bytes?);
                            // A blank output writes no file.
                            let blank = std::str::from_utf8(&bytes)
                                .is_ok_and(|text| text.trim().is_empty());
                            let file = (!blank).then(|| ItemFile {
                                path: functions::ssl_file(&namespace, &name),
                                object: Arc::new(ObjectRef {
                                    store: store.to_owned(),
                                    namespace,
                                    name,
                                }),
                            });
                            let kept = inputs.filter(|_| active.keep).and_then(|inputs| {
                                self.items.keep(
                                    *index,
                                    item,
                                    inputs.to_vec(),
                                    (bytes.clone(), file.clone()),
                                    asked_here.clone(),
                                    tracked,
                                    active.epoch,
                                )
                            });
                            match kept {
                                Some(kept) => {
                                    if let Some(outputs) = &mut outputs {
                                        outputs.push(kept);
                                    }
                                }
                                None => outputs = None,
                            }
                            asked.extend(asked_here);
                            (bytes, file)
                        }
                    };
                    if let Some(file) = file {
                        if let Some(size) = size {
                            size.store(bytes.len(), Ordering::Relaxed);
                        }
                        files.push((file.path, bytes, Origin::Item(file.object)));
                    }
                }
                if let (Some(outputs), Some(inputs)) = (outputs, inputs) {
                    self.items.keep_chunk(
                        (*index, *chunk),
                        items,
                        inputs,
                        outputs,
                        &stores,
                        active.epoch,
                    );
                }
                Ok((files, asked))
            }
        }
    }
}

/// What one job produced: paths, bytes and where they came from, and what its templates
/// asked for.
type Produced = (Vec<(String, Bytes, Origin)>, Requests);

/// What one job produced, and how long it took.
type Rendered = (Vec<(String, Bytes, Origin)>, Requests, std::time::Duration);

/// Where one rendered file came from.
enum Origin {
    /// A single output, with the marks its templates made (`from`).
    Marks(provenance::Marks),
    /// A per-item output: its item.
    Item(Arc<ObjectRef>),
}

/// Per-item outputs are rendered in chunks of this many items per job.
const ITEMS_PER_JOB: usize = 128;

/// A unit of render work.
enum Job<'a> {
    /// One output rendered once; `index` is its place in the renderer's outputs.
    Single {
        index: usize,
        output: &'a Output,
        /// What the output can read, as it is in this render (none: unknown).
        inputs: Option<&'a [Value]>,
    },
    /// A per-item output rendered for a run of its store's items.
    Items {
        /// The output's place in the renderer's outputs.
        index: usize,
        /// What the output can read beyond its item, as it is in this render (none: unknown).
        inputs: Option<&'a [Value]>,
        /// Which run of `ITEMS_PER_JOB` items.
        chunk: usize,
        output: &'a Output,
        items: &'a [Value],
    },
}

impl Job<'_> {
    /// Where the job's output comes in output order: the output's index, then the chunk.
    fn place(&self) -> (usize, usize) {
        match self {
            Job::Single { index, .. } => (*index, 0),
            Job::Items { index, chunk, .. } => (*index, *chunk),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::set::{CertificateTemplate, Template};
    use crate::store::StoreConfig;
    use serde_json::json;

    fn compile(main: &str) -> Result<Renderer> {
        Renderer::compile(&TemplateSet {
            haproxy_config: Template::new(main),
            ..TemplateSet::default()
        })
    }

    #[test]
    fn a_lookup_is_a_call_of_it_not_the_word() {
        for called in [
            "{{ lookup(store=\"s\", key=k) }}",
            "{% set x = lookup (store=\"s\", key=k) %}",
            "{{ [\"s\", a] | lookup }}",
            "{{ [\"s\", a]|lookup|length }}",
        ] {
            assert!(calls(called, "lookup"), "{called}");
        }
        assert!(!calls(
            &without_comments("{# a lookup (in a map) #}{{ x }}"),
            "lookup"
        ));
        assert!(calls(
            &without_comments("{# x #}{{ lookup(key=1) }}{# y"),
            "lookup"
        ));
        for not in [
            "{% include \"gateway-lookup\" %}",
            "{# without a lookup in a map #}",
            "{{ row.lookup }}",
            "{{ lookups(x) }}",
            "{{ my_lookup(x) }}",
        ] {
            assert!(!calls(not, "lookup"), "{not}");
        }
    }

    /// The reference set calls no `lookup` and names no `resources`: its renders build
    /// neither the indexes nor the lists (but the certificates' Secrets, which a per-item
    /// output walks).
    #[test]
    fn the_reference_set_reads_names_and_one_list() {
        let renderer = Renderer::compile(&crate::reference::template_set()).unwrap();
        assert!(!renderer.store_reads.lists);
        assert!(!renderer.store_reads.indexes);
        assert_eq!(
            renderer.wants("secrets"),
            Wants {
                list: true,
                index: false
            }
        );
        assert_eq!(
            renderer.wants("ingresses"),
            Wants {
                list: false,
                index: false
            }
        );
        // A set that calls it builds the indexes.
        let looking = compile("{{ lookup(store=\"services\", key=\"ns\") | length }}").unwrap();
        assert!(looking.store_reads.indexes);
    }

    /// The reference set keeps compact the stores it reads only through derived views and
    /// `get()` (its `ingresses` view holds no Ingress whole): all but the Secrets, which a
    /// per-item output lists. A view that holds the Ingresses whole keeps their store as
    /// template values.
    #[test]
    fn the_reference_set_compacts_the_stores_it_only_derives_from() {
        let renderer = Renderer::compile(&crate::reference::template_set()).unwrap();
        let mut stores = crate::reference::stores().unwrap();
        let compact = renderer.compact_unread_stores(&mut stores);
        for name in [
            "ingresses",
            "services",
            "endpointslices",
            "ingressclasses",
            "httproutes",
        ] {
            assert!(compact.iter().any(|c| c == name), "{name}: {compact:?}");
        }
        assert!(!compact.iter().any(|c| c == "secrets"), "{compact:?}");
        assert!(!stores.get("secrets").unwrap().is_compact());
        let whole = crate::Derivation::Ingresses {
            ingresses: "ingresses".into(),
            classes: None,
            whole: true,
        };
        stores.derive("whole", whole).unwrap();
        renderer.compact_unread_stores(&mut stores);
        assert!(!stores.get("ingresses").unwrap().is_compact());
        // A set that lists the Services keeps them as template values.
        let listing = compile("{% for s in resources.services %}{{ s }}{% endfor %}").unwrap();
        listing.compact_unread_stores(&mut stores);
        assert!(!stores.get("services").unwrap().is_compact());
    }

    /// What a template reads of a compact store is what it reads of the same store kept as
    /// template values: `get()` (a missing resource too), a list and an index built for a
    /// renderer that wants them (a second set on the same stores), numbers of their kinds.
    #[test]
    fn a_compact_store_reads_as_template_values() {
        let main = r#"{% set s = get(store="services", namespace="a", name="web") %}{{ s.metadata.name }} {{ s.spec.ports[0].port }} {{ s.spec.ports[0].port / 2 }} {{ s.spec.ratio }} {{ s.spec.none is none }} {{ get(store="services", namespace="a", name="gone") is none }}
{% for s in resources.services %}{{ s.metadata.namespace }}/{{ s.metadata.name }} {% endfor %}
{% for s in lookup(store="services", key=["a", "api"]) %}{{ s.metadata.name }}{% endfor %}"#;
        let renderer = compile(main).unwrap();
        let mut plain = stores();
        plain
            .get_mut("services")
            .unwrap()
            .apply(&json!({"metadata": {"namespace": "a", "name": "web"}, "spec": {"ports": [{"port": 80}], "ratio": 1.5, "none": null}}))
            .unwrap();
        let mut compact = plain.clone();
        compact.get_mut("services").unwrap().set_compact(true);
        assert!(compact.get("services").unwrap().is_compact());
        let want = renderer.render(&plain).unwrap();
        let got = renderer.render(&compact).unwrap();
        let text = got.text("haproxy.cfg").unwrap();
        assert!(
            text.starts_with("web 80 40.0 1.5 true true\na/api a/web b/web \napi"),
            "{text}"
        );
        assert_eq!(text, want.text("haproxy.cfg").unwrap());
        // Back to template values: the same again.
        compact.get_mut("services").unwrap().set_compact(false);
        assert_eq!(
            renderer.render(&compact).unwrap().checksum(),
            want.checksum()
        );
        // Outside templates too.
        let mut compacted = plain.clone();
        compacted.get_mut("services").unwrap().set_compact(true);
        let (p, c) = (
            plain.get("services").unwrap(),
            compacted.get("services").unwrap(),
        );
        assert_eq!(c.json(), p.json());
        for path in [
            "spec.ports",
            "spec.ports.0.port",
            "spec.ratio",
            "spec.none",
            "spec.gone",
            "metadata.name",
        ] {
            assert_eq!(
                c.value_at("a", "web", path),
                p.value_at("a", "web", path),
                "{path}"
            );
        }
        assert_eq!(
            c.value_at("a", "web", "spec.ports"),
            Some(json!([{"port": 80}]))
        );
        assert_eq!(c.value_at("a", "web", "spec.none"), None);
    }

    /// An event on a compact store makes template values of the resource it changed, not of
    /// every resource: the derived views read an extract of each resource once per version.
    #[test]
    fn an_event_on_a_compact_store_expands_the_resource_it_changed() {
        let fixtures = crate::fixtures::generate(200);
        let renderer = Renderer::compile(&crate::reference::template_set())
            .unwrap()
            .with_threads(1);
        let mut stores = crate::reference::stores().unwrap();
        renderer.compact_unread_stores(&mut stores);
        fixtures.load(&mut stores).unwrap();
        let expanded = || crate::value::EXPANDED.with(std::cell::Cell::get);
        let before = expanded();
        renderer.render(&stores).unwrap();
        let first = expanded() - before;
        // Every Ingress, Service and EndpointSlice at least once (their extracts), an
        // Ingress for each of its extracts and rows (paths, TLS, its `ingresses` row).
        let resources =
            fixtures.ingresses.len() + fixtures.services.len() + fixtures.endpoint_slices.len();
        assert!(
            first >= resources && first <= 3 * resources,
            "{first} for {resources}"
        );
        for (store, resource) in [
            ("services", &fixtures.services[7]),
            ("endpointslices", &fixtures.endpoint_slices[9]),
            ("ingresses", &fixtures.ingresses[11]),
        ] {
            let mut changed = resource.clone();
            changed["metadata"]["labels"] = json!({"changed": "yes"});
            stores.get_mut(store).unwrap().apply(&changed).unwrap();
            let before = expanded();
            renderer.render(&stores).unwrap();
            let again = expanded() - before;
            assert!((1..=5).contains(&again), "{store}: {again} values made");
        }
    }

    /// A single output's file is written in the buffer its file had in a set that was let go
    /// (`recycle.rs`), and gives the bytes a fresh render of the same stores gives.
    #[test]
    fn a_file_is_written_again_in_the_buffer_of_a_set_let_go() {
        // With reuse (as the controller renders) the renderer keeps each output's last bytes
        // and lets go of the ones replaced during the next render; without it, it keeps none.
        for reuse in [true, false] {
            file_written_again_in_a_buffer_let_go(reuse);
        }
    }

    fn file_written_again_in_a_buffer_let_go(reuse: bool) {
        let fixtures = crate::fixtures::generate(200);
        let renderer = Renderer::compile(&crate::reference::template_set())
            .unwrap()
            .with_threads(1)
            .with_reuse(reuse);
        let mut stores = crate::reference::stores().unwrap();
        fixtures.load(&mut stores).unwrap();
        let config = |set: &FileSet| set.get("haproxy.cfg").unwrap().as_ptr();
        let first = renderer.render(&stores).unwrap();
        assert!(
            first.get("haproxy.cfg").unwrap().len() >= crate::recycle::MIN_RECYCLED,
            "haproxy.cfg at 200 Ingresses is large enough to be recycled"
        );
        let mut ready = true;
        let mut change = |stores: &mut Stores| {
            ready = !ready;
            let mut slice = fixtures.endpoint_slices[9].clone();
            slice["endpoints"][0]["conditions"]["ready"] = json!(ready);
            stores
                .get_mut("endpointslices")
                .unwrap()
                .apply(&slice)
                .unwrap();
        };
        change(&mut stores);
        // The first set is still held: its buffer is not the second's.
        let second = renderer.render(&stores).unwrap();
        assert_ne!(config(&second), config(&first));
        let first_buffer = config(&first);
        drop(first);
        change(&mut stores);
        let third = renderer.render(&stores).unwrap();
        assert_eq!(config(&third), first_buffer, "reuse: {reuse}");
        let fresh = Renderer::compile(&crate::reference::template_set())
            .unwrap()
            .render(&stores)
            .unwrap();
        assert_eq!(third.get("haproxy.cfg"), fresh.get("haproxy.cfg"));
        assert_ne!(third.get("haproxy.cfg"), second.get("haproxy.cfg"));
        assert_eq!(third.checksum_hex(), fresh.checksum_hex());
    }

    fn stores() -> Stores {
        let mut stores = Stores::new();
        let services = stores.add("services", StoreConfig::default()).unwrap();
        for (ns, name) in [("b", "web"), ("a", "web"), ("a", "api")] {
            services
                .apply(&json!({"metadata": {"namespace": ns, "name": name}, "spec": {"ports": [{"port": 80}]}}))
                .unwrap();
        }
        stores
    }

    #[test]
    fn compile_errors_name_template_and_line() {
        let err = compile("global\n\n{% if %}\n").unwrap_err();
        let Error::Compile { template, line, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(template, "haproxyConfig");
        assert_eq!(*line, Some(3));
        assert!(err.to_string().contains("haproxyConfig` line 3"), "{err}");
    }

    #[test]
    fn unknown_filters_fail_at_compile_time() {
        let err = compile("{{ x | no_such_filter }}").unwrap_err();
        assert!(matches!(err, Error::Compile { .. }), "{err}");
        assert!(err.to_string().contains("no_such_filter"), "{err}");
    }

    #[test]
    fn fail_names_template_line_and_message() {
        let mut set = TemplateSet {
            haproxy_config: Template::new("a\n{% include \"check\" %}\n"),
            ..TemplateSet::default()
        };
        set.template_snippets.insert(
            "check".into(),
            Template::new("x\ny\n{{ fail(message=\"ingress shop/web has no rules\") }}"),
        );
        let renderer = Renderer::compile(&set).unwrap();
        let err = renderer.render(&stores()).unwrap_err();
        let Error::Render {
            output,
            template,
            line,
            cause,
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(output, "haproxy.cfg");
        assert_eq!(template, "check");
        assert_eq!(*line, Some(3));
        assert!(cause.contains("ingress shop/web has no rules"), "{cause}");
    }

    #[test]
    fn the_error_reported_is_the_first_in_output_order_whatever_the_job_order() {
        // The map is slower than haproxy.cfg, so after the first render it is started first.
        let fail_if_any = "{% if resources.services %}{{ fail(message=\"no\") }}{% endif %}";
        let mut set = TemplateSet {
            haproxy_config: Template::new(fail_if_any),
            ..TemplateSet::default()
        };
        set.maps.insert(
            "slow.map".into(),
            Template::new(format!(
                "{fail_if_any}{{% for i in range(end=20000) %}}{{{{ i }}}}{{% endfor %}}"
            )),
        );
        for threads in [1, 2] {
            let renderer = Renderer::compile(&set).unwrap().with_threads(threads);
            let mut empty = Stores::new();
            empty.add("services", StoreConfig::default()).unwrap();
            renderer.render(&empty).unwrap();
            renderer.render(&empty).unwrap();
            let err = renderer.render(&stores()).unwrap_err();
            assert!(
                matches!(&err, Error::Render { output, .. } if output == "haproxy.cfg"),
                "{err}"
            );
        }
    }

    #[test]
    fn stores_are_listed_sorted_and_found_by_get_and_lookup() {
        let renderer = compile(
            "{% for s in resources.services %}{{ s.metadata.namespace }}/{{ s.metadata.name }} {% endfor %}\
             {% set svc = get(store=\"services\", namespace=\"b\", name=\"web\") %}\
             |{{ svc.metadata.namespace }}\
             |{{ get(store=\"services\", namespace=\"b\", name=\"nope\") is none }}\
             |{{ lookup(store=\"services\", key=[\"a\", \"api\"]) | length }}\
             |{{ lookup(store=\"services\", key=\"a/zzz\") | length }}\
             {% set fast = [\"services\", \"a\", \"web\"] | get %}|{{ fast.metadata.namespace }}\
             |{{ [\"services\", \"a\", \"nope\"] | get is none }}\
             |{{ [\"services\", \"a\", \"api\"] | lookup | length }}\
             |{{ [\"a\", \"web\", 80] | backend_name }}",
        )
        .unwrap();
        let files = renderer.render(&stores()).unwrap();
        assert_eq!(
            files.text("haproxy.cfg").unwrap(),
            "a/api a/web b/web |b|true|1|0|a|true|1|a_web_80"
        );
    }

    /// Every function, filter and test as a template author writes it.
    #[test]
    fn functions_filters_and_tests_work_in_templates() {
        let mut stores = stores();
        let services = stores.get_mut("services").unwrap();
        services
            .apply(
                &json!({"metadata": {"namespace": "a", "name": "zeta"}, "spec": {"priority": 5}}),
            )
            .unwrap();
        services
            .apply(&json!({"metadata": {"namespace": "b", "name": "mid"}, "spec": {"priority": 9}}))
            .unwrap();
        let cases = [
            ("{{ \"shop/web:8080\" | sanitize }}", "shop_web_8080"),
            (
                "{{ backend_name(namespace=\"shop\", service=\"web\", port=80) }}",
                "shop_web_80",
            ),
            (
                "{{ [\"shop\", \"web\", \"http\"] | backend_name }}",
                "shop_web_http",
            ),
            ("{{ \"/v1.0/(x)\" | regex_escape }}", "/v1\\.0/\\(x\\)"),
            ("{{ \"aGk=\" | b64decode }}", "hi"),
            ("[{{ \"%%%\" | b64decode(default=\"\") }}]", "[]"),
            (
                "{{ ssl_file(namespace=\"shop\", name=\"web-tls\") }}",
                "ssl/10/shop_web-tls.pem",
            ),
            (
                "{% for s in resources.services | sort_by(field=\"spec.priority\", reverse=true) %}{{ s.metadata.name }} {% endfor %}",
                "mid zeta api web web ",
            ),
            (
                "{% for s in resources.services | sort_by(field=\"metadata.name\") %}{{ s.metadata.name }} {% endfor %}",
                "api mid web web zeta ",
            ),
            (
                "{% for g in resources.services | group_by_field(field=\"metadata.namespace\") %}{{ g.key }}={{ g.items | length }} {% endfor %}",
                "a=3 b=2 ",
            ),
            (
                "{{ \"/api\" is http_path }} {{ \"api\" is http_path }} {{ 3 is http_path }}",
                "true false false",
            ),
            (
                "{{ \"a.example.com\" is hostname }} {{ \"*.example.com\" is hostname }}",
                "true false",
            ),
        ];
        for (source, want) in cases {
            let files = compile(source).unwrap().render(&stores).unwrap();
            assert_eq!(files.text("haproxy.cfg"), Some(want), "{source}");
        }
        let err = compile("{{ \"%%%\" | b64decode }}")
            .unwrap()
            .render(&stores)
            .unwrap_err();
        assert!(
            err.to_string().contains("b64decode: not valid base64"),
            "{err}"
        );
    }

    #[test]
    fn unknown_store_is_a_render_error_listing_known_stores() {
        let renderer = compile("{{ get(store=\"servics\", name=\"x\") }}").unwrap();
        let err = renderer.render(&stores()).unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown store `servics` (known: services)"),
            "{err}"
        );
    }

    #[test]
    fn where_any_keeps_rows_with_a_truthy_or_a_falsy_field() {
        let mut set = TemplateSet {
            haproxy_config: Template::new(
                "{% for r in rows | where_any(truthy=[\"conflict\", \"external\"], falsy=[\"backend\"]) %}{{ r.n }} {% endfor %}",
            ),
            ..TemplateSet::default()
        };
        set.extra_context.insert(
            "rows".into(),
            json!([
                {"n": 1, "backend": "b", "conflict": null, "external": false},
                {"n": 2, "backend": "b", "conflict": "x/y", "external": false},
                {"n": 3, "backend": null, "conflict": null, "external": false},
                {"n": 4, "backend": "b", "conflict": null, "external": true},
                {"n": 5, "conflict": null},
            ]),
        );
        let files = Renderer::compile(&set)
            .unwrap()
            .render(&Stores::new())
            .unwrap();
        assert_eq!(files.text("haproxy.cfg"), Some("2 3 4 5 "));
        set.extra_context.insert("rows".into(), json!([1]));
        let err = Renderer::compile(&set)
            .unwrap()
            .render(&Stores::new())
            .unwrap_err();
        assert!(
            err.to_string().contains("where_any: expected maps"),
            "{err}"
        );
    }

    #[test]
    fn extra_context_is_visible_at_top_level() {
        let mut set = TemplateSet {
            haproxy_config: Template::new("{{ tuning.maxconn }}"),
            ..TemplateSet::default()
        };
        set.extra_context
            .insert("tuning".into(), json!({"maxconn": 5000}));
        let files = Renderer::compile(&set)
            .unwrap()
            .render(&Stores::new())
            .unwrap();
        assert_eq!(files.text("haproxy.cfg"), Some("5000"));
    }

    #[test]
    fn per_item_certificates_skip_blank_output() {
        let mut set = TemplateSet::default();
        set.ssl_certificates.insert(
            "services".into(),
            CertificateTemplate {
                template: "{% if item.metadata.name == \"web\" %}PEM {{ item.metadata.namespace }}{% endif %}".into(),
                for_each: Some("services".into()),
            },
        );
        let files = Renderer::compile(&set).unwrap().render(&stores()).unwrap();
        let paths: Vec<&str> = files.iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            ["haproxy.cfg", "ssl/1d/a_web.pem", "ssl/28/b_web.pem"]
        );
        assert_eq!(files.text("ssl/28/b_web.pem"), Some("PEM b"));

        set.ssl_certificates.get_mut("services").unwrap().for_each = Some("secrets".into());
        let err = Renderer::compile(&set)
            .unwrap()
            .render(&stores())
            .unwrap_err();
        assert!(matches!(err, Error::UnknownStore { .. }), "{err}");
    }

    #[test]
    fn two_outputs_of_one_path_are_an_error_naming_it() {
        let mut set = TemplateSet::default();
        for key in ["one", "two"] {
            set.ssl_certificates.insert(
                key.into(),
                CertificateTemplate {
                    template: "PEM {{ item.metadata.name }}".into(),
                    for_each: Some("services".into()),
                },
            );
        }
        let err = Renderer::compile(&set)
            .unwrap()
            .render(&stores())
            .unwrap_err();
        assert!(
            matches!(&err, Error::DuplicatePath(path) if path == "ssl/03/a_api.pem"),
            "{err}"
        );
    }

    #[test]
    fn render_each_reuses_rows_and_names_errors() {
        let mut set = TemplateSet {
            haproxy_config: Template::new(
                "{{ render_each(rows=resources.services, template=\"row\", args=\"-\") }}",
            ),
            ..TemplateSet::default()
        };
        set.template_snippets.insert(
            "row".into(),
            Template::new(
                "{{ row.metadata.namespace }}{{ args }}{{ row.metadata.name }}\n\
                 {% if row.metadata.name == \"bad\" %}{{ fail(message=\"no\") }}{% endif %}",
            ),
        );
        let renderer = Renderer::compile(&set).unwrap();
        let mut stores = stores();
        let files = renderer.render(&stores).unwrap();
        assert_eq!(files.text("haproxy.cfg"), Some("a-api\na-web\nb-web\n"));
        assert_eq!(renderer.last_timings().fragments_rendered, 3);
        // One Service changes: one row rendered, two reused, the same bytes as a fresh render.
        stores
            .get_mut("services")
            .unwrap()
            .apply(&json!({"metadata": {"namespace": "a", "name": "api"}, "spec": {}}))
            .unwrap();
        let files = renderer.render(&stores).unwrap();
        assert_eq!(files.text("haproxy.cfg"), Some("a-api\na-web\nb-web\n"));
        let timings = renderer.last_timings();
        assert_eq!(
            (timings.fragments_rendered, timings.fragments_reused),
            (1, 2)
        );
        stores
            .get_mut("services")
            .unwrap()
            .apply(&json!({"metadata": {"namespace": "c", "name": "bad"}}))
            .unwrap();
        let err = renderer.render(&stores).unwrap_err();
        assert!(
            err.to_string()
                .contains("render_each: template `row` line 2: template failed: no"),
            "{err}"
        );
    }

    /// Services added one a render, before all the others and in the middle: each render
    /// renders the new row alone, gives a fresh render's bytes, and its call site's index puts
    /// in the new row's place (all of them only when its slack grew too wide), not the place
    /// of every row after it.
    #[test]
    fn render_each_after_rows_added_anywhere_renders_and_indexes_them_alone() {
        let mut set = TemplateSet {
            haproxy_config: Template::new(
                "{{ render_each(rows=resources.services, template=\"row\") }}",
            ),
            ..TemplateSet::default()
        };
        set.template_snippets.insert(
            "row".into(),
            Template::new("{{ row.metadata.namespace }}/{{ row.metadata.name }}\n"),
        );
        let renderer = Renderer::compile(&set).unwrap().with_threads(1);
        let mut stores = stores();
        renderer.render(&stores).unwrap();
        let mut indexed = 0;
        for i in 0..40 {
            let (namespace, name) = if i % 3 == 0 {
                ("0", format!("front-{i:02}"))
            } else {
                ("a", format!("middle-{i:02}"))
            };
            stores
                .get_mut("services")
                .unwrap()
                .apply(&json!({"metadata": {"namespace": namespace, "name": name}}))
                .unwrap();
            let before = fragments::INDEXED.with(std::cell::Cell::get);
            let files = renderer.render(&stores).unwrap();
            indexed += fragments::INDEXED.with(std::cell::Cell::get) - before;
            assert_eq!(renderer.last_timings().fragments_rendered, 1, "after {i}");
            let fresh = Renderer::compile(&set).unwrap().render(&stores).unwrap();
            assert_eq!(files.text("haproxy.cfg"), fresh.text("haproxy.cfg"));
        }
        // Every row after the new one put in again would be ~400 over the 40 renders.
        assert!(indexed < 40 + 2 * 48, "{indexed} places indexed");
    }

    /// A row never sees what another row set, whether the runner's loop holds the snippet's
    /// source (inlined) or includes it (a snippet with `set_global`).
    #[test]
    fn render_each_rows_do_not_see_each_others_variables() {
        for extra in ["", "{% set_global g = 1 %}"] {
            let mut set = TemplateSet {
                haproxy_config: Template::new(
                    "{{ render_each(rows=resources.services, template=\"row\") }}",
                ),
                ..TemplateSet::default()
            };
            set.template_snippets.insert(
                "row".into(),
                Template::new(format!(
                    "{extra}{{% if row.metadata.name == \"api\" %}}{{% set v = \"set\" %}}{{% endif %}}\
                     {{{{ row.metadata.name }}}}={{{{ v | default(value=\"none\") }}}}\n"
                )),
            );
            let files = Renderer::compile(&set).unwrap().render(&stores()).unwrap();
            assert_eq!(
                files.text("haproxy.cfg"),
                Some("api=set\nweb=none\nweb=none\n"),
                "{extra}"
            );
        }
        assert!(fragments::inlinable(
            "{% set v = 1 %}{# set_global in a comment #}"
        ));
        assert!(!fragments::inlinable("{%- set_global v = 1 %}"));
        assert!(!fragments::inlinable(
            "{% for x in y %}{% break %}{% endfor %}"
        ));
        assert!(!fragments::inlinable("{% import \"m\" as m %}"));
    }

    /// `render_each(from="origin")` marks each row as `{{ row.origin | from }}` at the start of
    /// its snippet does; a row without the field belongs to no object.
    #[test]
    fn render_each_from_marks_each_row_as_its_object() {
        let stores = stores();
        let traced = |call: &str, snippet: &str| {
            let mut set = TemplateSet {
                haproxy_config: Template::new(format!("head\n{call}tail\n")),
                ..TemplateSet::default()
            };
            set.template_snippets
                .insert("row".into(), Template::new(snippet));
            let (files, _, provenance) = Renderer::compile(&set)
                .unwrap()
                .render_traced(&stores)
                .unwrap();
            let text = files.text("haproxy.cfg").unwrap().to_owned();
            let objects: Vec<Option<String>> = (1..=text.lines().count())
                .map(|line| {
                    provenance
                        .object_at(&files, "haproxy.cfg", line)
                        .map(|o| o.to_string())
                })
                .collect();
            (text, objects)
        };
        let rows = "[{\"origin\": [\"services\", \"a\", \"api\"], \"n\": 1}, {\"n\": 2}, \
                    {\"origin\": [\"services\", \"b\", \"web\"], \"n\": 3}]";
        let explicit = traced(
            &format!("{{{{ render_each(rows={rows}, template=\"row\") }}}}{{{{ [] | from }}}}"),
            "{{ row.origin | default(value=[]) | from }}line {{ row.n }}\n",
        );
        let marked = traced(
            &format!(
                "{{{{ render_each(rows={rows}, template=\"row\", from=\"origin\") }}}}{{{{ [] | from }}}}"
            ),
            "line {{ row.n }}\n",
        );
        assert_eq!(marked, explicit);
        assert_eq!(
            marked.1,
            [
                None,
                Some("services/a/api".into()),
                None,
                Some("services/b/web".into()),
                None
            ]
        );
    }

    /// A run of rows split over threads is one run: the same bytes, Events and provenance (a
    /// mark in the middle of a row included), and the first failing row in row order is the
    /// error, whichever part it is in.
    #[test]
    fn render_each_split_over_threads_is_one_run() {
        let mut set = TemplateSet {
            haproxy_config: Template::new(
                "head\n{{ render_each(rows=resources.services, template=\"row\") }}tail\n",
            ),
            ..TemplateSet::default()
        };
        set.template_snippets.insert(
            "row".into(),
            Template::new(
                "before {{ row.metadata.name }}\n\
                 {{ [\"services\", row.metadata.namespace, row.metadata.name] | from }}after {{ row.metadata.name }}\n\
                 {% if row.spec.warn %}{{ record_event(object=row, type=\"Warning\", reason=\"Seven\", message=row.metadata.name) }}{% endif %}\
                 {% if row.spec.fail %}{{ fail(message=\"failed at \" ~ row.metadata.name) }}{% endif %}\
                 {{ [] | from }}",
            ),
        );
        let mut stores = Stores::new();
        stores.add("services", StoreConfig::default()).unwrap();
        for i in 0..40 {
            stores
                .get_mut("services")
                .unwrap()
                .apply(
                    &json!({"metadata": {"namespace": "ns", "name": format!("s{i:02}")},
                               "spec": {"warn": i % 10 == 7}}),
                )
                .unwrap();
        }
        let render = |threads: usize, split: usize, stores: &Stores| {
            Renderer::compile(&set)
                .unwrap()
                .with_threads(threads)
                .with_split_rows(split)
                .render_traced(stores)
        };
        let (files, requests, provenance) = render(1, 1024, &stores).unwrap();
        let (split_files, split_requests, split_provenance) = render(3, 4, &stores).unwrap();
        assert_eq!(split_files.files(), files.files());
        assert_eq!(split_requests, requests);
        assert_eq!(requests.events.len(), 4);
        let text = files.text("haproxy.cfg").unwrap();
        for (i, line) in text.lines().enumerate() {
            let at = |p: &Provenance, f: &FileSet| {
                p.object_at(f, "haproxy.cfg", i + 1).map(|o| o.to_string())
            };
            assert_eq!(
                at(&split_provenance, &split_files),
                at(&provenance, &files),
                "{line}"
            );
            if let Some(name) = line.strip_prefix("after ") {
                assert_eq!(
                    at(&split_provenance, &split_files),
                    Some(format!("services/ns/{name}"))
                );
            } else {
                assert_eq!(at(&split_provenance, &split_files), None, "{line}");
            }
        }
        // Rows 13 (second part of three) and 35 (third) fail: row 13's error is the one.
        for i in [35, 13] {
            stores
                .get_mut("services")
                .unwrap()
                .apply(
                    &json!({"metadata": {"namespace": "ns", "name": format!("s{i:02}")},
                               "spec": {"fail": true}}),
                )
                .unwrap();
        }
        let err = render(3, 4, &stores).unwrap_err().to_string();
        assert!(err.contains("template `row` line 3"), "{err}");
        assert!(err.contains("failed at s13"), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused_before_the_engine() {
        let source = format!("{{{{ {}1{} }}}}", "(".repeat(10_000), ")".repeat(10_000));
        let err = compile(&source).unwrap_err();
        assert!(err.to_string().contains("nest deeper"), "{err}");
    }
}
