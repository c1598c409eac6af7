//! minijinja as a peer engine: the same template set, the same context shape, the same
//! functions and filters (the ones from `haptic_render::functions`), for a side-by-side render
//! time. Bench-only: the product renders with tera.

use std::collections::BTreeMap;

use haptic_render::fixtures::Fixtures;
use haptic_render::functions::{
    b64decode, backend_name, is_hostname, is_http_path, regex_escape, sanitize, ssl_file,
};
use haptic_render::{FileSet, Stores, TemplateSet, reference};
use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, context};
use serde_json::Value as Json;

/// A `Result` with minijinja's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn invalid(message: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, message)
}

/// Text of a key-like value: strings as they are, anything else in its display form.
fn text(value: &Value) -> String {
    value
        .as_str()
        .map_or_else(|| value.to_string(), ToOwned::to_owned)
}

fn store_lookup(state: &State, var: &str, store: &str, key: &str) -> Result<Value> {
    let stores = state
        .lookup(var)
        .ok_or_else(|| invalid("the render context has no stores".into()))?;
    let entries = stores.get_attr(store)?;
    if entries.is_undefined() {
        return Err(invalid(format!("unknown store `{store}`")));
    }
    entries.get_item(&Value::from(key))
}

/// Resolves a field path of the reference stores: dot-separated, with `["..."]` for keys.
fn resolve<'a>(json: &'a Json, path: &str) -> Option<&'a Json> {
    let mut value = json;
    let mut rest = path;
    while !rest.is_empty() {
        let key;
        if let Some(after) = rest.strip_prefix("[\"") {
            let end = after.find("\"]")?;
            key = &after[..end];
            rest = &after[end + 2..];
        } else {
            let end = rest.find(['.', '[']).unwrap_or(rest.len());
            key = &rest[..end];
            rest = &rest[end..];
        }
        rest = rest.strip_prefix('.').unwrap_or(rest);
        value = value.get(key)?;
    }
    Some(value)
}

/// The render context, built once from the resources (as the tera stores build their views
/// once per change), so that the timed part is the render alone for both engines.
#[derive(Debug, Clone)]
pub struct PeerContext {
    base: Value,
    /// The Secrets of the stores certificates are rendered per item of (`secrets`,
    /// `auth_secrets`).
    secrets: BTreeMap<String, Vec<Value>>,
}

impl PeerContext {
    /// The context of the reference stores holding `fixtures`, with the set's extra context.
    ///
    /// `stores` are the reference stores loaded with the same fixtures: the derived views
    /// (`derived.<name>`) are data, computed by haptic-render for both engines alike.
    pub fn new(set: &TemplateSet, fixtures: &Fixtures, stores: &Stores) -> Self {
        let mut lists: BTreeMap<&str, Vec<&Json>> = BTreeMap::new();
        for (store, resource) in fixtures.resources() {
            lists.entry(store).or_default().push(resource);
        }
        let meta = |r: &Json, field: &str| {
            r.get("metadata")
                .and_then(|m| m.get(field))
                .and_then(Json::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let (mut resources, mut by_name, mut by_index) =
            (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        let mut secrets = BTreeMap::new();
        for (store, index_by) in reference::STORES {
            let mut items = lists.remove(store).unwrap_or_default();
            items.sort_by_key(|r| (meta(r, "namespace"), meta(r, "name")));
            let values: Vec<Value> = items.iter().map(Value::from_serialize).collect();
            let mut names = BTreeMap::new();
            let mut index: BTreeMap<String, Vec<Value>> = BTreeMap::new();
            for (item, value) in items.iter().zip(&values) {
                let key = format!("{}/{}", meta(item, "namespace"), meta(item, "name"));
                names.insert(key, value.clone());
                let parts: Option<Vec<String>> = index_by
                    .iter()
                    .map(|path| match resolve(item, path)? {
                        Json::String(s) => Some(s.clone()),
                        other => Some(other.to_string()),
                    })
                    .collect();
                if let Some(parts) = parts {
                    index
                        .entry(parts.join("/"))
                        .or_default()
                        .push(value.clone());
                }
            }
            if store == "secrets" || store == "auth_secrets" {
                secrets.insert(store.to_owned(), values.clone());
            }
            resources.insert(store.to_owned(), Value::from(values));
            by_name.insert(store.to_owned(), Value::from(names));
            by_index.insert(
                store.to_owned(),
                Value::from(
                    index
                        .into_iter()
                        .map(|(k, v)| (k, Value::from(v)))
                        .collect::<BTreeMap<_, _>>(),
                ),
            );
        }
        let mut top: BTreeMap<String, Value> = set
            .extra_context
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        top.insert("resources".into(), Value::from(resources));
        top.insert("__haptic_get".into(), Value::from(by_name));
        top.insert("__haptic_index".into(), Value::from(by_index));
        let derived: BTreeMap<&str, Value> = reference::derivations()
            .iter()
            .map(|(name, _)| {
                let rows = stores.derived_json(name).unwrap_or_default();
                (*name, Value::from_serialize(&rows))
            })
            .collect();
        top.insert("derived".into(), Value::from(derived));
        Self {
            base: Value::from(top),
            secrets,
        }
    }
}

/// A template set compiled by minijinja, with haptic-render's functions, filters and tests
/// registered under the same names and arguments.
#[derive(Debug)]
pub struct PeerRenderer {
    env: Environment<'static>,
    outputs: Vec<(String, String)>,
    per_secret: Vec<(String, String)>,
    /// The status templates (`statusTemplates.<name>`), which write no file.
    status: Vec<String>,
}

impl PeerRenderer {
    /// Compiles every template of the set (the reference set's per-item certificates are
    /// rendered for each Secret).
    pub fn compile(set: &TemplateSet) -> Result<Self> {
        let mut env = Environment::new();
        env.set_keep_trailing_newline(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        register(&mut env);
        let mut outputs = vec![("haproxyConfig".to_owned(), "haproxy.cfg".to_owned())];
        env.add_template_owned("haproxyConfig", set.haproxy_config.template.clone())?;
        for (name, t) in &set.maps {
            env.add_template_owned(format!("maps.{name}"), t.template.clone())?;
            outputs.push((format!("maps.{name}"), format!("maps/{name}")));
        }
        for (name, f) in &set.files {
            env.add_template_owned(format!("files.{name}"), f.template.clone())?;
            outputs.push((format!("files.{name}"), f.path.clone()));
        }
        let mut per_secret = Vec::new();
        for (name, c) in &set.ssl_certificates {
            let template = format!("sslCertificates.{name}");
            env.add_template_owned(template.clone(), c.template.clone())?;
            match c.for_each.as_deref() {
                Some(store @ ("secrets" | "auth_secrets")) => {
                    per_secret.push((template, store.to_owned()));
                }
                Some(other) => return Err(invalid(format!("forEach `{other}` unsupported"))),
                None => outputs.push((template, format!("ssl/{name}.pem"))),
            }
        }
        for (name, t) in &set.template_snippets {
            env.add_template_owned(name.clone(), t.template.clone())?;
        }
        // Rendered as the renderer renders them, their text dropped: they write no file.
        let mut status = Vec::new();
        for (name, t) in &set.status_templates {
            let template = format!("statusTemplates.{name}");
            env.add_template_owned(template.clone(), t.template.clone())?;
            status.push(template);
        }
        Ok(Self {
            env,
            outputs,
            per_secret,
            status,
        })
    }

    /// Renders the set into a file set, as `haptic_render::Renderer::render` does.
    pub fn render(&self, context: &PeerContext) -> Result<FileSet> {
        let mut files = BTreeMap::new();
        for (template, path) in &self.outputs {
            let text = self.env.get_template(template)?.render(&context.base)?;
            files.insert(path.clone(), text.into_bytes());
        }
        for template in &self.status {
            self.env.get_template(template)?.render(&context.base)?;
        }
        for (template, store) in &self.per_secret {
            let template = self.env.get_template(template)?;
            for secret in context.secrets.get(store).into_iter().flatten() {
                let text = template.render(context! { item => secret, ..context.base.clone() })?;
                if text.trim().is_empty() {
                    continue;
                }
                let meta = secret.get_attr("metadata")?;
                let path = ssl_file(
                    &text_of(&meta.get_attr("namespace")?),
                    &text_of(&meta.get_attr("name")?),
                );
                files.insert(path, text.into_bytes());
            }
        }
        Ok(FileSet::new(files))
    }
}

fn text_of(value: &Value) -> String {
    if value.is_undefined() || value.is_none() {
        String::new()
    } else {
        text(value)
    }
}

fn register(env: &mut Environment<'static>) {
    env.add_filter("sanitize", |s: &str| sanitize(s));
    env.add_filter("regex_escape", |s: &str| regex_escape(s));
    env.add_filter("b64decode", |s: &str, kwargs: Kwargs| -> Result<String> {
        let default: Option<String> = kwargs.get("default")?;
        kwargs.assert_all_used()?;
        match (b64decode(s), default) {
            (Ok(text), _) => Ok(text),
            (Err(_), Some(default)) => Ok(default),
            (Err(e), None) => Err(invalid(format!("b64decode: {e}"))),
        }
    });
    env.add_filter("nginx_client_ca", |ingress: Value| -> String {
        let json = serde_json::to_value(&ingress).unwrap_or_default();
        let namespace = json["metadata"]["namespace"].as_str().unwrap_or_default();
        let pairs: Vec<(&str, &str)> = json["metadata"]["annotations"]
            .as_object()
            .map(|a| {
                a.iter()
                    .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)))
                    .collect()
            })
            .unwrap_or_default();
        haptic_render::nginx::client_ca(namespace, &pairs)
    });
    env.add_filter(
        "nginx_rules",
        |backend: Value, kwargs: Kwargs| -> Result<Value> {
            let part: Option<String> = kwargs.get("part")?;
            kwargs.assert_all_used()?;
            let part = match part.as_deref() {
                None => None,
                Some("head") => Some(haptic_render::nginx_rules::Part::Head),
                Some("rules") => Some(haptic_render::nginx_rules::Part::Rules),
                Some(other) => return Err(invalid(format!("nginx_rules: part {other:?}"))),
            };
            let backend = tera::Value::try_from_serializable(&backend)
                .map_err(|e| invalid(format!("nginx_rules: {e}")))?;
            let lines = haptic_render::nginx_rules::backend_rules(&backend, part)
                .ok_or_else(|| invalid("nginx_rules: no policy".to_owned()))?;
            // The lines hold validated values: not escaped (tera writes them so).
            Ok(Value::from_safe_string(lines))
        },
    );
    env.add_filter("gateway_action", |row: Value| -> Result<Value> {
        let row = tera::Value::try_from_serializable(&row)
            .map_err(|e| invalid(format!("gateway_action: {e}")))?;
        let lines = haptic_render::gateway_action::action_lines(&row)
            .ok_or_else(|| invalid("gateway_action: not an action row".to_owned()))?;
        // The lines hold validated values: not escaped (tera writes them so).
        Ok(Value::from_safe_string(lines))
    });
    env.add_filter(
        "gateway_certificates",
        |frontends: Value, kwargs: Kwargs| -> Result<Value> {
            let https_port: Option<Value> = kwargs.get("https_port")?;
            let shared: Option<bool> = kwargs.get("shared")?;
            kwargs.assert_all_used()?;
            let tera_value = |v: &Value| {
                tera::Value::try_from_serializable(v)
                    .map_err(|e| invalid(format!("gateway_certificates: {e}")))
            };
            let frontends = tera_value(&frontends)?;
            let https_port = match &https_port {
                Some(port) => tera_value(port)?,
                None => tera::Value::none(),
            };
            let certificates = haptic_render::functions::gateway_certificates(
                frontends.as_array().unwrap_or_default(),
                &https_port,
                shared.unwrap_or(false),
            );
            Ok(Value::from_serialize(&certificates))
        },
    );
    env.add_filter("trim_end", |s: &str, kwargs: Kwargs| -> Result<String> {
        let pat: Option<String> = kwargs.get("pat")?;
        kwargs.assert_all_used()?;
        Ok(match pat {
            Some(pat) if !pat.is_empty() => s.trim_end_matches(pat.as_str()).to_owned(),
            _ => s.trim_end().to_owned(),
        })
    });
    env.add_test("http_path", |v: &Value| {
        v.as_str().is_some_and(is_http_path)
    });
    env.add_test("hostname", |v: &Value| v.as_str().is_some_and(is_hostname));
    env.add_test("wildcard_host", |v: &Value| {
        v.as_str()
            .is_some_and(haptic_render::functions::is_wildcard_host)
    });
    env.add_test("config_token", |v: &Value| {
        v.as_str()
            .is_none_or(haptic_render::functions::is_config_token)
    });
    env.add_test("ip_address", |v: &Value| {
        v.as_str()
            .is_some_and(haptic_render::functions::is_ip_address)
    });
    // The peer never renders an overlay, so nothing is under review: `refuse` writes nothing,
    // as in tera's normal render.
    env.add_function("refuse", |_: Kwargs| -> Result<String> {
        Ok(String::new())
    });
    // What templates ask the cluster to show renders nothing; the peer compares files only.
    env.add_function("record_event", |_: Kwargs| -> Result<String> {
        Ok(String::new())
    });
    env.add_function("set_status", |_: Kwargs| -> Result<String> {
        Ok(String::new())
    });
    env.add_function("set_statuses", |_: Kwargs| -> Result<String> {
        Ok(String::new())
    });
    // Status values render nothing either; `pick` keeps the listed keys (as haptic-render's).
    env.add_filter("pick", |value: Value, kwargs: Kwargs| -> Result<Value> {
        let keys: Vec<String> = kwargs.get("keys")?;
        kwargs.assert_all_used()?;
        let pick_one = |item: &Value| -> Value {
            Value::from_iter(keys.iter().filter_map(|k| {
                item.get_attr(k)
                    .ok()
                    .filter(|v| !v.is_undefined())
                    .map(|v| (k.clone(), v))
            }))
        };
        Ok(match value.try_iter() {
            Ok(items) if value.kind() == minijinja::value::ValueKind::Seq => {
                Value::from_iter(items.map(|item| pick_one(&item)))
            }
            _ => pick_one(&value),
        })
    });
    // `where_any` keeps the rows with a truthy `truthy` field or a falsy `falsy` one (as
    // haptic-render's).
    env.add_filter(
        "where_any",
        |rows: Vec<Value>, kwargs: Kwargs| -> Result<Vec<Value>> {
            let truthy: Option<Vec<String>> = kwargs.get("truthy")?;
            let falsy: Option<Vec<String>> = kwargs.get("falsy")?;
            kwargs.assert_all_used()?;
            let field = |row: &Value, key: &str| row.get_attr(key).is_ok_and(|v| v.is_true());
            Ok(rows
                .into_iter()
                .filter(|row| {
                    truthy.iter().flatten().any(|k| field(row, k))
                        || falsy.iter().flatten().any(|k| !field(row, k))
                })
                .collect())
        },
    );
    // Provenance marks render nothing; the peer keeps no provenance.
    env.add_filter("from", |_: Value| -> Result<String> { Ok(String::new()) });
    env.add_function("backend_name", |kwargs: Kwargs| -> Result<String> {
        let namespace: Value = kwargs.get("namespace")?;
        let service: Value = kwargs.get("service")?;
        let port: Value = kwargs.get("port")?;
        Ok(backend_name(
            &text(&namespace),
            &text(&service),
            &text(&port),
        ))
    });
    env.add_filter(
        "server_slots",
        |rows: Vec<Value>, kwargs: Kwargs| -> Result<Vec<Value>> {
            let slots: Option<usize> = kwargs.get("slots")?;
            kwargs.assert_all_used()?;
            let texts = endpoint_texts(&rows);
            let endpoints = endpoints_of(&texts);
            let per_backend = slots.unwrap_or(haptic_render::slots::DEFAULT_SLOTS);
            Ok(haptic_render::slots::assign(&endpoints, per_backend)
                .into_iter()
                .map(|slot| {
                    context! {
                        slot => slot.slot,
                        name => format!("s{}", slot.slot),
                        endpoint => slot.endpoint,
                        enabled => slot.enabled,
                    }
                })
                .collect())
        },
    );
    env.add_filter(
        "server_lines",
        |state: &State, rows: Vec<Value>, kwargs: Kwargs| -> Result<Value> {
            // What is not given is what the config says (haproxy.server_slots, .health_checks).
            let haproxy = state.lookup("haproxy");
            let configured = |name: &str| {
                haproxy
                    .as_ref()
                    .and_then(|h| h.get_attr(name).ok())
                    .filter(|v| !v.is_undefined() && !v.is_none())
            };
            let slots: Option<usize> = kwargs.get("slots")?;
            let slots = match slots {
                Some(n) => Some(n),
                None => configured("server_slots")
                    .map(|v| usize::try_from(v).map_err(|e| invalid(e.to_string())))
                    .transpose()?,
            };
            let options: Option<String> = kwargs.get("options")?;
            let check: Option<Value> = kwargs
                .get::<Option<Value>>("check")?
                .or_else(|| configured("health_checks"));
            let cookie: Option<Value> = kwargs.get("cookie")?;
            kwargs.assert_all_used()?;
            let texts = endpoint_texts(&rows);
            let endpoints = endpoints_of(&texts);
            // The lines hold the template's own option text: not escaped (tera writes it so).
            Ok(Value::from_safe_string(haptic_render::slots::server_lines(
                &endpoints,
                slots.unwrap_or(haptic_render::slots::DEFAULT_SLOTS),
                options.as_deref().unwrap_or(""),
                check.is_none_or(|v| v.is_true()),
                cookie.is_some_and(|v| v.is_true()),
            )))
        },
    );
    // The pool of spare backends (haptic_render::pool), computed afresh on every call.
    env.add_function(
        "backend_pool",
        |state: &State, kwargs: Kwargs| -> Result<Value> {
            let rows: Vec<Value> = kwargs.get("rows")?;
            let step: Option<usize> = kwargs.get("step")?;
            let only: Option<Vec<String>> = kwargs.get("names")?;
            // `flat=false`: no `rows` in the answer (the renderer's memo then makes no flat list;
            // this peer makes it anyway, unread).
            let _flat: Option<bool> = kwargs.get("flat")?;
            // The reserve: `data.size` of the ConfigMap `reserve_at` in store `reserve_from`, or
            // `reserve` given; a number or the text of one, anything else none.
            let reserve_from: Option<String> = kwargs.get("reserve_from")?;
            // A text, or (minijinja's `default(value=...)` of an undefined value gives the
            // keyword arguments themselves) nothing.
            let reserve_at: Option<Value> = kwargs.get("reserve_at")?;
            let reserve_at = reserve_at.and_then(|v| v.as_str().map(str::to_owned));
            let mut reserve: Option<Value> = kwargs.get("reserve")?;
            kwargs.assert_all_used()?;
            if let (Some(store), Some(at)) = (reserve_from, reserve_at.filter(|at| !at.is_empty()))
            {
                let held = store_lookup(state, "__haptic_get", &store, &at)?;
                reserve = held
                    .get_attr("data")
                    .and_then(|data| data.get_attr("size"))
                    .ok()
                    .filter(|v| !v.is_undefined() && !v.is_none());
            }
            let reserve = reserve.and_then(|v| {
                v.as_usize()
                    .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            });
            let step = step.unwrap_or(haptic_render::pool::DEFAULT_STEP);
            let sizing = haptic_render::pool::Sizing { step, reserve };
            let field =
                |row: &Value, name: &str| row.get_attr(name).ok().filter(|v| !v.is_undefined());
            let plain = |row: &Value| {
                step > 0
                    && row.kind() == minijinja::value::ValueKind::Map
                    && !field(row, "policy").is_some_and(|v| v.is_true())
                    && !field(row, "app_protocol").is_some_and(|v| v.is_true())
            };
            let texts: Vec<(String, String)> = rows
                .iter()
                .filter(|row| plain(row))
                .map(|row| {
                    let get = |name| field(row, name).map(|v| text(&v)).unwrap_or_default();
                    (get("name"), get("created"))
                })
                .collect();
            let members: Vec<haptic_render::pool::Member<'_>> = texts
                .iter()
                .map(|(name, created)| haptic_render::pool::Member { name, created })
                .collect();
            let (size, slots) =
                haptic_render::pool::assign_sized(&members, sizing.size(members.len()));
            let mut out: Vec<Value> = rows.iter().filter(|row| !plain(row)).cloned().collect();
            let before = out.len();
            let mut pool: Vec<Option<Value>> = vec![None; size];
            let mut names = BTreeMap::new();
            let mut map = String::new();
            for ((row, (name, _)), slot) in
                rows.iter().filter(|row| plain(row)).zip(&texts).zip(&slots)
            {
                let pool_name = haptic_render::pool::backend_name(*slot);
                map.push_str(&format!("{name} {pool_name}\n"));
                if only.as_ref().is_none_or(|only| only.contains(name)) {
                    names.insert(name.clone(), Value::from(pool_name.clone()));
                }
                if let Some(place) = pool.get_mut(*slot).filter(|place| place.is_none()) {
                    let mut fields: BTreeMap<String, Value> = BTreeMap::new();
                    if let Ok(keys) = row.try_iter() {
                        for key in keys {
                            let value = row.get_item(&key)?;
                            fields.insert(text(&key), value);
                        }
                    }
                    fields.insert("service_backend".into(), Value::from(name.clone()));
                    fields.insert("name".into(), Value::from(pool_name));
                    *place = Some(Value::from(fields));
                }
            }
            for (index, place) in pool.into_iter().enumerate() {
                out.push(place.unwrap_or_else(|| {
                    context! {
                        name => haptic_render::pool::backend_name(index),
                        endpoints => Vec::<Value>::new(),
                        app_protocol => "",
                        namespace => "",
                        service => "",
                        port => 0,
                        port_name => "",
                        created => "",
                        origin => Vec::<Value>::new(),
                        policy => (),
                        service_backend => "",
                    }
                }));
            }
            // `rows` in runs of at most pool::GROUP, the rows before the pool apart.
            let (unpooled, pooled) = out.split_at(before);
            let group = |(k, run): (usize, &[Value]), part: &str| {
                context! { id => format!("{part}{k}"), rows => run.to_vec() }
            };
            let groups: Vec<Value> = unpooled
                .chunks(haptic_render::pool::GROUP)
                .enumerate()
                .map(|g| group(g, "b"))
                .chain(
                    pooled
                        .chunks(haptic_render::pool::GROUP)
                        .enumerate()
                        .map(|g| group(g, "p")),
                )
                .collect();
            Ok(context! {
                rows => out,
                groups => groups,
                names => names,
                map => map,
                size => size,
                used => texts.len(),
            })
        },
    );
    env.add_filter("backend_name", |parts: Vec<Value>| -> Result<String> {
        match parts.as_slice() {
            [namespace, service, port] => {
                Ok(backend_name(&text(namespace), &text(service), &text(port)))
            }
            _ => Err(invalid(format!(
                "backend_name: expected 3 values, got {}",
                parts.len()
            ))),
        }
    });
    env.add_filter("get", |state: &State, parts: Vec<Value>| -> Result<Value> {
        let [store, namespace, name] = parts.as_slice() else {
            return Err(invalid(format!(
                "get: expected 3 values, got {}",
                parts.len()
            )));
        };
        let key = format!("{}/{}", text(namespace), text(name));
        let found = store_lookup(state, "__haptic_get", &text(store), &key)?;
        Ok(if found.is_undefined() {
            Value::from(())
        } else {
            found
        })
    });
    env.add_filter(
        "lookup",
        |state: &State, parts: Vec<Value>| -> Result<Value> {
            let Some((store, key)) = parts.split_first() else {
                return Err(invalid("lookup: expected [store, key parts...]".into()));
            };
            let key = key.iter().map(text).collect::<Vec<_>>().join("/");
            let found = store_lookup(state, "__haptic_index", &text(store), &key)?;
            Ok(if found.is_undefined() {
                Value::from(Vec::<Value>::new())
            } else {
                found
            })
        },
    );
    // haptic-render's render_each, without its reuse or its provenance marks: the snippet once
    // per row, with `row` and `args` beside what the calling template sees.
    env.add_function(
        "render_each",
        |state: &State, kwargs: Kwargs| -> Result<String> {
            let rows: Value = kwargs.get("rows")?;
            let template: String = kwargs.get("template")?;
            let args: Option<Value> = kwargs.get("args")?;
            // Provenance marks (`from`): the peer keeps none.
            let _: Option<String> = kwargs.get("from")?;
            kwargs.assert_all_used()?;
            if rows.is_undefined() || rows.is_none() {
                return Ok(String::new());
            }
            let mut context: BTreeMap<String, Value> = state
                .known_variables()
                .iter()
                .filter_map(|name| state.lookup(name).map(|v| (name.to_string(), v)))
                .collect();
            context.insert("args".into(), args.unwrap_or_else(|| Value::from(())));
            let snippet = state.env().get_template(&template)?;
            let mut out = String::new();
            for row in rows.try_iter()? {
                context.insert("row".into(), row);
                out.push_str(&snippet.render(Value::from(context.clone()))?);
            }
            Ok(out)
        },
    );
    env.add_function("ssl_file", |kwargs: Kwargs| -> Result<String> {
        let namespace: String = kwargs.get("namespace")?;
        let name: String = kwargs.get("name")?;
        Ok(ssl_file(&namespace, &name))
    });
    env.add_function("fail", |kwargs: Kwargs| -> Result<bool> {
        let message: Value = kwargs.get("message")?;
        Err(invalid(format!("template failed: {}", text(&message))))
    });
    env.add_function("get", |state: &State, kwargs: Kwargs| -> Result<Value> {
        let store: String = kwargs.get("store")?;
        let namespace: Option<String> = kwargs.get("namespace")?;
        let name: String = kwargs.get("name")?;
        let key = format!("{}/{name}", namespace.unwrap_or_default());
        let found = store_lookup(state, "__haptic_get", &store, &key)?;
        Ok(if found.is_undefined() {
            Value::from(())
        } else {
            found
        })
    });
    env.add_function("lookup", |state: &State, kwargs: Kwargs| -> Result<Value> {
        let store: String = kwargs.get("store")?;
        let key: Value = kwargs.get("key")?;
        let key = match key.as_str() {
            Some(s) => s.to_owned(),
            None => key
                .try_iter()?
                .map(|part| text(&part))
                .collect::<Vec<_>>()
                .join("/"),
        };
        let found = store_lookup(state, "__haptic_index", &store, &key)?;
        Ok(if found.is_undefined() {
            Value::from(Vec::<Value>::new())
        } else {
            found
        })
    });
    // haptic-render's `derived_get`: an entry of a derived view (no reuse to track here).
    env.add_function(
        "derived_get",
        |state: &State, kwargs: Kwargs| -> Result<Value> {
            let view: String = kwargs.get("view")?;
            let key: String = kwargs.get("key")?;
            kwargs.assert_all_used()?;
            let found = state
                .lookup("derived")
                .and_then(|derived| derived.get_attr(&view).ok())
                .and_then(|entries| entries.get_item(&Value::from(key)).ok())
                .filter(|found| !found.is_undefined());
            Ok(found.unwrap_or_else(|| Value::from(())))
        },
    );
}

/// The `endpoint` and `ready` (ready unless it says false) of endpoint rows, as
/// haptic-render's slot filters read them.
fn endpoint_texts(rows: &[Value]) -> Vec<(String, bool)> {
    rows.iter()
        .filter_map(|row| {
            let endpoint = row.get_attr("endpoint").ok()?;
            let ready = row
                .get_attr("ready")
                .ok()
                .is_none_or(|r| r.is_undefined() || r.is_true());
            Some((endpoint.as_str()?.to_owned(), ready))
        })
        .collect()
}

/// [`endpoint_texts`] as the slot assignment takes them.
fn endpoints_of(texts: &[(String, bool)]) -> Vec<haptic_render::slots::Endpoint<'_>> {
    texts
        .iter()
        .map(|(endpoint, ready)| haptic_render::slots::Endpoint {
            endpoint,
            ready: *ready,
        })
        .collect()
}
